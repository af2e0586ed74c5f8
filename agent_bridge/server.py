"""The bridge server: REST for session lifecycle, one WebSocket per agent for actions.

:func:`create_app` wraps a :class:`~orchestrator.manager.SessionManager` in a FastAPI
application; :func:`run_server` serves it with uvicorn. The wire protocol is documented in
``docs/protocol.md``; the OpenAPI schema of the REST part is served at ``/openapi.json``
(and ``/docs``).

Layering: this module translates between HTTP/WebSocket and the orchestrator. Parsing of
action messages is the pure :mod:`agent_bridge.protocol` layer's job; executing them is
:meth:`orchestrator.session.Session.execute`'s. Blocking calls into the orchestrator
(booting, acting, tearing down) run in worker threads so the event loop stays responsive.

Errors: every :class:`~orchestrator.errors.DeskvmError` becomes a JSON body
``{"error": {"code", "message"}}`` with the status of :data:`STATUS_BY_CODE` (REST) or an
error reply ``{"id", "ok": false, "error": {...}}`` (WebSocket). The bearer token is never
logged, never echoed and never read from the URL.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import importlib
import io
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import anyio
import anyio.to_thread
from fastapi import Depends, FastAPI, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.websockets import WebSocketDisconnect, WebSocketState

from agent_bridge.protocol.actions import (
    Action,
    CursorPosition,
    Screenshot,
    Type,
    Zoom,
    action_name,
    action_to_dict,
)
from agent_bridge.protocol.messages import (
    ClientId,
    decode_envelope,
    encode_error,
    encode_result,
    parse_deskvm_action,
)
from agent_bridge.protocol.results import (
    CursorResult,
    Done,
    ImageResult,
    Result,
    to_deskvm_result,
)
from agent_bridge.protocol.scaling import Scaler, scale_action
from agent_bridge.tokens import Claims, Scope, TokenAuthority, TokenError, scope_allows
from agent_bridge.viewer import replay_router
from orchestrator.approval import (
    ApprovalDenied,
    ApprovalDesk,
    ApprovalPolicy,
    ApprovalTimeout,
    PendingAction,
)
from orchestrator.errors import (
    ActionError,
    BootTimeout,
    ConfigError,
    DeskvmError,
    ProtocolError,
    SessionClosed,
    SessionNotFound,
)
from orchestrator.manager import SessionManager
from orchestrator.session import Session, SessionState, decision_to_json, encode_png
from orchestrator.settings import Settings
from orchestrator.spec import (
    MAX_DISPLAY_PX,
    MAX_EGRESS_ENTRIES,
    MIN_DISPLAY_PX,
    DisplaySpec,
    EgressPolicy,
)

__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_SESSION_NOT_FOUND",
    "CLOSE_TRY_AGAIN_LATER",
    "MAX_MESSAGE_BYTES",
    "STATUS_BY_CODE",
    "SUBPROTOCOL",
    "SUBPROTOCOL_BEARER_PREFIX",
    "CreateSessionRequest",
    "DisplayModel",
    "EgressInfo",
    "EgressRequest",
    "ErrorBody",
    "HealthResponse",
    "NetworkDecisionModel",
    "SessionInfo",
    "create_app",
    "run_server",
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

_STATE_POLL_S = 0.2
_CLOSE_REASON_MAX_BYTES = 123  # RFC 6455 section 5.5: control frame payload <= 125 bytes
_IMAGE_NAME_RE = r"^[a-z0-9][a-z0-9._-]{0,63}$"
_ENDED: frozenset[SessionState] = frozenset({"closing", "closed", "failed"})

STATUS_BY_CODE: dict[str, int] = {
    "invalid_request": 422,
    "invalid_config": 422,
    "invalid_egress": 422,
    "egress_not_configured": 422,
    "image_not_found": 404,
    "session_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "unauthorized": 401,
    "forbidden": 403,
    "pending_not_found": 404,
    "session_closed": 409,
    "rate_limited": 429,
    "over_capacity": 503,
    "over_memory": 503,
    "insufficient_disk": 503,
    "boot_timeout": 504,
    "hypervisor_error": 502,
    "display_error": 502,
    "guest_helper_error": 502,
    "egress_error": 502,
    "recorder_error": 500,
    "internal_error": 500,
}
"""HTTP status of each error ``code`` on the REST side; unlisted codes answer 500, unlisted
:class:`~orchestrator.errors.ProtocolError` codes 400."""


# --- wire models (the HTTP edge) -------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class DisplayModel(_Strict):
    """Guest screen size in pixels (origin top-left); width a multiple of 8."""

    width: int = Field(1280, ge=MIN_DISPLAY_PX, le=MAX_DISPLAY_PX, description="pixels")
    height: int = Field(800, ge=MIN_DISPLAY_PX, le=MAX_DISPLAY_PX, description="pixels")


class ApprovalPolicyModel(_Strict):
    """Which actions wait for an operator (see ``orchestrator.approval.ApprovalPolicy``)."""

    every_action: bool = Field(False, description="supervised mode: hold every action")
    kinds: list[str] = Field(default_factory=list, description="action names to hold")
    key_combos: list[str] = Field(
        default_factory=list, description="key combos to hold, e.g. 'ctrl+alt+delete'"
    )
    text_patterns: list[str] = Field(
        default_factory=list, description="regular expressions on typed text (re.search)"
    )
    timeout_s: float = Field(60.0, gt=0, le=3600, description="seconds to decide; then deny")
    include_observations: bool = Field(
        False, description="supervised mode also holds screenshot/zoom/cursor_position"
    )

    def to_policy(self) -> ApprovalPolicy:
        """Raises: ConfigError: bad combo or pattern."""
        return ApprovalPolicy(
            every_action=self.every_action,
            kinds=tuple(self.kinds),
            key_combos=tuple(self.key_combos),
            text_patterns=tuple(self.text_patterns),
            timeout_s=self.timeout_s,
            include_observations=self.include_observations,
        )

    @classmethod
    def of(cls, policy: ApprovalPolicy) -> ApprovalPolicyModel:
        return cls(
            every_action=policy.every_action,
            kinds=list(policy.kinds),
            key_combos=list(policy.key_combos),
            text_patterns=list(policy.text_patterns),
            timeout_s=policy.timeout_s,
            include_observations=policy.include_observations,
        )


class LimitsModel(BaseModel):
    """Host-enforced limits of a session."""

    memory_hard_limit_mib: int = Field(description="guest RAM + QEMU overhead, cgroup max")
    cpu_quota_pct: int | None = Field(description="percent of one host core; null: none")
    disk_mib: int | None = Field(description="guest disk cap; null: the image's size")
    ttl_s: float | None = Field(description="maximum lifetime, seconds")
    idle_timeout_s: float | None = Field(description="idle timeout, seconds")


class MintTokenRequest(_Strict):
    """Body of ``POST /v1/sessions/{id}/tokens``."""

    scope: Literal["view", "control", "admin"] = Field(
        description="view: frames only; control: actions; admin: lifecycle and policy"
    )
    ttl_s: float | None = Field(None, gt=0, description="lifetime, seconds; default 900")
    single_use: bool = Field(False, description="valid for one WebSocket connection only")


class TokenInfo(BaseModel):
    """A minted token (the ``token`` itself is shown only once, in the mint response)."""

    token: str | None = Field(None, description="the bearer credential; only when minted")
    token_id: str = Field(description="handle for revocation (safe to log)")
    session_id: str
    scope: Literal["view", "control", "admin"]
    expires_at: datetime = Field(description="UTC")
    single_use: bool


class PendingInfo(BaseModel):
    """An action held for an operator's decision."""

    pending_id: str
    session_id: str
    action: dict[str, Any] = Field(description="the held action, deskvm form")
    reason: str = Field(description="which rule held it")
    seconds_left: float = Field(description="until it is denied automatically")
    frame_url: str = Field(description="PNG of the screen when it was held")


