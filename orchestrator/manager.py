"""The sessions of one server: create (blocking until ready), look up, delete, reap.

The manager owns the server-wide limits (concurrent sessions, total memory) and the
mapping from ids to sessions. It keeps ended sessions in a bounded history so that
clients can still read their state, guest log and recording path after deletion.

:meth:`SessionManager.sweep` enforces each session's lifetime (``ttl_s``) and idle timeout
(``idle_timeout_s``) and reaps leftovers of sessions it does not know; the server calls it
at start and periodically.

Bridge restarts: with a :class:`~orchestrator.store.SessionStore` and a named
:class:`~orchestrator.instance.Instance`, every session keeps a record; a server that
restarts under the same name calls :meth:`SessionManager.adopt` first and carries on with
the sessions it left running (their recordings continue after a ``gap`` marker). A
session whose server is gone is left alone for ``adopt_grace_s`` (its server may come
back); after that, or at once if that server can never come back (an unnamed instance,
another boot, a session still starting), the reaper ends it and seals its recording as
truncated. :meth:`SessionManager.detach_all` leaves the sessions running at a graceful
exit (``deskvm serve --on-exit keep``).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent_bridge.protocol.keys import KeyboardLayout
from orchestrator.clock import Clock, SystemClock
from orchestrator.egress.base import Egress
from orchestrator.errors import (
    CapacityError,
    ConfigError,
    DeskvmError,
    HypervisorError,
    SessionClosed,
    SessionNotFound,
)
from orchestrator.hypervisor.base import Hypervisor
from orchestrator.hypervisor.domain_xml import hard_limit_mib as _hard_mib
from orchestrator.input_plan import Pacing
from orchestrator.instance import Instance, boot_id
from orchestrator.pool import (
    DEFAULT_CPU_WEIGHT,
    PoolKey,
    PoolTarget,
    WarmDesktop,
    WarmPool,
    WarmState,
    remove_stale_pools,
)
from orchestrator.recorder import FileRecorder, seal, writer_alive
from orchestrator.session import CLOSED_DOMAIN_STOPPED, CLOSED_IDLE, CLOSED_TTL, Session
from orchestrator.spec import (
    Autostart,
    BootImage,
    DisplaySpec,
    EgressPolicy,
    SessionSpec,
    new_session_id,
    validate_session_id,
)
from orchestrator.store import SessionRecord, SessionStore

__all__ = [
    "ADOPT_GRACE_S",
    "CLOSED_DOMAIN_STOPPED",
    "CLOSED_IDLE",
    "CLOSED_TTL",
    "GAP_REASON",
    "AdoptReport",
    "SessionManager",
]

_HISTORY = 256

ADOPT_GRACE_S = 300.0
"""How long a session whose server is gone waits for that server to restart, seconds."""
GAP_REASON = "the bridge server restarted (sessions re-adopted)"
"""``reason`` of the ``gap`` marker a re-adopted session's recording gets."""


