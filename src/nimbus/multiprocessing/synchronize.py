"""Locks, semaphores, conditions, events and barriers in the state store.

The stdlib's ``multiprocessing.synchronize`` with its semantics, for processes
that share no memory or file descriptors: every object is a few Redis keys of
its program (see ``nimbus.keys``) and pickles as (program, name), so it works
in any process that unpickles it::

    Semaphore   semaphore:<n>          a list of tokens: acquire = BLPOP, release = RPUSH
    Lock/RLock  lock:<n>               a list holding 1 token while the lock is free
                lock:<n>:owners        owner -> recursion depth, written with the pop
                lock:<n>:claim:<owner> where a blocked acquire lands its token (BLMOVE)
    Event       event:<n>              the flag
    Condition   waiters:<n>            the wake-up lists of the waiting threads
    (any wait)  waiter:<unique>        one thread's wake-up list: BLPOP on it
    Barrier     barrier:<n>            state and count; threading.Barrier on a Condition

Blocked waiters are served first come, first served by Redis; nothing polls.
Each thread talks to the store on its own connection, one round trip per
operation (Lua scripts where several keys change at once, their commands packed
once per lock and thread). A thread releasing a lock it acquired asks the store
not to reply (``CLIENT REPLY SKIP``: the release cannot fail), so an uncontended
``Lock`` acquire + release costs one round trip and a send. If another process
released that Lock meanwhile (a Lock may be released by anyone), the store notes
it and the ``ValueError`` of that release is raised by the holder's next acquire
of the lock. Keys are created with the program's TTL; those of finished waits
are deleted.

Owners are (hostname, pid, thread id) plus the Redis client id of a
connection each process keeps open for its lifetime (its *presence*).

**A Lock or RLock holder that dies is released.** A waiter that has waited
``_REAP_STEP`` seconds asks Redis which owners' presence connections are
gone (``CLIENT LIST ID``; the kernel closes them when a process dies, even by
SIGKILL, and Redis never reuses a client id) and gives their tokens back, so
a waiter gets a SIGKILLed holder's lock within about half a second. The same
applies to a holder that exits without releasing. A live but hung holder keeps
its lock, as in the stdlib. Caveats: an external Redis must not close idle
clients (``timeout 0``, its default) and must allow ``CLIENT LIST``;
otherwise a dead holder's lock stays held. Semaphores carry no owners (any
process may release them), so nothing is given back for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from nimbus.errors import StateStoreError
from nimbus.keys import Keys
from nimbus.multiprocessing import _state
from nimbus.multiprocessing._link import MIN_WAIT, SKIP_REPLY, Link, Script, pack, preload
from nimbus.multiprocessing._link import link as _link
from nimbus.multiprocessing._state import Program

__all__ = ["Barrier", "BoundedSemaphore", "Condition", "Event", "Lock", "RLock", "Semaphore"]

_REAP_STEP = 0.5  # seconds a Lock waiter blocks between checks for dead holders
_T = TypeVar("_T")


class _NotOwnedError(AssertionError, RuntimeError):
    """Raised where multiprocessing asserts (AssertionError) and threading raises RuntimeError."""


# ---------------------------------------------------------------- scripts

_SEM_RELEASE = Script("""
if tonumber(ARGV[1]) >= 0 and redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[1]) then return -1 end
redis.call('RPUSH', KEYS[1], 't')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 0
""")
# KEYS tokens, owners, late; ARGV owner, recursive, depth, ttl -> -1: a release of ours failed
_LOCK_TRY = Script("""
if redis.call('HDEL', KEYS[3], ARGV[1]) == 1 then return -1 end
if ARGV[2] == '1' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
  return 2
end
if redis.call('LPOP', KEYS[1]) then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  return 1
end
return 0
""")
# KEYS claim, owners; ARGV owner, depth, ttl: runs right after BLMOVE tokens -> claim
_LOCK_CLAIM = Script("""
if redis.call('LPOP', KEYS[1]) then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
return 0
""")
# KEYS tokens, owners, late; ARGV owner, recursive, all, ttl, unheard
#   -> depth released, -1 not owned, -2 too many; an unheard (reply-less) failure is noted in late
_LOCK_RELEASE = preload(
    Script("""
