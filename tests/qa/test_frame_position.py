"""Screenshots say which recorded frame they are (frame_seq) and when it was (t_s),
scaled or not, and the client's Screenshot and the QA frames carry it on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from agent_bridge.pytest_plugin import _fake_manager
from agent_bridge.server import create_app

TOKEN = "qa-test-token-0123456789"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    manager, settings = _fake_manager(tmp_path, capture_off=False)
    app = create_app(manager, token=TOKEN, settings=settings)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def _recorded_t_s(recording: Path, seq: int) -> float:
    manifest = json.loads((recording / "manifest.json").read_text())
    for line in (recording / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["seq"] == seq:
            assert event["kind"] == "frame"
            return float(event["data"]["pts_ns"] - manifest["monotonic_origin_ns"]) / 1e9
    raise AssertionError(f"no event {seq}")


@pytest.mark.parametrize("query", ["", "?scale_to=640x400"])
def test_screenshot_and_zoom_results_name_their_frame(client: TestClient, query: str) -> None:
    created = client.post("/v1/sessions", json={"display": {"width": 1280, "height": 800}})
    assert created.status_code == 201, created.text
    session: dict[str, Any] = created.json()
    results = []
    with client.websocket_connect(f"/v1/sessions/{session['id']}/ws{query}") as ws:
        for i, action in enumerate(
            [{"action": "screenshot"}, {"action": "zoom", "region": [0, 0, 100, 100]}]
        ):
            ws.send_text(json.dumps({"id": i + 1, **action}))
            reply = ws.receive_json()
            assert reply["ok"], reply
            results.append(reply["result"])
    for result in results:
        assert isinstance(result["frame_seq"], int) and result["t_s"] > 0
        recorded = _recorded_t_s(Path(session["recording"]), result["frame_seq"])
        assert result["t_s"] == pytest.approx(recorded, abs=1e-6)
    assert results[1]["frame_seq"] > results[0]["frame_seq"]
