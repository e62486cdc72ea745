"""The dashboard in a real browser (Debian's chromium through chromium-driver, Selenium)
against a real service, a real endpoint agent and real tasks."""

from __future__ import annotations

import os
import re
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
import redis

from nimbus import Client, Executor
from nimbus.service.dashboard._html import short
from nimbus.statestore import StateStore
from service_support import EndpointProcess, Service, serve, service_env, ship, two_services

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
XSS = "<script>alert(1)</script>"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1200,800",
)

if not (os.access(CHROMIUM, os.X_OK) and os.access(DRIVER, os.X_OK)) and os.geteuid() != 0:
    pytest.skip(
        "needs Debian's chromium and chromium-driver (apt-get install -y chromium "
        "chromium-driver, as root; .ci/run does it when run as root)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import NoAlertPresentException, WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service as DriverService  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def hostile() -> str:
    return "ran"


hostile.__name__ = hostile.__qualname__ = XSS  # the name the dashboard shows


def raises(message: str) -> None:
    raise ValueError(message)


# ``ship`` (``service_support``) under a name that is markup, over 0.2 s
hostile_ship = types.FunctionType(ship.__code__, ship.__globals__, XSS + "ship", (0.2,))
hostile_ship.__name__ = hostile_ship.__qualname__ = XSS + "ship"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The module's service (as conftest's), with user "boss" as the dashboard's admin."""
    yield from serve(tmp_path_factory, NIMBUS_SERVICE_ADMINS="boss")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} missing: apt-get install -y chromium"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    driver = webdriver.Chrome(options=options, service=DriverService(DRIVER))
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


def login(driver: Any, service: Service, token: str, path: str = "/") -> None:
    driver.delete_all_cookies()
    driver.get(service.url + path)
    assert "/login" in driver.current_url  # no session: the login form, never data
    driver.find_element(By.NAME, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "form.login button").click()
    try:
        WebDriverWait(driver, 10).until(lambda d: "/login" not in d.current_url)
    except Exception:
        raise AssertionError(driver.current_url + driver.page_source) from None
    assert token not in driver.current_url


def live(driver: Any, timeout: float = 10, poll: float = 0.5) -> WebDriverWait:
    """A wait on what a live page shows: the stream replaces its rows and a form's post
    loads the page again, so an element found may be gone, or in no document, when it is
    read (Chrome says "Node with given id does not belong to the document"); such a read
    is tried again, never taken for the answer."""
    return WebDriverWait(driver, timeout, poll, ignored_exceptions=(WebDriverException,))


def screenshot(driver: Any, path: Path) -> Path:
    driver.save_screenshot(str(path))
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, path
    return path


def no_alert(driver: Any) -> None:
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018


def test_endpoint_to_task_with_a_hostile_name_inert(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any, tmp_path: Path
) -> None:
    task_id = alice.run(hostile, endpoint="lab")
    assert alice.get_result(task_id, timeout=30) == "ran"
    login(browser, service, alice.token)
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-endpoint="{lab.endpoint_id}"]')
    assert "online" in row.text and "alice" in row.text
    screenshot(browser, tmp_path / "endpoints.png")
    row.find_element(By.LINK_TEXT, "lab").click()  # endpoint -> its page -> its tasks
    WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.ID, "endpoint-tasks"))
    browser.find_element(By.ID, "endpoint-tasks").click()
    WebDriverWait(browser, 10).until(lambda d: "/tasks?endpoint=" in d.current_url)
    task_row = browser.find_element(By.CSS_SELECTOR, f'tr[data-task="{task_id}"]')
    assert XSS in task_row.text and "success" in task_row.text  # shown as text
    no_alert(browser)
    screenshot(browser, tmp_path / "tasks.png")
    task_row.find_element(By.LINK_TEXT, short(task_id)).click()  # -> the task
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(f"/tasks/{task_id}"))
    record = browser.find_element(By.ID, "task").text
    assert XSS in record and "endpoint/lab/" in record and "success" in record
    scripts = browser.find_elements(By.TAG_NAME, "script")
    assert [s.get_attribute("src") for s in scripts] == [service.url + "/static/dashboard.js"]
    no_alert(browser)
    screenshot(browser, tmp_path / "task.png")