local function fail(code)
  if ARGV[5] == '1' then
    redis.call('HSET', KEYS[3], ARGV[1], code)
    redis.call('PEXPIRE', KEYS[3], ARGV[4])
  end
  return code
end
local n = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if ARGV[2] == '1' or ARGV[3] == '1' then
  if n == 0 then return fail(-1) end
  if n > 1 and ARGV[3] == '0' then redis.call('HINCRBY', KEYS[2], ARGV[1], -1) return 1 end
  redis.call('HDEL', KEYS[2], ARGV[1])
else
  if redis.call('LLEN', KEYS[1]) >= 1 then return fail(-2) end
  if n == 0 then
    local other = redis.call('HKEYS', KEYS[2])[1]
    if other then redis.call('HDEL', KEYS[2], other) end
  else
    redis.call('HDEL', KEYS[2], ARGV[1])
  end
  n = 1
end
redis.call('RPUSH', KEYS[1], 't')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return n
""")
)
# KEYS tokens, owners, claim; ARGV ttl, owners to drop...: give back the tokens of dead owners
_LOCK_REAP = Script("""
local given = 0
if redis.call('LPOP', KEYS[3]) then given = 1 end
for i = 2, #ARGV do
  if redis.call('HDEL', KEYS[2], ARGV[i]) == 1 then given = 1 end
end
if given == 1 and redis.call('LLEN', KEYS[1]) == 0 then
  redis.call('RPUSH', KEYS[1], 't')
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return given
""")
# KEYS waiters, waiter; ARGV n (-1: all), ttl -> wakes the first n waiters
_NOTIFY = Script("""
local ws
if tonumber(ARGV[1]) < 0 then
  ws = redis.call('LRANGE', KEYS[1], 0, -1)
  redis.call('DEL', KEYS[1])
else
  ws = redis.call('LPOP', KEYS[1], ARGV[1]) or {}
end
for _, w in ipairs(ws) do
  redis.call('RPUSH', w, '1')
  redis.call('PEXPIRE', w, ARGV[2])
