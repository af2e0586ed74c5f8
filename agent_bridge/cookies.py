"""Browser sign-in without tokens in URLs: a bearer token exchanged for a short cookie.

A page (the live view, the session list) must not carry a token in its URL (URLs end up in
logs, histories and screenshots). Instead the page sends the token once, in an
``Authorization: Bearer`` header, to an exchange endpoint and gets back an ``HttpOnly``,
``SameSite=Strict`` cookie that JavaScript cannot read:

- ``deskvm_s_<session id>``: bound to that session, with the presenting token's scope and
  identity (``admin`` or ``token:<id>``: what the recording names), for
  ``cookie_ttl_s`` seconds but never past the token's own expiry; refused as soon as the
  token is revoked or the session's tokens die;
- ``deskvm_server``: from the server's admin token only, for the session list and the
  recordings.

Cookie values are signed (itsdangerous, HMAC-SHA256, a random key per server process) and
carry ``{"sid", "scope", "who", "tid", "exp", "jti"}``. Requests authenticated by a cookie
that change something (any method but GET/HEAD) must also send ``X-Requested-With:
deskvm``: a cross-site form cannot, and a cross-site script cannot without a CORS preflight
this server never grants. WebSocket handshakes from a browser are held to the Origin
allowlist as before.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from itsdangerous import BadSignature, URLSafeSerializer

from agent_bridge.tokens import SCOPES, Scope, TokenError

__all__ = [
    "CSRF_HEADER",
    "CSRF_VALUE",
    "SERVER_COOKIE",
    "CookieClaims",
    "CookieSigner",
    "session_cookie_name",
]

SERVER_COOKIE = "deskvm_server"
CSRF_HEADER = "x-requested-with"
CSRF_VALUE = "deskvm"
_SALT = "deskvm.cookie"


def session_cookie_name(session_id: str) -> str:
    """The cookie of one session: ``deskvm_s_<session id>``."""
    return f"deskvm_s_{session_id}"


@dataclass(frozen=True, slots=True)
class CookieClaims:
    """What a verified cookie grants.

    Attributes:
        session_id: the session (``"*"``: the server cookie).
        scope: ``view``, ``control`` or ``admin``.
        who: the identity it was exchanged from (``admin`` or ``token:<id>``).
        token_id: the exchanged session token's id (``None`` for the admin token).
        expires_at: Unix time (seconds).
        cookie_id: random id of this cookie (for revocation at sign-out).
    """

    session_id: str
    scope: Scope
    who: str
    token_id: str | None
    expires_at: float
    cookie_id: str


class CookieSigner:
    """Signs and checks cookie values.

    Args:
        ttl_s: a cookie's longest lifetime, seconds.
        token_alive: whether a session token id is still valid (not revoked or expired);
            cookies exchanged from a token die with it.
        clock: Unix time in seconds.
    """

    def __init__(
        self,
        *,
        ttl_s: float = 900.0,
        token_alive: Callable[[str, str], bool] = lambda _sid, _tid: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl_s = ttl_s
        self._serializer = URLSafeSerializer(secrets.token_bytes(32), salt=_SALT)
        self._token_alive = token_alive
        self._clock = clock
        self._revoked: dict[str, float] = {}
        self._lock = threading.Lock()

    def sign(
        self,
        session_id: str,
        scope: Scope,
        who: str,
        token_id: str | None,
        *,
        not_after: float | None = None,
    ) -> tuple[str, CookieClaims]:
        """A new cookie value, valid ``ttl_s`` seconds (never past ``not_after``)."""
        expires = self._clock() + self.ttl_s
        if not_after is not None:
            expires = min(expires, not_after)
        claims = CookieClaims(session_id, scope, who, token_id, expires, secrets.token_hex(8))
        payload: dict[str, Any] = {
            "sid": session_id, "scope": scope, "who": who, "tid": token_id, "exp": expires,
            "jti": claims.cookie_id,
        }  # fmt: skip
        return self._serializer.dumps(payload), claims

    def verify(self, value: str, session_id: str) -> CookieClaims:
        """The claims of a cookie presented for ``session_id`` (``"*"``: server cookie).

        Raises:
            TokenError: ``unauthorized``: forged, expired, revoked, for another session, or
                exchanged from a token that has since been revoked.
        """
        try:
            payload = self._serializer.loads(value)
            claims = CookieClaims(
                session_id=str(payload["sid"]),
                scope=payload["scope"],
                who=str(payload["who"]),
                token_id=None if payload["tid"] is None else str(payload["tid"]),
                expires_at=float(payload["exp"]),
                cookie_id=str(payload["jti"]),
            )
        except (BadSignature, KeyError, TypeError, ValueError):
            raise TokenError("the sign-in cookie is invalid; sign in again") from None
        if claims.scope not in SCOPES or claims.session_id != session_id:
            raise TokenError("the sign-in cookie is not for this session")
        if self._clock() >= claims.expires_at:
            raise TokenError("the sign-in cookie has expired; sign in again")
        with self._lock:
            if claims.cookie_id in self._revoked:
                raise TokenError("the sign-in cookie was signed out")
        if claims.token_id is not None and not self._token_alive(session_id, claims.token_id):
            raise TokenError(f"token {claims.token_id} behind this cookie is no longer valid")
        return claims

    def seconds_left(self, claims: CookieClaims) -> float:
        """Seconds until the cookie expires."""
        return claims.expires_at - self._clock()

    def revoke(self, claims: CookieClaims) -> None:
        """Refuse this cookie from now on (sign-out)."""
        with self._lock:
            now = self._clock()
            for cookie_id in [k for k, exp in self._revoked.items() if exp <= now]:
                del self._revoked[cookie_id]
            self._revoked[claims.cookie_id] = claims.expires_at
