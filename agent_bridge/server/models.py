"""The bridge's wire models: pydantic bodies and replies of the REST API (the HTTP edge).

Request bodies are strict (``extra="forbid"``, no type coercion): an unknown or mistyped
field answers 422 ``invalid_request`` naming it. Replies are built from orchestrator values
by the ``of`` class methods; nothing here does I/O.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agent_bridge.protocol.actions import action_to_dict
from agent_bridge.protocol.keys import KeyboardLayout
from agent_bridge.tokens import Claims
from orchestrator.approval import ApprovalPolicy, PendingAction
from orchestrator.hypervisor.domain_xml import hard_limit_mib
from orchestrator.session import Session
from orchestrator.spec import MAX_DISPLAY_PX, MAX_EGRESS_ENTRIES, MIN_DISPLAY_PX
from orchestrator.takeover import Control, TakeoverPolicy

__all__ = [
    "ApprovalPolicyModel",
    "ControlInfo",
    "CreateSessionRequest",
    "CursorModel",
    "DecisionRequest",
    "DisplayModel",
    "EgressInfo",
    "EgressRequest",
    "ErrorBody",
    "ErrorDetail",
    "ExtendRequest",
    "HealthResponse",
    "LimitsModel",
    "MintTokenRequest",
    "NetworkDecisionModel",
    "PendingInfo",
    "SessionInfo",
    "TakeoverPolicyModel",
    "TokenInfo",
    "ws_base",
]

_IMAGE_NAME_RE = r"^[a-z0-9][a-z0-9._-]{0,63}$"


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
    argv_patterns: list[str] = Field(
        default_factory=list,
        description="regular expressions on a guest exec's argv, shell-quoted and joined"
        " (re.search)",
    )
    path_patterns: list[str] = Field(
        default_factory=list,
        description="regular expressions on the path of put_file / get_file (re.search)",
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
            argv_patterns=tuple(self.argv_patterns),
            path_patterns=tuple(self.path_patterns),
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
            argv_patterns=list(policy.argv_patterns),
            path_patterns=list(policy.path_patterns),
        )


class TakeoverPolicyModel(_Strict):
    """What the agent's input actions get while a person has taken the session over."""

    agent: Literal["refuse", "wait"] = Field(
        "refuse",
        description="refuse: error human_in_control at once; wait: run after the hand-back",
    )
    wait_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="wait: the longest an agent action waits, seconds"
    )

    def to_policy(self) -> TakeoverPolicy:
        return TakeoverPolicy(agent=self.agent, wait_timeout_s=self.wait_timeout_s)

    @classmethod
    def of(cls, policy: TakeoverPolicy) -> TakeoverPolicyModel:
        return cls(agent=policy.agent, wait_timeout_s=policy.wait_timeout_s)


class ControlInfo(BaseModel):
    """Who has taken the session over (``GET /v1/sessions/{id}/control``)."""

    holder: str = Field(description="admin or token:<id>")
    since: datetime = Field(description="UTC")

    @classmethod
    def of(cls, control: Control | None) -> ControlInfo | None:
        if control is None:
            return None
        return cls(holder=control.holder, since=datetime.fromtimestamp(control.since_unix, UTC))


class LimitsModel(BaseModel):
    """Host-enforced limits of a session."""

    memory_hard_limit_mib: int = Field(
        description="guest RAM + QEMU overhead + video memory beyond 16 MiB, cgroup max"
    )
    cpu_quota_pct: int | None = Field(description="percent of one host core; null: none")
    disk_mib: int | None = Field(description="guest disk cap; null: the image's size")
    ttl_s: float | None = Field(description="maximum lifetime, seconds")
    idle_timeout_s: float | None = Field(description="idle timeout, seconds")


class MintTokenRequest(_Strict):
    """Body of ``POST /v1/sessions/{id}/tokens``."""

    scope: Literal["view", "control", "exec", "admin"] = Field(
        description="view: frames only; control: actions; admin: lifecycle and policy"
    )
    ttl_s: float | None = Field(None, gt=0, description="lifetime, seconds; default 900")
    single_use: bool = Field(False, description="valid for one WebSocket connection only")


class TokenInfo(BaseModel):
    """A minted token (the ``token`` itself is shown only once, in the mint response)."""

    token: str | None = Field(None, description="the bearer credential; only when minted")
    token_id: str = Field(description="handle for revocation (safe to log)")
    session_id: str
    scope: Literal["view", "control", "exec", "admin"]
    expires_at: datetime = Field(description="UTC")
    single_use: bool

    @classmethod
    def of(cls, claims: Claims, token: str | None = None) -> TokenInfo:
        """The reply for ``claims``; ``token`` only in the mint response."""
        return cls(
            token=token,
            token_id=claims.token_id,
            session_id=claims.session_id,
            scope=claims.scope,
            expires_at=datetime.fromtimestamp(claims.expires_at, UTC),
            single_use=claims.single_use,
        )