end
return #ws
""")
# KEYS waiters, waiter, flag -> 1 if the waiter was woken (a wake-up was or is being sent)
_UNWAIT = Script("""
local removed = redis.call('LREM', KEYS[1], 0, KEYS[2])
redis.call('DEL', KEYS[2])
if removed == 0 then return 1 end
return redis.call('EXISTS', KEYS[3])
""")
# KEYS flag, waiters, waiter; ARGV ttl -> 1 if set, else registers the waiter
_EVENT_WAIT = Script("""
if redis.call('EXISTS', KEYS[1]) == 1 then return 1 end
redis.call('RPUSH', KEYS[2], KEYS[3])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 0
""")


def _ttl(program: Program) -> int:
    return program.ttl_ms


# ---------------------------------------------------------------- the objects


class _Shared:
    """A named object of one program; pickles as (program, name, _extra)."""

    _program: Program
    _name: str

    def __init__(self, program: Program | None) -> None:
        self._setup(program if program is not None else _state.program(), Keys.new_name())

    def _setup(self, program: Program, name: str) -> None:
        self._program = program
        self._name = name

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


class _Acquirable(_Shared):
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


class Semaphore(_Acquirable):
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


class Lock(_Acquirable):
    """A mutex any process may release; released for you if its holder dies."""

    _recursive = "0"

    def __init__(self, *, ctx: object = None, program: Program | None = None) -> None:
        super().__init__(program)
        _link(self._program).call(
            ("RPUSH", self._tokens, "t"), ("PEXPIRE", self._tokens, _ttl(self._program))
        )

    def _setup(self, program: Program, name: str) -> None:
        super()._setup(program, name)
        self._tokens = program.keys.lock(name)
        self._owners = program.keys.lock_owners(name)
        self._late = program.keys.lock_late(name)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return self._acquire(_link(self._program), block, timeout, 1)

    def _acquire(self, link: Link, block: bool, timeout: float | None, depth: int) -> bool:
        ttl = _ttl(self._program)
        keys = (self._tokens, self._owners, self._late)
        args = (link.owner, self._recursive, depth, ttl)
        if depth == 1:  # the common case, packed once
            packed = link.packed.get(("acquire", self._owners))
            if packed is None:
                packed = pack("EVALSHA", _LOCK_TRY.sha, 3, *keys, *args)
                link.packed["acquire", self._owners] = packed
            link.write(packed)
            got = link.read_eval(_LOCK_TRY, keys, args)
        else:
            got = link.eval(_LOCK_TRY, keys, args)
        if got == -1:
            raise ValueError(
                f"an earlier release of {self!r} by this thread failed: "
                "another process had released it"
            )
        if got:
            link.held[self._owners] = link.held.get(self._owners, 0) + 1 if got == 2 else depth
            return True
        if not block:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        claim = self._program.keys.lock_claim(self._name, link.owner)
        claim_args = (link.owner, depth, ttl)
        try:
            while True:
                step = _REAP_STEP
                if deadline is not None:
                    step = min(step, deadline - time.monotonic())
                    if step < MIN_WAIT:
                        return False
                link.send("BLMOVE", self._tokens, claim, "LEFT", "LEFT", round(step, 3))
                link.send("EVALSHA", _LOCK_CLAIM.sha, 2, claim, self._owners, *claim_args)
                link.read()
                if link.read_eval(_LOCK_CLAIM, (claim, self._owners), claim_args) == 1:
                    link.held[self._owners] = depth
                    return True
                self._reap(link, claim, ())
        except BaseException:
            try:  # e.g. KeyboardInterrupt: maybe the token arrived; give it back
                self._reap(link, claim, (link.owner,))
            except StateStoreError:
                pass
            raise

    def _reap(self, link: Link, claim: str, drop: Sequence[str]) -> None:
        """Give back the lock if its holder's process is gone (or one of ``drop`` holds it)."""
        dead = list(drop)
        if not dead:
            owners = [o.decode() for o in link.command("HKEYS", self._owners)]
            if not owners:
                return
            ids = {o.rsplit(":", 1)[1] for o in owners}
            try:
                listing = link.command("CLIENT", "LIST", "ID", *ids)
            except StateStoreError:
                return  # CLIENT LIST is not allowed here: dead holders cannot be found
            alive = {word[3:] for word in listing.decode().split() if word.startswith("id=")}
            dead = [o for o in owners if o.rsplit(":", 1)[1] not in alive]
            if not dead:
                return
        link.eval(_LOCK_REAP, (self._tokens, self._owners, claim), (_ttl(self._program), *dead))

    def release(self) -> None:
        link = _link(self._program)
        held = link.held.pop(self._owners, 0)
        if not held:  # not acquired by this thread (allowed for a Lock): check the outcome
            self._release(link, "0")
            return
        if held > 1:
            link.held[self._owners] = held - 1
        # This thread holds it, so the release cannot fail: the store is asked not to reply
        # (a failure is noted for the next acquire). The link loaded the script when it connected.
        packed = link.packed.get(("release", self._owners))
        if packed is None:
            command = ("EVALSHA", _LOCK_RELEASE.sha, 3, self._tokens, self._owners, self._late)
            args = (link.owner, self._recursive, "0", _ttl(self._program), "1")
            packed = SKIP_REPLY + pack(*command, *args)
            link.packed["release", self._owners] = packed
        link.write(packed)

    def _release(self, link: Link, everything: str) -> int:
        link.held.pop(self._owners, None)
        keys = (self._tokens, self._owners, self._late)
        args = (link.owner, self._recursive, everything, _ttl(self._program), "0")
        depth = int(link.eval(_LOCK_RELEASE, keys, args))
        if depth == -1:
            raise _NotOwnedError("attempt to release recursive lock not owned by thread")
        if depth == -2:
            raise ValueError("semaphore or lock released too many times")
        return depth

    def _depth(self, link: Link) -> int:
        """How many times this thread holds the lock (0: it does not)."""
        return int(link.command("HGET", self._owners, link.owner) or 0)

    def get_value(self) -> int:
        return int(_link(self._program).command("LLEN", self._tokens))


class RLock(Lock):
    """A re-entrant lock: only its owner thread may release it."""

    _recursive = "1"


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
        depth = self._lock._release(link, "1")
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
