"""Shared FastAPI dependencies: the app's state, who is asking, and the session asked about.

- :data:`Bridge` — the app's :class:`~agent_bridge.server.state.BridgeState`.
- :data:`server_token` — ``dependencies=[server_token]`` on routes that need the server's
  admin token itself (create/list sessions, recordings).
- :data:`ViewPrincipal`, :data:`ControlPrincipal`, :data:`ExecPrincipal`,
  :data:`AdminPrincipal` — routes under ``/v1/sessions/{session_id}``: the admin token, or a
  session token *for that session* with at least that scope
  (``Depends(SessionGuard(scope))`` when the principal itself is unused).
- :data:`SessionDep` — the session named by the ``session_id`` path parameter (404
  ``session_not_found``). Declare it after the principal so credentials are checked first.
- :data:`BaseUrl` — the server's base URL as the client reached it.
- :data:`known_query_only` — on the app: a query parameter the route does not declare is
  refused (422 ``invalid_query``, naming it), so a typo such as ``?ofset=`` never silently
  falls back to a default. WebSocket routes check theirs with :func:`unknown_query`.

Credentials come from the ``Authorization`` header or, for pages in a browser, from the
sign-in cookies of :mod:`agent_bridge.cookies` (used only when no header is sent);
never from the URL.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection

from agent_bridge.cookies import (
    CSRF_HEADER,
    CSRF_VALUE,
    SERVER_COOKIE,
    session_cookie_name,
)
from agent_bridge.server.state import BridgeState
from agent_bridge.tokens import Claims, Scope, TokenAuthority, TokenError, scope_allows
from orchestrator.errors import ProtocolError
from orchestrator.session import Session

__all__ = [
    "ADMIN",
    "AdminPrincipal",
    "BaseUrl",
    "Bridge",
    "ControlPrincipal",
    "ExecPrincipal",
    "Principal",
    "SessionDep",
    "SessionGuard",
    "ViewPrincipal",
    "authorize",
    "cookie_principal",
    "get_bridge",
    "known_query_only",
    "recording_access",
    "server_token",
    "token_ok",
    "unknown_query",
]

_BEARER = HTTPBearer(auto_error=False, description="the server's token (see `deskvm serve`)")


def get_bridge(connection: HTTPConnection) -> BridgeState:
    """The app's state (``app.state.bridge``); works for HTTP and WebSocket routes."""
    state: BridgeState = connection.app.state.bridge
    return state


Bridge = Annotated[BridgeState, Depends(get_bridge)]


def _base_url(request: Request) -> str:
    return str(request.base_url)


BaseUrl = Annotated[str, Depends(_base_url)]


def token_ok(offered: str | None, token: str) -> bool:
    """Constant-time comparison of a presented credential with ``token``."""
    if offered is None:
        return False
    return hmac.compare_digest(offered.encode("utf-8"), token.encode("utf-8"))


