"""The wire contract: every message encodes to the bytes the service, its endpoint
daemons and the SDK exchanged before the messages were dataclasses (golden vectors,
written from that code), decodes back to an equal dataclass, and a malformed one
raises ProtocolError naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from nimbus import Environment
from nimbus.errors import ProtocolError
from nimbus.protocol import (
    NOT_MSGPACK,
    TEXT_FRAME,
    WRONG_SHAPE,
    Accepted,
    Ack,
    Batch,
    Beat,
    Cancel,
    DataRef,
    Hello,
    Malformed,
    Message,
    Refused,
    Result,
    ResultRow,
    Results,
    Running,
    Submit,
    SubmitRow,
    TaskRow,
    Tasks,
    Unknown,
    Watch,
    decode_frame,
    decode_message,
    new_row,
    pack,
    pack_payload,
    pack_result,
    unpack,
)
from nimbus.records import TaskRecord, TaskState

T1, T2 = "0d9a6f3e-6b1a-4a55-9d0e-5b8e1f6c2a01", "7c1e2d3f-0000-4000-8000-000000000002"
F = "f" * 64
E = "1b2c3d4e-5f60-4718-8a9b-0c1d2e3f4a5b"
RECORD = TaskRecord(
    T1, TaskState.SUCCESS, function=F, worker="w1", host="h", pid=42, submitted=1.5,
    dispatched=2.0, started=2.25, ended=3.0, cpu_user=0.5, cpu_system=0.25,
    peak_memory=1024, net_bytes_in=7, net_bytes_out=9,
).to_wire()  # fmt: skip
PAYLOAD = pack_payload(b"pickle", [b"buffer"])

# The bytes the code before nimbus.protocol put on the wire for these messages
# (packed from the dicts and lists it built by hand); submit's and tasks' rows have
# carried a trailing environment (None here) since, and tasks' rows a trailing owner
# after it (OLD and SIX below: still read).
GOLDEN = {
    "payload": "92c4067069636b6c6591c406627566666572",
    "result": "9300c4046461746191c403627566",
    "hello": "86a26f70a568656c6c6fa6707974686f6ea4332e3132aa73657269616c697a6572b47069636b6c65352b636c6f75647069636b6c6533a7776f726b65727304a677696e646f77cd0400a468656c6491d92430643961366633652d366231612d346135352d396430652d356238653166366332613031",
    "agent_results": "82a26f70a7726573756c7473a7726573756c74739294d92430643961366633652d366231612d346135352d396430652d356238653166366332613031a7737563636573739300c4046461746191c403627566dc0015d92430643961366633652d366231612d346135352d396430652d356238653166366332613031a773756363657373d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666a27731a1682acb3ff8000000000000cb4000000000000000cb4002000000000000cb4008000000000000cb3fe0000000000000cb3fd0000000000000cd04000709a6736f636b65740000c0c0cb000000000000000094d92437633165326433662d303030302d343030302d383030302d303030303030303030303032a66661696c656481a464617461a26431dc0015d92430643961366633652d366231612d346135352d396430652d356238653166366332613031a773756363657373d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666a27731a1682acb3ff8000000000000cb4000000000000000cb4002000000000000cb4008000000000000cb3fe0000000000000cb3fd0000000000000cd04000709a6736f636b65740000c0c0cb0000000000000000",
    "running": "82a26f70a772756e6e696e67a369647392d92430643961366633652d366231612d346135352d396430652d356238653166366332613031d92437633165326433662d303030302d343030302d383030302d303030303030303030303032",
    "beat": "82a26f70a462656174a174cb40c81cd6c8b43958",
    "tasks": "82a26f70a57461736b73a57461736b739297d92430643961366633652d366231612d346135352d396430652d356238653166366332613031d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c404626f6479c41292c4067069636b6c6591c406627566666572cb403e000000000000c0c097d92437633165326433662d303030302d343030302d383030302d303030303030303030303032d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c081a464617461a26432c0c0c0",
    "ack": "82a26f70a361636ba369647391d92430643961366633652d366231612d346135352d396430652d356238653166366332613031",
    "cancel": "82a26f70a663616e63656ca369647392d92430643961366633652d366231612d346135352d396430652d356238653166366332613031d92437633165326433662d303030302d343030302d383030302d303030303030303030303032",
    "submit": "84a26f70a67375626d6974a372656603ab656e64706f696e745f6964d92431623263336434652d356636302d343731382d386139622d306331643265336634613562a57461736b739294d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c41292c4067069636b6c6591c406627566666572c0c094d9406666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666681a464617461a26433cb4014000000000000c0",
    "watch": "82a26f70a57761746368a369647392d92430643961366633652d366231612d346135352d396430652d356238653166366332613031d92437633165326433662d303030302d343030302d383030302d303030303030303030303032",
    "accepted": "84a26f70a86163636570746564a372656603a369647392d92430643961366633652d366231612d346135352d396430652d356238653166366332613031d92437633165326433662d303030302d343030302d383030302d303030303030303030303032a567726f7570d92431623263336434652d356636302d343731382d386139622d306331643265336634613562",
    "refused": "84a26f70a772656675736564a372656603a6737461747573cd019da664657461696ca9746f6f206c61726765",
    "client_results": "82a26f70a7726573756c7473a7726573756c74739294d92430643961366633652d366231612d346135352d396430652d356238653166366332613031a773756363657373c4099300c4046461746190c4c8dc0015d92430643961366633652d366231612d346135352d396430652d356238653166366332613031a773756363657373d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666a27731a1682acb3ff8000000000000cb4000000000000000cb4002000000000000cb4008000000000000cb3fe0000000000000cb3fd0000000000000cd04000709a6736f636b65740000c0c0cb000000000000000094d92437633165326433662d303030302d343030302d383030302d303030303030303030303032a963616e63656c6c6564c4059302c40090c400",
    "unknown": "82a26f70a7756e6b6e6f776ea369647391d92437633165326433662d303030302d343030302d383030302d303030303030303030303032",
}

MESSAGES: dict[str, Message] = {
    "hello": Hello("3.12", "pickle5+cloudpickle3", 4, 1024, [T1]),
    "agent_results": Results(
        [
            ResultRow(T1, TaskState.SUCCESS, Result(0, b"data", [b"buf"]), RECORD),
            ResultRow(T2, TaskState.FAILED, DataRef("d1"), RECORD),
        ]
    ),
    "running": Running([T1, T2]),
    "beat": Beat(12345.678),
    "tasks": Tasks(
        [
            TaskRow(T1, F, b"body", PAYLOAD, 30.0),
            TaskRow(T2, F, None, DataRef("d2"), None),
        ]
    ),
    "ack": Ack([T1]),
    "cancel": Cancel([T1, T2]),
    "submit": Submit(3, E, [SubmitRow(F, PAYLOAD, None), SubmitRow(F, DataRef("d3"), 5.0)]),
    "watch": Watch([T1, T2]),
    "accepted": Accepted(3, [T1, T2], E),
    "refused": Refused(3, 413, "too large"),
    "client_results": Results(
        [
            ResultRow(T1, TaskState.SUCCESS, Result(0, b"data").pack(), pack(RECORD)),
            ResultRow(T2, TaskState.CANCELLED, Result(2, b"").pack(), b""),
        ]
    ),
    "unknown": Unknown([T2]),
}
KINDS: dict[str, type[Message]] = {
    kind.op: kind
    for kind in (Hello, Results, Running, Beat, Tasks, Ack, Cancel, Submit, Watch, Accepted)
}
KINDS.update({"refused": Refused, "unknown": Unknown})


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_each_message_encodes_to_the_bytes_of_before(name: str) -> None:
    assert MESSAGES[name].encode().hex() == GOLDEN[name]


def test_a_record_row_of_before_the_network_and_build_fields_still_reads() -> None:
    """Results' records carry 26 fields since net_source...colocated (issue 19) and
    build_seconds (issue 18); a peer's 20-field row reads with their defaults."""
    old = TaskRecord.from_wire(RECORD[:20])
    assert old == TaskRecord.from_wire(RECORD)
    assert (old.net_source, old.tcp, old.build_seconds) == ("socket", None, 0.0)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_each_message_decodes_back(name: str) -> None:
    frame = bytes.fromhex(GOLDEN[name])
    message = decode_message(decode_frame(frame, KINDS), KINDS)
    assert message == MESSAGES[name]
    assert message.encode() == frame


