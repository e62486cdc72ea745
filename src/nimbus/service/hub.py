"""The service's in-process routing: who is connected and who waits for what.

Redis holds every task (``queues.TaskStore``); the hub only knows which agent
connection serves which endpoint, which client connection asked for which
task's result, and wakes dispatchers when their endpoint's queue grows. It is
rebuilt from the connections after a restart (agents reconnect, clients send
``watch``).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence

from nimbus.protocol import REVOKED, Malformed, ResultRow, Results

__all__ = ["ADMIN_REVOKED", "Hub", "Peer"]

ADMIN_REVOKED = "token revoked by the service admin"  # the client says what to do
REASON_BYTES = 120  # a WebSocket close reason holds at most 123 bytes
GONE_KEPT = 100_000  # revoked digests remembered for agents still saying hello


class Peer:
    """One WebSocket connection; ``send`` is serialised (one frame at a time).

    ``digest`` is the hash of the token it connected with; ``close(code, reason)``
    ends it from the service's side (its token was revoked or replaced, its
    endpoint deleted).
    """

    def __init__(
        self,
        conn_id: str,
        send: Callable[[bytes], Awaitable[None]],
        *,
        digest: str = "",
        close: Callable[[int, str], Awaitable[None]] | None = None,
    ) -> None:
        self.conn_id = conn_id
        self.digest = digest
        self._send = send
        self._close = close
        self._lock = asyncio.Lock()
        self.closed = False

    async def close(self, code: int, reason: str) -> None:
        self.closed = True
        if self._close is not None:
            try:
                await self._close(code, reason)
            except Exception:
                pass  # already gone

    async def send(self, data: bytes) -> None:
        if self.closed:
            return
        async with self._lock:
            try:
                await self._send(data)
            except Exception:
                self.closed = True  # the receive side sees the disconnect and cleans up


class Hub:
    def __init__(self) -> None:
        self.agents: dict[str, Peer] = {}  # conn id -> agent peer
        self.endpoint_agents: dict[str, set[str]] = defaultdict(set)
        self.watchers: dict[str, Peer] = {}  # task id -> client peer
        self.waiters: dict[str, list[asyncio.Future[None]]] = defaultdict(list)
        self.beats: dict[str, float] = {}  # endpoint id -> time of its last heartbeat
        self._wakeups: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.peers: dict[str, Peer] = {}  # conn id -> every connection (agents and clients)
        self.closing = False
        # revoked token digests -> close code and reason: for an agent that was still
        # saying hello (not yet added) when its token went
        self._gone: dict[str, tuple[int, str]] = {}
        self._closers: set[asyncio.Future[None]] = set()

    async def revoked(self, digests: set[str], code: int = REVOKED, reason: str = "") -> int:
        """Close the connections made with these (revoked) tokens, saying why; how many.

        A connection already closed (for another reason said first) is left alone.
        """
        text = (reason or ADMIN_REVOKED).encode()[:REASON_BYTES].decode(errors="ignore")
        if len(self._gone) > GONE_KEPT:
            self._gone.clear()
        for digest in digests:  # the first reason given is the one said
            self._gone.setdefault(digest, (code, text))
        kicked = [
            peer for peer in list(self.peers.values()) if peer.digest in digests and not peer.closed
        ]
        for peer in kicked:
            await peer.close(code, text)
        return len(kicked)

    def close(self) -> None:
        """The service stops: every long-poll answers now with what it has."""
        self.closing = True
        self.wake_all()

    def wake_all(self) -> None:
        """Every long-poll answers now with what it has (its client asks again)."""
        for waiting in self.waiters.values():
            for future in waiting:
                if not future.done():
                    future.set_result(None)

    def ended(self, task_ids: list[str]) -> list[str]:
        """Tasks ended (said by another service process, ``wakeups``): their long-polls
        answer now; returns those of them a client connection here watches (whose
        results are to be read and delivered)."""
        waiters, watchers = self.waiters, self.watchers
        watched = []
        for task_id in task_ids:
            if task_id in waiters:
                for future in waiters.pop(task_id):
                    if not future.done():
                        future.set_result(None)
            if task_id in watchers:
                watched.append(task_id)
        return watched

    def wakeup(self, endpoint_id: str) -> asyncio.Event:
        return self._wakeups[endpoint_id]

    def work_arrived(self, endpoint_id: str) -> None:
        self._wakeups[endpoint_id].set()

    def online(self, endpoint_id: str) -> int:
        return len(self.endpoint_agents.get(endpoint_id, ()))

    def add_agent(self, endpoint_id: str, peer: Peer) -> None:
        """An agent said hello; one whose token was revoked meanwhile is closed now."""
        self.agents[peer.conn_id] = peer
        self.endpoint_agents[endpoint_id].add(peer.conn_id)
        self.peers[peer.conn_id] = peer
        gone = self._gone.get(peer.digest)
        if gone is not None:
            peer.closed = True  # nothing more is sent to it
            closing = asyncio.ensure_future(peer.close(*gone))
            self._closers.add(closing)
            closing.add_done_callback(self._closers.discard)

    def drop_agent(self, endpoint_id: str, peer: Peer) -> None:
        self.agents.pop(peer.conn_id, None)
        self.endpoint_agents[endpoint_id].discard(peer.conn_id)
        self.peers.pop(peer.conn_id, None)

    def watch(self, task_ids: list[str], peer: Peer) -> None:
        for task_id in task_ids:
            self.watchers[task_id] = peer

    def unwatch_peer(self, peer: Peer) -> None:
        """A client's connection ended: forget it and what it waited for."""
        self.peers.pop(peer.conn_id, None)
        for task_id in [t for t, p in self.watchers.items() if p is peer]:
            del self.watchers[task_id]

    async def wait_done(
        self, task_id: str, timeout: float, done: Callable[[], Awaitable[bool]]
    ) -> None:
        """Wait until ``task_id`` finishes (``done()`` is asked once the wait is registered):
        woken by ``deliver`` when it ends here, by ``ended`` when on another process."""
        if self.closing:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters[task_id].append(future)
        try:
            if not await done():
                await asyncio.wait_for(future, timeout)
        except TimeoutError:
            pass
        finally:
            waiting = self.waiters.get(task_id)
            if waiting is not None and future in waiting:
                waiting.remove(future)
                if not waiting:
                    del self.waiters[task_id]

    async def deliver(self, rows: Sequence[ResultRow]) -> None:
        """Send finished tasks' result rows to whoever waits."""
        by_peer: dict[Peer, list[ResultRow | Malformed]] = defaultdict(list)
        for row in rows:
            task_id = row.task_id
            peer = self.watchers.pop(task_id, None)
            if peer is not None:
                by_peer[peer].append(row)
            for future in self.waiters.pop(task_id, ()):
                if not future.done():
                    future.set_result(None)
        for peer, mine in by_peer.items():
            await peer.send(Results(mine).encode())
