"""The dashboard's endpoint, task, timeline and directory pages and its buttons, in a real
browser (Debian's chromium, Selenium) against a real service, a real endpoint agent and
real tasks. Screenshots go to $NIMBUS_SCREENSHOTS (docs/dashboard/ for the closing note)
or, by default, a directory under the system's temporary one: a test run leaves the
checkout as it was."""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from nimbus import Client
from nimbus.messaging import Entry
from nimbus.messaging._directory import Directory, host_id
from nimbus.service.dashboard._html import short
from nimbus.statestore import Keys, connect
from service_support import EndpointProcess, Service
from test_service_dashboard import (  # the browser, the admin's service, the hostile names
    XSS,
    browser,
    live,
    login,
    nap,
    no_alert,
    raises,
    screenshot,
    service,
)

__all__ = ["browser", "service"]  # fixtures of test_service_dashboard, used here

DOCS = Path(os.environ.get("NIMBUS_SCREENSHOTS") or Path(tempfile.gettempdir()) / "nimbus-shots")


def shot(driver: Any, name: str) -> Path:
    """A screenshot into ``DOCS`` (checked to be a PNG of some size)."""
    DOCS.mkdir(parents=True, exist_ok=True)
    return screenshot(driver, DOCS / name)


def says(text: str) -> str:
    return text + XSS


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None, page[:2000]
    return found[1]


def cells(driver: Any, selector: str) -> list[list[str]]:
    """The cells' text of the rows ``selector`` finds, read in one go (live rows are
    replaced while they are read one by one)."""
    rows: list[list[str]] = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), "
        "(tr) => Array.from(tr.cells, (td) => td.textContent));",
        selector,
    )
    return rows


def test_endpoint_page_shows_workers_busy_live_and_clicks_through_to_a_task(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any
) -> None:
    done_id = alice.run(says, "out:", endpoint="lab")
    assert alice.get_result(done_id, timeout=30) == "out:" + XSS
    failed_id = alice.run(raises, XSS, endpoint="lab")
    with pytest.raises(ValueError):
        alice.get_result(failed_id, timeout=30)
    login(browser, service, alice.token)
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-endpoint="{lab.endpoint_id}"]')
    assert "online" in row.text and "alice" in row.text
    row.find_element(By.LINK_TEXT, "lab").click()  # the list -> the endpoint
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(lab.endpoint_id))
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "live").text == "live")
    heartbeat = browser.find_element(By.CSS_SELECTOR, 'td[data-field="heartbeat"]').text
    assert heartbeat.endswith("s ago") and float(heartbeat.split()[0]) < 5
    managers = cells(browser, "#managers tbody tr")
    assert len(managers) == 1 and managers[0][3] == "2"  # one manager, 2 workers
    assert browser.find_element(By.ID, "blocks").text.startswith("No blocks")

    def pools(d: Any) -> list[list[str]]:
        return [r for r in cells(d, "#pools tbody tr") if r]

    WebDriverWait(browser, 10).until(lambda d: any(r[2:] == ["2", "0", "2"] for r in pools(d)))
    running = [alice.run(nap, 3, endpoint="lab") for _ in range(2)]
    # the page is not reloaded: the stream redraws the table when a heartbeat changes it
    WebDriverWait(browser, 10, poll_frequency=0.1).until(
        lambda d: any(r[2:] == ["2", "2", "0"] for r in pools(d))
    )
    assert pools(browser)[0][1] == "plain"
    shot(browser, "endpoint.png")
    browser.execute_script("document.getElementById('blocks').scrollIntoView()")
    shot(browser, "endpoint-workers.png")
    for task_id in running:
        alice.get_result(task_id, timeout=30)

    browser.find_element(By.ID, "endpoint-tasks").click()  # -> its tasks
    WebDriverWait(browser, 10).until(lambda d: "/tasks?endpoint=" in d.current_url)
    task_row = browser.find_element(By.CSS_SELECTOR, f'tr[data-task="{done_id}"]')
    task_row.find_element(By.LINK_TEXT, short(done_id)).click()  # -> the task
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(f"/tasks/{done_id}"))
    assert browser.find_element(By.ID, "output").text == repr("out:" + XSS)  # as text
    assert not browser.find_elements(By.ID, "cancel")  # done: nothing to cancel
    no_alert(browser)
    shot(browser, "task-output.png")

    browser.get(service.url + f"/tasks/{failed_id}")
    assert browser.find_element(By.ID, "exception").text == f"ValueError: {XSS}"
    assert browser.find_element(By.ID, "traceback").text.startswith("Traceback")
    no_alert(browser)
    shot(browser, "task-failed.png")

    login(browser, service, service.token("mallory"), f"/endpoints/{lab.endpoint_id}")
    assert "not found" in browser.page_source and lab.endpoint_id in browser.current_url
    assert not browser.find_elements(By.ID, "managers")


