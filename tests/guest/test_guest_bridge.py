"""Guest control through the bridge on the fake backend: REST and WebSocket, the switch,
the ``exec`` scope, approval rules on argv and paths, the recording, resolution changes."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from agent_bridge.protocol.guest import PUT_FILE_MAX_BYTES
from orchestrator.hypervisor.fake import FakeHypervisor
from tests.guest.conftest import TOKEN


def create(client: TestClient, **body: Any) -> str:
    response = client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def ask(ws: Any, message: dict[str, Any]) -> dict[str, Any]:
    ws.send_text(json.dumps(message))
    return ws.receive_json()  # type: ignore[no-any-return]


def events(client: TestClient, sid: str) -> list[dict[str, Any]]:
    path = Path(client.get(f"/v1/sessions/{sid}").json()["recording"]) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def token(client: TestClient, sid: str, scope: str) -> dict[str, str]:
    minted = client.post(f"/v1/sessions/{sid}/tokens", json={"scope": scope}).json()
    return {"Authorization": f"Bearer {minted['token']}"}


def test_guest_control_is_off_by_default(client: TestClient) -> None:
    sid = create(client)
    assert client.get(f"/v1/sessions/{sid}").json()["guest_control"] is False
    response = client.post(f"/v1/sessions/{sid}/guest/exec", json={"argv": ["true"]})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "guest_control_disabled"
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        reply = ask(ws, {"id": 1, "action": "clipboard_get"})
        assert reply["error"]["code"] == "guest_control_disabled"
        assert ask(ws, {"id": 2, "action": "cursor_position"})["ok"]  # the session lives on


def test_exec_files_and_clipboard_over_rest(client: TestClient) -> None:
    sid = create(client, guest_control=True)
    base = f"/v1/sessions/{sid}/guest"
    result = client.post(f"{base}/exec", json={"argv": ["cat"], "stdin": "ä\n"}).json()
    assert result == {
        "exit_code": 0,
        "stdout": "ä\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "cap_bytes": 1 << 20,
        "timed_out": False,
    }
    data = bytes(range(256))
    encoded = base64.b64encode(data).decode()
    put = client.post(f"{base}/put_file", json={"path": "/home/desk/a.bin", "data_b64": encoded})
    assert put.json() == {"path": "/home/desk/a.bin", "size_bytes": 256,
                          "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    got = client.post(f"{base}/get_file", json={"path": "/home/desk/a.bin"}).json()
    assert base64.b64decode(got["data_b64"]) == data and got["sha256"] == put.json()["sha256"]
    assert client.post(f"{base}/clipboard_set", json={"text": "pasted"}).json() == {}
    assert client.post(f"{base}/clipboard_get").json() == {"text": "pasted"}
    timed = client.post(f"{base}/exec", json={"argv": ["sleep", "5"], "timeout_s": 1}).json()
    assert timed["timed_out"] is True and timed["exit_code"] == -9
    missing = client.post(f"{base}/exec", json={"argv": ["nosuch"]}).json()
    assert missing["exit_code"] == 127


@pytest.mark.parametrize(
    ("op", "body", "code", "status"),
    [
        ("exec", {"argv": "ls -l"}, "invalid_action", 400),
        ("exec", {"argv": []}, "invalid_action", 400),
        ("exec", {"argv": ["x"], "timeout_s": 0}, "invalid_action", 400),
        ("exec", {"argv": ["x"], "env": {"A=B": "c"}}, "invalid_action", 400),
        ("exec", {"argv": ["x"], "shell": True}, "unknown_parameter", 400),
        ("get_file", {"path": "/etc/shadow"}, "path_not_allowed", 403),
        ("get_file", {"path": "/tmp/../etc/shadow"}, "path_not_allowed", 403),
        ("get_file", {"path": "tmp/x"}, "path_not_allowed", 403),
        ("get_file", {}, "missing_parameter", 400),
        ("put_file", {"path": "/tmp/x", "data_b64": "***"}, "invalid_action", 400),
        ("window_close", {"id": "0x1"}, "invalid_action", 400),
        ("window_close", {"id": 1, "window_id": 1}, "invalid_action", 400),
        ("nosuch", {}, "unknown_action", 400),
    ],
)
def test_bad_requests_are_structured_errors(client: TestClient, op, body, code, status) -> None:  # type: ignore[no-untyped-def]
    sid = create(client, guest_control=True)
    response = client.post(f"/v1/sessions/{sid}/guest/{op}", json=body)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    assert client.post(f"/v1/sessions/{sid}/guest/exec", json={"argv": ["true"]}).status_code == 200


def test_put_file_cap(client: TestClient) -> None:
    sid = create(client, guest_control=True)
    big = base64.b64encode(b"x" * (PUT_FILE_MAX_BYTES + 1)).decode()
    response = client.post(
        f"/v1/sessions/{sid}/guest/put_file", json={"path": "/tmp/x", "data_b64": big}
    )
    assert response.status_code == 400 and "larger than" in response.json()["error"]["message"]


def test_exec_scope_is_separate_from_control(client: TestClient) -> None:
    sid = create(client, guest_control=True)
    control = token(client, sid, "control")
    response = client.post(
        f"/v1/sessions/{sid}/guest/exec", json={"argv": ["true"]}, headers=control
    )
    assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden"
    with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=control) as ws:
        reply = ask(ws, {"id": 1, "action": "exec", "argv": ["true"]})
        assert reply["error"]["code"] == "forbidden" and "'exec'" in reply["error"]["message"]
        assert ask(ws, {"id": 2, "action": "click", "x": 5, "y": 5})["ok"]
    exec_token = token(client, sid, "exec")
    with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=exec_token) as ws:
        assert ask(ws, {"id": 1, "action": "exec", "argv": ["true"]})["ok"]
        assert ask(ws, {"id": 2, "action": "click", "x": 5, "y": 5})["ok"]  # exec implies control
    # A control token cannot mint an exec token either.
    minted = client.post(f"/v1/sessions/{sid}/tokens", json={"scope": "exec"}, headers=control)
    assert minted.status_code == 403


GUEST_BODIES: dict[str, dict[str, Any]] = {
    "exec": {"argv": ["true"]},
    "put_file": {"path": "/tmp/x", "data_b64": "eA=="},
    "get_file": {"path": "/tmp/x"},
    "clipboard_get": {},
    "clipboard_set": {"text": "x"},
    "windows": {},
    "window_activate": {"id": 1},
    "window_close": {"id": 1},
    "a11y_tree": {},
    "set_resolution": {"width": 1024, "height": 768},
}


def test_every_guest_op_needs_the_exec_scope(client: TestClient) -> None:
    from agent_bridge.protocol.guest import GUEST_ACTIONS

    assert set(GUEST_BODIES) == set(GUEST_ACTIONS)  # a new op is added here too
    sid = create(client, guest_control=True)
    for scope in ("view", "control"):
        headers = token(client, sid, scope)
        with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=headers) as ws:
            for n, (op, body) in enumerate(GUEST_BODIES.items()):
                if op.startswith("window_"):  # on the socket "id" is the request's
                    body = {"window_id": body["id"]}
                reply = ask(ws, {"id": n, "action": op, **body})
                assert reply["error"]["code"] == "forbidden", (scope, op, reply)
                assert "scope 'exec'" in reply["error"]["message"], (scope, op, reply)
        for op, body in GUEST_BODIES.items():
            response = client.post(f"/v1/sessions/{sid}/guest/{op}", json=body, headers=headers)
            assert response.status_code == 403, (scope, op, response.text)
    # None of them reached the guest: the recording has no guest action at all.
    assert not [e for e in events(client, sid) if e["kind"] == "input"]


def test_the_recording_keeps_sizes_and_hashes_not_contents(client: TestClient) -> None:
    sid = create(client, guest_control=True)
    base = f"/v1/sessions/{sid}/guest"
    client.post(f"{base}/exec", json={"argv": ["cat"], "stdin": "stdin-content-xyz",
                                      "env": {"TOKEN_NAME": "env-value-xyz"}})  # fmt: skip
    encoded = base64.b64encode(b"file-content-xyz").decode()
    client.post(f"{base}/put_file", json={"path": "/tmp/f", "data_b64": encoded})
    client.post(f"{base}/clipboard_set", json={"text": "clip-content-xyz"})
    client.post(f"{base}/exec", json={"argv": ["echo", "hunter2-xyz"], "secret": True})
    recorded = events(client, sid)
    text = json.dumps(recorded)
    for secret in ("stdin-content-xyz", "env-value-xyz", "file-content-xyz", "clip-content-xyz",
                   "hunter2-xyz"):  # fmt: skip
        assert secret not in text
    inputs = [e["data"]["action"] for e in recorded if e["kind"] == "input"]
    assert inputs[0]["argv"] == ["cat"] and inputs[0]["env_names"] == ["TOKEN_NAME"]
    assert inputs[0]["stdin_sha256"] == hashlib.sha256(b"stdin-content-xyz").hexdigest()
    assert inputs[1]["sha256"] == hashlib.sha256(b"file-content-xyz").hexdigest()
    assert inputs[3]["secret"] is True and "argv" not in inputs[3]
    assert set(inputs[3]["digest"]) == {"length", "hmac_sha256"}
    results = [e["data"] for e in recorded if e["kind"] == "result"]
    assert results[0]["stdout_sha256"] == hashlib.sha256(b"stdin-content-xyz").hexdigest()
    assert results[0]["reported_by"] == "guest" and results[0]["exit_code"] == 0
    assert "stdout_sha256" not in results[3] and "stdout_digest" in results[3]


def test_approval_rules_hold_exec_argv_and_paths(client: TestClient) -> None:
    approval = {"argv_patterns": [r"^rm( |$)"], "path_patterns": [r"/\.ssh/"], "timeout_s": 5}
    sid = create(client, guest_control=True, approval=approval)
    base = f"/v1/sessions/{sid}/guest"
    assert client.post(f"{base}/exec", json={"argv": ["ls"]}).status_code == 200
    replies: dict[str, Any] = {}

    def run() -> None:
        replies["rm"] = client.post(f"{base}/exec", json={"argv": ["rm", "-rf", "/tmp/x"]})

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 5
    pending: list[dict[str, Any]] = []
    while not pending and time.monotonic() < deadline:
        pending = client.get(f"/v1/sessions/{sid}/pending").json()
        time.sleep(0.05)
    assert pending and pending[0]["reason"] == "exec argv matches /^rm( |$)/"
    assert pending[0]["action"]["argv"] == ["rm", "-rf", "/tmp/x"]
    client.post(f"/v1/sessions/{sid}/pending/{pending[0]['pending_id']}", json={"decision": "deny"})
    thread.join(5)
    assert replies["rm"].json()["error"]["code"] == "approval_denied"
    put = {"path": "/home/desk/.ssh/authorized_keys", "data_b64": "eA=="}

    def put_run() -> None:
        replies["put"] = client.post(f"{base}/put_file", json=put)

    thread = threading.Thread(target=put_run)
    thread.start()
    pending = []
    deadline = time.monotonic() + 5
    while not pending and time.monotonic() < deadline:
        pending = client.get(f"/v1/sessions/{sid}/pending").json()
        time.sleep(0.05)
    assert pending and pending[0]["reason"] == r"path matches //\.ssh//"
    client.post(
        f"/v1/sessions/{sid}/pending/{pending[0]['pending_id']}", json={"decision": "approve"}
    )
    thread.join(5)
    assert replies["put"].status_code == 200
    policy = client.get(f"/v1/sessions/{sid}/approval-policy").json()
    assert policy["argv_patterns"] == [r"^rm( |$)"] and policy["path_patterns"] == [r"/\.ssh/"]


def test_bad_approval_patterns_are_refused(client: TestClient) -> None:
    response = client.post("/v1/sessions", json={"approval": {"argv_patterns": ["("]}})
    assert response.status_code == 422
    assert "approval pattern '('" in response.json()["error"]["message"]


def test_windows_activate_close_and_a11y(client: TestClient) -> None:
    sid = create(client, guest_control=True)
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        windows = ask(ws, {"id": 1, "action": "windows"})["result"]["windows"]
        assert [w["class"] for w in windows] == ["xterm.XTerm"] and windows[0]["focused"]
        wid = windows[0]["id"]
        assert ask(ws, {"id": 2, "action": "window_activate", "window_id": wid})["ok"]
        tree = ask(ws, {"id": 3, "action": "a11y_tree", "window_id": wid})["result"]
        assert tree["tree"]["children"][0]["name"] == "desk@deskvm"
        assert ask(ws, {"id": 4, "action": "window_close", "window_id": wid})["ok"]
        assert ask(ws, {"id": 5, "action": "windows"})["result"]["windows"] == []
        gone = ask(ws, {"id": 6, "action": "window_activate", "window_id": wid})
        assert gone["error"]["code"] == "guest_refused"


def test_resolution_change_moves_screenshots_bounds_and_scaling(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = create(client, guest_control=True)
    with client.websocket_connect(f"/v1/sessions/{sid}/ws?max_long_edge=640") as ws:
        refused = ask(ws, {"id": 1, "action": "set_resolution", "width": 1366, "height": 768})
        assert refused["error"]["code"] == "unsupported_resolution"
        assert "multiple of 8" in refused["error"]["message"]
        assert "1360x768, 1368x768" in refused["error"]["message"]
        too_big = ask(ws, {"id": 2, "action": "set_resolution", "width": 4096, "height": 4096})
        assert too_big["error"]["code"] == "unsupported_resolution"
        assert "16 MiB" in too_big["error"]["message"]
        done = ask(ws, {"id": 3, "action": "set_resolution", "width": 1024, "height": 768})
        assert done["result"] == {"width": 1024, "height": 768}
        shot = ask(ws, {"id": 4, "action": "screenshot"})["result"]
        assert (shot["width"], shot["height"]) == (640, 480)  # scaled from 1024x768
        assert ask(ws, {"id": 5, "action": "click", "x": 639, "y": 479})["ok"]
        outside = ask(ws, {"id": 6, "action": "click", "x": 639, "y": 499})
        assert outside["error"]["code"] == "out_of_screen"
    domain = hypervisor.domains[sid] if hasattr(hypervisor, "domains") else None
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["display"] == {"width": 1024, "height": 768}
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        assert ask(ws, {"id": 1, "action": "click", "x": 1023, "y": 767})["ok"]
        assert ask(ws, {"id": 2, "action": "cursor_position"})["result"] == {"x": 1023, "y": 767}
    del domain
    changed = [e for e in events(client, sid) if e["data"].get("event") == "display_changed"]
    assert changed and changed[0]["data"]["display"] == [1024, 768]


def test_session_token_of_scope_exec_reaches_the_rest_route(client: TestClient, app: Any) -> None:
    sid = create(client, guest_control=True)
    headers = token(client, sid, "exec")
    with TestClient(app) as anon:
        response = anon.post(f"/v1/sessions/{sid}/guest/exec", json={"argv": ["pwd"]},
                             headers=headers)  # fmt: skip
        assert response.json()["stdout"] == "/home/desk\n"
        assert (
            anon.post(f"/v1/sessions/{sid}/guest/exec", json={"argv": ["pwd"]}).status_code == 401
        )
    assert TOKEN not in json.dumps(events(client, sid))


def test_a_reset_returns_to_the_created_display(tmp_path: Path) -> None:
    from agent_bridge.server import create_app
    from orchestrator.input_plan import Pacing
    from orchestrator.manager import SessionManager
    from orchestrator.pool import PoolTarget
    from orchestrator.settings import Settings
    from tests.guest.conftest import HELPER_PORT, IMAGE, _resolver

    manager = SessionManager(
        hypervisor=FakeHypervisor(),
        resolve_image=_resolver(tmp_path, helper_port=HELPER_PORT),
        recordings_dir=tmp_path / "recordings",
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
        warm_pool=(PoolTarget(IMAGE, 1),),
        pool_dir=tmp_path / "pool",
    )
    assert manager.pool is not None
    manager.pool._interval_s = 0.05
    app = create_app(manager, token=TOKEN, settings=Settings(default_image=IMAGE))
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        assert manager.pool.wait_full(5)
        info = client.post("/v1/sessions", json={"guest_control": True}).json()
        assert info["start"] == "warm", info
        sid = info["id"]
        with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
            assert ask(ws, {"id": 1, "action": "set_resolution", "width": 1024, "height": 768})[
                "ok"
            ]
            assert client.post(f"/v1/sessions/{sid}/reset").status_code == 200
            shot = ask(ws, {"id": 2, "action": "screenshot"})["result"]
            assert (shot["width"], shot["height"]) == (1280, 800)
            assert ask(ws, {"id": 3, "action": "click", "x": 1279, "y": 799})["ok"]
        assert client.get(f"/v1/sessions/{sid}").json()["display"] == {"width": 1280, "height": 800}
