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
local add = {}
local done_keys, wait_keys, run_keys = {}, {}, {}  -- field names made once a call, not a task
for i = 0, #bounds do
  wait_keys[i] = 'wait:' .. i
  run_keys[i] = 'run:' .. i
end
local function bucket(x)
  for i, b in ipairs(bounds) do
    if x <= b then return i - 1 end
  end
  return #bounds
end
local function inc(field, n) add[field] = (add[field] or 0) + n end
local function num(x) if type(x) == 'number' then return x end return nil end
local function count(state, submitted, dispatched, rec, m)
  local done = done_keys[state]
  if not done then
    done = 'done:' .. state
    done_keys[state] = done
  end
  inc(done, 1)
  local s, d = tonumber(submitted), tonumber(dispatched)
  if s and d and d > 0 then
    local wait = math.max(0, d - s)
    inc(wait_keys[bucket(wait)], 1); inc('wait:sum', wait); inc('wait:count', 1)
  end
  if type(m) ~= 'table' then
    local ok = true
    if type(rec) == 'string' then ok, rec = pcall(cmsgpack.unpack, rec) end
    if not ok or type(rec) ~= 'table' then return end
    m = {rec[STARTED], rec[ENDED], rec[NET_IN], rec[NET_OUT]}
  end
  local started, ended = num(m[1]), num(m[2])
  if started and ended and started > 0 and ended > 0 then
    local run = math.max(0, ended - started)
    inc(run_keys[bucket(run)], 1); inc('run:sum', run); inc('run:count', 1)
  end
  inc('net_in', math.max(0, math.floor(num(m[3]) or 0)))
  inc('net_out', math.max(0, math.floor(num(m[4]) or 0)))
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
