"""The task store's Lua scripts: each step that moves tasks is one script.

::

    SUBMIT   rows -> task hashes, the owner's index and quota, the endpoint queue
             (held rows wait in their inputs' sets of dependents instead)
    TAKE     endpoint queue -> inflight hash (state dispatched)
    RUNNING  dispatched -> running (the agent said so)
    FINISH   inflight -> final state, first result wins; counted (``counters``)
             and held tasks released (``held``: only for a task whose hash's 'then'
             is not 0, which SUBMIT sets to 1 on an input when a task is held for it)
    CANCEL   any state not final -> cancelled
    REQUEUE  inflight on a lost connection -> back to the queue head
    FAIL_HELD  held tasks whose input failed -> failed (``held.fail_held_lua``); the
             scripts that end an input append its held dependents to fail to the
             stream ``held.TO_FAIL``, whose consumer calls it

Each reads its keys and arguments from the KEYS and ARGV places the Python call
sites of ``nimbus.service.queues.TaskStore`` pass (see each method there); the
counting Lua is ``nimbus.service.counters``, the Lua of tasks held for others
``nimbus.service.held``.
"""

from __future__ import annotations

from nimbus.service.counters import COUNT
from nimbus.service.held import TO_FAIL, WOKEN, fail_held_lua, settle_lua
from nimbus.service.wakeups import tell_ended, tell_woken

__all__ = [
    "CANCEL",
    "FAIL_HELD",
    "FINISH",
    "OWNERS",
    "RELEASE",
    "REQUEUE",
    "RUNNING",
    "SUBMIT",
    "TAKE",
]

# Rows travel to and from the scripts as one msgpack string (Redis's Lua has
# cmsgpack, which reads the old "raw" string type: packed with use_bin_type=False).

# A task leaving the queue and the inflight hash for a final state gives its
# share of its owner's quota back (``key``: the task hash).
RELEASE = """
local function release(key)
  local q = redis.call('HMGET', key, 'quota', 'size')
  if q[1] then
    if redis.call('HINCRBY', q[1], 'tasks', -1) < 0 then redis.call('HSET', q[1], 'tasks', 0) end
    local size = tonumber(q[2] or 0) or 0
    if redis.call('HINCRBY', q[1], 'bytes', 0 - size) < 0 then redis.call('HSET', q[1], 'bytes', 0) end
    redis.call('HDEL', key, 'quota')
  end
end
"""

