"""The service's data store, as the endpoint daemon uses it: a task's arguments fetched
before it starts, a large result stored before it is sent.

::

    TaskRow(payload=DataRef)  -> arguments(task_id, data_id): GET /v1/data/{id} -> the
                                 payload, or the RemoteError the task fails with
    a result > INLINE_MIN     -> result(row): the service's limits (GET /v1/limits, once);
                                 at most inline_payload: the row as it is; over max_payload:
                                 the error it fails with; else PUT /v1/data -> the row with a
                                 DataRef, or None (404: done elsewhere or cancelled); a failed
                                 try again, with backoff

Each transfer runs as a job of its own (:meth:`Transfers.spawn`); :meth:`close`
cancels those under way and closes the HTTP client.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Coroutine
from typing import Any

import httpx

from nimbus.errors import RemoteError
from nimbus.protocol import DATA, LIMITS, DataRef, Result, ResultRow, payload_size, too_large

__all__ = ["Transfers"]

log = logging.getLogger(__name__)


class Transfers:
    """One daemon's transfers to and from the service's data store."""

    def __init__(
        self,
        service_url: str,
        token: str,
        ssl_context: ssl.SSLContext | None,
        *,
        backoff: tuple[float, float],
    ) -> None:
        self.service_url = service_url
        self.token = token
        self.backoff = backoff  # (first, most) seconds between tries of a result
        self._ssl = ssl_context
        self._jobs: set[asyncio.Task[None]] = set()  # transfers under way
        self._http: httpx.AsyncClient | None = None
        self._limits: dict[str, int] | None = None  # the service's (GET /v1/limits), asked once

    def open(self) -> None:
        """In the daemon's event loop, as it starts: the HTTP client."""
        self._http = httpx.AsyncClient(
            base_url=self.service_url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=httpx.Timeout(60.0, connect=10.0),
            verify=self._ssl or True,
        )

    async def close(self) -> None:
        """Cancel the transfers under way, and close the HTTP client."""
        for job in list(self._jobs):
            job.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` (a transfer and what follows it) as a job of its own."""
        job = asyncio.ensure_future(coro)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    async def arguments(self, task_id: str, data_id: str) -> bytes | RemoteError:
        """The arguments of task ``task_id``, stored as ``data_id``; or why they are not."""
        assert self._http is not None
        try:
            response = await self._http.get(f"{DATA}/{data_id}")
            response.raise_for_status()
        except (httpx.HTTPError, OSError) as exc:
            return RemoteError(
                f"the arguments of task {task_id} could not be fetched from the service's "
                f"data store ({data_id}): {exc}"
            )
        return response.content

    async def result(self, row: ResultRow) -> ResultRow | Exception | None:
        """``row`` to send: inline below the service's limit, else with its result stored
        (a DataRef); the error its task fails with if it is too large; None if the service
        needs it no more."""
        assert self._http is not None
        task_id = row.task_id
        result = row.result
        assert isinstance(result, Result)
        data, buffers = result.data, result.buffers
        backoff, most = self.backoff
        while True:
            try:
                if self._limits is None:
                    limits = await self._http.get(LIMITS)
                    limits.raise_for_status()
                    self._limits = {k: int(v) for k, v in limits.json().items()}
                size = payload_size(data, buffers)
                if size <= self._limits["inline_payload"]:
                    return row
                if size > self._limits["max_payload"]:  # refused before a byte is sent
                    return too_large(
                        f"the result of task {task_id}", size, self._limits["max_payload"]
                    )
                blob = result.pack()
                response = await self._http.put(DATA, params={"task_id": task_id}, content=blob)
                if response.status_code == 404:  # done elsewhere or cancelled: not needed
                    return None
                response.raise_for_status()
                return row._replace(result=DataRef(response.json()["data_id"]))
            except (httpx.HTTPError, OSError, ValueError) as exc:
                log.info("storing the result of %s failed (%s); retrying", task_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(most, backoff * 2)
