"""Where a grid cell's n tasks meet before they move anything (``_grid``).

::

    this machine: Starts on --server (a port of its own); the client opens a cell
                  (a key), submits its n tasks and waits at ``gather``
    each task:    connects, sends the key, waits; all n there -> "go" to each at once;
                  the window over first -> "stop" to those there and to any that come

Whether the n tasks ran at once is decided here, by counting who arrived, not by
comparing the client's clock with the workers' (they may be other machines, a
second apart, and a cold worker of a new size may take seconds to start): the
window is how long the slowest may take to start.
"""

from __future__ import annotations

import socket
import threading
import time

from nimbus.errors import ConfigError

__all__ = ["GO", "Starts", "meet", "wait_start"]

GO = b"go\n"
STOP = b"stop\n"


class Starts:
    """The meeting point, serving on ``host`` until ``close``."""

    def __init__(self, host: str) -> None:
        self._listener = socket.create_server((host, 0), backlog=256)
        self.address = (host, self._listener.getsockname()[1])
        self._cond = threading.Condition()
        self._waiting: dict[str, list[socket.socket]] = {}
        self._over: set[str] = set()  # cells whose window is over: late comers stop
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._arrive, args=(conn,), daemon=True).start()

    def _arrive(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        try:
            key = conn.makefile("rb").readline(200).strip().decode()
        except (OSError, UnicodeDecodeError):
            conn.close()
            return
        with self._cond:
            if key not in self._over:
                self._waiting.setdefault(key, []).append(conn)
                self._cond.notify_all()
                return
        _answer([conn], STOP)

    def gather(self, key: str, n: int, within: float) -> int:
        """Wait until ``n`` tasks of ``key`` have arrived (then all go at once) or
        ``within`` seconds have passed (then those there and any later stop); how many
        arrived."""
        deadline = time.monotonic() + within
        with self._cond:
            while len(self._waiting.get(key, [])) < n and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            came = self._waiting.pop(key, [])
            self._over.add(key)
        _answer(came, GO if len(came) >= n else STOP)
        return len(came)

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # (wakes accept on Linux)
        except OSError:
            pass
        self._listener.close()
        self._thread.join()
        with self._cond:
            left = [c for conns in self._waiting.values() for c in conns]
            self._waiting.clear()
        _answer(left, STOP)


def _answer(conns: list[socket.socket], word: bytes) -> None:
    for conn in conns:
        try:
            conn.sendall(word)
        except OSError:
            pass  # that task is gone; the others are answered
        finally:
            conn.close()


def wait_start(conn: socket.socket, key: str, patience: float) -> bool:
    """In a task, on ``conn`` to the meeting point: arrive for cell ``key`` and wait
    (``patience`` seconds at most); True when all its cell's tasks are there, False
    when told to stop."""
    with conn:
        conn.sendall(key.encode() + b"\n")
        conn.settimeout(patience)
        return conn.makefile("rb").readline(10) == GO


def meet(starts: tuple[str, int], key: str, patience: float, option: str, run: str) -> bool:
    """In a task of netbench ``option``: ``wait_start`` at the meeting point ``starts``
    of its ``run`` (the sweep, the grid); a ConfigError where the task cannot reach it."""
    try:
        conn = socket.create_connection(starts, timeout=30)
    except OSError as exc:
        raise ConfigError(
            f"netbench {option}: a task on {socket.gethostname()} cannot reach the {run}'s "
            f"meeting point {starts[0]}:{starts[1]} on this machine ({exc}); let the "
            f"endpoint's nodes connect to every port of --server {starts[0]}"
        ) from None
    return wait_start(conn, key, patience)
