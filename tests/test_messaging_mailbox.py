"""The mailbox: frames read from a real socket, delivered once and in order per sender."""

from __future__ import annotations

import pickle
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from nimbus.errors import MessageDecodeError
from nimbus.messaging._mailbox import Mailbox
from nimbus.messaging._peer import TAGS, Peer
from nimbus.messaging._stream import BATCH, MSG, PICKLE, RAW, Stream
from nimbus.wire import Frame, pack


@pytest.fixture
def wire() -> Iterator[tuple[Stream, Peer]]:
    """A stream to write frames into and the link they are read from."""
    a, b = socket.socketpair()
    b.setblocking(False)
    out = Stream(a)
    link = Peer(b, Stream(b), "sender")
    yield out, link
    out.close()
    link.close()


def _frames(out: Stream, link: Peer, *frames: tuple[int, tuple[object, ...], bytes]) -> list[Frame]:
    for kind, meta, data in frames:
        if kind in (PICKLE, RAW):  # a small message: its number in the header
            seq, tag = meta
            assert isinstance(seq, int)
            out.queue_message(kind, seq, pack(tag), data)
        else:
            out.queue_small(kind, pack(meta), data)
    assert out.flush()
    got = link.channel.receive()
    assert got is not None and len(got) == len(frames)
    return got


def test_a_batch_ahead_of_the_store_waits_for_the_gap_then_arrives_once(
    wire: tuple[Stream, Peer],
) -> None:
    out, link = wire
    box = Mailbox()
    batch = _frames(out, link, (BATCH, (2, 0, [1, 2, 1], True), b"cdde"))
    box.deliver(link, batch)
    assert not box.mail  # 0 and 1 are still on their way through the store
    box.put("sender", 1, 0, pickle.dumps("b"), ())
    assert not box.mail
    box.put("sender", 0, 0, pickle.dumps("a"), ())
    box.deliver(link, batch)  # the same batch again: duplicates, dropped
    box.put("sender", 3, 0, pickle.dumps("again"), ())
    got = [box.pop(None, 0) for _ in range(5)]
    assert got == [("sender", x) for x in ("a", "b", b"c", b"dd", b"e")]
    assert box.pop(None, 0) is None


def test_batches_of_pickles_and_tags_are_taken_by_tag_in_order(wire: tuple[Stream, Peer]) -> None:
    out, link = wire
    box = Mailbox()
    ones = [pickle.dumps(x) for x in ("x", 2)]
    frames = _frames(
        out,
        link,
        (BATCH, (0, "t", [len(p) for p in ones], False), b"".join(ones)),
        (RAW, (2, 0), b"raw"),
        (MSG, (3, "t"), pickle.dumps([3])),
    )
    box.deliver(link, frames)
    assert box.pop("sender", 0) == ("sender", b"raw")
    assert [box.pop("sender", "t") for _ in range(3)] == [
        ("sender", "x"),
        ("sender", 2),
        ("sender", [3]),
    ]
    assert box.pop("other", "t") is None


def test_an_undecodable_message_in_a_batch_names_its_sender_and_spares_the_rest(
    wire: tuple[Stream, Peer],
) -> None:
    out, link = wire
    box = Mailbox()
    parts = [pickle.dumps("ok"), b"\x80\x05not a pickle.", pickle.dumps("fine")]
    box.deliver(
        link, _frames(out, link, (BATCH, (0, 0, [len(p) for p in parts], False), b"".join(parts)))
    )
    assert box.pop(None, 0) == ("sender", "ok")
    with pytest.raises(MessageDecodeError, match="instance sender") as info:
        box.pop(None, 0)
    assert info.value.sender == "sender"
    assert box.pop(None, 0) == ("sender", "fine")


def _message(out: Stream, link: Peer, kind: int, seq: int, tag: object, data: bytes) -> Any:
    """One small message written to ``out`` and read from ``link`` as one."""
    out.queue_message(kind, seq, pack(tag), data)
    assert out.flush()
    got = link.channel.receive_message()
    assert got == (kind, seq, pack(tag), data)
    return got


def test_take_hands_back_only_the_next_message_with_the_tag_when_nothing_waits(
    wire: tuple[Stream, Peer],
) -> None:
    out, link = wire
    box = Mailbox()
    one = _message(out, link, PICKLE, 0, "t", pickle.dumps("one"))
    assert box.take(link, one, "t") == ("sender", "t", pickle.dumps("one"), ())
    assert box.take(link, one, "t") is None  # a duplicate: dropped
    assert not box.mail
    # another tag: delivered, not handed back; and with mail waiting, nothing
    # overtakes it, even a message with the tag wanted
    assert box.take(link, _message(out, link, RAW, 1, "u", b"u"), "t") is None
    assert box.take(link, _message(out, link, RAW, 2, "t", b"t"), "t") is None
    assert [box.pop("sender", "u"), box.pop("sender", "t")] == [("sender", b"u"), ("sender", b"t")]
    # ahead of a gap (a message still in the store): held, then delivered in order
    assert box.take(link, _message(out, link, RAW, 4, "t", b"4"), "t") is None
    assert not box.mail
    box.put("sender", 3, "t", pickle.dumps("3"), ())
    assert [box.pop(None, "t"), box.pop(None, "t")] == [("sender", "3"), ("sender", b"4")]
    assert box.take(link, _message(out, link, RAW, 5, "t", b"5"), "t") == (
        "sender",
        "t",
        b"5",
        None,
    )


