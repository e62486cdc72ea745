"""State set up under the ``__main__`` guard reaches the children as under fork: globals
assigned or changed there, functions, an initializer and classes defined there, read by
a Process, a Pool, a ProcessPoolExecutor and emcee's sampler (issue 16, stranger F1)."""

import concurrent.futures
import multiprocessing
import sys

DATA = None
SETTINGS = {}
CONFIG = {"scale": 1}


class Point:
    def __init__(self, x):
        self.x = x

    def scaled(self):
        return Point(self.x * CONFIG["scale"])


def show(label):
    print(label, DATA, SETTINGS, flush=True)


def with_k(x):
    return x * SETTINGS["k"]


def call(fn, x):
    return fn(x)


def call_print(fn, x):
    print("process passed", fn(x), flush=True)


def moved(p):
    return isinstance(p, Point), p.scaled()


def fails(x):
    raise ValueError(f"bad {x}")


def processes(square):
    p = multiprocessing.Process(target=show, args=("process",))
    p.start()
    p.join()
    p = multiprocessing.Process(target=call_print, args=(square, 5))
    p.start()
    p.join()
    with concurrent.futures.ProcessPoolExecutor(1) as ex:
        ex.submit(show, "executor").result()
        print("executor", ex.submit(square, 7).result(), list(ex.map(with_k, [1, 2])))


def pool(square, init, shifted, local):
    with multiprocessing.Pool(2) as pool:
        print("settings", pool.map(with_k, range(4)))
        print("square", pool.map(square, range(5)))
        print("passed", pool.starmap(call, [(square, 3), (with_k, 2)]))
        ok, q = pool.apply(moved, (Point(2),))
        print("point", ok, isinstance(q, Point), q.x)
        back = pool.apply(call, (type, local))
        again = pool.apply(call, (tuple, [local]))[0]
        print("local class", back is type(local), isinstance(again, type(local)))
        try:
            pool.apply(fails, (3,))
        except ValueError as exc:
            text = str(exc.__cause__)
            print("traceback", exc, 'guarded_state.py", line' in text, "raise ValueError" in text)
    SETTINGS["k"] = 5  # changed before the next pool, in place: its tasks see 5
    with multiprocessing.Pool(2, initializer=init, initargs=(100,)) as pool:
        print("again", pool.map(with_k, range(3)), pool.map(shifted, range(3)))


def sampler(log_prob):
    import emcee
    import numpy as np

    with multiprocessing.Pool(2) as pool:
        sampler = emcee.EnsembleSampler(8, 2, log_prob, pool=pool)
        sampler.random_state = np.random.RandomState(42).get_state()
        sampler.run_mcmc(np.random.RandomState(7).randn(8, 2), 20, progress=False)
    print("emcee", np.round(sampler.get_chain()[-1].sum(), 8))


if __name__ == "__main__":
    DATA = "loaded-in-main"
    SETTINGS.update(k=4)
    CONFIG["scale"] = 10

    def square(x):
        return x * x

    def init(offset):
        global OFFSET
        OFFSET = offset

    def shifted(x):
        return x + OFFSET

    class Local:
        pass

    def log_prob(x):
        import numpy as np

        return -0.5 * np.sum(x**2) * SETTINGS["k"] / 4

    mode = sys.argv[1]
    if mode == "processes":
        processes(square)
    elif mode == "pool":
        pool(square, init, shifted, Local())
    else:
        sampler(log_prob)
