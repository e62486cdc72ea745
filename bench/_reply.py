"""A first request and its reply between instances on two hosts, with and without the
link back (``Sender._call_back``); one run, the two ways alternated.

::

    python bench/_reply.py [--reps 15] [--work 0.02]

Each repetition starts two fresh ``nimbus.multiprocessing`` processes, a and b, each
listening over TCP on 127.0.0.1 under a host id of its own (its Unix socket
unlinked: peers connect over TCP, as between machines). a sends b a request and
times until b's reply is in (b works ``--work`` seconds first: a reply that comes at
once races its link back), then a second round trip (warm). The baseline is the same
code with the link back turned off in both processes (``_call_back`` does nothing).
Medians; ratio = without / with (above 1: the link back is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def worker(parent: str, name: str, back: bool, work: float) -> None:
    os.environ["NIMBUS_MESSAGING_HOST"] = "127.0.0.1"
    os.environ["NIMBUS_MESSAGING_HOST_ID"] = f"reply-{name}-{os.getpid()}"
    import nimbus.messaging as msg
    from nimbus.messaging._sending import Sender

    if not back:
        Sender._call_back = lambda self, peer: None  # type: ignore[method-assign]
    unix = msg.current().entry.unix
    if unix:
        os.unlink(unix)
    msg.send(parent, (name, msg.instance_id()))
    if name == "b":
        while True:
            source, got = msg.recv_with_source(timeout=30)
            if got == b"end":
                return
            time.sleep(work)  # the request's work
            msg.send(source, b"reply")
    other = msg.recv(source=parent, timeout=30)
    times = []
    for _ in range(2):  # the first round trip, then a warm one
        start = time.perf_counter()
        msg.send(other, b"request")
        msg.recv(source=other, timeout=30)
        times.append((time.perf_counter() - start - work) * 1e3)
    msg.send(other, b"end")
    msg.send(parent, times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--work", type=float, default=0.02, help="seconds b works first")
    args = parser.parse_args()
    if args.reps < 1 or args.work < 0:
        parser.error("--reps takes 1 or more repetitions, --work 0 or more seconds")
    import nimbus.messaging as msg
    import nimbus.multiprocessing as mp

    me = msg.instance_id()
    got: dict[bool, list[list[float]]] = {True: [], False: []}
    for rep in range(args.reps):
        for back in (True, False) if rep % 2 else (False, True):
            procs = [mp.Process(target=worker, args=(me, n, back, args.work)) for n in "ab"]
            for p in procs:
                p.start()
            ids = dict(msg.recv(timeout=30) for _ in procs)
            msg.send(ids["a"], ids["b"])
            got[back].append(msg.recv(source=ids["a"], timeout=30))
            for p in procs:
                p.join(30)
    first = {back: statistics.median(t[0] for t in got[back]) for back in got}
    warm = {back: statistics.median(t[1] for t in got[back]) for back in got}
    print(f"reply after {args.work * 1e3:.0f} ms of work, {args.reps} repetitions, medians:")
    print(f"  first request and reply: {first[False]:.2f} ms without the link back, "
          f"{first[True]:.2f} ms with it: {first[False] / first[True]:.2f}x")  # fmt: skip
    print(f"  warm: {warm[False]:.3f} ms without, {warm[True]:.3f} ms with")


if __name__ == "__main__":
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent  # after the stdlib: bench/multiprocessing.py
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here] + [str(here)]
    main()