class PendingInfo(BaseModel):
    """An action held for an operator's decision."""

    pending_id: str
    session_id: str
    action: dict[str, Any] = Field(description="the held action, deskvm form")
    reason: str = Field(description="which rule held it")
    seconds_left: float = Field(description="until it is denied automatically")
    frame_url: str = Field(description="PNG of the screen when it was held")

    @classmethod
    def of(cls, item: PendingAction, base_url: str) -> PendingInfo:
        """The reply for a held action; ``base_url`` is the server's (for ``frame_url``)."""
        left_s = max(0.0, (item.deadline_ns - time.monotonic_ns()) / 1e9)
        return cls(
            pending_id=item.pending_id,
            session_id=item.session_id,
            action=action_to_dict(item.action),
            reason=item.reason,
            seconds_left=round(left_s, 3),
            frame_url=f"{base_url.rstrip('/')}/v1/sessions/{item.session_id}/pending/"
            f"{item.pending_id}/frame",
        )


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
    keyboard_layout: KeyboardLayout | None = Field(
        None,
        description="the guest's XKB keyboard layout: 'us', 'de' or 'fr' (typing and key combos"
        " follow it: 'z' on 'de' is the key US calls 'y', ctrl+z stays undo); null: the image's",
    )
    takeover: TakeoverPolicyModel | None = Field(
        None, description="the agent's input while a person has taken over; null: refuse"
    )
    guest_control: bool = Field(
        False,
        description="allow the guest control plane (exec, files, clipboard, windows,"
        " accessibility tree, resolution; token scope 'exec'); off by default",
    )


class EgressInfo(BaseModel):
    """A session's network: its policy and where the guest sits (null: no NIC)."""

    allow: list[str]
    bridge: str | None = Field(description="host bridge (dvm<id>) once attached")
    guest_ip: str | None = Field(description="IPv4 the guest gets by DHCP")
    gateway_ip: str | None = Field(description="bridge address: the guest's router and DNS")
    guest_mac: str | None = Field(
        None,
        description="the one source MAC the bridge lets in: the session's own (cold start)"
        " or the one baked into the warm pool's saved desktop (warm start; every clone has"
        " it, each behind its own bridge)",
    )

    @classmethod
    def of(cls, session: Session) -> EgressInfo | None:
        """The session's network, or ``None`` when it has no egress policy (no NIC)."""
        policy = session.spec.egress
        if policy is None:
            return None
        attachment = session.egress_attachment
        return cls(
            allow=list(policy.allow),
            bridge=attachment.bridge if attachment else None,
            guest_ip=attachment.guest_ip if attachment else None,
            gateway_ip=attachment.gateway_ip if attachment else None,
            guest_mac=attachment.guest_mac if attachment else None,
        )


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
    attempts: int = Field(
        1, description="how often the guest sent this same request (retries are counted here)"
    )
    last_ts_ns: int | None = Field(None, description="CLOCK_MONOTONIC ns of the last attempt")


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
    boot_s: float | None = Field(
        description="seconds from domain start (cold) or from the claim (warm) to ready"
    )
    start: Literal["warm", "cold"] | None = Field(
        None,
        description="'warm': a desktop restored from a saved state was handed out (warm "
        "pool); 'cold': the domain booted; null: not started (or re-adopted)",
    )
    resets: int = Field(0, description="how often the session was reset (POST .../reset)")
    last_reset_s: float | None = Field(None, description="seconds the last reset took")
    start_phases_s: dict[str, float] = Field(
        default_factory=dict,
        description="seconds per start phase: claim_s (warm), egress_s (with a policy), "
        "domain_start_s (cold), clock_s (warm: the guest's wall clock set), ready_s (until "
        "a drawn frame); a warm start with egress also restore_s (the saved desktop restored"
        " onto the session's network), link_s (its NIC's link down and up again) and "
        "lease_s (until the guest leased the session's address)",
    )
    recording: str | None = Field(description="recording bundle directory (kept after end)")
    cursor: CursorModel
    closed_reason: str | None
    limits: LimitsModel | None = None
    autostart: str | None = Field(None, description="what the guest started instead of the xterm")
    guest_control: bool = Field(False, description="whether the guest control plane is on")
    keyboard_layout: str = Field("us", description="the guest's keyboard layout (XKB name)")
    egress: EgressInfo | None = Field(None, description="null: no network device at all")
    expires_at: datetime | None = Field(
        None, description="UTC, when ttl_s runs out (PATCH ttl_s to move it); null: never"
    )
    idle_expires_at: datetime | None = Field(
        None, description="UTC, when idle_timeout_s runs out unless an action comes first"
    )
    takeover: TakeoverPolicyModel | None = Field(None, description="the take-over policy")
    control: ControlInfo | None = Field(
        None, description="who has taken the session over; null: the agent drives"
    )

    @classmethod
    def of(
        cls,
        session: Session,
        *,
        base_url: str,
        accel: str,
        created_at: datetime | None,
        ready_at: datetime | None,
        takeover: TakeoverPolicy | None = None,
        control: Control | None = None,
    ) -> SessionInfo:
        """The REST view of ``session``; ``base_url`` is the server's (for ``ws_url``)."""
        spec = session.spec
        path = session.recorder.path
        x, y = session.cursor
        return cls(
            id=session.id,
            state=session.state,
            ws_url=f"{ws_base(base_url.rstrip('/'))}/v1/sessions/{session.id}/ws",
            image=spec.image.name,
            display=DisplayModel(width=spec.display.width_px, height=spec.display.height_px),
            memory_mib=spec.memory_mib,
            vcpus=spec.vcpus,
            accel=accel,
            created_at=created_at,
            ready_at=ready_at,
            boot_s=round(session.boot_s, 3) if session.boot_s is not None else None,
            start=session.start_kind,
            resets=session.resets,
            last_reset_s=session.last_reset_s,
            start_phases_s=dict(session.start_phases_s),
            recording=str(path) if path is not None else None,
            cursor=CursorModel(x=x, y=y),
            closed_reason=session.closed_reason,
            autostart=spec.autostart,
            guest_control=spec.guest_control,
            keyboard_layout=spec.layout,
            limits=LimitsModel(
                memory_hard_limit_mib=hard_limit_mib(spec),
                cpu_quota_pct=spec.cpu_quota_pct,
                disk_mib=spec.disk_mib,
                ttl_s=spec.ttl_s,
                idle_timeout_s=spec.idle_timeout_s,
            ),
            egress=EgressInfo.of(session),
            takeover=TakeoverPolicyModel.of(takeover) if takeover is not None else None,
            control=ControlInfo.of(control),
            **_expiries(session),
        )


