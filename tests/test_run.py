"""``nimbus run`` and ``install()``: nimbus as ``multiprocessing``, programs run as python runs them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


def _python(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=ENV, input=stdin, capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip


def _script(tmp_path: Path, text: str, name: str = "prog.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


POOL_PROGRAM = """
    import math
    import sys
    import multiprocessing
    from multiprocessing import Pool, Process, Queue

    def root(x):
        return math.sqrt(x)

    def where(q):
        import multiprocessing as m
        q.put(m.__name__)

    if __name__ == "__main__":
        with Pool(2) as pool:
            print(pool.map(root, [1, 4, 9]))
        q = Queue()
        p = Process(target=where, args=(q,))
        p.start()
        print(multiprocessing.__name__, q.get(), sys.argv[1:])
        p.join()
        sys.exit(int(sys.argv[1]))
"""


@pytest.mark.timeout(120)
def test_stdlib_names_aliased_to_nimbus_everywhere(tmp_path: Path) -> None:
    """Issue 16 #1: with sys.modules' multiprocessing[.x] pointing at nimbus, nimbus's own
    modules (managers, popen_nimbus) import, and the whole module map is offered."""
    code = """
        import sys, importlib
        import nimbus.multiprocessing as nmp
        sys.modules["multiprocessing"] = nmp
        for name in [n for n in sys.modules if n.startswith("multiprocessing.")]:
            sys.modules[name] = getattr(nmp, name.split(".", 1)[1], sys.modules[name])
        import nimbus.multiprocessing.managers, nimbus.multiprocessing.popen_nimbus
        from multiprocessing import managers, resource_sharer, spawn
        assert managers.AcquirerProxy.__module__ == "multiprocessing.managers"
        subs = ("connection context dummy heap managers pool popen_fork popen_forkserver "
                "popen_spawn_posix process queues reduction resource_sharer resource_tracker "
                "shared_memory sharedctypes spawn synchronize util").split()
        for sub in subs:
            module = getattr(nmp, sub, None) or importlib.import_module("nimbus.multiprocessing." + sub)
            print(sub, module.__name__)
    """
    done = _python("-c", textwrap.dedent(code), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    names = dict(line.split() for line in done.stdout.splitlines())
    for sub in ("connection", "context", "managers", "pool", "queues", "synchronize", "process"):
        assert names[sub] == f"nimbus.multiprocessing.{sub}"
    for sub in ("heap", "util", "spawn", "reduction", "popen_fork", "shared_memory", "dummy"):
        assert names[sub] == f"multiprocessing.{sub}"


@pytest.mark.timeout(120)
def test_install_then_manager_and_pool_in_one_program(tmp_path: Path) -> None:
    code = """
        import nimbus.multiprocessing
        nimbus.multiprocessing.install()
        import multiprocessing, multiprocessing.pool, multiprocessing.heap
        assert multiprocessing.pool.Pool.__module__ == "nimbus.multiprocessing.pool"
        assert multiprocessing.heap.__name__ == "multiprocessing.heap"
        if __name__ == "__main__":
            with multiprocessing.Manager() as m:
                d = m.dict(a=1)
                print(dict(d), m.Lock() is not None)
            with multiprocessing.get_context("spawn").Pool(2) as p:
                print(p.map(abs, [-1, -2]))
    """
    done = _python("-c", textwrap.dedent(code), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["{'a': 1} True", "[1, 2]"]


@pytest.mark.timeout(120)
def test_nimbus_run_script_argv_and_exit_code(tmp_path: Path) -> None:
    prog = _script(tmp_path, POOL_PROGRAM)
    done = _python("-m", "nimbus", "run", str(prog), "7", cwd=tmp_path)
    assert done.returncode == 7, done.stderr
    assert done.stdout.splitlines() == [
        "[1.0, 2.0, 3.0]",
        "nimbus.multiprocessing nimbus.multiprocessing ['7']",
    ]


FIRST_IMPORT_PROGRAM = """
    import {first} as first
    import multiprocessing
    import multiprocessing.connection
    from multiprocessing import Pipe, Process

    def child(conn):
        conn.send(conn.recv() * 2)
        conn.close()

    if __name__ == "__main__":
        a, b = Pipe()
        p = Process(target=child, args=(b,))
        p.start()
        a.send(21)
        print(first.__name__, multiprocessing.__name__, multiprocessing.connection.__name__)
        print(a.recv())
        p.join()
        print(p.exitcode)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "first",
    ["nimbus.multiprocessing.connection", "nimbus.multiprocessing.pool", "nimbus.multiprocessing"],
)
def test_nimbus_run_program_whose_first_import_is_nimbus_multiprocessing(
    tmp_path: Path, first: str
) -> None:
    """A program that imports a module of nimbus's package before any `multiprocessing`
    runs under `nimbus run` as under python (it was a partially-initialised-module error)."""
    prog = _script(tmp_path, FIRST_IMPORT_PROGRAM.format(first=first))
    lines = [first, "nimbus.multiprocessing", "nimbus.multiprocessing.connection"]
    for launcher in (["-m", "nimbus", "run"], []):
        done = _python(*launcher, str(prog), cwd=tmp_path)
        assert done.returncode == 0, (launcher, done.stderr)
        if launcher:
            assert done.stdout.splitlines() == [" ".join(lines), "42", "0"]
        else:  # python: multiprocessing stays the stdlib's
            assert done.stdout.splitlines()[1:] == ["42", "0"]


