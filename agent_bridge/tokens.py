"""Scoped, short-lived session tokens minted by the server's admin credential.

A token is bound to one session, one scope and an expiry, and carries a random id that
can be revoked. It is an itsdangerous signed payload (HMAC-SHA256 over the claims with the
server's secret, salt ``deskvm.session-token``); itsdangerous compares signatures in
constant time. The authority is pure apart from its revocation/use table: no I/O.

Scopes are ordered: ``view`` (frames only: screenshot, zoom, cursor position; read the
session) < ``control`` (every input action) < ``exec`` (the guest control plane as well:
exec, files, clipboard, windows, accessibility tree, resolution; only on sessions created
with ``guest_control``) < ``admin`` (lifecycle and policy of that session: delete, approval
policy and decisions, minting and revoking its tokens). ``control`` does not imply
``exec``.

Restarts: the signing secret is the installation's (``agent_bridge.runtime.ensure_signing_key``
keeps it in a 0600 file), so tokens minted before a bridge restart verify after it; what
the authority remembers about a session's tokens (issued ids, revocations, used single-use
ids) is exported with :meth:`TokenAuthority.export_session` into the session's record and
imported again when the session is re-adopted (:meth:`TokenAuthority.import_session`): a
revoked token stays revoked. ``on_change`` tells the bridge when to store it.

Errors: every failure is an :class:`~orchestrator.errors.DeskvmError` with code
``unauthorized`` (bad, expired, revoked, replayed or wrong-session token) or ``forbidden``
(valid token, scope too small). Messages never contain the token.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from itsdangerous import BadSignature, URLSafeSerializer

from orchestrator.errors import ConfigError, DeskvmError

__all__ = [
    "SCOPES",
    "TOKEN_PREFIX",
    "Claims",
    "Scope",
    "TokenAuthority",
    "TokenError",
    "scope_allows",
]

Scope = Literal["view", "control", "exec", "admin"]
SCOPES: tuple[Scope, ...] = ("view", "control", "exec", "admin")
TOKEN_PREFIX = "dvt1."
"""Every minted token starts with this (tells it apart from the server's admin token)."""

_SALT = "deskvm.session-token"


class TokenError(DeskvmError):
    """A token was refused: ``code`` is ``unauthorized`` (HTTP 401) or ``forbidden`` (403)."""

    code = "unauthorized"


def scope_allows(have: Scope, need: Scope) -> bool:
    """Whether a token of scope ``have`` may do what needs ``need``
    (view < control < exec < admin)."""
    return SCOPES.index(have) >= SCOPES.index(need)


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified token grants.

    Attributes:
        token_id: random id (``jti``), the handle for revocation; safe to log.
        session_id: the one session the token is for.
        scope: ``view``, ``control`` or ``admin``.
        expires_at: Unix time (seconds) after which the token is refused.
        single_use: the token opens one WebSocket only (e.g. a link for a browser viewer).
    """

    token_id: str
    session_id: str
    scope: Scope
    expires_at: float
    single_use: bool = False


class TokenAuthority:
    """Mints and verifies session tokens; remembers revoked and used single-use ids.

    Args:
        secret: signing key (>= 32 bytes); default a fresh random one, so tokens die with
            the server process.
        default_ttl_s: lifetime when a mint request names none, seconds.
        max_ttl_s: longest lifetime a mint request may ask for, seconds.
        clock: Unix time in seconds (``time.time``; fake in tests).
        on_change: called with a session id after its tokens changed (minted, revoked,
            a single-use token used), to store :meth:`export_session`; may raise (e.g.
            ``StoreError``) to fail the operation's reply (the change itself stands).

    Raises:
        ConfigError: secret too short or TTLs inconsistent.
    """

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        default_ttl_s: float = 900.0,
        max_ttl_s: float = 4 * 3600.0,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        secret = secret if secret is not None else secrets.token_bytes(32)
        if len(secret) < 32:
            raise ConfigError("the token signing secret must be at least 32 bytes")
        if not 0 < default_ttl_s <= max_ttl_s:
            raise ConfigError("token TTLs: need 0 < default_ttl_s <= max_ttl_s")
        self._serializer = URLSafeSerializer(secret, salt=_SALT)
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._revoked: dict[str, float] = {}  # token id -> expiry (forgotten after it)
        self._used: dict[str, float] = {}
        self._issued: dict[str, Claims] = {}
        self._session_of: dict[str, str] = {}  # token id -> session id (revoked/used)
        self.on_change = on_change

    def mint(
        self,
        session_id: str,
        scope: Scope,
        *,
        ttl_s: float | None = None,
        single_use: bool = False,
    ) -> tuple[str, Claims]:
        """A new token for ``session_id``.

        Args:
            session_id: the session it is bound to.
            scope: what it allows.
            ttl_s: lifetime in seconds (default ``default_ttl_s``, at most ``max_ttl_s``).
            single_use: refuse it after its first successful WebSocket use.

        Returns:
            ``(token, claims)``; the token is the secret, ``claims.token_id`` the handle.

        Raises:
            ConfigError: bad scope or lifetime.
        """
        if scope not in SCOPES:
            raise ConfigError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= self.max_ttl_s:
            raise ConfigError(f"ttl_s {ttl} is outside (0, {self.max_ttl_s:.0f}]")
        claims = Claims(
            token_id=secrets.token_hex(8),
            session_id=session_id,
            scope=scope,
            expires_at=self._clock() + ttl,
            single_use=single_use,
        )
        payload: dict[str, Any] = {
            "jti": claims.token_id,
            "sid": session_id,
            "scope": scope,
            "exp": claims.expires_at,
            "once": single_use,
        }
        with self._lock:
            self._prune()
            self._issued[claims.token_id] = claims
            self._session_of[claims.token_id] = session_id
        self._changed(session_id)
        return TOKEN_PREFIX + self._serializer.dumps(payload), claims

    def verify(self, token: str, *, session_id: str, need: Scope, use: bool = False) -> Claims:
        """Check a token for one request.

        Args:
            token: as presented.
            session_id: the session the request is about.
            need: the scope the request needs.
            use: this is the use that consumes a single-use token (opening a WebSocket).

        Returns:
            The token's claims.

        Raises:
            TokenError: ``unauthorized`` if the token is malformed, forged, expired, revoked,
                already used (single-use) or for another session; ``forbidden`` if its
                scope is below ``need``.
        """
        if not token.startswith(TOKEN_PREFIX):
            raise TokenError("not a deskvm session token")
        try:
            payload = self._serializer.loads(token.removeprefix(TOKEN_PREFIX))
        except BadSignature:
            raise TokenError("token signature is invalid") from None
        try:
            claims = Claims(
                token_id=str(payload["jti"]),
                session_id=str(payload["sid"]),
                scope=payload["scope"],
                expires_at=float(payload["exp"]),
                single_use=bool(payload["once"]),
            )
        except (KeyError, TypeError, ValueError):
            raise TokenError("token payload is malformed") from None
        now = self._clock()
        if now >= claims.expires_at:
            raise TokenError(f"token {claims.token_id} has expired")
        if claims.session_id != session_id:
            raise TokenError(f"token {claims.token_id} is not for this session")
        with self._lock:
            if claims.token_id in self._revoked:
                raise TokenError(f"token {claims.token_id} was revoked")
            if claims.single_use and claims.token_id in self._used:
                raise TokenError(f"single-use token {claims.token_id} was already used")
            if claims.scope not in SCOPES or not scope_allows(claims.scope, need):
                raise TokenError(
                    f"token {claims.token_id} has scope {claims.scope!r}; this needs {need!r}",
                    code="forbidden",
                )
            used_now = use and claims.single_use
            if used_now:
                self._used[claims.token_id] = claims.expires_at
                self._session_of[claims.token_id] = claims.session_id
        if used_now:
            self._changed(claims.session_id)
        return claims

    def revoke(self, token_id: str) -> Claims | None:
        """Refuse the token with this id from now on. Idempotent.

        Returns:
            Its claims if this authority minted it (and it has not expired), else ``None``.
        """
        with self._lock:
            claims = self._issued.get(token_id)
            expiry = claims.expires_at if claims is not None else self._clock() + self.max_ttl_s
            self._revoked[token_id] = expiry
        if claims is not None:
            self._changed(claims.session_id)
        return claims

    def revoked(self, token_id: str) -> bool:
        """Whether the token with this id was revoked (open connections it authorised end)."""
        with self._lock:
            return token_id in self._revoked

    def revoke_session(self, session_id: str) -> int:
        """Revoke every token of a session (e.g. when it ends); returns how many."""
        with self._lock:
            ids = [c.token_id for c in self._issued.values() if c.session_id == session_id]
            for token_id in ids:
                self._revoked[token_id] = self._issued[token_id].expires_at
        if ids:
            self._changed(session_id)
        return len(ids)

    def _changed(self, session_id: str) -> None:
        if self.on_change is not None:
            self.on_change(session_id)

    def export_session(self, session_id: str) -> dict[str, Any]:
        """What this authority knows about ``session_id``'s tokens, JSON-ready (never a
        token itself): ``{"issued": [{"token_id", "scope", "expires_at", "single_use"}],
        "revoked": {id: expires_at}, "used": {id: expires_at}}``."""
        with self._lock:
            self._prune()
            issued = [c for c in self._issued.values() if c.session_id == session_id]
            ids = {c.token_id for c in issued} | {
                k for k, sid in self._session_of.items() if sid == session_id
            }
            return {
                "issued": [
                    {
                        "token_id": c.token_id,
                        "scope": c.scope,
                        "expires_at": c.expires_at,
                        "single_use": c.single_use,
                    }
                    for c in issued
                ],
                "revoked": {k: v for k, v in self._revoked.items() if k in ids},
                "used": {k: v for k, v in self._used.items() if k in ids},
            }

    def import_session(self, session_id: str, data: Mapping[str, Any]) -> None:
        """Take back :meth:`export_session` data (a re-adopted session's tokens).

        Raises:
            ConfigError: the data is malformed.
        """
        try:
            issued = [
                Claims(
                    token_id=str(c["token_id"]), session_id=session_id, scope=c["scope"],
                    expires_at=float(c["expires_at"]), single_use=bool(c["single_use"]),
                )
                for c in data.get("issued", [])
            ]  # fmt: skip
            revoked = {str(k): float(v) for k, v in dict(data.get("revoked", {})).items()}
            used = {str(k): float(v) for k, v in dict(data.get("used", {})).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed token state of session {session_id}: {exc!r}") from exc
        with self._lock:
            for claims in issued:
                self._issued[claims.token_id] = claims
                self._session_of[claims.token_id] = session_id
            for table, values in ((self._revoked, revoked), (self._used, used)):
                for token_id, expiry in values.items():
                    table[token_id] = expiry
                    self._session_of[token_id] = session_id
            self._prune()

    def minted(self, session_id: str, token_id: str) -> Claims | None:
        """The claims of ``token_id`` if this authority minted it for ``session_id`` and it
        has not expired (revoked or not), else ``None``."""
        with self._lock:
            self._prune()
            claims = self._issued.get(token_id)
            return claims if claims is not None and claims.session_id == session_id else None

    def issued(self, session_id: str) -> list[Claims]:
        """Unexpired, unrevoked tokens minted for ``session_id`` (claims only)."""
        with self._lock:
            self._prune()
            return [
                c
                for c in self._issued.values()
                if c.session_id == session_id and c.token_id not in self._revoked
            ]

    def _prune(self) -> None:
        now = self._clock()
        for table in (self._revoked, self._used):
            for token_id in [k for k, exp in table.items() if exp <= now]:
                del table[token_id]
        for token_id in [k for k, c in self._issued.items() if c.expires_at <= now]:
            del self._issued[token_id]
        keep = set(self._issued) | set(self._revoked) | set(self._used)
        for token_id in [k for k in self._session_of if k not in keep]:
            del self._session_of[token_id]
