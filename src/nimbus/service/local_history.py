"""A local Executor's finished tasks in this machine's history, for ``nimbus dashboard``.

::

    Executor (local backend)  _on_results: deque.append(record)        (the runtime's thread)
    LocalHistory thread       every FLUSH_EVERY s: the records so far, packed in one
                              msgpack file, renamed into <service dir>/local-history/
    the service (nimbus dashboard, nimbus service start) every INGEST_EVERY s:
                              ingest(): each file claimed (renamed), its rows written to
                              the SQL history (History.write, idempotent), then removed

The program pays a deque append a task and, once a second on a thread, the
packing of its records (a few microseconds each): the SQL insert and its indexes
are the service's work, not the program's. It is on while a service runs on this
runtime directory (``nimbus dashboard`` or ``nimbus service start``: its state file
names a live process, looked at again every ``LOOK_EVERY`` s), off otherwise: a
program never creates a service's files by running tasks, nor leaves files that
nobody reads. Files beyond ``KEEP_BYTES`` (a service that could not keep up, or
stopped while programs still wrote) are dropped, oldest first, at ingest. Rows carry the owner
``local:<user>`` and the endpoint ``local``: the dashboard's admin
(``nimbus dashboard``'s user) sees them on the tasks and task pages.

Once rows are written, :func:`ingest_and_tell` publishes their owners on the
task store's channel (``TaskStore.changes``), as the task store's scripts do
for the tasks they move: an admin's open tasks page (``/tasks/stream``) sees
that a ``local:`` owner changed and reads the history's newest rows, so a
local task shows without a reload.

The program's side (``LocalHistory``, the files) is ``nimbus.local_history``.

Two service processes never ingest one file twice at once: a file is claimed by
renaming it (one rename wins); a claimed file left by a process that died is
taken again after ``STALE`` seconds (its rows written twice are kept once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack

from nimbus.config import Settings
from nimbus.local_history import ENDPOINT, KEEP_BYTES, OWNER_PREFIX, directory
from nimbus.records import TaskRecord

if TYPE_CHECKING:
    from nimbus.service.history import History
    from nimbus.service.queues import TaskStore

__all__ = ["INGEST_EVERY", "KEEP_BYTES", "STALE", "ingest", "ingest_and_tell"]

INGEST_EVERY = 1.0  # seconds between a service's reads of them
STALE = 60.0  # seconds after which a claimed file not removed is taken again
log = logging.getLogger(__name__)


async def ingest_and_tell(settings: Settings, history: History, store: TaskStore) -> int:
    """:func:`ingest` (in a thread), then the owners of the rows written published on
    the task store's channel, for the open pages; the rows."""
    owners: set[str] = set()
    total = await asyncio.to_thread(ingest, settings, history, owners)
    if owners:
        await store.redis.publish(store.changes, " ".join(sorted(owners)))
    return total


def ingest(settings: Settings, history: History, owners: set[str] | None = None) -> int:
    """Write the files programs left to the SQL history, and remove them; the rows
    (their owners added to ``owners``)."""
    folder = directory(settings)
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return 0
    names = _within_bound(folder, names)
    total = 0
    for name in names:
        path = folder / name
        if name.startswith("."):
            continue
        if ".taken-" in name:  # claimed by a service process: taken again once stale
            try:
                if time.time() - path.stat().st_mtime < STALE:
                    continue
            except FileNotFoundError:
                continue
        claimed = folder / f"{name.split('.taken-')[0]}.taken-{secrets.token_hex(4)}"
        try:
            path.rename(claimed)
            os.utime(claimed)
            owner, wire = msgpack.unpackb(claimed.read_bytes())
        except FileNotFoundError:  # another process claimed it first
            continue
        except (ValueError, msgpack.UnpackException) as exc:
            log.warning("%s is not a local history file (%s): removed", name, exc)
            claimed.unlink(missing_ok=True)
            continue
        if not isinstance(owner, str) or not owner.startswith(OWNER_PREFIX):
            log.warning("%s names the owner %r, not a local one: removed", name, owner)
            claimed.unlink(missing_ok=True)  # a file never gives a service user's tasks
            continue
        rows = []
        for fields in wire:
            try:
                r = TaskRecord.from_wire(fields)
            except Exception:  # written by another version: not shown
                continue
            rows.append(
                (r.task_id, owner, ENDPOINT, r.function, "", r.state.value, r.submitted,
                 r.dispatched, r.ended, None, b"", msgpack.packb(fields))
            )  # fmt: skip
        total += history.write(rows)
        if rows and owners is not None:
            owners.add(str(owner))
        claimed.unlink(missing_ok=True)
    return total


def _within_bound(folder: Path, names: list[str]) -> list[str]:
    """``names`` (oldest first) without the oldest files beyond ``KEEP_BYTES``, which
    are removed (said once in the log): history the dashboard will not show."""
    sizes = []
    for name in names:
        try:
            claimed = name.startswith(".") or ".taken-" in name  # (being written or read)
            sizes.append(0 if claimed else (folder / name).stat().st_size)
        except OSError:
            sizes.append(0)
    over = sum(sizes) - KEEP_BYTES
    if over <= 0:
        return names
    dropped = freed = 0
    for i, name in enumerate(names):
        if freed >= over:
            break
        if sizes[i]:
            (folder / name).unlink(missing_ok=True)
            names[i] = ""
            dropped, freed = dropped + 1, freed + sizes[i]
    log.warning(
        "%d local history files (%d bytes, the oldest) dropped unread: %s held more than "
        "%d bytes (local programs wrote faster than the service took them in)",
        dropped, freed, folder, KEEP_BYTES,
    )  # fmt: skip
    return [name for name in names if name]
