"""Limits at the HTTP edge: a request's head size (431) and the pace of its body (408).

::

    bytes --> HeadLimit (the uvicorn h11 protocol): a head (request line and
              |         headers) over ``max_header_bytes`` -> 431, connection closed
              v
            BodyTimeout (ASGI middleware): no part of the body within
              |         ``body_timeout`` seconds -> 408, connection closed
              v
            the app

A client that announces a large body and sends a few bytes holds a connection
(and, for ``PUT /v1/data``, a file) only until ``body_timeout``; one that sends
headers without end is cut at ``max_header_bytes``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from fastapi.responses import JSONResponse
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["BodyTimeout", "HeadLimit"]

_END_OF_HEAD = b"\r\n\r\n"


class HeadLimit(H11Protocol):
    """uvicorn's h11 protocol answering 431 to a request head over its limit
    (``Config.h11_max_incomplete_event_size``); uvicorn itself answers 400."""

    @property
    def limit(self) -> int:
        limit = self.config.h11_max_incomplete_event_size
        return DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit

    def handle_events(self) -> None:
        conn = self.conn
        if conn.their_state is h11.IDLE:
            buffered = conn.trailing_data[0]
            end = buffered.find(_END_OF_HEAD)
            head = len(buffered) if end < 0 else end
            if head > self.limit:
                self._too_large(head)
                return
        super().handle_events()

    def _too_large(self, size: int) -> None:
        limit = self.limit
        body = (
            f"request head of {size}+ bytes is over the limit of {limit} bytes "
            f"(NIMBUS_MAX_HEADER_BYTES on the service); send fewer or smaller headers"
        ).encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self.logger.warning("refused a request head over %d bytes (431)", limit)
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            + b"".join(name + b": " + value + b"\r\n" for name, value in headers)
            + b"\r\n"
            + body
        )
        self.transport.close()


class _BodyStalled(Exception):
    pass


class BodyTimeout:
    """Answer 408 (and close) when a request body's next part takes over ``timeout`` s."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:  # the body is in: what follows is a disconnect, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                raise _BodyStalled from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except _BodyStalled:
            if started:
                raise
            await _stalled(self.timeout)(scope, receive, send)
        except BaseExceptionGroup as group:  # raised inside a task group (streaming routes)
            stalled, rest = group.split(_BodyStalled)
            if stalled is None or started:
                raise
            if rest is not None:
                raise rest from None
            await _stalled(self.timeout)(scope, receive, send)


def _stalled(timeout: float) -> Any:
    detail = (
        f"the request body stalled: no part of it came within {timeout} s "
        f"(NIMBUS_BODY_TIMEOUT on the service); send the whole body the request announces"
    )
    return JSONResponse({"detail": detail}, 408, headers={"Connection": "close"})
