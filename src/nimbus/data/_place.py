"""The client's large objects straight to and from an endpoint's node, not through the service.

::

    nimbus.put(big, endpoint="hpc")                   (1 MiB or more, pickled)
        written to this machine's store (a file, in memory)
        a task on hpc: expect_object -> its node's server, a pin's secret
        the file sent to that server (``_direct``: the pin's HMAC, sha256 checked)
        -> Ref(new id, hpc, holder=(server, secret, pin)), held as a relayed copy is
    ref.get() / future.result() of an object of 1 MiB or more kept there
        the node its Ref names, if this client reached it before; else a task there
        (reopen) says where (its node's server, a short-leased pin's secret)
        fetched from that server into this machine's store (``_fetch.fetch_object``),
        read, the file unlinked (its mapping lives as long as the object's buffers)

Where the endpoint's node serves nothing (it cannot listen on its ``NIMBUS_DATA_HOST``;
an endpoint's agent serves before it is online), or the client cannot reach it (the endpoint behind a firewall, ``NIMBUS_DATA_HOST`` on
loopback while the client is elsewhere), the object goes through the service as before,
and so do the session's next ones for ``AGAIN`` or ``UNREACHABLE`` s: one failed try,
not one per object; a connection waits ``CONNECT`` s at most (a node on a cluster's
private network may drop what comes from outside).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Any

from nimbus import serialization
from nimbus.data._ref import Ref, Session, named, new_id, session
from nimbus.errors import ConfigError, DataError, ReferenceLost

log = logging.getLogger(__name__)

DIRECT = 1 << 20  # bytes: a smaller object goes through the service (one round trip less)
CONNECT = 5.0  # seconds to reach an endpoint's node: then through the service
WAIT = 120.0  # seconds a staged object or a reopened pin is leased for its transfer
AGAIN = 10.0  # seconds before a put tries again an endpoint whose node served nothing
UNREACHABLE = 300.0  # seconds before the client tries again a node it could not reach


def place(obj: object, where: Session) -> Ref | None:
    """``obj`` put on ``where``'s endpoint straight to one of its nodes: its Ref; None
    where it is small or there is no direct path (then the caller sends it through the
    service)."""
    from nimbus.data._direct import _send
    from nimbus.data._fetch import request

    if time.monotonic() < where.direct_after or not _allowed():
        return None
    dumped = serialization.dumps(obj)  # (a small object is pickled again by the service's way)
    if len(dumped[0]) + sum(b.raw().nbytes for b in dumped[1]) < DIRECT:
        return None
    assert where.call is not None
    staged = new_id()
    try:
        local = session(None).store
        assert local is not None
        size = local.write_dumped(staged, dumped, time.time() + WAIT)
    except (OSError, ConfigError):  # no room in this machine's memory store, or none
        return None
    try:
        copy_id = new_id()
        pin = copy_id + new_id()
        try:  # (as long as the endpoint's workers are busy, as a put through the service)
            found = where.call(expect, copy_id, pin, where.lease).result()
        except ReferenceLost:  # (the watch's word for an offline endpoint: no object here)
            name = named(where.endpoint)
            raise DataError(
                f"nimbus.put(obj, endpoint={name!r}): endpoint {name!r} is offline (stopped, "
                f"or cut off from the service); start it (`nimbus endpoint start {name}`) "
                f"and try again"
            ) from None
        if found is None:  # that node serves nothing (not yet: its agent just started, or
            where.direct_after = time.monotonic() + AGAIN  # its NIMBUS_DATA_HOST is wrong)
            return None
        if local.renew([staged], time.time() + WAIT):  # swept while the workers were busy
            try:
                local.write_dumped(staged, dumped, time.time() + WAIT)
            except OSError:
                return None
        target = (str(found[0]), int(found[1]), str(found[2]))
        header = {"op": "put", "namespace": where.namespace, "pin": pin, "ref": copy_id}
        holder = (*target, pin)
        ref = where.adopt(Ref(copy_id, where.namespace, where.user, where.endpoint, size, holder))

        def opened() -> Any:
            sock = request(target, header, "put an object", WAIT, CONNECT)[0]  # (busy: waited)
            sock.settimeout(WAIT)
            return sock

        try:
            _send(local.path(staged), *target, None, opened)
        except (DataError, OSError) as exc:  # the pin freed with ``ref``
            _unreachable(where, exc)
            return None
        where.reached.add(target[:2])
        return ref
    finally:
        local.free([staged])


def expect(ref_id: str, pin: str, lease: float) -> tuple[str, int, str] | None:
    """A task on the endpoint: :func:`~nimbus.data._direct.expect_object`, the pin leased
    ``lease`` s from when it runs (not from when the client asked: it may wait behind
    busy workers longer than that)."""
    from nimbus.data._direct import expect_object

    return expect_object(ref_id, pin, time.time() + lease)


def take(ref: Ref, where: Session, timeout: float | None) -> tuple[bool, Any]:
    """``(True, the object)`` of ``ref`` (1 MiB or more) fetched straight from the node
    of its endpoint that keeps it: from the node its Ref names (``Ref.holder``) if this
    client reached that node before, else from where a task there says (:func:`reopen`);
    ``(False, None)`` where it cannot be (then the caller reads it through the service).
    ``cf.TimeoutError`` once ``timeout`` s passed waiting for that task."""
    if ref.size < DIRECT or time.monotonic() < where.direct_after or not _allowed():
        return False, None
    assert where.call is not None
    if ref.holder is not None and tuple(ref.holder[:2]) in where.reached:
        host, port, secret, pin = ref.holder
        try:
            return True, _fetched(ref, where, (host, port, secret), pin)
        except (DataError, OSError) as exc:  # its node's server moved (restarted), or gone
            where.reached.discard((host, port))
            log.info("%r: not read from the node its Ref names (%s)", ref, exc)
    asked = where.call(reopen, ref.id, WAIT, keep=False)
    try:
        found = asked.result(timeout)
    except cf.TimeoutError:
        asked.cancel()
        raise
    if found is None:  # not on the node that ran it, or that node serves nothing
        return False, None
    host, port, secret, pin = str(found[0]), int(found[1]), str(found[2]), str(found[3])
    try:
        obj = _fetched(ref, where, (host, port, secret), pin)
    except (DataError, OSError) as exc:  # not reachable from here: the service's way
        _unreachable(where, exc)
        return False, None
    where.reached.add((host, port))
    return True, obj


def _fetched(ref: Ref, where: Session, server: tuple[str, int, str], pin: str) -> Any:
    """``ref``'s object fetched from ``server`` with ``pin`` into this machine's store,
    read, and unlinked there (the object's buffers map the file: they live on)."""
    from nimbus.data._fetch import fetch_object, lock_of

    if pin[:32] != ref.id:
        raise DataError(f"{ref!r}: the pin {pin!r} names another object")
    local = session(None).store
    assert local is not None
    staged = new_id()
    try:
        path = local.path(staged)
        fetch_object(server, where.namespace, pin, path, time.time() + WAIT, CONNECT)
        return local.read(staged)
    finally:
        local.free([staged])
        lock_of(local.path(staged)).unlink(missing_ok=True)  # (its fetch's: of no use now)


def reopen(ref_id: str, lease: float) -> tuple[str, int, str, str] | None:
    """A task on the endpoint: where the client fetches the object ``ref_id`` from, if
    this node keeps it and serves (its server, a new pin's secret and the pin, leased
    ``lease`` s from now by this node's clock, 120 s at most: swept then, the object
    stays); else None."""
    from nimbus.data._task import _holder, _node, _scope

    if not _node(_scope().namespace).exists(ref_id):
        return None
    return _holder(ref_id, time.time() + min(lease, WAIT))


def _allowed() -> bool:
    """Whether large objects may go straight between this client and nodes (in clear):
    ``NIMBUS_DATA_DIRECT``."""
    from nimbus.config import Settings

    return bool(Settings.lookup("data_direct"))


def _unreachable(where: Session, exc: BaseException) -> None:
    """The session's large objects through the service for ``UNREACHABLE`` s."""
    where.direct_after = time.monotonic() + UNREACHABLE
    log.info(
        "objects of endpoint %r go through the service for %.0f s: its node cannot be reached "
        "from here (%s)",
        named(where.endpoint),
        UNREACHABLE,
        exc,
    )