SUBMIT = (
    """
local t = cmsgpack.unpack(ARGV[2])
local owner, endpoint, group, submitted, size = t[1], t[2], t[3], t[4], t[6]
local ended = t[7] or {}  -- inputs no longer in Redis, by their state in the SQL history
local earlier = {}  -- a row's inputs: tasks of this owner, stored or earlier in this batch
for i, r in ipairs(t[5]) do
  for _, a in ipairs(r[7] or {}) do
    if not earlier[a] and not ended[a] then
      local o = redis.pcall('HGET', ARGV[1] .. a, 'owner')
      if type(o) ~= 'string' then return {-3, i - 1, a} end
      if o ~= owner then return {-4, i - 1, a} end
    end
  end
  earlier[r[1]] = true
end
local q = redis.call('HMGET', KEYS[4], 'tasks', 'bytes')
local tasks, bytes = tonumber(q[1] or 0) or 0, tonumber(q[2] or 0) or 0
if tasks + #t[5] > tonumber(ARGV[5]) then return {-1, tasks} end
if bytes + size > tonumber(ARGV[6]) then return {-2, bytes} end
redis.call('HINCRBY', KEYS[4], 'tasks', #t[5])
redis.call('HINCRBY', KEYS[4], 'bytes', size)
local held, queued = {}, false
for _, r in ipairs(t[5]) do
  local id = r[1]
  redis.call('HSET', ARGV[1] .. id, 'state', 'waiting-for-endpoint', 'owner', owner,
             'endpoint', endpoint, 'function', r[2], 'group', group, 'submitted', submitted,
             'payload', r[3], 'timeout', r[4], 'quota', KEYS[4], 'size', #r[3], 'then', 0)
  if r[5] ~= '' then  -- its arguments are in the data store: the task claims them
    redis.call('HSET', ARGV[1] .. id, 'data', r[5])
    redis.call('HSET', ARGV[4] .. r[5], 'task', id, 'endpoint', endpoint)
    redis.call('PERSIST', ARGV[4] .. r[5])
  end
  if r[6] ~= '' then redis.call('HSET', ARGV[1] .. id, 'env', r[6]) end  -- its environment
  if r[7] then  -- held ('waits': inputs not done) until its inputs succeed
    local waits, failed = 0, nil
    for _, a in ipairs(r[7]) do
      local st = ended[a] or redis.call('HGET', ARGV[1] .. a, 'state')
      if st == 'failed' or st == 'cancelled' then
        failed = failed or {id, a, st}
      elseif st ~= 'success' then
        redis.call('SADD', ARGV[1] .. a .. ARGV[7], id)
        if st and not ended[a] then redis.call('HSET', ARGV[1] .. a, 'then', 1) end
        waits = waits + 1
      end
    end
    if failed then  -- failed as a held task (the stream's consumer makes the error)
      redis.call('XADD', ARGV[1] .. 'TO_FAIL', '*', 'd', failed[1], 'i', failed[2], 's', failed[3])
      waits = waits + 1
    end
    if waits > 0 then
      redis.call('HSET', ARGV[1] .. id, 'waits', waits)
      redis.call('SADD', KEYS[6], id)  -- the endpoint's held tasks (deleting it fails them)
      held[id] = true
    end
  end
end
for i = 1, #t[5], 1000 do  -- indexed and queued 1,000 at a time (one call each, not per task)
  local ids, scored, ready = {}, {}, {}
  for j = i, math.min(i + 999, #t[5]) do
    local id = t[5][j][1]
    ids[#ids + 1] = id
    scored[#scored + 1] = submitted
    scored[#scored + 1] = id
    if not held[id] then ready[#ready + 1] = id end
  end
  redis.call('ZADD', KEYS[2], unpack(scored))
  redis.call('ZADD', KEYS[5], unpack(scored))
  if #ready > 0 then
    redis.call('RPUSH', KEYS[1], unpack(ready))
    queued = true
  end
  redis.call('RPUSH', KEYS[3], unpack(ids))
end
redis.call('EXPIRE', KEYS[3], ARGV[3])
redis.call('PUBLISH', ARGV[1] .. 'changed', owner)  -- wakes the owner's open dashboard pages
""".replace("TO_FAIL", TO_FAIL)
    + tell_woken(f"ARGV[1] .. '{WOKEN}'", "endpoint", "queued")  # its agents on other processes
    + "return {#t[5], 0}\n"
)

OWNERS = """
local owners, named = {}, {}  -- whose tasks moved: published for their dashboard pages
local function moved(owner)
  if owner and not named[owner] then
    named[owner] = true
    owners[#owners + 1] = owner
  end
end
"""

TAKE = (
    OWNERS
    + """
local out = {}
local n = tonumber(ARGV[1])
local taken = 0
while taken < n do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  local key = ARGV[3] .. id
  local v = redis.call('HMGET', key, 'state', 'function', 'payload', 'timeout', 'data', 'owner',
                       'env')
  if v[1] == 'waiting-for-endpoint' then
    redis.call('HSET', key, 'state', 'dispatched', 'dispatched', ARGV[4])
    redis.call('HSET', KEYS[2], id, ARGV[2])
    out[#out + 1] = {id, v[2], v[3], v[4] or '', v[5] or '', v[6] or '', v[7] or ''}
    moved(v[6])
    taken = taken + 1
  end
end
if taken > 0 then redis.call('PUBLISH', ARGV[3] .. 'changed', table.concat(owners, ' ')) end
return cmsgpack.pack(out)
"""
)

# The finish and cancel scripts hand the SQL history its rows in the stream entry
# they append (``flusher``): the fields of each task ended, in ``history.FIELDS``
# order, flat, so that the flusher reads no task hash back.
HISTORY_ROW = """
local function history_row(rows, a, b, c, d, e, f, g, h, i, j, k, l)  -- (no varargs: cheaper)
  local n = #rows
  rows[n + 1] = a or ''; rows[n + 2] = b or ''; rows[n + 3] = c or ''; rows[n + 4] = d or ''
  rows[n + 5] = e or ''; rows[n + 6] = f or ''; rows[n + 7] = g or ''; rows[n + 8] = h or ''
  rows[n + 9] = i or ''; rows[n + 10] = j or ''; rows[n + 11] = k or ''; rows[n + 12] = l or ''
end
"""

