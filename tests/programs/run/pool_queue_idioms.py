"""Stdlib-documentation idioms: Pool.map/imap/apply_async, Process with a Queue, a Pipe, a Lock,
Value/Array, a Manager, JoinableQueue consumers with poison pills (plain `import multiprocessing`)."""

import multiprocessing
import os
from multiprocessing import Array, Lock, Manager, Pipe, Pool, Process, Queue, Value


def square(x):
    return x * x


def report(q, name):
    q.put(f"hello {name} from a child: {os.getpid() != PARENT}")


def pipe_child(conn):
    conn.send([42, None, "hello"])
    conn.close()


def locked_print(lock, i, out):
    with lock:
        out.put(i)


def fill(n, a):
    n.value = 3.1415927
    for i in range(len(a)):
        a[i] = -a[i]


def managed(d, lst):
    d[1] = "1"
    d["2"] = 2
    d[0.25] = None
    lst.reverse()


def consumer(tasks, results):
    while True:
        task = tasks.get()
        if task is None:
            tasks.task_done()
            break
        results.put((task, task**3))
        tasks.task_done()


PARENT = os.getpid()

if __name__ == "__main__":
    with Pool(processes=3) as pool:
        print("map", pool.map(square, range(10)))
        print("imap", list(pool.imap(square, range(5))))
        print("unordered", sorted(pool.imap_unordered(square, range(5))))
        print("apply_async", pool.apply_async(square, (20,)).get(timeout=30))
        print("starmap", pool.starmap(pow, [(2, 5), (3, 3)]))

    q = Queue()
    p = Process(target=report, args=(q, "bob"))
    p.start()
    print(q.get())
    p.join()
    print("exitcode", p.exitcode)

    parent_conn, child_conn = Pipe()
    p = Process(target=pipe_child, args=(child_conn,))
    p.start()
    print("pipe", parent_conn.recv())
    p.join()

    lock, out = Lock(), Queue()
    ps = [Process(target=locked_print, args=(lock, i, out)) for i in range(5)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    print("locked", sorted(out.get() for _ in range(5)))

    num, arr = Value("d", 0.0), Array("i", range(10))
    p = Process(target=fill, args=(num, arr))
    p.start()
    p.join()
    print("shared", num.value, arr[:])

    with Manager() as manager:
        d, lst = manager.dict(), manager.list(range(10))
        p = Process(target=managed, args=(d, lst))
        p.start()
        p.join()
        print("manager", sorted(d.items(), key=str), list(lst))

    tasks, results = multiprocessing.JoinableQueue(), Queue()
    consumers = [Process(target=consumer, args=(tasks, results)) for _ in range(2)]
    for c in consumers:
        c.start()
    for i in range(8):
        tasks.put(i)
    for _ in consumers:
        tasks.put(None)
    tasks.join()
    print("consumers", sorted(results.get() for _ in range(8)))
    for c in consumers:
        c.join()
    print("cpu_count > 0", multiprocessing.cpu_count() > 0)
    print("current", multiprocessing.current_process().name)
