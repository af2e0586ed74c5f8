"""The sessions of one server: create (blocking until ready), look up, delete, reap.

The manager owns the server-wide limits (concurrent sessions, total memory) and the
mapping from ids to sessions. It keeps ended sessions in a bounded history so that
clients can still read their state, guest log and recording path after deletion.

:meth:`SessionManager.sweep` enforces each session's lifetime (``ttl_s``) and idle timeout
(``idle_timeout_s``) and reaps leftovers of sessions it does not know; the server calls it
at start and periodically.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from orchestrator.clock import Clock, SystemClock
from orchestrator.egress.base import Egress
from orchestrator.errors import CapacityError, ConfigError, DeskvmError, SessionNotFound
from orchestrator.hypervisor.base import Hypervisor
from orchestrator.hypervisor.domain_xml import hard_limit_mib as _hard_mib
from orchestrator.input_plan import Pacing
from orchestrator.recorder import FileRecorder
from orchestrator.session import Session
from orchestrator.spec import (
    Autostart,
    BootImage,
    DisplaySpec,
    EgressPolicy,
    SessionSpec,
    new_session_id,
    validate_session_id,
)

CLOSED_TTL = "ttl expired"
"""``closed_reason`` of a session ended because it reached its ``ttl_s``."""
CLOSED_DOMAIN_STOPPED = "the domain stopped (guest powered off, crashed or was killed)"
"""``closed_reason`` of a ready session whose QEMU process went away (e.g. the host's
memory hard limit killed it)."""
CLOSED_IDLE = "idle timeout"
"""``closed_reason`` of a session ended after ``idle_timeout_s`` without an action."""

__all__ = ["CLOSED_DOMAIN_STOPPED", "CLOSED_IDLE", "CLOSED_TTL", "SessionManager"]

_HISTORY = 256


class SessionManager:
    """Creates and tracks sessions.

    Args:
        hypervisor: the hypervisor seam.
        resolve_image: image name -> built image (raises ``ImageNotFound``).
        recordings_dir: each session records into ``recordings_dir/<id>``.
        max_sessions: concurrent live sessions (starting or ready).
        clock: time source.
        pacing: input pacing for every session.
        capture_fps: continuous capture rate of every session (``None`` or 0: off).
        max_total_memory_mib: sum of the live sessions' host memory hard limits (guest RAM
            plus QEMU overhead, MiB) the server accepts; ``None``: no limit.
        memory_overhead_mib: QEMU overhead added to each session's hard limit, MiB.
        egress: the egress seam (``NftEgress`` on a host with an upstream configured,
            ``FakeEgress`` in tests); ``None``: sessions with an egress policy are refused.
        new_id: makes each new session's id (default :func:`~orchestrator.spec.new_session_id`;
            a cluster node uses the id its bridge placed, see docs/scale-out.md). The id is
            checked with :func:`~orchestrator.spec.validate_session_id`.
    """

    def __init__(
        self,
        *,
        hypervisor: Hypervisor,
        resolve_image: Callable[[str], BootImage],
        recordings_dir: Path,
        max_sessions: int = 4,
        clock: Clock | None = None,
        pacing: Pacing | None = None,
        ready_poll_s: float = 0.5,
        capture_fps: float | None = None,
        max_total_memory_mib: int | None = None,
        memory_overhead_mib: int = 768,
        egress: Egress | None = None,
        new_id: Callable[[], str] = new_session_id,
    ) -> None:
        self.hypervisor = hypervisor
        self._new_id = new_id
        self.egress = egress
        self._max_total_memory_mib = max_total_memory_mib
        self._memory_overhead_mib = memory_overhead_mib
        self._resolve_image = resolve_image
        self._recordings_dir = recordings_dir
        self._max_sessions = max_sessions
        self._clock = clock or SystemClock()
        self._pacing = pacing
        self._ready_poll_s = ready_poll_s
        self._capture_fps = capture_fps or None
        self._live: dict[str, Session] = {}
        self._ended: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def create(
        self,
        *,
        image: str,
        display: DisplaySpec,
        memory_mib: int = 2048,
        vcpus: int = 2,
        boot_timeout_s: float = 180.0,
        on_started: Callable[[Session], None] | None = None,
        cpu_quota_pct: int | None = None,
        disk_mib: int | None = None,
        ttl_s: float | None = None,
        idle_timeout_s: float | None = None,
        autostart: Autostart | None = None,
        egress: EgressPolicy | None = None,
    ) -> Session:
        """Start a session and block until its desktop is drawn.

        Args:
            on_started: called with the session as soon as it is registered (before the
                boot wait), e.g. to let a caller cancel it.
            cpu_quota_pct, disk_mib, ttl_s, idle_timeout_s: per-session limits, see
                :class:`~orchestrator.spec.SessionSpec`.
            autostart: what the guest starts instead of the xterm (e.g. ``"input-probe"``);
                also decides the readiness criterion.
            egress: the session's network allowlist; ``None`` (default) means no NIC at
                all. An empty policy gets a NIC, DHCP and a resolver that answers nothing.

        Raises:
            CapacityError: ``over_capacity`` (``max_sessions`` are live already) or
                ``over_memory`` (the hard limits would exceed ``max_total_memory_mib``);
                checked before anything is started.
            ConfigError: this session alone needs more than ``max_total_memory_mib`` (it
                could never start), before anything is started.
            ConfigError, ImageNotFound: bad request; ``ConfigError`` with code
                ``egress_not_configured`` when a policy is given and this manager has no
                egress (no upstream configured).
            HypervisorError, BootTimeout, EgressError: could not start (nothing is left
                behind).
        """
        if egress is not None and self.egress is None:
            raise ConfigError(
                "this server has no egress upstream configured, so sessions with an egress "
                "policy are refused (start it with --egress-upstream-iface IFACE "
                "--egress-upstream-dns IP[,IP])",
                code="egress_not_configured",
            )
        boot_image = self._resolve_image(image)
        session_id = validate_session_id(self._new_id())
        with self._lock:
            if session_id in self._live or session_id in self._ended:
                raise ConfigError(f"session id {session_id} is already in use")
        spec = SessionSpec(
            session_id=session_id,
            image=boot_image,
            display=display,
            memory_mib=memory_mib,
            vcpus=vcpus,
            boot_timeout_s=boot_timeout_s,
            cpu_quota_pct=cpu_quota_pct,
            memory_overhead_mib=self._memory_overhead_mib,
            disk_mib=disk_mib,
            ttl_s=ttl_s,
            idle_timeout_s=idle_timeout_s,
            autostart=autostart,
            egress=egress,
        )
        with self._lock:
            if len(self._live) >= self._max_sessions:
                raise CapacityError(
                    f"{len(self._live)} of {self._max_sessions} sessions are running; "
                    "delete one or raise --max-sessions"
                )
            if self._max_total_memory_mib is not None:
                if _hard_mib(spec) > self._max_total_memory_mib:
                    raise ConfigError(
                        f"memory_mib {memory_mib} needs {_hard_mib(spec)} MiB of host memory"
                        f" (+ {spec.memory_overhead_mib} MiB QEMU overhead and the display's"
                        f" video memory); this server gives all sessions together at most"
                        f" {self._max_total_memory_mib} MiB (max_total_memory_mib, by default"
                        " derived from the host's RAM)"
                    )
                used = sum(_hard_mib(s.spec) for s in self._live.values())
                if used + _hard_mib(spec) > self._max_total_memory_mib:
                    raise CapacityError(
                        f"{used} MiB of {self._max_total_memory_mib} MiB are committed to live"
                        f" sessions; this one needs {_hard_mib(spec)} MiB (memory_mib"
                        f" {memory_mib} + {spec.memory_overhead_mib} MiB QEMU overhead)",
                        code="over_memory",
                    )
            recorder = FileRecorder(
                self._recordings_dir / spec.session_id,
                self._clock,
                {
                    "session_id": spec.session_id,
                    "image": {"name": boot_image.name, "content_hash": boot_image.content_hash},
                    "display": {"width": display.width_px, "height": display.height_px},
                    "memory_mib": memory_mib,
                    "vcpus": vcpus,
                    "accel": self.hypervisor.accel,
                    "limits": {
                        "memory_hard_limit_mib": _hard_mib(spec),
                        "cpu_quota_pct": cpu_quota_pct,
                        "disk_mib": disk_mib,
                        "ttl_s": ttl_s,
                        "idle_timeout_s": idle_timeout_s,
                    },
                    "egress": None if egress is None else {"allow": list(egress.allow)},
                },
            )
            session = Session(
                spec,
                hypervisor=self.hypervisor,
                recorder=recorder,
                clock=self._clock,
                pacing=self._pacing,
                ready_poll_s=self._ready_poll_s,
                capture_fps=self._capture_fps,
                egress=self.egress,
            )
            self._live[spec.session_id] = session
        if on_started is not None:
            on_started(session)
        try:
            session.start()
        except BaseException:
            self._retire(session)
            raise
        return session

    def _retire(self, session: Session) -> None:
        with self._lock:
            self._live.pop(session.id, None)
            self._ended[session.id] = session
            while len(self._ended) > _HISTORY:
                self._ended.popitem(last=False)

    def resolve_image(self, name: str) -> BootImage:
        """The built image called ``name`` (with its content hash).

        Raises:
            ImageNotFound: no such image is built.
        """
        return self._resolve_image(name)

    @property
    def recordings_dir(self) -> Path:
        """Where each session's recording directory is created."""
        return self._recordings_dir

    def get(self, session_id: str) -> Session:
        """The live or recently ended session with this id.

        Raises:
            SessionNotFound: unknown id.
        """
        with self._lock:
            session = self._live.get(session_id) or self._ended.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return session

    def live(self) -> list[Session]:
        with self._lock:
            return list(self._live.values())

    def all(self) -> list[Session]:
        with self._lock:
            return [*self._live.values(), *self._ended.values()]

    def delete(self, session_id: str, *, reason: str = "deleted") -> Session:
        """Close a session (idempotent for ended ones) and return it.

        Raises:
            SessionNotFound: unknown id.
            HypervisorError: teardown incomplete (the session is still retired).
        """
        session = self.get(session_id)
        try:
            session.close(reason=reason)
        finally:
            self._retire(session)
        return session

    def close_all(self, *, reason: str = "server shutdown") -> list[str]:
        """Close every live session; returns error messages of failed teardowns."""
        errors: list[str] = []
        for session in self.live():
            try:
                self.delete(session.id, reason=reason)
            except DeskvmError as exc:
                errors.append(f"{session.id}: {exc.message}")
        return errors

    def expire(self) -> list[str]:
        """Close live sessions past their ``ttl_s`` or ``idle_timeout_s``, or whose domain died.

        Their ``closed_reason`` is :data:`CLOSED_TTL`, :data:`CLOSED_IDLE` or
        :data:`CLOSED_DOMAIN_STOPPED`. A teardown
        error is swallowed here (the session is retired; the reaper retries leftovers).

        Returns:
            The session ids closed.
        """
        now_ns = self._clock.monotonic_ns()
        closed = []
        for session in self.live():
            spec = session.spec
            reason = None
            if spec.ttl_s is not None and now_ns - session.created_ns >= spec.ttl_s * 1e9:
                reason = CLOSED_TTL
            elif session.state == "ready" and not session.domain_running():
                reason = CLOSED_DOMAIN_STOPPED
            elif (
                spec.idle_timeout_s is not None
                and session.state == "ready"
                and now_ns - session.last_action_ns >= spec.idle_timeout_s * 1e9
            ):
                reason = CLOSED_IDLE
            if reason is not None:
                with contextlib.suppress(DeskvmError):
                    self.delete(session.id, reason=reason)
                closed.append(session.id)
        return closed

    def sweep(self) -> tuple[list[str], list[str]]:
        """One pass of the server's periodic housekeeping: :meth:`expire`, then :meth:`reap`.

        Returns:
            ``(expired, reaped)`` session ids.
        """
        expired = self.expire()
        reaped: list[str] = []
        with contextlib.suppress(DeskvmError):
            reaped = self.reap()
        return expired, reaped

    def reap(self) -> list[str]:
        """Destroy hypervisor and egress leftovers of sessions this manager does not know.

        Returns:
            The session ids removed (sorted).
        """
        # List first, then read the live ids: a session registers before its domain exists,
        # so any domain in the listing belongs to a session already in ``_live`` (the other
        # order would reap a session created between the two reads).
        found = self.hypervisor.list_sessions()
        with self._lock:
            known = set(self._live)
        removed = set()
        for session_id in sorted(found - known):
            with contextlib.suppress(DeskvmError):
                self.hypervisor.destroy(session_id)
                removed.add(session_id)
        if self.egress is not None:
            # Under the lock: a session registers before it attaches, so none can attach
            # between reading the live ids and the egress listing its leftovers.
            with self._lock, contextlib.suppress(DeskvmError):
                removed.update(self.egress.reap(frozenset(self._live)))
        return sorted(removed)
