"""The task store's Lua for tasks held until their inputs end (``after``).

``settle_lua`` is spliced into the scripts that end a task (finish, cancel) and into
``fail_held_lua``, which fails held tasks whose input failed. The store's other scripts are
``nimbus.service.scripts``, its Python side ``nimbus.service.queues``; what the service does
with what they return, ``nimbus.service.dependencies``.
"""

from __future__ import annotations

from nimbus.service.wakeups import tell_ended

__all__ = ["TO_FAIL", "WOKEN", "fail_held_lua", "settle_lua"]

# The stream (after the task prefix) of held tasks to fail: {d: dependent, i: input,
# s: its state}, appended by the script that ended the input (or by submit, for an input
# that had failed already), so that no crash between that script and ``fail_held`` leaves
# them held forever; a consumer group reads it (``nimbus.service.dependencies``), and
# ``fail_held`` acknowledges the entries it handled in the same script.
TO_FAIL = "tofail"
# The pub/sub channel (after the task prefix) of the endpoints whose queues held tasks
# joined (ids space-separated): every service process wakes its dispatchers of them (an
# endpoint's agents may be connected to another process than the one that ended the input).
WOKEN = "woken"


def settle_lua(prefix: int, then: int, queue: int) -> str:
    """The Lua of ``settle(id, state)``: a task that ended releases the tasks held for it
    (``after``). On success each waits for one input less and, at none, leaves its
    endpoint's set of held tasks for its queue (``woken`` names the endpoints); otherwise
    each is to fail: ``{dependent, input, state}`` appended to the stream ``TO_FAIL`` (its
    consumer makes the error and fails it with ``fail_held``). The task prefix, the suffix of a task's set of
    dependents, an endpoint queue's key and its set of held tasks' (each around the
    endpoint id: ``queue``, ``queue + 1``; ``queue + 2``, ``queue + 3``) are read from
    those ARGV places."""
    return (
        """
local woken, named_ep = {}, {}
local function settle(id, state)
  local set = ARGV[P] .. id .. ARGV[T]
  local deps = redis.call('SMEMBERS', set)
  if #deps == 0 then return end
  redis.call('DEL', set)
  for _, d in ipairs(deps) do
    local dk = ARGV[P] .. d
    local w = redis.call('HMGET', dk, 'state', 'waits', 'endpoint')
    if w[1] == 'waiting-for-endpoint' and w[2] then
      if state ~= 'success' then
        redis.call('XADD', ARGV[P] .. 'TO_FAIL', '*', 'd', d, 'i', id, 's', state)
      elseif redis.call('HINCRBY', dk, 'waits', -1) <= 0 then
        redis.call('HDEL', dk, 'waits')
        redis.call('SREM', ARGV[HQ] .. w[3] .. ARGV[HR], d)
        redis.call('RPUSH', ARGV[Q] .. w[3] .. ARGV[R], d)
        if not named_ep[w[3]] then
          named_ep[w[3]] = true
          woken[#woken + 1] = w[3]
        end
      end
    end
  end
end
""".replace("TO_FAIL", TO_FAIL)
        .replace("ARGV[P]", f"ARGV[{prefix}]")
        .replace("ARGV[T]", f"ARGV[{then}]")
        .replace("ARGV[Q]", f"ARGV[{queue}]")
        .replace("ARGV[R]", f"ARGV[{queue + 1}]")
        .replace("ARGV[HQ]", f"ARGV[{queue + 2}]")
        .replace("ARGV[HR]", f"ARGV[{queue + 3}]")
    )


def fail_held_lua(owners: str, release: str, count: str) -> str:
    """The script that fails held tasks whose input failed (``[[task_id, result], ...]``
    in ARGV[4]), as cancel does (their quota given back: ``release``, the store's
    ``release(key)``; ``owners``, its ``moved(owner)``), counted on their endpoints'
    metrics hashes as cancel counts (``count``: ``counters.COUNT``; the hash's key around
    the endpoint id: ARGV[13], ARGV[14]), and acknowledges the entries of the stream
    ``TO_FAIL`` that named them (ARGV[12] the group, ARGV[15...] the entries);
    it returns those failed and the data-store blobs to remove. The tasks held for them
    are appended to the stream in turn."""
    return (
        owners
        + release
        + count
        + settle_lua(1, 5, 7)
        + """
local out, drop = {}, {}
local adds = {}  -- the counters' sums (count's ``add``) of each endpoint
for _, r in ipairs(cmsgpack.unpack(ARGV[4])) do
  local key = ARGV[1] .. r[1]
  local v = redis.call('HMGET', key, 'state', 'waits', 'data', 'owner', 'endpoint')
  if v[1] == 'waiting-for-endpoint' and v[2] then
    release(key)
    redis.call('SREM', ARGV[9] .. (v[5] or '') .. ARGV[10], r[1])
    redis.call('HSET', key, 'state', 'failed', 'result', r[2], 'ended', ARGV[2])
    redis.call('HDEL', key, 'payload', 'data', 'waits')
    redis.call('EXPIRE', key, ARGV[3])
    if v[3] then
      redis.call('DEL', ARGV[6] .. v[3])
      drop[#drop + 1] = v[3]
    end
    out[#out + 1] = r[1]
    local ep = v[5] or ''
    if not adds[ep] then adds[ep] = {} end
    add = adds[ep]
    count('failed', nil, nil, nil)  -- by state only: it has no run (as cancel)
    moved(v[4])
    settle(r[1], 'failed')
  end
end
if #out > 0 then
  redis.call('PUBLISH', ARGV[1] .. 'changed', table.concat(owners, ' '))
  redis.call('XADD', ARGV[11], '*', 'ids', table.concat(out, ' '))  -- for the SQL history
end
for ep, sums in pairs(adds) do
  add = sums
  flush(ARGV[13] .. ep .. ARGV[14])
end
local stream = ARGV[1] .. 'TO_FAIL'
for i = 15, #ARGV, 1000 do
  local part = {unpack(ARGV, i, math.min(i + 999, #ARGV))}
  redis.call('XACK', stream, ARGV[12], unpack(part))
  redis.call('XDEL', stream, unpack(part))
end
""".replace("TO_FAIL", TO_FAIL)
        + tell_ended("ARGV[1]", "out")  # wakes their waiters in other service processes
        + "return {out, drop}\n"
    )
