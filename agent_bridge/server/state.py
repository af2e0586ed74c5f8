"""What the routers share: one :class:`BridgeState` per app, kept on ``app.state.bridge``.

Routers never close over globals; they reach the manager, settings, token authority,
approval desk and rate limits through the :func:`agent_bridge.server.deps.bridge`
dependency, which reads this object. Each session's approval policy lives on the session
(``Session.approval_policy``), which persists it with the rest of its state.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime

import anyio.to_thread

from agent_bridge.cookies import CookieSigner
from agent_bridge.server.models import SessionInfo
from agent_bridge.server.ratelimit import RateLimits
from agent_bridge.tokens import TokenAuthority
from orchestrator.approval import ApprovalDesk
from orchestrator.errors import DeskvmError, SessionNotFound
from orchestrator.manager import SessionManager
from orchestrator.session import Session
from orchestrator.settings import Settings
from orchestrator.takeover import ControlDesk, TakeoverPolicy

__all__ = ["BridgeState", "SessionBook"]

log = logging.getLogger("deskvm.bridge")


class SessionBook:
    """Wall-clock creation and ready times of the sessions this app created.

    The session keeps monotonic times only; the REST view shows UTC times, so the app
    notes them. Entries of sessions the manager has forgotten are pruned on each create.
    """

    def __init__(self) -> None:
        self.created_at: dict[str, datetime] = {}
        self.ready_at: dict[str, datetime] = {}

    def prune(self, known: set[str]) -> None:
        """Forget sessions not in ``known``."""
        for table in (self.created_at, self.ready_at):
            for session_id in [k for k in table if k not in known]:
                del table[session_id]


@dataclass(eq=False)
class BridgeState:
    """Everything one bridge app serves from.

    Attributes:
        manager: creates, finds and deletes sessions.
        settings: server settings (defaults, limits, Origin allowlist, ...).
        admin_token: the server's bearer token (never logged).
        authority: mints and verifies session tokens.
        desk: where held actions wait for an operator.
        limits: per-session action and typing rate limits.
        book: wall-clock creation/ready times.
        controls: who has taken over which session.
        takeover: take-over policy per session id (absent: the default, refuse).
        cookies: signs and checks browser sign-in cookies.
        shutting_down: set when the server begins to shut down (Ctrl-C, SIGTERM): a
            session still booting is ended and its create answers 503
            ``server_shutting_down``.
    """

    manager: SessionManager
    settings: Settings
    admin_token: str
    authority: TokenAuthority
    desk: ApprovalDesk
    limits: RateLimits
    book: SessionBook = field(default_factory=SessionBook)
    controls: ControlDesk = field(default_factory=ControlDesk)
    takeover: dict[str, TakeoverPolicy] = field(default_factory=dict)
    cookies: CookieSigner = field(init=False)
    shutting_down: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        authority = self.authority

        def token_alive(session_id: str, token_id: str) -> bool:
            return any(c.token_id == token_id for c in authority.issued(session_id))

        self.cookies = CookieSigner(ttl_s=self.settings.token_ttl_s, token_alive=token_alive)

    def takeover_policy(self, session_id: str) -> TakeoverPolicy:
        """The session's take-over policy (default: refuse the agent's input)."""
        return self.takeover.get(session_id) or TakeoverPolicy()

    @property
    def accel(self) -> str:
        """The hypervisor's acceleration (``kvm`` or ``tcg``)."""
        return str(self.manager.hypervisor.accel)

    def session_info(self, session: Session, base_url: str) -> SessionInfo:
        """The REST view of ``session``."""
        return SessionInfo.of(
            session,
            base_url=base_url,
            accel=self.accel,
            created_at=self.book.created_at.get(session.id, session.created_at),
            ready_at=self.book.ready_at.get(session.id, session.ready_at),
            takeover=self.takeover_policy(session.id),
            control=self.controls.holder(session.id),
        )

    def store_tokens(self, session_id: str) -> None:
        """Keep ``session_id``'s token state (ids, revocations) in its record, so a
        restarted bridge still refuses a revoked token (``TokenAuthority.on_change``).

        Raises:
            StoreError: the record could not be written.
        """
        try:
            session = self.manager.get(session_id)
        except SessionNotFound:
            return
        if session.state in ("starting", "ready"):
            session.set_extra("tokens", self.authority.export_session(session_id))

    def forget_unknown(self) -> None:
        """Drop per-session bookkeeping of sessions the manager no longer knows."""
        known = {s.id for s in self.manager.all()}
        self.book.prune(known)
        self.limits.forget(known)
        for session_id in [k for k in self.takeover if k not in known]:
            del self.takeover[session_id]

    async def delete_quietly(self, session_id: str, reason: str) -> None:
        """Delete a session in a worker thread, logging (not raising) a teardown failure."""
        manager = self.manager
        try:
            await anyio.to_thread.run_sync(lambda: manager.delete(session_id, reason=reason))
        except DeskvmError as exc:
            log.error("deleting %s (%s) failed: %s", session_id, reason, exc.message)
