"""The client's large objects straight to and from an endpoint's node, not through the service.

::

    nimbus.put(big, endpoint="hpc")                   (1 MiB or more, pickled)
        written to this machine's store (a file, in memory)
        a task on hpc: expect_object -> its node's server, a pin's secret
        the file sent to that server (``_direct``: the pin's HMAC, sha256 checked)
        -> Ref(new id, hpc, holder=(server, secret, pin)), held as a relayed copy is
    ref.get() of a Ref held by a node this client put to so (1 MiB or more)
        fetched from that server into this machine's store (``_fetch.fetch_object``),
        read, the file unlinked (its mapping lives as long as the object's buffers)

Where the endpoint's node serves nothing, or the client cannot reach it (the endpoint
behind a firewall, ``NIMBUS_DATA_HOST`` on loopback while the client is elsewhere), the
object goes through the service as before, and so does every later one of that session:
one failed try, not one per object. Only a node that took a put is read from: one this
client is known to reach (a block's node on a cluster's private network may not be).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nimbus.data._ref import Ref, Session, new_id, session
from nimbus.errors import DataError

log = logging.getLogger(__name__)

DIRECT = 1 << 20  # bytes: a smaller object goes through the service (one round trip less)
CONNECT = 5.0  # seconds to reach an endpoint's node: then through the service
WAIT = 120.0  # seconds the endpoint may take to run the task that expects the object


def place(obj: object, where: Session) -> Ref | None:
    """``obj`` put on ``where``'s endpoint straight to one of its nodes: its Ref; None
    where it is small or there is no direct path (then the caller sends it through the
    service)."""
    from nimbus.data._direct import _send, expect_object
    from nimbus.data._fetch import request

    if not where.direct:
        return None
    local = session(None).store
    assert local is not None and where.call is not None
    staged = new_id()
    try:
        size = local.write(staged, obj, time.time() + WAIT)
    except OSError:  # no room in this machine's memory store: the service's way
        return None
    try:
        if size < DIRECT:
            return None
        copy_id = new_id()
        pin = copy_id + new_id()
        found = where.call(expect_object, copy_id, pin, time.time() + where.lease).result(WAIT)
        if found is None:  # that node serves nothing (its NIMBUS_DATA_HOST cannot listen)
            where.direct = False
            return None
        target = (str(found[0]), int(found[1]), str(found[2]))
        header = {"op": "put", "namespace": where.namespace, "pin": pin, "ref": copy_id}
        holder = (*target, pin)
        ref = where.adopt(Ref(copy_id, where.namespace, where.user, where.endpoint, size, holder))

        def opened() -> Any:
            sock = request(target, header, "put an object", CONNECT)[0]
            sock.settimeout(WAIT)
            return sock

        try:
            _send(local.path(staged), *target, None, opened)
        except (DataError, OSError) as exc:  # the pin freed with ``ref``
            where.direct = False
            log.info("%s: through the service from now on (%s)", _name(where), exc)
            return None
        where.reached.add(target[:2])
        return ref
    finally:
        local.free([staged])


def take(ref: Ref, where: Session) -> tuple[bool, Any]:
    """``(True, the object)`` of ``ref`` fetched straight from the node that holds it,
    where its Ref says which (``Ref.holder``); ``(False, None)`` where it cannot be."""
    from nimbus.data._fetch import fetch_object

    if ref.holder is None or tuple(ref.holder[:2]) not in where.reached or ref.size < DIRECT:
        return False, None
    local = session(None).store
    assert local is not None
    host, port, secret, pin = ref.holder
    staged = new_id()
    try:
        fetch_object(
            (host, port, secret), where.namespace, pin, local.path(staged), time.time() + WAIT
        )
        return True, local.read(staged)  # (its buffers map the file: unlinked, they live on)
    except (DataError, OSError) as exc:  # lost there, or its node gone: the service says
        where.reached.discard((host, port))
        log.info("%s: read through the service (%s)", _name(where), exc)
        return False, None
    finally:
        local.free([staged])


def _name(where: Session) -> str:
    from nimbus.data._ref import named

    return f"objects of endpoint {named(where.endpoint)!r}"