def test_a_failed_task_shows_its_traceback(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any, tmp_path: Path
) -> None:
    task_id = alice.run(raises, XSS, endpoint="lab")
    with pytest.raises(ValueError, match="alert"):
        alice.get_result(task_id, timeout=30)
    login(browser, service, alice.token, f"/tasks/{task_id}")
    text = browser.find_element(By.ID, "traceback").text
    assert text.startswith("Traceback (most recent call last)")
    assert f"ValueError: {XSS}" in text  # the exception's text, as text
    no_alert(browser)
    screenshot(browser, tmp_path / "failed.png")


def test_a_running_task_appears_live(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any, tmp_path: Path
) -> None:
    login(browser, service, alice.token, "/tasks")
    WebDriverWait(browser, 10).until(
        lambda d: d.find_element(By.ID, "live").text == "live"  # the stream is open
    )
    submitted = time.monotonic()
    task_id = alice.run(nap, 3, endpoint="lab")
    selector = f'tr[data-task="{task_id}"]'
    WebDriverWait(browser, 5, poll_frequency=0.02).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, selector)
    )
    appeared = time.monotonic() - submitted
    live(browser, 10, 0.02).until(
        lambda d: "running" in d.find_element(By.CSS_SELECTOR, selector).text
    )
    assert alice.get_task(task_id)["state"] == "running"
    screenshot(browser, tmp_path / "live.png")
    assert appeared <= 1.0, f"the task showed {appeared:.2f} s after its submit"
    alice.cancel(task_id)
    live(browser, 5, 0.05).until(
        lambda d: "cancelled" in d.find_element(By.CSS_SELECTOR, selector).text
    )


