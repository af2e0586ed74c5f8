"""The replay viewer's routes, in process (FastAPI TestClient)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from agent_bridge.server import create_app
from agent_bridge.viewer import viewer_app
from orchestrator.clock import SystemClock
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.manager import SessionManager
from orchestrator.replay import Recording
from tests.recording.conftest import IMAGE, record

TOKEN = "viewer-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recordings")
    return record(root / "abcdefgh2345", clock=SystemClock(), capture_fps=5)


def test_standalone_viewer(bundle: Path) -> None:
    client = TestClient(viewer_app(bundle, token=TOKEN))
    page = client.get("/replay/local/")
    assert page.status_code == 200 and "deskvm replay" in page.text
    assert TOKEN not in page.text
    assert client.get("/replay/local/timeline.json").status_code == 401
    assert client.get("/replay/local/timeline.json?token=" + TOKEN).status_code == 401
    tl = client.get("/replay/local/timeline.json", headers=AUTH).json()
    recording = Recording(bundle)
    assert len(tl["events"]) == len(recording.events)
    click = next(
        e for e in tl["events"] if e["kind"] == "input" and e["data"]["action"]["action"] == "click"
    )
    assert click["cursor"] == [200, 150]
    seq = click["frame_seq"]
    png = client.get(f"/replay/local/frames/{seq}.png", headers=AUTH)
    assert png.headers["content-type"] == "image/png"
    got = Image.open(io.BytesIO(png.content)).convert("RGB")
    assert got.tobytes() == recording.frame_image(seq).tobytes()
    assert client.get("/replay/other/timeline.json", headers=AUTH).status_code == 404
    assert client.get("/replay/local/frames/99999.png", headers=AUTH).status_code == 404


def test_served_by_the_bridge(bundle: Path) -> None:
    manager = SessionManager(
        hypervisor=FakeHypervisor(), resolve_image=lambda name: IMAGE, recordings_dir=bundle.parent
    )
    client = TestClient(create_app(manager, token=TOKEN))
    assert client.get("/replay/").status_code == 200
    index = client.get("/replay/index.json", headers=AUTH).json()
    assert [r["id"] for r in index] == [bundle.name] and index[0]["status"] == "closed"
    assert client.get(f"/replay/{bundle.name}/timeline.json", headers=AUTH).status_code == 200
    assert client.get("/replay/..%2Fetc/timeline.json", headers=AUTH).status_code == 404
    assert client.get("/replay/index.json").status_code == 401
