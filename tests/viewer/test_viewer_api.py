"""The replay viewer's routes, in process (FastAPI TestClient)."""

from __future__ import annotations

import io
import json
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
    assert page.status_code == 200 and "<title>deskvm · replay</title>" in page.text
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


def test_index_thumbnail_and_console(bundle: Path) -> None:
    manager = SessionManager(
        hypervisor=FakeHypervisor(), resolve_image=lambda name: IMAGE, recordings_dir=bundle.parent
    )
    client = TestClient(create_app(manager, token=TOKEN))
    (entry,) = client.get("/replay/index.json", headers=AUTH).json()
    recording = Recording(bundle)
    assert entry["events"] == len(recording.events) and entry["frames"] > 0
    assert entry["duration_s"] >= 0 and entry["image"] == IMAGE.name
    assert entry["display"] == {"width": 640, "height": 400}
    thumb = client.get(f"/replay/{bundle.name}/thumbnail.jpg", headers=AUTH)
    assert thumb.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(thumb.content)).size == (320, 200)
    console = client.get(f"/replay/{bundle.name}/console.txt", headers=AUTH)
    assert console.status_code == 200 and console.headers["content-type"].startswith("text/plain")
    assert client.get(f"/replay/{bundle.name}/thumbnail.jpg").status_code == 401


def test_unfinished_recordings_are_counted(tmp_path: Path) -> None:
    bundle = record(tmp_path / "rec" / "abcdefgh2345", clock=SystemClock(), capture_fps=5)
    data = json.loads((bundle / "manifest.json").read_text())
    for key in ("event_count", "counts", "ended_at"):
        data.pop(key)
    data["status"] = "recording"
    (bundle / "manifest.json").write_text(json.dumps(data))
    manager = SessionManager(
        hypervisor=FakeHypervisor(), resolve_image=lambda name: IMAGE, recordings_dir=bundle.parent
    )
    client = TestClient(create_app(manager, token=TOKEN))
    (entry,) = client.get("/replay/index.json", headers=AUTH).json()
    assert entry["events"] == len(Recording(bundle).events) and entry["status"] == "recording"
    assert entry["duration_s"] is not None


def test_pages_and_assets_are_served_without_credentials(bundle: Path) -> None:
    manager = SessionManager(
        hypervisor=FakeHypervisor(), resolve_image=lambda name: IMAGE, recordings_dir=bundle.parent
    )
    client = TestClient(create_app(manager, token=TOKEN), follow_redirects=False)
    assert client.get("/").headers["location"] == "/ui/"
    for path, marker in (("/ui/", "Sessions"), ("/replay/", "Sessions"),
                         ("/view/abcdefgh2345", "Take over"),
                         (f"/replay/{bundle.name}/", "replay")):  # fmt: skip
        page = client.get(path)
        assert page.status_code == 200 and marker in page.text, path
        assert TOKEN not in page.text
    assert client.get("/view/..%2Fx").status_code == 404
    assert client.get("/static/style.css").headers["content-type"].startswith("text/css")
    assert "signIn" in client.get("/static/common.js").text
    assert client.get("/static/secret.txt").status_code == 404
