"""In-process attacks on the bridge (fake hypervisor): scoped tokens, WebSocket hardening,
capacity and limits, and approvals checked on the fake display's event list."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import AUTH, IMAGE, TOKEN
from conftest import ask as _ask
from conftest import create_session as _create
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from agent_bridge.server import MAX_MESSAGE_BYTES, create_app
from agent_bridge.tokens import TokenAuthority
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.manager import CLOSED_DOMAIN_STOPPED, CLOSED_IDLE, CLOSED_TTL, SessionManager
from orchestrator.settings import Settings


def _mint(client: TestClient, sid: str, scope: str, **extra: Any) -> dict[str, Any]:
    response = client.post(f"/v1/sessions/{sid}/tokens", json={"scope": scope, **extra})
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def _refused(anon: TestClient, url: str, **kwargs: Any) -> int:
    with pytest.raises(WebSocketDisconnect) as info, anon.websocket_connect(url, **kwargs):
        pass  # the handshake is refused before this line
    return info.value.code


@pytest.fixture
def hardened(manager: SessionManager) -> Iterator[TestClient]:
    settings = Settings(
        default_image=IMAGE,
        allowed_origins=("https://viewer.example",),
        max_actions_per_s=5,
        max_typed_chars_per_s=20,
    )
    with TestClient(create_app(manager, token=TOKEN, settings=settings), headers=AUTH) as c:
        yield c


# --- tokens over REST and WebSocket -------------------------------------------------------


def test_view_token_sees_frames_but_cannot_click(
    client: TestClient, anon: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client)["id"]
    display = hypervisor.domains[sid].display
    view = _mint(client, sid, "view")
    assert view["expires_at"] and view["scope"] == "view" and view["token"]
    headers = {"Authorization": f"Bearer {view['token']}"}
    assert anon.get(f"/v1/sessions/{sid}", headers=headers).status_code == 200
    with anon.websocket_connect(f"/v1/sessions/{sid}/ws", headers=headers) as ws:
        assert _ask(ws, {"id": 1, "action": "screenshot"})["ok"] is True
        reply = _ask(ws, {"id": 2, "action": "click", "x": 5, "y": 5})
        assert reply["error"]["code"] == "forbidden"
        reply = _ask(ws, {"id": 3, "action": "type", "text": "rm -rf /\n"})
        assert reply["error"]["code"] == "forbidden"
    assert display.events == []
    # View cannot delete, mint or read the policy either.
    assert anon.delete(f"/v1/sessions/{sid}", headers=headers).status_code == 403
    response = anon.post(f"/v1/sessions/{sid}/tokens", headers=headers, json={"scope": "view"})
    assert response.status_code == 403
    assert anon.get(f"/v1/sessions/{sid}/pending", headers=headers).status_code == 403


def test_control_token_acts_admin_token_deletes(
    client: TestClient, anon: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client)["id"]
    control = {"Authorization": f"Bearer {_mint(client, sid, 'control')['token']}"}
    with anon.websocket_connect(f"/v1/sessions/{sid}/ws", headers=control) as ws:
        assert _ask(ws, {"id": 1, "action": "click", "x": 5, "y": 5})["ok"] is True
    assert hypervisor.domains[sid].display.events
    admin = _mint(client, sid, "admin")
    assert anon.delete(f"/v1/sessions/{sid}", headers=control).status_code == 403
    headers = {"Authorization": f"Bearer {admin['token']}"}
    # A session admin token mints narrower tokens for its own session only.
    assert (
        anon.post(f"/v1/sessions/{sid}/tokens", headers=headers, json={"scope": "view"}).status_code
        == 201
    )
    assert anon.get("/v1/sessions", headers=headers).status_code == 401  # not server-wide
    assert anon.delete(f"/v1/sessions/{sid}", headers=headers).status_code == 200


def test_revoking_a_token_ends_the_action_socket_it_opened(
    client: TestClient, anon: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client)["id"]
    minted = _mint(client, sid, "control")
    control = {"Authorization": f"Bearer {minted['token']}"}
    with anon.websocket_connect(f"/v1/sessions/{sid}/ws", headers=control) as ws:
        assert _ask(ws, {"id": 1, "action": "click", "x": 5, "y": 5})["ok"] is True
        events = len(hypervisor.domains[sid].display.events)
        assert client.delete(f"/v1/sessions/{sid}/tokens/{minted['token_id']}").status_code == 204
        reply = _ask(ws, {"id": 2, "action": "click", "x": 6, "y": 6})
        assert reply["ok"] is False and reply["error"]["code"] == "unauthorized"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1008
    assert len(hypervisor.domains[sid].display.events) == events  # nothing injected


def test_wrong_session_revoked_replayed_forged_and_query_tokens_are_refused(
    client: TestClient, anon: TestClient, hypervisor: FakeHypervisor
) -> None:
    a, b = _create(client)["id"], _create(client)["id"]
    token_a = _mint(client, a, "admin")["token"]
    # Wrong session: REST 401, WebSocket refused before accept.
    response = anon.get(f"/v1/sessions/{b}", headers={"Authorization": f"Bearer {token_a}"})
    assert response.status_code == 401
    assert "not for this session" in response.json()["error"]["message"]
    assert token_a not in response.text
    url_b = f"/v1/sessions/{b}/ws"
    assert _refused(anon, url_b, headers={"Authorization": f"Bearer {token_a}"}) == 1008
    # Forged: one signature character changed. Not the last one: a base64 HMAC's last
    # character carries unused bits, and changing only those leaves the same signature.
    i = len(token_a) - 10
    forged = token_a[:i] + ("A" if token_a[i] != "A" else "B") + token_a[i + 1 :]
    response = anon.get(f"/v1/sessions/{a}", headers={"Authorization": f"Bearer {forged}"})
    assert response.status_code == 401
    # In the URL: never read.
    assert anon.get(f"/v1/sessions/{a}?token={token_a}").status_code == 401
    assert anon.get(f"/v1/sessions/{a}?access_token={token_a}").status_code == 401
    assert _refused(anon, f"/v1/sessions/{a}/ws?token={token_a}") == 1008
    # Revoked.
    minted = _mint(client, a, "control")
    headers = {"Authorization": f"Bearer {minted['token']}"}
    assert anon.get(f"/v1/sessions/{a}", headers=headers).status_code == 200
    assert [t["token_id"] for t in client.get(f"/v1/sessions/{a}/tokens").json()].count(
        minted["token_id"]
    ) == 1
    assert all(t["token"] is None for t in client.get(f"/v1/sessions/{a}/tokens").json())
    assert client.delete(f"/v1/sessions/{a}/tokens/{minted['token_id']}").status_code == 204
    assert client.delete(f"/v1/sessions/{a}/tokens/{minted['token_id']}").status_code == 204
    assert client.delete(f"/v1/sessions/{a}/tokens/nosuchtoken").status_code == 404
    assert anon.get(f"/v1/sessions/{a}", headers=headers).status_code == 401
    assert _refused(anon, f"/v1/sessions/{a}/ws", headers=headers) == 1008
    # Replayed single-use token (a viewer link): the second WebSocket is refused.
    once = _mint(client, a, "view", single_use=True)["token"]
    protocols = ["deskvm.v1", f"deskvm.bearer.{once}"]
    with anon.websocket_connect(f"/v1/sessions/{a}/ws", subprotocols=protocols) as ws:
        assert _ask(ws, {"id": 1, "action": "screenshot"})["ok"] is True
    assert _refused(anon, f"/v1/sessions/{a}/ws", subprotocols=protocols) == 1008
    for sid in (a, b):
        assert hypervisor.domains[sid].display.events == []


def test_expired_token_is_refused(manager: SessionManager, hypervisor: FakeHypervisor) -> None:
    now = [1000.0]
    authority = TokenAuthority(default_ttl_s=60, max_ttl_s=120, clock=lambda: now[0])
    app = create_app(manager, token=TOKEN, settings=Settings(default_image=IMAGE),
                     authority=authority)  # fmt: skip
    with TestClient(app, headers=AUTH) as client, TestClient(app) as anon:
        sid = _create(client)["id"]
        assert (
            client.post(
                f"/v1/sessions/{sid}/tokens", json={"scope": "view", "ttl_s": 121}
            ).status_code
            == 422
        )
        token = _mint(client, sid, "control")["token"]
        headers = {"Authorization": f"Bearer {token}"}
        assert anon.get(f"/v1/sessions/{sid}", headers=headers).status_code == 200
        now[0] += 60
        response = anon.get(f"/v1/sessions/{sid}", headers=headers)
        assert response.status_code == 401 and "expired" in response.json()["error"]["message"]
        assert _refused(anon, f"/v1/sessions/{sid}/ws", headers=headers) == 1008
    assert hypervisor.destroyed  # lifespan closed it


# --- WebSocket hardening --------------------------------------------------------------------


def test_origin_allowlist(hardened: TestClient) -> None:
    sid = _create(hardened)["id"]
    url = f"/v1/sessions/{sid}/ws"
    assert _refused(hardened, url, headers={"Origin": "https://evil.example"}) == 1008
    with hardened.websocket_connect(url, headers={"Origin": "https://viewer.example"}) as ws:
        assert _ask(ws, {"id": 1, "action": "cursor_position"})["ok"] is True
    with hardened.websocket_connect(url, headers={"Origin": "http://testserver"}) as ws:
        assert _ask(ws, {"id": 1, "action": "cursor_position"})["ok"] is True  # same origin
    with hardened.websocket_connect(url) as ws:  # no Origin: not a browser
        assert _ask(ws, {"id": 1, "action": "cursor_position"})["ok"] is True


def test_flooding_client_is_closed_and_other_sessions_carry_on(
    hardened: TestClient, hypervisor: FakeHypervisor
) -> None:
    flood, calm = _create(hardened)["id"], _create(hardened)["id"]
    codes: list[str] = []
    with (
        hardened.websocket_connect(f"/v1/sessions/{flood}/ws") as ws,
        pytest.raises(WebSocketDisconnect) as info,
    ):
        for i in range(200):
            reply = _ask(ws, {"id": i, "action": "move", "x": 1, "y": 1})
            codes.append(reply.get("error", {}).get("code", "ok"))
    assert info.value.code == 1008 and "rate_limited" in (info.value.reason or "")
    assert codes.count("ok") <= 12 and "rate_limited" in codes
    with hardened.websocket_connect(f"/v1/sessions/{calm}/ws") as ws:
        assert _ask(ws, {"id": 1, "action": "click", "x": 3, "y": 3})["ok"] is True
    assert hardened.get(f"/v1/sessions/{flood}").json()["state"] == "ready"


def test_typed_characters_are_rate_limited(hardened: TestClient) -> None:
    sid = _create(hardened)["id"]
    with hardened.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        # One text longer than the burst (40 at 20/s) is one action and passes...
        assert _ask(ws, {"id": 1, "action": "type", "text": "a" * 100})["ok"] is True
        # ...and the session then owes the time: the next text is refused.
        reply = _ask(ws, {"id": 2, "action": "type", "text": "b"})
        assert reply["error"]["code"] == "rate_limited"


def test_refused_text_does_not_use_up_the_typed_characters_limit(hardened: TestClient) -> None:
    sid = _create(hardened)["id"]
    with hardened.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        # Refused before anything is typed (no key on the US layout, no guest helper in
        # this fake image): the 100 characters are given back...
        reply = _ask(ws, {"id": 1, "action": "type", "text": "ñ" * 100})
        assert reply["error"]["code"] == "untypeable_text"
        # ...so a text the agent sends next is not rate limited.
        assert _ask(ws, {"id": 2, "action": "type", "text": "ok"})["ok"] is True


def test_oversized_client_is_closed_and_other_sessions_carry_on(client: TestClient) -> None:
    big, other = _create(client)["id"], _create(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{big}/ws") as ws:
        ws.send_text("x" * (MAX_MESSAGE_BYTES + 1))
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
    assert info.value.code == 1009
    with client.websocket_connect(f"/v1/sessions/{other}/ws") as ws:
        assert _ask(ws, {"id": 1, "action": "screenshot"})["ok"] is True


# --- limits and capacity ----------------------------------------------------------------------


def test_limits_are_echoed_and_recorded(client: TestClient) -> None:
    info = _create(client, memory_mib=1024, vcpus=2, cpu_quota_pct=150, disk_mib=4096,
                   ttl_s=60, idle_timeout_s=30)  # fmt: skip
    assert info["limits"] == {"memory_hard_limit_mib": 1792, "cpu_quota_pct": 150,
                              "disk_mib": 4096, "ttl_s": 60, "idle_timeout_s": 30}  # fmt: skip
    manifest = json.loads((Path(info["recording"]) / "manifest.json").read_text())
    assert "limits" in json.dumps(manifest)


@pytest.mark.parametrize(
    "body", [{"cpu_quota_pct": 201, "vcpus": 2}, {"disk_mib": 10}, {"ttl_s": 0},
             {"idle_timeout_s": -1}, {"approval": {"text_patterns": ["("]}}],
)  # fmt: skip
def test_bad_limits_are_422_and_start_nothing(
    client: TestClient, hypervisor: FakeHypervisor, body: dict[str, Any]
) -> None:
    assert client.post("/v1/sessions", json=body).status_code == 422
    assert hypervisor.started == []


def test_total_memory_capacity_is_503_with_reason(tmp_path: Path, manager: SessionManager) -> None:
    image = manager._resolve_image(IMAGE)
    hv = FakeHypervisor()
    manager = SessionManager(hypervisor=hv, resolve_image=lambda name: image,
                             recordings_dir=tmp_path / "rec", max_sessions=8,
                             max_total_memory_mib=3300, ready_poll_s=0.01)  # fmt: skip
    app = create_app(manager, token=TOKEN, settings=Settings(default_image=IMAGE))
    with TestClient(app, headers=AUTH) as client:
        _create(client, memory_mib=2048)  # 2816 MiB with overhead
        response = client.post("/v1/sessions", json={"memory_mib": 512})
        assert response.status_code == 503
        assert response.headers["retry-after"]
        error = response.json()["error"]
        assert error["code"] == "over_memory" and "3300 MiB" in error["message"]
        assert len(hv.started) == 1 and len(hv.domains) == 1  # never a half-started VM


def test_ttl_and_idle_timeout_end_sessions_with_a_reason(
    client: TestClient, manager: SessionManager, hypervisor: FakeHypervisor
) -> None:
    ttl = _create(client, ttl_s=0.3)["id"]
    # (margins for a loaded host: an action after the idle deadline is refused)
    idle = _create(client, idle_timeout_s=1.0)["id"]
    with client.websocket_connect(f"/v1/sessions/{idle}/ws") as ws:
        for i in range(3):  # activity keeps it alive past its idle timeout
            time.sleep(0.4)
            assert _ask(ws, {"id": i, "action": "cursor_position"})["ok"] is True
        assert manager.expire() == [ttl]
        time.sleep(1.05)
        assert manager.expire() == [idle]
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
        assert info.value.code == 1001
    assert client.get(f"/v1/sessions/{ttl}").json()["closed_reason"] == CLOSED_TTL
    assert client.get(f"/v1/sessions/{idle}").json()["closed_reason"] == CLOSED_IDLE
    assert hypervisor.domains == {}


def test_the_server_sweeps_periodically(
    manager: SessionManager, hypervisor: FakeHypervisor
) -> None:
    settings = Settings(default_image=IMAGE, sweep_interval_s=0.1)
    with TestClient(create_app(manager, token=TOKEN, settings=settings), headers=AUTH) as c:
        # ttl 1 s: a start that takes longer than the ttl (a loaded host) ends "while
        # starting" and the create answers 409 (seen at load 5 with ttl 0.2 s).
        sid = _create(c, ttl_s=1.0)["id"]
        # A leftover of a session nobody knows (e.g. from a server killed with -9).
        from orchestrator.spec import SessionSpec

        image = manager.get(sid).spec.image
        hypervisor.start(SessionSpec("leftover0000", image))
        deadline = time.monotonic() + 5
        while (sid in hypervisor.domains or "leftover0000" in hypervisor.domains) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert hypervisor.domains == {}
        assert c.get(f"/v1/sessions/{sid}").json()["closed_reason"] == CLOSED_TTL


# --- approvals ---------------------------------------------------------------------------


def _operator(client: TestClient, sid: str, decision: str, seen: list[dict[str, Any]]) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pending = client.get(f"/v1/sessions/{sid}/pending").json()
        if pending:
            item = pending[0]
            frame = client.get(item["frame_url"].split("testserver", 1)[1])
            assert frame.headers["content-type"] == "image/png"
            seen.append(item)
            response = client.post(f"/v1/sessions/{sid}/pending/{item['pending_id']}",
                                   json={"decision": decision})  # fmt: skip
            assert response.status_code == 200
            return
        time.sleep(0.01)


def _events(recording: str) -> list[dict[str, Any]]:
    lines = (Path(recording) / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("decision", ["approve", "deny"])
def test_held_action_runs_once_if_approved_never_if_denied(
    client: TestClient, hypervisor: FakeHypervisor, decision: str
) -> None:
    info = _create(client, approval={"text_patterns": ["secret"], "timeout_s": 5})
    sid = info["id"]
    domain = hypervisor.domains[sid]
    seen: list[dict[str, Any]] = []
    worker = threading.Thread(target=_operator, args=(client, sid, decision, seen))
    worker.start()
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        reply = _ask(ws, {"id": 1, "action": "type", "text": "echo secret\n"})
        worker.join()
        assert _ask(ws, {"id": 2, "action": "type", "text": "ls\n"})["ok"] is True  # not held
    assert seen and seen[0]["reason"].startswith("typed text matches")
    log = domain.read_guest_log().decode().splitlines()
    if decision == "approve":
        assert reply["ok"] is True
        assert log.count("echo secret") == 1
    else:
        assert reply["error"]["code"] == "approval_denied"
        assert "echo secret" not in log
    assert log[-1] == "ls"
    approvals = [e for e in _events(info["recording"]) if e["kind"] == "approval"]
    assert [a["data"]["event"] for a in approvals] == ["requested", "decided"]
    assert approvals[1]["data"]["by"] == "admin"
    assert approvals[1]["data"]["decision"] == decision
    assert approvals[0]["data"]["frame_seq"] is not None


def test_no_decision_before_deadline_is_approval_timeout(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client, approval={"kinds": ["click"], "timeout_s": 0.3})["id"]
    display = hypervisor.domains[sid].display
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        reply = _ask(ws, {"id": 1, "action": "click", "x": 9, "y": 9})
    assert reply["error"]["code"] == "approval_timeout"
    assert display.events == []


def test_supervised_mode_and_the_operator_websocket(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client)["id"]
    response = client.put(f"/v1/sessions/{sid}/approval-policy",
                          json={"every_action": True, "timeout_s": 5})  # fmt: skip
    assert response.status_code == 200 and response.json()["every_action"] is True
    display = hypervisor.domains[sid].display
    results: list[dict[str, Any]] = []

    def agent() -> None:
        with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
            results.append(_ask(ws, {"id": 1, "action": "key", "keys": "ctrl+alt+delete"}))
            results.append(_ask(ws, {"id": 2, "action": "screenshot"}))  # observation: free

    thread = threading.Thread(target=agent)
    with client.websocket_connect(f"/v1/sessions/{sid}/operator") as op:
        thread.start()
        event = op.receive_json()
        assert event["event"] == "pending" and event["action"]["action"] == "key"
        assert event["frame_png_b64"]
        op.send_text(json.dumps({"pending_id": "nope", "decision": "approve"}))
        assert op.receive_json()["code"] == "pending_not_found"
        op.send_text(json.dumps({"pending_id": event["pending_id"], "decision": "approve"}))
        got = [op.receive_json(), op.receive_json()]
        assert {e["event"] for e in got} == {"decided", "resolved"}
        thread.join()
    assert [r["ok"] for r in results] == [True, True]
    assert sum(1 for e in display.events if getattr(e, "qcode", None) == "delete") == 2  # down+up


def test_deleting_a_session_denies_its_pending_actions(client: TestClient) -> None:
    sid = _create(client, approval={"every_action": True, "timeout_s": 30})["id"]
    results: list[dict[str, Any]] = []

    def agent() -> None:
        with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
            results.append(_ask(ws, {"id": 1, "action": "click", "x": 1, "y": 1}))

    thread = threading.Thread(target=agent)
    thread.start()
    deadline = time.monotonic() + 5
    while not client.get(f"/v1/sessions/{sid}/pending").json() and time.monotonic() < deadline:
        time.sleep(0.01)
    client.delete(f"/v1/sessions/{sid}")
    thread.join(timeout=10)
    assert results and results[0]["error"]["code"] == "approval_denied"


def test_a_session_whose_domain_died_is_closed_with_a_reason(
    client: TestClient, manager: SessionManager, hypervisor: FakeHypervisor
) -> None:
    sid = _create(client)["id"]
    hypervisor.domains[sid].running = False  # e.g. QEMU killed by its memory hard limit
    assert manager.expire() == [sid]
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["state"] == "closed" and info["closed_reason"] == CLOSED_DOMAIN_STOPPED
    assert hypervisor.domains == {}


def test_tokens_are_never_logged(
    client: TestClient, anon: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    sid = _create(client)["id"]
    minted = _mint(client, sid, "view")
    headers = {"Authorization": f"Bearer {minted['token']}"}
    with anon.websocket_connect(f"/v1/sessions/{sid}/ws", headers=headers) as ws:
        assert _ask(ws, {"id": 1, "action": "click", "x": 1, "y": 1})["ok"] is False
    client.delete(f"/v1/sessions/{sid}/tokens/{minted['token_id']}")
    assert _refused(anon, f"/v1/sessions/{sid}/ws", headers=headers) == 1008
    assert minted["token_id"] in caplog.text  # the id is logged, the secret never
    assert minted["token"] not in caplog.text and TOKEN not in caplog.text


def test_a_sessions_admin_cannot_revoke_or_decide_for_another_session(
    client: TestClient, anon: TestClient
) -> None:
    a, b = _create(client)["id"], _create(client, approval={"every_action": True})["id"]
    victim = _mint(client, b, "control")
    admin_a = {"Authorization": f"Bearer {_mint(client, a, 'admin')['token']}"}
    response = anon.delete(f"/v1/sessions/{a}/tokens/{victim['token_id']}", headers=admin_a)
    assert response.status_code == 404  # not a token of session a: nothing revoked
    assert response.json()["error"]["code"] == "token_not_found"
    headers_b = {"Authorization": f"Bearer {victim['token']}"}
    assert anon.get(f"/v1/sessions/{b}", headers=headers_b).status_code == 200
    results: list[dict[str, Any]] = []

    def agent() -> None:
        with client.websocket_connect(f"/v1/sessions/{b}/ws") as ws:
            results.append(_ask(ws, {"id": 1, "action": "click", "x": 1, "y": 1}))

    thread = threading.Thread(target=agent)
    thread.start()
    deadline = time.monotonic() + 5
    while not (pending := client.get(f"/v1/sessions/{b}/pending").json()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pid = pending[0]["pending_id"]
    response = anon.post(f"/v1/sessions/{a}/pending/{pid}", headers=admin_a,
                         json={"decision": "approve"})  # fmt: skip
    assert response.status_code == 404
    with anon.websocket_connect(f"/v1/sessions/{a}/operator", headers=admin_a) as op:
        op.send_text(json.dumps({"pending_id": pid, "decision": "approve"}))
        assert op.receive_json()["code"] == "pending_not_found"
    assert (
        client.post(f"/v1/sessions/{b}/pending/{pid}", json={"decision": "deny"}).status_code == 200
    )
    thread.join(timeout=10)
    assert results[0]["error"]["code"] == "approval_denied"


def test_a_text_rule_cannot_be_split_over_actions_or_connections(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    """Issue 10, section 5: ``rm -`` then ``rf`` (another message, another connection,
    key presses) is held like ``rm -rf`` in one action."""
    info = _create(client, approval={"text_patterns": [r"rm\s+-rf"], "timeout_s": 5})
    sid = info["id"]
    seen: list[dict[str, Any]] = []
    worker = threading.Thread(target=_operator, args=(client, sid, "deny", seen))
    worker.start()
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as a:
        assert _ask(a, {"id": 1, "action": "type", "text": "rm -"})["ok"] is True
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as b:
        reply = _ask(b, {"id": 2, "action": "key", "keys": "r f Return"})
        worker.join()
        assert reply["error"]["code"] == "approval_denied"
        assert _ask(b, {"id": 3, "action": "key", "keys": "Return"})["ok"] is True
    assert seen and seen[0]["reason"] == r"recent typed text matches /rm\s+-rf/"
    assert "rm -rf" not in hypervisor.domains[sid].read_guest_log().decode()
