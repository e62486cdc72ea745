"""``nimbus dashboard``: this machine's dashboard on loopback, its URL printed, you its
admin; over HTTP as a browser logs in; stopped cleanly; its history kept across a restart."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from nimbus.client import Client
from nimbus.config import Settings
from nimbus.service.dashboard._html import short
from nimbus.service.registry import Registry
from service_support import CLI, Service, service_env


def _interruptible() -> None:
    """SIGINT as a terminal's program has it: a test run started in the background
    (CI's shell, `&`) inherits it ignored, and Python keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(root: Path) -> tuple[subprocess.Popen[str], str, str]:
    """``nimbus dashboard --port 0``: the process, the token it printed, its URL."""
    url_file = root / "url"
    url_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, "dashboard", "--port", "0", "--user", "dana",
         "--url-file", str(url_file)],
        env=service_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_interruptible,
    )  # fmt: skip
    assert proc.stdout is not None
    head = proc.stdout.readline()
    assert head.startswith("nimbus dashboard: log in as dana with this token"), head
    token = proc.stdout.readline().strip()
    listening = proc.stdout.readline()
    deadline = time.monotonic() + 60
    while not url_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(stop(proc))
        time.sleep(0.05)
    url = url_file.read_text().strip()
    assert listening.strip() == f"nimbus dashboard listening on {url}"  # no service started
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and token not in url
    return proc, token, url


def login(http: httpx.Client, token: str) -> None:
    csrf = re.search(r'name="csrf" value="([^"]+)"', http.get("/login").text)
    assert csrf is not None
    assert http.post("/login", data={"token": token, "csrf": csrf[1]}).status_code == 303


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> tuple[int, str]:
    """SIGTERM (or ``sig``): its exit status and what it wrote on stderr."""
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def test_nimbus_dashboard_serves_this_machine_prints_its_url_and_stops_cleanly(
    tmp_path: Path,
) -> None:
    proc, token, url = start(tmp_path)
    try:
        settings = Settings.load(service_env(tmp_path))
        registry = Registry(settings.registry_url)
        other = registry.create_user_token("olga")  # another user of this machine
        registry.close()
        with Client(url, other, settings=settings) as olga:
            olga.register_endpoint("olgas-lab")
            [task_id] = olga.batch_run(abs, [(-1,)], endpoint="olgas-lab")  # stays queued
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/", follow_redirects=False).status_code == 303  # no session
            login(http, token)
            assert "olgas-lab" in http.get("/").text  # you are its admin: every endpoint
            assert task_id in http.get("/tasks").text
        sockets = list((tmp_path / "rt").glob("redis-*.sock"))
        assert sockets
    finally:
        code, err = stop(proc)
    assert code == 0, err
    assert not any(path.exists() for path in sockets)  # its Redis stopped, its files gone

    proc, token, url = start(tmp_path)  # again: the history is still there
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            login(http, token)
            assert task_id in http.get("/tasks").text
    finally:
        code, err = stop(proc)
    assert code == 0, err


def shout(word: str) -> str:
    return word.upper()


def test_a_local_executors_tasks_show_on_the_page_nimbus_dashboard_serves(
    tmp_path: Path,
) -> None:
    """Not through the service: a local Executor of the same runtime directory hands its
    finished records (files) to the service, which keeps them in the history it reads."""
    from nimbus import Executor

    proc, token, url = start(tmp_path)
    try:
        settings = Settings.load(service_env(tmp_path))
        with Executor(max_workers=1, settings=settings) as pool:
            futures = [pool.submit(shout, w) for w in ("a", "b", "c")]
            assert [f.result(timeout=60) for f in futures] == ["A", "B", "C"]
            ids = [f.record.task_id for f in futures]  # type: ignore[attr-defined]
        with httpx.Client(base_url=url, timeout=30) as http:
            login(http, token)
            deadline = time.monotonic() + 20  # the service reads them each second
            while not all(task_id in (page := http.get("/tasks").text) for task_id in ids):
                assert time.monotonic() < deadline, page[-3000:]
                time.sleep(0.2)
            assert not list((tmp_path / "rt" / "service" / "local-history").iterdir())
            # a local executor's ids differ at their end: the rows say which is which
            shown = [short(task_id) for task_id in ids]
            assert len(set(shown)) == 3 and all(f">{s}</a>" in page for s in shown)
            task = http.get(f"/tasks/{ids[0]}")
            assert task.status_code == 200 and "shout" in task.text and "success" in task.text
    finally:
        code, err = stop(proc)
    assert code == 0, err