def test_a_read_of_more_than_one_small_message_comes_back_as_frames(
    wire: tuple[Stream, Peer],
) -> None:
    out, link = wire
    out.queue_message(RAW, 0, pack("t"), b"a")
    out.queue_message(PICKLE, 1, pack("t"), pickle.dumps("b"))
    assert out.flush()
    box = Mailbox()
    frames = link.channel.receive_message()
    assert isinstance(frames, list) and len(frames) == 2
    box.deliver(link, frames)
    assert [box.pop(None, "t"), box.pop(None, "t")] == [("sender", b"a"), ("sender", "b")]
    # one message longer than the first read: the rest is read on, into the same frame
    big = pickle.dumps(bytes(range(256)) * 200)
    out.queue_message(PICKLE, 2, pack("t"), big)
    assert out.flush()
    frames = []
    while not frames:  # a socket pair may hand the bytes over in pieces
        got = link.channel.receive_message()
        assert isinstance(got, list)
        frames += got
    box.deliver(link, frames)
    assert box.pop(None, "t") == ("sender", bytes(range(256)) * 200)


def test_small_messages_with_many_tags_and_unhashable_ones_arrive_with_their_tags() -> None:
    """More tags than a link keeps packed, and a tag that cannot be kept (a list)."""
    a, b = socket.socketpair()
    b.setblocking(False)
    sending, reading = Peer(a, Stream(a), "receiver"), Peer(b, Stream(b), "sender")
    try:
        tags: list[object] = [*range(3 * TAGS), "t", ["list", 1]]
        for seq, tag in enumerate(tags):
            sending.queue(seq, tag, pickle.dumps(seq) if seq % 2 else b"%d" % seq, [], seq % 2 == 0)
        assert sending.channel.flush()
        assert len(sending.tags) == TAGS
        box = Mailbox()
        box.deliver(reading, reading.channel.receive() or [])
        got = [box.pop("sender", tag) for tag in reversed(tags)]
        assert got[::-1] == [
            ("sender", seq if seq % 2 else b"%d" % seq) for seq in range(len(tags))
        ]
    finally:
        sending.close()
        reading.close()


# ---------------------------------------------------------------- runs (BATCH frames in order)


def _raw_batch(seq: int, tag: object, pieces: list[bytes]) -> tuple[int, tuple[object, ...], bytes]:
    return BATCH, (seq, tag, [len(p) for p in pieces], True), b"".join(pieces)


def test_a_run_at_the_head_is_taken_without_the_lock_in_order(wire: tuple[Stream, Peer]) -> None:
    out, link = wire
    box = Mailbox()
    box.deliver(link, _frames(out, link, _raw_batch(0, 0, [b"a", b"bb", b"c"])))
    assert len(box.mail) == 1 and box.count() == 3  # one entry, three messages
    got: list[object] = []
    with box.lock:  # held: a pop that needed it would wait here
        taker = threading.Thread(target=lambda: got.extend(box.pop("sender", 0) for _ in range(3)))
        taker.start()
        taker.join(10)
        assert not taker.is_alive()
    assert got == [("sender", b"a"), ("sender", b"bb"), ("sender", b"c")]
    assert box.count() == 0 and not box.waiting(None, 0)
    assert box.pop(None, 0) is None
    assert not box.mail  # the used-up run went with the first look under the lock


def test_runs_of_two_tags_interleaved_are_taken_by_tag_in_order(wire: tuple[Stream, Peer]) -> None:
    out, link = wire
    box = Mailbox()
    frames = _frames(
        out,
        link,
        _raw_batch(0, "a", [b"a0", b"a1", b"a2"]),
        _raw_batch(3, "b", [b"b3", b"b4"]),
        (RAW, (5, "a"), b"a5"),
        _raw_batch(6, "a", [b"a6", b"a7"]),
    )
    box.deliver(link, frames)
    assert box.waiting("sender", "b") and not box.waiting("other", "b")
    # "b" is behind a run of "a": taken from the middle of the mail, the run of "a" stays
    assert [box.pop("sender", "b"), box.pop(None, "b"), box.pop(None, "b")] == [
        ("sender", b"b3"),
        ("sender", b"b4"),
        None,
    ]
    assert box.pop("other", "a") is None
    assert [box.pop("sender", "a") for _ in range(6)] == [
        ("sender", b"a%d" % i) for i in (0, 1, 2, 5, 6, 7)
    ]
    assert box.pop(None, "a") is None and not box.mail


