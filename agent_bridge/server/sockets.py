"""What every bridge WebSocket shares: limits, close codes, the subprotocol, handshake auth.

Credentials are checked before ``accept()``: a refused handshake is answered with HTTP 403
by the ASGI server. They come from the ``Authorization: Bearer`` header or, for browsers
(which cannot set headers), from an offered subprotocol ``deskvm.bearer.<token>`` or the
page's sign-in cookie (:mod:`agent_bridge.cookies`); never from the URL. A
cross-site ``Origin`` not in ``settings.allowed_origins`` is refused too.
"""

from __future__ import annotations

import contextlib
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from agent_bridge.protocol.messages import encode_error
from agent_bridge.server.deps import Principal, authorize, cookie_principal
from agent_bridge.server.state import BridgeState
from agent_bridge.tokens import Scope, TokenError
from orchestrator.errors import DeskvmError, SessionClosed, SessionNotFound
from orchestrator.session import Session

__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_SESSION_NOT_FOUND",
    "CLOSE_TRY_AGAIN_LATER",
    "MAX_MESSAGE_BYTES",
    "SUBPROTOCOL",
    "SUBPROTOCOL_BEARER_PREFIX",
    "bearer_from_header",
    "close_reason",
    "offered_subprotocols",
    "ready_session",
    "refuse",
    "revoked_error",
    "ws_principal",
]

log = logging.getLogger("deskvm.bridge")

MAX_MESSAGE_BYTES = 1024 * 1024
"""Largest WebSocket message the server accepts (bytes of UTF-8); larger closes with 1009."""

SUBPROTOCOL = "deskvm.v1"
"""The WebSocket subprotocol (RFC 6455 section 1.9) echoed when the client offers it."""

SUBPROTOCOL_BEARER_PREFIX = "deskvm.bearer."
"""Browsers, which cannot set headers, offer ``deskvm.bearer.<token>`` as a subprotocol."""

# WebSocket close codes (RFC 6455 section 7.4.1; 4000-4999 are private use).
CLOSE_GOING_AWAY = 1001
"""The session ended (deleted, failed, server shutting down)."""
CLOSE_POLICY_VIOLATION = 1008
"""Bad credentials (sent before the handshake completes: HTTP 403), unknown ``schema`` or
``on_disconnect`` value."""
CLOSE_MESSAGE_TOO_BIG = 1009
"""A message larger than :data:`MAX_MESSAGE_BYTES`."""
CLOSE_TRY_AGAIN_LATER = 1013
"""The session is still booting."""
CLOSE_SESSION_NOT_FOUND = 4404
"""No session with that id."""

_CLOSE_REASON_MAX_BYTES = 123  # RFC 6455 section 5.5: control frame payload <= 125 bytes


def close_reason(text: str) -> str:
    """``text`` cut to what fits a close frame (123 bytes): at a word boundary, whole UTF-8
    characters only, the cut marked with an ellipsis."""
    data = text.encode("utf-8")
    if len(data) <= _CLOSE_REASON_MAX_BYTES:
        return text
    # Cut at a word boundary and mark the cut (the reply before the close has it all).
    cut = data[: _CLOSE_REASON_MAX_BYTES - 3].decode("utf-8", errors="ignore")
    head, space, _ = cut.rpartition(" ")
    return (head if space and len(head) > len(cut) // 2 else cut) + "…"


def offered_subprotocols(websocket: WebSocket) -> list[str]:
    """The subprotocols the client offered (``Sec-WebSocket-Protocol``), in order."""
    header = websocket.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in header.split(",") if p.strip()]


def bearer_from_header(value: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header value, if any."""
    if value is None:
        return None
    scheme, _, credentials = value.partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


async def ws_principal(
    websocket: WebSocket, bridge: BridgeState, session_id: str, need: Scope
) -> Principal | None:
    """Check Origin and credentials before ``accept()``; refuse (HTTP 403) if bad.

    Returns:
        The principal, or ``None`` when the handshake was refused (nothing more to do).
    """
    origin = websocket.headers.get("origin")
    host = websocket.headers.get("host", "")
    same_origin = origin in (f"http://{host}", f"https://{host}")
    if origin is not None and not same_origin and origin not in bridge.settings.allowed_origins:
        log.warning("refused a WebSocket from origin %r (not in the allowlist)", origin)
        await websocket.close(CLOSE_POLICY_VIOLATION, reason="origin not allowed")
        return None
    offered = offered_subprotocols(websocket)
    presented = bearer_from_header(websocket.headers.get("authorization"))
    if presented is None:
        presented = next(
            (
                p.removeprefix(SUBPROTOCOL_BEARER_PREFIX)
                for p in offered
                if p.startswith(SUBPROTOCOL_BEARER_PREFIX)
            ),
            None,
        )
    try:
        if presented is None and "authorization" not in websocket.headers:
            principal = cookie_principal(websocket, bridge, session_id, need)
            if principal is not None:
                return principal
        return authorize(
            presented, bridge.admin_token, bridge.authority, session_id, need, use=True
        )
    except TokenError as exc:
        log.info("refused a WebSocket for session %s: %s", session_id, exc.code)
        # Before accept(): the ASGI server answers the handshake with HTTP 403.
        await websocket.close(CLOSE_POLICY_VIOLATION, reason=exc.code)
        return None


def revoked_error(bridge: BridgeState, principal: Principal) -> TokenError | None:
    """The error for a connection whose session token has been revoked since it opened
    (also through a sign-in cookie exchanged from it), else ``None``.

    Sockets check it on every message and every status poll: revoking a token ends what
    it had opened (close 1008 after this error), not only its next handshake.
    """
    kind, _, token_id = principal.who.partition(":")
    if kind == "token" and bridge.authority.revoked(token_id):
        return TokenError(f"token {token_id} was revoked")
    return None


async def refuse(websocket: WebSocket, error: DeskvmError, close_code: int) -> None:
    """After ``accept()``: send one error reply (``id`` null) saying why, then close."""
    with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
        await websocket.send_text(encode_error(None, error))
        if websocket.application_state != WebSocketState.DISCONNECTED:
            await websocket.close(close_code, reason=close_reason(f"{error.code}: {error.message}"))


async def ready_session(
    websocket: WebSocket, bridge: BridgeState, session_id: str
) -> Session | None:
    """The session, once ready; otherwise refuse the (accepted) socket and return ``None``.

    Refusals: 4404 ``session_not_found``, 1013 ``session_not_ready`` (booting: retry),
    1001 ``session_closed`` (ended).
    """
    try:
        session = bridge.manager.get(session_id)
    except SessionNotFound as exc:
        await refuse(websocket, exc, CLOSE_SESSION_NOT_FOUND)
        return None
    if session.state == "ready":
        return session
    if session.state in ("new", "starting"):
        await refuse(
            websocket,
            SessionClosed(
                f"session {session.id} is {session.state}; retry when ready",
                code="session_not_ready",
            ),
            CLOSE_TRY_AGAIN_LATER,
        )
    else:
        await refuse(websocket, SessionClosed(f"session {session.id} is {session.state}"),
                     CLOSE_GOING_AWAY)  # fmt: skip
    return None