def test_the_dashboards_token_is_revoked_when_it_stops_by_sigterm_or_ctrl_c(
    tmp_path: Path,
) -> None:
    """A registry token made for one run: accepted while it runs, then refused (401) by
    any service on the same registry; a run that cannot listen makes none."""
    env = service_env(tmp_path)
    tokens = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc, token, url = start(tmp_path)
        try:
            with httpx.Client(base_url=url, timeout=30) as http:
                whoami = http.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"})
                assert whoami.status_code == 200, whoami.text
        finally:
            code, err = stop(proc, sig)
        assert code == (0 if sig == signal.SIGTERM else 130), err
        tokens.append(token)
    early = subprocess.Popen(
        [sys.executable, "-c", CLI, "dashboard", "--port", "0", "--user", "dana"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert early.stdout is not None
    assert "log in as dana" in early.stdout.readline()
    code, err = stop(early)  # SIGTERM at once: while its service starts
    assert code == 0, err
    with socket.socket() as busy:  # a port in use: no token made, no service started
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        failed = subprocess.run(
            [sys.executable, "-c", CLI, "dashboard", "--port", str(port), "--user", "dana"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert failed.returncode == 2 and "in use" in failed.stderr, failed.stderr
    assert "token" not in failed.stdout
    registry = Registry(Settings.load(env).registry_url)
    try:
        assert registry.tokens() == []  # none left behind
    finally:
        registry.close()
    service = Service(tmp_path, env).start()  # the real service, same registry
    try:
        with service.http() as http:
            for token in tokens:
                answer = http.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"})
                assert answer.status_code == 401, answer.text
            fresh = service.token("dana")
            answer = http.get("/v1/whoami", headers={"Authorization": f"Bearer {fresh}"})
            assert answer.status_code == 200  # the check can fail: a live token passes
    finally:
        service.stop()


def test_nimbus_dashboard_beside_a_running_service_points_to_it_and_starts_none(
    tmp_path: Path,
) -> None:
    env = service_env(tmp_path)
    service = Service(tmp_path, env).start()
    try:
        state = tmp_path / "rt" / "service" / "service.json"
        before = state.read_text()
        heavy = (
            "; print(sorted(m for m in ('fastapi', 'uvicorn', 'sqlalchemy') if m in sys.modules))"
        )
        done = subprocess.run(
            [sys.executable, "-c", CLI.replace("; sys.exit(main())", f"; code = main(){heavy}; "
             "sys.exit(code)"), "dashboard", "--port", "0", "--user", "dana"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        # it took 5.5 s (10 s loaded): the server's imports, before it read service.json
        assert done.stdout.splitlines()[-1] == "[]", done.stdout
        assert f"a service runs at {service.url}" in done.stdout, done.stdout
        assert f"its dashboard is at {service.url}/" in done.stdout
        assert "nimbus service token create dana" in done.stdout
        assert "listening" not in done.stdout  # no second service
        assert state.read_text() == before  # service.json untouched
        registry = Registry(service.settings().registry_url)
        try:
            assert registry.tokens() == []  # no token made
        finally:
            registry.close()
        token = service.token("dana")
        with service.http(token) as http:
            assert http.get("/v1/whoami").status_code == 200
        # stranger 6 #11: logged in (as another user than the OS's), the hint named the
        # OS user's `token create` alone: the token given to `nimbus login` comes first
        login = subprocess.run(
            [sys.executable, "-c", CLI, "login", "--service", service.url, "--token",
             service.token("erin")], env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert login.returncode == 0, login.stderr
        again = subprocess.run([sys.executable, "-c", CLI, "dashboard", "--port", "0"], env=env,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "(log in with the token you gave `nimbus login`, or a new one: " in again.stdout
    finally:
        service.stop()


def test_a_local_executors_tasks_appear_on_an_open_tasks_page_without_a_reload(
    tmp_path: Path,
) -> None:
    """The service publishes the ingested rows' owner on the task store's channel: the
    admin's open stream reads the history and sends them as events."""
    from nimbus import Executor

    proc, token, url = start(tmp_path)
    try:
        settings = Settings.load(service_env(tmp_path))
        lines: list[str] = []
        with httpx.Client(base_url=url, timeout=30) as http:
            login(http, token)
            opened = threading.Event()

            def read() -> None:
                with http.stream("GET", "/tasks/stream", timeout=60) as stream:
                    for line in stream.iter_lines():
                        lines.append(line)
                        opened.set()
                        if sum(line.startswith("data: {") for line in lines) >= 3:
                            return

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            assert opened.wait(30)
            time.sleep(0.5)  # its first look done: what follows is pushed
            with Executor(max_workers=1, settings=settings) as pool:
                futures = [pool.submit(shout, w) for w in ("x", "y", "z")]
                assert [f.result(timeout=60) for f in futures] == ["X", "Y", "Z"]
                ids = [f.record.task_id for f in futures]  # type: ignore[attr-defined]
            reader.join(30)
            assert not reader.is_alive(), lines[-20:]
        text = "\n".join(lines)
        assert all(task_id in text for task_id in ids), text[-2000:]
        assert "shout" in text and "success" in text
    finally:
        code, err = stop(proc)
    assert code == 0, err


POOL_PROGRAM = """
import multiprocessing as mp
import sys


def square(x):
    return x * x


def fails():
    sys.exit(3)


if __name__ == "__main__":
    with mp.Pool(2) as pool:
        print(sum(pool.map(square, range(20), chunksize=5)))
    p = mp.Process(target=fails)
    p.start()
    p.join()
    print("exit", p.exitcode)
"""


def test_a_nimbus_run_programs_processes_and_pool_tasks_show_on_the_tasks_page(
    tmp_path: Path,
) -> None:
    """``nimbus run`` of a Pool program: each Pool task (a map's chunk) and each Process
    (one that exits 3) hands its record over from the process that ran it, though the
    pool's workers are terminated by ``with``; the tasks page lists them all."""
    proc, token, url = start(tmp_path)
    try:
        program = tmp_path / "squares.py"
        program.write_text(POOL_PROGRAM)
        ran = subprocess.run(
            [sys.executable, "-c", CLI, "run", str(program)],
            env=service_env(tmp_path), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == ["2470", "exit", "3"]
        with httpx.Client(base_url=url, timeout=30) as http:
            login(http, token)
            deadline = time.monotonic() + 20  # the service reads the files each second
            while True:
                page = http.get("/tasks").text
                rows = re.findall(
                    r'<tr data-task="([^"]+)">.*?<td class="state (\w+)">\w+</td><td>([^<]*)</td>',
                    page,
                )
                names = sorted((fn, state) for _, state, fn in rows)
                if names.count(("square", "success")) == 4 and ("fails", "failed") in names:
                    break
                assert time.monotonic() < deadline, names
                time.sleep(0.2)
            # the pool's processes are listed when they end by themselves; terminated
            # by the pool (``with``), they are not (their tasks are)
            assert names.count(("_worker", "success")) <= 2, names
            [chunk] = [task_id for task_id, _, fn in rows if fn == "square"][:1]
            task = http.get(f"/tasks/{chunk}")
            assert task.status_code == 200 and "pool/" in task.text
    finally:
        code, err = stop(proc)
    assert code == 0, err


def test_nimbus_dashboard_refuses_a_url_file_it_cannot_write_in_one_line(tmp_path: Path) -> None:
    """It printed pathlib's traceback (FileNotFoundError: '/proc/nope') once its service
    was up; now one line naming the path, status 2, before any token or service."""
    env = service_env(tmp_path)
    for where in ("/proc/nope/x", str(tmp_path / "file" / "x")):
        (tmp_path / "file").write_text("a file, not a directory")
        done = subprocess.run(
            [sys.executable, "-c", CLI, "dashboard", "--port", "0", "--url-file", where],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.splitlines()
        assert line.startswith(f"nimbus dashboard: --url-file {where}: cannot write there ("), line
        assert "Traceback" not in done.stderr and "token" not in done.stdout


def test_the_dashboards_hint_reads_the_credentials_where_the_client_saves_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 7 #15: ``_which_token`` re-implemented ``client.credentials_file()`` (its
    path and format): one home now, ``nimbus.config``, that both use."""
    import nimbus.client
    import nimbus.config
    from nimbus.cli.dashboard import _which_token

    assert nimbus.client.credentials_file is nimbus.config.credentials_file
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NIMBUS_CONFIG", raising=False)
    assert _which_token("http://127.0.0.1:1/", "ann").startswith("a token: ")
    nimbus.client.save_credentials("http://127.0.0.1:1/", "secret")
    assert nimbus.config.saved_credentials()["token"] == "secret"
    assert _which_token("http://127.0.0.1:1", "ann").startswith("the token you gave")
    assert _which_token("http://127.0.0.1:2", "ann").startswith("a token: ")