async def _require_server_token(
    request: Request,
    bridge: Bridge,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> None:
    """The request must carry ``Authorization: Bearer <the server's token>``.

    Raises: ``HTTPException`` 401 ``unauthorized`` (with ``WWW-Authenticate``).
    """
    offered = None if credentials is None else credentials.credentials
    if token_ok(offered, bridge.admin_token):
        return
    if offered is None and SERVER_COOKIE in request.cookies:
        principal = cookie_principal(request, bridge, "*", "admin")
        if principal is not None:
            return
    hint = "send 'Authorization: Bearer <token>'"
    if any(k in request.query_params for k in ("token", "access_token")):
        hint += "; tokens in the URL are never accepted"
    raise StarletteHTTPException(
        401,
        detail=f"missing or wrong bearer token: {hint}",
        headers={"WWW-Authenticate": "Bearer"},
    )


server_token = Depends(_require_server_token)
"""Route dependency: the server's admin token (``dependencies=[server_token]``)."""


async def _require_recording_access(
    request: Request,
    name: str,
    bridge: Bridge,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> None:
    """One recording (``{name}`` = its session id): the admin token or server cookie, or a
    ``view`` credential (token or cookie) of that session.

    Raises: TokenError: 401 ``unauthorized``, 403 ``forbidden``.
    """
    offered = None if credentials is None else credentials.credentials
    if token_ok(offered, bridge.admin_token):
        return
    if offered is None and "authorization" not in request.headers:
        if cookie_principal(request, bridge, name, "view") is not None:
            return
        raise TokenError("missing bearer token: send 'Authorization: Bearer <token>'")
    authorize(offered, bridge.admin_token, bridge.authority, name, "view")


recording_access = Depends(_require_recording_access)
"""Route dependency of one recording's routes (``/replay/{name}/...``)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a request: the server's admin token or a scoped session token.

    Attributes:
        who: ``"admin"`` or ``"token:<token_id>"`` (safe to log and record).
        scope: what it may do.
        claims: the verified session token; ``None`` for the admin token.
    """

    who: str
    scope: Scope
    claims: Claims | None


ADMIN = Principal("admin", "admin", None)
"""The server's admin token as a principal."""


def authorize(
    offered: str | None,
    admin_token: str,
    authority: TokenAuthority,
    session_id: str,
    need: Scope,
    *,
    use: bool = False,
) -> Principal:
    """The principal behind ``offered`` for a request on ``session_id`` needing ``need``.

    Args:
        use: consume a single-use token (WebSocket connections).

    Raises:
        TokenError: ``unauthorized`` or ``forbidden``.
    """
    if offered is None:
        raise TokenError("missing bearer token: send 'Authorization: Bearer <token>'")
    if token_ok(offered, admin_token):
        return ADMIN
    claims = authority.verify(offered, session_id=session_id, need=need, use=use)
    return Principal(f"token:{claims.token_id}", claims.scope, claims)


def cookie_principal(
    connection: HTTPConnection, bridge: BridgeState, session_id: str, need: Scope
) -> Principal | None:
    """The principal of the request's sign-in cookie for ``session_id`` (``"*"``: the
    server cookie only), or ``None`` when it sends no such cookie.

    The server cookie (admin) counts for every session. A cookie-authenticated HTTP
    request that is not GET/HEAD must carry ``X-Requested-With: deskvm``.

    Raises:
        TokenError: ``unauthorized`` (bad cookie), ``forbidden`` (scope too small, or the
            anti-forgery header is missing).
    """
    cookies = connection.cookies
    name = session_cookie_name(session_id)
    if session_id != "*" and name in cookies:
        claims = bridge.cookies.verify(cookies[name], session_id)
    elif SERVER_COOKIE in cookies:
        claims = bridge.cookies.verify(cookies[SERVER_COOKIE], "*")
    else:
        return None
    method = connection.scope.get("method")
    unsafe = method is not None and method not in ("GET", "HEAD")
    if unsafe and connection.headers.get(CSRF_HEADER, "").lower() != CSRF_VALUE:
        raise TokenError(
            f"a request signed in by cookie must send the header 'X-Requested-With: {CSRF_VALUE}'",
            code="forbidden",
        )
    if not scope_allows(claims.scope, need):
        raise TokenError(
            f"this sign-in has scope {claims.scope!r}; this needs {need!r}", code="forbidden"
        )
    return Principal(claims.who, claims.scope, None)


class SessionGuard:
    """Dependency for ``/v1/sessions/{session_id}/...``: the admin token, or a session
    token for that session with at least scope ``need``. Tokens in the URL are never read.
    """

    def __init__(self, need: Scope) -> None:
        self._need = need

    async def __call__(
        self,
        request: Request,
        session_id: str,
        bridge: Bridge,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> Principal:
        """Raises: TokenError: 401 ``unauthorized``, 403 ``forbidden``."""
        offered = None if credentials is None else credentials.credentials
        if offered is None and "authorization" not in request.headers:
            principal = cookie_principal(request, bridge, session_id, self._need)
            if principal is not None:
                return principal
        return authorize(offered, bridge.admin_token, bridge.authority, session_id, self._need)


ViewPrincipal = Annotated[Principal, Depends(SessionGuard("view"))]
ControlPrincipal = Annotated[Principal, Depends(SessionGuard("control"))]
ExecPrincipal = Annotated[Principal, Depends(SessionGuard("exec"))]
AdminPrincipal = Annotated[Principal, Depends(SessionGuard("admin"))]


def _lookup_session(session_id: str, bridge: Bridge) -> Session:
    """Raises: SessionNotFound: 404 ``session_not_found``."""
    return bridge.manager.get(session_id)


SessionDep = Annotated[Session, Depends(_lookup_session)]


def _declared_query(dependant: Any) -> set[str]:
    names = {str(p.alias) for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _declared_query(sub)
    return names


def unknown_query(given: Iterable[str], allowed: Iterable[str]) -> ProtocolError | None:
    """The error for query parameters outside ``allowed`` (``None`` when all are known).

    The message names the unknown ones and lists what the endpoint takes; a ``token`` or
    ``access_token`` gets the reason it is never read.
    """
    allowed = set(allowed)
    unknown = sorted(set(given) - allowed)
    if not unknown:
        return None
    takes = ", ".join(sorted(allowed)) if allowed else "none"
    message = (
        f"unknown query parameter{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(repr(u) for u in unknown)}; this endpoint takes: {takes}"
    )
    if {"token", "access_token"} & set(unknown):
        message += " (tokens in the URL are never read: send 'Authorization: Bearer <token>')"
    return ProtocolError(message, code="invalid_query")


async def _known_query_only(connection: HTTPConnection) -> None:
    """Raises: ProtocolError: 422 ``invalid_query`` for an undeclared query parameter."""
    if connection.scope.get("type") != "http":
        return  # WebSocket routes answer in their own protocol (see unknown_query)
    route = connection.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    error = unknown_query(connection.query_params.keys(), _declared_query(dependant))
    if error is None:
        return
    if "authorization" not in connection.headers and _needs_credentials(dependant):
        return  # credentials first: the route's own dependency answers 401
    raise error


def _needs_credentials(dependant: Any) -> bool:
    call = getattr(dependant, "call", None)
    if call is _require_server_token or isinstance(call, SessionGuard):
        return True
    return any(_needs_credentials(sub) for sub in dependant.dependencies)


known_query_only = Depends(_known_query_only)
"""App dependency: refuse query parameters the route does not declare."""
