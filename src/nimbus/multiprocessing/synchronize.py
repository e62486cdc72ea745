"""Locks, semaphores, conditions, events and barriers in the state store.

The stdlib's ``multiprocessing.synchronize`` with its semantics, for processes
that share no memory or file descriptors: every object is a few Redis keys of
its program (see ``nimbus.statestore.keys``) and pickles as (program, name), so it works
in any process that unpickles it::

    Semaphore   semaphore:<n>          a list of tokens: acquire = BLPOP, release = RPUSH
    Lock/RLock  lock:<n>               a list holding the lock's one token while it is free
                lock:<n>:held:<owner>  the token while <owner> (a thread) holds the lock
                lock:<n>:owners        who may hold it: each owner registers before acquiring
    Event       event:<n>              the flag
    Condition   waiters:<n>            the wake-up lists of the waiting threads
    (any wait)  waiter:<unique>        one thread's wake-up list: BLPOP on it
    Barrier     barrier:<n>            state and count; threading.Barrier on a Condition

Blocked waiters are served first come, first served by Redis; nothing polls.
Each thread talks to the store on its own connection, one round trip per
operation (Lua scripts where several keys change at once, commands packed once
per lock and thread). A Lock's token only ever moves, with ``LMOVE``/``BLMOVE``
(no Lua on the common path): acquiring moves it from the lock's list to the
holder's, releasing moves it back, so there is never more than one token and
the store always knows who holds it. An RLock's depth is counted by its holder
thread, which alone may release it. A release by the holder is sent without
waiting for its reply (read before the link's next reply), so an uncontended
``Lock`` acquire + release costs one round trip and a send. If another process
released that Lock meanwhile (a Lock may be released by anyone: the store moves
the holder's token back), the holder's own release finds nothing to move, and
the ``ValueError`` the stdlib raises there is raised by the holder's next
acquire of the lock. Keys are created with the program's TTL; those of
finished waits are deleted.

In a program whose processes all run on this host (its Values and Arrays are
in shared memory), ``Lock()`` is a ``_mutex.HostLock`` instead: a semaphore in
shared memory with the same semantics, about a microsecond per acquire +
release, moved to these keys before a process on another host gets it.

Owners are (hostname, pid, thread id) plus the Redis client id of a
connection each process keeps open for its lifetime (its *presence*).

**A Lock or RLock holder that dies is released.** A waiter that has waited
``_REAP_STEP`` seconds asks Redis which owners' presence connections are
gone (``CLIENT LIST ID``; the kernel closes them when a process dies, even by
SIGKILL, and Redis never reuses a client id) and gives their tokens back, so
a waiter gets a SIGKILLed holder's lock within about half a second (the
dead owners' tokens move back). The same
applies to a holder that exits without releasing. A live but hung holder keeps
its lock, as in the stdlib. Caveats: an external Redis must not close idle
clients (``timeout 0``, its default) and must allow ``CLIENT LIST``;
otherwise a dead holder's lock stays held. Semaphores carry no owners (any
process may release them), so nothing is given back for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from nimbus.errors import StateStoreError
from nimbus.multiprocessing import _site as _state
from nimbus.statestore import MIN_WAIT, SKIP_REPLY, Keys, Link, Program, pack
from nimbus.statestore import link as _link
from nimbus.statestore.lua import (
    CONDITION_NOTIFY as _NOTIFY,
)
from nimbus.statestore.lua import (
    CONDITION_UNWAIT as _UNWAIT,
)
from nimbus.statestore.lua import (
    EVENT_WAIT as _EVENT_WAIT,
)
from nimbus.statestore.lua import (
    LOCK_REAP as _LOCK_REAP,
)
from nimbus.statestore.lua import (
    LOCK_RELEASE_ANY as _LOCK_RELEASE_ANY,
)
from nimbus.statestore.lua import (
    SEM_RELEASE as _SEM_RELEASE,
)

__all__ = ["Barrier", "BoundedSemaphore", "Condition", "Event", "Lock", "RLock", "Semaphore"]

_REAP_STEP = 0.5  # seconds a Lock waiter blocks between checks for dead holders
_T = TypeVar("_T")


class _NotOwnedError(AssertionError, RuntimeError):
    """Raised where multiprocessing asserts (AssertionError) and threading raises RuntimeError."""


# ---------------------------------------------------------------- scripts


def _ttl(program: Program) -> int:
    return program.ttl_ms


# ---------------------------------------------------------------- the objects


class _Shared:
    """A named object of one program; pickles as (program, name, _extra)."""

    _program: Program
    _name: str

    def __init__(self, program: Program | None) -> None:
        self._setup(program if program is not None else _state.shared_program(), Keys.new_name())

    def _setup(self, program: Program, name: str) -> None:
        self._program = program
        self._name = name

    def __reduce__(self) -> tuple[Any, ...]:
        # not __newobj__: Lock.__new__ may hand out a lock in shared memory
        return (_restore, (type(self), self.__getstate__()))

    def __getstate__(self) -> tuple[Program, str, Any]:
        return (self._program, self._name, self._extra())

    def __setstate__(self, state: tuple[Program, str, Any]) -> None:
        self._restore(state[2])
        self._setup(state[0], state[1])

    def _extra(self) -> Any:
        return None

    def _restore(self, extra: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name} of program {self._program.program_id}>"


def _restore(cls: type[_Shared], state: tuple[Program, str, Any]) -> _Shared:
    obj = object.__new__(cls)
    obj.__setstate__(state)
    return obj


class _Acquirable:
    """``with`` for anything with ``acquire`` and ``release``: a lock or semaphore."""

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Semaphore(_Shared, _Acquirable):
    """A counting semaphore; ``release`` never fails."""

    _bounded = False

    def __init__(
        self, value: int = 1, *, ctx: object = None, program: Program | None = None
    ) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self._max = value if self._bounded else -1
        super().__init__(program)
        if value:
            _link(self._program).call(
                ("RPUSH", self._tokens, *["t"] * value),
                ("PEXPIRE", self._tokens, _ttl(self._program)),
            )

    def _setup(self, program: Program, name: str) -> None:
        super()._setup(program, name)
        self._tokens = program.keys.semaphore(name)

    def _extra(self) -> Any:
        return self._max

    def _restore(self, extra: Any) -> None:
        self._max = extra

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return _link(self._program).blpop(self._tokens, timeout if block else 0)

    def release(self) -> None:
        link = _link(self._program)
        if link.eval(_SEM_RELEASE, (self._tokens,), (self._max, _ttl(self._program))) < 0:
            raise ValueError("semaphore or lock released too many times")

    def get_value(self) -> int:
        return int(_link(self._program).command("LLEN", self._tokens))


class BoundedSemaphore(Semaphore):
    """A semaphore whose ``release`` beyond its initial value raises ``ValueError``."""

    _bounded = True


class Lock(_Shared, _Acquirable):
    """A mutex any process may release; released for you if its holder dies.

    In a program whose processes all run on this host (its Values and Arrays
    are in shared memory), ``Lock()`` makes a ``_mutex.HostLock``: the same
    semantics without a round trip to the store.
    """

    _recursive = False

    def __new__(cls, *, ctx: object = None, program: Program | None = None) -> Lock:
        if cls is Lock:
            from nimbus.multiprocessing import _mutex

            prog = program if program is not None else _state.program()
            if prog.shared is not None and not prog.remote and _mutex.available():
                return _mutex.HostLock.new(prog)
        return super().__new__(cls)

    def __init__(self, *, ctx: object = None, program: Program | None = None) -> None:
        super().__init__(program)
        self._create(_link(self._program), held=False)

    def _create(self, link: Link, *, held: bool) -> None:
        """Make the lock's keys: free, or held by this thread (a lock moving to the store)."""
        ttl = _ttl(self._program)
        if not held:
            link.call(("RPUSH", self._tokens, "t"), ("PEXPIRE", self._tokens, ttl))
            return
        mine = self._held + link.owner
        link.call(
            ("SADD", self._owners, link.owner),
            ("PEXPIRE", self._owners, ttl),
            ("RPUSH", mine, "t"),
            ("PEXPIRE", mine, ttl),
        )
        link.registered[self._owners] = time.monotonic() + ttl / 4000
        link.held[self._owners] = 1

    def _setup(self, program: Program, name: str) -> None:
        super()._setup(program, name)
        self._tokens = program.keys.lock(name)
        self._owners = program.keys.lock_owners(name)
        self._held = program.keys.lock_held(name, "")

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return self._acquire(_link(self._program), block, timeout, 1)

    def _acquire(self, link: Link, block: bool, timeout: float | None, depth: int) -> bool:
        owners = self._owners
        held = link.held.get(owners, 0)
        if held and self._recursive:
            link.held[owners] = held + depth
            return True
        now = time.monotonic()
        if link.registered.get(owners, 0.0) <= now:  # before any token can be ours
            ttl = _ttl(self._program)
            link.write(
                SKIP_REPLY
                + pack("SADD", owners, link.owner)
                + SKIP_REPLY
                + pack("PEXPIRE", owners, ttl)
            )
            link.registered[owners] = now + ttl / 4000
        packed = link.packed.get(("acquire", owners))
        if packed is None:
            mine = self._held + link.owner
            packed = pack("LMOVE", self._tokens, mine, "LEFT", "LEFT")
            packed += SKIP_REPLY + pack("PEXPIRE", mine, _ttl(self._program))
            link.packed["acquire", owners] = packed
        got = link.request(packed) is not None
        if owners in link.late:
            link.late.discard(owners)
            if got:
                self._give_back(link)
            raise ValueError(
                f"an earlier release of {self!r} by this thread failed: "
                "another process had released it"
            )
        if got:
            link.held[owners] = depth
            return True
        if not block:
            return False
        return self._wait(link, timeout, depth)

    def _wait(self, link: Link, timeout: float | None, depth: int) -> bool:
        """Block until the token moves to this thread's held list (or ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        mine = self._held + link.owner
        try:
            while True:
                step = _REAP_STEP
                if deadline is not None:
                    step = min(step, deadline - time.monotonic())
                    if step < MIN_WAIT:
                        return False
                got = link.command("BLMOVE", self._tokens, mine, "LEFT", "LEFT", round(step, 3))
                if got is not None:
                    link.write(SKIP_REPLY + pack("PEXPIRE", mine, _ttl(self._program)))
                    link.held[self._owners] = depth
                    return True
                self._reap(link)
        except BaseException:
            try:  # e.g. KeyboardInterrupt: maybe the token arrived; give it back
                self._give_back(link)
            except StateStoreError:
                pass
            raise

    def _give_back(self, link: Link) -> None:
        link.command("LMOVE", self._held + link.owner, self._tokens, "LEFT", "RIGHT")

    def _reap(self, link: Link) -> None:
        """Give back the lock if its holder's process is gone."""
        owners = [o.decode() for o in link.command("SMEMBERS", self._owners)]
        if not owners:
            return
        ids = {o.rsplit(":", 1)[1] for o in owners}
        try:
            listing = link.command("CLIENT", "LIST", "ID", *ids)
        except StateStoreError:
            return  # CLIENT LIST is not allowed here: dead holders cannot be found
        alive = {word[3:] for word in listing.decode().split() if word.startswith("id=")}
        dead = [o for o in owners if o.rsplit(":", 1)[1] not in alive]
        if dead:
            keys = (self._tokens, self._owners)
            link.eval(_LOCK_REAP, keys, (self._held, _ttl(self._program), *dead))

    def release(self) -> None:
        link = _link(self._program)
        held = link.held.pop(self._owners, 0)
        if not held:  # not acquired by this thread: allowed for a Lock, checked by the store
            if self._recursive:
                raise _NotOwnedError("attempt to release recursive lock not owned by thread")
            reply = link.eval(
                _LOCK_RELEASE_ANY, (self._tokens, self._owners), (self._held, _ttl(self._program))
            )
            if reply == -2:
                raise ValueError("semaphore or lock released too many times")
            return
        if held > 1:
            link.held[self._owners] = held - 1
            return
        self._send_release(link)

    def _send_release(self, link: Link) -> None:
        """Move this thread's token back; its reply is read later (nil: it was released)."""
        packed = link.packed.get(("release", self._owners))
        if packed is None:
            packed = pack("LMOVE", self._held + link.owner, self._tokens, "LEFT", "RIGHT")
            packed += SKIP_REPLY + pack("PEXPIRE", self._tokens, _ttl(self._program))
            link.packed["release", self._owners] = packed
        link.write(packed)
        link.pending.append(self._owners)

    def _release_all(self, link: Link) -> int:
        """Release however deep this thread holds it (for ``Condition.wait``); that depth."""
        depth = link.held.pop(self._owners, 0)
        if not depth:
            raise _NotOwnedError("must acquire() condition before using wait()")
        self._send_release(link)
        return depth

    def _depth(self, link: Link) -> int:
        """How many times this thread holds the lock (0: it does not)."""
        return link.held.get(self._owners, 0)

    def get_value(self) -> int:
        return int(_link(self._program).command("LLEN", self._tokens))