FINISH = (
    OWNERS
    + HISTORY_ROW
    + COUNT
    + settle_lua(1, 8, 9)
    + """
local out, drop = {}, {}
local freed, quotas = {}, {}  -- quota hash -> {tasks, bytes} given back, once per owner at the end
local gone = {}  -- ids no longer in flight on the endpoint, 1,000 to a call at the end
local rows = {}  -- the SQL history's rows of the tasks ended (history.FIELDS, flat)
local ended = {}  -- the results stored, their state written once the history's entry is known
for _, r in ipairs(cmsgpack.unpack(ARGV[5])) do
  local id = r[1]
  local key = ARGV[1] .. id
  local v = redis.call('HMGET', key, 'state', 'endpoint', 'data', 'quota', 'size', 'owner',
                       'submitted', 'dispatched', 'function', 'group', 'timeout', 'then')
  if ended[id] then v[1] = false end  -- (a result twice in one call: the first is kept)
  local blob = ''  -- a result in the data store, if it was stored for this task
  if r[5] ~= '' and redis.call('HGET', ARGV[6] .. r[5], 'task') == id then blob = r[5] end
  local stored = false
  if v[2] == ARGV[4] then
    if v[1] == 'dispatched' or v[1] == 'running' or v[1] == 'waiting-for-endpoint' then
      if v[4] then  -- its share of its owner's quota (as release() does, summed per owner)
        local f = freed[v[4]]
        if not f then
          f = {0, 0}
          freed[v[4]] = f
          quotas[#quotas + 1] = v[4]
        end
        f[1] = f[1] + 1
        f[2] = f[2] + (tonumber(v[5] or 0) or 0)
      end
      ended[id] = r
      if v[1] == 'waiting-for-endpoint' then redis.call('SREM', KEYS[3], id) end
      if v[3] then  -- (a field known missing is not looked for: a scan of the hash each)
        redis.call('HDEL', key, 'payload', 'data', 'quota', 'waits')
      else
        redis.call('HDEL', key, 'payload', 'quota', 'waits')
      end
      if v[12] ~= '0' then settle(id, r[2]) end  -- none held for it: no set to read
      redis.call('EXPIRE', key, ARGV[3])
      if v[3] then
        redis.call('DEL', ARGV[6] .. v[3])
        drop[#drop + 1] = v[3]
      end
      if blob ~= '' then redis.call('EXPIRE', ARGV[6] .. blob, ARGV[3]) end
      stored = true
      out[#out + 1] = id
      history_row(rows, id, v[6], v[2], v[9], v[10], r[2], v[7], v[8], ARGV[2], v[11], r[3], r[4])
      moved(v[6])
      count(r[2], v[7], v[8], r[4], r[6])  -- the dashboard's and /metrics' counters (counters.py)
    end
    gone[#gone + 1] = id
  end
  if blob ~= '' and not stored then
    redis.call('DEL', ARGV[6] .. blob)
    drop[#drop + 1] = blob
  end
end
for i = 1, #gone, 1000 do
  redis.call('HDEL', KEYS[1], unpack(gone, i, math.min(i + 999, #gone)))
end
for _, quota in ipairs(quotas) do
  local f = freed[quota]
  if redis.call('HINCRBY', quota, 'tasks', 0 - f[1]) < 0 then redis.call('HSET', quota, 'tasks', 0) end
  if redis.call('HINCRBY', quota, 'bytes', 0 - f[2]) < 0 then redis.call('HSET', quota, 'bytes', 0) end
end
if #out > 0 then
  redis.call('PUBLISH', ARGV[1] .. 'changed', table.concat(owners, ' '))
  -- each task ended names the history's entry of its row ('entry'): saved once the stream
  -- holds no entry as old (flusher.py), with no mark to write task by task
  local entry = redis.call('XADD', ARGV[7], '*', 'ids', table.concat(out, ' '),
                           'rows', cmsgpack.pack(rows), 'e', 1)
  for _, id in ipairs(out) do
    local r = ended[id]
    redis.call('HSET', ARGV[1] .. id, 'state', r[2], 'result', r[3], 'record', r[4],
               'ended', ARGV[2], 'entry', entry)
  end
end
flush(KEYS[2])
if #woken > 0 then  -- every service process wakes its dispatchers of these endpoints
  redis.call('PUBLISH', ARGV[1] .. 'WOKEN', table.concat(woken, ' '))
end
""".replace("WOKEN", WOKEN)
    + tell_ended("ARGV[1]", "out")  # wakes their waiters in other service processes
    + "return {out, drop, woken}\n"
)