@dataclass(slots=True)
class AdoptReport:
    """What :meth:`SessionManager.adopt` did at server start.

    Attributes:
        adopted: sessions taken back (running again in this server).
        failed: ``{id: why}`` of this server's sessions that could not be taken back
            (they were ended, their recordings closed with the reason).
        reaped: ``{id: why}`` of sessions nobody will take back (torn down, recordings
            sealed truncated).
        waiting: sessions of another named server that is gone but still within the
            grace period (left running).
        sealed: recordings left ``recording`` by a dead writer and now sealed truncated.
    """

    adopted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    reaped: dict[str, str] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)
    sealed: list[str] = field(default_factory=list)


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
        store: where sessions keep their records for a restart (``None``: nowhere;
            nothing can be re-adopted).
        instance: this server's identity in the installation (its name owns the records;
            the liveness of other servers decides what the reaper may touch).
        adopt_grace_s: how long sessions of a gone named server are left running for it
            to come back (:data:`ADOPT_GRACE_S`).
        warm_pool: desktops to keep restored and ready (:mod:`orchestrator.pool`); a
            matching :meth:`create` takes one over instead of booting (a session with an
            egress policy restores an egress target's saved desktop onto its own
            network, see :meth:`Session.start`). Their memory counts
            in ``max_total_memory_mib``. Only with the default ``new_id`` (a cluster node's
            ids are placed by its bridge) and a ``pool_dir``.
        pool_dir: where the warm pool keeps its saved states (``<pool root>/<server
            name>``); the reaper removes the directories of gone servers beside it.

    The warm pool starts refilling at :meth:`start_pool` (the server calls it after
    :meth:`adopt`) and is removed by :meth:`close_pool`.
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
        ready_poll_s: float = 0.1,
        capture_fps: float | None = None,
        max_total_memory_mib: int | None = None,
        memory_overhead_mib: int = 768,
        egress: Egress | None = None,
        new_id: Callable[[], str] = new_session_id,
        store: SessionStore | None = None,
        instance: Instance | None = None,
        adopt_grace_s: float = ADOPT_GRACE_S,
        warm_pool: tuple[PoolTarget, ...] = (),
        pool_dir: Path | None = None,
    ) -> None:
        self.hypervisor = hypervisor
        self.store = store
        self.instance = instance
        self.adopt_grace_s = adopt_grace_s
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
        if warm_pool and (pool_dir is None or new_id is not new_session_id):
            raise ConfigError(
                "a warm pool needs a pool directory and server-made session ids "
                "(not available on cluster nodes)"
            )
        self._pool_dir = pool_dir
        self.pool: WarmPool | None = None
        self._start_keys: dict[str, PoolKey] = {}  # warm sessions -> their pool key
        """The warm pool (``None``: every session boots cold)."""
        if warm_pool and pool_dir is not None:
            self.pool = WarmPool(
                warm_pool,
                hypervisor=hypervisor,
                resolve_image=resolve_image,
                pool_dir=pool_dir,
                new_id=new_id,
                reserve=self._pool_reserve,
                memory_overhead_mib=memory_overhead_mib,
                egress=egress,
            )

    def start_pool(self) -> None:
        """Start filling the warm pool (a no-op without one)."""
        if self.pool is not None:
            self.pool.start()

    def close_pool(self) -> None:
        """Destroy the warm pool's desktops and saved states (a no-op without one)."""
        if self.pool is not None:
            self.pool.close()

    def _pool_reserve(self, mib: int) -> bool:
        """Whether the pool may commit ``mib`` MiB more without crowding out sessions."""
        if self._max_total_memory_mib is None:
            return True
        with self._lock:
            used = sum(_hard_mib(s.spec) for s in self._live.values())
        pool = self.pool.memory_mib() if self.pool is not None else 0
        return used + pool + mib <= self._max_total_memory_mib

    def _claim(
        self,
        image: BootImage,
        display: DisplaySpec,
        memory_mib: int,
        vcpus: int,
        *,
        plain: bool,
    ) -> tuple[WarmDesktop | None, float]:
        """A pooled desktop for this request (``None``: boot cold) and the claim's time."""
        if self.pool is None or not plain:
            return None, 0.0
        t0 = self._clock.monotonic_ns()
        key = PoolKey.of(image, display, memory_mib, vcpus, network=False)
        desktop = self.pool.claim(key)
        if desktop is not None:
            try:
                if not desktop.live_weight:  # the pool's head has it already
                    self.hypervisor.set_cpu_weight(desktop.spec.session_id, DEFAULT_CPU_WEIGHT)
                self.hypervisor.resume(desktop.spec.session_id)  # pooled desktops wait paused
                # The session's own link to its start state (for resets; outlives the pool's).
                desktop.state = self.hypervisor.keep_state(desktop.spec.session_id, desktop.state)
            except DeskvmError as exc:
                self.pool.handover_failed(desktop, exc.message)
                self.pool.settled(desktop.spec.session_id)
                with contextlib.suppress(DeskvmError):
                    self.hypervisor.destroy(desktop.spec.session_id)
                desktop = None
        return desktop, round((self._clock.monotonic_ns() - t0) / 1e9, 3)

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
        guest_control: bool = False,
        keyboard_layout: KeyboardLayout | None = None,
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
            guest_control: allow the guest control plane (exec, files, clipboard...) on
                this session; off by default.
            keyboard_layout: the guest's keyboard layout (``us``, ``de``, ``fr``); ``None``:
                the image's.

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
        with self._lock:
            if len(self._live) >= self._max_sessions:
                raise CapacityError(
                    f"{len(self._live)} of {self._max_sessions} sessions are running; "
                    "delete one or raise --max-sessions"
                )
        plain = autostart is None and cpu_quota_pct is None and disk_mib is None
        # Pooled desktops booted with the image's keyboard layout.
        plain = plain and keyboard_layout in (None, boot_image.keyboard_layout)
        warm, claim_s = self._claim(
            boot_image, display, memory_mib, vcpus, plain=plain and egress is None
        )
        saved: WarmState | None = None
        if plain and egress is not None and self.pool is not None:
            t0 = self._clock.monotonic_ns()
            key = PoolKey.of(boot_image, display, memory_mib, vcpus, network=True)
            saved = self.pool.claim_state(key)
            claim_s = round((self._clock.monotonic_ns() - t0) / 1e9, 3)
        try:
            return self._start_registered(
                warm, saved, claim_s, on_started, boot_image, display, memory_mib, vcpus,
                boot_timeout_s, cpu_quota_pct, disk_mib, ttl_s, idle_timeout_s, autostart,
                egress, guest_control, keyboard_layout,
            )  # fmt: skip
        finally:
            if warm is not None and self.pool is not None:
                # Ready or failed: the pool's refill may restore the next desktop now.
                self.pool.settled(warm.spec.session_id)
                self._want_spare(warm.spec.session_id)

    def _want_spare(self, session_id: str) -> None:
        """Ask the pool for a reset spare of a live warm session (see
        :meth:`WarmPool.want_spare`)."""
        with self._lock:
            session = self._live.get(session_id)
        if self.pool is None or session is None or session.state != "ready":
            return
        key = self._start_keys.get(session_id)
        if session.start_state is not None and key is not None:
            self.pool.want_spare(session.spec, session.start_state, key)

    def _start_registered(
        self,
        warm: WarmDesktop | None,
        saved: WarmState | None,
        claim_s: float,
        on_started: Callable[[Session], None] | None,
        boot_image: BootImage,
        display: DisplaySpec,
        memory_mib: int,
        vcpus: int,
        boot_timeout_s: float,
        cpu_quota_pct: int | None,
        disk_mib: int | None,
        ttl_s: float | None,
        idle_timeout_s: float | None,
        autostart: Autostart | None,
        egress: EgressPolicy | None,
        guest_control: bool,
        keyboard_layout: KeyboardLayout | None,
    ) -> Session:
        """Register the session and start it (warm, warm with egress or cold)."""
        try:
            session = self._register(
                warm, boot_image, display, memory_mib, vcpus, boot_timeout_s, cpu_quota_pct,
                disk_mib, ttl_s, idle_timeout_s, autostart, egress, guest_control,
                keyboard_layout,
            )  # fmt: skip
        except BaseException:
            if warm is not None:
                with contextlib.suppress(DeskvmError):
                    self.hypervisor.destroy(warm.spec.session_id)
            raise
        finally:
            if warm is not None and self.pool is not None:
                self.pool.release(warm.spec.session_id)
        if on_started is not None:
            on_started(session)
        try:
            if warm is not None:
                session.start_state = warm.state
                self._start_keys[session.id] = warm.key
                session.start(warm=warm.domain, claim_s=claim_s)
            elif saved is not None:
                # Restored onto the session's own network (see Session.start).
                session.start(
                    claim_s=claim_s, restore_from=saved.state, restore_mac=saved.guest_mac
                )
            else:
                session.start()
        except BaseException:
            self._retire(session)
            raise
        return session

    def _register(
        self,
        warm: WarmDesktop | None,
        boot_image: BootImage,
        display: DisplaySpec,
        memory_mib: int,
        vcpus: int,
        boot_timeout_s: float,
        cpu_quota_pct: int | None,
        disk_mib: int | None,
        ttl_s: float | None,
        idle_timeout_s: float | None,
        autostart: Autostart | None,
        egress: EgressPolicy | None,
        guest_control: bool,
        keyboard_layout: KeyboardLayout | None,
    ) -> Session:
        """Check the limits and register a new session (its recording starts here)."""
        if warm is not None:
            session_id = warm.spec.session_id
        else:
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
            guest_control=guest_control,
            keyboard_layout=keyboard_layout,
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
                pooled = self.pool.memory_mib() if self.pool is not None else 0
                if (
                    warm is None
                    and pooled
                    and used + pooled + _hard_mib(spec) > (self._max_total_memory_mib)
                ):
                    # Pool desktops make room for a session that has to boot cold.
                    self.pool.evict(used + pooled + _hard_mib(spec) - self._max_total_memory_mib)  # type: ignore[union-attr]
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
                store=self.store,
                owner=self.owner,
            )
            self._live[spec.session_id] = session
        return session

    def _retire(self, session: Session) -> None:
        if self.pool is not None:
            self.pool.drop_spare(session.id)
        self._start_keys.pop(session.id, None)
        with self._lock:
            self._live.pop(session.id, None)
            self._ended[session.id] = session
            while len(self._ended) > _HISTORY:
                self._ended.popitem(last=False)

    @property
    def owner(self) -> str:
        """This server's instance name (``""`` without an instance)."""
        return "" if self.instance is None else self.instance.name

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
        :data:`CLOSED_DOMAIN_STOPPED`. A teardown error is swallowed here (the session is
        retired; the reaper retries leftovers). The deadline check is
        :meth:`Session.expiry` (atomic with :meth:`extend_ttl`).

        Returns:
            The session ids closed.
        """
        closed = []
        for session in self.live():
            reason = session.expiry()
            if (
                reason is None
                and session.state == "ready"
                and not session.resetting  # its domain is replaced meanwhile
                and not session.domain_running()
            ):
                reason = CLOSED_DOMAIN_STOPPED
            if reason is not None:
                with contextlib.suppress(DeskvmError):
                    self.delete(session.id, reason=reason)
                closed.append(session.id)
        return closed

    def reset(self, session_id: str) -> Session:
        """Return a session to its start state (see :meth:`Session.reset`).

        A reset that fails ends the session (its domain is gone).

        Raises:
            SessionNotFound: unknown id.
            SessionClosed: the session is not ready.
            ConfigError: code ``reset_unavailable``: the session has no saved start state.
            HypervisorError: the restore failed (the session has been ended).
        """
        session = self.get(session_id)
        key = self._start_keys.get(session.id)
        if self.pool is not None and session.start_state is not None and key is not None:
            self.pool.take_spare(session.id, key)  # counted; the hypervisor runs it
        try:
            session.reset()
        except HypervisorError as exc:
            with contextlib.suppress(DeskvmError):
                self.delete(session.id, reason=f"reset failed: {exc.message}")
            raise
        except DeskvmError:
            # Refused (expired, not ready) or not drawn in time: the hypervisor still has
            # the spare (or the session's domain is the spare); the pool counts it again.
            self._want_spare(session.id)
            raise
        if session.state != "ready":
            # Deleted as the reset finished: it stays deleted, and the reset says so.
            raise SessionClosed(f"session {session.id} is {session.state}, not ready")
        self._want_spare(session.id)  # for the next reset
        return session

    def extend_ttl(self, session_id: str, ttl_s: float, *, max_ttl_s: float | None) -> Session:
        """Set a session's lifetime to ``ttl_s`` seconds from its creation (see
        :meth:`Session.extend_ttl`); a session found already expired is ended now.

        Raises:
            SessionNotFound: unknown id.
            ConfigError: ``ttl_s`` out of range (see :meth:`Session.extend_ttl`).
            SessionClosed: code ``session_expired`` (it has been ended) or
                ``session_closed``.
            StoreError: the new deadline could not be stored.
        """
        session = self.get(session_id)
        try:
            session.extend_ttl(ttl_s, max_ttl_s=max_ttl_s)
        except SessionClosed as exc:
            if exc.code == "session_expired":
                with contextlib.suppress(DeskvmError):
                    self.delete(session.id, reason=session.expiry() or CLOSED_TTL)
            raise
        return session

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
        """Destroy hypervisor and egress leftovers of sessions nobody runs or will run.

        Sessions of live servers and sessions waiting for their server to restart (see
        :meth:`adopt`) are left alone; records of sessions nobody will take back are
        torn down (recording sealed truncated).

        Returns:
            The session ids removed (sorted).
        """
        # List first, then read the live ids: a session registers before its domain exists,
        # so any domain in the listing belongs to a session already in ``_live`` (the other
        # order would reap a session created between the two reads).
        found = self.hypervisor.list_sessions()
        removed: set[str] = set()
        # Pool domains register their ids before their domains exist, like sessions.
        protected: set[str] = self.pool.ids() if self.pool is not None else set()
        if self.store is not None:
            for record in self.store.records():
                if record.session_id in self._live_ids():
                    continue
                why = self._unclaimed(record)
                if why is None:
                    protected.add(record.session_id)
                else:
                    self._reap_record(record, why)
                    removed.add(record.session_id)
        known = self._live_ids() | protected
        for session_id in sorted(found - known - removed):
            with contextlib.suppress(DeskvmError):
                self.hypervisor.destroy(session_id)
                removed.add(session_id)
        if self._pool_dir is not None and self.instance is not None:
            me = self.instance.name
            # Without a pool of its own, this name's leftovers (a killed predecessor's) go too.
            with contextlib.suppress(OSError):
                remove_stale_pools(
                    self._pool_dir.parent,
                    alive=lambda name: (
                        name != me and self.instance is not None and self.instance.alive(name)
                    ),
                    keep=me if self.pool is not None else None,
                )
        if self.egress is not None:
            # Under the lock: a session registers before it attaches, so none can attach
            # between reading the live ids and the egress listing its leftovers.
            with self._lock, contextlib.suppress(DeskvmError):
                removed.update(self.egress.reap(frozenset(self._live) | protected))
        return sorted(removed)

    def _live_ids(self) -> set[str]:
        with self._lock:
            return set(self._live)

    # --- bridge restarts ------------------------------------------------------------

    def _unclaimed(self, record: SessionRecord) -> str | None:
        """Why nobody will take ``record``'s session back, or ``None`` if someone may
        (its server is alive, or gone less than ``adopt_grace_s`` ago)."""
        if self.instance is None:
            return None
        if record.boot_id != boot_id():
            return "the host rebooted since (its domain is gone)"
        if record.owner == self.instance.name:
            return None if record.session_id in self._live_ids() else (
                "this server could not take it back after a restart"
            )  # fmt: skip
        gone_s = self.instance.gone_for_s(record.owner)
        if gone_s is None:
            return None
        if record.state != "ready":
            return f"its server {record.owner!r} stopped while it was starting"
        if gone_s == float("inf"):
            return f"its server {record.owner!r} is gone and cannot come back"
        if gone_s < self.adopt_grace_s:
            return None
        return (
            f"its server {record.owner!r} has been gone for {gone_s:.0f} s, more than the "
            f"{self.adopt_grace_s:g} s grace period"
        )

    def _reap_record(self, record: SessionRecord, why: str) -> None:
        """Tear down a session nobody will take back and seal its recording."""
        sid = record.session_id
        with contextlib.suppress(DeskvmError):
            self.hypervisor.destroy(sid)
        if record.egress is not None and self.egress is not None:
            with contextlib.suppress(DeskvmError):
                self.egress.detach(sid)
        if record.recording:
            path = Path(record.recording)
            if path.is_dir() and not writer_alive(path):
                with contextlib.suppress(DeskvmError):
                    seal(path, self._clock, reason=f"session ended by the reaper: {why}")
        if self.store is not None:
            self.store.delete(sid)

    def adopt(self) -> AdoptReport:
        """At server start: take back this server's sessions, reap what nobody will.

        For every record in the store: a ready session of this server (same name, same
        boot) is re-adopted (:meth:`Session.adopt`: domain, egress, recording continued
        after a ``gap`` marker, deadlines, policy and extras from the record); a session
        of another server is left alone while that server is alive or gone for less than
        :attr:`adopt_grace_s`; everything else is torn down and its recording sealed
        truncated. Then every recording still ``recording`` whose writer is dead and whose
        session is nobody's is sealed (:func:`orchestrator.recorder.seal`).

        Returns:
            What was adopted, reaped, left waiting and sealed.
        """
        report = AdoptReport()
        if self.store is not None and self.instance is not None:
            for record in self.store.records():
                sid = record.session_id
                if sid in self._live_ids():
                    continue
                mine = record.owner == self.instance.name
                if mine and record.state == "ready" and record.boot_id == boot_id():
                    try:
                        self._adopt_one(record)
                    except DeskvmError as exc:
                        report.failed[sid] = exc.message
                        self._reap_record(record, f"could not be re-adopted: {exc.message}")
                    else:
                        report.adopted.append(sid)
                    continue
                why = "this server stopped while it was starting" if mine else None
                why = why or self._unclaimed(record)
                if why is None:
                    report.waiting.append(sid)
                else:
                    self._reap_record(record, why)
                    report.reaped[sid] = why
        report.sealed = self._seal_orphan_recordings(set(report.waiting))
        return report

    def _adopt_one(self, record: SessionRecord) -> Session:
        if record.recording is None:
            raise ConfigError(f"session {record.session_id} has no recording to continue")
        recorder = FileRecorder.reopen(Path(record.recording), self._clock, reason=GAP_REASON)
        try:
            session = Session.adopt(
                record,
                hypervisor=self.hypervisor,
                recorder=recorder,
                clock=self._clock,
                pacing=self._pacing,
                egress=self.egress,
                capture_fps=self._capture_fps,
                store=self.store,
                owner=self.owner,
            )
        except BaseException:
            with contextlib.suppress(DeskvmError):
                recorder.close(status="closed_with_errors")
            raise
        with self._lock:
            self._live[session.id] = session
        return session

    def _seal_orphan_recordings(self, keep: set[str]) -> list[str]:
        """Seal recordings left ``recording`` by a dead writer whose session nobody runs."""
        sealed: list[str] = []
        root = self._recordings_dir
        if not root.is_dir():
            return sealed
        live = self._live_ids()
        for path in sorted(root.iterdir()):
            if path.name in live or path.name in keep or not path.is_dir():
                continue
            try:
                status = json.loads((path / "manifest.json").read_text()).get("status")
            except (OSError, ValueError, AttributeError):
                continue
            if status != "recording" or writer_alive(path):
                continue
            with contextlib.suppress(DeskvmError):
                seal(
                    path,
                    self._clock,
                    reason="the server recording this session stopped (killed or crashed) "
                    "and no server took the session back",
                )
                sealed.append(path.name)
        return sealed

    def detach_all(
        self, *, reason: str = "server shutdown; the session keeps running"
    ) -> list[str]:
        """Leave every live session running for a restarted server (graceful exit with
        ``--on-exit keep``): each is detached (:meth:`Session.detach`), its record kept.

        Returns:
            The session ids left running.
        """
        kept = []
        for session in self.live():
            if session.state != "ready":
                with contextlib.suppress(DeskvmError):
                    self.delete(session.id, reason="server shutdown while starting")
                continue
            session.detach(reason=reason)
            with self._lock:
                self._live.pop(session.id, None)
            kept.append(session.id)
        return kept
