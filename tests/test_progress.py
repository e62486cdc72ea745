"""``Executor.map(..., progress=True)``: a bar on stderr, tqdm's or the plain one."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import termios
import textwrap
import threading
from pathlib import Path

import pytest

from nimbus._progress import Bar

PROGRAM = textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "plain":
        sys.modules["tqdm"] = None  # as if tqdm were not installed
    from nimbus import Executor

    with Executor(max_workers=2) as ex:
        out = list(ex.map(abs, range(-30, 0), chunksize=int(sys.argv[2]), progress=True))
    print(sum(out))
    """
)


def _run(tmp_path: Path, mode: str, chunksize: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(chunksize)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_map_progress_plain_fallback_without_tqdm(tmp_path: Path) -> None:
    proc = _run(tmp_path, "plain", 1)
    assert proc.stdout.strip() == str(sum(range(1, 31)))  # results untouched
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("map abs: [") and "0/30 (0%)" in lines[0]
    assert "30/30 (100%)" in lines[-1]
    assert len(lines) <= 11  # a pipe gets one line per tenth of the way, not one per task
    assert "it/s" not in proc.stderr  # not tqdm's


def test_map_progress_with_tqdm_counts_items_of_chunks_on_a_terminal(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    master, slave = pty.openpty()  # stderr a terminal: tqdm draws there
    termios.tcsetwinsize(slave, (24, 100))  # (a terminal of no columns draws no bar)
    drawn: list[bytes] = []

    def read() -> None:  # as the terminal does, while the program writes
        try:
            while chunk := os.read(master, 65536):
                drawn.append(chunk)
        except OSError:  # EIO: the terminal's other end closed, all read
            pass

    reader = threading.Thread(target=read)
    reader.start()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), "tqdm", "7"],  # 5 chunks, 30 items
            stdout=subprocess.PIPE, stderr=slave, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        os.close(slave)
        reader.join(30)
        os.close(master)
    assert proc.returncode == 0 and proc.stdout.strip() == str(sum(range(1, 31)))
    text = b"".join(drawn).decode()
    assert "map abs" in text and "30/30" in text and "task/s" in text, text  # tqdm's


