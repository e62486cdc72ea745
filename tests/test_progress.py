"""``Executor.map(..., progress=True)``: a bar on stderr, tqdm's or the plain one."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

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


def test_map_progress_with_tqdm_counts_items_of_chunks(tmp_path: Path) -> None:
    proc = _run(tmp_path, "tqdm", 7)  # 5 chunks, 30 items
    assert proc.stdout.strip() == str(sum(range(1, 31)))
    assert "map abs" in proc.stderr and "30/30" in proc.stderr


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