class RLock(Lock):
    """A re-entrant lock: only its owner thread may release it."""

    _recursive = True


class _Count:
    def __init__(self, fn: Any) -> None:
        self.get_value = fn


class Condition(_Shared):
    """A condition variable over a ``Lock`` or ``RLock`` (a new ``RLock`` by default)."""

    def __init__(
        self, lock: Lock | None = None, *, ctx: object = None, program: Program | None = None
    ) -> None:
        if lock is None:
            lock = RLock(program=program)
        elif not isinstance(lock, Lock):
            raise TypeError(f"Condition needs a nimbus Lock or RLock, not {type(lock).__name__}")
        self._lock = lock
        super().__init__(lock._program)

    def _setup(self, program: Program, name: str) -> None:
        super()._setup(program, name)
        self._waiters = program.keys.waiters(name)

    def _extra(self) -> Any:
        return self._lock

    def _restore(self, extra: Any) -> None:
        self._lock = extra

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return self._lock.acquire(block, timeout)

    def release(self) -> None:
        self._lock.release()

    # read by the stdlib suite's check_invariant: sleepers - woken must be 0 when idle
    @property
    def _sleeping_count(self) -> Any:
        link = _link(self._program)
        return _Count(lambda: int(link.command("LLEN", self._waiters)))

    @property
    def _woken_count(self) -> Any:
        return _Count(lambda: 0)

    @property
    def _wait_semaphore(self) -> Any:
        return _Count(lambda: 0)

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        link = _link(self._program)
        if not self._lock._depth(link):
            raise _NotOwnedError("must acquire() condition before using wait()")
        me = self._program.keys.waiter(Keys.new_name())
        link.call(("RPUSH", self._waiters, me), ("PEXPIRE", self._waiters, _ttl(self._program)))
        depth = self._lock._release_all(link)
        try:
            woken = link.blpop(me, timeout)
            if not woken:  # a notify may have picked this waiter as the wait timed out
                woken = link.eval(_UNWAIT, (self._waiters, me, me)) == 1
        finally:
            self._lock._acquire(link, True, None, depth)
        return woken

    def wait_for(self, predicate: Callable[[], _T], timeout: float | None = None) -> _T:
        result = predicate()
        if result:
            return result
        endtime = None if timeout is None else time.monotonic() + timeout
        waittime = None
        while not result:
            if endtime is not None:
                waittime = endtime - time.monotonic()
                if waittime <= 0:
                    break
            self.wait(waittime)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        self._wake(max(n, 0))

    def notify_all(self) -> None:
        self._wake(-1)

    def _wake(self, n: int) -> None:
        """Wake ``n`` waiters (-1: all) as their lock's owner."""
        link = _link(self._program)
        if not self._lock._depth(link):
            raise _NotOwnedError("lock is not owned")
        if n:
            link.eval(_NOTIFY, (self._waiters,), (n, _ttl(self._program)))


