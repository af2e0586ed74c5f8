"""Browser sign-in: a bearer token exchanged for a short ``HttpOnly`` cookie.

- ``POST /v1/sessions/{id}/cookie`` with ``Authorization: Bearer <token>`` (the admin token
  or a token of that session, any scope; a single-use token is used up by it) sets the
  session's cookie; with the cookie itself (and ``X-Requested-With: deskvm``) it renews it.
  ``GET`` says who the cookie signs in, ``DELETE`` signs out.
- ``POST /v1/cookie`` (the server's admin token) sets the server cookie used by the
  session list and the recordings; ``GET``/``DELETE`` as above.

See :mod:`agent_bridge.cookies` for the cookie itself.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from agent_bridge.cookies import (
    CSRF_HEADER,
    CSRF_VALUE,
    SERVER_COOKIE,
    CookieClaims,
    session_cookie_name,
)
from agent_bridge.server.deps import Bridge, authorize, token_ok
from agent_bridge.server.errors import ERROR_RESPONSES
from agent_bridge.server.sockets import bearer_from_header
from agent_bridge.server.state import BridgeState
from agent_bridge.tokens import TokenError

__all__ = ["router"]

router = APIRouter(tags=["sign-in"], responses=ERROR_RESPONSES)


class CookieInfo(BaseModel):
    """Who a sign-in cookie signs in."""

    session_id: str = Field(description='the session; "*" for the server cookie')
    scope: Literal["view", "control", "exec", "admin"]
    who: str = Field(description="admin or token:<id> (what the recording names)")
    expires_at: datetime = Field(description="UTC; renew before (POST with the cookie)")


def _info(claims: CookieClaims) -> CookieInfo:
    return CookieInfo(
        session_id=claims.session_id,
        scope=claims.scope,
        who=claims.who,
        expires_at=datetime.fromtimestamp(claims.expires_at, UTC),
    )


def _set(response: Response, request: Request, name: str, value: str, claims: CookieClaims,
         bridge: BridgeState) -> None:  # fmt: skip
    max_age = max(1, int(bridge.cookies.seconds_left(claims)))
    response.set_cookie(
        name, value, max_age=max_age, path="/", httponly=True, samesite="strict",
        secure=request.url.scheme == "https",
    )  # fmt: skip


def _from_cookie(request: Request, bridge: BridgeState, name: str, session_id: str) -> CookieClaims:
    value = request.cookies.get(name)
    if value is None:
        raise TokenError(
            "not signed in: send 'Authorization: Bearer <token>' to sign in (never in the URL)"
        )
    return bridge.cookies.verify(value, session_id)


def _check_csrf(request: Request) -> None:
    if request.headers.get(CSRF_HEADER, "").lower() != CSRF_VALUE:
        raise TokenError(
            f"renewing a sign-in by cookie needs the header 'X-Requested-With: {CSRF_VALUE}'",
            code="forbidden",
        )


@router.post("/v1/sessions/{session_id}/cookie", response_model=CookieInfo)
async def sign_in(
    session_id: str, request: Request, response: Response, bridge: Bridge
) -> CookieInfo:
    """Exchange a bearer token for the session's cookie, or renew the cookie."""
    bridge.manager.get(session_id)
    name = session_cookie_name(session_id)
    offered = bearer_from_header(request.headers.get("authorization"))
    if offered is not None:
        principal = authorize(
            offered, bridge.admin_token, bridge.authority, session_id, "view", use=True
        )
        claims = principal.claims
        value, signed = bridge.cookies.sign(
            session_id,
            principal.scope,
            principal.who,
            None if claims is None else claims.token_id,
            not_after=None if claims is None else claims.expires_at,
        )
    else:
        old = _from_cookie(request, bridge, name, session_id)
        _check_csrf(request)
        value, signed = bridge.cookies.sign(session_id, old.scope, old.who, old.token_id)
    _set(response, request, name, value, signed, bridge)
    return _info(signed)


@router.get("/v1/sessions/{session_id}/cookie", response_model=CookieInfo)
async def whoami(session_id: str, request: Request, bridge: Bridge) -> CookieInfo:
    """Who the session's cookie signs in (401 if none or invalid)."""
    return _info(_from_cookie(request, bridge, session_cookie_name(session_id), session_id))


@router.delete("/v1/sessions/{session_id}/cookie", status_code=204)
async def sign_out(session_id: str, request: Request, bridge: Bridge) -> Response:
    """Sign out: the cookie is refused from now on and deleted."""
    name = session_cookie_name(session_id)
    value = request.cookies.get(name)
    if value is not None:
        with contextlib.suppress(TokenError):
            bridge.cookies.revoke(bridge.cookies.verify(value, session_id))
    response = Response(status_code=204)
    response.delete_cookie(name, path="/", httponly=True, samesite="strict")
    return response


@router.post("/v1/cookie", response_model=CookieInfo)
async def server_sign_in(request: Request, response: Response, bridge: Bridge) -> CookieInfo:
    """Exchange the server's admin token for the server cookie, or renew it."""
    offered = bearer_from_header(request.headers.get("authorization"))
    if offered is not None:
        if not token_ok(offered, bridge.admin_token):
            raise TokenError("the server cookie needs the server's admin token")
        value, signed = bridge.cookies.sign("*", "admin", "admin", None)
    else:
        _from_cookie(request, bridge, SERVER_COOKIE, "*")
        _check_csrf(request)
        value, signed = bridge.cookies.sign("*", "admin", "admin", None)
    _set(response, request, SERVER_COOKIE, value, signed, bridge)
    return _info(signed)


@router.get("/v1/cookie", response_model=CookieInfo)
async def server_whoami(request: Request, bridge: Bridge) -> CookieInfo:
    """Whether the server cookie is valid (401 if not)."""
    return _info(_from_cookie(request, bridge, SERVER_COOKIE, "*"))


@router.delete("/v1/cookie", status_code=204)
async def server_sign_out(request: Request, bridge: Bridge) -> Response:
    """Sign out of the server cookie."""
    value = request.cookies.get(SERVER_COOKIE)
    if value is not None:
        with contextlib.suppress(TokenError):
            bridge.cookies.revoke(bridge.cookies.verify(value, "*"))
    response = Response(status_code=204)
    response.delete_cookie(SERVER_COOKIE, path="/", httponly=True, samesite="strict")
    return response