def test_payloads_and_results_pack_as_before() -> None:
    assert PAYLOAD.hex() == GOLDEN["payload"]
    assert Result(0, b"data", [b"buf"]).pack().hex() == GOLDEN["result"]
    assert pack_result(0, b"data", [b"buf"]) == Result(0, b"data", [b"buf"]).pack()
    assert Result.unpack(bytes.fromhex(GOLDEN["result"])) == Result(0, b"data", [b"buf"])


BATCH = "82ab656e64706f696e745f6964d92431623263336434652d356636302d343731382d386139622d306331643265336634613562a57461736b739294d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c41292c4067069636b6c6591c406627566666572c0c094d9406666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666681a464617461a26433cb4014000000000000c0"
# Before rows carried an environment (three and five fields): still read.
OLD_BATCH = "82ab656e64706f696e745f6964d92431623263336434652d356636302d343731382d386139622d306331643265336634613562a57461736b739293d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c41292c4067069636b6c6591c406627566666572c093d9406666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666681a464617461a26433cb4014000000000000"
OLD = {
    "submit": "84a26f70a67375626d6974a372656603ab656e64706f696e745f6964d92431623263336434652d356636302d343731382d386139622d306331643265336634613562a57461736b739293d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c41292c4067069636b6c6591c406627566666572c093d9406666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666681a464617461a26433cb4014000000000000",
    "tasks": "82a26f70a57461736b73a57461736b739295d92430643961366633652d366231612d346135352d396430652d356238653166366332613031d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c404626f6479c41292c4067069636b6c6591c406627566666572cb403e00000000000095d92437633165326433662d303030302d343030302d383030302d303030303030303030303032d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c081a464617461a26432c0",
}


