"""Every Lua script nimbus runs on a program's state store, in one place (as ``keys``).

::

    multiprocessing.synchronize   LOCK_*, SEM_*, CONDITION_*, EVENT_*
    multiprocessing.queues        QUEUE_*            multiprocessing.connection  CONNECTION_*
    multiprocessing._handover     HANDOVER_*         multiprocessing._direct     PIPE_*
    multiprocessing.sharedctypes  ARRAY_*            messaging._directory        DIRECTORY_*
    data._kv (nimbus.data.store() on an endpoint)    KV_*
          |  link.eval(SCRIPT, keys, args): EVALSHA, EVAL when the store lacks it
          v
    the service's stores Redis: loads scripts() at start; its users may EVALSHA these only

They are here, below the packages that run them, so that the service can list
them (``scripts()``) without importing ``nimbus.multiprocessing``.
"""

from __future__ import annotations

from nimbus.statestore._script import Script

__all__ = [
    "ARRAY_GUARDED",
    "CONDITION_NOTIFY",
    "CONDITION_UNWAIT",
    "CONNECTION_RELEASE",
    "DIRECTORY_LOOKUP",
    "EVENT_WAIT",
    "HANDOVER_CLAIM",
    "HANDOVER_GIVE_UP",
    "HANDOVER_SHARE",
    "HANDOVER_STEAL",
    "HANDOVER_SWITCH",
    "KV_LISTED",
    "LOCK_REAP",
    "LOCK_RELEASE_ANY",
    "PIPE_SECOND",
    "QUEUE_RELEASE",
    "QUEUE_RESERVE",
    "QUEUE_TASK_DONE",
    "SEM_RELEASE",
]


# ---------------------------------------------------------------- the handover of a Pipe or a Queue's lane to direct messaging (``multiprocessing._handover``)

# A Pipe direction's second writing process: the direction goes to the store for good
# once two processes have written it; the holder's claim goes (``multiprocessing._direct``).
PIPE_SECOND = Script("""
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('PEXPIRE', KEYS[4], ARGV[2])
if #redis.call('SMEMBERS', KEYS[4]) < 2 then return false end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
local h = redis.call('GET', KEYS[1])
if h then redis.call('DEL', KEYS[1]) end
return h or ''
""")

# A consumer claims the lane. {0}: shared (store only); {1}: claimed; {2, holder}.
HANDOVER_CLAIM = Script("""
if redis.call('GET', KEYS[2]) then return {0} end
local h = redis.call('GET', KEYS[1])
if h then return {2, h} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1}
""")


# A second consumer: shared for good, the claim goes (its holder gives it up).
HANDOVER_SHARE = Script("""
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('RPUSH', KEYS[3], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return 1
""")


# The holder is dead: its claim is replaced.
HANDOVER_STEAL = Script("""
if redis.call('GET', KEYS[2]) then return 0 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
""")


# A producer switches to the holder: -1 shared (never again), 0 not now, else the claim.
HANDOVER_SWITCH = Script("""
if redis.call('GET', KEYS[2]) then return -1 end
local h = redis.call('GET', KEYS[1])
if not h or h == ARGV[2] or string.sub(h, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then return 0 end
redis.call('HSET', KEYS[3], ARGV[1], h)
redis.call('PEXPIRE', KEYS[3], ARGV[3])
redis.call('RPUSH', KEYS[4], 'S' .. h .. '|' .. ARGV[1])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
return h
""")


# The holder gives its claim up: the producers switched to it (taken out of "writers").
HANDOVER_GIVE_UP = Script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
local out = {}
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  if all[i + 1] == ARGV[1] then
    table.insert(out, all[i])
    redis.call('HDEL', KEYS[2], all[i])
  end
end
return out
""")


# ---------------------------------------------------------------- Pipes (``multiprocessing.connection``)

# Decrement the references of an end; at zero push end-of-stream to the list it writes.
CONNECTION_RELEASE = Script("""
local n = redis.call('DECR', KEYS[1])
if n <= 0 then redis.call('DEL', KEYS[1]) end
return n
""")


# ---------------------------------------------------------------- Queues (``multiprocessing.queues``)

# KEYS: count; ARGV: maxsize, ttl. 1 if a slot was reserved, else 0.
QUEUE_RESERVE = Script("""
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")