def test_the_timeline_draws_each_task_on_its_worker_live_and_exports_a_png(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any
) -> None:
    first = alice.batch_run(nap, [(0.5,)] * 4, endpoint="lab")  # together: on both workers
    for task_id in first:
        alice.get_result(task_id, timeout=30)
    login(browser, service, alice.token)
    browser.find_element(By.LINK_TEXT, "Timeline").click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "live").text == "live")
    canvas = browser.find_element(By.ID, "timeline")
    WebDriverWait(browser, 10).until(lambda d: int(canvas.get_attribute("data-drawn") or 0) >= 4)
    workers = {r[0] for r in cells(browser, "#lanes tbody tr")}
    records = [alice.get_task(t)["record"] for t in first]
    assert {r["worker"] for r in records} <= workers  # a lane per worker that ran them
    assert len({r["worker"] for r in records}) == 2  # two workers shared the four

    def states(d: Any) -> dict[str, str]:
        raw = d.find_element(By.ID, "timeline").get_attribute("data-states") or "{}"
        return dict(__import__("json").loads(raw))

    submitted = time.monotonic()
    task = alice.run(nap, 2, endpoint="lab")
    WebDriverWait(browser, 5, poll_frequency=0.05).until(lambda d: task in states(d))
    appeared = time.monotonic() - submitted
    WebDriverWait(browser, 10, poll_frequency=0.05).until(
        lambda d: states(d).get(task) == "running"
    )
    assert int(canvas.get_attribute("data-running")) >= 1
    drawn = browser.execute_script(
        "const c = document.getElementById('timeline');"
        "const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 0; i < px.length; i += 4) {"
        "  if (px[i] === 0x25 && px[i + 1] === 0x63 && px[i + 2] === 0xeb) n++; }"
        "return n;"
    )
    assert drawn > 0, "no running (blue) bar on the canvas"
    shot(browser, "timeline.png")
    assert appeared <= 1.0, f"the task showed {appeared:.2f} s after its submit"
    WebDriverWait(browser, 10, poll_frequency=0.05).until(
        lambda d: states(d).get(task) == "success"
    )

    cookie = browser.get_cookie("nimbus_session")
    assert cookie is not None
    with httpx.Client(base_url=service.url, timeout=30) as http:
        assert http.get("/timeline.png").status_code == 401  # no session: no picture
        http.cookies.set("nimbus_session", cookie["value"])
        png = http.get(browser.find_element(By.ID, "png").get_attribute("href"))
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content.startswith(b"\x89PNG\r\n\x1a\n") and len(png.content) > 10_000
    DOCS.mkdir(parents=True, exist_ok=True)
    (DOCS / "timeline-export.png").write_bytes(png.content)

    group = alice.get_task(first[0])["group_id"]  # one batch's timeline: its 4 tasks only
    browser.get(service.url + f"/timeline?group={group}")
    WebDriverWait(browser, 10).until(lambda d: len(states(d)) == 4)
    assert set(states(browser)) == set(first)
    assert sum(int(r[1]) for r in cells(browser, "#lanes tbody tr")) == 4

    login(browser, service, service.token("mallory"), "/timeline")  # nothing of alice's
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "live").text == "live")
    time.sleep(0.5)
    assert states(browser) == {} and not cells(browser, "#lanes tbody tr")
    browser.get(service.url + f"/timeline?group={group}")  # nor her batch, by its id
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "live").text == "live")
    time.sleep(0.5)
    assert states(browser) == {} and not cells(browser, "#lanes tbody tr")