@pytest.mark.parametrize("name", sorted(OLD))
def test_rows_without_an_environment_still_decode(name: str) -> None:
    frame = bytes.fromhex(OLD[name])
    assert decode_message(decode_frame(frame, KINDS), KINDS) == MESSAGES[name]


# Tasks' rows before they carried their owner (six fields, with the environment).
SIX = "82a26f70a57461736b73a57461736b739296d92430643961366633652d366231612d346135352d396430652d356238653166366332613031d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c404626f6479c41292c4067069636b6c6591c406627566666572cb403e000000000000c096d92437633165326433662d303030302d343030302d383030302d303030303030303030303032d94066666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666c081a464617461a26432c0c0"


def test_task_rows_carry_their_owner_and_rows_without_one_still_decode() -> None:
    assert decode_message(decode_frame(bytes.fromhex(SIX), KINDS), KINDS) == MESSAGES["tasks"]
    owned = Tasks([TaskRow(T1, F, None, PAYLOAD, 1.0, None, "user-1")])
    assert decode_message(decode_frame(owned.encode(), KINDS), KINDS) == owned
    slow = Tasks([TaskRow(T1, F, None, DataRef("d"), 1.0, None, "user-1")])  # the checked path
    assert decode_message(decode_frame(slow.encode(), KINDS), KINDS) == slow


def test_an_old_rest_batch_body_still_decodes() -> None:
    batch = Batch(E, [SubmitRow(F, PAYLOAD, None), SubmitRow(F, DataRef("d3"), 5.0)])
    assert Batch.decode(bytes.fromhex(OLD_BATCH)) == batch


def test_the_rest_batch_body_is_a_typed_message_with_the_bytes_of_before() -> None:
    """POST /v1/tasks/batch's body, {endpoint_id, tasks}, as the SDK packed it by hand."""
    batch = Batch(E, [SubmitRow(F, PAYLOAD, None), SubmitRow(F, DataRef("d3"), 5.0)])
    assert batch.encode().hex() == BATCH
    assert Batch.decode(bytes.fromhex(BATCH)) == batch
    for body, field in [
        (b"\xc1", "body"),
        (pack([E]), "body"),
        (pack({"endpoint_id": E}), "body"),
        (pack({"endpoint_id": 5, "tasks": []}), "endpoint_id"),
        (pack({"endpoint_id": E, "tasks": [[F, 7, None]]}), "tasks[0].payload"),
    ]:
        with pytest.raises(ProtocolError) as info:
            Batch.decode(body)
        assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_rows_are_tuples_that_pack_as_their_wire_lists() -> None:
    """No conversion per row: a row is its wire list (a DataRef packs as {"data": id})."""
    row = TaskRow(T1, F, None, PAYLOAD, 1.0)
    assert pack(row) == pack([T1, F, None, PAYLOAD, 1.0, None, None])
    assert pack(SubmitRow(F, DataRef("d"), None)) == pack([F, {"data": "d"}, None, None])
    assert pack(Result(0, b"x", [memoryview(b"buf")])) == pack([0, b"x", [b"buf"]])
    assert new_row(TaskRow, (T1, F, None, PAYLOAD, 1.0, None, None)) == row
    with pytest.raises(TypeError, match="cannot pack"):
        pack(object())