class DecisionRequest(_Strict):
    """Body of ``POST /v1/sessions/{id}/pending/{pending_id}``."""

    decision: Literal["approve", "deny"]

class EgressRequest(_Strict):
    """The session's egress policy: what the guest may reach (everything else is dropped)."""

    allow: list[str] = Field(
        default_factory=list,
        max_length=MAX_EGRESS_ENTRIES,
        description=(
            "entries: CIDR[:port] (e.g. 198.51.100.0/24:443) or a domain (example.org, "
            "*.example.org, optionally :port); [] gives a NIC that reaches nothing"
        ),
    )


class CreateSessionRequest(_Strict):
    """Body of ``POST /v1/sessions``; every field is optional."""

    image: str | None = Field(
        None,
        pattern=_IMAGE_NAME_RE,
        description="built image name; default: the server's default image",
    )
    display: DisplayModel = Field(default_factory=lambda: DisplayModel(width=1280, height=800))
    memory_mib: int = Field(2048, ge=256, le=65536, description="guest RAM, MiB")
    vcpus: int = Field(2, ge=1, le=16, description="virtual CPUs")
    boot_timeout_s: float | None = Field(
        None, gt=0, le=3600, description="seconds until the desktop must be drawn"
    )
    cpu_quota_pct: int | None = Field(
        None,
        ge=1,
        le=1600,
        description="host CPU the domain may use, percent of one core (<= 100 * vcpus);"
        " null: no quota",
    )
    disk_mib: int | None = Field(
        None,
        ge=256,
        le=1024 * 1024,
        description="guest disk cap, MiB (>= the image's size); null: the image's size",
    )
    ttl_s: float | None = Field(
        None, gt=0, le=7 * 86400, description="maximum lifetime, seconds; default: server's"
    )
    idle_timeout_s: float | None = Field(
        None,
        gt=0,
        le=7 * 86400,
        description="end after this many seconds without an action; default: server's",
    )
    approval: ApprovalPolicyModel | None = Field(
        None, description="actions held for an operator's approval; null: none"
    )
    autostart: Literal["input-probe"] | None = Field(
        None,
        description="what the guest starts instead of the xterm: 'input-probe' (a full-screen"
        " app reporting every input as JSON lines on the guest log; the session is ready once"
        " it reports probe_ready); null: the xterm",
    )
    egress: EgressRequest | None = Field(
        None,
        description="network allowlist; absent or null: the guest has no network device",
    )


class EgressInfo(BaseModel):
    """A session's network: its policy and where the guest sits (null: no NIC)."""

    allow: list[str]
    bridge: str | None = Field(description="host bridge (dvm<id>) once attached")
    guest_ip: str | None = Field(description="IPv4 the guest gets by DHCP")
    gateway_ip: str | None = Field(description="bridge address: the guest's router and DNS")


class NetworkDecisionModel(BaseModel):
    """One egress decision (``GET /v1/sessions/{id}/network``)."""

    ts_ns: int = Field(description="CLOCK_MONOTONIC ns of the server host when decided")
    kind: Literal["dns_answered", "dns_refused", "conn_allowed", "conn_dropped"]
    reason: str
    protocol: str = Field(description="tcp, udp, icmp, ipv6, arp, ether:0x..., or dns")
    src: str | None
    src_port: int | None
    dst: str | None
    dst_port: int | None
    query: str | None = Field(description="DNS decisions: the name asked")
    qtype: str | None
    answers: list[str]


class CursorModel(BaseModel):
    """Pointer position as last placed by the host, display pixels."""

    x: int
    y: int


class SessionInfo(BaseModel):
    """A session as the REST API shows it."""

    id: str
    state: Literal["new", "starting", "ready", "closing", "closed", "failed"]
    ws_url: str = Field(description="WebSocket URL for actions (add ?schema=... if needed)")
    image: str
    display: DisplayModel
    memory_mib: int
    vcpus: int
    accel: str
    created_at: datetime | None = Field(description="UTC, when the server registered it")
    ready_at: datetime | None = Field(description="UTC, when the desktop was first drawn")
    boot_s: float | None = Field(description="seconds from domain start to ready")
    recording: str | None = Field(description="recording bundle directory (kept after end)")
    cursor: CursorModel
    closed_reason: str | None
    limits: LimitsModel | None = None
    autostart: str | None = Field(None, description="what the guest started instead of the xterm")
    egress: EgressInfo | None = Field(None, description="null: no network device at all")


class HealthResponse(BaseModel):
    """``GET /healthz``."""

    ok: bool
    sessions: int = Field(description="live sessions (starting or ready)")


class ErrorDetail(BaseModel):
    """The ``error`` object of every error body."""

    code: str
    message: str
    console_tail: str | None = Field(None, description="boot_timeout only: guest console tail")
    details: list[Any] | None = Field(None, description="invalid_request only: field errors")


class ErrorBody(BaseModel):
    """Every REST error answers ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (401, 403, 404, 409, 422, 429, 502, 503, 504)
}


# --- vocabulary plug-in ----------------------------------------------------------------


class _Vocabulary(Protocol):
    """What the WebSocket handler needs of a vocabulary (see ``protocol/vocab``)."""

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]: ...

    def format_result(
        self, body: Mapping[str, Any], results: Sequence[Result]
    ) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class _DeskvmFallback:
    """deskvm's own actions, used when ``agent_bridge.protocol.vocab`` is not available."""

    name: str = "deskvm"

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]:
        return (parse_deskvm_action(body),)

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        return to_deskvm_result(results[-1] if results else Done())


def _load_vocabulary(name: str) -> _Vocabulary:
    """The vocabulary for ``?schema=name``.

    Uses ``agent_bridge.protocol.vocab.get_vocabulary`` when that package provides it,
    otherwise only ``deskvm`` is known.

    Raises:
        ProtocolError: code ``unknown_schema``.
    """
    try:
        module = importlib.import_module("agent_bridge.protocol.vocab")
    except ImportError:
        module = None
    get_vocabulary: Callable[[str], _Vocabulary] | None = getattr(module, "get_vocabulary", None)
    if get_vocabulary is None:
        if name == "deskvm":
            return _DeskvmFallback()
        raise ProtocolError(
            f"unknown schema {name!r}; this server supports: deskvm", code="unknown_schema"
        )
    try:
        return get_vocabulary(name)
    except ProtocolError as exc:
        if exc.code == "unknown_schema":
            raise
        raise ProtocolError(
            f"unknown schema {name!r}: {exc.message}", code="unknown_schema"
        ) from None
    except (DeskvmError, LookupError, ValueError) as exc:
        detail = exc.message if isinstance(exc, DeskvmError) else str(exc)
        raise ProtocolError(f"unknown schema {name!r}: {detail}", code="unknown_schema") from None


