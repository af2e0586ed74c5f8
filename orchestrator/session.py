"""One disposable session: start the domain, wait for a drawn desktop, act, record, tear down.

:class:`Session` composes the seams (hypervisor, display, recorder, clock, egress). It is a
context manager: leaving the ``with`` block (normally, on error or on Ctrl-C) destroys the
domain and deletes the overlay; a start that fails tears down whatever it started before
the error propagates. Every input is appended to the recording before it is injected.

A session whose spec carries an egress policy gets its filtered network attached before the
domain starts (the NIC plugs into the session bridge) and detached after the domain is
destroyed; a poller thread drains the egress decisions into the recording as ``network``
events every ``network_poll_s`` (and once more at teardown).

Thread safety: actions on one session run one at a time (a lock); different sessions are
independent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Literal

import numpy as np
from PIL import Image

from agent_bridge.protocol.actions import (
    Action,
    CursorPosition,
    Screenshot,
    Scroll,
    Type,
    Wait,
    Zoom,
    action_name,
    action_to_dict,
    is_guest_action,
)
from agent_bridge.protocol.guest import ClipboardSet, Exec, GuestAction, PutFile, SetResolution
from agent_bridge.protocol.keys import MODIFIER_QCODES, text_to_combos
from agent_bridge.protocol.messages import check_bounds
from agent_bridge.protocol.results import CursorResult, Done, GuestResult, ImageResult, Result
from orchestrator.approval import ApprovalPolicy, TypedWindow
from orchestrator.capture import FrameCapture
from orchestrator.clock import Clock, SystemClock
from orchestrator.display.base import AbsMove, ButtonEvent, InputEvent, KeyEvent
from orchestrator.display.key_pacing import KEY_ACK_WINDOW, KeyPacer
from orchestrator.egress.base import (
    RETRY_WINDOW_S,
    Egress,
    EgressAttachment,
    NetworkDecision,
    merge_retries,
    summarise_link_chatter,
)
from orchestrator.errors import (
    AccelFailed,
    ActionError,
    BootTimeout,
    ConfigError,
    DeskvmError,
    DisplayError,
    EgressError,
    HypervisorError,
    SessionClosed,
)
from orchestrator.guest_control import run_guest_action
from orchestrator.hypervisor.base import (
    LIVE_CPU_WEIGHT,
    Domain,
    Hypervisor,
    NicAttachment,
    SavedState,
)
from orchestrator.imaging import encode_png as _encode_png
from orchestrator.input_plan import HelperStep, Pacing, PlanStep, plan_action, release_all
from orchestrator.instance import boot_id
from orchestrator.recorder import Recorder, Source
from orchestrator.spec import (
    MAX_DISPLAY_PX,
    MIN_DISPLAY_PX,
    DisplaySpec,
    ReadyCheck,
    SessionSpec,
    check_display_size,
)
from orchestrator.store import SessionRecord, SessionStore, spec_to_json

__all__ = [
    "CLOSED_DOMAIN_STOPPED",
    "CLOSED_IDLE",
    "CLOSED_TTL",
    "DECISION_LOG_LAG_S",
    "PROBE_READY_MARKER",
    "READY_MARKER",
    "Session",
    "SessionState",
    "decision_from_json",
    "decision_to_json",
    "desktop_drawn",
    "encode_png",
    "probe_drawn",
]

READY_MARKER = b"DESKVM_READY"
PROBE_READY_MARKER = b'"ev":"probe_ready"'
"""The input probe's readiness line on the guest log (mapped, full-screen, text focused)."""

CLOSED_TTL = "ttl expired"
"""``closed_reason`` of a session ended because it reached its ``ttl_s``."""
CLOSED_DOMAIN_STOPPED = "the domain stopped (guest powered off, crashed or was killed)"
"""``closed_reason`` of a ready session whose QEMU process went away (e.g. the host's
memory hard limit killed it)."""
CLOSED_IDLE = "idle timeout"
"""``closed_reason`` of a session ended after ``idle_timeout_s`` without an action."""

_ALL_BUTTONS = frozenset({"left", "middle", "right", "side", "extra"})

DECISION_LOG_LAG_S = 2.0
"""How late an egress decision may reach its log (dnsmasq stamps whole seconds)."""

CLOCK_SET_TIMEOUT_S = 1.0
"""How long a warm start waits for the guest to confirm its new wall clock, seconds."""
WARM_LINK_DOWN_S = 0.3
"""How long a warm start with egress keeps the restored guest's link down, seconds from
the resume, and at least until the guest answered on its clock port (it runs): the
guest's virtio-net driver sees the loss when it handles the configuration interrupt
pending at the resume, and Linux reports it to user space at once when no link event
came within the last second of the guest's time (the template's last one came long
before its save). A loss that is over before it is reported is never seen, so the
guest would keep its saved lease: then :data:`WARM_RELINK_AFTER_S`."""
WARM_RELINK_AFTER_S = 1.0
"""How long a warm start with egress waits for the guest's new lease after the link came
up before it takes the link down once more, for :data:`WARM_LINK_RETRY_DOWN_S`, seconds
(the lease comes 0.1-0.2 s after the link)."""
WARM_LINK_RETRY_DOWN_S = 1.2
"""How long the second link-down of a warm start with egress lasts, seconds: Linux
reports a non-urgent carrier change to user space at most 1 s late (its linkwatch
batches them), so a loss this long is seen."""
WARM_LEASE_TIMEOUT_S = 15.0
"""How long a warm start with egress waits for the guest's new DHCP lease after the
last link-up, seconds."""
RESET_READY_TIMEOUT_S = 30.0
"""How long a reset's restored desktop may take to show a drawn frame, seconds."""
WARM_READY_POLL_S = 0.05
"""How often a restored desktop (warm start, reset) is checked for a drawn frame,
seconds: it is drawn within a second, so the cold boot's poll interval would dominate."""
HELPER_ANNOUNCE_WAIT_S = 5.0
"""How long an action that needs the guest helper waits for it to announce itself, s."""
HELPER_MAX_TEXT_CHARS = 10_000
"""Longest text one action may hand to the guest helper, characters."""
HELPER_BASE_TIMEOUT_S = 10.0
HELPER_PER_EVENT_TIMEOUT_S = 0.1
"""A helper request's deadline: base + per character or wheel notch, seconds."""

SessionState = Literal["new", "starting", "ready", "closing", "closed", "failed"]


def encode_png(image: Image.Image) -> bytes:
    """PNG bytes of ``image`` (see :func:`orchestrator.imaging.encode_png`: fast, RGB)."""
    return _encode_png(image)


def decision_to_json(decision: NetworkDecision) -> dict[str, Any]:
    """A network decision as the recording's ``network`` event data and ``GET .../network``.

    Returns:
        ``{"ts_ns", "kind", "reason", "protocol", "src", "src_port", "dst", "dst_port",
        "query", "qtype", "answers", "attempts", "last_ts_ns"}``; ``ts_ns`` is
        ``CLOCK_MONOTONIC`` ns of this host (when the decision was taken, see
        :class:`~orchestrator.egress.base.NetworkDecision`), ports and DNS fields ``None``
        where they do not apply; ``attempts`` counts the guest's repeats of the same
        request (``last_ts_ns`` is the last one's time, see
        :func:`~orchestrator.egress.base.merge_retries`).
    """
    return {
        "ts_ns": decision.ts_ns,
        "kind": decision.kind,
        "reason": decision.reason,
        "protocol": decision.protocol,
        "src": decision.src,
        "src_port": decision.src_port,
        "dst": decision.dst,
        "dst_port": decision.dst_port,
        "query": decision.query,
        "qtype": decision.qtype,
        "answers": list(decision.answers),
        "attempts": decision.attempts,
        "last_ts_ns": decision.last_ts_ns if decision.last_ts_ns is not None else decision.ts_ns,
    }


def decision_from_json(data: Mapping[str, Any], session_id: str) -> NetworkDecision:
    """The inverse of :func:`decision_to_json` (a recorded ``network`` event's data)."""
    return NetworkDecision(
        ts_ns=int(data["ts_ns"]),
        kind=data["kind"],
        session_id=session_id,
        reason=str(data["reason"]),
        protocol=str(data["protocol"]),
        src=data.get("src"),
        src_port=data.get("src_port"),
        dst=data.get("dst"),
        dst_port=data.get("dst_port"),
        query=data.get("query"),
        qtype=data.get("qtype"),
        answers=tuple(data.get("answers") or ()),
        attempts=int(data.get("attempts", 1)),
        last_ts_ns=data.get("last_ts_ns"),
    )


def desktop_drawn(
    image: Image.Image,
    *,
    width_px: int,
    height_px: int,
    background_rgb: tuple[int, int, int],
    ready: ReadyCheck | None = None,
) -> tuple[bool, str]:
    """Whether a frame shows the image's desktop: right size, background, windows, bands.

    Ready means at least ``ready.min_background_share`` of the pixels are the desktop
    background colour (the root window is painted; default 10%), at least
    ``ready.min_window_share`` are not (a window is drawn; default 1%), and every band of
    ``ready.regions`` (e.g. a panel) is drawn: enough of its pixels differ from the
    background and it shows enough distinct colours. A pixel is background when every
    channel is within 6 of ``background_rgb``.

    Returns:
        ``(ready, reason)``; ``reason`` explains a ``False``.
    """
    check = ready if ready is not None else ReadyCheck()
    if image.size != (width_px, height_px):
        return False, f"screen is {image.width}x{image.height}, want {width_px}x{height_px}"
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    background = np.all(np.abs(pixels - np.array(background_rgb, dtype=np.int16)) <= 6, axis=2)
    share = float(background.mean())
    if share < check.min_background_share:
        return False, f"background covers {share:.1%} of the screen (desktop not painted yet)"
    if 1 - share < check.min_window_share:
        return False, f"only background is drawn (windows {1 - share:.1%}: no window yet)"
    for region in check.regions:
        top = region.top_px if region.top_px >= 0 else height_px + region.top_px
        top = max(0, min(height_px, top))
        bottom = max(top, min(height_px, top + region.height_px))
        if bottom == top:
            return False, f"{region.name}: band outside the {width_px}x{height_px} screen"
        band_background = background[top:bottom]
        foreground = 1 - float(band_background.mean())
        if foreground < region.min_foreground_share:
            return False, f"{region.name} not drawn ({foreground:.0%} of its band drawn)"
        band = pixels[top:bottom].reshape(-1, 3).astype(np.int32)
        colours = len(np.unique(band[:, 0] * 65536 + band[:, 1] * 256 + band[:, 2]))
        if colours < region.min_colours:
            return False, f"{region.name} not drawn ({colours} colours in its band)"
    drawn = ", ".join(r.name for r in check.regions)
    return True, f"background {share:.1%}, windows {1 - share:.1%}" + (
        f", {drawn} drawn" if drawn else ""
    )


