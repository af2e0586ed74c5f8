"""Warm starts and resets over HTTP on the fake backend: "start", phases, reset, healthz."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from agent_bridge.server import create_app
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.pool import PoolTarget
from orchestrator.settings import Settings
from tests.bridge.conftest import AUTH, IMAGE, TOKEN, _resolver, ask, create_session


def _app(tmp_path: Path, hv: FakeHypervisor):  # type: ignore[no-untyped-def]
    manager = SessionManager(
        hypervisor=hv,
        resolve_image=_resolver(tmp_path),
        recordings_dir=tmp_path / "recordings",
        max_sessions=3,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
        warm_pool=(PoolTarget(IMAGE, 1),),
        pool_dir=tmp_path / "pool",
    )
    assert manager.pool is not None
    manager.pool._interval_s = 0.05
    return manager, create_app(manager, token=TOKEN, settings=Settings(default_image=IMAGE))


def test_warm_start_reset_and_cold_fallback_over_http(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    manager, app = _app(tmp_path, hv)
    with TestClient(app, headers=AUTH) as client:
        assert manager.pool is not None and manager.pool.wait_full(5)
        (pool,) = client.get("/healthz").json()["warm_pool"]
        assert pool["image"] == IMAGE and pool["ready"] == 1 and pool["phase"] == "full"

        warm = create_session(client)
        assert warm["start"] == "warm" and warm["resets"] == 0
        assert set(warm["start_phases_s"]) == {"claim_s", "clock_s", "ready_s"}
        cold = create_session(client, display={"width": 1024, "height": 768})
        assert cold["start"] == "cold" and "domain_start_s" in cold["start_phases_s"]
        (pool,) = client.get("/healthz").json()["warm_pool"]
        assert (pool["claims"], pool["empty_claims"], pool["handover_failures"]) == (1, 0, 0)

        sid = warm["id"]
        with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
            reply = ask(ws, {"id": 1, "action": "type", "text": "before reset\n"})
            assert reply["ok"], reply
            before = hv.domains[sid]
            info = client.post(f"/v1/sessions/{sid}/reset").json()
            assert info["resets"] == 1 and info["last_reset_s"] is not None
            assert hv.domains[sid] is not before and not before.running
            (pool,) = client.get("/healthz").json()["warm_pool"]
            assert pool["spare_resets"] + pool["restored_resets"] == 1
            # The same WebSocket carries on against the restored desktop.
            reply = ask(ws, {"id": 2, "action": "type", "text": "after reset\n"})
            assert reply["ok"], reply
        log = client.get(f"/v1/sessions/{sid}/guest-log").text
        assert "before reset" in log and "after reset" in log  # the log keeps both sides
        assert b"before reset" not in hv.domains[sid].read_guest_log()  # the guest forgot

        refused = client.post(f"/v1/sessions/{cold['id']}/reset")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "reset_unavailable"
        assert client.get(f"/v1/sessions/{cold['id']}").json()["state"] == "ready"

        client.delete(f"/v1/sessions/{sid}")
        events = [
            json.loads(line)
            for line in (Path(warm["recording"]) / "events.jsonl").read_text().splitlines()
        ]
        marks = [e["data"]["event"] for e in events if e["kind"] == "lifecycle"]
        assert marks == ["starting", "ready", "reset", "reset_done", "closed"]
        assert client.post(f"/v1/sessions/{sid}/reset").status_code == 409
    assert hv.domains == {}


def test_a_session_with_another_keyboard_layout_boots_cold(tmp_path: Path) -> None:
    """Pooled desktops run the image's layout: asking for another one is a cold start with
    the layout on the kernel command line; asking for the image's own may take a warm one."""
    hv = FakeHypervisor()
    manager, app = _app(tmp_path, hv)
    with TestClient(app, headers=AUTH) as client:
        assert manager.pool is not None and manager.pool.wait_full(5)
        german = create_session(client, keyboard_layout="de")
        assert german["start"] == "cold" and german["keyboard_layout"] == "de"
        assert hv.domains[german["id"]].spec.keyboard_layout == "de"
        us = create_session(client, keyboard_layout="us")
        assert us["start"] == "warm" and us["keyboard_layout"] == "us"
