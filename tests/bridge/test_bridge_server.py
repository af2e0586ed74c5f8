"""In-process tests of the bridge server: FastAPI TestClient over the fake hypervisor."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest
from conftest import AUTH, IMAGE, TOKEN
from conftest import ask as _ask
from conftest import create_session as _create
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from starlette.websockets import WebSocketDisconnect

from agent_bridge.server import MAX_MESSAGE_BYTES, create_app
from orchestrator.errors import ConfigError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.manager import SessionManager

# --- REST --------------------------------------------------------------------------------


def test_create_get_list_delete(client: TestClient, hypervisor: FakeHypervisor) -> None:
    info = _create(client, display={"width": 1024, "height": 768}, memory_mib=1024, vcpus=1)
    sid = info["id"]
    assert info["state"] == "ready"
    assert info["image"] == IMAGE
    assert info["display"] == {"width": 1024, "height": 768}
    assert info["ws_url"] == f"ws://testserver/v1/sessions/{sid}/ws"
    assert info["recording"].endswith(sid)
    assert info["boot_s"] is not None and info["created_at"] and info["ready_at"]
    assert info["cursor"] == {"x": 512, "y": 384}
    assert sid in hypervisor.domains

    assert client.get(f"/v1/sessions/{sid}").json()["id"] == sid
    assert [s["id"] for s in client.get("/v1/sessions").json()] == [sid]

    deleted = client.delete(f"/v1/sessions/{sid}")
    assert deleted.status_code == 200
    assert deleted.json()["state"] == "closed"
    assert hypervisor.domains == {}
    # Deleting again is fine; the ended session is still visible with its recording.
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    assert client.get(f"/v1/sessions/{sid}").json()["state"] == "closed"


def test_healthz_needs_no_token(anon: TestClient, client: TestClient) -> None:
    _create(client)
    assert anon.get("/healthz").json() == {"ok": True, "sessions": 1, "warm_pool": []}


def test_openapi_is_served(anon: TestClient) -> None:
    schema = anon.get("/openapi.json").json()
    assert "/v1/sessions" in schema["paths"]
    assert anon.get("/docs").status_code == 200


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
     {"Authorization": "Bearer ünïcode".encode("latin-1")}],
)  # fmt: skip
def test_rest_rejects_missing_or_wrong_token(anon: TestClient, headers: dict[str, Any]) -> None:
    for method, path in [("GET", "/v1/sessions"), ("POST", "/v1/sessions"),
                         ("GET", "/v1/sessions/abc"), ("DELETE", "/v1/sessions/abc"),
                         ("GET", "/v1/sessions/abc/guest-log")]:  # fmt: skip
        response = anon.request(method, path, headers=headers, json={})
        assert response.status_code == 401, (method, path)
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"


def test_token_in_query_is_not_accepted(anon: TestClient) -> None:
    response = anon.get(f"/v1/sessions?token={TOKEN}")
    assert response.status_code == 401
    assert "URL" in response.json()["error"]["message"]


def test_create_app_needs_a_token(manager: SessionManager) -> None:
    with pytest.raises(ConfigError):
        create_app(manager, token="")


@pytest.mark.parametrize(
    "body",
    [
        {"display": {"width": 100, "height": 800}},
        {"display": {"width": "1280", "height": 800}},
        {"memory_mib": 10},
        {"vcpus": 0},
        {"boot_timeout_s": -1},
        {"image": "../etc/passwd"},
        {"surprise": True},
    ],
)
def test_create_validation_is_422(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post("/v1/sessions", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"


def test_config_error_from_spec_is_422(client: TestClient) -> None:
    response = client.post("/v1/sessions", json={"display": {"width": 1284, "height": 800}})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_config"


def test_unknown_image_is_404(client: TestClient, hypervisor: FakeHypervisor) -> None:
    response = client.post("/v1/sessions", json={"image": "no-such-image"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "image_not_found"
    assert hypervisor.domains == {}


def test_unknown_session_is_404(client: TestClient) -> None:
    for method, path in [("GET", "/v1/sessions/nope"), ("DELETE", "/v1/sessions/nope"),
                         ("GET", "/v1/sessions/nope/guest-log")]:  # fmt: skip
        response = client.request(method, path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "session_not_found"


def test_unknown_route_is_json(client: TestClient) -> None:
    response = client.get("/v2/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_over_capacity_is_503(client: TestClient, hypervisor: FakeHypervisor) -> None:
    _create(client)
    _create(client)
    response = client.post("/v1/sessions", json={})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "over_capacity"
    assert "retry-after" in response.headers
    assert len(hypervisor.domains) == 2


def test_boot_failure_leaves_nothing(client: TestClient, hypervisor: FakeHypervisor) -> None:
    hypervisor.fail_on.add("start")
    response = client.post("/v1/sessions", json={})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "hypervisor_error"
    assert hypervisor.domains == {}
    assert client.get("/healthz").json()["sessions"] == 0
    # The failed session is listed as failed, with its recording.
    (failed,) = client.get("/v1/sessions").json()
    assert failed["state"] == "failed"


def test_boot_timeout_is_504_with_console_tail(
    client: TestClient, hypervisor: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A guest that never reports ready: drop the readiness marker from its log.
    from orchestrator.hypervisor import fake

    monkeypatch.setattr(fake.FakeDomain, "read_guest_log", lambda self, offset=0: b"")
    response = client.post("/v1/sessions", json={"boot_timeout_s": 0.05})
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "boot_timeout"
    assert "Linux version" in error["console_tail"]
    assert hypervisor.domains == {}


def test_guest_log_has_what_was_typed(client: TestClient) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        assert _ask(ws, {"id": 1, "action": "type", "text": "hello\n"})["ok"] is True
    response = client.get(f"/v1/sessions/{sid}/guest-log")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text.splitlines()[-1] == "hello"
    # Still readable after the session ended.
    client.delete(f"/v1/sessions/{sid}")
    assert "hello" in client.get(f"/v1/sessions/{sid}/guest-log").text


def test_lifespan_exit_closes_all_sessions(app: FastAPI, hypervisor: FakeHypervisor) -> None:
    with TestClient(app, headers=AUTH) as c:
        _create(c)
        assert len(hypervisor.domains) == 1
    assert hypervisor.domains == {}


# --- WebSocket ---------------------------------------------------------------------------


def test_ws_rejects_missing_or_wrong_token_before_accept(
    client: TestClient, anon: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client)["id"]
    display = hypervisor.domains[sid].display
    for url, headers in [
        (f"/v1/sessions/{sid}/ws", {}),
        (f"/v1/sessions/{sid}/ws", {"Authorization": "Bearer nope"}),
        (f"/v1/sessions/{sid}/ws?token={TOKEN}", {}),
    ]:
        with (
            pytest.raises(WebSocketDisconnect) as info,
            anon.websocket_connect(url, headers=headers),
        ):
            pass  # the handshake is refused before this line
        assert info.value.code == 1008
    assert display.events == []


def test_ws_accepts_bearer_subprotocol_and_echoes_only_v1(
    client: TestClient, anon: TestClient
) -> None:
    sid = _create(client)["id"]
    protocols = ["deskvm.v1", f"deskvm.bearer.{TOKEN}"]
    with anon.websocket_connect(f"/v1/sessions/{sid}/ws", subprotocols=protocols) as ws:
        assert ws.accepted_subprotocol == "deskvm.v1"
        assert _ask(ws, {"id": "a", "action": "cursor_position"})["ok"] is True
    with (
        pytest.raises(WebSocketDisconnect) as info,
        anon.websocket_connect(
            f"/v1/sessions/{sid}/ws", subprotocols=["deskvm.v1", "deskvm.bearer.wrong"]
        ),
    ):
        pass
    assert info.value.code == 1008


def test_ws_every_action_round_trip(client: TestClient, hypervisor: FakeHypervisor) -> None:
    sid = _create(client)["id"]
    display = hypervisor.domains[sid].display
    messages: list[dict[str, Any]] = [
        {"action": "move", "x": 10, "y": 20},
        {"action": "click", "x": 30, "y": 40, "button": "right", "count": 1},
        {"action": "click"},
        {"action": "double_click", "x": 1, "y": 2},
        {"action": "triple_click", "x": 3, "y": 4},
        {"action": "mouse_down", "x": 5, "y": 6},
        {"action": "mouse_up", "x": 7, "y": 8},
        {"action": "drag", "path": [[10, 10], [50, 60], [100, 120]]},
        {"action": "scroll", "x": 200, "y": 200, "dy": 3, "dx": -1},
        {"action": "type", "text": "ls -l\n"},
        {"action": "type", "text": "hunter2", "secret": True},
        {"action": "key", "keys": "ctrl+shift+t"},
        {"action": "hold_key", "keys": "shift", "duration_ms": 1},
        {"action": "wait", "ms": 1},
        {"action": "cursor_position"},
        {"action": "zoom", "region": [0, 0, 64, 32]},
        {"action": "screenshot"},
    ]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        replies = [_ask(ws, {"id": i, **m}) for i, m in enumerate(messages)]
    for i, reply in enumerate(replies):
        assert reply["id"] == i and reply["ok"] is True, (messages[i], reply)
    assert replies[14]["result"] == {"x": 200, "y": 200}  # where the scroll moved it
    assert replies[15]["result"]["width"] == 64 and replies[15]["result"]["height"] == 32
    assert display.pressed_keys == set() and display.pressed_buttons == set()
    assert display.pointer == (200, 200)


def test_ws_screenshot_is_a_png_of_the_display(client: TestClient) -> None:
    sid = _create(client, display={"width": 800, "height": 600})["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        reply = _ask(ws, {"id": 7, "action": "screenshot"})
    result = reply["result"]
    assert (result["width"], result["height"], result["mime"]) == (800, 600, "image/png")
    png = base64.b64decode(result["data"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png))
    image.verify()
    assert image.size == (800, 600)


def test_ws_bad_messages_get_structured_errors_and_session_survives(client: TestClient) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        ws.send_text("{not json")
        assert ws.receive_json()["error"]["code"] == "invalid_json"
        ws.send_text("[1, 2]")
        assert ws.receive_json()["error"]["code"] == "invalid_message"
        ws.send_bytes(b"\x00\x01")
        assert ws.receive_json() == {
            "id": None, "ok": False,
            "error": {"code": "binary_not_supported",
                      "message": "binary frames are not supported; send JSON text messages"},
        }  # fmt: skip
        reply = _ask(ws, {"id": 1, "action": "fly"})
        assert reply["id"] == 1 and reply["error"]["code"] == "unknown_action"
        assert "screenshot" in reply["error"]["message"]
        assert _ask(ws, {"id": 2, "action": "move", "x": 5})["error"]["code"] == (
            "missing_parameter"
        )
        reply = _ask(ws, {"id": 3, "action": "click", "x": 1280, "y": 10})
        assert reply == {
            "id": 3, "ok": False,
            "error": {"code": "out_of_screen", "message": reply["error"]["message"]},
        }  # fmt: skip
        assert _ask(ws, {"id": 4, "action": "click", "x": -1, "y": 10})["error"]["code"] == (
            "out_of_screen"
        )
        assert _ask(ws, {"id": 5, "action": "wait", "ms": "soon"})["error"]["code"] == (
            "invalid_action"
        )
        # ...and the session still answers.
        assert _ask(ws, {"id": 6, "action": "cursor_position"}) == {
            "id": 6, "ok": True, "result": {"x": 640, "y": 400},
        }  # fmt: skip
    assert client.get(f"/v1/sessions/{sid}").json()["state"] == "ready"


def test_ws_message_too_big_closes_1009(client: TestClient) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        ws.send_text(json.dumps({"id": 1, "action": "type", "text": "x" * MAX_MESSAGE_BYTES}))
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
    assert info.value.code == 1009
    assert client.get(f"/v1/sessions/{sid}").json()["state"] == "ready"


def test_ws_records_agent_source(client: TestClient) -> None:
    info = _create(client)
    with client.websocket_connect(f"/v1/sessions/{info['id']}/ws") as ws:
        _ask(ws, {"id": 1, "action": "click", "x": 3, "y": 4})
    client.delete(f"/v1/sessions/{info['id']}")
    with open(f"{info['recording']}/events.jsonl") as f:
        events = [json.loads(line) for line in f]
    inputs = [e for e in events if e["kind"] == "input"]
    assert inputs and all(e["source"] == "agent" for e in inputs)
    assert inputs[0]["data"]["action"]["action"] == "click"


def test_ws_on_disconnect_delete(client: TestClient, hypervisor: FakeHypervisor) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws?on_disconnect=delete") as ws:
        assert _ask(ws, {"id": 1, "action": "screenshot"})["ok"] is True
    assert client.get(f"/v1/sessions/{sid}").json()["state"] == "closed"
    assert hypervisor.domains == {}


def test_ws_on_disconnect_keep_is_default(client: TestClient, hypervisor: FakeHypervisor) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        _ask(ws, {"id": 1, "action": "screenshot"})
    assert client.get(f"/v1/sessions/{sid}").json()["state"] == "ready"
    assert sid in hypervisor.domains


def test_ws_session_deleted_while_connected_closes_1001(client: TestClient) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        assert client.delete(f"/v1/sessions/{sid}").status_code == 200
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
    assert info.value.code == 1001
    assert "session ended" in (info.value.reason or "")


@pytest.mark.parametrize(
    ("query", "code", "error"),
    [
        ("?schema=klingon", 1008, "unknown_schema"),
        ("?on_disconnect=explode", 1008, "invalid_query"),
    ],
)
def test_ws_bad_query_is_explained_then_closed(
    client: TestClient, query: str, code: int, error: str
) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws{query}") as ws:
        assert ws.receive_json()["error"]["code"] == error
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
    assert info.value.code == code


def test_ws_schema_deskvm_explicit(client: TestClient) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws?schema=deskvm") as ws:
        assert _ask(ws, {"id": 1, "action": "cursor_position"})["ok"] is True


def test_ws_unknown_and_ended_sessions(client: TestClient) -> None:
    with client.websocket_connect("/v1/sessions/nosuchsession/ws") as ws:
        assert ws.receive_json()["error"]["code"] == "session_not_found"
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
    assert info.value.code == 4404
    sid = _create(client)["id"]
    client.delete(f"/v1/sessions/{sid}")
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        assert ws.receive_json()["error"]["code"] == "session_closed"
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
    assert info.value.code == 1001


def test_ws_keeps_order_of_pipelined_requests(client: TestClient) -> None:
    sid = _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        for i in range(20):
            ws.send_json({"id": i, "action": "move", "x": i, "y": i})
        ws.send_json({"id": "last", "action": "cursor_position"})
        ids = [ws.receive_json()["id"] for _ in range(21)]
    assert ids == [*range(20), "last"]


def test_display_error_becomes_error_reply(client: TestClient, hypervisor: FakeHypervisor) -> None:
    from orchestrator.errors import DisplayError

    sid = _create(client)["id"]
    hypervisor.domains[sid].display.fail_next_screendump = DisplayError("screendump failed")
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        assert _ask(ws, {"id": 1, "action": "screenshot"})["error"] == {
            "code": "display_error", "message": "screendump failed",
        }  # fmt: skip
        assert _ask(ws, {"id": 2, "action": "screenshot"})["ok"] is True


def test_ws_vendor_schema_plugs_in(client: TestClient, hypervisor: FakeHypervisor) -> None:
    info = _create(client)
    sid = info["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws?schema=computer_20250124") as ws:
        reply = _ask(ws, {"id": 1, "action": "left_click", "coordinate": [12, 34]})
        assert reply["id"] == 1 and reply["ok"] is True, reply
        bad = _ask(ws, {"id": 2, "action": "click", "x": 1, "y": 1})
        assert bad["error"]["code"] == "unknown_action"
    assert hypervisor.domains[sid].display.pointer == (12, 34)
    client.delete(f"/v1/sessions/{sid}")
    with open(f"{info['recording']}/events.jsonl") as f:
        inputs = [json.loads(line) for line in f if '"kind":"input"' in line]
    assert inputs[0]["data"]["raw"] == {"action": "left_click", "coordinate": [12, 34]}
    assert inputs[0]["source"] == "agent"
