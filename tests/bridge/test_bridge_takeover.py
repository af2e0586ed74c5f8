"""Take-over: a person holds a session, the agent's input is held, hand-back releases it."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from conftest import ask, create_session
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from orchestrator.display.base import ButtonEvent, KeyEvent
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.replay import Recording


def _token(client: TestClient, sid: str, scope: str) -> dict[str, Any]:
    response = client.post(f"/v1/sessions/{sid}/tokens", json={"scope": scope})
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _markers(client: TestClient, sid: str) -> list[dict[str, Any]]:
    recording = Recording(client.app.state.bridge.manager.get(sid).recorder.path)  # type: ignore[attr-defined]
    return [e for e in recording.events if e["kind"] == "marker"]


def test_take_over_holds_the_agent_and_hand_back_releases_it(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = create_session(client)["id"]
    person = _token(client, sid, "control")
    display = hypervisor.domains[sid].display
    with (
        client.websocket_connect(f"/v1/sessions/{sid}/ws") as agent,
        client.websocket_connect(
            f"/v1/sessions/{sid}/control", headers=_bearer(person["token"])
        ) as control,
    ):
        assert control.receive_json() == {"event": "hello", "holder": None}
        # Before the take-over the person cannot act.
        reply = ask(control, {"id": 1, "action": "click", "x": 5, "y": 5})
        assert reply["error"]["code"] == "not_in_control"
        reply = ask(control, {"id": 2, "op": "take_over"})
        assert reply["ok"] and reply["result"]["holder"]["holder"] == f"token:{person['token_id']}"
        status = client.get(f"/v1/sessions/{sid}/control").json()
        assert status["holder"]["holder"] == f"token:{person['token_id']}"
        assert status["policy"] == {"agent": "refuse", "wait_timeout_s": 600.0}
        assert client.get(f"/v1/sessions/{sid}").json()["control"]["holder"].startswith("token:")

        # The agent's input is refused with a clear code; observing still works.
        clicks_before = sum(isinstance(e, ButtonEvent) for e in display.events)
        reply = ask(agent, {"id": 3, "action": "click", "x": 10, "y": 10})
        assert reply["error"]["code"] == "human_in_control"
        assert "has taken over" in reply["error"]["message"]
        assert ask(agent, {"id": 4, "action": "screenshot"})["ok"]
        assert sum(isinstance(e, ButtonEvent) for e in display.events) == clicks_before

        # The person's input reaches the guest, recorded as human with the token id.
        assert ask(control, {"id": 5, "action": "click", "x": 30, "y": 40})["ok"]
        assert display.pointer == (30, 40)
        assert sum(isinstance(e, ButtonEvent) for e in display.events) == clicks_before + 2
        assert ask(control, {"id": 6, "action": "cursor_position"})["result"] == {"x": 30, "y": 40}

        assert ask(control, {"id": 7, "op": "hand_back"})["result"] == {"holder": None}
        assert ask(agent, {"id": 8, "action": "click", "x": 10, "y": 10})["ok"]
    recording = Recording(client.app.state.bridge.manager.get(sid).recorder.path)  # type: ignore[attr-defined]
    inputs = [e for e in recording.events if e["kind"] == "input"]
    human = [e for e in inputs if e["source"] == "human"]
    assert [e["data"]["action"]["action"] for e in human] == ["click", "cursor_position"]
    assert all(e["data"]["by"] == f"token:{person['token_id']}" for e in human)
    assert all("by" not in e["data"] for e in inputs if e["source"] == "agent")
    assert [(m["data"]["event"], m["source"]) for m in _markers(client, sid)] == [
        ("take_over", "human"), ("hand_back", "human"),
    ]  # fmt: skip


def test_wait_policy_runs_the_agents_action_after_the_hand_back(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = create_session(client, takeover={"agent": "wait", "wait_timeout_s": 30})["id"]
    replies: list[dict[str, Any]] = []
    with client.websocket_connect(f"/v1/sessions/{sid}/control") as control:
        control.receive_json()
        assert ask(control, {"id": 1, "op": "take_over"})["ok"]

        def agent() -> None:
            with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
                replies.append(ask(ws, {"id": 1, "action": "move", "x": 77, "y": 88}))

        thread = threading.Thread(target=agent)
        thread.start()
        time.sleep(0.5)
        assert replies == []  # held
        assert ask(control, {"id": 2, "action": "move", "x": 5, "y": 5})["ok"]
        assert hypervisor.domains[sid].display.pointer == (5, 5)
        assert ask(control, {"id": 3, "op": "hand_back"})["ok"]
        thread.join(timeout=10)
    assert replies and replies[0]["ok"]
    assert hypervisor.domains[sid].display.pointer == (77, 88)  # ran after the person's move


def test_closing_the_control_socket_hands_back(client: TestClient) -> None:
    sid = create_session(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/control") as control:
        control.receive_json()
        ask(control, {"id": 1, "op": "take_over"})
    deadline = time.monotonic() + 5
    while client.get(f"/v1/sessions/{sid}/control").json()["holder"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    reason = [m["data"].get("reason") for m in _markers(client, sid)]
    assert reason == [None, "disconnected"]


def test_one_holder_at_a_time_and_scopes(client: TestClient) -> None:
    sid = create_session(client)["id"]
    viewer = _token(client, sid, "view")
    with (
        pytest.raises(WebSocketDisconnect),
        client.websocket_connect(
            f"/v1/sessions/{sid}/control", headers=_bearer(viewer["token"])
        ) as ws,
    ):
        ws.receive_json()
    with (
        client.websocket_connect(f"/v1/sessions/{sid}/control") as first,
        client.websocket_connect(f"/v1/sessions/{sid}/control") as second,
    ):
        first.receive_json(), second.receive_json()
        assert ask(first, {"id": 1, "op": "take_over"})["ok"]
        assert ask(first, {"id": 2, "op": "take_over"})["ok"]  # idempotent
        reply = ask(second, {"id": 1, "op": "take_over"})
        error = reply["error"]
        assert error["code"] == "control_held" and "admin holds" in error["message"]
        assert ask(second, {"id": 2, "op": "hand_back"})["error"]["code"] == "not_in_control"
        assert ask(second, {"id": 3, "op": "fly"})["error"]["code"] == "unknown_action"
        reply = ask(second, {"id": 4, "op": "take_over", "x": 1})
        assert reply["error"]["code"] == "invalid_message"


def test_the_stream_reports_the_take_over(client: TestClient) -> None:
    sid = create_session(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/stream") as stream:
        assert stream.receive_json()["event"] == "hello"

        def next_status() -> dict[str, Any]:
            while True:
                message = stream.receive()
                if message.get("text"):
                    event = json.loads(message["text"])
                    if event["event"] == "status":
                        return event  # type: ignore[no-any-return]

        assert next_status()["control"] is None
        with client.websocket_connect(f"/v1/sessions/{sid}/control") as control:
            control.receive_json()
            ask(control, {"id": 1, "op": "take_over"})
            assert next_status()["control"]["holder"] == "admin"
        assert next_status()["control"] is None


def test_deleting_the_session_releases_a_waiting_agent(client: TestClient) -> None:
    sid = create_session(client, takeover={"agent": "wait"})["id"]
    replies: list[dict[str, Any]] = []
    with client.websocket_connect(f"/v1/sessions/{sid}/control") as control:
        control.receive_json()
        ask(control, {"id": 1, "op": "take_over"})

        def agent() -> None:
            with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
                replies.append(ask(ws, {"id": 1, "action": "key", "keys": "a"}))

        thread = threading.Thread(target=agent)
        thread.start()
        time.sleep(0.3)
        client.delete(f"/v1/sessions/{sid}")
        thread.join(timeout=10)
    # Released, and refused: the session has ended (nothing was typed).
    assert replies and replies[0]["error"]["code"] in ("session_closed", "human_in_control")


def test_takeover_policy_is_validated(client: TestClient) -> None:
    response = client.post("/v1/sessions", json={"takeover": {"agent": "ignore"}})
    assert response.status_code == 422 and "takeover.agent" in response.json()["error"]["message"]


def test_revoking_the_holders_token_ends_the_take_over(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = create_session(client)["id"]
    person = _token(client, sid, "control")
    display = hypervisor.domains[sid].display
    with client.websocket_connect(
        f"/v1/sessions/{sid}/control", headers=_bearer(person["token"])
    ) as control:
        control.receive_json()
        assert ask(control, {"id": 1, "op": "take_over"})["ok"]
        response = client.delete(f"/v1/sessions/{sid}/tokens/{person['token_id']}")
        assert response.status_code == 204
        clicks_before = sum(isinstance(e, ButtonEvent) for e in display.events)
        # The revoked person's input no longer reaches the guest; the socket closes (1008).
        control.send_text(json.dumps({"id": 2, "action": "click", "x": 5, "y": 5}))
        reply = control.receive_json()
        assert reply["ok"] is False and reply["error"]["code"] == "unauthorized"
        with pytest.raises(WebSocketDisconnect) as closed:
            control.receive_json()
        assert closed.value.code == 1008
    assert sum(isinstance(e, ButtonEvent) for e in display.events) == clicks_before
    deadline = time.monotonic() + 5
    while client.get(f"/v1/sessions/{sid}/control").json()["holder"] is not None:
        assert time.monotonic() < deadline, "the revoked person still holds the session"
        time.sleep(0.05)


def test_take_over_withdraws_an_agent_action_waiting_for_approval(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = create_session(client, approval={"text_patterns": ["rm "], "timeout_s": 30})["id"]
    display = hypervisor.domains[sid].display
    with (
        client.websocket_connect(f"/v1/sessions/{sid}/ws") as agent,
        client.websocket_connect(f"/v1/sessions/{sid}/control") as control,
    ):
        control.receive_json()
        agent.send_text(json.dumps({"id": 1, "action": "type", "text": "rm -r x\n"}))
        deadline = time.monotonic() + 5
        while not client.get(f"/v1/sessions/{sid}/pending").json():
            assert time.monotonic() < deadline, "the agent's type was not held"
            time.sleep(0.02)
        assert ask(control, {"id": 1, "op": "take_over"})["ok"]
        # The held action is withdrawn at once: the person's input does not queue behind
        # it, and an approval can no longer slip the agent's text in during the take-over.
        deadline = time.monotonic() + 5
        while client.get(f"/v1/sessions/{sid}/pending").json():
            assert time.monotonic() < deadline, "the held action still waits during a take-over"
            time.sleep(0.02)
        reply = agent.receive_json()
        assert reply["ok"] is False and reply["error"]["code"] == "human_in_control"
        assert not any(isinstance(e, KeyEvent) for e in display.events)
        assert ask(control, {"id": 2, "action": "click", "x": 5, "y": 5})["ok"]
        assert ask(control, {"id": 3, "op": "hand_back"})["ok"]
    recording = Recording(client.app.state.bridge.manager.get(sid).recorder.path)  # type: ignore[attr-defined]
    decided = [e["data"] for e in recording.events
               if e["kind"] == "approval" and e["data"]["event"] == "decided"]  # fmt: skip
    assert [(d["decision"], d["by"]) for d in decided] == [("deny", "take_over")]