# --- helpers ---------------------------------------------------------------------------


def _error_response(
    exc: DeskvmError, *, status: int | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    detail: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if isinstance(exc, BootTimeout):
        detail["console_tail"] = exc.console_tail
    if status is None:
        default = 400 if isinstance(exc, ProtocolError) else 500
        status = STATUS_BY_CODE.get(exc.code, default)
    if exc.code == "unauthorized":
        headers = {"WWW-Authenticate": "Bearer", **(headers or {})}
    if exc.code in ("over_capacity", "over_memory", "insufficient_disk", "rate_limited"):
        headers = {"Retry-After": "5", **(headers or {})}
    return JSONResponse({"error": detail}, status_code=status, headers=headers)


def _plain_error(code: str, message: str, status: int, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, **extra}}, status_code=status)


def _token_ok(offered: str | None, token: str) -> bool:
    if offered is None:
        return False
    return hmac.compare_digest(offered.encode("utf-8"), token.encode("utf-8"))


def _bearer_from_header(value: str | None) -> str | None:
    if value is None:
        return None
    scheme, _, credentials = value.partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


def _offered_subprotocols(websocket: WebSocket) -> list[str]:
    header = websocket.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in header.split(",") if p.strip()]


def _close_reason(text: str) -> str:
    data = text.encode("utf-8")[:_CLOSE_REASON_MAX_BYTES]
    return data.decode("utf-8", errors="ignore")


def _ws_base(url: str) -> str:
    if url.startswith("https://"):
        return "wss://" + url.removeprefix("https://")
    if url.startswith("http://"):
        return "ws://" + url.removeprefix("http://")
    return url


class _Book:
    """Wall-clock creation and ready times of the sessions this app created.

    The session keeps monotonic times only; the REST view shows UTC times, so the app
    notes them. Entries of sessions the manager has forgotten are pruned on each create.
    """

    def __init__(self) -> None:
        self.created_at: dict[str, datetime] = {}
        self.ready_at: dict[str, datetime] = {}

    def prune(self, known: set[str]) -> None:
        for table in (self.created_at, self.ready_at):
            for session_id in [k for k in table if k not in known]:
                del table[session_id]


def _info(session: Session, book: _Book, base_url: str, accel: str) -> SessionInfo:
    spec = session.spec
    path = session.recorder.path
    x, y = session.cursor
    return SessionInfo(
        id=session.id,
        state=session.state,
        ws_url=f"{_ws_base(base_url.rstrip('/'))}/v1/sessions/{session.id}/ws",
        image=spec.image.name,
        display=DisplayModel(width=spec.display.width_px, height=spec.display.height_px),
        memory_mib=spec.memory_mib,
        vcpus=spec.vcpus,
        accel=accel,
        created_at=book.created_at.get(session.id),
        ready_at=book.ready_at.get(session.id),
        boot_s=round(session.boot_s, 3) if session.boot_s is not None else None,
        recording=str(path) if path is not None else None,
        cursor=CursorModel(x=x, y=y),
        closed_reason=session.closed_reason,
        autostart=spec.autostart,
        limits=LimitsModel(
            memory_hard_limit_mib=spec.memory_mib + spec.memory_overhead_mib,
            cpu_quota_pct=spec.cpu_quota_pct,
            disk_mib=spec.disk_mib,
            ttl_s=spec.ttl_s,
            idle_timeout_s=spec.idle_timeout_s,
        ),
        egress=_egress_info(session),
    )


def _egress_info(session: Session) -> EgressInfo | None:
    policy = session.spec.egress
    if policy is None:
        return None
    attachment = session.egress_attachment
    return EgressInfo(
        allow=list(policy.allow),
        bridge=attachment.bridge if attachment else None,
        guest_ip=attachment.guest_ip if attachment else None,
        gateway_ip=attachment.gateway_ip if attachment else None,
    )


_BEARER = HTTPBearer(auto_error=False, description="the server's token (see `deskvm serve`)")


class _TokenGuard:
    """FastAPI dependency: the request must carry ``Authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def __call__(
        self,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        """Raises: ``HTTPException`` 401 ``unauthorized`` (with ``WWW-Authenticate``)."""
        offered = None if credentials is None else credentials.credentials
        if _token_ok(offered, self._token):
            return
        hint = "send 'Authorization: Bearer <token>'"
        if any(k in request.query_params for k in ("token", "access_token")):
            hint += "; tokens in the URL are never accepted"
        raise StarletteHTTPException(
            401,
            detail=f"missing or wrong bearer token: {hint}",
            headers={"WWW-Authenticate": "Bearer"},
        )


@dataclass(frozen=True, slots=True)
class _Principal:
    """Who made a request: the server's admin token or a scoped session token."""

    who: str  # "admin" or "token:<token_id>" (safe to log and record)
    scope: Scope
    claims: Claims | None


def _authorize(
    offered: str | None,
    admin_token: str,
    authority: TokenAuthority,
    session_id: str,
    need: Scope,
    *,
    use: bool = False,
) -> _Principal:
    """The principal behind ``offered`` for a request on ``session_id`` needing ``need``.

    Raises:
        TokenError: ``unauthorized`` or ``forbidden``.
    """
    if offered is None:
        raise TokenError("missing bearer token: send 'Authorization: Bearer <token>'")
    if _token_ok(offered, admin_token):
        return _Principal("admin", "admin", None)
    claims = authority.verify(offered, session_id=session_id, need=need, use=use)
    return _Principal(f"token:{claims.token_id}", claims.scope, claims)