def probe_drawn(image: Image.Image, *, width_px: int, height_px: int) -> tuple[bool, str]:
    """Whether a frame can show the full-screen input probe: the screen has the right size.

    The probe covers the whole screen, so the desktop-background test of
    :func:`desktop_drawn` does not apply; the probe's own ``probe_ready`` line (mapped,
    full-screen, focused) is the real criterion.

    Returns:
        ``(ready, reason)``; ``reason`` explains a ``False``.
    """
    if image.size != (width_px, height_px):
        return False, f"screen is {image.width}x{image.height}, want {width_px}x{height_px}"
    return True, "input probe ready"


class Session:
    """A running (or starting) disposable desktop session.

    Args:
        spec: what to start.
        hypervisor: starts and destroys the domain.
        recorder: where every event goes (its directory is the session's recording).
        clock: time source (fake in tests).
        pacing: input pacing.
        nic: network attachment for sessions with an egress policy (``None``: no NIC).
            Ignored when ``egress`` attaches the session (the attachment gives the NIC).
        egress: the egress seam; needed when ``spec.egress`` is set (the session's
            bridge, rules and resolver are attached before the domain starts).
        ready_poll_s: how often readiness is checked during boot, seconds: a read of the
            guest log, and a frame check once it says ``DESKVM_READY`` (each interval adds
            up to that much to the boot).
        capture_fps: continuous capture rate once ready (frames per second; ``None``: no
            continuous capture and no stills at input moments, only screenshots).
        network_poll_s: how often egress decisions are drained into the recording (s).
        store: where the session keeps its :class:`~orchestrator.store.SessionRecord`
            (spec, deadlines, policy, recording, egress, extras) so that a restarted
            server can re-adopt it; ``None``: nothing is kept.
        owner: the name of the server instance running it (written into its record).

    Deadlines: ``ttl_s`` counts from :attr:`created_ns`, ``idle_timeout_s`` from
    :attr:`last_action_ns`, both on the ``CLOCK_MONOTONIC`` clock that every process of
    the boot shares, and both are in the record; a session is expired the moment a
    deadline passes (:meth:`expiry`), whether or not the sweeper has ended it yet.

    Raises:
        ConfigError: ``spec.egress`` is set but no ``egress`` seam was given.
    """

    def __init__(
        self,
        spec: SessionSpec,
        *,
        hypervisor: Hypervisor,
        recorder: Recorder,
        clock: Clock | None = None,
        pacing: Pacing | None = None,
        nic: NicAttachment | None = None,
        egress: Egress | None = None,
        ready_poll_s: float = 0.1,
        capture_fps: float | None = None,
        network_poll_s: float = 1.0,
        store: SessionStore | None = None,
        owner: str = "",
    ) -> None:
        if spec.egress is not None and egress is None:
            raise ConfigError(
                f"session {spec.session_id} has an egress policy but this host has no "
                "egress configured"
            )
        self.spec = spec
        self._hypervisor = hypervisor
        self._recorder = recorder
        self._clock = clock or SystemClock()
        self._pacing = pacing or Pacing()
        self._key_flow: bool | None = None
        self._key_pacer: KeyPacer | None = None  # for the domain's helper
        self._nic = nic
        self._egress = egress if spec.egress is not None else None
        self._egress_attached = False
        self._detach_lock = threading.Lock()
        self.egress_attachment: EgressAttachment | None = None
        self._network_poll_s = network_poll_s
        self._decisions: list[NetworkDecision] = []
        # (retry key, first attempt's ts_ns) of each decision already recorded
        self._decisions_seen: set[tuple[tuple[object, ...], int]] = set()
        self._open_decisions: list[NetworkDecision] = []
        self._drain_lock = threading.Lock()
        self._poller_stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._ready_poll_s = ready_poll_s
        self._domain: Domain | None = None
        # _lock serializes actions (held for a whole action); _state_lock guards state
        # transitions only, so that close() never waits for a running action: it sets
        # _closing, which cuts the action's pauses short.
        self._lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._closing = threading.Event()
        self._state: SessionState = "new"
        self._cursor = (spec.display.width_px // 2, spec.display.height_px // 2)
        self._keys_down: set[str] = set()
        self._buttons_down: set[str] = set()
        self.created_ns = self._clock.monotonic_ns()
        self.last_action_ns = self.created_ns
        """Monotonic time of the last action (or creation): the idle timeout counts from it."""
        self.ready_ns: int | None = None
        self.boot_s: float | None = None
        """Seconds from the start (domain start, or the claim of a warm desktop) to ready."""
        self.start_kind: Literal["warm", "cold"] | None = None
        """``"warm"``: a restored pool desktop was taken over; ``"cold"``: it booted."""
        self.start_state: SavedState | None = None
        """The saved state this session started from (warm starts); :meth:`reset` restores
        it. ``None``: the session booted cold and cannot be reset."""
        self.resets = 0
        """How often the session was reset."""
        self.last_reset_s: float | None = None
        """Seconds the last :meth:`reset` took."""
        self.reset_phases_s: dict[str, float] = {}
        """Seconds each phase of the last reset took: ``restore_s`` (the old domain
        stopped, the new one restored from the start state onto a fresh overlay),
        ``clock_s`` (setting the guest's wall clock), ``ready_s`` (until a drawn frame)."""
        self._log_before_reset = b""
        self.clock_offset_s: float | None = None
        """After a warm start: the guest's wall clock minus the host's once set, seconds
        (the guest's word); ``None``: cold start, or the guest did not confirm."""
        self.start_phases_s: dict[str, float] = {}
        """Seconds each start phase took: ``claim_s`` (warm), ``egress_s`` (with a
        policy), ``domain_start_s`` (cold), ``clock_s`` (warm: setting the guest's wall
        clock), ``ready_s`` (until a drawn frame); a warm start with egress also
        ``restore_s``, ``link_s`` and ``lease_s`` (see :meth:`start`)."""
        self.closed_reason: str | None = None
        self._guest_log_snapshot = b""
        self._console_snapshot = ""
        self._capture_fps = capture_fps
        self._frames: FrameCapture | None = None
        self._secrets: list[str] = []
        self._approval_policy: ApprovalPolicy | None = None
        self.typed = TypedWindow()
        """What was typed into the guest lately (text approval rules match across actions)."""
        self._store = store
        self.owner = owner
        """The name of the server instance running this session."""
        self.created_at: datetime = self._clock.wall()
        """Wall clock (UTC) when the session was registered."""
        self.ready_at: datetime | None = None
        """Wall clock (UTC) when the desktop was first drawn."""
        self.extras: dict[str, Any] = {}
        """State of the layers above kept in the session's record (see :meth:`set_extra`)."""
        self._deadline_lock = threading.Lock()
        self._persist_lock = threading.Lock()
        self._expired: str | None = None
        self._resetting = False
        self._store_error_reported = False
        self._display_memory_kib = spec.display.memory_kib
        self._created_display = spec.display
        """The display the session was created with (a reset returns to it)."""
        """The display device's video memory, fixed at boot (bounds a resolution change)."""

    # --- lifecycle ------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self.spec.session_id

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def recorder(self) -> Recorder:
        return self._recorder

    def __enter__(self) -> Session:
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(reason="context exit")

    def start(
        self,
        *,
        warm: Domain | None = None,
        claim_s: float | None = None,
        restore_from: SavedState | None = None,
        restore_mac: str | None = None,
    ) -> None:
        """Start the domain and block until the desktop is drawn.

        Ready means: the guest wrote ``DESKVM_READY`` and a frame shows the desktop
        (:func:`desktop_drawn`); with ``spec.autostart == "input-probe"`` it means the probe
        wrote ``probe_ready`` and ``DESKVM_READY`` and the screen has the asked size
        (:func:`probe_drawn`).

        A warm start takes over ``warm``, a domain already running from a restored state
        (a warm pool's desktop, see :mod:`orchestrator.pool`): nothing boots, the
        recording starts now, and ready means a frame shows the desktop (the guest wrote
        its ``DESKVM_READY`` before the state was saved). :attr:`start_kind` says which
        start it was and :attr:`start_phases_s` how long each phase took.

        A warm start with egress (``restore_from``: an egress pool target's saved state,
        whose NIC has the MAC ``restore_mac``) attaches the session's network first, with
        its policy and accepting ``restore_mac``, restores the state onto it (paused),
        takes the guest's link down, resumes it, sets its clock, brings the link back up
        after :data:`WARM_LINK_DOWN_S` and waits until the session's DHCP server has
        leased the session's address: the guest dropped the template's lease at the
        carrier loss and asked anew. No lease within :data:`WARM_RELINK_AFTER_S`: the
        link goes down once more, for :data:`WARM_LINK_RETRY_DOWN_S` (a ``relink``
        network event), and the lease may take :data:`WARM_LEASE_TIMEOUT_S`. The state
        is restored from the session's own hard links to it
        (:meth:`~orchestrator.hypervisor.base.Hypervisor.keep_state`), so the clone's
        overlay never backs onto the pool's files, which a rebuilt template replaces.
        The policy holds from the first packet whatever the guest does: the rules pass
        only the session's address and ``restore_mac``. If any of that fails, the
        domain is destroyed, a ``warm_failed`` lifecycle event recorded, and the session
        boots cold on the same network (:attr:`start_kind` ``"cold"``).

        A :meth:`close` while starting ends the start at its next step (a closed
        session never falls back to a cold boot) and leaves nothing behind: a domain
        restored or booted after ``close`` tore the session down is destroyed and its
        network detached here.

        Args:
            warm: the restored domain to take over (``None``: boot cold).
            claim_s: how long taking ``warm`` (or ``restore_from``) from the pool took, s.
            restore_from: a saved state with a NIC to restore onto the session's network.
            restore_mac: the MAC of ``restore_from``'s NIC.

        Raises:
            BootTimeout: not ready before ``spec.boot_timeout_s`` (carries the console tail).
            HypervisorError: the domain could not start or died while booting.
            SessionClosed: the session was closed while starting.
        """
        with self._state_lock:
            if self._state != "new":
                raise SessionClosed(f"session {self.id} was already started")
            self._state = "starting"
        t0 = self._clock.monotonic_ns()
        if restore_from is not None and (self._egress is None or restore_mac is None):
            restore_from = None  # only sessions with egress restore here (the pool's check)
        self.start_kind = "cold" if warm is None and restore_from is None else "warm"
        self._recorder.append(
            "lifecycle",
            {
                "event": "starting",
                "start": self.start_kind,
                "image": self.spec.image.name,
                "image_hash": self.spec.image.content_hash,
                "display": [self.spec.display.width_px, self.spec.display.height_px],
                "memory_mib": self.spec.memory_mib,
                "vcpus": self.spec.vcpus,
                "accel": self._hypervisor.accel,
                "network": self._nic is not None or self.spec.egress is not None,
                **({"autostart": self.spec.autostart} if self.spec.autostart else {}),
                **({"keyboard_layout": self.spec.layout} if self.spec.keyboard_layout else {}),
            },
        )
        self._persist_quietly()  # "starting": a restart tears such a session down
        try:
            phases: dict[str, float] = {}
            if claim_s is not None:
                phases["claim_s"] = claim_s
            mark = self._clock.monotonic_ns()
            if self._egress is not None and self.spec.egress is not None:
                self._attach_egress(guest_mac=restore_mac if restore_from is not None else None)
                phases["egress_s"], mark = self._since(mark)
                self._check_closing()
            if restore_from is not None:
                try:
                    self._restore_networked(restore_from, phases)
                    warm = self._domain
                except SessionClosed:
                    raise
                except DeskvmError as exc:
                    self._check_closing()  # a closed session does not boot cold
                    self._warm_failed(exc)
                mark = self._clock.monotonic_ns()
            boot_accel = self._hypervisor.accel
            if warm is None:
                self._check_closing()
                self._domain = self._hypervisor.start(self.spec, nic=self._nic)
                phases["domain_start_s"], mark = self._since(mark)
            elif restore_from is None:
                self._domain = warm
                # A restored guest's wall clock is that of its save: set it to the host's.
                self.clock_offset_s = warm.set_clock(timeout_s=CLOCK_SET_TIMEOUT_S)
                phases["clock_s"], mark = self._since(mark)
            self._start_capture()  # the boot is recorded too (capture starts at domain start)
            try:
                self._wait_ready(t0, warm=warm is not None)
            except AccelFailed as exc:
                if warm is not None or boot_accel != "kvm":
                    raise
                if not self._hypervisor.fall_back_to_tcg(exc.message):
                    raise AccelFailed(
                        f"{exc.message}. Not booted again under TCG: KVM is forced "
                        "(DESKVM_ACCEL=kvm, or a cluster node labelled kvm) or already ran a "
                        "Linux guest on this host; `deskvm doctor --reprobe` probes again"
                    ) from exc
                phases["accel_failed_s"], mark = self._since(mark)
                self._boot_again_under_tcg(exc)
                self._wait_ready(self._clock.monotonic_ns())
            phases["ready_s"], mark = self._since(mark)
            if warm is None:
                self._hypervisor.kvm_ran_linux()  # a no-op unless it still runs KVM
            self.start_phases_s = phases
        except BaseException as exc:
            with self._state_lock:
                closed_by_caller = self._closing.is_set()
                if not closed_by_caller:
                    self._state = "failed"
            if closed_by_caller:
                # close() ended the session while it booted (e.g. its client went away): that
                # is the one ending, with close()'s reason; the boot's failure is its effect.
                self._clean_after_close()
                raise SessionClosed(
                    f"session {self.id} was closed while starting: {self.closed_reason}"
                ) from exc
            detail = exc.message if isinstance(exc, DeskvmError) else repr(exc)
            with contextlib.suppress(DeskvmError):
                self._recorder.append("lifecycle", {"event": "start_failed", "error": detail})
            self._teardown(reason="start failed")
            raise
        self.ready_ns = self._clock.monotonic_ns()
        self.ready_at = self._clock.wall()
        self.last_action_ns = self.ready_ns
        self.boot_s = (self.ready_ns - t0) / 1e9
        with self._state_lock:
            if self._state != "starting":
                raise SessionClosed(f"session {self.id} was closed while starting")
            self._state = "ready"
        self._recorder.append(
            "lifecycle",
            {
                "event": "ready",
                "boot_s": round(self.boot_s, 3),
                "start": self.start_kind,
                "phases_s": self.start_phases_s,
                **({} if warm is None else {"clock_offset_s": self.clock_offset_s}),
            },
        )
        self._persist_quietly()

    def _boot_again_under_tcg(self, exc: AccelFailed) -> None:
        """KVM stopped this cold boot and the hypervisor fell back to TCG: destroy the
        domain (and its overlay) and boot a new one on the same network, recorded as a
        ``accel_fallback`` lifecycle event."""
        self._recorder.append(
            "lifecycle", {"event": "accel_fallback", "accel": "tcg", "error": exc.message}
        )
        if self._frames is not None:
            self._frames.stop()
            self._frames = None
        if self._domain is not None:
            with contextlib.suppress(DeskvmError):
                self._domain.display.close()
            self._domain = None
        self._hypervisor.destroy(self.id)
        self._check_closing()
        self._domain = self._hypervisor.start(self.spec, nic=self._nic)
        self._start_capture()

    def _restore_networked(self, state: SavedState, phases: dict[str, float]) -> None:
        """The warm start with egress of :meth:`start` up to the new lease (sets
        :attr:`_domain`); phases ``restore_s``, ``clock_s``, ``link_s``, ``lease_s``
        (and ``relink_s`` when the link went down a second time)."""
        assert self._egress is not None and self._nic is not None
        mark = self._clock.monotonic_ns()
        # The session's own links to the state: its overlay backs onto them, not the pool's.
        kept = self._hypervisor.keep_state(self.id, state)
        domain = self._hypervisor.restore(
            self.spec, kept, cpu_weight=LIVE_CPU_WEIGHT, paused=True, nic=self._nic
        )
        self._domain = domain
        self._check_closing()
        phases["restore_s"], mark = self._since(mark)
        domain.set_link(False)  # while paused: the guest sees the loss as it wakes
        self._hypervisor.resume(self.id)
        down_ns = self._clock.monotonic_ns()
        self.clock_offset_s = domain.set_clock(timeout_s=CLOCK_SET_TIMEOUT_S)
        phases["clock_s"], mark = self._since(mark)
        down_s, wait_s = WARM_LINK_DOWN_S, WARM_RELINK_AFTER_S
        while True:
            self._clock.sleep(down_s - (self._clock.monotonic_ns() - down_ns) / 1e9, self._closing)
            self._check_closing()
            domain.set_link(True)
            phases["link_s" if "link_s" not in phases else "relink_s"], mark = self._since(mark)
            leased = self._wait_lease(mark + int(wait_s * 1e9))
            if leased is not None:
                break
            if "relink_s" in phases:
                raise HypervisorError(
                    "the restored guest took no DHCP lease within "
                    f"{WARM_LEASE_TIMEOUT_S:g} s of its link's second coming up"
                )
            # The guest did not see the loss (it keeps the template's lease): once more, longer.
            domain.set_link(False)
            down_ns = self._clock.monotonic_ns()
            down_s, wait_s = WARM_LINK_RETRY_DOWN_S, WARM_LEASE_TIMEOUT_S
            self._recorder.append(
                "network",
                {"event": "relink", "why": f"no lease {WARM_RELINK_AFTER_S:g} s after link up"},
            )
        phases["lease_s"], mark = self._since(mark)
        self._recorder.append("network", {"event": "leased", "guest_ip": leased})

    def _wait_lease(self, deadline_ns: int) -> str | None:
        """The address the session's DHCP server leased to the guest, polled until
        ``deadline_ns`` (``None``: no lease by then)."""
        assert self._egress is not None
        while (leased := self._egress.leased_ip(self.id)) is None:
            self._check_closing()
            if self._clock.monotonic_ns() >= deadline_ns:
                return None
            self._clock.sleep(WARM_READY_POLL_S)
        return leased

    def _check_closing(self) -> None:
        """Raise :class:`SessionClosed` when :meth:`close` was called during the start."""
        if self._closing.is_set():
            raise SessionClosed(f"session {self.id} was closed while starting")

    def _clean_after_close(self) -> None:
        """After a start that ``close`` interrupted: remove what the start made after
        close's teardown (a domain restored or booted meanwhile, its capture, its
        network). Every step is idempotent; errors are ignored (close reports its own)."""
        if self._frames is not None:
            self._frames.stop()
        with contextlib.suppress(DeskvmError):
            self._hypervisor.destroy(self.id)
        if self._domain is not None:
            with contextlib.suppress(DeskvmError):
                self._domain.display.close()
        self._detach_egress(wait=False)  # close's teardown may be at it: then it does it

    def _warm_failed(self, exc: DeskvmError) -> None:
        """A warm start with egress failed: destroy its domain, record why, go cold."""
        self._domain = None
        self.clock_offset_s = None
        with contextlib.suppress(DeskvmError):
            self._hypervisor.destroy(self.id)
        self.start_kind = "cold"
        self._recorder.append("lifecycle", {"event": "warm_failed", "error": exc.message})

    def _since(self, mark_ns: int) -> tuple[float, int]:
        now = self._clock.monotonic_ns()
        return round((now - mark_ns) / 1e9, 3), now

    def _start_capture(self) -> None:
        """Start the capture loop of the running domain's screen (once).

        One loop feeds the video (when ``capture_fps`` is set) and live viewers.
        """
        if self._domain is not None and self._frames is None:
            self._frames = FrameCapture(
                self._domain.display, self._recorder, self._clock, fps=self._capture_fps
            )
            self._frames.start()

    def _attach_egress(self, *, guest_mac: str | None = None) -> None:
        assert self._egress is not None and self.spec.egress is not None
        self._egress_attached = True  # detach runs at teardown even if attach fails midway
        t0 = self._clock.monotonic_ns()
        if guest_mac is None:
            attachment = self._egress.attach(self.id, self.spec.egress)
        else:
            attachment = self._egress.attach(self.id, self.spec.egress, guest_mac=guest_mac)
        self.egress_attachment = attachment
        self._nic = NicAttachment(
            bridge=attachment.bridge, mac=attachment.guest_mac, tap=attachment.guest_port
        )
        self._recorder.append(
            "network",
            {
                "event": "attached",
                "allow": list(self.spec.egress.allow),
                "bridge": attachment.bridge,
                "guest_port": attachment.guest_port,
                "guest_mac": attachment.guest_mac,
                "guest_ip": attachment.guest_ip,
                "gateway_ip": attachment.gateway_ip,
                "attach_s": round((self._clock.monotonic_ns() - t0) / 1e9, 3),
            },
        )
        self._poller = threading.Thread(
            target=self._poll_decisions, name=f"deskvm-net-{self.id}", daemon=True
        )
        self._poller.start()

    def _poll_decisions(self) -> None:
        while not self._poller_stop.wait(self._network_poll_s):
            with contextlib.suppress(DeskvmError):
                self.drain_network()

    def drain_network(self, *, final: bool = False) -> list[NetworkDecision]:
        """Append egress decisions not yet recorded to the recording (``network`` events).

        Called by the poller thread every ``network_poll_s``, at teardown (``final``), and
        by readers that want an up-to-date view. A no-op for sessions without egress.

        Repeats of one request are one decision (``attempts``, see
        :func:`~orchestrator.egress.base.merge_retries`), so a decision is recorded once
        no repeat can follow: :data:`~orchestrator.egress.base.RETRY_WINDOW_S` plus
        :data:`DECISION_LOG_LAG_S` after its last attempt (at teardown: at once).

        Returns:
            The decisions recorded now, oldest first.

        Raises:
            EgressError: the decision logs could not be read.
            RecorderError: the recording could not be written.
        """
        if self._egress is None or self.egress_attachment is None:
            return []
        with self._drain_lock:
            merged = merge_retries(self._egress.decisions(self.id))
            settle_ns = int((RETRY_WINDOW_S + DECISION_LOG_LAG_S) * 1e9)
            now_ns = self._clock.monotonic_ns()
            new, still_open = [], []
            for decision in merged:
                ident = (decision.retry_key, decision.ts_ns)
                if ident in self._decisions_seen:
                    continue
                last_ns = decision.last_ts_ns if decision.last_ts_ns is not None else 0
                if not final and now_ns - last_ns <= settle_ns:
                    still_open.append(decision)
                    continue
                self._recorder.append("network", decision_to_json(decision))
                self._decisions_seen.add(ident)
                self._decisions.append(decision)
                new.append(decision)
            self._open_decisions = still_open
            return new

    def network_decisions(self) -> list[NetworkDecision]:
        """Every egress decision recorded so far, in time order (kept after close).

        Decisions come from two logs (packet log, resolver log) drained in batches, so the
        recording's order can differ from their timestamps' by a little; this list is sorted.

        The guest's IPv6 link-scope multicast chatter (router and neighbour solicitations,
        MLD reports; all dropped at the bridge) is summarised: one entry per kind of
        packet with its ``attempts`` and first/last time
        (:func:`~orchestrator.egress.base.summarise_link_chatter`); the recording keeps
        each of its decisions.

        Live sessions are drained first. Empty for sessions without an egress policy.

        Raises:
            EgressError: the decision logs of a live session could not be read.
        """
        if self._state in ("starting", "ready"):
            self.drain_network()
        with self._drain_lock:
            return summarise_link_chatter([*self._decisions, *self._open_decisions])

    def _wait_ready(self, t0_ns: int, *, warm: bool = False) -> None:
        assert self._domain is not None
        domain, spec = self._domain, self.spec
        deadline_ns = t0_ns + int(spec.boot_timeout_s * 1e9)
        reason = "the guest has not reported DESKVM_READY on its guest log"
        while True:
            if self._state != "starting":
                raise SessionClosed(f"session {self.id} was closed while starting")
            if not domain.is_running():
                raise HypervisorError(
                    f"the domain of session {self.id} stopped while booting; console tail:\n"
                    + domain.console_tail()
                )
            if (stopped := domain.stop_error()) is not None:
                raise AccelFailed(f"session {self.id}: QEMU stopped the guest: {stopped}")
            guest_log = domain.read_guest_log()
            if spec.autostart == "input-probe" and PROBE_READY_MARKER not in guest_log:
                reason = "the input probe has not reported probe_ready on the guest log"
            elif warm or READY_MARKER in guest_log:
                image = domain.display.screendump()
                d = spec.display
                if spec.autostart == "input-probe":
                    ready, reason = probe_drawn(image, width_px=d.width_px, height_px=d.height_px)
                else:
                    ready, reason = desktop_drawn(
                        image,
                        width_px=d.width_px,
                        height_px=d.height_px,
                        background_rgb=spec.image.background_rgb,
                        ready=spec.image.ready,
                    )
                if ready:
                    self._record_frame(image, reason="ready", source="system")
                    return
            if self._clock.monotonic_ns() >= deadline_ns:
                tail = domain.console_tail()
                raise BootTimeout(
                    f"session {self.id}: desktop not ready after {spec.boot_timeout_s:.0f} s "
                    f"({reason}); console tail:\n{tail}",
                    console_tail=tail,
                )
            self._clock.sleep(
                min(self._ready_poll_s, WARM_READY_POLL_S) if warm else self._ready_poll_s
            )

    def close(self, *, reason: str = "deleted") -> None:
        """Destroy the domain, delete the overlay and close the recording. Idempotent.

        Raises:
            HypervisorError: a teardown step failed (all steps were still attempted).
        """
        with self._state_lock:
            if self._state in ("closing", "closed"):
                return
            if self._state == "failed":
                return
            was = self._state
            self._state = "closing"
            self._closing.set()
        if was == "new":
            self._state = "closed"
            self._recorder.close(status="closed")
            return
        self._teardown(reason=reason)

    def _teardown(self, *, reason: str) -> None:
        # Called without the action lock held so that a close interrupts a long action.
        self._closing.set()
        self.closed_reason = reason
        errors: list[str] = []
        if self._frames is not None:
            self._frames.stop()
            if self._capture_fps is not None:
                with contextlib.suppress(DeskvmError):
                    self._frames.still(reason="closing")
        if self._domain is not None:
            with contextlib.suppress(DeskvmError):
                self._guest_log_snapshot = self._log_before_reset + self._domain.read_guest_log()
                self._console_snapshot = self._domain.console_tail(64 * 1024)
        try:
            self._hypervisor.destroy(self.id)
        except DeskvmError as exc:
            errors.append(exc.message)
        if self._domain is not None:
            with contextlib.suppress(DeskvmError):
                self._domain.display.close()
        egress_errors = self._detach_egress()
        errors += egress_errors
        with contextlib.suppress(DeskvmError):
            self._recorder.append(
                "lifecycle", {"event": "closed", "reason": reason, "errors": errors}
            )
        self._write_guest_log_copy()
        with contextlib.suppress(DeskvmError):
            self._recorder.close(status="closed" if not errors else "closed_with_errors")
        if self._store is not None:
            self._store.delete(self.id)
        if self._state != "failed":
            self._state = "closed"
        if errors:
            if len(errors) == len(egress_errors):
                raise EgressError("; ".join(errors))
            raise HypervisorError("; ".join(errors))

    def _detach_egress(self, *, wait: bool = True) -> list[str]:
        """Stop the poller, record the last decisions, detach; every step runs (once:
        close and an interrupted start may both call it; without ``wait``, nothing is
        done while the other one is at it)."""
        if not self._detach_lock.acquire(blocking=wait):
            return []
        try:
            if self._egress is None or not self._egress_attached:
                return []
            return self._detach_egress_locked()
        finally:
            self._detach_lock.release()

    def _detach_egress_locked(self) -> list[str]:
        assert self._egress is not None
        errors: list[str] = []
        self._poller_stop.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=10)
        try:
            self.drain_network(final=True)
        except DeskvmError as exc:
            errors.append(f"egress decisions: {exc.message}")
        try:
            self._egress.detach(self.id)
        except DeskvmError as exc:
            errors.append(exc.message)
        else:
            with contextlib.suppress(DeskvmError):
                self._recorder.append("network", {"event": "detached"})
        self._egress_attached = False
        return errors

    def _write_guest_log_copy(self) -> None:
        path = self._recorder.path
        if path is not None:
            guest_log, console = self._guest_log_snapshot, self._console_snapshot
            for secret in self._secrets:
                # The guest may echo secret text; the recording keeps only its digest.
                mark = "[secret length={length} hmac_sha256={hmac_sha256}]".format(
                    **self._recorder.secret_digest(secret)
                )
                guest_log = guest_log.replace(secret.encode(), mark.encode())
                console = console.replace(secret, mark)
            with contextlib.suppress(OSError):
                (path / "guest.log").write_bytes(guest_log)
                (path / "console.log").write_text(console)

    # --- persistence, deadlines, adoption (a bridge restart loses no session) -----------

    @property
    def approval_policy(self) -> ApprovalPolicy | None:
        """Which actions wait for an operator (``None``: none); see :meth:`execute`.

        Setting it stores it in the session's record.
        """
        return self._approval_policy

    @approval_policy.setter
    def approval_policy(self, policy: ApprovalPolicy | None) -> None:
        self._approval_policy = policy
        self._persist_quietly()

    def set_extra(self, key: str, value: Any) -> None:
        """Keep ``value`` (JSON-ready) under ``key`` in the session's record, now.

        For the layers above (the bridge keeps the session's token ids and revocations
        here, so a restarted bridge refuses what was revoked).

        Raises:
            StoreError: the record could not be written (the value is not kept).
        """
        old = self.extras.get(key)
        self.extras[key] = value
        try:
            self.persist()
        except DeskvmError:
            self.extras[key] = old
            raise

    def record(self) -> SessionRecord:
        """What a restarted server needs to carry on with this session."""
        path = self._recorder.path
        attachment = self.egress_attachment
        policy = self._approval_policy
        return SessionRecord(
            session_id=self.id,
            owner=self.owner,
            boot_id=boot_id(),
            state="ready" if self._state == "ready" else "starting",
            spec=spec_to_json(self.spec),
            created_ns=self.created_ns,
            last_action_ns=self.last_action_ns,
            ready_ns=self.ready_ns,
            boot_s=self.boot_s,
            created_at=self.created_at.isoformat(),
            ready_at=None if self.ready_at is None else self.ready_at.isoformat(),
            recording=None if path is None else str(path),
            cursor=self._cursor,
            approval_policy=None if policy is None else policy.to_json(),
            typed_text=self.typed.to_json(),
            egress=None if attachment is None else dataclasses.asdict(attachment),
            extras=dict(self.extras),
        )

    def persist(self) -> None:
        """Write the session's record to its store (no-op without one, or once ended).

        Raises:
            StoreError: it could not be written.
        """
        if self._store is not None and self._state in ("starting", "ready"):
            # One writer at a time, each saving what it sees under the lock: a record
            # built before an extension can never be saved after it.
            with self._persist_lock:
                self._store.save(self.record())

    def _persist_quietly(self) -> None:
        try:
            self.persist()
        except DeskvmError as exc:
            # The session goes on (its deadlines are still enforced in this process); the
            # recording says once that a restart might not find it.
            if not self._store_error_reported:
                self._store_error_reported = True
                with contextlib.suppress(DeskvmError):
                    self._recorder.append("marker", {"event": "store_error", "error": exc.message})

    @property
    def ttl_deadline_ns(self) -> int | None:
        """When ``ttl_s`` runs out (``CLOCK_MONOTONIC`` ns), or ``None``."""
        ttl_s = self.spec.ttl_s
        return None if ttl_s is None else self.created_ns + int(ttl_s * 1e9)

    @property
    def idle_deadline_ns(self) -> int | None:
        """When ``idle_timeout_s`` runs out without an action (ready sessions), or ``None``."""
        idle_s = self.spec.idle_timeout_s
        if idle_s is None or self._state != "ready":
            return None
        return self.last_action_ns + int(idle_s * 1e9)

    def seconds_left(self) -> tuple[float | None, float | None]:
        """Seconds until the ttl and the idle deadline (``None``: no such deadline)."""
        now_ns = self._clock.monotonic_ns()
        ttl, idle = self.ttl_deadline_ns, self.idle_deadline_ns
        return (
            None if ttl is None else (ttl - now_ns) / 1e9,
            None if idle is None else (idle - now_ns) / 1e9,
        )

    def _expiry_locked(self, now_ns: int) -> str | None:
        if self._expired is None:
            ttl, idle = self.ttl_deadline_ns, self.idle_deadline_ns
            if ttl is not None and now_ns >= ttl:
                self._expired = CLOSED_TTL
            elif idle is not None and now_ns >= idle:
                self._expired = CLOSED_IDLE
        return self._expired

    def expiry(self) -> str | None:
        """:data:`CLOSED_TTL` or :data:`CLOSED_IDLE` once a deadline has passed, else
        ``None``. Sticky: once expired, always expired (an extension comes too late).
        ``None`` while a :meth:`reset` runs (it is activity; a ttl that ran out meanwhile
        is seen after it)."""
        with self._deadline_lock:
            if self._resetting:
                return None
            return self._expiry_locked(self._clock.monotonic_ns())

    @property
    def resetting(self) -> bool:
        """Whether a :meth:`reset` is under way (its domain is briefly gone)."""
        return self._resetting

    def extend_ttl(self, ttl_s: float, *, max_ttl_s: float | None) -> None:
        """Set the session's lifetime to ``ttl_s`` seconds from its creation.

        Atomic with :meth:`expiry` (one lock): an extension that comes before the
        deadline holds (the new deadline is stored before this returns, so a restart or
        the sweeper never ends the session early); one that comes at or after it fails
        and the session stays expired. It may shorten the lifetime too.

        Args:
            ttl_s: the new total lifetime, seconds (more than the session has run).
            max_ttl_s: the server's maximum (``None``: no maximum).

        Raises:
            ConfigError: ``ttl_s`` not positive, above ``max_ttl_s``, or not more than the
                session has already run (it would end now).
            SessionClosed: code ``session_expired``: a deadline had already passed; or
                ``session_closed``: the session has ended.
            StoreError: the new deadline could not be stored (it is not taken).
        """
        if not ttl_s > 0:
            raise ConfigError(f"ttl_s must be positive, got {ttl_s:g}")
        if max_ttl_s is not None and ttl_s > max_ttl_s:
            raise ConfigError(
                f"ttl_s {ttl_s:g} is above this server's maximum of {max_ttl_s:g} s "
                "(deskvm serve --max-ttl-s)"
            )
        with self._deadline_lock:
            if self._state not in ("starting", "ready") or self._closing.is_set():
                raise SessionClosed(f"session {self.id} is {self._state}")
            now_ns = self._clock.monotonic_ns()
            expired = self._expiry_locked(now_ns)
            if expired is not None:
                raise SessionClosed(
                    f"session {self.id} has already expired ({expired}); it is being ended",
                    code="session_expired",
                )
            ran_s = (now_ns - self.created_ns) / 1e9
            if self.created_ns + int(ttl_s * 1e9) <= now_ns:
                raise ConfigError(
                    f"ttl_s {ttl_s:g} would end the session now: it has run {ran_s:.1f} s"
                )
            old = self.spec
            self.spec = dataclasses.replace(old, ttl_s=ttl_s)
            try:
                self.persist()
            except DeskvmError:
                self.spec = old
                raise
        with contextlib.suppress(DeskvmError):
            self._recorder.append("lifecycle", {"event": "ttl", "ttl_s": ttl_s, "ran_s": ran_s})

    @classmethod
    def adopt(
        cls,
        record: SessionRecord,
        *,
        hypervisor: Hypervisor,
        recorder: Recorder,
        clock: Clock | None = None,
        pacing: Pacing | None = None,
        egress: Egress | None = None,
        capture_fps: float | None = None,
        network_poll_s: float = 1.0,
        store: SessionStore | None = None,
        owner: str = "",
    ) -> Session:
        """Take back a running session from its record after a server restart.

        The domain keeps running under libvirt (QMP is reached through libvirt again, the
        guest helper's socket is reconnected), the egress is re-adopted (its resolver and
        packet logger restarted if they died with the server), every modifier key and
        button is released (the old server may have died mid-action), continuous capture
        resumes, and the recording (``recorder``, reopened with a ``gap`` marker) gets an
        ``adopted`` lifecycle event. Deadlines, cursor, approval policy, recent typed text
        and extras come from the record.

        Args:
            record: the session's record (state ``ready``).
            recorder: its recording, reopened (``FileRecorder.reopen``).
            hypervisor, clock, pacing, egress, capture_fps, network_poll_s, store, owner:
                as for the constructor.

        Raises:
            ConfigError: the record is not a ready session or its spec is invalid.
            HypervisorError, EgressError, DisplayError: the domain or its egress cannot
                be taken back; the session is then ended (domain destroyed, egress
                detached, recording closed with the reason) before the error propagates.
        """
        if record.state != "ready":
            raise ConfigError(f"session {record.session_id} was still starting; not adoptable")
        session = cls(
            record.session_spec,
            hypervisor=hypervisor,
            recorder=recorder,
            clock=clock,
            pacing=pacing,
            egress=egress,
            capture_fps=capture_fps,
            network_poll_s=network_poll_s,
            store=store,
            owner=owner,
        )
        session.created_ns = record.created_ns
        session.last_action_ns = record.last_action_ns
        session.ready_ns = record.ready_ns
        session.boot_s = record.boot_s
        if record.created_at:
            session.created_at = datetime.fromisoformat(record.created_at)
        if record.ready_at:
            session.ready_at = datetime.fromisoformat(record.ready_at)
        if record.cursor is not None:
            session._cursor = (int(record.cursor[0]), int(record.cursor[1]))
        if record.approval_policy is not None:
            session._approval_policy = ApprovalPolicy.from_json(record.approval_policy)
        session.typed = TypedWindow.from_json(record.typed_text)
        session.extras = dict(record.extras)
        session._state = "ready"
        try:
            session._take_back(record)
        except BaseException as exc:
            detail = exc.message if isinstance(exc, DeskvmError) else repr(exc)
            session._state = "closing"
            with contextlib.suppress(DeskvmError):
                session._teardown(reason=f"could not be re-adopted after a restart: {detail}")
            raise
        return session

    def _take_back(self, record: SessionRecord) -> None:
        spec = self.spec
        if spec.egress is not None:
            assert self._egress is not None
            self._egress_attached = True  # detached at teardown even if adoption fails
            self.egress_attachment = self._egress.adopt(self.id, spec.egress)
            self._decisions_seen = self._recorded_decisions()
        self._domain = self._hypervisor.adopt(spec)
        step = release_all(set(MODIFIER_QCODES), set(_ALL_BUTTONS))
        self._domain.display.send(
            step.events, width_px=spec.display.width_px, height_px=spec.display.height_px
        )
        now_ns = self._clock.monotonic_ns()
        self._recorder.append(
            "lifecycle",
            {
                "event": "adopted",
                "by": self.owner,
                "ttl_left_s": None
                if self.ttl_deadline_ns is None
                else round((self.ttl_deadline_ns - now_ns) / 1e9, 3),
                "egress": self.egress_attachment is not None,
            },
        )
        self._recorder.append(
            "injected", {"events": _describe_steps([step]), "why": "released after adoption"}
        )
        if self._egress is not None:
            self._poller = threading.Thread(
                target=self._poll_decisions, name=f"deskvm-net-{self.id}", daemon=True
            )
            self._poller.start()
        self._start_capture()
        self.persist()

    def _recorded_decisions(self) -> set[tuple[tuple[object, ...], int]]:
        """Identities of the network decisions already in the recording (after a restart
        the decision logs are read again from their start)."""
        seen: set[tuple[tuple[object, ...], int]] = set()
        path = self._recorder.path
        if path is None:
            return seen
        with contextlib.suppress(OSError), (path / "events.jsonl").open(encoding="utf-8") as f:
            for line in f:
                if '"kind":"network"' not in line:
                    continue
                try:
                    data = json.loads(line)["data"]
                    if "kind" in data:
                        decision = decision_from_json(data, self.id)
                        self._decisions.append(decision)
                        seen.add((decision.retry_key, decision.ts_ns))
                except (ValueError, KeyError, TypeError):
                    continue
        return seen

    def detach(self, *, reason: str) -> None:
        """Leave the session running for a restarted server (graceful exit that keeps
        sessions): capture and the network poller stop (settled decisions are recorded),
        the recording gets a ``detached`` marker and is left open for
        ``FileRecorder.reopen``, the record is written. The domain, its overlay and its
        egress stay; this object is done with it.
        """
        with self._state_lock:
            if self._state != "ready":
                return
            self._state = "closing"  # no more actions through this object
        self._closing.set()
        if self._frames is not None:
            self._frames.stop()
        self._poller_stop.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=10)
        with contextlib.suppress(DeskvmError):
            self.drain_network()
        self._state = "ready"
        with contextlib.suppress(DeskvmError):
            self.persist()
        self._state = "closing"
        with contextlib.suppress(DeskvmError):
            self._recorder.detach(reason=reason)
        if self._domain is not None and self._domain.helper is not None:
            with contextlib.suppress(DeskvmError):
                self._domain.helper.close()
        self.closed_reason = f"detached: {reason}"
        self._state = "closed"

    # --- observation ----------------------------------------------------------------

    def guest_log(self) -> bytes:
        """Everything the guest wrote to ``/dev/ttyS1`` so far (kept after close)."""
        if self._domain is not None and self._state in ("starting", "ready"):
            return self._log_before_reset + self._domain.read_guest_log()
        return self._guest_log_snapshot

    def domain_running(self) -> bool:
        """Whether the session's domain (its QEMU process) is still running and its guest
        can run: ``False`` too when QEMU stopped it for good (``Domain.stop_error``)."""
        domain = self._domain
        return domain is not None and domain.is_running() and domain.stop_error() is None

    def guest_key_events(self) -> int | None:
        """The guest X server's count of processed key events, as its helper last reported
        (see :mod:`orchestrator.display.key_pacing`); ``None`` without a counting helper."""
        domain = self._domain
        if domain is None or domain.helper is None:
            return None
        return domain.helper.key_events()

    def console_tail(self, max_bytes: int = 4096) -> str:
        """The last bytes of the guest console (empty once closed)."""
        if self._domain is not None and self._state in ("starting", "ready"):
            return self._domain.console_tail(max_bytes)
        return ""

    @property
    def frames(self) -> FrameCapture | None:
        """The session's capture loop (live frames for viewers); ``None`` unless ready."""
        return self._frames if self._state == "ready" else None

    @property
    def cursor(self) -> tuple[int, int]:
        """Where the host last put the pointer (display pixels)."""
        return self._cursor

    # --- actions --------------------------------------------------------------------

    def approval_reason(self, action: Action) -> str | None:
        """Why :attr:`approval_policy` holds ``action`` now (given what was typed lately),
        or ``None``."""
        policy = self.approval_policy
        return None if policy is None else policy.reason(action, self.typed)

    def execute(
        self,
        action: Action,
        *,
        source: Source = "agent",
        raw: Mapping[str, Any] | None = None,
        gate: Callable[[Action, str], None] | None = None,
        by: str | None = None,
    ) -> Result:
        """Carry out one action and return its result.

        The action is validated, appended to the recording, then injected; the result (or
        error) is appended after. Whatever happens, no key or button is left pressed.

        Args:
            action: what to do (display pixels).
            source: who asked (recorded).
            raw: the message as received, when it was translated from a vendor schema.
            gate: called as ``gate(action, reason)`` when :attr:`approval_policy` holds
                the action (:meth:`approval_reason`); it returns once an operator
                approved, or raises (e.g. ``ApprovalDenied``) and nothing is injected.
                The check, the wait and the action run under the session's action lock,
                so actions of other connections cannot slip text in between (a text
                rule split over two connections is still caught).
            by: the credential behind it (``admin``, ``token:<id>``), recorded as the input
                event's ``by`` (a person's input during a take-over).

        Raises:
            SessionClosed: the session is not ready.
            ActionError: the action is not valid here (e.g. off-screen); nothing was injected.
            DisplayError: injection or capture failed.
        """
        display = self.spec.display
        with self._lock:
            if self._state != "ready":
                raise SessionClosed(f"session {self.id} is {self._state}")
            expired = self.expiry()
            if expired is not None:
                # A passed deadline ends the session even before the sweeper gets to it.
                raise SessionClosed(f"session {self.id} has expired ({expired})")
            if is_guest_action(action) and not self.spec.guest_control:
                raise ActionError(
                    f"{action_name(action)}: guest control is off for session {self.id}; "
                    'create the session with "guest_control": true to use it',
                    code="guest_control_disabled",
                )
            if gate is not None:
                reason = self.approval_reason(action)
                if reason is not None:
                    gate(action, reason)
                    if self._state != "ready":
                        raise SessionClosed(f"session {self.id} is {self._state}")
            self.last_action_ns = self._clock.monotonic_ns()
            assert self._domain is not None
            record: dict[str, Any] = {"action": action_to_dict(action)}
            if by is not None:
                record["by"] = by
            secret = action.text if isinstance(action, Type) and action.secret else ""
            if secret:
                record["action"].update(self._recorder.secret_digest(secret))
                if secret not in self._secrets:
                    self._secrets.append(secret)
            if raw is not None:
                record["raw"] = _scrub(raw, secret) if secret else dict(raw)
            if is_guest_action(action):
                return self._guest(action, record, source)  # type: ignore[arg-type]
            try:
                check_bounds(action, display.width_px, display.height_px)
                steps = self._plan(action)
            except DeskvmError as exc:
                self._recorder.append("input", record, source=source)
                self._recorder.append("error", {"code": exc.code, "message": exc.message})
                raise
            self._recorder.append("input", record, source=source)
            # Counted as typed once it may reach the guest (even if injection fails midway).
            self.typed.feed(action)
            try:
                # The still of the input moment: only for actions that inject input (a
                # screenshot records its own still; taking two cost a second screendump).
                if self._frames is not None and self._capture_fps is not None and steps:
                    self._frames.still(reason="input", source=source)
                if steps and secret:
                    count = sum(len(s.events) or 1 for s in steps)
                    self._recorder.append(
                        "injected", {"events": None, "count": count, "secret": True},
                        source=source,
                    )  # fmt: skip
                elif steps:
                    self._recorder.append(
                        "injected", {"events": _describe_steps(steps)}, source=source
                    )
                result = self._run(action, steps, source)
            except DeskvmError as exc:
                self._release_everything()
                if self._closing.is_set():
                    # Torn down under the action: whatever failed, the answer is that the
                    # session ended (the recording may already be closed).
                    with contextlib.suppress(DeskvmError):
                        self._recorder.append(
                            "error", {"code": "session_closed", "message": exc.message}
                        )
                    raise SessionClosed(f"session {self.id} ended during the action") from exc
                self._recorder.append("error", {"code": exc.code, "message": exc.message})
                raise
            except BaseException:
                self._release_everything()
                raise
            outcome = _result_record(action, result)
            if self._key_pacer is not None:
                outcome.update(self._key_pacer.summary())
            self._recorder.append("result", outcome)
            self._persist_quietly()  # last action (the idle deadline), cursor, typed text
            return result

    def _guest(self, action: GuestAction, record: dict[str, Any], source: Source) -> Result:
        """Carry out a guest control action through the helper (under the action lock).

        The request is recorded (sizes and hashes, no contents) before it is sent; the
        checked result is recorded after, marked as the guest's word.
        """
        assert self._domain is not None
        helper = self._domain.helper
        try:
            if helper is None:
                reason: str | None = f"the image {self.spec.image.name!r} has no guest helper"
            else:
                reason = helper.unavailable_reason(wait_s=HELPER_ANNOUNCE_WAIT_S)
            if reason is not None:
                raise ActionError(
                    f"{action_name(action)} needs the in-guest helper, which is not "
                    f"available: {reason}",
                    code="guest_control_unavailable",
                )
            if isinstance(action, SetResolution):
                self._check_resolution(action.width, action.height)
        except DeskvmError as exc:
            self._recorder.append("input", record, source=source)
            self._recorder.append("error", {"code": exc.code, "message": exc.message})
            raise
        secret = _secret_of(action)
        if secret is not None:
            record["action"]["digest"] = self._recorder.secret_digest(secret)
        self._recorder.append("input", record, source=source)
        assert helper is not None
        try:
            result = run_guest_action(helper, action, digest=self._recorder.secret_digest)
            if isinstance(action, SetResolution):
                self._display_changed(int(result.data["width"]), int(result.data["height"]))
        except DeskvmError as exc:
            if self._closing.is_set():
                with contextlib.suppress(DeskvmError):
                    self._recorder.append(
                        "error", {"code": "session_closed", "message": exc.message}
                    )
                raise SessionClosed(f"session {self.id} ended during the action") from exc
            self._recorder.append("error", {"code": exc.code, "message": exc.message})
            raise
        self._recorder.append("result", {**result.record, "reported_by": "guest"})
        self._persist_quietly()
        return result

    def _check_resolution(self, width_px: int, height_px: int) -> None:
        """Refuse a size the running display cannot take, naming sizes it can.

        Raises:
            ActionError: code ``unsupported_resolution``.
        """
        try:
            check_display_size(width_px, height_px, memory_kib=self._display_memory_kib)
        except ConfigError as exc:
            raise ActionError(
                f"{width_px}x{height_px} is not a size this display can take: {exc.message}. "
                + supported_sizes_hint(width_px, height_px, self._display_memory_kib),
                code="unsupported_resolution",
            ) from None

    def _display_changed(self, width_px: int, height_px: int) -> None:
        """The guest says its screen is now ``width_px`` x ``height_px``: check and adopt it.

        The screendump must show the new size (within 5 s); then the session's display
        (bounds of actions, the tablet's scaling, screenshots, stream) follows it.

        Raises:
            DisplayError: the display does not show what the guest reported.
        """
        assert self._domain is not None
        deadline = time.monotonic() + 5.0
        while True:
            shown = self._domain.display.screendump().size
            if shown == (width_px, height_px):
                break
            if time.monotonic() > deadline:
                raise DisplayError(
                    f"the guest reported a {width_px}x{height_px} screen but the display "
                    f"shows {shown[0]}x{shown[1]}"
                )
            time.sleep(0.1)
        self.spec = dataclasses.replace(
            self.spec, display=DisplaySpec(width_px=width_px, height_px=height_px)
        )
        x, y = self._cursor
        self._cursor = (min(x, width_px - 1), min(y, height_px - 1))
        self._recorder.append(
            "lifecycle", {"event": "display_changed", "display": [width_px, height_px]}
        )

    def _plan(self, action: Action) -> list[PlanStep]:
        """The action's input steps; refuses (before any input) what cannot be carried out.

        Raises:
            ActionError: ``untypeable_text`` / ``unsupported_input``: the action needs the
                in-guest helper and it is not available.
        """
        assert self._domain is not None
        hwheel = True
        if isinstance(action, Scroll) and action.dx:
            hwheel = self._domain.display.horizontal_wheel()
        steps = plan_action(
            action,
            self._pacing,
            horizontal_wheel=hwheel,
            cursor=self._cursor,
            key_flow_control=self._key_flow_control(),
            keyboard_layout=self.spec.layout,
        )
        needs = next((s for s in steps if isinstance(s, HelperStep)), None)
        if needs is None:
            return steps
        helper = self._domain.helper
        reason: str | None
        if helper is None:
            reason = f"the image {self.spec.image.name!r} has no guest helper"
        else:
            reason = helper.unavailable_reason(wait_s=HELPER_ANNOUNCE_WAIT_S)
        if reason is None:
            if needs.op == "type":
                assert helper is not None
                self._check_helper_text(needs.args["text"], helper.hello_info, action)
            return steps
        if needs.op == "type":
            try:
                text_to_combos(needs.args["text"], self.spec.layout)
            except ActionError as exc:
                what = exc.message
                if isinstance(action, Type) and action.secret:
                    what = (
                        "the text has a character with no key on the guest's "
                        f"{self.spec.layout} keyboard layout"
                    )
                raise ActionError(
                    f"{what}; such text is typed by the in-guest helper, which is not "
                    f"available: {reason}",
                    code="untypeable_text",
                ) from None
        raise ActionError(
            "horizontal scroll: this host's QEMU has no horizontal wheel (QMP InputButton "
            "wheel-left/wheel-right, QEMU 8.1 and later) and the in-guest helper that "
            f"scrolls instead is not available: {reason}",
            code="unsupported_input",
        )

    def _key_flow_control(self) -> bool:
        """Whether the display paces keys by the guest's acknowledgement (asked once)."""
        if self._key_flow is None:
            assert self._domain is not None
            self._key_flow = self._domain.display.key_flow_control()
        return self._key_flow

    def _check_helper_text(self, text: str, hello: Mapping[str, Any], action: Action) -> None:
        """Refuse (before any input) text the helper cannot type in one request."""
        if len(text) > HELPER_MAX_TEXT_CHARS:
            raise ActionError(
                "text with characters that have no key on the guest's layout is typed by the "
                f"guest helper, at "
                f"most {HELPER_MAX_TEXT_CHARS} characters per action: send it in parts",
                code="untypeable_text",
            )
        spare = hello.get("spare_keycodes")
        if not isinstance(spare, int):
            return
        layout = self.spec.layout
        distinct = len({c for c in text if not _has_key(c, layout)})
        if distinct > spare:
            raise ActionError(
                f"the text has {distinct} different characters with no {layout.upper()} key; "
                f"the guest helper types at most {spare} different ones per action (its spare "
                "keycodes, never rebound within an action): send it in parts",
                code="untypeable_text",
            )

    def _helper_request(self, step: HelperStep) -> None:
        assert self._domain is not None and self._domain.helper is not None
        size = len(step.args.get("text", "")) + int(step.args.get("count", 0))
        timeout_s = HELPER_BASE_TIMEOUT_S + HELPER_PER_EVENT_TIMEOUT_S * size
        self._domain.helper.request(step.op, step.args, timeout_s=timeout_s)

    def _run(self, action: Action, steps: list[PlanStep], source: Source) -> Result:
        assert self._domain is not None
        display = self.spec.display
        # Keys wait for the guest X server to take those before (see key_pacing).
        if self._key_pacer is None or self._key_pacer.helper is not self._domain.helper:
            self._key_pacer = KeyPacer(self._domain.helper)
        pacer = self._key_pacer
        pacer.begin_action()
        for index, step in enumerate(steps):
            if self._closing.is_set():
                raise SessionClosed(f"session {self.id} ended during the action")
            if isinstance(step, HelperStep):
                if step.op == "type" and not self._keys_down:
                    # The helper's XTEST text must not overtake QEMU keys sent before it that
                    # the X server has not read yet: wait until all are counted.
                    pacer.before(KEY_ACK_WINDOW, self._closing)
                self._helper_request(step)
            else:
                keys = sum(isinstance(event, KeyEvent) for event in step.events)
                if keys and not self._keys_down:
                    # Room for the whole press..release group, before its first press:
                    # never wait while a key is down (a held key autorepeats in the guest,
                    # X after 660 ms, the kernel's evdev after 250 ms).
                    pacer.before(_key_group(steps, index), self._closing)
                if self._closing.is_set():
                    raise SessionClosed(f"session {self.id} ended during the action")
                self._domain.display.send(
                    step.events, width_px=display.width_px, height_px=display.height_px
                )
                pacer.sent(keys)
                self._track(step.events)
            if self._clock.sleep(step.pause_s, self._closing):
                raise SessionClosed(f"session {self.id} ended during the action")
        match action:
            case Screenshot():
                return self._capture(source)
            case Zoom(x0=x0, y0=y0, x1=x1, y1=y1):
                return self._capture(source, box=(x0, y0, x1, y1))
            case CursorPosition():
                return CursorResult(*self._cursor)
            case Wait(ms=ms):
                if self._clock.sleep(ms / 1000, self._closing):
                    raise SessionClosed(f"session {self.id} ended during the wait")
                return Done()
            case _:
                return Done()

    def _track(self, events: tuple[InputEvent, ...]) -> None:
        for event in events:
            match event:
                case AbsMove(x=x, y=y):
                    self._cursor = (x, y)
                case KeyEvent(qcode=q, down=down):
                    (self._keys_down.add if down else self._keys_down.discard)(q)
                case ButtonEvent(button=b, down=down):
                    (self._buttons_down.add if down else self._buttons_down.discard)(b)

    def _release_everything(self) -> None:
        if self._domain is None or not (self._keys_down or self._buttons_down):
            return
        step = release_all(self._keys_down, self._buttons_down)
        with contextlib.suppress(DeskvmError):
            d = self.spec.display
            self._domain.display.send(step.events, width_px=d.width_px, height_px=d.height_px)
        self._keys_down.clear()
        self._buttons_down.clear()

    def _capture(self, source: Source, box: tuple[int, int, int, int] | None = None) -> ImageResult:
        assert self._domain is not None
        if self._frames is not None:
            event, image, png = self._frames.still(reason="screenshot", source=source)
            frame_seq, pts_ns = event.seq, int(event.data["pts_ns"])
        else:
            pts_ns = self._clock.monotonic_ns()
            image = self._domain.display.screendump()
            png = encode_png(image)
            frame_seq = self._recorder.add_frame(
                png, pts_ns=pts_ns, reason="screenshot", source=source
            ).seq
        if box is not None:
            image = image.crop(box)
            png = encode_png(image)
        t_s = round((pts_ns - self._recorder.origin_ns) / 1e9, 6)
        return ImageResult(image.width, image.height, "image/png", png, frame_seq, t_s)

    def screenshot_after(
        self, still_ms: int, timeout_ms: int, *, source: Source = "agent"
    ) -> tuple[ImageResult, bool, int]:
        """Wait until the screen has been still for ``still_ms``, then record a still of it.

        Gives up after ``timeout_ms`` and returns the screen as it is then. The still is a
        ``frame`` event (reason ``settled`` or ``settle_timeout``) followed by a ``result``
        event ``{"action": "screenshot_after", "settled", "waited_ms", "frame_seq"}``.

        Returns:
            The PNG screenshot, whether the screen settled, and the milliseconds waited.

        Raises:
            SessionClosed: the session is not ready (or ended while waiting).
            DisplayError: a screendump failed.
        """
        frames = self._frames
        if self._state != "ready" or frames is None:
            raise SessionClosed(f"session {self.id} is {self._state}")
        self.last_action_ns = self._clock.monotonic_ns()
        frame, settled, waited_s = frames.wait_still(
            still_ms / 1000, timeout_ms / 1000, cancel=self._closing
        )
        if self._closing.is_set():
            raise SessionClosed(f"session {self.id} ended while waiting for a still screen")
        reason = "settled" if settled else "settle_timeout"
        event, image, png = frames.record_still(frame, reason=reason, source=source)
        waited_ms = round(waited_s * 1000)
        self._recorder.append(
            "result",
            {"action": "screenshot_after", "settled": settled, "waited_ms": waited_ms,
             "frame_seq": event.seq},
        )  # fmt: skip
        t_s = round((frame.pts_ns - self._recorder.origin_ns) / 1e9, 6)
        shot = ImageResult(image.width, image.height, "image/png", png, event.seq, t_s)
        return shot, settled, waited_ms

    def _record_frame(self, image: Image.Image, *, reason: str, source: Source) -> int:
        pts_ns = self._clock.monotonic_ns()
        return self._recorder.add_frame(
            encode_png(image), pts_ns=pts_ns, reason=reason, source=source
        ).seq

    def held(self) -> tuple[set[str], set[str]]:
        """Keys (qcodes) and buttons the host currently holds down (empty between actions)."""
        return set(self._keys_down), set(self._buttons_down)

    def uptime_s(self) -> float:
        return (time.monotonic_ns() - self.created_ns) / 1e9

    def reset(self) -> float:
        """Return the desktop to its start state: restore :attr:`start_state` onto a fresh
        overlay (what was written, typed or opened since is gone), or run the *spare* the
        warm pool restored ahead (see
        :meth:`~orchestrator.hypervisor.base.Hypervisor.prepare_reset`; ``spare`` in
        ``reset_done`` says which).

        Runs between actions (it takes the action lock). The recording stays one bundle:
        a ``lifecycle`` ``reset`` event is appended before the restore, a ``reset_done``
        event (with ``reset_s`` and the clock offset) and a ``ready`` frame after it. The
        guest's wall clock is set again, held keys and buttons are forgotten, the host's
        pointer position returns to the centre, the display returns to the size the
        session was created with (after a ``set_resolution``), and the guest log keeps what
        was written before the reset (:meth:`guest_log`).

        Returns:
            Seconds the reset took (also :attr:`last_reset_s`).

        Raises:
            ConfigError: code ``reset_unavailable``: no saved start state (a cold start).
            SessionClosed: the session is not ready.
            HypervisorError: the restore failed (the session's domain is gone).
            BootTimeout: the restored desktop was not drawn in time.
        """
        if self._state in ("closing", "closed", "failed"):
            raise SessionClosed(f"session {self.id} is {self._state}, not ready")
        if self.start_state is None and self.spec.egress is not None and self.start_kind == "warm":
            raise ConfigError(
                f"session {self.id} has egress: its warm start restored a desktop onto its "
                "own network, and resets of such sessions are not supported yet",
                code="reset_unavailable",
            )
        if self.start_state is None:
            raise ConfigError(
                f"session {self.id} started cold and has no saved start state; only sessions "
                'handed a warm-pool desktop ("start": "warm") can be reset',
                code="reset_unavailable",
            )
        with self._lock:
            with self._deadline_lock:
                if self._state != "ready" or self._domain is None:
                    raise SessionClosed(f"session {self.id} is {self._state}, not ready")
                expired = self._expiry_locked(self._clock.monotonic_ns())
                if expired is not None:
                    raise SessionClosed(
                        f"session {self.id} has expired ({expired})", code="session_expired"
                    )
                self._resetting = True
            try:
                return self._reset_locked()
            finally:
                with self._deadline_lock:
                    self._resetting = False

    def _reset_locked(self) -> float:
        """The reset itself; the action lock is held and ``_resetting`` is set."""
        assert self.start_state is not None and self._domain is not None
        t0 = self._clock.monotonic_ns()
        self._recorder.append("lifecycle", {"event": "reset", "count": self.resets + 1})
        with contextlib.suppress(DeskvmError):
            self._log_before_reset += self._domain.read_guest_log()
        if self.spec.display != self._created_display:
            # The saved start state has the display the session was created with.
            self.spec = dataclasses.replace(self.spec, display=self._created_display)
        mark = self._clock.monotonic_ns()
        try:
            domain, spare = self._hypervisor.reset(self.spec, self.start_state)
        except DeskvmError:
            self._check_not_closed_during_reset()
            raise
        self._check_not_closed_during_reset()
        phases: dict[str, float] = {}
        phases["restore_s"], mark = self._since(mark)
        self._domain = domain
        if self._frames is not None:
            self._frames.replace_display(domain.display)
        self.clock_offset_s = domain.set_clock(timeout_s=CLOCK_SET_TIMEOUT_S)
        phases["clock_s"], mark = self._since(mark)
        self._keys_down.clear()
        self._buttons_down.clear()
        self._cursor = (self.spec.display.width_px // 2, self.spec.display.height_px // 2)
        self.typed = TypedWindow()
        deadline_ns = t0 + int(RESET_READY_TIMEOUT_S * 1e9)
        while True:
            if self._closing.is_set():
                raise SessionClosed(f"session {self.id} was closed while resetting")
            if (stopped := domain.stop_error()) is not None:
                raise AccelFailed(f"session {self.id}: QEMU stopped the reset guest: {stopped}")
            image = domain.display.screendump()
            d = self.spec.display
            ready, reason = desktop_drawn(
                image,
                width_px=d.width_px,
                height_px=d.height_px,
                background_rgb=self.spec.image.background_rgb,
                ready=self.spec.image.ready,
            )
            if ready:
                self._record_frame(image, reason="ready", source="system")
                break
            if self._clock.monotonic_ns() >= deadline_ns:
                raise BootTimeout(
                    f"session {self.id}: the reset desktop was not drawn within "
                    f"{RESET_READY_TIMEOUT_S:g} s ({reason})",
                    console_tail=domain.console_tail(),
                )
            self._clock.sleep(min(self._ready_poll_s, WARM_READY_POLL_S))
        phases["ready_s"], mark = self._since(mark)
        self.resets += 1
        self.last_reset_s = round((self._clock.monotonic_ns() - t0) / 1e9, 3)
        self.reset_phases_s = phases
        self.last_action_ns = self._clock.monotonic_ns()
        self._recorder.append(
            "lifecycle",
            {
                "event": "reset_done",
                "count": self.resets,
                "reset_s": self.last_reset_s,
                "spare": spare,
                "phases_s": phases,
                "clock_offset_s": self.clock_offset_s,
            },
        )
        return self.last_reset_s

    def _check_not_closed_during_reset(self) -> None:
        """After the restore of a reset: a session closed meanwhile stays closed.

        ``close`` sets ``_closing`` before it destroys the domain, so either its destroy
        came after the restore (the domain is gone) or the flag is seen here.
        """
        if self._closing.is_set():
            with contextlib.suppress(DeskvmError):
                self._hypervisor.destroy(self.id)
            raise SessionClosed(f"session {self.id} was closed while resetting")


def _secret_of(action: GuestAction) -> str | None:
    """The content a secret guest action keeps out of the recording (keyed digest only)."""
    match action:
        case Exec(secret=True, argv=argv, stdin=stdin, env=env):
            return json.dumps([list(argv), stdin, list(env)])
        case PutFile(secret=True, data=data):
            return data.hex()
        case ClipboardSet(secret=True, text=text):
            return text
    return None


def supported_sizes_hint(width_px: int, height_px: int, memory_kib: int) -> str:
    """A sentence naming the sizes a display with ``memory_kib`` of video memory takes,
    and the nearest ones to ``width_px`` x ``height_px``."""

    def fits(w: int, h: int) -> bool:
        try:
            check_display_size(w, h, memory_kib=memory_kib)
        except ConfigError:
            return False
        return True

    near: list[str] = []
    h = min(max(height_px, MIN_DISPLAY_PX), MAX_DISPLAY_PX)
    for w in (width_px - width_px % 8, width_px - width_px % 8 + 8):
        w = min(max(w, MIN_DISPLAY_PX), MAX_DISPLAY_PX)
        if fits(w, h) and f"{w}x{h}" not in near:
            near.append(f"{w}x{h}")
    if not near:
        near = [s for s in ("1920x1080", "1280x800", "1024x768", "800x600") if fits(
            *map(int, s.split("x")))]  # fmt: skip
    pixels = memory_kib * 1024 // 8
    return (
        f"It can do widths that are multiples of 8, each side {MIN_DISPLAY_PX}.."
        f"{MAX_DISPLAY_PX} px, at most {pixels} pixels in all ({memory_kib // 1024} MiB of "
        f"video memory, two 32-bit frames); nearest: {', '.join(near)}"
    )


def _has_key(char: str, layout: str) -> bool:
    try:
        text_to_combos(char, layout)
    except ActionError:
        return False
    return True


def _describe_steps(steps: list[PlanStep]) -> list[str]:
    out: list[str] = []
    for step in steps:
        if isinstance(step, HelperStep):
            a = step.args
            if step.op == "type":
                out.append(f"helper type {len(a['text'])} chars")
            else:
                out.append(f"helper wheel {a['direction']} x{a['count']} at {a['x']} {a['y']}")
        else:
            out += [_describe(e) for e in step.events]
    return out


def _describe(event: InputEvent) -> str:
    match event:
        case AbsMove(x=x, y=y):
            return f"abs {x} {y}"
        case ButtonEvent(button=b, down=down):
            return f"btn {'down' if down else 'up'} {b}"
        case KeyEvent(qcode=q, down=down):
            return f"key {'down' if down else 'up'} {q}"
        case _:
            return f"wheel {event.direction}"


def _scrub(raw: Any, secret: str) -> Any:
    """``raw`` with every string containing ``secret`` replaced by ``"[secret]"``."""
    if isinstance(raw, str):
        return "[secret]" if secret in raw else raw
    if isinstance(raw, Mapping):
        return {k: _scrub(v, secret) for k, v in raw.items()}
    if isinstance(raw, list | tuple):
        return [_scrub(v, secret) for v in raw]
    return raw


def _key_group(steps: list[PlanStep], start: int) -> int:
    """Key events from ``steps[start]`` until every key pressed since is released again."""
    down: set[str] = set()
    total = 0
    for step in steps[start:]:
        for event in step.events:
            if isinstance(event, KeyEvent):
                total += 1
                (down.add if event.down else down.discard)(event.qcode)
        if not down:
            break
    return total


def _result_record(action: Action, result: Result) -> dict[str, Any]:
    out: dict[str, Any] = {"action": action_name(action)}
    match result:
        case ImageResult():
            out.update(
                width=result.width_px, height=result.height_px, frame_seq=result.frame_seq,
                bytes=len(result.data),
            )  # fmt: skip
        case CursorResult(x=x, y=y):
            out.update(x=x, y=y)
        case Done(detail=detail):
            out.update(dict(detail))
        case GuestResult(record=record):
            out.update(dict(record))
    return out