def test_the_directory_lists_the_users_messaging_instances(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any
) -> None:
    with service.http(alice.token) as http:
        store = http.post(f"/v1/endpoints/{lab.endpoint_id}/store").json()
    client = connect(store["url"], own=True)  # alice's ACL user on the programs' store
    keys = Keys(f"{store['key_prefix']}.{Keys.new_name()}")
    directory = Directory(lambda: client, keys, ttl_ms=60_000)
    directory.set_local("inst-1", Entry(host_id(), os.getpid(), "/run/x/inst-1.sock", None))
    directory.set_local(XSS, Entry(host_id(), 4242, None, ("127.0.0.1", 5555), "exited"))
    directory.publish()
    try:
        login(browser, service, alice.token)
        browser.find_element(By.LINK_TEXT, "Directory").click()
        WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith("/directory"))
        table = browser.find_element(By.CSS_SELECTOR, f'table[data-program="{keys.program_id}"]')
        rows = {
            r[0]: r for r in cells(browser, f'table[data-program="{keys.program_id}"] tbody tr')
        }
        assert rows["inst-1"][2:] == [str(os.getpid()), "/run/x/inst-1.sock", "", "alive"]
        assert rows[XSS][2:] == ["4242", "", "127.0.0.1:5555", "exited"]  # as text
        assert table.is_displayed()
        no_alert(browser)
        shot(browser, "directory.png")
        login(browser, service, service.token("mallory"), "/directory")
        assert keys.program_id not in browser.page_source
        login(browser, service, service.token("boss"), "/directory")  # the admin: all
        assert browser.find_elements(By.CSS_SELECTOR, f'table[data-program="{keys.program_id}"]')
    finally:
        client.delete(keys.directory())
        client.close()