class _SessionGuard:
    """FastAPI dependency for ``/v1/sessions/{session_id}/...``: the admin token, or a session
    token for that session with at least scope ``need``. Tokens in the URL are never read.
    The admin token and the authority are the app's (``app.state.deskvm_auth``).
    """

    def __init__(self, need: Scope) -> None:
        self._need = need

    async def __call__(
        self,
        request: Request,
        session_id: str,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> _Principal:
        """Raises: TokenError: 401 ``unauthorized``, 403 ``forbidden``."""
        admin_token, authority = request.app.state.deskvm_auth
        offered = None if credentials is None else credentials.credentials
        return _authorize(offered, admin_token, authority, session_id, self._need)


_AdminPrincipal = Annotated[_Principal, Depends(_SessionGuard("admin"))]


class _Bucket:
    """A token bucket: ``rate_per_s`` refill, ``burst`` capacity (monotonic seconds).

    With ``allow_debt`` a request larger than what is left still passes while the bucket
    is not in debt, and the bucket goes negative: one long ``type`` (up to the protocol's
    text limit) is allowed, and the session then waits until the debt is repaid.
    """

    def __init__(self, rate_per_s: float, burst: float, *, allow_debt: bool = False) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.allow_debt = allow_debt
        self._level = burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def give(self, amount: float) -> None:
        """Return ``amount`` taken by a request that did not run (never above ``burst``)."""
        with self._lock:
            self._level = min(self.burst, self._level + amount)

    def take(self, amount: float) -> bool:
        with self._lock:
            now = time.monotonic()
            self._level = min(self.burst, self._level + (now - self._t) * self.rate_per_s)
            self._t = now
            if amount > self._level and not (self.allow_debt and self._level > 0):
                return False
            self._level -= amount
            return True


class _RateLimits:
    """Per-session limits on actions and typed characters, shared by its connections."""

    def __init__(self, actions_per_s: float, chars_per_s: float) -> None:
        self._actions_per_s = actions_per_s
        self._chars_per_s = chars_per_s
        self._buckets: dict[str, tuple[_Bucket, _Bucket]] = {}
        self._lock = threading.Lock()

    def check(self, session_id: str, actions: Sequence[Action]) -> None:
        """Raises: DeskvmError: code ``rate_limited``."""
        with self._lock:
            if session_id not in self._buckets:
                self._buckets[session_id] = (
                    _Bucket(self._actions_per_s, 2 * self._actions_per_s),
                    _Bucket(self._chars_per_s, 2 * self._chars_per_s, allow_debt=True),
                )
            action_bucket, char_bucket = self._buckets[session_id]
        chars = sum(len(a.text) for a in actions if isinstance(a, Type))
        if not action_bucket.take(len(actions)):
            raise DeskvmError(
                f"more than {self._actions_per_s:g} actions/s on this session; slow down",
                code="rate_limited",
            )
        if chars and not char_bucket.take(chars):
            raise DeskvmError(
                f"more than {self._chars_per_s:g} typed characters/s on this session",
                code="rate_limited",
            )

    def refund(self, session_id: str, chars: int) -> None:
        """Give back typed characters of actions that were refused or never ran."""
        with self._lock:
            buckets = self._buckets.get(session_id)
        if buckets is not None and chars > 0:
            buckets[1].give(chars)

    def forget(self, known: set[str]) -> None:
        with self._lock:
            for session_id in [k for k in self._buckets if k not in known]:
                del self._buckets[session_id]


_OBSERVATIONS = (Screenshot, Zoom, CursorPosition)
_FLOOD_STRIKES = 10
"""Rate-limited messages in a row after which a WebSocket is closed (1008)."""


def _gate(
    session: Session, action: Action, policy: ApprovalPolicy | None, desk: ApprovalDesk
) -> None:
    """Hold ``action`` for an operator if ``policy`` says so; return only if approved.

    The request (with the frame the operator sees) and the decision (with who decided)
    are appended to the session's recording.

    Raises:
        ApprovalDenied: an operator denied it (or the session ended meanwhile).
        ApprovalTimeout: nobody decided before ``policy.timeout_s``.
    """
    reason = policy.reason(action) if policy is not None else None
    if reason is None or policy is None:
        return
    frame, frame_seq = b"", None
    with contextlib.suppress(DeskvmError):
        shot = session.execute(Screenshot(), source="system")
        if isinstance(shot, ImageResult):
            frame, frame_seq = shot.data, shot.frame_seq
    item = desk.file(session.id, action, reason, timeout_s=policy.timeout_s, frame_png=frame)
    session.recorder.append(
        "approval",
        {
            "event": "requested",
            "pending_id": item.pending_id,
            "action": action_to_dict(action),
            "reason": reason,
            "frame_seq": frame_seq,
            "timeout_s": policy.timeout_s,
        },
        source="agent",
    )
    desk.wait(item, still_wanted=lambda: session.state == "ready")
    by = item.decided_by or "unknown"
    session.recorder.append(
        "approval",
        {
            "event": "decided",
            "pending_id": item.pending_id,
            "decision": item.decision,
            "by": by,
        },
        source="system" if by in ("timeout", "session ended") else "human",
    )
    if item.decision == "approve":
        return
    if by == "timeout":
        raise ApprovalTimeout(
            f"no operator approved {action_name(action)} ({reason}) within"
            f" {policy.timeout_s:g} s; it was not executed"
        )
    raise ApprovalDenied(
        f"{action_name(action)} ({reason}) was denied by {by}; it was not executed"
    )


def _pending_info(item: PendingAction, base_url: str) -> PendingInfo:
    left_s = max(0.0, (item.deadline_ns - time.monotonic_ns()) / 1e9)
    return PendingInfo(
        pending_id=item.pending_id,
        session_id=item.session_id,
        action=action_to_dict(item.action),
        reason=item.reason,
        seconds_left=round(left_s, 3),
        frame_url=f"{base_url.rstrip('/')}/v1/sessions/{item.session_id}/pending/"
        f"{item.pending_id}/frame",
    )


def _token_info(claims: Claims, token: str | None = None) -> TokenInfo:
    return TokenInfo(
        token=token,
        token_id=claims.token_id,
        session_id=claims.session_id,
        scope=claims.scope,
        expires_at=datetime.fromtimestamp(claims.expires_at, UTC),
        single_use=claims.single_use,
    )


# --- the application -------------------------------------------------------------------


def create_app(
    manager: SessionManager,
    *,
    token: str,
    settings: Settings | None = None,
    authority: TokenAuthority | None = None,
    desk: ApprovalDesk | None = None,
) -> FastAPI:
    """The bridge's ASGI application.

    Args:
        manager: creates, finds and deletes sessions (its hypervisor decides real or fake).
        token: the server's admin bearer token: every REST call (except ``/healthz`` and
            the OpenAPI pages) and every WebSocket must present it or a session token it
            minted. Compared in constant time; never logged.
        settings: supplies ``default_image``, ``boot_timeout_s``, default limits, token
            lifetimes, the Origin allowlist, rate limits and the sweep interval (default:
            :class:`~orchestrator.settings.Settings` defaults).
        authority: mints and verifies session tokens (default: a fresh random secret).
        desk: where actions held for approval wait (default: a new one).

    Returns:
        A FastAPI app. Its lifespan runs ``manager.sweep`` (TTL, idle timeout, reaper) at
        start and every ``settings.sweep_interval_s`` in a background thread, and closes
        every live session (``manager.close_all``) on shutdown.

    Raises:
        ConfigError: ``token`` is empty.
    """
    if not token:
        raise ConfigError("the bridge needs a non-empty bearer token")
    settings = settings or Settings()
    book = _Book()
    authority = authority or TokenAuthority(
        default_ttl_s=settings.token_ttl_s, max_ttl_s=settings.token_max_ttl_s
    )
    desk = desk or ApprovalDesk()
    policies: dict[str, ApprovalPolicy] = {}
    limits = _RateLimits(settings.max_actions_per_s, settings.max_typed_chars_per_s)

    def sweep_once() -> None:
        try:
            expired, reaped = manager.sweep()
        except Exception:
            log.exception("session sweep failed")
            return
        for session_id in expired:
            with contextlib.suppress(DeskvmError):
                log.info("session %s ended: %s", session_id,
                         manager.get(session_id).closed_reason)  # fmt: skip
        if reaped:
            log.warning("reaped leftovers of unknown sessions: %s", ", ".join(reaped))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()

        def sweeper() -> None:
            while not stop.wait(settings.sweep_interval_s):
                sweep_once()

        await anyio.to_thread.run_sync(sweep_once)
        thread = threading.Thread(target=sweeper, name="deskvm-sweeper", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            await anyio.to_thread.run_sync(lambda: thread.join(timeout=30))
            errors = await anyio.to_thread.run_sync(
                lambda: manager.close_all(reason="server shutdown")
            )
            for error in errors:
                log.error("teardown at shutdown failed: %s", error)

    app = FastAPI(
        title="deskvm bridge",
        version="1",
        summary="Disposable desktop VMs for computer-use agents.",
        description="REST for sessions; actions over the WebSocket "
        "`/v1/sessions/{id}/ws` (see docs/protocol.md).",
        lifespan=lifespan,
    )

    # -- errors: always {"error": {"code", "message"}} ----------------------------------

    @app.exception_handler(DeskvmError)
    async def _deskvm_error(request: Request, exc: DeskvmError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else "invalid request"
        details = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
            for e in errors
        ]
        return _plain_error("invalid_request", message, 422, details=details)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}.get(
            exc.status_code, "http_error"
        )
        response = _plain_error(code, str(exc.detail), exc.status_code)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _plain_error("internal_error", "internal server error (see the server log)", 500)

    # -- auth ---------------------------------------------------------------------------

    authed = [Depends(_TokenGuard(token))]
    app.state.deskvm_auth = (token, authority)
    can_view = _SessionGuard("view")
    can_admin = _SessionGuard("admin")

    # The browser replay viewer over this server's recordings (agent_bridge/viewer.py).
    def recordings() -> list[tuple[str, Path]]:
        root = manager.recordings_dir
        return sorted((p.name, p) for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    app.include_router(
        replay_router(
            lambda name: manager.recordings_dir / name, recordings, data_dependencies=authed
        )
    )

    def base_url(request: Request) -> str:
        return str(request.base_url)

    def accel() -> str:
        return str(manager.hypervisor.accel)

    # -- REST ---------------------------------------------------------------------------

    @app.get("/healthz", response_model=HealthResponse, tags=["server"])
    async def healthz() -> HealthResponse:
        """Liveness; no token needed."""
        return HealthResponse(ok=True, sessions=len(manager.live()))

    @app.post(
        "/v1/sessions",
        status_code=201,
        response_model=SessionInfo,
        dependencies=authed,
        responses=_ERROR_RESPONSES,
        tags=["sessions"],
    )
    async def create_session(request: Request, body: CreateSessionRequest) -> SessionInfo:
        """Start a session; answers 201 once its desktop is drawn.

        On failure nothing is left behind: 404 ``image_not_found``, 422 ``invalid_config``,
        503 ``over_capacity`` / ``over_memory`` / ``insufficient_disk`` (with
        ``Retry-After``), 504 ``boot_timeout`` (with ``console_tail``), 502
        ``hypervisor_error`` / ``egress_error``, 422 ``invalid_egress`` (the message names
        the malformed entry) or ``egress_not_configured`` (a policy on a server without an
        egress upstream). If the client disconnects while the session boots, the session
        is deleted.
        """
        display = DisplaySpec(width_px=body.display.width, height_px=body.display.height)
        policy = body.approval.to_policy() if body.approval is not None else None
        egress_policy: EgressPolicy | None = None
        if body.egress is not None:
            try:
                egress_policy = EgressPolicy(allow=tuple(body.egress.allow))
            except ConfigError as exc:
                raise ConfigError(exc.message, code="invalid_egress") from None
        started: list[Session] = []

        def on_started(session: Session) -> None:
            book.created_at[session.id] = datetime.now(UTC)
            if policy is not None and not policy.empty:
                policies[session.id] = policy
            started.append(session)

        def create() -> Session:
            return manager.create(
                image=body.image or settings.default_image,
                display=display,
                memory_mib=body.memory_mib,
                vcpus=body.vcpus,
                boot_timeout_s=body.boot_timeout_s or settings.boot_timeout_s,
                on_started=on_started,
                cpu_quota_pct=body.cpu_quota_pct,
                disk_mib=body.disk_mib,
                ttl_s=body.ttl_s or settings.session_ttl_s,
                idle_timeout_s=body.idle_timeout_s or settings.idle_timeout_s,
                autostart=body.autostart,
                egress=egress_policy,
            )

        session = await _run_unless_disconnected(request, create, started, manager)
        book.ready_at[session.id] = datetime.now(UTC)
        known = {s.id for s in manager.all()}
        book.prune(known)
        limits.forget(known)
        for session_id in [k for k in policies if k not in known]:
            del policies[session_id]
        log.info("session %s ready in %.1f s", session.id, session.boot_s or 0.0)
        return _info(session, book, base_url(request), accel())

    @app.get(
        "/v1/sessions",
        response_model=list[SessionInfo],
        dependencies=authed,
        responses=_ERROR_RESPONSES,
        tags=["sessions"],
    )
    async def list_sessions(request: Request) -> list[SessionInfo]:
        """Live sessions first, then recently ended ones (bounded history)."""
        return [_info(s, book, base_url(request), accel()) for s in manager.all()]

    @app.get(
        "/v1/sessions/{session_id}",
        response_model=SessionInfo,
        dependencies=[Depends(can_view)],
        responses=_ERROR_RESPONSES,
        tags=["sessions"],
    )
    async def get_session(request: Request, session_id: str) -> SessionInfo:
        """One live or recently ended session (404 ``session_not_found``)."""
        return _info(manager.get(session_id), book, base_url(request), accel())

    @app.delete(
        "/v1/sessions/{session_id}",
        response_model=SessionInfo,
        dependencies=[Depends(can_admin)],
        responses=_ERROR_RESPONSES,
        tags=["sessions"],
    )
    async def delete_session(request: Request, session_id: str) -> SessionInfo:
        """End a session: domain destroyed, overlay deleted; the recording stays.

        Deleting an ended session answers 200 again with its final state. 502
        ``hypervisor_error`` if a teardown step failed (the session is retired anyway).
        """
        desk.deny_all(session_id, by="session deleted")
        session = await anyio.to_thread.run_sync(
            lambda: manager.delete(session_id, reason="deleted by client")
        )
        return _info(session, book, base_url(request), accel())

    @app.get(
        "/v1/sessions/{session_id}/guest-log",
        response_class=PlainTextResponse,
        dependencies=[Depends(can_view)],
        responses={**_ERROR_RESPONSES, 200: {"content": {"text/plain": {}}}},
        tags=["sessions"],
    )
    async def guest_log(
        session_id: str,
        offset: Annotated[int, Query(ge=0, description="skip this many bytes")] = 0,
    ) -> PlainTextResponse:
        """What the guest wrote to its ``/dev/ttyS1`` (UTF-8, undecodable bytes replaced)."""
        session = manager.get(session_id)
        data = await anyio.to_thread.run_sync(session.guest_log)
        return PlainTextResponse(data[offset:].decode("utf-8", errors="replace"))

    # -- tokens -------------------------------------------------------------------------

    @app.post(
        "/v1/sessions/{session_id}/tokens",
        status_code=201,
        response_model=TokenInfo,
        responses=_ERROR_RESPONSES,
        tags=["tokens"],
    )
    async def mint_token(
        session_id: str,
        body: MintTokenRequest,
        principal: _AdminPrincipal,
    ) -> TokenInfo:
        """Mint a token bound to this session with a scope and an expiry.

        Needs the admin token or an ``admin`` token of this session; a token never mints a
        wider scope than its own. The token is in this response only; keep it secret.
        422 if ``ttl_s`` exceeds the server's maximum.
        """
        manager.get(session_id)
        if not scope_allows(principal.scope, body.scope):
            raise TokenError(
                f"a {principal.scope} token cannot mint {body.scope}", code="forbidden"
            )
        minted, claims = authority.mint(
            session_id, body.scope, ttl_s=body.ttl_s, single_use=body.single_use
        )
        log.info("minted token %s (%s) for %s by %s", claims.token_id, claims.scope, session_id,
                 principal.who)  # fmt: skip
        return _token_info(claims, minted)

    @app.get(
        "/v1/sessions/{session_id}/tokens",
        response_model=list[TokenInfo],
        dependencies=[Depends(can_admin)],
        responses=_ERROR_RESPONSES,
        tags=["tokens"],
    )
    async def list_tokens(session_id: str) -> list[TokenInfo]:
        """Unexpired, unrevoked tokens of this session (ids and scopes, never the tokens)."""
        return [_token_info(c) for c in authority.issued(session_id)]

    @app.delete(
        "/v1/sessions/{session_id}/tokens/{token_id}",
        status_code=204,
        dependencies=[Depends(can_admin)],
        responses=_ERROR_RESPONSES,
        tags=["tokens"],
    )
    async def revoke_token(session_id: str, token_id: str) -> Response:
        """Revoke a token of this session: refused from now on (idempotent).

        Ids of other sessions' tokens are ignored (answering 204 all the same).
        """
        if any(c.token_id == token_id for c in authority.issued(session_id)):
            authority.revoke(token_id)
        return Response(status_code=204)

    # -- approvals ----------------------------------------------------------------------

    @app.get(
        "/v1/sessions/{session_id}/approval-policy",
        response_model=ApprovalPolicyModel,
        dependencies=[Depends(can_admin)],
        responses=_ERROR_RESPONSES,
        tags=["approvals"],
    )
    async def get_policy(session_id: str) -> ApprovalPolicyModel:
        """The session's approval policy (empty: nothing is held)."""
        manager.get(session_id)
        return ApprovalPolicyModel.of(policies.get(session_id) or ApprovalPolicy())

    @app.put(
        "/v1/sessions/{session_id}/approval-policy",
        response_model=ApprovalPolicyModel,
        responses=_ERROR_RESPONSES,
        tags=["approvals"],
    )
    async def put_policy(
        session_id: str,
        body: ApprovalPolicyModel,
        principal: _AdminPrincipal,
    ) -> ApprovalPolicyModel:
        """Replace the session's approval policy (recorded with who set it)."""
        session = manager.get(session_id)
        policy = body.to_policy()
        policies[session_id] = policy
        with contextlib.suppress(DeskvmError):
            session.recorder.append(
                "approval",
                {"event": "policy", "policy": body.model_dump(), "by": principal.who},
                source="human",
            )
        return ApprovalPolicyModel.of(policy)

    @app.get(
        "/v1/sessions/{session_id}/pending",
        response_model=list[PendingInfo],
        dependencies=[Depends(can_admin)],
        responses=_ERROR_RESPONSES,
        tags=["approvals"],
    )
    async def list_pending(request: Request, session_id: str) -> list[PendingInfo]:
        """Actions of this session waiting for a decision, oldest first."""
        return [_pending_info(p, base_url(request)) for p in desk.pending(session_id)]

    @app.get(
        "/v1/sessions/{session_id}/pending/{pending_id}/frame",
        response_class=Response,
        dependencies=[Depends(can_admin)],
        responses={**_ERROR_RESPONSES, 200: {"content": {"image/png": {}}}},
        tags=["approvals"],
    )
    async def pending_frame(session_id: str, pending_id: str) -> Response:
        """The screen (PNG) when the action was held."""
        for item in desk.pending(session_id):
            if item.pending_id == pending_id:
                return Response(item.frame_png, media_type="image/png")
        raise DeskvmError(f"no pending action {pending_id!r}", code="pending_not_found")

    @app.post(
        "/v1/sessions/{session_id}/pending/{pending_id}",
        response_model=PendingInfo,
        responses=_ERROR_RESPONSES,
        tags=["approvals"],
    )
    async def decide(
        request: Request,
        session_id: str,
        pending_id: str,
        body: DecisionRequest,
        principal: _AdminPrincipal,
    ) -> PendingInfo:
        """Approve or deny a held action (404 ``pending_not_found`` once decided/expired)."""
        if not any(p.pending_id == pending_id for p in desk.pending(session_id)):
            raise DeskvmError(f"no pending action {pending_id!r}", code="pending_not_found")
        item = desk.decide(pending_id, body.decision, by=principal.who)
        return _pending_info(item, base_url(request))

    @app.get(
        "/v1/sessions/{session_id}/network",
        response_model=list[NetworkDecisionModel],
        dependencies=[Depends(can_view)],
        responses=_ERROR_RESPONSES,
        tags=["sessions"],
    )
    async def network(session_id: str) -> list[NetworkDecisionModel]:
        """Every egress decision of the session so far, in recording order.

        DNS answered/refused and connections allowed/dropped (with the 5-tuple); the same
        entries are in the recording as ``network`` events. Kept after the session ends;
        ``[]`` for a session without an egress policy. 502 ``egress_error`` if the
        decision logs of a live session cannot be read.
        """
        session = manager.get(session_id)
        decisions = await anyio.to_thread.run_sync(session.network_decisions)
        return [NetworkDecisionModel(**decision_to_json(d)) for d in decisions]

    # -- WebSocket ----------------------------------------------------------------------

    async def ws_principal(
        websocket: WebSocket, session_id: str, need: Scope
    ) -> _Principal | None:
        """Check Origin and credentials before ``accept()``; refuse (HTTP 403) if bad."""
        origin = websocket.headers.get("origin")
        host = websocket.headers.get("host", "")
        same_origin = origin in (f"http://{host}", f"https://{host}")
        if origin is not None and not same_origin and origin not in settings.allowed_origins:
            log.warning("refused a WebSocket from origin %r (not in the allowlist)", origin)
            await websocket.close(CLOSE_POLICY_VIOLATION, reason="origin not allowed")
            return None
        offered = _offered_subprotocols(websocket)
        presented = _bearer_from_header(websocket.headers.get("authorization"))
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
            return _authorize(presented, token, authority, session_id, need, use=True)
        except TokenError as exc:
            log.info("refused a WebSocket for session %s: %s", session_id, exc.code)
            # Before accept(): the ASGI server answers the handshake with HTTP 403.
            await websocket.close(CLOSE_POLICY_VIOLATION, reason=exc.code)
            return None

    @app.websocket("/v1/sessions/{session_id}/ws")
    async def session_ws(websocket: WebSocket, session_id: str) -> None:
        principal = await ws_principal(websocket, session_id, "view")
        if principal is None:
            return
        offered = _offered_subprotocols(websocket)
        await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        connection = _Connection(websocket, manager, session_id)
        connection.principal = principal
        connection.limits = limits
        connection.gate = lambda session, action: _gate(
            session, action, policies.get(session.id), desk
        )
        await connection.run()

    @app.websocket("/v1/sessions/{session_id}/operator")
    async def operator_ws(websocket: WebSocket, session_id: str) -> None:
        """Operators: pending actions pushed as they come; decisions sent back."""
        principal = await ws_principal(websocket, session_id, "admin")
        if principal is None:
            return
        await websocket.accept()
        await _operate(websocket, desk, session_id, principal.who)

    return app


async def _operate(websocket: WebSocket, desk: ApprovalDesk, session_id: str, who: str) -> None:
    """The operator WebSocket: ``{"event": "pending", ...}`` with the frame (base64 PNG) for
    each new held action, ``{"event": "resolved", "pending_id"}`` when it leaves the queue;
    the operator sends ``{"pending_id", "decision": "approve"|"deny"}`` and gets
    ``{"event": "decided", ...}`` or ``{"event": "error", ...}`` back.
    """
    seen: set[str] = set()

    async def push() -> None:
        while True:
            current = {p.pending_id: p for p in desk.pending(session_id)}
            for pending_id, item in current.items():
                if pending_id not in seen:
                    seen.add(pending_id)
                    await websocket.send_json(
                        {
                            "event": "pending",
                            "pending_id": pending_id,
                            "action": action_to_dict(item.action),
                            "reason": item.reason,
                            "seconds_left": round(
                                max(0.0, (item.deadline_ns - time.monotonic_ns()) / 1e9), 3
                            ),
                            "frame_png_b64": base64.b64encode(item.frame_png).decode(),
                        }
                    )
            for pending_id in [p for p in seen if p not in current]:
                seen.discard(pending_id)
                await websocket.send_json({"event": "resolved", "pending_id": pending_id})
            await anyio.sleep(0.05)

    async def receive() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                body = json.loads(message.get("text") or "")
                pending_id = str(body["pending_id"])
                if not any(p.pending_id == pending_id for p in desk.pending(session_id)):
                    raise DeskvmError(
                        f"no pending action {pending_id!r} on this session",
                        code="pending_not_found",
                    )
                item = desk.decide(pending_id, body["decision"], by=who)
            except (ValueError, KeyError, TypeError) as exc:
                await websocket.send_json({"event": "error", "message": f"bad message: {exc}"})
                continue
            except DeskvmError as exc:
                await websocket.send_json(
                    {"event": "error", "code": exc.code, "message": exc.message}
                )
                continue
            await websocket.send_json(
                {"event": "decided", "pending_id": item.pending_id, "decision": item.decision}
            )

    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        async with anyio.create_task_group() as tg:

            async def pusher() -> None:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await push()

            tg.start_soon(pusher)
            await receive()
            tg.cancel_scope.cancel()


async def _run_unless_disconnected(
    request: Request,
    create: Callable[[], Session],
    started: list[Session],
    manager: SessionManager,
) -> Session:
    """Run the blocking ``create`` in a worker thread; delete the session if the client leaves.

    Raises:
        Whatever ``create`` raises.
    """
    outcome: list[Session] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def watch_client() -> None:
            while True:
                await anyio.sleep(0.5)
                if await request.is_disconnected():
                    if started:
                        await _delete_quietly(manager, started[0].id, "client disconnected")
                    return

        tg.start_soon(watch_client)
        try:
            outcome.append(await anyio.to_thread.run_sync(create))
        except Exception as exc:  # re-raised below, outside the task group's ExceptionGroup
            failure.append(exc)
        finally:
            tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return outcome[0]


async def _delete_quietly(manager: SessionManager, session_id: str, reason: str) -> None:
    """Delete a session in a worker thread, logging (not raising) a teardown failure."""
    try:
        await anyio.to_thread.run_sync(lambda: manager.delete(session_id, reason=reason))
    except DeskvmError as exc:
        log.error("deleting %s (%s) failed: %s", session_id, reason, exc.message)


class _Connection:
    """One WebSocket connection to one session: read a request, run it, reply; in order."""

    def __init__(self, websocket: WebSocket, manager: SessionManager, session_id: str) -> None:
        self.ws = websocket
        self.manager = manager
        self.session_id = session_id
        self._send_lock = anyio.Lock()
        self._closed = False
        self.principal = _Principal("admin", "admin", None)
        self.limits: _RateLimits | None = None
        self.gate: Callable[[Session, Action], None] | None = None
        self.scaler: Scaler | None = None
        self._strikes = 0

    async def _send(self, text: str) -> bool:
        """Send one text message; ``False`` if the connection is gone."""
        async with self._send_lock:
            if self._closed:
                return False
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._closed = True
                return False
            return True

    async def _close(self, code: int, reason: str) -> None:
        async with self._send_lock:
            if self._closed:
                return
            self._closed = True
            if self.ws.application_state != WebSocketState.DISCONNECTED:
                with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
                    await self.ws.close(code, reason=_close_reason(reason))

    async def _refuse(self, error: DeskvmError, close_code: int) -> None:
        """Send one error reply (``id`` null) explaining why, then close."""
        await self._send(encode_error(None, error))
        await self._close(close_code, f"{error.code}: {error.message}")

    async def run(self) -> None:
        query = self.ws.query_params
        on_disconnect = query.get("on_disconnect", "keep")
        if on_disconnect not in ("keep", "delete"):
            await self._refuse(
                ProtocolError(
                    f"on_disconnect must be 'keep' or 'delete', not {on_disconnect!r}",
                    code="invalid_query",
                ),
                CLOSE_POLICY_VIOLATION,
            )
            return
        try:
            vocabulary = _load_vocabulary(query.get("schema", "deskvm"))
            session = self.manager.get(self.session_id)
            self.scaler = _scaler_from_query(
                query.get("scale_to"),
                query.get("max_long_edge"),
                session.spec.display.width_px,
                session.spec.display.height_px,
            )
        except ProtocolError as exc:
            await self._refuse(exc, CLOSE_POLICY_VIOLATION)
            return
        except SessionNotFound as exc:
            await self._refuse(exc, CLOSE_SESSION_NOT_FOUND)
            return
        if session.state != "ready":
            if session.state in ("new", "starting"):
                await self._refuse(
                    SessionClosed(
                        f"session {session.id} is {session.state}; retry when ready",
                        code="session_not_ready",
                    ),
                    CLOSE_TRY_AGAIN_LATER,
                )
            else:
                await self._refuse(
                    SessionClosed(f"session {session.id} is {session.state}"), CLOSE_GOING_AWAY
                )
            return
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_session, session, tg.cancel_scope)
                try:
                    await self._serve(session, vocabulary)
                except Exception:
                    log.exception("WebSocket of session %s failed", session.id)
                    await self._close(1011, "internal_error")
                finally:
                    tg.cancel_scope.cancel()
        finally:
            # Shielded: a cancelled connection (server shutdown, test client exit) must still
            # honour on_disconnect=delete.
            with anyio.CancelScope(shield=True):
                await self._close(1000, "bye")
                if on_disconnect == "delete":
                    await _delete_quietly(self.manager, session.id, "client disconnected")

    async def _watch_session(self, session: Session, scope: anyio.CancelScope) -> None:
        while session.state not in _ENDED:
            await anyio.sleep(_STATE_POLL_S)
        reason = session.closed_reason or session.state
        await self._close(CLOSE_GOING_AWAY, f"session ended: {reason}")
        scope.cancel()

    async def _serve(self, session: Session, vocabulary: _Vocabulary) -> None:
        while True:
            message = await self.ws.receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                self._closed = True
                return
            if kind != "websocket.receive":
                continue
            text: str | None = message.get("text")
            if text is None:
                size = len(message.get("bytes") or b"")
                if size > MAX_MESSAGE_BYTES:
                    await self._close(CLOSE_MESSAGE_TOO_BIG, "message_too_big")
                    return
                error = ProtocolError(
                    "binary frames are not supported; send JSON text messages",
                    code="binary_not_supported",
                )
                if not await self._send(encode_error(None, error)):
                    return
                continue
            if len(text) > MAX_MESSAGE_BYTES // 4 and len(text.encode()) > MAX_MESSAGE_BYTES:
                await self._close(
                    CLOSE_MESSAGE_TOO_BIG, f"message_too_big: limit {MAX_MESSAGE_BYTES} bytes"
                )
                return
            if not await self._send(await self._handle(session, vocabulary, text)):
                return
            if self._strikes >= _FLOOD_STRIKES:
                log.warning("closing a flooding WebSocket of session %s", session.id)
                await self._close(
                    CLOSE_POLICY_VIOLATION, f"rate_limited: {_FLOOD_STRIKES} messages over limit"
                )
                return
            if session.state in _ENDED:
                reason = session.closed_reason or session.state
                await self._close(CLOSE_GOING_AWAY, f"session ended: {reason}")
                return

    async def _handle(self, session: Session, vocabulary: _Vocabulary, text: str) -> str:
        """One request in, one reply out (never raises for a bad request)."""
        client_id: ClientId = None
        try:
            envelope = decode_envelope(text)
            client_id = envelope.id
            body = envelope.body
            actions = vocabulary.parse(body)
            if not scope_allows(self.principal.scope, "control") and not all(
                isinstance(a, _OBSERVATIONS) for a in actions
            ):
                raise TokenError(
                    "a view token may only observe (screenshot, zoom, cursor_position)",
                    code="forbidden",
                )
            if self.limits is not None:
                try:
                    self.limits.check(session.id, actions)
                except DeskvmError:
                    self._strikes += 1
                    raise
            self._strikes = 0
            # The recording keeps vendor-shaped requests as received; deskvm ones are the
            # action itself.
            raw = None if getattr(vocabulary, "name", "deskvm") == "deskvm" else body
            gate, scaler = self.gate, self.scaler
            limits = self.limits
            refund = None if limits is None else (lambda n: limits.refund(session.id, n))
            result = await anyio.to_thread.run_sync(
                lambda: _execute_all(
                    session, actions, raw, vocabulary, body, gate, scaler, refund=refund
                )
            )
            return encode_result(client_id, result)
        except DeskvmError as exc:
            if client_id is None:
                client_id = getattr(exc, "client_id", None)
            return encode_error(client_id, exc)
        except Exception:
            log.exception("unexpected error handling a message for session %s", session.id)
            return json.dumps(
                {
                    "id": client_id,
                    "ok": False,
                    "error": {"code": "internal_error", "message": "internal server error"},
                }
            )


def _execute_all(
    session: Session,
    actions: Sequence[Action],
    raw: Mapping[str, Any] | None,
    vocabulary: _Vocabulary,
    body: Mapping[str, Any],
    gate: Callable[[Session, Action], None] | None = None,
    scaler: Scaler | None = None,
    refund: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    if scaler is not None:
        # Client pixels -> display pixels, all before the first action runs, so a batch
        # with a point outside the scaled screenshot runs nothing.
        actions = [scale_action(a, scaler) for a in actions]
    results = []
    for i, action in enumerate(actions):
        try:
            if gate is not None:
                gate(session, action)  # raises ApprovalDenied / ApprovalTimeout
            result = session.execute(action, source="agent", raw=raw)
        except DeskvmError as exc:
            if refund is not None:
                # Refused actions (ActionError: nothing injected) and those never reached
                # give their typed characters back to the rate limit.
                unrun = actions[i:] if isinstance(exc, ActionError) else actions[i + 1 :]
                refund(sum(len(a.text) for a in unrun if isinstance(a, Type)))
            raise
        results.append(result if scaler is None else _scale_result(action, result, scaler))
    return vocabulary.format_result(body, results)


def _scaler_from_query(
    scale_to: str | None, max_long_edge: str | None, width_px: int, height_px: int
) -> Scaler | None:
    """The connection's screenshot scaling from its URL query (``None``: no scaling).

    ``scale_to=WxH`` sends screenshots of exactly ``W``x``H`` pixels; ``max_long_edge=N``
    shrinks them (keeping the aspect ratio, never enlarging) so the long edge is at most
    ``N`` pixels. Coordinates the client sends are then in that space.

    Raises:
        ProtocolError: code ``invalid_query`` (both given, malformed, out of range).
    """
    if scale_to is None and max_long_edge is None:
        return None
    if scale_to is not None and max_long_edge is not None:
        raise ProtocolError(
            "give scale_to=WxH or max_long_edge=N, not both", code="invalid_query"
        )
    lo, hi = 16, MAX_DISPLAY_PX
    try:
        if scale_to is not None:
            w_text, sep, h_text = scale_to.partition("x")
            if not sep or not w_text.isdigit() or not h_text.isdigit():
                raise ValueError(scale_to)
            size = (int(w_text), int(h_text))
            if not all(lo <= v <= hi for v in size):
                raise ValueError(scale_to)
            return Scaler(width_px, height_px, *size)
        assert max_long_edge is not None
        if not max_long_edge.isdigit() or not lo <= int(max_long_edge) <= hi:
            raise ValueError(max_long_edge)
        return Scaler.for_max_long_edge(width_px, height_px, int(max_long_edge))
    except ValueError:
        raise ProtocolError(
            f"scale_to must be WxH and max_long_edge N, each {lo}..{hi} pixels; got "
            f"scale_to={scale_to!r} max_long_edge={max_long_edge!r}",
            code="invalid_query",
        ) from None


def _scale_result(action: Action, result: Result, scaler: Scaler) -> Result:
    """A result in the client's space: screenshots resized, the pointer position mapped.

    ``zoom`` crops stay at full display resolution (that is what zoom is for).
    """
    if scaler.is_identity:
        return result
    match result:
        case ImageResult() if isinstance(action, Screenshot):
            size = (scaler.client_width_px, scaler.client_height_px)
            with Image.open(io.BytesIO(result.data)) as image:
                scaled = image.convert("RGB").resize(size, Image.Resampling.LANCZOS)
            return ImageResult(size[0], size[1], result.mime, encode_png(scaled), result.frame_seq)
        case CursorResult(x=x, y=y):
            return CursorResult(*scaler.to_client(x, y))
        case _:
            return result


def run_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    log_level: str = "info",
    graceful_timeout_s: float = 10.0,
) -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM, then shut down gracefully.

    Open WebSockets are closed by uvicorn, in-flight requests get ``graceful_timeout_s``
    seconds, then the app's lifespan closes every live session (domains destroyed,
    overlays deleted; recordings kept).

    Args:
        app: from :func:`create_app`.
        host: interface to bind (default loopback only).
        port: TCP port; 0 picks a free one.
        log_level: uvicorn's log level.
        graceful_timeout_s: seconds in-flight requests may take at shutdown.
    """
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        ws_max_size=MAX_MESSAGE_BYTES,
        timeout_graceful_shutdown=int(graceful_timeout_s),
    )
    uvicorn.Server(config).run()