RUNNING = (
    OWNERS
    + """
for i = 4, #ARGV do
  local key = ARGV[1] .. ARGV[i]
  local v = redis.call('HMGET', key, 'state', 'endpoint', 'owner')
  if v[1] == 'dispatched' and v[2] == ARGV[2] then
    redis.call('HSET', key, 'state', 'running', 'started', ARGV[3])  -- a worker started it
    moved(v[3])
  end
end
if #owners > 0 then redis.call('PUBLISH', ARGV[1] .. 'changed', table.concat(owners, ' ')) end
return 0
"""
)

REQUEUE = (
    """
local rows = redis.call('HGETALL', KEYS[2])
local n = 0
for i = 1, #rows, 2 do
  if ARGV[2] == '' or rows[i + 1] == ARGV[2] then
    local key = ARGV[1] .. rows[i]
    local st = redis.call('HGET', key, 'state')
    if st == 'dispatched' or st == 'running' then
      redis.call('HSET', key, 'state', 'waiting-for-endpoint')
      redis.call('LPUSH', KEYS[1], rows[i])
      n = n + 1
    end
    redis.call('HDEL', KEYS[2], rows[i])
  end
end
if n > 0 then redis.call('PUBLISH', ARGV[1] .. 'changed', '') end
"""
    + tell_woken(f"ARGV[1] .. '{WOKEN}'", "ARGV[3]", "n > 0")  # its agents on other processes
    + "return n\n"
)

CANCEL = (
    RELEASE
    + HISTORY_ROW
    + COUNT
    + settle_lua(7, 8, 9)
    + """
local v = redis.call('HMGET', KEYS[1], 'state', 'owner', 'endpoint', 'function', 'group',
                     'submitted', 'dispatched', 'timeout', 'record')
local st = v[1]
if not st or st == 'success' or st == 'failed' or st == 'cancelled' then return false end
release(KEYS[1])
count('cancelled', nil, nil, nil)  -- by state only: it has no run to put in the histograms
flush(KEYS[3])
local data = redis.call('HGET', KEYS[1], 'data')
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'result', ARGV[1], 'ended', ARGV[2])
redis.call('HDEL', KEYS[1], 'payload', 'data')
redis.call('EXPIRE', KEYS[1], ARGV[3])
if data then redis.call('DEL', ARGV[5] .. data) end
local rows = {}  -- for the SQL history (flusher.py)
history_row(rows, ARGV[4], v[2], v[3], v[4], v[5], 'cancelled', v[6], v[7], ARGV[2], v[8],
            ARGV[1], v[9])
local entry = redis.call('XADD', ARGV[6], '*', 'ids', ARGV[4], 'rows', cmsgpack.pack(rows), 'e', 1)
redis.call('HSET', KEYS[1], 'entry', entry)  -- saved once the stream holds no older entry
local conn = redis.call('HGET', KEYS[2], ARGV[4])
redis.call('HDEL', KEYS[2], ARGV[4])
redis.call('HDEL', KEYS[1], 'waits')
redis.call('SREM', KEYS[4], ARGV[4])  -- if it was held
settle(ARGV[4], 'cancelled')
"""
    + tell_ended("ARGV[7]", "{ARGV[4]}")  # wakes its waiters in other service processes
    + "return {conn or '', data or ''}\n"
)

FAIL_HELD = fail_held_lua(OWNERS, RELEASE, COUNT)
