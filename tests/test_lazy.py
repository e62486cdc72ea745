"""``nimbus._lazy``: modules imported on first use, and what that saves a program."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nimbus._lazy import lazy

SRC = Path(__file__).resolve().parents[1] / "src"


def test_a_lazy_module_is_imported_on_first_use_and_then_stands_in_its_own_place() -> None:
    namespace: dict[str, object] = {}
    name = "nimbus._lazy_probe_never_imported"
    namespace["probe"] = lazy(name, namespace, "probe")
    assert name not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="_lazy_probe_never_imported"):
        _ = namespace["probe"].anything  # type: ignore[attr-defined]
    namespace["json"] = stand_in = lazy("json", namespace)  # imported already: itself
    assert stand_in is sys.modules["json"]
    namespace["colorsys"] = stand_in = lazy("colorsys", namespace)
    if "colorsys" not in sys.modules:
        assert namespace["colorsys"] is stand_in
    assert stand_in.rgb_to_hsv(0, 0, 0) == (0.0, 0.0, 0.0)
    assert namespace["colorsys"] is sys.modules["colorsys"]  # the module itself from now on


def _run_program(tmp_path: Path, source: str) -> list[str]:
    """The lines ``source`` (a program importing nimbus.multiprocessing) prints."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


PROGRAM = """
    import sys
    import nimbus.multiprocessing as mp

    def child(q=None):
        if q is not None:
            q.put("redis" in sys.modules)

    if __name__ == "__main__":
        print("import", "redis" in sys.modules)
        p = mp.Process(target=child)
        p.start()
        p.join()
        print("process", "redis" in sys.modules, p.exitcode)
        q = mp.Queue()
        p = mp.Process(target=child, args=(q,))
        p.start()
        print("queue", q.get(timeout=60), "redis" in sys.modules)
        p.join()
"""


@pytest.mark.timeout(120)
def test_redis_py_is_imported_when_the_store_is_first_used(tmp_path: Path) -> None:
    """Importing the package and starting processes need no redis-py (half of what the
    import cost); a shared object imports it, in the root before its workers fork."""
    assert _run_program(tmp_path, PROGRAM) == [
        "import False",
        "process False 0",
        "queue True True",
    ]


@pytest.mark.timeout(120)
def test_package_metadata_is_not_read_by_the_import_nor_the_first_start(tmp_path: Path) -> None:
    """``importlib.metadata`` (18 ms of ``import nimbus.multiprocessing``) is imported
    where a package's version is looked up (an environment is built), not before."""
    printed = _run_program(
        tmp_path,
        """
            import sys
            import nimbus.multiprocessing as mp

            def child():
                pass

            if __name__ == "__main__":
                print("importlib.metadata" in sys.modules)
                p = mp.Process(target=child)
                p.start()
                p.join()
                print("importlib.metadata" in sys.modules, p.exitcode)
            """,
    )
    assert " ".join(printed).split() == ["False", "False", "0"]