def test_cancel_and_share_buttons_and_cross_site_posts_refused(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any
) -> None:
    service.token("bob")  # a user to share with
    task_id = alice.run(nap, 20, endpoint="lab")
    WebDriverWait(None, 10).until(lambda _: alice.get_task(task_id)["state"] == "running")
    login(browser, service, alice.token, f"/tasks/{task_id}")
    action = live(browser).until(lambda d: d.find_element(By.ID, "cancel").get_attribute("action"))
    assert "csrf" not in browser.current_url and "csrf" not in action
    shot(browser, "task-running.png")
    live(browser).until(lambda d: d.find_element(By.CSS_SELECTOR, "#cancel button").click() or True)
    live(browser).until(lambda d: "cancelled" in d.find_element(By.ID, "task").text)
    assert alice.get_task(task_id)["state"] == "cancelled"

    browser.get(service.url + f"/endpoints/{lab.endpoint_id}")
    browser.find_element(By.CSS_SELECTOR, "#share input[name=user]").send_keys("bob")
    live(browser).until(lambda d: d.find_element(By.CSS_SELECTOR, "#share button").click() or True)
    live(browser).until(lambda d: "bob" in d.find_element(By.ID, "shared").text)
    assert "bob" in alice.get_endpoint(lab.endpoint_id)["shared_with"]
    shot(browser, "endpoint-shared.png")
    live(browser).until(lambda d: d.find_element(By.CSS_SELECTOR, "#shared button").click() or True)
    live(browser).until(lambda d: "bob" not in d.find_element(By.ID, "shared").text)
    assert alice.get_endpoint(lab.endpoint_id)["shared_with"] == []

    # a page of another site posting to the dashboard: refused, nothing changed
    victim = alice.run(nap, 20, endpoint="lab")
    session = browser.get_cookie("nimbus_session")
    assert session is not None
    with httpx.Client(base_url=service.url, timeout=10) as http:
        http.cookies.set("nimbus_session", session["value"])
        csrf = csrf_of(http.get(f"/tasks/{victim}").text)
        share = f"/endpoints/{lab.endpoint_id}/share"
        evil = {"Origin": "http://evil.example"}
        assert http.post(f"/tasks/{victim}/cancel", data={}).status_code == 403
        assert http.post(f"/tasks/{victim}/cancel", data={"csrf": "guess"}).status_code == 403
        refused = http.post(f"/tasks/{victim}/cancel", data={"csrf": csrf}, headers=evil)
        assert refused.status_code == 403
        fetched = {"Sec-Fetch-Site": "cross-site"}
        refused = http.post(f"/tasks/{victim}/cancel", data={"csrf": csrf}, headers=fetched)
        assert refused.status_code == 403
        assert http.post(share, data={"user": "bob"}).status_code == 403
        assert http.post(share, data={"user": "bob", "csrf": csrf}, headers=evil).status_code == 403
        assert alice.get_task(victim)["state"] in ("dispatched", "running")
        assert alice.get_endpoint(lab.endpoint_id)["shared_with"] == []
        # and a browser on another origin: its cookie is SameSite=Strict, so not even sent
        assert session["sameSite"] == "Strict" and session["httpOnly"]
        ok = http.post(f"/tasks/{victim}/cancel", data={"csrf": csrf}, follow_redirects=False)
        assert ok.status_code == 303 and ok.headers["location"] == f"/tasks/{victim}"
        assert alice.get_task(victim)["state"] == "cancelled"
        # mallory's own session and token cannot cancel alice's task or share her endpoint
        mallory = service.token("mallory")
        http.cookies.clear()
        page = http.get("/login")
        http.post("/login", data={"token": mallory, "csrf": csrf_of(page.text)})
        mine = csrf_of(http.get("/").text)
        other = alice.run(nap, 20, endpoint="lab")
        assert http.post(f"/tasks/{other}/cancel", data={"csrf": mine}).status_code == 404
        assert http.post(share, data={"user": "mallory", "csrf": mine}).status_code == 404
        assert alice.get_task(other)["state"] != "cancelled"
        alice.cancel(other)
    no_alert(browser)


def test_a_page_of_another_site_cannot_cancel_even_with_the_token(
    service: Service, alice: Client, lab: EndpointProcess, browser: Any, tmp_path: Path
) -> None:
    """A real cross-site form post in the browser (from http://localhost:PORT to the
    service at 127.0.0.1), carrying the right CSRF token as if it had leaked: the
    SameSite=Strict cookie is not sent and the Origin is foreign, so nothing happens."""
    import http.server
    import threading

    task_id = alice.run(nap, 20, endpoint="lab")
    login(browser, service, alice.token, f"/tasks/{task_id}")
    csrf = browser.find_element(By.CSS_SELECTOR, "#cancel input[name=csrf]").get_attribute("value")
    (tmp_path / "evil.html").write_text(
        f'<form method="post" action="{service.url}/tasks/{task_id}/cancel">'
        f'<input type="hidden" name="csrf" value="{csrf}"></form>'
        "<script>document.forms[0].submit()</script>"
    )
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=evil.serve_forever, daemon=True)
    thread.start()
    try:
        browser.get(f"http://localhost:{evil.server_address[1]}/evil.html")
        WebDriverWait(browser, 10).until(lambda d: d.current_url.startswith(service.url))
        assert "/login" in browser.current_url  # no cookie came along: asked to log in
        assert f"next=%2Ftasks%2F{task_id}" in browser.current_url  # then to the task's page
        time.sleep(0.3)
        assert alice.get_task(task_id)["state"] in ("dispatched", "running")
    finally:
        evil.shutdown()
        evil.server_close()
        thread.join()
        alice.cancel(task_id)