@pytest.mark.timeout(120)
def test_nimbus_run_module(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _script(pkg, POOL_PROGRAM, "mod.py")
    done = _python("-m", "nimbus", "run", "-m", "pkg.mod", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == "nimbus.multiprocessing nimbus.multiprocessing ['0']"


def test_nimbus_run_missing_script_exits_2_naming_it(tmp_path: Path) -> None:
    done = _python("-m", "nimbus", "run", "no_such_script.py", cwd=tmp_path)
    assert done.returncode == 2
    assert "no_such_script.py" in done.stderr
    no_module = _python("-m", "nimbus", "run", "-m", "no_such_module", cwd=tmp_path)
    assert no_module.returncode == 1 and "no_such_module" in no_module.stderr


def test_nimbus_run_uncaught_exception_is_status_1_with_the_programs_traceback(
    tmp_path: Path,
) -> None:
    prog = _script(tmp_path, "raise ValueError('boom')\n")
    done = _python("-m", "nimbus", "run", str(prog), cwd=tmp_path)
    assert done.returncode == 1
    assert "ValueError: boom" in done.stderr and "nimbus/run.py" not in done.stderr


@pytest.mark.timeout(120)
def test_signal_ends_program_as_python(tmp_path: Path) -> None:
    prog = _script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    done = _python("-m", "nimbus", "run", str(prog), cwd=tmp_path)
    assert done.returncode == -signal.SIGTERM


CHILDREN_PROGRAM = """
    import multiprocessing, sys, time

    def sleeper(ready):
        try:
            ready.put(1)
            time.sleep(60)
        except KeyboardInterrupt:
            print("child interrupted", flush=True)
            sys.exit(1)

    if __name__ == "__main__":
        ready = multiprocessing.Queue()
        ps = [multiprocessing.Process(target=sleeper, args=(ready,)) for _ in range(2)]
        for p in ps:
            p.start()
        ready.get()  # both children in their sleep, whatever the machine's load
        ready.get()
        print("started", flush=True)
        try:
            for p in ps:
                p.join()
        finally:
            print(f"codes {[p.exitcode for p in ps]}", flush=True)
"""


def _interruptible() -> None:
    """SIGINT as a terminal's program has it: a test run started in the background
    (CI's shell, `&`) inherits it ignored, and Python keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c(prog: Path, launcher: list[str]) -> tuple[str, str, int]:
    """Run ``prog`` (under ``launcher``) in a session of its own until it prints "started",
    then Ctrl-C it as a terminal does (SIGINT to its process group): its output, errors
    and exit status."""
    proc = subprocess.Popen(
        [sys.executable, *launcher, str(prog)], cwd=prog.parent, env=ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_interruptible,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "started\n"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # as the terminal does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out, err, proc.returncode


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", [[], ["-m", "nimbus", "run"]], ids=["python", "nimbus-run"])
def test_ctrl_c_ends_children(tmp_path: Path, launcher: list[str]) -> None:
    prog = _script(tmp_path, CHILDREN_PROGRAM)
    out, err, returncode = _ctrl_c(prog, launcher)
    assert out.count("child interrupted") == 2, err
    assert "codes [" in out
    assert returncode in (-signal.SIGINT, 130, 1)
    assert "KeyboardInterrupt" in err


GRANDCHILDREN_PROGRAM = """
    import multiprocessing, sys, time

    def sleeper(ready):
        try:
            ready.put(1)
            time.sleep(60)
        except KeyboardInterrupt:
            print("grandchild interrupted", flush=True)
            sys.exit(1)

    def parent():
        ready = multiprocessing.Queue()
        ps = [multiprocessing.Process(target=sleeper, args=(ready,)) for _ in range(2)]
        for p in ps:
            p.start()
        ready.get()
        ready.get()
        print("started", flush=True)
        try:
            for p in ps:
                p.join()
        except KeyboardInterrupt:
            for p in ps:
                p.join()
            print(f"child interrupted {[p.exitcode for p in ps]}", flush=True)
            sys.exit(1)

    if __name__ == "__main__":
        p = multiprocessing.Process(target=parent)
        p.start()
        try:
            p.join()
        finally:
            print(f"codes {p.exitcode}", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "launcher", [[], ["-m", "nimbus", "run"], ["import"]], ids=["python", "nimbus-run", "import"]
)
def test_ctrl_c_reaches_grandchildren(tmp_path: Path, launcher: list[str]) -> None:
    """A Process started by a Process gets Ctrl-C too, as every process of the group does
    (under `nimbus run`, and in a program that imports nimbus.multiprocessing itself)."""
    text = GRANDCHILDREN_PROGRAM
    if launcher == ["import"]:
        launcher = []
        text = text.replace(
            "import multiprocessing,", "import nimbus.multiprocessing as multiprocessing,"
        )
    prog = _script(tmp_path, text)
    out, err, returncode = _ctrl_c(prog, launcher)
    assert out.count("grandchild interrupted") == 2, err
    assert "child interrupted [1, 1]" in out, err
    assert returncode in (-signal.SIGINT, 130, 1)


EARLY_CTRL_C_PROGRAM = """
    import multiprocessing, os, signal, sys, time

    def sleeper():
        try:
            time.sleep(20)
        except KeyboardInterrupt:
            sys.exit(1)

    if __name__ == "__main__":
        for _ in range(3):
            ps = [multiprocessing.Process(target=sleeper) for _ in range(4)]
            for p in ps:
                p.start()
            try:
                os.killpg(0, signal.SIGINT)  # Ctrl-C at once: the children are being forked
                time.sleep(20)
            except KeyboardInterrupt:
                pass
            for p in ps:
                p.join()
            print([p.exitcode for p in ps], flush=True)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_reaches_children_started_just_before_it(tmp_path: Path) -> None:
    """Stranger 6 #2: a Ctrl-C right after start() reaches every child, also one whose fork
    (or standby) had not yet taken signals (Python clears those a fork inherits): the
    worker forks with SIGINT held back until the process runs. Lost, a child slept on."""
    prog = _script(tmp_path, EARLY_CTRL_C_PROGRAM)
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "nimbus", "run", str(prog)], cwd=tmp_path, env=ENV,
        capture_output=True, text=True, timeout=110, check=False, start_new_session=True,
        preexec_fn=_interruptible,
    )  # fmt: skip
    assert done.stdout.splitlines() == ["[1, 1, 1, 1]"] * 3, done.stderr
    assert time.monotonic() - began < 20


CTRL_C_UNDER_SITE_LOCK_PROGRAM = """
    import os, signal, sys, time
    import multiprocessing as mp
    from nimbus.multiprocessing._site import this_site

    def sleeper():
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            sys.exit(7)

    def child(q):
        from nimbus import _install

        # its handler whatever SIGINT it inherited (a CI run in the background ignores it)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _install.pass_interrupts()
        for _ in range(200):  # until one grandchild's pid is not back when the lock is taken
            g = mp.Process(target=sleeper)
            g.start()  # its pid comes back through the relay, which needs site.lock
            site = this_site()
            try:
                with site.lock:  # as inside Site.register() for the next child
                    if g._popen._forked.done():
                        raise LookupError
                    os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C passed on by the parent
                    for _ in range(1000):
                        pass
                q.put("no KeyboardInterrupt")
                return
            except LookupError:
                g.kill()
                g.join()
            except KeyboardInterrupt:
                g.join(50)  # the SIGINT held for it went when its pid came
                q.put(f"{type(site).__name__} interrupted, grandchild {g.exitcode}")
                return
        q.put("every pid was back before the lock was taken")

    if __name__ == "__main__":
        q = mp.Queue()
        p = mp.Process(target=child, args=(q,))
        p.start()
        try:
            print(q.get(timeout=60), flush=True)
        except Exception:
            print("HUNG", flush=True)
            p.kill()
        p.join()
"""


@pytest.mark.timeout(180)
def test_ctrl_c_while_the_site_lock_is_held_is_passed_on_when_the_pid_comes(
    tmp_path: Path,
) -> None:
    """Review 7 #3: the SIGINT handler of a process that starts processes waited for a
    grandchild's pid, which the relay's reader delivers under ``site.lock``, held by the
    interrupted main thread: it hung. It now waits for nothing and passes the SIGINT on
    to that grandchild when its pid arrives."""
    prog = _script(tmp_path, CTRL_C_UNDER_SITE_LOCK_PROGRAM)
    done = subprocess.run(  # SIGINT as a terminal's program has it (CI's is ignored)
        [sys.executable, "-m", "nimbus", "run", str(prog)], cwd=tmp_path, env=ENV,
        capture_output=True, text=True, timeout=150, check=False, preexec_fn=_interruptible,
    )  # fmt: skip
    if done.stdout.startswith("every pid was back"):  # (a machine that never showed it)
        pytest.skip("every grandchild's pid was back before the lock was taken, 200 times")
    # 7: in its sleep; 1: a KeyboardInterrupt before it (the pid comes as the fork is done);
    # "no KeyboardInterrupt": the signal not raised within the loop (seen only in full CI
    # runs, unexplained: see the closing note); what the fix is for: never "HUNG"
    assert done.stdout.split("\n")[0] in (
        "RelayedSite interrupted, grandchild 7",
        "RelayedSite interrupted, grandchild 1",
        "no KeyboardInterrupt",
        "RelayedSite interrupted, grandchild None",  # (its own SIGINT ignored: see the note)
    ), done.stderr


FORK_WHILE_PASSING_PROGRAM = """
    import os, signal
    from nimbus import _install

    signal.signal(signal.SIGINT, signal.default_int_handler)
    _install.pass_interrupts()
    _install._Interrupts.passing = True  # the main thread passes a Ctrl-C on, as another forks
    pid = os.fork()
    if pid == 0:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            os._exit(3)  # ignored: its handler thought it was passing one on already
        except KeyboardInterrupt:
            os._exit(0)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_process_forked_while_a_ctrl_c_is_passed_on_still_takes_ctrl_c(tmp_path: Path) -> None:
    """Review 7 #4: the handler's state is not a fork's: a warm worker forked by the
    executor's thread while the main thread passed a Ctrl-C on ignored every later one."""
    done = _python(str(_script(tmp_path, FORK_WHILE_PASSING_PROGRAM)), cwd=tmp_path)
    assert done.stdout.split() == ["0"], done.stderr


def test_an_error_passing_a_ctrl_c_on_leaves_ctrl_c_working(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 7 #4: an exception out of passing one on does not leave the handler
    thinking it still is (which would swallow every later Ctrl-C)."""
    from nimbus import _install

    def broken() -> None:
        raise OSError("passing it on failed")

    for name in ("received", "passed", "passing"):
        monkeypatch.setattr(_install._Interrupts, name, getattr(_install._Interrupts, name))
    monkeypatch.setattr(_install, "_pass_on", broken)
    with pytest.raises(OSError, match="passing it on failed"):
        _install._on_interrupt(signal.SIGINT, None)
    assert _install._Interrupts.passing is False
    with pytest.raises(OSError):  # the next one is passed on (and fails) again: not swallowed
        _install._on_interrupt(signal.SIGINT, None)


NO_FILE_PROGRAM = """
import math
import multiprocessing

def root(x):
    return math.sqrt(x)

if __name__ == "__main__":
    with multiprocessing.Pool(2) as pool:
        print(pool.map(root, [4, 9]))
    p = multiprocessing.Process(target=root, args=(16,))
    p.start()
    p.join()
    print("exitcode", p.exitcode)
"""
NO_FILE_OUTPUT = ["[2.0, 3.0]", "exitcode 0"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["stdin", "dash-c", "runpy", "interactive", "run-stdin"])
def test_mains_with_no_file(tmp_path: Path, how: str) -> None:
    """Issue 16 #3: `python - < script.py`, `python -c`, runpy, `python -i`: as the stdlib's fork."""
    install = "import nimbus.multiprocessing; nimbus.multiprocessing.install()\n"
    program = install + NO_FILE_PROGRAM
    if how == "stdin":
        done = _python("-", cwd=tmp_path, stdin=program)
    elif how == "dash-c":
        done = _python("-c", program, cwd=tmp_path)
    elif how == "runpy":
        _script(tmp_path, program, "target.py")
        done = _python(
            "-c", "import runpy; runpy.run_path('target.py', run_name='__main__')", cwd=tmp_path
        )
    elif how == "interactive":
        done = _python("-i", cwd=tmp_path, stdin=program + "\n")
    else:
        done = _python("-m", "nimbus", "run", "-", cwd=tmp_path, stdin=NO_FILE_PROGRAM)
    assert done.returncode == 0, done.stderr
    assert [
        line.lstrip(">. ") for line in done.stdout.splitlines() if line.strip(">. ")
    ] == NO_FILE_OUTPUT


INITIALIZER_PROGRAM = """
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

G = None

def init(v):
    global G
    G = v

def g(x):
    return x + G

if __name__ == "__main__":
    with mp.Pool(2, initializer=init, initargs=(100,)) as p:
        print(p.map(g, range(4)))
    with ProcessPoolExecutor(1, initializer=init, initargs=(7,)) as ex:
        print(list(ex.map(g, range(2))))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["run-stdin", "run-dash-c", "import-stdin"])
def test_an_initializers_globals_reach_the_tasks_of_a_main_sent_by_value(
    tmp_path: Path, how: str
) -> None:
    """Stranger 6 #1: a Pool's (or a ProcessPoolExecutor's) initializer sets a global of a
    main module sent by value (`nimbus run -`, `-c`, `python -`): its tasks, pickled
    apart, see it, as the stdlib's fork does (they had their own globals: NameError)."""
    if how == "run-stdin":
        done = _python("-m", "nimbus", "run", "-", cwd=tmp_path, stdin=INITIALIZER_PROGRAM)
    elif how == "run-dash-c":
        done = _python("-m", "nimbus", "run", "-c", INITIALIZER_PROGRAM, cwd=tmp_path)
    else:
        text = INITIALIZER_PROGRAM.replace(
            "import multiprocessing as mp", "import nimbus.multiprocessing as mp"
        )
        done = _python("-", cwd=tmp_path, stdin=text)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[100, 101, 102, 103]", "[7, 8]"]


NAME_PROGRAM = """
    import multiprocessing

    def name(_=None):
        print("child", __name__, flush=True)
        return __name__

    if __name__ == "__main__":
        p = multiprocessing.Process(target=name)
        p.start()
        p.join()
        with multiprocessing.Pool(1) as pool:
            print("pool", pool.map(name, [0])[0], flush=True)
"""


@pytest.mark.timeout(120)
def test_a_child_reads_its_main_modules_name_as_main(tmp_path: Path) -> None:
    """Stranger 6 #11: the stdlib docs' `info()` prints `module name: __main__` in a child
    under `nimbus run`, as under the stdlib's fork (it printed spawn's `__mp_main__`)."""
    prog = _script(tmp_path, NAME_PROGRAM)
    done = _python("-m", "nimbus", "run", str(prog), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["child __main__", "child __main__", "pool __main__"]


NOTEBOOK_CELLS = [
    "import math\nimport multiprocessing\n\ndef root(x):\n    return math.sqrt(x)",
    "def put_root(q, x):\n    q.put(root(x))",
    "with multiprocessing.Pool(2) as pool:\n    print(pool.map(root, [4, 9]))",
    "q = multiprocessing.Queue()\np = multiprocessing.Process(target=put_root, args=(q, 16))\n"
    "p.start()\nprint(q.get(), type(p).__module__)\np.join()\nprint(p.exitcode)",
]


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "first",
    ["%load_ext nimbus", "import nimbus.multiprocessing\nnimbus.multiprocessing.install()"],
    ids=["load_ext", "install"],
)
def test_notebook_cells_run_in_pool_and_process(
    first: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real IPython kernel (ipykernel, driven by nbclient): functions defined in cells."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("PYTHONPATH", str(SRC))
    cells = [nbformat.v4.new_code_cell(source) for source in [first, *NOTEBOOK_CELLS]]
    notebook = nbformat.v4.new_notebook(cells=cells)
    client = nbclient.NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = [
        "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        for cell in notebook.cells
    ]
    assert outputs[3] == "[2.0, 3.0]\n"
    assert outputs[4] == "4.0 nimbus.multiprocessing.context\n0\n"


DILL_PROGRAM = """
    import math
    import sys
    import dill
    import multiprocessing

    FACTOR = 2

    def row_func(x):
        return FACTOR * math.sqrt(x)

    def call(payload):
        return dill.loads(payload)(16)

    def show(payload):
        print("process", call(payload), flush=True)

    if __name__ == "__main__":
        with multiprocessing.Pool(1) as pool:
            print(pool.map(call, [dill.dumps(row_func)]), flush=True)
        p = multiprocessing.Process(target=show, args=(dill.dumps(row_func),))
        p.start()
        p.join()
        print("exitcode", p.exitcode)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stdin", [False, True], ids=["file", "stdin"])
@pytest.mark.parametrize("launcher", [["-m", "nimbus", "run"], []], ids=["nimbus-run", "import"])
def test_children_see_the_main_script_as_main(
    tmp_path: Path, launcher: list[str], stdin: bool
) -> None:
    """Issue 16 #2: a main-script function dill sends by value finds its globals (`math`,
    `FACTOR`), also when the program comes on standard input (`nimbus run -`, `python -`)."""
    pytest.importorskip("dill")
    text = DILL_PROGRAM
    if not launcher:
        text = text.replace(
            "import multiprocessing", "import nimbus.multiprocessing as multiprocessing"
        )
    if stdin:
        done = _python(*launcher, "-", cwd=tmp_path, stdin=textwrap.dedent(text))
    else:
        done = _python(*launcher, str(_script(tmp_path, text)), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[8.0]\nprocess 8.0\nexitcode 0\n"


def test_endpoint_option_and_the_cli_parser(tmp_path: Path) -> None:
    """--endpoint is checked before the program starts: with no service configured (an
    empty config directory) it is one line naming the option given, status 2."""
    marker = tmp_path / "started"
    code = f"open({str(marker)!r}, 'w')"
    (tmp_path / "empty.toml").write_text("")
    env = {**ENV, "XDG_CONFIG_HOME": str(tmp_path), "NIMBUS_CONFIG": str(tmp_path / "empty.toml")}
    for key in ("NIMBUS_SERVICE_URL", "NIMBUS_TOKEN", "NIMBUS_ENDPOINT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, "-m", "nimbus", "run", "--endpoint", "hpc", "-c", code, "x"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("nimbus run: --endpoint=hpc: no nimbus service configured")
    assert len(done.stderr.splitlines()) == 1 and not marker.exists()
    prog = _script(
        tmp_path, "import sys, multiprocessing\nprint(multiprocessing.__name__)\nsys.exit(4)\n"
    )
    via_cli = _python(
        "-c", f"from nimbus.cli import main; main(['run', {str(prog)!r}])", cwd=tmp_path
    )
    assert via_cli.returncode == 4, via_cli.stderr
    assert via_cli.stdout == "nimbus.multiprocessing\n"


def test_the_default_config_file_is_read_before_the_program(tmp_path: Path) -> None:
    """An endpoint set only in the default config file ($XDG_CONFIG_HOME/nimbus/config.toml,
    where nimbus.config looks) is checked before the program starts, as one given by
    NIMBUS_ENDPOINT; without the file the program runs."""
    marker = tmp_path / "started"
    code = f"open({str(marker)!r}, 'w')"
    env = {**ENV, "XDG_CONFIG_HOME": str(tmp_path)}
    for key in ("NIMBUS_SERVICE_URL", "NIMBUS_TOKEN", "NIMBUS_ENDPOINT", "NIMBUS_CONFIG"):
        env.pop(key, None)
    argv = [sys.executable, "-m", "nimbus", "run", "-c", code]
    ran = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and marker.exists(), ran.stderr
    marker.unlink()
    (tmp_path / "nimbus").mkdir()
    (tmp_path / "nimbus" / "config.toml").write_text('endpoint = "hpc"\n')
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("nimbus run: NIMBUS_ENDPOINT=hpc: no nimbus service configured")
    assert not marker.exists()


def test_options_without_a_value_and_the_usage(tmp_path: Path) -> None:
    """Stranger #7: `-m`, `-c`, `--environment`, `--endpoint` last say they need a value
    (not "unknown option"); with nothing to run the usage names -c too; status 2."""
    for option in ("-m", "-c", "--environment", "--endpoint", "--environment="):
        done = _python("-m", "nimbus", "run", option, cwd=tmp_path)
        assert done.returncode == 2, (option, done.stderr)
        assert f"option {option.rstrip('=')} needs a value" in done.stderr, done.stderr
    bare = _python("-m", "nimbus", "run", cwd=tmp_path)
    assert bare.returncode == 2
    assert "no script, -m MODULE or -c CODE to run" in bare.stderr and "-c CODE" in bare.stderr
    glued = _python("-m", "nimbus", "run", "-cimport sys; print(sys.argv)", "a", cwd=tmp_path)
    assert glued.returncode == 0 and glued.stdout == "['-c', 'a']\n", glued.stderr


def test_an_unknown_option_points_to_the_help(tmp_path: Path) -> None:
    """A stranger's find: `nimbus run --bogus` said "unknown option" and nothing of where to
    look; it says `see nimbus run --help`, as every other nimbus command's parser does."""
    done = _python("-m", "nimbus", "run", "--bogus", "x.py", cwd=tmp_path)
    assert done.returncode == 2
    usage, said = done.stderr.splitlines()
    assert usage.startswith("usage: nimbus run ")
    assert said == "nimbus run: unknown option '--bogus' (see `nimbus run --help`)"
    for argv in (["run", "--bogus"], ["tasks", "list", "--bogus"], ["endpoint", "--bogus"]):
        cli = _python("-c", f"from nimbus.cli import main; main({argv!r})", cwd=tmp_path)
        prog = " ".join(["nimbus", *argv[:-1]])
        assert cli.returncode == 2 and cli.stderr.endswith(f"(see `{prog} --help`)\n"), cli.stderr


def test_the_help_and_the_readme_say_what_environment_takes(tmp_path: Path) -> None:
    """A stranger's find: `--help` said `--environment NAME`, the README `NAME|JSON`; it
    takes either (``nimbus.environments.resolve``: a built name, or an Environment's JSON)."""
    fast = _python("-m", "nimbus", "run", "--help", cwd=tmp_path)
    assert "[--environment NAME|JSON]" in fast.stdout.splitlines()[0]
    via_cli = _python("-c", "from nimbus.cli import main; main(['run', '--help'])", cwd=tmp_path)
    assert via_cli.stdout.count("--environment NAME|JSON") == 2, via_cli.stdout  # usage, option
    assert "environments build" in via_cli.stdout and "JSON" in via_cli.stdout
    readme = (SRC.parent / "README.md").read_text()
    assert "--environment NAME|JSON" in readme.replace("\\|", "|")
    assert not re.search(r"--environment NAME(?![|\\])", readme)


def test_help_to_a_reader_that_went_is_quiet(tmp_path: Path) -> None:
    """Stranger 16 F9: `nimbus run --help | head -1` printed a BrokenPipeError traceback.
    Here the reader has gone before the help is written: no output on stderr, status 0."""
    full = _python("-m", "nimbus", "run", "--help", cwd=tmp_path)
    assert full.returncode == 0 and full.stdout.startswith("usage: nimbus run ")
    r, w = os.pipe()
    os.close(r)  # every write to w fails with EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "nimbus", "run", "--help"], cwd=tmp_path, env=ENV,
            stdout=w, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(w)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.timeout(120)
def test_nimbus_run_directory_with_main_runs_as_python_does(tmp_path: Path) -> None:
    """Stranger #7: `nimbus run app ARGS` with app/__main__.py runs it as `python app ARGS`:
    argv[0] is the directory, sys.path[0] the directory, its modules import, its Pool works."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("def square(x):\n    return x * x\n")
    (app / "__main__.py").write_text(
        textwrap.dedent("""
            import sys, multiprocessing
            from helper import square
            if __name__ == "__main__":
                with multiprocessing.Pool(2) as pool:
                    print(pool.map(square, [1, 2, 3]))
                print(sys.argv, sys.path[0] == __import__("os").path.abspath("app"))
                print(multiprocessing.__name__.split(".")[0])
        """)
    )
    done = _python("-m", "nimbus", "run", "app", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[1, 4, 9]", "['app', 'x'] True", "nimbus"]
    plain = _python("app", "x", cwd=tmp_path)  # python itself: the same, stdlib multiprocessing
    assert plain.stdout.splitlines()[:2] == done.stdout.splitlines()[:2], plain.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = _python("-m", "nimbus", "run", "empty", cwd=tmp_path)
    # issue 16 fixrun #3: as python says it, status 1
    python = _python("empty", cwd=tmp_path)
    assert python.returncode == missing.returncode == 1, missing.stderr
    said = f"can't find '__main__' module in {str(empty)!r}\n"
    assert python.stderr.endswith(": " + said) and missing.stderr == "nimbus run: " + said


def test_a_wrong_environment_is_one_line_before_the_program(tmp_path: Path) -> None:
    """Stranger #5: --environment (or NIMBUS_ENVIRONMENT) that is not an environment is one
    line naming what was given, status 2, and the program does not start."""
    marker = tmp_path / "started"
    prog = _script(tmp_path, f"open({str(marker)!r}, 'w')\n")
    env = {**ENV, "NIMBUS_ENVIRONMENTS_DIR": str(tmp_path / "envs")}
    cases = [
        (["--environment", '{"name": 1}'], {}, "--environment='{\"name\": 1}': environment name 1"),
        (["--environment={nope"], {}, "--environment='{nope' is not JSON"),
        (["--environment", "nosuch"], {}, "--environment='nosuch': no environment of that name"),
        ([], {"NIMBUS_ENVIRONMENT": "nosuch"}, "NIMBUS_ENVIRONMENT='nosuch': no environment"),
    ]
    for options, extra, expected in cases:
        done = subprocess.run(
            [sys.executable, "-m", "nimbus", "run", *options, str(prog)],
            cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
        assert done.returncode == 2, (options, done.stderr)
        assert done.stderr.startswith(f"nimbus run: {expected}"), done.stderr
        assert len(done.stderr.splitlines()) == 1 and not marker.exists()
    assert "`nimbus environments list`" in done.stderr
    assert "`nimbus environments build nosuch" in done.stderr


ENDPOINT_PROGRAM = """
    import os, sys
    import multiprocessing
    import psutil

    OFFSET = None

    def init(offset):  # stranger 6 #1: a global the initializer sets, which the tasks read
        global OFFSET
        OFFSET = offset

    def where(x):
        return x * x + OFFSET, [p.pid for p in psutil.Process().parents()]

    def child(q):
        init(0)
        q.put(where(7))

    if __name__ == "__main__":
        with multiprocessing.Pool(2, initializer=init, initargs=(0,)) as pool:
            results = pool.map(where, range(8))
        print("sum", sum(r for r, _ in results), flush=True)
        q = multiprocessing.Queue()
        p = multiprocessing.Process(target=child, args=(q,))
        p.start()
        square, chain = q.get()
        p.join()
        print("process", square, p.exitcode, multiprocessing.cpu_count(), flush=True)
        print("chains", [c for _, c in results] + [chain], flush=True)
        sys.exit(int(sys.argv[1]))
"""


@pytest.mark.timeout(300)
def test_nimbus_run_endpoint_runs_on_a_real_endpoint(
    tmp_path: Path, service: Any, alice: Any, lab: Any
) -> None:
    """`nimbus run --endpoint lab script.py`: a real service on loopback and a real endpoint
    agent; the unmodified program's processes run there, its output and exit code are its own."""
    pytest.importorskip("psutil")
    prog = _script(tmp_path, ENDPOINT_PROGRAM)
    env = {
        **service.env,
        "PYTHONPATH": str(SRC),
        "NIMBUS_SERVICE_URL": service.url,
        "NIMBUS_TOKEN": alice.token,
    }
    env.pop("NIMBUS_ENDPOINT", None)  # the option says where
    done = subprocess.run(
        [sys.executable, "-m", "nimbus", "run", "--endpoint", "lab", str(prog), "5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 5, done.stderr
    marker = tmp_path / "started"
    nosuch = subprocess.run(  # stranger #5: refused before the program, naming the option
        [sys.executable, "-m", "nimbus", "run", "--endpoint", "nosuch", "-c",
         f"open({str(marker)!r}, 'w')"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert nosuch.returncode == 2 and not marker.exists(), nosuch.stderr
    assert nosuch.stderr.startswith("nimbus run: --endpoint=nosuch: "), nosuch.stderr
    assert "`nimbus endpoints list`" in nosuch.stderr and len(nosuch.stderr.splitlines()) == 1
    alice.register_endpoint("asleep")  # registered, never started: offline
    asleep = subprocess.run(  # stranger 16 F10: as an unknown endpoint, status 2
        [sys.executable, "-m", "nimbus", "run", "--endpoint", "asleep", "-c",
         f"open({str(marker)!r}, 'w')"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert asleep.returncode == 2 and not marker.exists(), asleep.stderr
    assert "the endpoint is offline: start it with" in asleep.stderr, asleep.stderr
    assert len(asleep.stderr.splitlines()) == 1
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["sum"] == str(sum(i * i for i in range(8)))
    assert lines["process"] == "49 0 2"  # the endpoint's 2 workers
    for chain in eval(lines["chains"]):  # every process descends from the endpoint agent
        assert lab.proc.pid in chain


QUEUE_SUBCLASS_PROGRAM = """
    import multiprocessing
    import multiprocessing.queues
    from concurrent.futures import ProcessPoolExecutor

    class Tagged(multiprocessing.queues.Queue):  # a user's subclass, as the stdlib's _SafeQueue
        tag = "t"  # (its instance attributes do not pickle, as with the stdlib's spawn)

        def __init__(self):
            super().__init__(ctx=multiprocessing.get_context())

        def put(self, obj, block=True, timeout=None):
            super().put((self.tag, obj), block, timeout)

    def child(q):
        q.put("from child")

    if __name__ == "__main__":
        with ProcessPoolExecutor(2) as ex:
            print("ppe", ex.submit(pow, 2, 5).result(), flush=True)
        q = Tagged()
        p = multiprocessing.Process(target=child, args=(q,))
        p.start()
        print("subclass", q.get(timeout=120), flush=True)
        p.join()
        print("exit", p.exitcode, flush=True)
"""


@pytest.mark.timeout(300)
def test_queue_subclasses_reach_an_endpoints_processes(
    tmp_path: Path, service: Any, alice: Any, lab: Any
) -> None:
    """Stranger 5 #1: concurrent.futures' ProcessPoolExecutor (its call queue is the stdlib's
    ``_SafeQueue``, a subclass of ``multiprocessing.queues.Queue``) and a user's subclass of
    it work under `nimbus run --endpoint`, whose shared workers imported the program's main
    module (so concurrent.futures.process, and the user's class) on the stdlib's multiprocessing."""
    prog = _script(tmp_path, QUEUE_SUBCLASS_PROGRAM)
    env = {
        **service.env,
        "PYTHONPATH": str(SRC),
        "NIMBUS_SERVICE_URL": service.url,
        "NIMBUS_TOKEN": alice.token,
    }
    env.pop("NIMBUS_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-m", "nimbus", "run", "--endpoint", "lab", str(prog)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ppe 32", "subclass ('t', 'from child')", "exit 0"]
    local = _python("-m", "nimbus", "run", str(prog), cwd=tmp_path)  # as it runs locally
    assert local.stdout == done.stdout, local.stderr


REPLACED_WORKERS_PROGRAM = """
    import multiprocessing, os, time
    import psutil

    def count(q):
        q.put(len(os.listdir("/proc/self/fd")))

    def counts(n=6):
        q = multiprocessing.Queue()
        ps = [multiprocessing.Process(target=count, args=(q,)) for _ in range(n)]
        for p in ps:
            p.start()
        got = [q.get(timeout=60) for _ in ps]
        for p in ps:
            p.join()
        return got

    def workers():  # the root's forked warm workers: its children with its command line
        me, found = psutil.Process(), []
        for c in me.children():
            try:
                if c.status() != psutil.STATUS_ZOMBIE and c.cmdline() == me.cmdline():
                    found.append(c)
            except psutil.Error:
                pass
        return found

    if __name__ == "__main__":
        before = counts()
        opened = [open(__file__) for _ in range(4)] + [os.pipe() for _ in range(4)]
        dead = workers()
        for worker in dead:
            worker.kill()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = workers()
            if len(now) >= len(dead) and not set(now) & set(dead):
                break
            time.sleep(0.1)
        print("replaced", len(dead) > 0 and not set(workers()) & set(dead), flush=True)
        print("counts", max(before), max(counts()), flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.timeout(180)
def test_replacement_workers_do_not_inherit_what_the_root_opened_since(tmp_path: Path) -> None:
    """A worker that dies is replaced by a new fork of the root: its children have the
    descriptors the first workers' children have, not the 12 the program opened meanwhile."""
    pytest.importorskip("psutil")
    prog = _script(tmp_path, REPLACED_WORKERS_PROGRAM)
    done = _python("-m", "nimbus", "run", str(prog), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["replaced"] == "True"
    first, replaced = map(int, lines["counts"].split())
    assert replaced <= first, done.stdout


PACKAGE_MAIN = """
    import sys
    import multiprocessing as mp

    def sq(x):
        return x * x

    if __name__ == "__main__":
        with mp.Pool(2) as pool:
            print(pool.map(sq, range(5)))
        p = mp.Process(target=sq, args=(3,))
        p.start()
        p.join()
        print("exit", p.exitcode, __spec__.name if __spec__ else None)
"""


@pytest.mark.timeout(120)
def test_functions_of_a_package_or_directory_main_run_in_pool_and_process(tmp_path: Path) -> None:
    """Issue 16 fixrun #1: `nimbus run -m mypkg` and `nimbus run DIR` with a __main__.py
    defining the function: children import it as __mp_main__ (the stdlib's spawn leaves
    out a `.__main__` module; every child failed to unpickle `sq` and Pool.map hung)."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _script(pkg, PACKAGE_MAIN, "__main__.py")
    app = tmp_path / "app"
    app.mkdir()
    _script(app, PACKAGE_MAIN, "__main__.py")
    for args, spec in ((["-m", "mypkg"], "mypkg.__main__"), (["app"], "__main__")):
        done = _python("-m", "nimbus", "run", *args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["[0, 1, 4, 9, 16]", f"exit 0 {spec}"], done.stderr
        plain = _python(*args, cwd=tmp_path)
        assert plain.stdout == done.stdout, plain.stderr


@pytest.mark.timeout(120)
def test_a_pool_task_its_worker_cannot_unpickle_fails_the_map(tmp_path: Path) -> None:
    """Issue 16 fixrun #1: a task whose function the pool's children cannot find fails the
    map with the DeserializationError, as a task that raises does: it never hangs, and the
    pool's workers live on. (A function defined under the guard is no such function any
    more: it travels by value, stranger 16 F1; a module gone from disk is.)"""
    path = _script(
        tmp_path,
        """
        import multiprocessing as mp
        import os
        if __name__ == "__main__":
            with mp.Pool(2) as pool:
                print(pool.map(abs, [-1, -2]))
                with open("gone.py", "w") as f:
                    f.write("def sq(x):\\n    return x * x\\n")
                from gone import sq  # after the children started, and gone from disk
                os.remove("gone.py")
                try:
                    pool.map(sq, range(20))
                except Exception as exc:
                    print("failed:", type(exc).__name__, "'gone'" in str(exc))
                print(pool.map(abs, [-1, -2]))
        """,
    )
    done = _python("-m", "nimbus", "run", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[1, 2]", "failed: DeserializationError True", "[1, 2]"]


UNGUARDED = """
    import math
    import multiprocessing as mp
    import threading

    def sq(x):
        return math.sqrt(x) * 2

    class Box:
        def __init__(self, v):
            self.v = v

    def child(q, lock, rlock, box):
        with lock:
            q.put(("child", box.v, sq(16), rlock.acquire(blocking=False)))

    print("start", mp.get_start_method())
    with mp.Pool(2) as pool:
        print(pool.map(sq, [1, 4, 9]))
    q = mp.Queue()
    rlock = threading.RLock()
    rlock.acquire()
    p = mp.Process(target=child, args=(q, threading.Lock(), rlock, Box(7)))
    p.start()
    print(q.get())
    p.join()
    print("exit", p.exitcode)
"""


@pytest.mark.timeout(120)
def test_a_script_without_the_main_guard_runs_as_with_fork(tmp_path: Path) -> None:
    """Issue 16 fixrun #2: a fork-style script (no `if __name__ == "__main__":`) runs under
    `nimbus run` as under python's fork: its top level runs once, its functions and classes
    go to the children by value; thread locks passed to a Process arrive in their state."""
    path = _script(tmp_path, UNGUARDED)
    done = _python("-m", "nimbus", "run", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plain = _python(str(path), cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert done.stdout == plain.stdout
    assert done.stdout.splitlines()[2] == "('child', 7, 8.0, True)"


def test_syntax_error_and_interrupt_show_only_the_programs_frames(tmp_path: Path) -> None:
    """Issue 16 fixrun #4: a SyntaxError in the script and a KeyboardInterrupt in it are
    shown as python shows them, with no frame of nimbus's launcher or Ctrl-C handler."""
    bad = _script(tmp_path, "x = 1\ndef (:\n", "bad.py")
    interrupted = _script(tmp_path, "def f():\n    raise KeyboardInterrupt\nf()\n", "ki.py")
    for path in (bad, interrupted):
        done = _python("-m", "nimbus", "run", str(path), cwd=tmp_path)
        plain = _python(str(path), cwd=tmp_path)
        assert (done.returncode, done.stderr) == (plain.returncode, plain.stderr)
        assert "nimbus" not in done.stderr


@pytest.mark.timeout(120)
def test_bad_config_and_an_unreachable_store_are_one_line(tmp_path: Path) -> None:
    """Issue 16 fixrun #4: nimbus's own configuration error while starting the program's
    processes is one line and status 2; a store it cannot reach one line and status 1."""
    path = _script(
        tmp_path,
        """
        import multiprocessing as mp
        if __name__ == "__main__":
            with mp.Pool(2) as pool:
                print(pool.map(abs, [-1]))
        """,
    )
    for variable, value, status, named in (
        ("NIMBUS_WORKERS", "abc", 2, "NIMBUS_WORKERS='abc'"),
        ("NIMBUS_REDIS_URL", "redis://127.0.0.1:1", 1, "redis://127.0.0.1:1"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "nimbus", "run", str(path)], cwd=tmp_path,
            env={**ENV, variable: value}, capture_output=True, text=True, timeout=100, check=False,
        )  # fmt: skip
        assert done.returncode == status, done.stderr
        assert done.stderr.count("\n") == 1 and named in done.stderr, done.stderr
        assert done.stderr.startswith("nimbus run: ")


@pytest.mark.timeout(120)
def test_what_a_killed_program_left_is_removed_when_the_next_starts(tmp_path: Path) -> None:
    """Issue 16 fixrun #5: SIGKILL of a program using Pipes (messaging sockets), a Pool
    and a Process leaves its store's files, its relay, its m-<id> sockets and its shared
    memory directory; the next program's start removes all of them, in one pass."""
    import shutil
    import tempfile

    runtime = Path(tempfile.mkdtemp(prefix="nr", dir="/tmp"))  # short: Unix socket paths
    env = {**ENV, "NIMBUS_RUNTIME_DIR": str(runtime)}
    killed = _script(
        tmp_path,
        """
        import multiprocessing as mp, time
        def echo(c):
            c.send(c.recv())
            time.sleep(60)
        if __name__ == "__main__":
            a, b = mp.Pipe()
            p = mp.Process(target=echo, args=(b,))
            p.start()
            b.close()
            a.send("x")
            with mp.Pool(2) as pool:
                print(a.recv(), pool.map(abs, [-1]), flush=True)
            time.sleep(60)
        """,
        "killed.py",
    )
    nxt = _script(
        tmp_path,
        """
        import multiprocessing as mp
        if __name__ == "__main__":
            p = mp.Process(target=print, args=("next",))
            p.start()
            p.join()
        """,
        "next.py",
    )
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nimbus", "run", str(killed)], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "x [1]\n"
            left = sorted(p.name for p in runtime.iterdir())
            assert any(n.startswith("m-") for n in left) and any(
                n.startswith("relay-") for n in left
            )
            assert any(n.startswith("redis-") for n in left), left
            shm = list(Path("/dev/shm").glob(f"*/*-{proc.pid}-*"))
            assert shm
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
        done = subprocess.run(
            [sys.executable, "-m", "nimbus", "run", str(nxt)], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=100, check=False,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout == "next\n", done.stderr
        assert sorted(p.name for p in runtime.iterdir()) == []
        assert not [p for p in shm if p.exists()]
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


LARGE_GLOBAL_PROGRAM = """
    import multiprocessing as mp
    from nimbus.multiprocessing._site import dumps

    DATA = list(range(100_000))  # its pickle: ~370 KB
    CONF = {"k": 1}

    def look(i):
        return DATA[i] * CONF["k"]

    def scaled(i):
        return i * CONF["k"]

    if __name__ == "__main__":
        CONF["k"] = 2
        def square(x):
            return x * x
        for fn in (look, scaled, square):
            print(fn.__name__, len(dumps(fn)[0]) > 100_000)
        with mp.Pool(2) as pool:
            print(pool.map(scaled, [1, 2]), pool.map(square, [3]), pool.map(look, [5]))
"""


def test_a_main_function_reading_a_large_global_goes_by_name_where_workers_import_it(
    tmp_path: Path,
) -> None:
    """A guarded main's functions travel by value with the globals they read, so what the
    guard set up reaches the children (``scaled`` sees k = 2, ``square`` is defined
    there); but one whose pickle with its globals is over LARGE_MAIN, defined at the
    top level, goes by name, as spawn sends it: carried in every task, a 370 KB global
    made a Pool.map of 500 small tasks 100x slower (its workers imported it: DATA is
    theirs, and CONF as imported)."""
    prog = _script(tmp_path, LARGE_GLOBAL_PROGRAM)
    done = subprocess.run(
        [sys.executable, "-m", "nimbus", "run", str(prog)], cwd=tmp_path, env=ENV,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "look False", "scaled False", "square False", "[2, 4] [9] [5]"
    ], done.stdout  # fmt: skip
