"""Module-of-the-week idioms: named and daemon processes, Event, Barrier, terminate, exit codes,
a Process subclass, and the program's own exit code (plain `import multiprocessing`)."""

import multiprocessing
import sys
import time


def worker(num):
    print("worker", num, multiprocessing.current_process().name, flush=True)


def wait_for_event(e, out):
    e.wait()
    out.put(("event", e.is_set()))


def exit_with(code):
    sys.exit(code)


def raises():
    raise RuntimeError("expected in the child")


def slow():
    time.sleep(30)


def at_barrier(b, out):
    out.put(("barrier", b.wait() >= 0))


class Squarer(multiprocessing.Process):
    def __init__(self, n, out):
        super().__init__()
        self.n, self.out = n, out

    def run(self):
        self.out.put(("subclass", self.n * self.n))


if __name__ == "__main__":
    for i in range(3):
        p = multiprocessing.Process(target=worker, args=(i,), name=f"worker-{i}")
        p.start()
        p.join()
    out = multiprocessing.Queue()
    e = multiprocessing.Event()
    w = multiprocessing.Process(target=wait_for_event, args=(e, out), daemon=True)
    w.start()
    e.set()
    print(out.get())
    w.join()
    b = multiprocessing.Barrier(2)
    ps = [multiprocessing.Process(target=at_barrier, args=(b, out)) for _ in range(2)]
    for p in ps:
        p.start()
    print(sorted(out.get() for _ in ps))
    for p in ps:
        p.join()
    s = Squarer(7, out)
    s.start()
    print(out.get())
    s.join()
    codes = []
    for target, args in ((exit_with, (0,)), (exit_with, (3,)), (raises, ())):
        p = multiprocessing.Process(target=target, args=args)
        p.start()
        p.join()
        codes.append(p.exitcode)
    p = multiprocessing.Process(target=slow)
    p.start()
    p.terminate()
    p.join()
    codes.append(p.exitcode)
    print("exit codes", codes, "alive", p.is_alive())
    sys.exit(5)
