"""What owners decide takes effect at once: a new endpoint token replaces the old one,
a deleted endpoint stops its agent and fails its tasks, and an endpoint name that
means more than one endpoint is refused instead of guessed (real service, real agents).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nimbus import Executor
from nimbus.errors import AmbiguousEndpointError, NotFound, ServiceError
from service_support import EndpointProcess, Service


def square(x: int) -> int:
    return x * x


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def mark_and_nap(path: str, i: int, seconds: float) -> str:
    """Record each run of task i; a token of this run as its result."""
    token = f"{i}-{time.monotonic_ns()}"
    with open(path, "a") as out:
        out.write(f"{token}\n")
    time.sleep(seconds)
    return token


def _wait_marked(runs: Path) -> None:
    """Until a task of ``mark_and_nap`` has started (it writes ``runs``)."""
    deadline = time.monotonic() + 30
    while not runs.exists():
        assert time.monotonic() < deadline, f"no task started in 30 s ({runs} not written)"
        time.sleep(0.02)


def _exits(endpoint: EndpointProcess, within: float) -> tuple[int, float]:
    """The agent's exit status and how long it took to exit."""
    assert endpoint.proc is not None
    start = time.monotonic()
    code = endpoint.proc.wait(within)
    return code, time.monotonic() - start


# ---------------------------------------------------------------- #6 re-registration


def test_reconfigure_revokes_the_old_token_and_stops_its_agent_at_once(
    service: Service, tmp_path: Path
) -> None:
    with service.client(service.token("uma")) as uma:
        old = EndpointProcess(service, uma, "reconf").start(uma)
        runs = tmp_path / "runs.txt"
        try:
            [held] = uma.batch_run(mark_and_nap, [(str(runs), 0, 1.0)], endpoint="reconf")
            _wait_marked(runs)  # the old agent runs it now
            with service.http(old.token) as http:  # the old token is known (cached) here
                assert http.get("/v1/whoami").status_code == 403  # an endpoint's token
            new = EndpointProcess(service, uma, "reconf")  # `nimbus endpoint configure reconf`
            with service.http(old.token) as http:
                refused = http.get("/v1/whoami")
            assert refused.status_code == 401, refused.text  # at once, not after a cache
            code, took = _exits(old, 10)
            assert code == 1
            assert took < 3, f"the replaced agent ran on for {took:.1f} s"
            log = old.log.read_text()
            assert "configured again" in log and "Traceback" not in log
            assert uma.get_endpoint("reconf")["agents"] == 0
            new.start(uma)
            try:
                assert uma.get_endpoint("reconf")["agents"] == 1
                # the task the old agent held (stopped mid-run) runs again on the new one
                result = uma.get_result(held, timeout=30)
                started = runs.read_text().split()
                assert len(started) == 2 and result == started[1]
                assert uma.get_result(held, timeout=5) == result  # one result, kept
                assert uma.get_result(uma.run(square, 9, endpoint="reconf"), timeout=30) == 81
            finally:
                new.stop()
        finally:
            old.stop()


# ---------------------------------------------------------------- #10 deletion


def test_deleting_an_endpoint_stops_its_agent_and_fails_its_tasks(
    service: Service, tmp_path: Path
) -> None:
    with (
        service.client(service.token("dora")) as dora,
        service.client(service.token("dirk")) as dirk,
    ):
        doomed = EndpointProcess(service, dora, "doomed", workers=1).start(dora)
        try:
            dora.share_endpoint(doomed.endpoint_id, ["dirk"])
            runs = tmp_path / "runs.txt"
            running = dora.run(mark_and_nap, str(runs), 0, 30.0, endpoint="doomed")
            _wait_marked(runs)
            queued = dora.batch_run(square, [(i,) for i in range(5)], endpoint="doomed")
            settings = service.user_settings(dirk.token)
            with Executor(endpoint="dora/doomed", settings=settings) as ex:
                streamed = ex.submit(nap, 30.0)  # dirk waits on a WebSocket
                time.sleep(0.3)
                dora.delete_endpoint(doomed.endpoint_id)
                code, took = _exits(doomed, 10)
                assert code == 1 and took < 3, took
                log = doomed.log.read_text()
                assert "deleted" in log and "Traceback" not in log
                with pytest.raises(ServiceError, match="deleted"):
                    streamed.result(10)
            for task_id in [running, *queued]:
                with pytest.raises(ServiceError, match=r"endpoint doomed .* was deleted"):
                    dora.get_result(task_id, timeout=10)
                assert dora.get_task(task_id)["state"] == "failed"
            with pytest.raises(NotFound):
                dora.get_endpoint(doomed.endpoint_id)
        finally:
            doomed.stop()