class Event(_Shared):
    """A flag processes can wait for."""

    def __init__(self, *, ctx: object = None, program: Program | None = None) -> None:
        super().__init__(program)

    def _setup(self, program: Program, name: str) -> None:
        super()._setup(program, name)
        self._flag = program.keys.event(name)
        self._waiters = program.keys.waiters(name)

    def is_set(self) -> bool:
        return bool(_link(self._program).command("EXISTS", self._flag))

    def __repr__(self) -> str:
        set_status = "set" if self.is_set() else "unset"
        return f"<{type(self).__qualname__} at {id(self):#x} {set_status}>"

    def set(self) -> None:
        link = _link(self._program)
        ttl = _ttl(self._program)
        link.send("SET", self._flag, "1", "PX", ttl)
        link.send("EVALSHA", _NOTIFY.sha, 1, self._waiters, -1, ttl)
        link.read()
        link.read_eval(_NOTIFY, (self._waiters,), (-1, ttl))

    def clear(self) -> None:
        _link(self._program).command("DEL", self._flag)

    def wait(self, timeout: float | None = None) -> bool:
        link = _link(self._program)
        me = self._program.keys.waiter(Keys.new_name())
        keys = (self._flag, self._waiters, me)
        if link.eval(_EVENT_WAIT, keys, (_ttl(self._program),)) == 1:
            return True
        if link.blpop(me, timeout):
            return True
        return bool(link.eval(_UNWAIT, (self._waiters, me, self._flag)) == 1)


