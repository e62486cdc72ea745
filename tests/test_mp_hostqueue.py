"""``_hostqueue``: a Pool's queues as OS pipes when every process of the program is here."""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading

import pytest

import nimbus.multiprocessing as mp
from nimbus import statestore
from nimbus.errors import DeserializationError, SerializationError
from nimbus.multiprocessing import _hostqueue
from nimbus.multiprocessing._hostqueue import HostSimpleQueue


def _echo(inq: HostSimpleQueue, outq: HostSimpleQueue) -> None:
    while True:
        item = inq.get()
        outq.put(item)
        if item is None:
            return


def _take(inq: HostSimpleQueue, outq: HostSimpleQueue) -> None:
    """Take items until None; each one back with this process's pid."""
    while True:
        item = inq.get()
        if item is None:
            return
        outq.put((os.getpid(), item))


def _queues() -> tuple[HostSimpleQueue, HostSimpleQueue]:
    program = statestore.program()
    assert _hostqueue.usable(program)  # the tests run as a local program
    return HostSimpleQueue(program), HostSimpleQueue(program)


@pytest.mark.timeout(60)
def test_a_process_started_elsewhere_opens_the_pipe_and_both_ways_work() -> None:
    inq, outq = _queues()
    p = mp.Process(target=_echo, args=(inq, outq))
    p.start()
    big = os.urandom(1 << 20)  # past the pipe's buffer, with out-of-band buffers
    items = [1, "two", {"three": [3.0]}, big, bytearray(b"x" * 70_000), None]
    got = []
    for item in items:  # one at a time: both pipes' buffers are smaller than an item
        inq.put(item)
        got.append(outq.get())
    assert got == items
    p.join(30)
    assert p.exitcode == 0
    assert outq.empty()


@pytest.mark.timeout(60)
def test_competing_readers_each_take_whole_messages_once() -> None:
    """Four processes read one pipe (the Pool's job queue) and write another; messages of
    up to 200 KB (more than the pipe holds) arrive whole and once: the locks hold."""
    inq, outq = _queues()
    procs = [mp.Process(target=_take, args=(inq, outq)) for _ in range(4)]
    for p in procs:
        p.start()
    sent = [bytes([i % 256]) * (i * 997 % 200_000) for i in range(200)]
    feeder = threading.Thread(target=lambda: [inq.put(item) for item in sent])
    feeder.start()
    got = [outq.get() for _ in sent]
    feeder.join()
    for _ in procs:
        inq.put(None)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert sorted(item for _, item in got) == sorted(sent)
    assert len({pid for pid, _ in got}) > 1  # they did compete


@pytest.mark.timeout(30)
def test_an_object_that_does_not_pickle_raises_at_put_and_the_queue_goes_on() -> None:
    inq, _ = _queues()
    with pytest.raises(TypeError):  # SerializationError is one, as the stdlib's error
        inq.put(threading.Lock())
    inq.put("after")
    assert inq.get() == "after"
    assert inq.empty()


@pytest.mark.timeout(30)
def test_a_descriptor_that_is_no_longer_the_pipe_is_refused() -> None:
    inq, _ = _queues()
    fd = inq._reader.fileno()
    inode = os.fstat(fd).st_ino
    with pytest.raises(DeserializationError, match="no longer its pipe"):
        _hostqueue._open(os.getpid(), fd, inode + 1, os.O_RDONLY)
    read, write = os.pipe()
    os.close(write)
    gone = _gone_pid()
    with pytest.raises(DeserializationError, match=f"pid {gone}"):
        _hostqueue._open(gone, read, inode, os.O_RDONLY)
    os.close(read)


def _gone_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_only_a_program_whose_processes_are_all_here_uses_it() -> None:
    program = statestore.program()
    assert _hostqueue.usable(program)
    assert not _hostqueue.usable(dataclasses.replace(program, remote=True))
    assert not _hostqueue.usable(dataclasses.replace(program, shared=None))


@pytest.mark.timeout(30)
def test_it_does_not_go_to_a_process_on_another_host() -> None:
    inq, _ = _queues()
    remote = dataclasses.replace(statestore.program(), remote=True)
    statestore.adopt(remote)
    try:
        with pytest.raises(SerializationError, match="another host"):
            pickle.dumps(inq)
    finally:
        statestore.adopt(None)
