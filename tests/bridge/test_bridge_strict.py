"""Whatever the API accepts must work (issue 10 section 1): unknown query parameters and
approval rules that can never match are refused, with messages naming them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from agent_bridge.server.routers.actions import WS_QUERY_PARAMS
from orchestrator.approval import ApprovalPolicy
from orchestrator.errors import ConfigError
from tests.bridge.conftest import AUTH, create_session


def test_a_misspelt_query_parameter_is_refused_not_ignored(client: TestClient) -> None:
    """``?ofset=100000`` returned the whole log: now 422 naming the parameter."""
    sid = create_session(client)["id"]
    assert client.get(f"/v1/sessions/{sid}/guest-log", params={"offset": 3}).status_code == 200
    response = client.get(f"/v1/sessions/{sid}/guest-log", params={"ofset": 100000})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_query"
    assert "'ofset'" in error["message"] and "offset" in error["message"]


@pytest.mark.parametrize(
    "path", ["/v1/sessions", "/v1/sessions/{sid}", "/v1/sessions/{sid}/network", "/healthz"]
)
def test_every_rest_endpoint_refuses_unknown_query_parameters(
    client: TestClient, path: str
) -> None:
    sid = create_session(client)["id"]
    response = client.get(path.format(sid=sid), params={"verbose": "1"})
    assert response.status_code == 422, response.text
    assert "'verbose'" in response.json()["error"]["message"]


def test_a_token_in_the_url_is_refused_with_the_reason(client: TestClient) -> None:
    response = client.get("/v1/sessions", params={"token": "x"})
    assert response.status_code == 422
    assert "tokens in the URL are never read" in response.json()["error"]["message"]


def test_credentials_are_checked_before_query_parameters(anon: TestClient) -> None:
    response = anon.get("/v1/sessions", params={"verbose": "1"})
    assert response.status_code == 401
    assert anon.get("/healthz", params={"verbose": "1"}).status_code == 422  # public route
    assert anon.get("/v1/sessions", params={"verbose": "1"}, headers=AUTH).status_code == 422


def test_a_misspelt_websocket_parameter_is_refused(client: TestClient) -> None:
    """``?schem=openai`` silently gave the deskvm vocabulary to an OpenAI agent."""
    sid = create_session(client)["id"]
    with (
        client.websocket_connect(f"/v1/sessions/{sid}/ws?schem=openai") as ws,
        pytest.raises(WebSocketDisconnect) as closed,
    ):
        reply = ws.receive_json()
        assert reply["ok"] is False and reply["error"]["code"] == "invalid_query"
        assert "'schem'" in reply["error"]["message"]
        assert all(name in reply["error"]["message"] for name in WS_QUERY_PARAMS)
        ws.receive_json()
    assert closed.value.code == 1008
    with client.websocket_connect(f"/v1/sessions/{sid}/ws?schema=openai") as ws:
        ws.send_json({"type": "screenshot"})
        assert ws.receive_json()["ok"] is True


@pytest.mark.parametrize(
    ("kinds", "says"),
    [
        (["left_click"], "name 'click'"),  # Anthropic's name
        (["clik"], "click, clipboard_get, clipboard_set, cursor_position"),  # a typo: valid values
        (["keypress"], "name 'key'"),  # OpenAI's name
        (["double_click"], "name 'click'"),  # deskvm vocabulary spelling of a click
    ],
)
def test_an_approval_kind_that_can_never_match_is_refused(
    client: TestClient, kinds: list[str], says: str
) -> None:
    sid = create_session(client)["id"]
    response = client.put(f"/v1/sessions/{sid}/approval-policy", json={"kinds": kinds})
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert says in message and repr(kinds[0]) in message
    # The session's policy is unchanged: nothing is held.
    assert client.get(f"/v1/sessions/{sid}/approval-policy").json()["kinds"] == []
    # The same rule at creation is refused before anything starts.
    response = client.post("/v1/sessions", json={"approval": {"kinds": kinds}})
    assert response.status_code == 422, response.text


def test_include_observations_without_supervised_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="only applies with every_action"):
        ApprovalPolicy(include_observations=True)
    assert ApprovalPolicy(every_action=True, include_observations=True).every_action


def test_valid_kinds_are_accepted(client: TestClient) -> None:
    sid = create_session(client)["id"]
    body = {"kinds": ["click", "type", "drag"], "key_combos": ["ctrl+alt+delete"]}
    response = client.put(f"/v1/sessions/{sid}/approval-policy", json=body)
    assert response.status_code == 200 and response.json()["kinds"] == ["click", "type", "drag"]


def test_a_body_without_a_json_content_type_gets_a_hint(client: TestClient) -> None:
    """``curl -d '{}'`` sends form encoding: the answer says what to send instead."""
    response = client.post(
        "/v1/sessions", content="{}", headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert response.status_code == 422
    assert "Content-Type: application/json" in response.json()["error"]["message"]
    response = client.post(
        "/v1/sessions", content="notjson", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["message"].startswith("the body is not valid JSON")


def test_close_reasons_are_cut_at_a_word_and_marked() -> None:
    from agent_bridge.server.sockets import close_reason

    long = "session ended: " + " ".join(["interrupted"] * 20)
    cut = close_reason(long)
    assert len(cut.encode()) <= 123 and cut.endswith("…")
    assert cut[:-1].split(" ")[-1] == "interrupted"  # no word cut in half
    assert close_reason("bye") == "bye"


def test_a_zoom_region_off_screen_is_reported_as_a_region(client: TestClient) -> None:
    sid = create_session(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        ws.send_json({"id": 1, "action": "zoom", "region": [0, 0, 99999, 10]})
        reply = ws.receive_json()
    assert reply["error"]["code"] == "out_of_screen"
    assert reply["error"]["message"].startswith("zoom region [0, 0, 99999, 10]")