# KEYS: count, notfull; ARGV: released, maxsize, ttl.
QUEUE_RELEASE = Script("""
redis.call('DECRBY', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[2]), -1)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
""")


# KEYS: unfinished, joined; ARGV: ttl. -1 if there was no unfinished task.
QUEUE_TASK_DONE = Script("""
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n <= 0 then return -1 end
n = redis.call('DECR', KEYS[1])
if n == 0 then
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('LTRIM', KEYS[2], -64, -1)
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
end
return n
""")


# ---------------------------------------------------------------- locks, semaphores, conditions and events (``multiprocessing.synchronize``)

SEM_RELEASE = Script("""
if tonumber(ARGV[1]) >= 0 and redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[1]) then return -1 end
redis.call('RPUSH', KEYS[1], 't')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 0
""")


# KEYS tokens, owners; ARGV held-key prefix, ttl -> 1: released, -2: released too many times
LOCK_RELEASE_ANY = Script("""
if redis.call('LLEN', KEYS[1]) >= 1 then return -2 end
for _, owner in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('LMOVE', ARGV[1] .. owner, KEYS[1], 'LEFT', 'RIGHT') then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
  end
end
redis.call('RPUSH', KEYS[1], 't')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")


# KEYS tokens, owners; ARGV held-key prefix, ttl, dead owners... -> 1 if their token came back
LOCK_REAP = Script("""
local given = 0
for i = 3, #ARGV do
  if redis.call('LMOVE', ARGV[1] .. ARGV[i], KEYS[1], 'LEFT', 'RIGHT') then given = 1 end
  redis.call('SREM', KEYS[2], ARGV[i])
end
if given == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return given
""")


# KEYS waiters, waiter; ARGV n (-1: all), ttl -> wakes the first n waiters
CONDITION_NOTIFY = Script("""
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
CONDITION_UNWAIT = Script("""
local removed = redis.call('LREM', KEYS[1], 0, KEYS[2])
redis.call('DEL', KEYS[2])
if removed == 0 then return 1 end
return redis.call('EXISTS', KEYS[3])
""")


# KEYS flag, waiters, waiter; ARGV ttl -> 1 if set, else registers the waiter
EVENT_WAIT = Script("""
if redis.call('EXISTS', KEYS[1]) == 1 then return 1 end
redis.call('RPUSH', KEYS[2], KEYS[3])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 0
""")


# ---------------------------------------------------------------- Values and Arrays in the store (``multiprocessing.sharedctypes``)

# KEYS lock tokens, lock owners, data; ARGV owner, op, a, b -> {0} if the lock is someone else's
ARRAY_GUARDED = Script("""
if redis.call('LLEN', KEYS[1]) == 0 then return {0} end
if ARGV[1] == 'get' then return {1, redis.call('GETRANGE', KEYS[2], ARGV[2], ARGV[3])} end
redis.call('SETRANGE', KEYS[2], ARGV[2], ARGV[3])
return {1}
""")

# messaging's directory of instances: the whole hash if it is small, else the one entry
# (as [id, entry] or none): one round trip. KEYS: the directory; ARGV: the id, how small
DIRECTORY_LOOKUP = Script("""
if redis.call('HLEN', KEYS[1]) <= tonumber(ARGV[2]) then
    return redis.call('HGETALL', KEYS[1])
end
local found = redis.call('HGET', KEYS[1], ARGV[1])
if found then return {ARGV[1], found} end
return {}
""")


# nimbus.data.store() on an endpoint: the key ARGV[1], just set to live ARGV[2] ms, is
# listed in the index KEYS[1], which lives as long as the longest-lived of its keys (a
# key that expired stays listed until keys() finds it gone or the index expires)
KV_LISTED = Script("""
redis.call('SADD', KEYS[1], ARGV[1])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
""")
