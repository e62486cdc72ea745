"""``nimbus.Client``: the SDK of the nimbus service.

::

    client = Client()                                   # `nimbus login` saved URL and token
    task_id = client.run(square, 7, endpoint="lab")     # register, submit
    client.get_result(task_id)                          # 49 (waits on the service, no polling)

Functions are registered on first use (by the hash of their pickle), arguments
are pickled here and unpickled only on the endpoint's workers; results are
unpickled here. Arguments and results larger than the service's
``inline_payload`` go through its data store (``upload``/``download``) by
themselves. Errors of the service come back as
:class:`~nimbus.errors.ServiceError` subclasses (401/403 ``AuthError``, 404
``NotFound``, 413 ``PayloadTooLargeError``, 409 ``VersionMismatchError`` or
:class:`AmbiguousEndpointError`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from nimbus import serialization
from nimbus.config import (
    Settings,
    check_timeout,
    credentials_file,
    saved_credentials,
    untrusted_certificate,
)
from nimbus.environments import Environment, as_environment
from nimbus.errors import (
    AmbiguousEndpointError,
    AuthError,
    ConfigError,
    NotFound,
    PayloadTooLargeError,
    QuotaExceeded,
    RemoteTraceback,
    ServiceError,
    ServiceUnavailable,
    VersionMismatchError,
)
from nimbus.protocol import (
    DATA,
    INLINE_MIN,
    LIMITS,
    MSGPACK,
    PYTHON,
    SERIALIZER,
    Batch,
    DataRef,
    Result,
    SubmitRow,
    is_uuid,
    pack_payload,
    payload_size,
    slices,
    too_large,
    unpack,
)
from nimbus.runtime.messages import Status

__all__ = [
    "AmbiguousEndpointError",
    "Client",
    "credentials_file",
    "decode_result",
    "error_for",
    "save_credentials",
]

RECONNECT_SECONDS = 60.0  # get_result waits this long for a service that went away
RETRY_BACKOFF_MAX = 2.0  # seconds between retries of a call answered 503 (Retry-After)


def save_credentials(service_url: str, token: str) -> Path:
    path = credentials_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"service_url": service_url.rstrip("/"), "token": token}, out)
    return path


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds to wait before trying again a call answered 503 with Retry-After, else None."""
    if response.status_code != 503:
        return None
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def error_for(status: int, detail: str) -> ServiceError | PayloadTooLargeError:
    """The nimbus error of an HTTP status the service answered with."""
    if status in (401, 403):
        return AuthError(detail, status)
    if status == 404:
        return NotFound(detail, status)
    if status == 413:
        return PayloadTooLargeError(detail)
    if status == 503:
        return ServiceUnavailable(detail, status)
    if status == 429:
        return QuotaExceeded(detail, status)
    if status == 409 and "version mismatch" in detail:
        return ServiceVersionMismatch(detail, status)
    return ServiceError(detail, status)


class ServiceVersionMismatch(VersionMismatchError, ServiceError):
    """A 409 from the service: function and endpoint differ in Python or serializer."""


_PIN = re.compile(r"^\s*cloudpickle\s*===?\s*([0-9][0-9A-Za-z.+!-]*)\s*$", re.IGNORECASE)


def environment_mismatch(env: Environment) -> VersionMismatchError | None:
    """The error for an environment whose requirements pin another cloudpickle than
    this client's (its tasks could not be exchanged), naming both; else None.

    Checked at submit, before anything is sent or built. Its Python is the node's
    (which the service checks against the client's) unless it is an image: that one is
    compared when the node builds it, and the task fails with VersionMismatchError."""
    import cloudpickle

    ours = cloudpickle.__version__
    for requirement in env.requirements:
        pin = _PIN.match(requirement)
        if pin and pin.group(1) != ours:
            return VersionMismatchError(
                f"environment {env.name!r} pins cloudpickle {pin.group(1)} ({requirement!r}), "
                f"but this client runs Python {PYTHON} with cloudpickle {ours}: tasks could "
                f"not be exchanged; pin cloudpickle=={ours} in its requirements (or drop the pin)"
            )
    return None


