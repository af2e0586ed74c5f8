"""Through the bridge: after a restart, tokens minted before it still work, revoked ones
stay revoked, the approval policy and the session's REST view are back (issue 10, s2)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from agent_bridge.runtime import build_authority, ensure_signing_key
from agent_bridge.server import create_app
from orchestrator.clock import FakeClock
from orchestrator.settings import Settings
from tests.restart.test_adopt import World, crash

TOKEN = "admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_tokens_policy_and_view_survive_a_restart(tmp_path: Path) -> None:
    world = World(tmp_path, FakeClock())
    settings = Settings(default_image="x", state_dir=tmp_path / "state")
    first = world.server()
    # No lifespan for the first server: it "dies" without a shutdown.
    before = TestClient(
        create_app(first, token=TOKEN, settings=settings, authority=build_authority(settings)),
        headers=AUTH,
    )
    info = before.post(
        "/v1/sessions", json={"approval": {"text_patterns": ["secret"], "timeout_s": 5}}
    ).json()
    sid = info["id"]
    kept = before.post(f"/v1/sessions/{sid}/tokens", json={"scope": "control"}).json()
    gone = before.post(f"/v1/sessions/{sid}/tokens", json={"scope": "control"}).json()
    assert before.delete(f"/v1/sessions/{sid}/tokens/{gone['token_id']}").status_code == 204
    key_file = settings.token_key_file
    assert key_file.stat().st_mode & 0o777 == 0o600
    crash(first)

    second = world.server()
    app = create_app(second, token=TOKEN, settings=settings, authority=build_authority(settings))
    with TestClient(app) as after:  # the lifespan re-adopts
        ok = {"Authorization": f"Bearer {kept['token']}"}
        refused = {"Authorization": f"Bearer {gone['token']}"}
        view = after.get(f"/v1/sessions/{sid}", headers=ok)
        assert view.status_code == 200, view.text
        assert view.json()["state"] == "ready"
        assert view.json()["created_at"] == info["created_at"]
        assert after.get(f"/v1/sessions/{sid}", headers=refused).status_code == 401
        listed = after.get(f"/v1/sessions/{sid}/tokens", headers=AUTH).json()
        assert [t["token_id"] for t in listed] == [kept["token_id"]]
        policy = after.get(f"/v1/sessions/{sid}/approval-policy", headers=AUTH).json()
        assert policy["text_patterns"] == ["secret"]
        with after.websocket_connect(f"/v1/sessions/{sid}/ws", headers=ok) as ws:
            ws.send_text(json.dumps({"id": 1, "action": "type", "text": "ls\n"}))
            assert ws.receive_json()["ok"] is True
    assert ensure_signing_key(settings) == bytes.fromhex(key_file.read_text().strip())