def test_an_unauthorised_user_gets_nothing(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any, tmp_path: Path
) -> None:
    task_id = alice.run(hostile, endpoint="lab")
    alice.get_result(task_id, timeout=30)
    browser.delete_all_cookies()
    for path in ("/", "/tasks", f"/tasks/{task_id}", "/network"):  # nobody: the login form
        browser.get(service.url + path)
        assert "/login" in browser.current_url, path
        assert not browser.find_elements(By.CSS_SELECTOR, "#task, #tasks, #endpoints, #network")
        assert XSS not in browser.page_source and lab.endpoint_id not in browser.page_source
    browser.find_element(By.NAME, "token").send_keys("nimbus_not-a-token")
    browser.find_element(By.CSS_SELECTOR, "form.login button").click()
    WebDriverWait(browser, 10).until(  # the form again, saying why
        lambda d: (
            "invalid token" in " ".join(e.text for e in d.find_elements(By.CLASS_NAME, "error"))
        )
    )
    login(browser, service, service.token("mallory"))  # another user: nothing of alice's
    assert lab.endpoint_id not in browser.page_source
    browser.get(service.url + f"/tasks/{task_id}")
    assert "not found" in browser.page_source and XSS not in browser.page_source
    browser.get(service.url + "/tasks")
    assert task_id not in browser.page_source and lab.endpoint_id not in browser.page_source
    screenshot(browser, tmp_path / "mallory.png")
    with httpx.Client(base_url=service.url, timeout=10) as http:
        assert http.get("/tasks/stream").status_code == 401
        assert http.get("/tasks", follow_redirects=False).status_code == 303
        for path in ("/", f"/endpoints/{lab.endpoint_id}", f"/tasks/{task_id}", "/timeline?group=g", "/directory"):  # fmt: skip
            out = http.get(path, follow_redirects=False)  # no session: the login form, then back
            assert out.status_code == 303 and out.content == b"", path
            assert out.headers["location"] == "/login?" + urlencode({"next": path}), path
        for path in (f"/endpoints/{lab.endpoint_id}/stream", "/timeline/stream", "/timeline.png"):
            out = http.get(path)
            assert out.status_code == 401 and out.content == b"", path
            assert "script-src 'self'" in out.headers["content-security-policy"], path
        # an endpoint's token (not a user's) cannot log in either
        page = http.get("/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        refused = http.post("/login", data={"token": lab.token, "csrf": csrf[1]})
        assert refused.status_code == 403 and "nimbus_session" not in refused.headers.get(
            "set-cookie", ""
        )


def test_posts_without_the_csrf_token_are_refused(service: Service, alice: Client) -> None:
    with httpx.Client(base_url=service.url, timeout=10) as http:
        # a login posted from another site: no login-CSRF cookie, or a foreign Origin
        assert http.post("/login", data={"token": alice.token, "csrf": "x"}).status_code == 403
        page = http.get("/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        foreign = {"Origin": "http://evil.example"}
        form = {"token": alice.token, "csrf": csrf[1]}
        assert http.post("/login", data=form, headers=foreign).status_code == 403
        ok = http.post("/login", data=form | {"next": "//evil.example/x"})
        assert ok.status_code == 303 and ok.headers["location"] == "/"  # never off-site
        assert "nimbus_session" in http.cookies
        assert "HttpOnly" in ok.headers["set-cookie"]
        assert "SameSite=strict" in ok.headers["set-cookie"]
        assert http.get("/").status_code == 200
        assert http.post("/logout", data={"csrf": "wrong"}).status_code == 403
        assert http.get("/").status_code == 200  # still logged in
        token = re.search(r'name="csrf" value="([^"]+)"', http.get("/").text)
        assert token is not None
        assert http.post("/logout", data={"csrf": token[1]}).status_code == 303
        assert http.get("/", follow_redirects=False).status_code == 303


def test_unknown_filter_values_and_a_typed_logout_url_are_said(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """Stranger 6 #11: /tasks?state=bogus was an empty table with no word (200), and
    GET /logout (the URL typed) answered JSON {"detail":"Method Not Allowed"}."""
    with httpx.Client(base_url=service.url, timeout=10) as http:
        out = http.get("/logout", follow_redirects=False)  # not logged in: the login page
        assert out.status_code == 303 and out.headers["location"] == "/login"
        page = http.get("/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        assert http.post("/login", data={"token": alice.token, "csrf": csrf[1]}).status_code == 303
        for query, says in [
            ("state=bogus", "unknown state &#x27;bogus&#x27;: choose one of waiting"),
            ("endpoint=nope", "no endpoint &#x27;nope&#x27; that you can see"),
            ("function=nope", "no function &#x27;nope&#x27; of yours"),
        ]:
            out = http.get(f"/tasks?{query}")
            assert out.status_code == 422 and "text/html" in out.headers["content-type"], query
            assert says in out.text, out.text
        good = http.get(f"/tasks?state=success&endpoint={lab.endpoint_id}")
        assert good.status_code == 200 and 'class="error"' not in good.text
        out = http.get("/logout")
        assert out.status_code == 200 and "text/html" in out.headers["content-type"]
        token = re.search(r'action="/logout"><input type="hidden" name="csrf" value="([^"]+)"',
                          out.text)  # fmt: skip
        assert token is not None, out.text
        assert http.post("/logout", data={"csrf": token[1]}).status_code == 303
        assert http.get("/", follow_redirects=False).status_code == 303  # logged out


def test_the_admin_sees_every_endpoint_and_task(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any, tmp_path: Path
) -> None:
    task_id = alice.run(hostile, endpoint="lab")
    alice.get_result(task_id, timeout=30)
    login(browser, service, service.token("boss"))
    assert browser.find_elements(By.CSS_SELECTOR, f'tr[data-endpoint="{lab.endpoint_id}"]')
    browser.get(service.url + "/tasks")
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-task="{task_id}"]')
    assert XSS in row.text and "lab" in row.text
    row.find_element(By.LINK_TEXT, short(task_id)).click()
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(f"/tasks/{task_id}"))
    assert XSS in browser.find_element(By.ID, "task").text
    no_alert(browser)
    screenshot(browser, tmp_path / "admin.png")


def test_network_page_shows_bytes_and_throughput_of_each_task(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any, tmp_path: Path
) -> None:
    task_id = alice.run(hostile_ship, 300_000, endpoint="lab")
    assert alice.get_result(task_id, timeout=30) == 300_000
    record = alice.get_task(task_id)["record"]
    login(browser, service, alice.token)
    browser.find_element(By.LINK_TEXT, "Network").click()
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith("/network"))
    row = browser.find_element(By.CSS_SELECTOR, f'#network tr[data-task="{task_id}"]')
    cells = [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
    assert cells[1] == XSS + "ship" and cells[2] == "lab" and cells[3] == "success"
    assert record["net_bytes_in"] >= 300_000 and record["net_bytes_out"] >= 300_000
    assert abs(in_bytes(cells[5]) - record["net_bytes_in"]) <= 100  # shown as kB, 1 decimal
    assert abs(in_bytes(cells[6]) - record["net_bytes_out"]) <= 100
    rate_in = record["net_bytes_in"] / (record["ended"] - record["started"])
    shown_rate = cells[7].removesuffix("/s")
    half_a_digit = in_bytes("0.05 " + shown_rate.split()[1])  # one decimal shown
    assert abs(in_bytes(shown_rate) - rate_in) <= half_a_digit + 1, (cells[7], rate_in)
    assert cells[9] == record["net_source"]
    total = browser.find_element(
        By.CSS_SELECTOR, f'#endpoint-bytes tr[data-endpoint="{lab.endpoint_id}"]'
    )
    name, got, sent = [cell.text for cell in total.find_elements(By.TAG_NAME, "td")]
    assert name == "lab" and in_bytes(got) >= 300_000 and in_bytes(sent) >= 300_000
    no_alert(browser)
    screenshot(browser, tmp_path / "network.png")
    row.find_element(By.LINK_TEXT, short(task_id)).click()  # -> the task, with its bytes
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(f"/tasks/{task_id}"))
    assert "Network in" in browser.find_element(By.ID, "task").text
    login(browser, service, service.token("mallory"), "/network")  # nothing of alice's
    assert task_id not in browser.page_source and XSS not in browser.page_source
    assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-endpoint="{lab.endpoint_id}"]')


