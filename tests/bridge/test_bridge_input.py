"""In-process tests of the input options: autostart (probe readiness) and screenshot scaling."""

from __future__ import annotations

import base64
import io

import pytest
from conftest import ask as _ask
from conftest import create_session as _create
from fastapi.testclient import TestClient
from PIL import Image
from starlette.websockets import WebSocketDisconnect

from orchestrator.display.base import AbsMove, KeyEvent
from orchestrator.hypervisor.fake import FakeHypervisor


def test_autostart_input_probe_is_passed_and_ready_on_probe_ready(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    info = _create(client, autostart="input-probe")
    assert info["state"] == "ready" and info["autostart"] == "input-probe"
    domain = hypervisor.domains[info["id"]]
    assert domain.spec.autostart == "input-probe"
    assert b'"ev":"probe_ready"' in domain.read_guest_log()
    plain = _create(client)
    assert plain["autostart"] is None


def test_autostart_outside_the_closed_set_is_refused(client: TestClient) -> None:
    response = client.post("/v1/sessions", json={"autostart": "rm -rf /"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"


def test_scaled_screenshots_and_coordinates_map_to_display_pixels(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client, display={"width": 1280, "height": 800})["id"]
    display = hypervisor.domains[sid].display
    with client.websocket_connect(f"/v1/sessions/{sid}/ws?scale_to=1024x640") as ws:
        shot = _ask(ws, {"id": 1, "action": "screenshot"})["result"]
        assert (shot["width"], shot["height"]) == (1024, 640)
        image = Image.open(io.BytesIO(base64.b64decode(shot["data"])))
        assert image.size == (1024, 640)
        assert _ask(ws, {"id": 2, "action": "click", "x": 512, "y": 320})["ok"] is True
        assert AbsMove(640, 400) in display.events
        assert _ask(ws, {"id": 3, "action": "cursor_position"})["result"] == {"x": 512, "y": 320}
        assert _ask(ws, {"id": 4, "action": "move", "x": 1023, "y": 639})["ok"] is True
        assert display.events[-1] == AbsMove(1279, 799)
        outside = _ask(ws, {"id": 5, "action": "click", "x": 1024, "y": 0})
        assert outside["error"]["code"] == "out_of_screen"
        # zoom crops stay at full display resolution: a 100x100 client region is 125x125.
        zoom = _ask(ws, {"id": 6, "action": "zoom", "region": [0, 0, 100, 100]})["result"]
        assert (zoom["width"], zoom["height"]) == (125, 125)


def test_max_long_edge_with_a_vendor_vocabulary(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client, display={"width": 1280, "height": 800})["id"]
    display = hypervisor.domains[sid].display
    url = f"/v1/sessions/{sid}/ws?schema=computer_20250124&max_long_edge=1024"
    with client.websocket_connect(url) as ws:
        reply = _ask(ws, {"id": 1, "action": "left_click", "coordinate": [512, 320]})
        assert reply["ok"] is True, reply
        assert AbsMove(640, 400) in display.events
        shot = _ask(ws, {"id": 2, "action": "screenshot"})["result"]
        (block,) = [b for b in shot["content"] if b["type"] == "image"]
        data = base64.b64decode(block["source"]["data"])
        assert Image.open(io.BytesIO(data)).size == (1024, 640)
        cursor = _ask(ws, {"id": 3, "action": "cursor_position"})["result"]
        assert cursor["content"] == [{"type": "text", "text": "X=512,Y=320"}]


@pytest.mark.parametrize(
    "query",
    ["?scale_to=1024", "?scale_to=axb", "?max_long_edge=0", "?max_long_edge=9999",
     "?scale_to=1024x640&max_long_edge=1024"],
)  # fmt: skip
def test_bad_scaling_query_is_explained_then_closed(client: TestClient, query: str) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws{query}") as ws:
        assert ws.receive_json()["error"]["code"] == "invalid_query"
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
    assert info.value.code == 1008


def test_keyboard_layout_is_passed_and_typing_follows_it(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    """The session's layout reaches the domain; ``z`` on ``de`` is the key US calls ``y``
    and ``ctrl+z`` keeps its keysym (KEY_Y with ctrl)."""
    info = _create(client, keyboard_layout="de")
    assert info["keyboard_layout"] == "de"
    domain = hypervisor.domains[info["id"]]
    assert domain.spec.keyboard_layout == "de"
    display = domain.display
    with client.websocket_connect(f"/v1/sessions/{info['id']}/ws") as ws:
        assert _ask(ws, {"id": 1, "action": "type", "text": "z"})["ok"] is True
        assert _ask(ws, {"id": 2, "action": "key", "keys": "ctrl+z"})["ok"] is True
    downs = [e.qcode for e in display.events if isinstance(e, KeyEvent) and e.down]
    assert downs[-3:] == ["y", "ctrl", "y"]
    assert _create(client)["keyboard_layout"] == "us"


def test_keyboard_layout_outside_the_closed_set_is_refused(client: TestClient) -> None:
    response = client.post("/v1/sessions", json={"keyboard_layout": "es"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"
    assert "keyboard_layout" in response.json()["error"]["message"]
