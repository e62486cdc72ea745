"""Event loops for the service, the endpoint agents and the SDK: uvloop where installed."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "run", "run_on"]

T = TypeVar("T")


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