def in_bytes(text: str) -> float:
    """``"301.2 kB"`` as bytes."""
    value, unit = text.split()
    return float(value) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def test_the_progress_of_a_map_shows_live(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any, tmp_path: Path
) -> None:
    login(browser, service, alice.token)
    browser.find_element(By.LINK_TEXT, "Batches").click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "live").text == "live")
    before = {
        r.get_attribute("data-group")
        for r in browser.find_elements(By.CSS_SELECTOR, "tr[data-group]")
    }
    settings = service.user_settings(alice.token)
    with Executor(endpoint="lab", settings=settings) as ex:
        results = ex.map(nap, [0.5] * 12)  # 2 workers: about 3 s
        new_row = WebDriverWait(browser, 5, poll_frequency=0.05).until(
            lambda d: [
                r
                for r in d.find_elements(By.CSS_SELECTOR, "#batches tr[data-group]")
                if r.get_attribute("data-group") not in before
            ]
        )
        assert len(new_row) == 1  # the map's 12 tasks went in one batch
        group = new_row[0].get_attribute("data-group")
        selector = f'tr[data-group="{group}"]'
        seen: set[str] = set()

        def finished(d: Any) -> bool:  # read in one go: the live rows' cells are replaced
            seen.add(
                d.execute_script(f"return document.querySelector('{selector} .done').textContent")
            )
            return "12/12" in seen

        WebDriverWait(browser, 30, poll_frequency=0.05).until(finished)
        assert list(results) == [0.5] * 12
    assert len(seen) >= 3, seen  # part-way counts showed while it ran, not only the end
    row = browser.find_element(By.CSS_SELECTOR, selector)
    assert row.find_element(By.CLASS_NAME, "counts").text == "12 success"
    bar = row.find_element(By.TAG_NAME, "progress")
    assert bar.get_attribute("value") == "12" and bar.get_attribute("max") == "12"
    no_alert(browser)
    screenshot(browser, tmp_path / "batches.png")
    login(browser, service, service.token("mallory"), "/batches")  # nothing of alice's
    assert not browser.find_elements(By.CSS_SELECTOR, selector)


def http_login(http: httpx.Client, token: str) -> None:
    """Log ``http`` in to the dashboard as a browser does (login form, CSRF cookie)."""
    csrf = re.search(r'name="csrf" value="([^"]+)"', http.get("/login").text)
    assert csrf is not None
    assert http.post("/login", data={"token": token, "csrf": csrf[1]}).status_code == 303