class Barrier(threading.Barrier):
    """``threading.Barrier`` with its state in the store and a nimbus ``Condition``."""

    def __init__(
        self,
        parties: int,
        action: Callable[[], object] | None = None,
        timeout: float | None = None,
        *,
        ctx: object = None,
        program: Program | None = None,
    ) -> None:
        if parties < 1:
            raise ValueError("parties must be > 0")
        cond = Condition(Lock(program=program))
        prog = cond._program
        self.__setstate__((prog, Keys.new_name(), parties, action, timeout, cond))
        _link(prog).call(
            ("HSET", self._key, "state", 0, "count", 0), ("PEXPIRE", self._key, _ttl(prog))
        )

    def __getstate__(self) -> tuple[Any, ...]:
        return (self._program, self._name, self._parties, self._action, self._timeout, self._cond)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self._program, self._name, self._parties, self._action, self._timeout, self._cond) = state
        self._key = self._program.keys.barrier(self._name)

    def _get(self, field: str) -> int:
        return int(_link(self._program).command("HGET", self._key, field) or 0)

    @property
    def _state(self) -> int:
        return self._get("state")

    @_state.setter
    def _state(self, value: int) -> None:
        _link(self._program).command("HSET", self._key, "state", value)

    @property
    def _count(self) -> int:
        return self._get("count")

    @_count.setter
    def _count(self, value: int) -> None:
        _link(self._program).command("HSET", self._key, "count", value)

    def __repr__(self) -> str:
        return f"<Barrier {self._name} parties={self._parties}>"