def test_runs_across_a_gap_and_duplicates_arrive_once_in_order(wire: tuple[Stream, Peer]) -> None:
    out, link = wire
    box = Mailbox()
    ahead = _frames(out, link, _raw_batch(2, 0, [b"2", b"3", b"4"]))
    box.deliver(link, ahead)  # 0 and 1 are still on their way through the store
    assert not box.mail and box.pop(None, 0) is None
    box.put("sender", 1, 0, pickle.dumps("1"), ())
    box.put("sender", 0, 0, pickle.dumps("0"), ())
    box.deliver(link, ahead)  # again: duplicates, dropped
    # a run that overlaps what arrived (3, 4) and goes on (5, 6); then one in order
    box.deliver(link, _frames(out, link, _raw_batch(3, 0, [b"3", b"4", b"5", b"6"])))
    box.deliver(link, _frames(out, link, _raw_batch(7, 0, [b"7", b"8"])))
    box.put("sender", 8, 0, pickle.dumps("late"), ())  # a duplicate from the store
    got = [box.pop("sender", 0) for _ in range(9)]
    assert got == [("sender", x) for x in ("0", "1", b"2", b"3", b"4", b"5", b"6", b"7", b"8")]
    assert box.pop(None, 0) is None and box.count() == 0


def test_take_waits_behind_a_run_and_hands_back_once_it_is_used_up(
    wire: tuple[Stream, Peer],
) -> None:
    out, link = wire
    box = Mailbox()
    box.deliver(link, _frames(out, link, _raw_batch(0, "t", [b"0", b"1"])))
    assert box.pop("sender", "t") == ("sender", b"0")
    # the run still holds 1: the next message must not overtake it
    assert box.take(link, _message(out, link, RAW, 2, "t", b"2"), "t") is None
    assert [box.pop("sender", "t"), box.pop("sender", "t")] == [("sender", b"1"), ("sender", b"2")]
    box.deliver(link, _frames(out, link, _raw_batch(3, "t", [b"3", b"4"])))
    assert [box.pop(None, "t"), box.pop(None, "t")] == [("sender", b"3"), ("sender", b"4")]
    assert box.mail  # used up, not yet dropped (that needs the lock)
    assert box.take(link, _message(out, link, RAW, 5, "t", b"5"), "t") == (
        "sender",
        "t",
        b"5",
        None,
    )
    assert not box.mail


def test_an_undecodable_pickle_in_a_run_behind_another_tag_names_its_sender(
    wire: tuple[Stream, Peer],
) -> None:
    out, link = wire
    box = Mailbox()
    parts = [pickle.dumps(1), b"\x80\x05not a pickle.", pickle.dumps(3)]
    box.deliver(
        link,
        _frames(
            out,
            link,
            _raw_batch(0, "first", [b"x", b"y"]),
            (BATCH, (2, "p", [len(p) for p in parts], False), b"".join(parts)),
        ),
    )
    assert box.pop("sender", "p") == ("sender", 1)
    with pytest.raises(MessageDecodeError, match="instance sender") as info:
        box.pop("sender", "p")
    assert info.value.sender == "sender"
    assert [box.pop(None, "p"), box.pop(None, "first"), box.pop(None, "first")] == [
        ("sender", 3),
        ("sender", b"x"),
        ("sender", b"y"),
    ]


def test_threads_taking_from_runs_get_each_message_once_and_in_order(
    wire: tuple[Stream, Peer],
) -> None:
    """Four threads pop one sender's runs (with and without the lock) as they arrive."""
    out, link = wire
    box = Mailbox()
    total, size = 20_000, 250
    taken: list[list[int]] = [[] for _ in range(4)]

    def take(mine: list[int]) -> None:
        while len(mine) < total:  # stop once everything was taken, by anyone
            found = box.pop("sender", 0)
            if found is not None:
                mine.append(int(found[1]))
            elif sum(map(len, taken)) >= total:
                return

    threads = [threading.Thread(target=take, args=(mine,)) for mine in taken]
    for thread in threads:
        thread.start()
    for seq in range(0, total, size):
        box.deliver(
            link,
            _frames(out, link, _raw_batch(seq, 0, [b"%d" % i for i in range(seq, seq + size)])),
        )
    for thread in threads:
        thread.join(60)
    assert sorted(i for mine in taken for i in mine) == list(range(total))
    for mine in taken:
        assert mine == sorted(mine)