def zrevranges(store: StateStore) -> int:
    """How many ZREVRANGEs the queue Redis has answered (the live window's read)."""
    with redis.Redis.from_url(store.url) as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_zrevrange", {}).get("calls", 0))


def _llens(store: StateStore) -> int:
    """How many LLENs the queue Redis has answered (an endpoint page's read of its queue)."""
    with redis.Redis.from_url(store.url) as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_llen", {}).get("calls", 0))


def test_an_open_endpoint_page_reads_nothing_between_heartbeats_and_is_told_it_went_offline(
    tmp_path: Path,
) -> None:
    """Its endpoint beats, its summary unchanged: the page reads nothing; the agent stops:
    the page shows it offline at once (the service publishes connections and summaries)."""
    store = StateStore.open(None, tmp_path / "redis")
    root = tmp_path / "svc"
    root.mkdir()
    service = Service(root, service_env(root, NIMBUS_REDIS_URL=store.url)).start()
    agent = None
    try:
        token = service.token("ena")
        with service.client(token) as client, httpx.Client(base_url=service.url) as http:
            agent = EndpointProcess(service, client, "beating", workers=1).start(client)
            http_login(http, token)
            path = f"/endpoints/{agent.endpoint_id}/stream"
            with http.stream("GET", path, timeout=30) as stream:
                lines = stream.iter_lines()
                assert next(lines) == "retry: 1000"
                for line in lines:
                    if line.startswith("data: ") and '"online"' in line:
                        break
                time.sleep(1.5)
                before = _llens(store)
                time.sleep(float(service.settings().heartbeat) * 3 + 1)  # beats arrive
                assert _llens(store) == before  # open, its endpoint idle: nothing read
                stopped = time.monotonic()
                agent.stop()
                for line in lines:
                    if line.startswith("data: ") and '"offline"' in line:
                        break
                assert time.monotonic() - stopped < 5.0
    finally:
        if agent is not None:
            agent.stop()
        service.stop()
        store.close()


def test_an_open_page_reads_nothing_until_its_users_task_moves_in_any_service_process(
    tmp_path: Path,
) -> None:
    with two_services(tmp_path) as (first, second, store):
        token = first.token("vera")
        with (
            first.client(token) as client,
            first.client(first.token("walt")) as walt,
            httpx.Client(base_url=second.url, timeout=10) as http,
        ):
            client.register_endpoint("quiet")  # no agent: its tasks wait
            walt.register_endpoint("walts")
            http_login(http, token)
            with http.stream("GET", "/tasks/stream") as stream:
                lines = stream.iter_lines()
                assert next(lines) == "retry: 1000"
                time.sleep(1.0)  # the first look, and the one the subscription's start asks for
                before = zrevranges(store)
                time.sleep(2.0)
                assert zrevranges(store) == before  # open, idle: the page read nothing
                walt.batch_run(nap, [(1,)] * 50, endpoint="walts")  # another user's tasks
                time.sleep(1.0)
                assert zrevranges(store) == before  # not vera's: her page read nothing
                submitted = time.monotonic()
                task_id = client.run(nap, 1, endpoint="quiet")  # through the other process
                for line in lines:
                    if line.startswith("data: ") and task_id in line:
                        break
                appeared = time.monotonic() - submitted
                assert '"state": "waiting-for-endpoint"' in line
                assert appeared <= 1.0, f"the task showed {appeared:.2f} s after its submit"
                assert client.cancel(task_id)
                for line in lines:
                    if line.startswith("data: ") and task_id in line:
                        break
                assert '"state": "cancelled"' in line


def test_a_page_asked_after_a_cursor_that_is_no_number_is_a_422_naming_it(
    service: Service,
) -> None:
    """review6 #12: ``?after=nan~x`` reached the page script, which refused it: a 500."""
    with httpx.Client(base_url=service.url, timeout=30) as http:
        http_login(http, service.token("boss"))
        for path in ("/tasks", "/network"):
            assert http.get(path).status_code == 200
            for cursor in ("nan~x", "inf~x"):
                answer = http.get(path, params={"after": cursor})
                assert answer.status_code == 422, answer.text
                assert cursor in answer.json()["detail"]
