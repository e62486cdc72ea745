"""Frame kinds and row layouts between a manager and its workers.

Manager -> worker::

    TASKS   meta [python "3.11", [row, ...]]  row = [seq, fn_key, fn_bytes | None,
            payload | None, nbufs, notify_start]; a row whose payload is None has
            it as the first of its nbufs frame buffers.
    CANCEL  meta [seq, ...]: skip these queued tasks (answered with SKIPPED)
    RECALL  meta [seq, ...]: give back those of these tasks not started yet (work
            stealing: another worker is idle); answered with one HANDBACK, even
            while a task runs

Worker -> manager::

    HELLO   meta {"pid", "python", "host"}
    RESULTS meta [[[seq, status, payload | None, nbufs, started, ended, cpu_user,
            cpu_system, peak_memory, net_in, net_out], ...], started_seq | None],
            payload as in TASKS; started_seq: the task the worker starts now
            (sent before a task with notify_start, or one that may take long)
    NOTICE  meta: any msgpack value a task (or a thread it started) sent with
            ``nimbus.runtime.worker.notify``; handed to the manager's ``on_notice``
    HANDBACK meta [seq, ...]: the recalled tasks this worker dropped unstarted (they
            get no result from it); the others of the RECALL ran or are running

Results come back in the order the tasks were sent, less the tasks handed
back. A worker holds some results back in a batch, so the oldest unanswered
task is the running one only when the worker has said so with ``started_seq``.
"""

from __future__ import annotations

import enum

from nimbus.serialization import PYTHON

__all__ = ["PYTHON", "Kind", "Link", "Status"]

# a worker's notice: its task's program needs its store, which the executor's own
# process starts (its embedded Redis, deferred; one a worker started would die with the
# worker's cgroup). [START_STORE, url]
START_STORE = "nimbus:start-store"
INLINE_LIMIT = 64 * 1024  # larger payloads travel as frame buffers


class Kind(enum.IntEnum):
    TASKS = 1
    CANCEL = 2
    RECALL = 3
    HELLO = 10
    RESULTS = 12
    NOTICE = 13
    HANDBACK = 14


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1  # payload is a pickled (exception, traceback text)
    SKIPPED = 2  # cancelled before it started


class Link(enum.IntEnum):
    """Frames between an agent and a manager on another node (over TCP).

    Agent -> manager: CHALLENGE {"nonce"}; WELCOME {"proof", "heartbeat"} (the agent
    proves it holds the secret too); TASKS [[wid, fn_key, fn_bytes | None, payload |
    None, nbufs, timeout, environment | None], ...] (payloads as in Kind.TASKS;
    environment: ``Environment.to_dict()``, None for the node's own Python); CANCEL [wid, ...]; DRAIN
    (take no more, say what you hold); STOP (finish and exit); ORDER {"ref", "action",
    "name", "environment"} (build or remove an environment on the node: only to a
    manager whose JOIN has "can": ["orders"]).

    Manager -> agent: JOIN {"proof", "nonce", "workers", "host", "pid", "block",
    "python"}; RESULTS [[wid, status, data | None, nbufs, started, ended, cpu_user,
    cpu_system, peak_memory, net_in, net_out, worker, host, pid, build_seconds], ...]; HEARTBEAT
    {"held", "ready", "window", "slots", "unused", "environments", "run", "start"} (window: the node's
    tasks per worker, grown for short tasks; slots: worker slots per environment tag,
    unused: slots of none, environments: per tag its slots, ready and free workers;
    run, start: average seconds of a task's run and of a worker's start, or None; every
    fifth beat also "cache": the node's ``Cache.report()`` rows; "orders": the outcome
    of its recent ORDERs, ``{ref: {state, message, seconds}}``); DRAINED {"held": n};
    NOTICE (a worker's notice, as in Kind.NOTICE).
    """

    CHALLENGE = 30
    WELCOME = 31
    TASKS = 32
    CANCEL = 33
    DRAIN = 34
    STOP = 35
    ORDER = 36
    JOIN = 40
    RESULTS = 41
    HEARTBEAT = 42
    DRAINED = 43
    NOTICE = 44