def _usable_environment(environment: object) -> Environment | None:
    """``environment`` if it is None or an :class:`~nimbus.Environment` this client's
    functions can run in; ConfigError, or VersionMismatchError naming both versions."""
    environment = as_environment(environment)
    if environment is None:
        return None
    mismatch = environment_mismatch(environment)
    if mismatch is not None:
        raise mismatch
    return environment


def decode_result(result: bytes | list[Any], fetch: Callable[[str], bytes]) -> Any:
    """The value of a finished task's result, or raise its exception.

    ``result`` is packed or unpacked; a data-store reference is read with ``fetch``.
    """
    value = unpack(result) if isinstance(result, bytes) else result
    ref = DataRef.read(value)
    done = Result.unpack(fetch(ref.data_id)) if ref is not None else Result.decode(value)
    if done.status == Status.OK:
        return serialization.loads(done.data, done.buffers)
    if done.status == Status.SKIPPED:
        raise cf.CancelledError()
    error, tb = serialization.loads(done.data)
    if tb:
        error.__cause__ = RemoteTraceback(tb)
    raise error


class Client:
    """A connection to the nimbus service (HTTP; see ``nimbus.Executor`` for streaming)."""

    def __init__(
        self,
        service_url: str | None = None,
        token: str | None = None,
        *,
        settings: Settings | None = None,
        timeout: float = 60.0,
    ) -> None:
        settings = settings if settings is not None else Settings.load()
        saved = saved_credentials()
        url = service_url or settings.service_url or saved.get("service_url")
        token = token or settings.token or saved.get("token")
        if not url:
            raise ConfigError(
                "no nimbus service configured: run `nimbus login --service URL --token TOKEN` "
                "or set NIMBUS_SERVICE_URL and NIMBUS_TOKEN"
            )
        if not token:
            raise ConfigError(
                f"no token for the service at {url}: run `nimbus login --service {url} "
                f"--token TOKEN` or set NIMBUS_TOKEN"
            )
        self.service_url = url.rstrip("/")
        self.token = token
        self.settings = settings
        self._ssl: ssl.SSLContext | None = None
        self._http = httpx.Client(
            base_url=self.service_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            verify=self.ssl_context() or True,
        )
        self._functions = serialization.FunctionCache(by_value=True)
        self._registered: dict[str, str] = {}
        self._limits: dict[str, int] | None = None

    # ------------------------------------------------------------ plumbing

    def ssl_context(self) -> ssl.SSLContext | None:
        """How the service's certificate is verified (HTTPS and WSS); None for http://."""
        if not self.service_url.startswith("https://"):
            return None
        if self._ssl is None:
            self._ssl = self.settings.ssl_context()
        return self._ssl

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call; a 503 with Retry-After (the service's queues are restarting) is
        retried for up to RECONNECT_SECONDS (waits from 0.1 s, doubling, at most
        Retry-After), then raised as :class:`ServiceUnavailable`."""
        deadline = time.monotonic() + RECONNECT_SECONDS
        backoff = 0.1
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                untrusted = untrusted_certificate(exc, f"the nimbus service at {self.service_url}")
                if untrusted is not None:
                    raise untrusted from None
                hint = "is it running?"
                if isinstance(exc, httpx.RemoteProtocolError) and self.service_url.startswith(
                    "http:"
                ):
                    hint = "is it running, or does it serve TLS (then use its https:// URL)?"
                raise ServiceUnavailable(
                    f"cannot reach the nimbus service at {self.service_url} ({exc}); {hint}"
                ) from exc
            wait = _retry_after(response)
            if wait is None or time.monotonic() + backoff > deadline:
                break
            time.sleep(min(wait, backoff))
            backoff = min(RETRY_BACKOFF_MAX, backoff * 2)
        if response.status_code >= 400:
            try:
                body = response.json()
                detail = body["detail"]
            except (ValueError, TypeError, KeyError):  # not an answer of a nimbus service
                raise self._foreign(response, path) from None
            if response.status_code == 409 and isinstance(body, dict) and "choices" in body:
                raise AmbiguousEndpointError(str(detail), 409, [str(c) for c in body["choices"]])
            raise error_for(response.status_code, str(detail))
        return response

    def _foreign(self, response: httpx.Response, path: str) -> ServiceError:
        """The error of an answer with no nimbus ``detail`` (a proxy, another web server)."""
        status = response.status_code
        where = f"{self.service_url} answered {status} to {path}"
        if status >= 500:
            first = response.text.strip().splitlines()[0][:200] if response.text.strip() else ""
            said = f" ({first})" if first else ""
            if status == 503:
                return ServiceUnavailable(f"{where}{said}; is the nimbus service up?", status)
            return ServiceError(f"{where}{said}", status)
        return ServiceError(
            f"{where}: it is not a nimbus service (give the URL `nimbus service start` printed)",
            status,
        )

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ data store

    def limits(self) -> dict[str, int]:
        """The service's ``max_payload`` and ``inline_payload`` (asked once)."""
        if self._limits is None:
            self._limits = {k: int(v) for k, v in self._json("GET", LIMITS).items()}
        return self._limits

    def upload(self, blob: bytes) -> str:
        """Store ``blob`` in the service's data store; its data id."""
        limit = self.limits()["max_payload"]
        if len(blob) > limit:  # refused before a byte is sent
            raise too_large("a payload", len(blob), limit)
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(blob))}
        content = slices(blob)  # one write per slice: httpcore copies what a send leaves
        return str(self._json("PUT", DATA, content=content, headers=headers)["data_id"])

    def download(self, data_id: str) -> bytes:
        """The bytes of a data-store blob (yours, or a result of one of your tasks)."""
        return self.request("GET", f"{DATA}/{data_id}").content

    def payload(self, data: bytes, buffers: Sequence[Any]) -> bytes | DataRef:
        """A task's pickled arguments as sent: inline, or uploaded when large."""
        size = payload_size(data, buffers)
        if size > INLINE_MIN and size > self.limits()["inline_payload"]:
            return DataRef(self.upload(pack_payload(data, buffers)))
        return pack_payload(data, buffers)

    # ------------------------------------------------------------ functions

    def whoami(self) -> dict[str, Any]:
        return dict(self._json("GET", "/v1/whoami"))

    def register_function(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        *,
        environment: Environment | None = None,
    ) -> str:
        """Register ``fn`` (once per pickle) and return its function id.

        With ``environment``, the function's tasks run in it (for everyone who runs
        this function id) unless a call gives another (``ex.options(environment=...)``,
        ``batch_run(..., environment=...)``); this client's and executors' later
        submits of ``fn`` use that registration. Registering the same ``fn`` in
        another environment makes another function id.
        """
        key, body = self._functions.get(fn)
        found = self._registered.get(key)
        if found is None or environment is not None:
            env = _usable_environment(environment)
            label = str(name or getattr(fn, "__qualname__", type(fn).__qualname__))
            found = self.register_function_bytes(body, label, environment=env)
            self._registered[key] = found
        return found

    def register_function_bytes(
        self, body: bytes, name: str, *, environment: Environment | None = None, wraps: str = ""
    ) -> str:
        """Register a pickled function; without ``environment``, the owner's latest
        registration of these bytes is found (with the environment it was given), or,
        if there is none and ``wraps`` is the SHA-256 of the pickle of a function these
        bytes wrap, registered with the environment the owner registered that one with."""
        import base64

        request: dict[str, Any] = {
            "function": base64.b64encode(body).decode(),
            "name": name[:200],
            "python": PYTHON,
            "serializer": SERIALIZER,
        }
        if environment is not None:
            request["environment"] = environment.to_dict()
        elif wraps:
            request["wraps"] = wraps
        data = self._json("POST", "/v1/functions", json=request)
        return str(data["function_id"])

    def get_function(self, function_id: str) -> dict[str, Any]:
        return dict(self._json("GET", f"/v1/functions/{function_id}"))

    def delete_function(self, function_id: str) -> None:
        self.request("DELETE", f"/v1/functions/{function_id}")

    def share_function(
        self,
        function_id: str,
        users: Iterable[str] = (),
        *,
        public: bool | None = None,
        remove: Iterable[str] = (),
    ) -> dict[str, Any]:
        """Share your function with ``users``, stop sharing it with ``remove``, make it
        public or not; the function as it is now. Tasks of those who lost it that are
        still queued fail instead of running."""
        body = {"users": list(users), "public": public, "remove": list(remove)}
        return dict(self._json("POST", f"/v1/functions/{function_id}/share", json=body))

    # ------------------------------------------------------------ endpoints

    def register_endpoint(self, name: str) -> dict[str, Any]:
        """Register endpoint ``name`` (or find yours): its id and a new agent token."""
        return dict(self._json("POST", "/v1/endpoints", json={"name": name}))

    def endpoints(self, name: str | None = None) -> list[dict[str, Any]]:
        params = {"name": name} if name else {}
        return list(self._json("GET", "/v1/endpoints", params=params)["endpoints"])

    def get_endpoint(self, endpoint: str) -> dict[str, Any]:
        """An endpoint by id, by ``OWNER/NAME``, or by name: your own endpoint of that
        name, else the only one of that name you can use. A name that several
        endpoints of others answer to raises :class:`AmbiguousEndpointError` listing
        their ``OWNER/NAME`` (nothing is guessed); none raises ``NotFound``."""
        if is_uuid(endpoint):
            return dict(self._json("GET", f"/v1/endpoints/{endpoint}"))
        return dict(self._json("GET", "/v1/endpoints/resolve", params={"name": endpoint}))

    def order_environment(
        self, endpoint: str, action: str, name: str, environment: Environment | None = None
    ) -> dict[str, Any]:
        """Build ``environment`` (``action="build"``) on every node of ``endpoint`` now,
        or remove the environment ``name`` there (``action="remove"``; refused while
        tasks of it are not done): ``{order_id, endpoint_id, action, name, nodes: [{node,
        state, message, seconds}], done}``; follow it with :meth:`environment_order`."""
        endpoint_id = str(self.get_endpoint(endpoint)["endpoint_id"])
        spec = environment.to_dict() if environment is not None else None
        body = {"action": action, "name": name, "environment": spec}
        out = dict(self._json("POST", f"/v1/endpoints/{endpoint_id}/environments", json=body))
        return {**out, "endpoint_id": endpoint_id}

    def environment_order(self, endpoint_id: str, order_id: str) -> dict[str, Any]:
        """How each node does with an order of :meth:`order_environment`; ``done`` when
        every node said built, removed or failed."""
        return dict(self._json("GET", f"/v1/endpoints/{endpoint_id}/environments/{order_id}"))

    def share_endpoint(
        self,
        endpoint_id: str,
        users: Iterable[str] = (),
        *,
        public: bool | None = None,
        remove: Iterable[str] = (),
    ) -> dict[str, Any]:
        """Share your endpoint with ``users``, stop sharing it with ``remove``, make it
        public or not; the endpoint as it is now. The tasks not yet done of those who
        may no longer use it fail, saying so."""
        body = {"users": list(users), "public": public, "remove": list(remove)}
        return dict(self._json("POST", f"/v1/endpoints/{endpoint_id}/share", json=body))

    def delete_endpoint(self, endpoint_id: str) -> None:
        self.request("DELETE", f"/v1/endpoints/{endpoint_id}")

    # ------------------------------------------------------------ tasks

    def run(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        endpoint: str,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> str:
        """Submit ``fn(*args, **kwargs)`` to ``endpoint``; returns the task id."""
        return self.batch_run(fn, [args], endpoint=endpoint, kwargs=[kwargs], timeout=timeout)[0]

    def batch_run(
        self,
        fn: Callable[..., Any],
        args: Iterable[tuple[Any, ...]],
        *,
        endpoint: str,
        kwargs: Iterable[Mapping[str, Any]] | None = None,
        timeout: float | None = None,
        environment: Environment | None = None,
    ) -> list[str]:
        """Submit one task per tuple of ``args`` in one request; returns their task ids.
        ``environment`` is the :class:`~nimbus.Environment` they run in (default: the
        endpoint workers' own Python)."""
        timeout = check_timeout(timeout)
        environment = _usable_environment(environment)
        env = None if environment is None else environment.to_dict()
        function_id = self.register_function(fn)
        endpoint_id = self.get_endpoint(endpoint)["endpoint_id"]
        arg_list = list(args)
        kw_list = list(kwargs) if kwargs is not None else [{}] * len(arg_list)
        rows = []
        for a, k in zip(arg_list, kw_list, strict=True):
            data, buffers = serialization.dumps((tuple(a), dict(k)))
            rows.append(SubmitRow(function_id, self.payload(data, buffers), timeout, env))
        body = Batch(endpoint_id, rows).encode()
        response = self.request(
            "POST", "/v1/tasks/batch", content=body, headers={"Content-Type": MSGPACK}
        )
        return list(unpack(response.content)["task_ids"])

    def get_task(self, task_id: str) -> dict[str, Any]:
        """The task's state and record (timings, CPU, memory, network bytes)."""
        return dict(self._json("GET", f"/v1/tasks/{task_id}"))

    def get_result(self, task_id: str, timeout: float | None = None) -> Any:
        """Wait for the task and return its value (or raise its exception)."""
        end = None if timeout is None else time.monotonic() + timeout
        lost: float | None = None  # since when the service cannot be reached
        while True:
            wait = 60.0 if end is None else max(0.0, min(60.0, end - time.monotonic()))
            try:
                response = self.request(
                    "GET",
                    f"/v1/tasks/{task_id}/result",
                    params={"wait": wait},
                    headers={"Accept": MSGPACK},
                    timeout=wait + 30,
                )
            except ServiceUnavailable:  # restarting, perhaps: the task waits there
                now = time.monotonic()
                lost = now if lost is None else lost
                if now - lost > RECONNECT_SECONDS or (end is not None and now >= end):
                    raise
                time.sleep(0.2)
                continue
            lost = None
            body = unpack(response.content)
            if body["result"] is not None:
                try:
                    return decode_result(body["result"], self.download)
                except cf.CancelledError:
                    raise cf.CancelledError(
                        f"task {task_id} was cancelled (see `nimbus tasks show {task_id}`)"
                    ) from None
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"task {task_id} is still {body['state']} after {timeout} s")

    def list_tasks(
        self, status: str | None = None, *, endpoint: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        if endpoint:
            params["endpoint_id"] = endpoint
        return list(self._json("GET", "/v1/tasks", params=params)["tasks"])

    def cancel(self, task_id: str) -> bool:
        """Cancel a task that has not finished; whether it was."""
        return bool(self._json("POST", f"/v1/tasks/{task_id}/cancel")["cancelled"])

    # ------------------------------------------------------------ state stores

    def store(self, endpoint: str) -> dict[str, Any]:
        """A state store for programs on ``endpoint`` (see ``nimbus.service.stores``):
        its Redis ``url``, the ``key_prefix`` of your program ids, and the
        endpoint's ``endpoint_id``, ``name``, ``online`` and ``workers``."""
        endpoint_id = self.get_endpoint(endpoint)["endpoint_id"]
        return dict(self._json("POST", f"/v1/endpoints/{endpoint_id}/store"))