def test_deleting_an_offline_endpoint_fails_the_tasks_waiting_for_it(service: Service) -> None:
    with service.client(service.token("omar")) as omar:
        registered = omar.register_endpoint("never-up")
        waiting = omar.batch_run(square, [(i,) for i in range(3)], endpoint="never-up")
        assert omar.get_task(waiting[0])["state"] == "waiting-for-endpoint"
        omar.delete_endpoint(registered["endpoint_id"])
        for task_id in waiting:
            with pytest.raises(ServiceError, match="was deleted"):
                omar.get_result(task_id, timeout=10)
        with service.http(registered["token"]) as http:  # its agent's token is gone too
            assert http.get("/v1/whoami").status_code == 401


# ---------------------------------------------------------------- #7 names


def test_a_name_matching_several_endpoints_is_an_error_listing_them(service: Service) -> None:
    dana, ann, ben = (service.client(service.token(u)) for u in ("dana", "ann", "ben"))
    with dana, ann, ben:
        danas = dana.register_endpoint("gpu")["endpoint_id"]
        dana.share_endpoint(danas, public=True)
        assert ben.get_endpoint("gpu")["endpoint_id"] == danas  # the only one: no doubt
        anns = ann.register_endpoint("gpu")["endpoint_id"]
        ann.share_endpoint(anns, ["ben"])
        with pytest.raises(AmbiguousEndpointError) as caught:
            ben.get_endpoint("gpu")
        assert caught.value.choices == ["ann/gpu", "dana/gpu"]
        assert caught.value.status == 409
        assert "ann/gpu" in str(caught.value) and "dana/gpu" in str(caught.value)
        with pytest.raises(AmbiguousEndpointError):
            ben.run(square, 2, endpoint="gpu")  # refused before anything is queued
        assert ben.list_tasks() == []
        with pytest.raises(AmbiguousEndpointError):
            Executor(endpoint="gpu", settings=service.user_settings(ben.token))
        # qualified by owner: exactly that one
        assert ben.get_endpoint("ann/gpu")["endpoint_id"] == anns
        assert ben.get_endpoint("dana/gpu")["endpoint_id"] == danas
        for missing in ("ben/gpu", "zoe/gpu", "ann/cpu", "/gpu", "ann/"):
            with pytest.raises(NotFound):
                ben.get_endpoint(missing)
        # one's own endpoint of that name wins over others'
        assert ann.get_endpoint("gpu")["endpoint_id"] == anns
        assert dana.get_endpoint("gpu")["endpoint_id"] == danas
        assert ann.get_endpoint("dana/gpu")["endpoint_id"] == danas
        bens = ben.register_endpoint("gpu")["endpoint_id"]
        assert ben.get_endpoint("gpu")["endpoint_id"] == bens
        assert ben.get_endpoint("ann/gpu")["endpoint_id"] == anns
        # the REST answer: 409 with the choices
        with service.http(ann.token) as http:
            http.post(f"/v1/endpoints/{anns}/share", json={"public": True}).raise_for_status()
        carl = service.token("carl")
        with service.http(carl) as http:
            response = http.get("/v1/endpoints/resolve", params={"name": "gpu"})
            assert response.status_code == 409, response.text
            assert response.json()["choices"] == ["ann/gpu", "dana/gpu"]
            found = http.get("/v1/endpoints/resolve", params={"name": "ann/gpu"})
            assert found.status_code == 200 and found.json()["endpoint_id"] == anns


def test_qualified_names_work_in_executor_client_and_nimbus_endpoint(service: Service) -> None:
    with (
        service.client(service.token("ivy")) as ivy,
        service.client(service.token("jon")) as jon,
        service.client(service.token("kim")) as kim,
    ):
        ivys = EndpointProcess(service, ivy, "shared-gpu", workers=1).start(ivy)
        try:
            ivy.share_endpoint(ivys.endpoint_id, ["kim"])
            kims = jon.register_endpoint("shared-gpu")["endpoint_id"]  # jon's, public
            jon.share_endpoint(kims, public=True)
            with pytest.raises(AmbiguousEndpointError, match="ivy/shared-gpu"):
                kim.run(square, 3, endpoint="shared-gpu")
            task_id = kim.run(square, 3, endpoint="ivy/shared-gpu")
            assert kim.get_result(task_id, timeout=30) == 9
            assert kim.get_task(task_id)["endpoint_id"] == ivys.endpoint_id
            with Executor(
                endpoint="ivy/shared-gpu", settings=service.user_settings(kim.token)
            ) as ex:
                assert ex.submit(square, 4).result(30) == 16
            settings = service.user_settings(kim.token, NIMBUS_ENDPOINT="ivy/shared-gpu")
            with Executor(settings=settings) as ex:
                assert ex.submit(square, 5).result(30) == 25
            settings = service.user_settings(kim.token, NIMBUS_ENDPOINT="shared-gpu")
            with pytest.raises(AmbiguousEndpointError):
                Executor(settings=settings)
        finally:
            ivys.stop()


