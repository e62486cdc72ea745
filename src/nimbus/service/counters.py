"""The counters of finished tasks, kept in the queue Redis by the finish script itself.

::

    agent's results --> TaskStore.finish: one script call a batch --> each task stored
                        (its first result) counted: done:<state>, wait and run buckets
                        and sums, net bytes --> HINCRBY on the endpoint's metrics hash

``/metrics`` and the dashboard read the hash (``nimbus.service.metrics``). The
counting is Lua (:data:`COUNT`) spliced into the finish script, so a batch of
results costs one Redis call, not one to store and one to count, and the
service's loop does no per-task work for it. Fields: bucket counts (``wait:3``,
``run:16`` for +Inf), ``*:sum``, ``*:count``, ``net_in``, ``net_out`` and
``done:<state>``. The queue wait is the service's clock (submitted to dispatched,
from the task hash); the run time and the bytes are the worker's record.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from nimbus.records import TaskRecord
from nimbus.statestore import Keys

__all__ = ["BUCKETS", "COUNT", "measures", "metrics_key"]

# seconds: from a fast function on a warm worker to an hour-long job
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
           1800.0, 3600.0)  # fmt: skip


def metrics_key(keys: Keys, endpoint_id: str) -> str:
    """The hash of an endpoint's counters in the queue Redis."""
    return keys.endpoint_status(endpoint_id).removesuffix("status") + "metrics"


# count(state, submitted, dispatched, record, measures) for each task stored; flush(key) once.
# ``measures``: the record's {started, ended, net in, net out} (measures() in the service),
# or nil: then they are read from the record itself (packed, or a table).
_COUNT = """
local bounds = {BOUNDS}
local nbounds = #bounds
local add = {}
local done_keys, wait_keys, run_keys = {}, {}, {}  -- field names made once a call, not a task
for i = 0, nbounds do
  wait_keys[i] = 'wait:' .. i
  run_keys[i] = 'run:' .. i
end
local floor, tonumber, type = math.floor, tonumber, type
-- (plain loops and locals, no helper calls: this runs for every task a finish stores)
local numbers = {}  -- tonumber of each distinct time string once a call (a submit's tasks
local function number(x)  -- share their 'submitted', a take's their 'dispatched')
  if not x then return nil end
  local n = numbers[x]
  if n == nil then
    n = tonumber(x) or false
    numbers[x] = n
  end
  return n or nil
end
local function bucket(x)
  for i = 1, nbounds do
    if x <= bounds[i] then return i - 1 end
  end
  return nbounds
end
local function count(state, submitted, dispatched, rec, m)
  local field = done_keys[state]
  if not field then
    field = 'done:' .. state
    done_keys[state] = field
  end
  add[field] = (add[field] or 0) + 1
  local s, d = number(submitted), number(dispatched)
  if s and d and d > 0 then
    local wait = d - s
    if not (wait > 0) then wait = 0 end  -- (as math.max(0, wait))
    field = wait_keys[bucket(wait)]
    add[field] = (add[field] or 0) + 1
    add['wait:sum'] = (add['wait:sum'] or 0) + wait
    add['wait:count'] = (add['wait:count'] or 0) + 1
  end
  if type(m) ~= 'table' then
    local ok = true
    if type(rec) == 'string' then ok, rec = pcall(cmsgpack.unpack, rec) end
    if not ok or type(rec) ~= 'table' then return end
    m = {rec[STARTED], rec[ENDED], rec[NET_IN], rec[NET_OUT]}
  end
  local started, ended = m[1], m[2]
  if type(started) == 'number' and type(ended) == 'number' and started > 0 and ended > 0 then
    local run = ended - started
    if not (run > 0) then run = 0 end
    field = run_keys[bucket(run)]
    add[field] = (add[field] or 0) + 1
    add['run:sum'] = (add['run:sum'] or 0) + run
    add['run:count'] = (add['run:count'] or 0) + 1
  end
  local net = m[3]
  net = type(net) == 'number' and floor(net) or 0
  if not (net > 0) then net = 0 end
  add.net_in = (add.net_in or 0) + net
  net = m[4]
  net = type(net) == 'number' and floor(net) or 0
  if not (net > 0) then net = 0 end
  add.net_out = (add.net_out or 0) + net
end
local function flush(key)
  for field, n in pairs(add) do
    if string.sub(field, -4) == ':sum' then
      redis.call('HINCRBYFLOAT', key, field, tostring(n))
    elseif n ~= 0 then
      redis.call('HINCRBY', key, field, n)
    end
  end
end
"""
# 1-based places in the record's wire list (its fields in order), for the script
_PLACES = {f.name: i + 1 for i, f in enumerate(dataclasses.fields(TaskRecord))}
_WIRE_LEN = len(_PLACES)
_MEASURES = operator.itemgetter(
    *(_PLACES[name] - 1 for name in ("started", "ended", "net_bytes_in", "net_bytes_out"))
)


def measures(record: object) -> tuple[Any, ...] | None:
    """What the finish script counts of a record's wire list (``started``, ``ended``,
    ``net_bytes_in``, ``net_bytes_out``), picked here so that the script does not unpack
    each record; None (the script reads the record) for anything but a full list."""
    if type(record) is list and len(record) == _WIRE_LEN:
        picked: tuple[Any, ...] = _MEASURES(record)
        return picked
    return None


COUNT = (
    _COUNT.replace("BOUNDS", ", ".join(repr(b) for b in BUCKETS))
    .replace("STARTED", str(_PLACES["started"]))
    .replace("ENDED", str(_PLACES["ended"]))
    .replace("NET_IN", str(_PLACES["net_bytes_in"]))
    .replace("NET_OUT", str(_PLACES["net_bytes_out"]))
)
"""Lua: ``count(state, submitted, dispatched, record, measures)`` a task, ``flush(key)`` the
sums."""
