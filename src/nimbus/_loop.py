"""Event loops for the service, the endpoint agents and the SDK: uvloop where installed;
and the collector's thresholds of the processes nimbus runs to serve tasks."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["SERVING_GC", "new_event_loop", "run", "run_on", "serving_gc"]

T = TypeVar("T")

# the collector's thresholds of a serving process (serving_gc); the stdlib's: (700, 10, 10)
SERVING_GC = (20_000, 10, 10)
_stdlib_gc = gc.get_threshold()
_forks_reset = False


def serving_gc() -> None:
    """Collect the young objects after 20,000 allocations, not the stdlib's 700: for a
    process nimbus runs that serves tasks and runs no user code (the service, its
    history writer, an endpoint's daemon). The objects a task makes there (its messages,
    rows and futures) are mostly freed before such a collection, so few reach the oldest
    generation, whose collections walk every object of the process: in the throughput
    bench they cost the service 4-5 CPU us a task. A process forked from this one (a
    worker, which runs user code) gets the stdlib's thresholds back."""
    global _forks_reset
    gc.set_threshold(*SERVING_GC)
    if not _forks_reset:
        _forks_reset = True
        os.register_at_fork(after_in_child=lambda: gc.set_threshold(*_stdlib_gc))


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # not on this platform: the stdlib's loop works, slower
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on :func:`new_event_loop`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)


def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, object]) -> None:
    """Run ``coro`` on ``loop`` in this thread (a loop thread's target), then close ``loop``."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()
