"""Browser sign-in: a bearer token exchanged for a short HttpOnly cookie (no token in URLs)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from conftest import AUTH, TOKEN, create_session
from fastapi import FastAPI
from fastapi.testclient import TestClient
from websockets.sync.client import connect

CSRF = {"X-Requested-With": "deskvm"}


def _mint(client: TestClient, sid: str, scope: str, **extra: Any) -> dict[str, Any]:
    response = client.post(f"/v1/sessions/{sid}/tokens", json={"scope": scope, **extra})
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def test_a_token_becomes_a_session_bound_httponly_cookie(client: TestClient, app: FastAPI) -> None:
    sid = create_session(client)["id"]
    other = create_session(client)["id"]
    view = _mint(client, sid, "view")
    with TestClient(app) as browser:
        response = browser.post(
            f"/v1/sessions/{sid}/cookie", headers={"Authorization": f"Bearer {view['token']}"}
        )
        assert response.status_code == 200, response.text
        info = response.json()
        assert (info["session_id"], info["scope"], info["who"]) == (
            sid, "view", f"token:{view['token_id']}",
        )  # fmt: skip
        set_cookie = response.headers["set-cookie"]
        assert set_cookie.startswith(f"deskvm_s_{sid}=")
        for attribute in ("HttpOnly", "SameSite=strict", "Path=/", "Max-Age="):
            assert attribute.lower() in set_cookie.lower()
        assert view["token"] not in set_cookie  # a new credential, not the token
        # The cookie alone now reads the session (and nothing else).
        assert browser.get(f"/v1/sessions/{sid}").status_code == 200
        assert browser.get(f"/v1/sessions/{sid}/cookie").json()["scope"] == "view"
        assert browser.get(f"/v1/sessions/{other}").status_code == 401
        assert browser.get("/v1/sessions").status_code == 401
        # Its scope is the token's: a view sign-in cannot delete.
        denied = browser.delete(f"/v1/sessions/{sid}", headers=CSRF)
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "forbidden"
        # Revoking the token ends the cookie too.
        client.delete(f"/v1/sessions/{sid}/tokens/{view['token_id']}")
        assert browser.get(f"/v1/sessions/{sid}").status_code == 401


def test_cookie_writes_need_the_anti_forgery_header(client: TestClient, app: FastAPI) -> None:
    sid = create_session(client)["id"]
    with TestClient(app) as browser:
        browser.post(f"/v1/sessions/{sid}/cookie", headers=AUTH)  # the admin token: admin scope
        body = {"every_action": True}
        refused = browser.put(f"/v1/sessions/{sid}/approval-policy", json=body)
        assert refused.status_code == 403
        assert "X-Requested-With" in refused.json()["error"]["message"]
        done = browser.put(f"/v1/sessions/{sid}/approval-policy", json=body, headers=CSRF)
        assert done.status_code == 200
        # Renewal with the cookie itself, then sign-out.
        assert browser.post(f"/v1/sessions/{sid}/cookie").status_code == 403
        assert browser.post(f"/v1/sessions/{sid}/cookie", headers=CSRF).status_code == 200
        assert browser.delete(f"/v1/sessions/{sid}/cookie").status_code == 204
        assert browser.get(f"/v1/sessions/{sid}").status_code == 401


def test_single_use_tokens_are_used_up_by_the_exchange(client: TestClient, app: FastAPI) -> None:
    sid = create_session(client)["id"]
    link = _mint(client, sid, "control", single_use=True)
    headers = {"Authorization": f"Bearer {link['token']}"}
    with TestClient(app) as browser:
        assert browser.post(f"/v1/sessions/{sid}/cookie", headers=headers).status_code == 200
        again = browser.post(f"/v1/sessions/{sid}/cookie", headers=headers)
        assert again.status_code == 401 and "already used" in again.json()["error"]["message"]
        assert browser.get(f"/v1/sessions/{sid}").status_code == 200  # the cookie works


def test_the_server_cookie_needs_the_admin_token(client: TestClient, app: FastAPI) -> None:
    sid = create_session(client)["id"]
    token = _mint(client, sid, "admin")["token"]
    with TestClient(app) as browser:
        session_admin = {"Authorization": f"Bearer {token}"}
        assert browser.post("/v1/cookie", headers=session_admin).status_code == 401
        assert browser.post("/v1/cookie", headers=AUTH).status_code == 200
        assert [s["id"] for s in browser.get("/v1/sessions").json()] == [sid]
        assert browser.get("/replay/index.json").status_code == 200
        assert browser.get(f"/v1/sessions/{sid}/pending").status_code == 200  # admin everywhere
        assert browser.delete("/v1/cookie").status_code == 204
        assert browser.get("/v1/sessions").status_code == 401


def test_tokens_in_urls_are_still_refused(anon: TestClient, client: TestClient) -> None:
    sid = create_session(client)["id"]
    response = anon.post(f"/v1/sessions/{sid}/cookie?token={TOKEN}")
    assert response.status_code == 422 and "'token'" in response.json()["error"]["message"]
    assert anon.get(f"/v1/sessions/{sid}/cookie").status_code == 401  # nothing was set


def test_websockets_sign_in_by_cookie(server_url: str) -> None:
    sid = httpx.post(f"{server_url}/v1/sessions", json={}, headers=AUTH, timeout=30).json()["id"]
    control = httpx.post(
        f"{server_url}/v1/sessions/{sid}/tokens", json={"scope": "control"}, headers=AUTH
    ).json()
    exchanged = httpx.post(
        f"{server_url}/v1/sessions/{sid}/cookie",
        headers={"Authorization": f"Bearer {control['token']}"},
    )
    cookie = f"deskvm_s_{sid}={exchanged.cookies[f'deskvm_s_{sid}']}"
    ws_url = server_url.replace("http://", "ws://")
    origin = {"Origin": server_url, "Cookie": cookie}
    with connect(f"{ws_url}/v1/sessions/{sid}/stream", additional_headers=origin) as ws:
        assert json.loads(ws.recv(timeout=10))["event"] == "hello"
    with connect(f"{ws_url}/v1/sessions/{sid}/control", additional_headers=origin) as ws:
        json.loads(ws.recv(timeout=10))
        ws.send(json.dumps({"id": 1, "op": "take_over"}))
        reply = json.loads(ws.recv(timeout=10))
        assert reply["result"]["holder"]["holder"] == f"token:{control['token_id']}"
    httpx.delete(f"{server_url}/v1/sessions/{sid}", headers=AUTH, timeout=30)


def test_unknown_query_parameters_are_refused_by_name(client: TestClient) -> None:
    sid = create_session(client)["id"]
    response = client.post(f"/v1/sessions/{sid}/cookie?remember=1", headers=AUTH)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_query" and "'remember'" in error["message"]
    response = client.get(f"/v1/sessions/{sid}/control?verbose=1&x=2")
    assert "'verbose', 'x'" in response.json()["error"]["message"]
    with client.websocket_connect(f"/v1/sessions/{sid}/control?as=human") as ws:
        reply = ws.receive_json()
        assert reply["error"]["code"] == "invalid_query" and "'as'" in reply["error"]["message"]