def _expiries(session: Session) -> dict[str, datetime | None]:
    if session.state not in ("starting", "ready"):
        return {}
    now = datetime.now(UTC)
    ttl_s, idle_s = session.seconds_left()
    return {
        "expires_at": None if ttl_s is None else now + timedelta(seconds=ttl_s),
        "idle_expires_at": None if idle_s is None else now + timedelta(seconds=idle_s),
    }


class ExtendRequest(_Strict):
    """Body of ``PATCH /v1/sessions/{id}``."""

    ttl_s: float = Field(
        gt=0,
        description="the session's new maximum lifetime, seconds from its creation (not "
        "from now): more than it has run, at most the server's maximum; may also shorten it",
    )


class WarmPoolStatus(BaseModel):
    """One warm pool target (``deskvm serve --warm-pool IMAGE:N`` or ``IMAGE:egress``)."""

    image: str
    egress: bool = Field(
        default=False,
        description="for sessions with an egress policy: one saved desktop with a NIC,"
        " restored onto each claiming session's own network",
    )
    size: int = Field(description="desktops kept ready (an egress target: 1 saved desktop)")
    display: list[int] = Field(description="[width, height], pixels")
    memory_mib: int
    vcpus: int
    ready: int = Field(description="desktops ready to claim now (egress: 1 once saved)")
    phase: Literal["new", "building", "filling", "full", "failed"]
    error: str | None = Field(description="why the last build or restore failed")
    image_hash: str | None
    template_boot_s: float | None = Field(description="cold boot of the template, seconds")
    save_s: float | None = Field(description="saving the template's state, seconds")
    restore_s: list[float] = Field(description="the last restores, seconds each")
    claims: int = Field(0, description="desktops handed out since the server started")
    waited_claims: int = Field(
        0, description="of which found the pool empty and waited for the restore under way"
    )
    empty_claims: int = Field(
        0, description="claims that found no desktop ready nor coming (they booted cold)"
    )
    handover_failures: int = Field(
        0, description="claimed desktops that could not be taken over (they booted cold)"
    )
    reset_spares: int = Field(
        0, description="its sessions' reset spares ready now (next generations restored ahead)"
    )
    spare_resets: int = Field(
        0, description="resets of its sessions that found their spare ready or under way"
    )
    restored_resets: int = Field(
        0, description="resets of its sessions that had no spare (they restored)"
    )


class HealthResponse(BaseModel):
    """``GET /healthz``."""

    ok: bool
    sessions: int = Field(description="live sessions (starting or ready)")
    warm_pool: list[WarmPoolStatus] = Field(
        default_factory=list, description="the warm pool's targets (empty: no pool)"
    )


class ErrorDetail(BaseModel):
    """The ``error`` object of every error body."""

    code: str
    message: str
    console_tail: str | None = Field(None, description="boot_timeout only: guest console tail")
    details: list[Any] | None = Field(None, description="invalid_request only: field errors")


class ErrorBody(BaseModel):
    """Every REST error answers ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


def ws_base(url: str) -> str:
    """``http(s)://...`` -> ``ws(s)://...`` (other URLs unchanged)."""
    if url.startswith("https://"):
        return "wss://" + url.removeprefix("https://")
    if url.startswith("http://"):
        return "ws://" + url.removeprefix("http://")
    return url
