"""A file descriptor for a nimbus Connection's reading end: ``select``/``poll`` on it work.

::

    the end's list / direct lane --pump thread (one message ahead)--> slot --recv()--> program
                                                 |
                                         ring: one byte into an os.pipe()
    select.poll / selectors / stdlib wait <--- its read end: readable <=> slot full (or EOF)

A nimbus Connection has no descriptor of its own: its messages are in the
state store or come over nimbus's messaging sockets. Libraries that wait on
``conn.fileno()`` themselves (pebble's ``ProcessPool`` registers it with
``select.poll``) get, the first time they ask, the read end of a private
pipe. From then on one thread of this process, the *pump*, is the end's only
reader: it takes the next message into a slot of one and makes the pipe
readable, so the descriptor is readable exactly while a message (or
end-of-stream) is in hand, as an OS pipe's is; ``recv`` takes the slot and
drains the pipe, and the pump fetches the next. The end holds at most one
message ahead; when it closes, or its process exits, that message goes back
to the head of the list for its other readers.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Pump"]

SLICE = 0.1  # seconds the pump waits at once: how soon it sees that the end closed

_EMPTY = object()


class _EndOfStream:
    """What the slot holds for good once the stream ended (or the reader failed)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Pump:
    """The reading thread, slot and descriptor of one Connection end in this process.

    ``fill(timeout)`` waits up to ``timeout`` for the end to have a message in
    hand and ``take()`` takes it (``EOFError`` at end of stream); both run only
    in the pump's thread. They are bound to the connection through a weak
    reference, so that a connection left open is still collected.
    """

    def __init__(self, owner: Any, fill: Callable[[Any, float], bool], take: Callable[[Any], Any]):
        self._cond = threading.Condition()
        self._item: Any = _EMPTY
        self._stopped = False
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self.thread = threading.Thread(
            target=self._run,
            args=(weakref.ref(owner), fill, take),
            name="nimbus-connection-pump",
            daemon=True,
        )
        self.thread.start()

    def _run(
        self, ref: weakref.ref[Any], fill: Callable[..., bool], take: Callable[..., Any]
    ) -> None:
        while True:
            with self._cond:
                while self._item is not _EMPTY and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
            owner = ref()
            if owner is None:
                return
            try:
                if not fill(owner, SLICE):
                    continue
                item = take(owner)
            except BaseException as exc:  # EOFError, or the store failed: said at recv
                item = _EndOfStream(exc)
            finally:
                del owner
            with self._cond:
                self._item = item
                os.write(self._write_fd, b"x")
                self._cond.notify_all()
            if isinstance(item, _EndOfStream):
                return

    def ready(self) -> bool:
        """Whether a message (or end-of-stream) is in hand."""
        return self._item is not _EMPTY

    def wait(self, timeout: float | None) -> bool:
        """Whether one is in hand within ``timeout`` seconds (None: waits for it)."""
        with self._cond:
            return self._cond.wait_for(self.ready, timeout)

    def take(self) -> Any:
        """The message in hand, waiting for it; ``EOFError`` (again) at end of stream."""
        with self._cond:
            self._cond.wait_for(self.ready)
            item = self._item
            if isinstance(item, _EndOfStream):
                raise item.error
            self._item = _EMPTY
            os.read(self.read_fd, 1)
            self._cond.notify_all()
        return item

    def stop(self) -> Any:
        """Stop the thread and close the descriptor; the message in hand, if any (or None)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join()
        item, self._item = self._item, _EMPTY
        for fd in (self.read_fd, self._write_fd):
            os.close(fd)
        return None if item is _EMPTY or isinstance(item, _EndOfStream) else item

    def forget(self) -> None:
        """In a forked child: the thread and the message are the parent's; close the copies."""
        for fd in (self.read_fd, self._write_fd):
            os.close(fd)