def test_an_accepted_without_a_group_is_read() -> None:
    """An older service (and the SDK's test doubles) send no group."""
    msg = unpack(pack({"op": "accepted", "ref": 1, "ids": [T1]}))
    assert Accepted.decode(msg) == Accepted(1, [T1])
    assert Accepted(1, [T1]).encode() == pack(msg)


MALFORMED: list[tuple[type[Message], dict[str, Any], str]] = [
    (Hello, {"python": 5}, "hello.python"),
    (Hello, {"window": 0}, "hello.window"),
    (Hello, {"workers": True}, "hello.workers"),
    (Hello, {"held": "t1"}, "hello.held"),
    (Ack, {"ids": 7}, "ack.ids"),
    (Cancel, {"ids": [1]}, "cancel.ids"),
    (Watch, {}, "watch.ids"),
    (Unknown, {"ids": None}, "unknown.ids"),
    (Running, {"ids": "x"}, "running.ids"),
    (Tasks, {"tasks": 5}, "tasks.tasks"),
    (Results, {"results": 5}, "results.results"),
    (Results, {"results": [[T1, "success"]]}, "results.results[0]"),
    (Accepted, {"ref": "r", "ids": []}, "accepted.ref"),
    (Accepted, {"ref": 1, "ids": [], "group": 5}, "accepted.group"),
    (Refused, {"ref": 1, "status": "no", "detail": ""}, "refused.status"),
    (Refused, {"ref": 1, "status": 400, "detail": None}, "refused.detail"),
    (Submit, {"ref": 1, "endpoint_id": 5, "tasks": []}, "endpoint_id"),
    (Submit, {"ref": 1, "endpoint_id": E, "tasks": {"a": 1}}, "tasks"),
    (Submit, {"ref": 1, "endpoint_id": E, "tasks": [[F, PAYLOAD]]}, "tasks[0]"),
    (Submit, {"ref": 1, "endpoint_id": E, "tasks": [[5, PAYLOAD, None]]}, "tasks[0].function_id"),
    (Submit, {"ref": 1, "endpoint_id": E, "tasks": [[F, {"data": 5}, None]]}, "tasks[0].payload"),
    (Submit, {"ref": 1, "endpoint_id": E, "tasks": [[F, PAYLOAD, None], [F, 7, 1]]}, "tasks[1].payload"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "fields", "field"), MALFORMED)