# ---------------------------------------------------------------- siblings: unsharing


def test_unsharing_fails_the_waiting_tasks_of_those_who_lost_the_endpoint(
    service: Service,
) -> None:
    sal, sid, sue = (service.client(service.token(u)) for u in ("sal", "sid", "sue"))
    with sal, sid, sue:
        ep = sal.register_endpoint("withdrawn")["endpoint_id"]  # never started: tasks wait
        sal.share_endpoint(ep, ["sid"], public=True)
        tasks = {
            c: c.batch_run(square, [(1,), (2,)], endpoint="sal/withdrawn") for c in (sal, sid, sue)
        }
        with service.http(sal.token) as http:
            both = http.post(
                f"/v1/endpoints/{ep}/share", json={"users": ["sid"], "remove": ["sid"]}
            )
            assert both.status_code == 422 and "sid" in both.json()["detail"]
            http.post(f"/v1/endpoints/{ep}/share", json={"public": False}).raise_for_status()
            for task_id in tasks[sue]:
                with pytest.raises(ServiceError, match="no longer shared with you"):
                    sue.get_result(task_id, timeout=10)
            for client in (sid, sal):  # still allowed: still waiting
                states = [client.get_task(t)["state"] for t in tasks[client]]
                assert states == ["waiting-for-endpoint"] * 2
            shown = http.post(f"/v1/endpoints/{ep}/share", json={"remove": ["sid"]})
            assert shown.json()["shared_with"] == []
        for task_id in tasks[sid]:
            with pytest.raises(ServiceError, match="no longer shared with you"):
                sid.get_result(task_id, timeout=10)
        assert [sal.get_task(t)["state"] for t in tasks[sal]] == ["waiting-for-endpoint"] * 2
        with pytest.raises(NotFound):
            sid.get_endpoint("sal/withdrawn")


def test_unsharing_cancels_the_removed_users_tasks_held_by_the_agent(
    service: Service, tmp_path: Path
) -> None:
    with service.client(service.token("val")) as val, service.client(service.token("wes")) as wes:
        ep = EndpointProcess(service, val, "val-lab", workers=1).start(val)
        try:
            val.share_endpoint(ep.endpoint_id, ["wes"])
            runs = tmp_path / "runs.txt"
            first = wes.run(mark_and_nap, str(runs), 0, 1.5, endpoint="val/val-lab")
            _wait_marked(runs)
            held = wes.batch_run(
                mark_and_nap, [(str(runs), i, 0.0) for i in (1, 2, 3)], endpoint="val/val-lab"
            )
            time.sleep(0.3)  # sent to the agent, waiting there for its one worker
            with service.http(val.token) as http:
                http.post(
                    f"/v1/endpoints/{ep.endpoint_id}/share", json={"remove": ["wes"]}
                ).raise_for_status()
            for task_id in [first, *held]:
                with pytest.raises(ServiceError, match="no longer shared with you"):
                    wes.get_result(task_id, timeout=5)
            # the owner's next task runs after the running one; the cancelled ones never ran
            assert val.get_result(val.run(square, 7, endpoint="val-lab"), timeout=30) == 49
            assert [line.split("-")[0] for line in runs.read_text().split()] == ["0"]
        finally:
            ep.stop()


def test_an_agent_saying_hello_after_its_token_was_revoked_is_closed() -> None:
    import asyncio

    from nimbus.protocol import REPLACED
    from nimbus.service.hub import Hub, Peer

    async def scenario() -> list[tuple[int, str]]:
        closed: list[tuple[int, str]] = []

        async def send(data: bytes) -> None:
            del data

        async def close(code: int, reason: str) -> None:
            closed.append((code, reason))

        hub = Hub()
        assert await hub.revoked({"d1"}, REPLACED, "replaced") == 0  # not connected yet
        hub.add_agent("ep", Peer("c1", send, digest="d1", close=close))
        hub.add_agent("ep", Peer("c2", send, digest="d2", close=close))
        await asyncio.sleep(0.01)
        return closed

    assert asyncio.run(scenario()) == [(REPLACED, "replaced")]