def test_progress_to_a_pipe_writes_plain_lines_without_cursor_control(tmp_path: Path) -> None:
    """A stranger's find: with tqdm installed, a bar to a pipe (a log, CI) was tqdm's, full
    of "\\r" rewrites. Not on a terminal, it is the plain bar's lines: a map's, and
    `nimbus run --progress`'s for a Pool map."""
    proc = _run(tmp_path, "tqdm", 7)
    assert proc.stdout.strip() == str(sum(range(1, 31)))
    assert "\r" not in proc.stderr and "\x1b" not in proc.stderr, repr(proc.stderr)
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("map abs: [") and "30/30 (100%)" in lines[-1]
    script = tmp_path / "pool.py"
    script.write_text(
        "from multiprocessing import Pool\n"
        "if __name__ == '__main__':\n"
        "    with Pool(2) as pool:\n"
        "        print(sum(pool.map(abs, range(-20, 0))))\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    run = subprocess.run(
        [sys.executable, "-m", "nimbus", "run", "--progress", str(script)],
        capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": src},
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "210", run.stderr
    assert "\r" not in run.stderr and "\x1b" not in run.stderr, repr(run.stderr)
    assert run.stderr.splitlines()[-1].startswith("map abs: [####################] 20/20 (100%)")


def test_map_without_progress_writes_nothing(tmp_path: Path) -> None:
    script = tmp_path / "quiet.py"
    script.write_text(
        "from nimbus import Executor\n"
        "with Executor(max_workers=1) as ex:\n"
        "    print(list(ex.map(abs, [-1, -2])))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[1, 2]"
    assert proc.stderr == ""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_bar_on_a_terminal_rewrites_one_line_from_many_threads() -> None:
    out = _Tty()
    bar = Bar(400, "map f", out)
    threads = [threading.Thread(target=lambda: [bar.done() for _ in range(100)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    text = out.getvalue()
    assert bar.closed and bar.count == 400
    assert text.count("\n") == 1
    assert re.search(r"\rmap f: \[#{20}\] 400/400 \(100%\) [0-9.]+ s\n$", text)
    assert text.count("\r") == 401  # the first draw and one per item
    bar.done()  # after the end: ignored
    assert out.getvalue() == text


def test_plain_bar_closed_early_when_map_is_abandoned() -> None:
    out = io.StringIO()
    bar = Bar(10, "map f", out)
    bar.done(3)
    bar.close()
    bar.done(7)
    assert bar.count == 3 and out.getvalue().splitlines()[-1].startswith("map f: [######")


def test_plain_bar_ends_once_when_a_failed_map_cancels_the_rest() -> None:
    from concurrent.futures import Future
    from functools import partial

    from nimbus._progress import count

    out = _Tty()
    bar = Bar(100, "map f", out)
    futures: list[Future[int]] = [Future() for _ in range(100)]
    for future in futures:
        future.add_done_callback(partial(count, bar, 1))
    for future in futures[:50]:
        future.set_result(1)
    futures[50].set_exception(ValueError("one task failed"))
    for future in futures[51:]:  # what Executor.map does when a result raises
        future.cancel()
    text = out.getvalue()
    assert bar.closed and bar.count == 51
    assert text.count("\r") == 52  # the first draw and one per finished task, none per cancel
    assert text.endswith("51/100 (51%) " + text.rsplit(" ", 2)[-2] + " s\n")


def test_progress_must_be_a_bool() -> None:
    from nimbus import Executor

    with Executor(max_workers=1) as ex, pytest.raises(TypeError, match="progress must be True"):
        ex.map(abs, [1], progress="yes")  # type: ignore[arg-type]


POOL_PROGRAM = textwrap.dedent(
    """
    import sys
    import time
    from multiprocessing import Pool
    sys.modules["tqdm"] = None  # the plain bar: its lines are the test's to read

    def square(x):
        time.sleep(0.02)
        return x * x

    def bad(x):
        if x == 7:
            raise ValueError("seven")
        return x

    if __name__ == "__main__":
        with Pool(2) as pool:
            print(sum(pool.map(square, range(40), chunksize=4)))
            print(sum(pool.starmap(pow, [(2, i) for i in range(10)])))
            print(sum(pool.imap_unordered(square, range(20))))
            if sys.argv[1:] == ["fail"]:
                pool.map(bad, range(20), chunksize=1)
    """
)


def _nimbus_run(
    tmp_path: Path, *options: str, argv: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "pool_prog.py"
    script.write_text(POOL_PROGRAM)
    src = str(Path(__file__).resolve().parents[1] / "src")
    return subprocess.run(
        [sys.executable, "-m", "nimbus", "run", *options, str(script), *argv],
        capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": src},
    )  # fmt: skip


def _bars(stderr: str) -> dict[str, list[tuple[int, int]]]:
    """Each bar's (done, total) lines, by label, in order."""
    out: dict[str, list[tuple[int, int]]] = {}
    for label, done, total in re.findall(r"^(map \w+): \[[#.]+\] (\d+)/(\d+)", stderr, re.M):
        out.setdefault(label, []).append((int(done), int(total)))
    return out


def test_nimbus_run_progress_draws_a_bar_for_each_pool_map(tmp_path: Path) -> None:
    proc = _nimbus_run(tmp_path, "--progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(sum(x * x for x in range(40))), "1023",
                                   str(sum(x * x for x in range(20)))]  # fmt: skip
    bars = _bars(proc.stderr)
    square = bars["map square"]  # the map, then the imap_unordered
    first = square[: square.index((40, 40)) + 1]
    assert first[0] == (0, 40) and len(first) >= 4  # moved as chunks came back, not at the end
    assert [done for done, _ in first] == sorted(done for done, _ in first)
    assert all(done % 4 == 0 for done, _ in first)  # whole chunks of 4 items
    assert square[-1] == (20, 20)
    assert bars["map pow"][-1] == (10, 10)


def test_nimbus_run_progress_a_failed_map_ends_its_bar_and_the_program_as_python(
    tmp_path: Path,
) -> None:
    proc = _nimbus_run(tmp_path, "--progress", argv=("fail",))
    assert proc.returncode == 1 and "ValueError: seven" in proc.stderr
    failed = _bars(proc.stderr)["map bad"]
    assert failed[0] == (0, 20) and failed[-1][0] < 20


def test_nimbus_run_without_progress_draws_no_bar(tmp_path: Path) -> None:
    proc = _nimbus_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "map " not in proc.stderr