def test_a_malformed_message_raises_protocol_error_naming_the_field(
    kind: type[Message], fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        kind.decode({"op": kind.op, **fields})
    assert str(info.value).startswith(f"{field}:"), str(info.value)
    assert info.value.code == WRONG_SHAPE


def test_a_malformed_row_fails_alone_naming_its_field() -> None:
    tasks = Tasks.decode(
        {
            "op": "tasks",
            "tasks": [
                ["t-short", F],
                ["t-body", F, 5, PAYLOAD, None],
                ["t-timeout", F, None, PAYLOAD, -1],
                ["t-ok", F, None, PAYLOAD, None],
                ["t-owner", F, None, PAYLOAD, None, None, 7],
                ["t-path", F, None, PAYLOAD, None, None, "../x"],
                ["t-long", F, None, PAYLOAD, None, None, None, "more"],
            ],
        }
    )
    short, body, timeout, ok, owner, path, long = tasks.tasks
    for bad, at in [(owner, 4), (path, 5)]:  # the owner names a store: a plain user id
        assert isinstance(bad, Malformed) and str(bad.error).startswith(
            f"tasks.tasks[{at}].owner: expected None or a user id"
        ), bad
    assert isinstance(long, Malformed) and long.task_id is None
    assert isinstance(short, Malformed) and short.task_id is None
    assert isinstance(body, Malformed) and body.task_id == "t-body"
    assert str(body.error).startswith("tasks.tasks[1].body:")
    assert isinstance(timeout, Malformed) and "tasks.tasks[2].timeout" in str(timeout.error)
    assert ok == TaskRow("t-ok", F, None, PAYLOAD, None)
    results = Results.decode(
        {"op": "results", "results": [[T1, "success", [5, "x", []], None], [T2, "nope", b"", b""]]}
    )
    bad_result, bad_state = results.results
    assert isinstance(bad_result, Malformed) and bad_result.task_id == T1
    assert str(bad_result.error).startswith("results.results[0].result:")
    assert isinstance(bad_state, Malformed)
    assert str(bad_state.error).startswith("results.results[1].state:")
    with pytest.raises(ProtocolError, match=r"results\.results\[0\]\.result"):
        results.rows()


def test_frames_that_are_not_messages_get_their_close_code() -> None:
    for frame, code in [
        ("text", TEXT_FRAME),
        (b"", NOT_MSGPACK),
        (b"\xc1", NOT_MSGPACK),
        (pack([1]), WRONG_SHAPE),
        (pack({"op": "nope"}), WRONG_SHAPE),
    ]:
        with pytest.raises(ProtocolError) as info:
            decode_frame(frame, KINDS)
        assert info.value.code == code


def test_a_stored_result_row_unpacks() -> None:
    row = MESSAGES["client_results"].results[0]  # type: ignore[attr-defined]
    assert row.unpacked() == (Result(0, b"data", []), RECORD)
    broken = ResultRow(T1, TaskState.SUCCESS, b"\xc1", b"")
    with pytest.raises(ProtocolError, match=f"task {T1}: result"):
        broken.unpacked()


def test_the_socket_ends_on_a_refused_or_revoked_token_naming_it_and_the_fix() -> None:
    """ServiceSocket against a real WebSocket server on loopback: HTTP 401 at connect, or
    a connection closed as revoked, ends ``run`` with an AuthError that names the token
    and what to do; ``stop`` ends it while it backs off from a closed port."""
    import asyncio
    import time
    from http import HTTPStatus

    from websockets.asyncio.server import ServerConnection, serve

    from nimbus.errors import AuthError
    from nimbus.protocol import REVOKED
    from nimbus.protocol.wsclient import ServiceSocket

    def socket(url: str, path: str) -> ServiceSocket:
        return ServiceSocket(
            url, path, "tok", None, keepalive=1, whose="lab's token", fix="get a new one"
        )

    async def session(ws: Any) -> None:
        await ws.recv()

    async def main() -> float:
        def refuse(connection: ServerConnection, request: Any) -> Any:
            if request.path == "/v1/ws/refused":
                return connection.respond(HTTPStatus.UNAUTHORIZED, "no\n")
            return None

        async def handler(ws: ServerConnection) -> None:
            await ws.close(REVOKED, "token revoked by the service admin")

        async with serve(handler, "127.0.0.1", 0, process_request=refuse) as server:
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            with pytest.raises(AuthError, match=r"refused lab's token \(HTTP 401\).*get a new one"):
                await asyncio.wait_for(socket(url, "/v1/ws/refused").run(session), 10)
            revoked = socket(url, "/v1/ws/any")
            with pytest.raises(AuthError, match="lab's token was revoked: get a new one"):
                await asyncio.wait_for(revoked.run(session), 10)
            assert revoked.connects == 1
        away = socket(url, "/v1/ws/any")  # the server is gone: it backs off until stopped
        asyncio.get_running_loop().call_later(0.3, away.stop)
        start = time.monotonic()
        await asyncio.wait_for(away.run(session), 10)
        assert away.error is not None
        return time.monotonic() - start

    assert asyncio.run(main()) < 5


def test_ws_url_is_the_one_way_to_the_service_socket() -> None:
    """Tests, bench and both peers build the WebSocket URL with ws_url (no ws:// by hand)."""
    from pathlib import Path

    from nimbus.protocol import WS_AGENT
    from nimbus.protocol.wsclient import ws_url

    assert ws_url("http://127.0.0.1:8000/", WS_AGENT) == "ws://127.0.0.1:8000/v1/ws/endpoint"
    assert ws_url("https://h.example", "/v1/ws/client") == "wss://h.example/v1/ws/client"
    root = Path(__file__).resolve().parent.parent
    by_hand = [
        str(path.relative_to(root))
        for folder in ("tests", "bench", "src")
        for path in (root / folder).rglob("*.py")
        if '"ws://"' in path.read_text() and path.name not in ("wsclient.py", Path(__file__).name)
    ]
    assert not by_hand, f"build the WebSocket URL with protocol.wsclient.ws_url: {by_hand}"


def test_environment_orders_round_trip_and_refuse_wrong_fields() -> None:
    from nimbus.protocol import ORDERS, Order, Ordered

    spec = {"name": "geo", "requirements": ["six"], "wheelhouse": None, "image": None}
    kinds: dict[str, type[Message]] = {"order": Order, "ordered": Ordered, "hello": Hello}
    for msg in (
        Order("r1", "build", "geo", spec),
        Order("r2", "remove", "geo"),
        Ordered("r1", 0, "", ["n1", "n2"]),
        Ordered("r2", 409, "busy"),
        Hello("3.12", "s", 4, 1024, [], (ORDERS,)),
    ):
        assert decode_message(unpack(msg.encode()), kinds) == msg
    beat = Beat(1.0, None, None, [{"ref": "r1", "node": "n1", "state": "built", "seconds": 1.5}])
    assert Beat.decode(unpack(beat.encode())) == beat
    for fields, field in (
        ({"ref": "r", "action": "delete", "name": "geo"}, "order.action"),
        ({"ref": 5, "action": "remove", "name": "geo"}, "order.ref"),
        ({"ref": "r", "action": "build", "name": "geo"}, "order.environment"),
        ({"ref": "r", "action": "build", "name": "g", "environment": {"name": 5}}, "order.environment.name"),
    ):  # fmt: skip
        with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
            Order.decode({"op": "order", **fields})
    with pytest.raises(ProtocolError, match=r"ordered\.status"):
        Ordered.decode({"op": "ordered", "ref": "r", "status": "ok"})
    with pytest.raises(ProtocolError, match=r"beat\.orders"):
        Beat.decode({"op": "beat", "t": 1.0, "orders": "built"})


# ---------------------------------------------------------------- environments in rows and beats


def test_rows_carry_an_environment_and_old_rows_still_read() -> None:
    env = Environment("geo", requirements=["six"], sandbox=True).to_dict()
    row = SubmitRow("f", b"p", None, env)
    assert SubmitRow.decode(unpack(pack(row)), "tasks[0]") == row
    assert SubmitRow.decode(["f", b"p", None], "tasks[0]") == SubmitRow("f", b"p", None, None)
    task = TaskRow("t", "f", None, b"p", 2.0, env)
    assert TaskRow.read(unpack(pack(task)), 0) == task
    assert TaskRow.read(["t", "f", None, b"p", None], 0) == TaskRow("t", "f", None, b"p", None)


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ("geo", "tasks[0].environment: expected None or an environment"),
        ({"name": "geo", "shell": "rm -rf /"}, "tasks[0].environment: expected None"),
        ({"name": ""}, "tasks[0].environment.name"),
        ({"name": "g", "requirements": "six"}, "tasks[0].environment.requirements"),
        ({"name": "g", "requirements": [1]}, "tasks[0].environment.requirements"),
        ({"name": "g", "image": 5}, "tasks[0].environment.image"),
        ({"name": "g", "sandbox": "yes"}, "tasks[0].environment.sandbox"),
    ],
)
def test_a_wrong_environment_is_refused_naming_the_field(env: object, field: str) -> None:
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.").replace("[", r"\[")):
        SubmitRow.decode(["f", b"p", None, env], "tasks[0]")
    bad = TaskRow.read(["t", "f", None, b"p", None, env], 3)
    assert not isinstance(bad, TaskRow)
    assert bad.task_id == "t" and "tasks.tasks[3].environment" in str(bad.error)


def test_a_beat_carries_environments_and_refuses_wrong_ones() -> None:
    rows = [{"node": "n1", "name": "geo", "key": "k", "state": "warm", "workers": 2, "free": 1}]
    beat = Beat(1.5, rows)
    assert decode_message(unpack(beat.encode()), {"beat": Beat}) == beat
    assert Beat(1.5).encode() == pack({"op": "beat", "t": 1.5})  # none: as before
    for wrong in ("warm", [["geo"]], [{"name": ["geo"]}]):
        with pytest.raises(ProtocolError, match=r"beat\.environments"):
            Beat.decode({"op": "beat", "t": 1.5, "environments": wrong})
