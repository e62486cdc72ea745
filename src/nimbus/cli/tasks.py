"""``nimbus tasks``: ``list`` and ``show`` (``nimbus.cli.service``) and ``watch``.

``nimbus tasks watch [TASK_ID ...]`` follows tasks on the service live: one
line each time a task appears or changes state::

    17:40:02  3f2a...  square           waiting-for-endpoint
    17:40:02  3f2a...  square           waiting-for-endpoint -> running
    17:40:03  3f2a...  square           running -> success  0.412 s

Without ids it follows your newest tasks (``--limit``, ``--status``,
``--endpoint``) until interrupted; with ids, or ``--until-done``, it stops when
every task followed has finished, with exit status 1 if one failed or was
cancelled. The service is asked every ``--interval`` seconds (one request for
the list, or one per task id): a terminal, unlike an open dashboard page, has
no event stream to hold.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from nimbus.cli import service as service_cli
from nimbus.cli._numbers import number
from nimbus.cli._usage import UsageError
from nimbus.records import TaskState

__all__ = ["run", "setup", "watch"]

FINISHED = {state.value for state in TaskState if state.done}
BAD_END = {TaskState.FAILED.value, TaskState.CANCELLED.value}


_interval = number(float, 0.1, 60, "seconds")
_timeout = number(float, 0.0, None, "a number of seconds", above=True)


def setup(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    service_cli.task_actions(sub)
    watch_ = sub.add_parser(
        "watch",
        help="follow tasks live: a line each time one appears or changes state",
        description="Follow tasks live, a line each time one appears or changes state, until "
        "they finish (ids, --until-done), --timeout passes or Ctrl-C.",
    )
    watch_.add_argument("task_ids", nargs="*", metavar="TASK_ID", type=service_cli._task_id,
                        help="tasks to follow until they finish (default: your newest tasks)")  # fmt: skip
    watch_.add_argument("--status", choices=[s.value for s in TaskState] + ["waiting"],
                        help="only tasks in this state (of your newest)")  # fmt: skip
    watch_.add_argument("--endpoint", metavar="NAME", help="only tasks sent to this endpoint")
    watch_.add_argument("--limit", type=service_cli._limit, default=None, metavar="N",
                        help="without ids: follow your newest N tasks, as `tasks list --limit` "
                        f"shows them (default {service_cli.DEFAULT_LIMIT})")  # fmt: skip
    watch_.add_argument("--interval", type=_interval, default=1.0, metavar="SECONDS",
                        help="seconds between looks at the service (0.1-60, default 1)")  # fmt: skip
    watch_.add_argument("--until-done", action="store_true",
                        help="stop once every task followed has finished")  # fmt: skip
    watch_.add_argument("--timeout", type=_timeout, metavar="SECONDS",
                        help="stop after this long: exit status 3 if a task followed has not "
                        "finished, 0 if none is left to watch")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.action != "watch":
        return service_cli.tasks_run(args)
    if args.task_ids and (args.status or args.endpoint or args.limit is not None):
        raise UsageError(
            "nimbus tasks watch",
            "give task ids, or --status/--endpoint/--limit to choose among your newest tasks, "
            "not both",
        )
    from nimbus.client import Client

    with Client() as client:
        return watch(client, args)


def _line(task: dict[str, Any], names: dict[str, str], before: str | None) -> str:
    name = names.get(task["function_id"]) or task["function_id"][:8]
    change = task["state"] if before is None else f"{before} -> {task['state']}"
    record = task.get("record") or {}
    if task["state"] in FINISHED and record.get("started") and record.get("ended"):
        change += f"  {record['ended'] - record['started']:.3f} s"
    stamp = time.strftime("%H:%M:%S")
    return f"{stamp}  {task['task_id']}  {name[:24]:<24} {change}"


def watch(client: Any, args: argparse.Namespace) -> int:
    """Print state changes of the tasks ``args`` names until they finish, time runs out or
    the user interrupts; the exit status."""
    endpoint_id = client.get_endpoint(args.endpoint)["endpoint_id"] if args.endpoint else None
    status = TaskState.WAITING.value if args.status == "waiting" else args.status
    names = service_cli._function_names(client)
    task_ids = list(dict.fromkeys(args.task_ids or ()))  # an id given twice is one task
    limit = service_cli.DEFAULT_LIMIT if args.limit is None else args.limit
    until_done = args.until_done or bool(task_ids)
    end = None if args.timeout is None else time.monotonic() + args.timeout
    seen: dict[str, str] = {}
    while True:
        if task_ids:
            tasks = [client.get_task(task_id) for task_id in task_ids]
        else:
            tasks = client.list_tasks(status, endpoint=endpoint_id, limit=limit)
            tasks.reverse()  # oldest first, as they happened
        for task in tasks:
            before = seen.get(task["task_id"])
            if before != task["state"]:
                if task["function_id"] not in names:
                    names = service_cli._function_names(client)
                print(_line(task, names, before), flush=True)
                seen[task["task_id"]] = task["state"]
        if until_done and tasks and all(t["state"] in FINISHED for t in tasks):
            done = [t["state"] for t in tasks]
            summary = ", ".join(f"{done.count(s)} {s}" for s in sorted(set(done)))
            print(f"all {len(tasks)} finished: {summary}", flush=True)
            return 1 if BAD_END & set(done) else 0
        if end is not None and time.monotonic() >= end:
            left = sum(1 for t in tasks if t["state"] not in FINISHED)
            if not left:
                print(
                    f"--timeout {args.timeout:g} s passed: nothing left to watch "
                    f"({len(tasks)} tasks followed, none unfinished)",
                    flush=True,
                )
                return 0
            print(
                f"nimbus tasks watch: --timeout {args.timeout:g} s passed with {left} tasks "
                "not finished",
                file=sys.stderr,
            )
            return 3
        time.sleep(
            args.interval if end is None else max(0.0, min(args.interval, end - time.monotonic()))
        )
