"""The Site interface: local or remote decided in one place (``multiprocessing._site``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nimbus.multiprocessing as mp
from nimbus import statestore
from nimbus.multiprocessing import _site, popen_nimbus
from nimbus.multiprocessing._local import LocalSite, RelayedSite
from nimbus.multiprocessing._remote import RemoteSite

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_a_site_is_three_methods_and_each_kind_is_one() -> None:
    assert _site.Site.__abstractmethods__ == {"start", "signal", "close"}
    for kind in (LocalSite, RelayedSite, RemoteSite):
        assert issubclass(kind, _site.Site)
        assert not kind.__abstractmethods__


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_local_program_starts_and_signals_through_its_local_site() -> None:
    p = mp.Process(target=_sleep, args=(60,))
    p.start()
    where = popen_nimbus.site()
    assert isinstance(where, LocalSite)
    assert where.program == statestore.program() and not where.program.remote
    assert p._popen._site is where  # type: ignore[attr-defined]
    p.terminate()  # site.signal: by pid, on this host
    p.join(30)
    assert p.exitcode == -signal.SIGTERM


def _program_in_a_fresh_process(tmp_path: Path, code: str) -> str:
    env = os.environ | {"PYTHONPATH": SRC, "NIMBUS_RUNTIME_DIR": str(tmp_path)}
    env.pop("NIMBUS_SHARED_MEMORY", None)
    env.pop("NIMBUS_ENDPOINT", None)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()


def test_multiprocessing_opens_the_program_with_shared_memory_the_store_alone_without(
    tmp_path: Path,
) -> None:
    alone = "from nimbus import statestore\nprint(statestore.program().shared)"
    assert _program_in_a_fresh_process(tmp_path, alone) == "None"
    with_mp = "import nimbus.multiprocessing\n" + alone
    shared = _program_in_a_fresh_process(tmp_path, with_mp)
    assert shared != "None"
    assert not Path(shared).exists()  # removed at the root's exit
