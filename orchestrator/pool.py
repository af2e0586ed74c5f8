"""The warm pool: desktops restored from a saved state, ready before anyone asks.

For each :class:`PoolTarget` (``deskvm serve --warm-pool IMAGE:N``) the pool boots one
*template* session cold, waits until its desktop is drawn (and its guest helper has
announced itself, and its guest clock answers: the guest starts it once the desktop is
ready, :data:`TEMPLATE_CLOCK_WAIT_S`), and saves it
(:meth:`~orchestrator.hypervisor.base.Hypervisor.save`): memory and devices into
``state.save``, the disk frozen as a read-only layer. It then keeps ``N`` clones restored
from that state (each on its own overlay over the frozen
layer, with its own name, UUID and VM generation ID), restored at a low CPU weight
(:data:`POOL_CPU_WEIGHT`) and kept *paused* (no CPU used while it waits; the manager
resumes it at the claim) except the next one to be claimed, which runs, so that a
session that matches the target's
:class:`PoolKey` is handed a drawn desktop instead of booting one
(:meth:`WarmPool.claim`). A background thread refills the pool after each claim. A claim
that finds its target empty while a restore for it is under way (claims came faster than
restores) waits for that restore, up to :data:`CLAIM_WAIT_S`, instead of booting cold; a
claim that finds nothing to wait for is logged and counted (``empty_claims`` in
:meth:`WarmPool.status`).

The refill restores the next desktop once the claimed session is ready
(:meth:`WarmPool.settled`, at most :data:`SETTLE_MAX_S` after the claim; at once when a
claim waits): on a 2-core host a restore beside a claim slowed the claim's first frame.

Reset spares: after its own desktops, the refill thread restores each warm session's
start state ahead as the session's next generation, paused, at :data:`POOL_CPU_WEIGHT`
(:meth:`WarmPool.want_spare`,
:meth:`~orchestrator.hypervisor.base.Hypervisor.prepare_reset`): the session's next
reset runs it instead of restoring. A spare counts in :meth:`WarmPool.memory_mib` (so in
the memory budget), is restored only when the budget has room, and is evicted after the
pooled desktops (and by the refill of a pooled desktop that has no room: a pooled desktop
saves a cold boot, a spare ~1 s of a reset). A pooled desktop itself cannot serve a
reset: libvirt renames only inactive persistent domains, and a session's domains carry
its id in their name.

Identity: pool desktops have session ids and directories like sessions (a claimed one
*becomes* the session), so the session manager keeps them out of its reaper
(:meth:`WarmPool.ids`); a server that stops leaves them to the reaper of its
successor, which does not know them. Memory: every pool domain's hard limit counts in
the server's memory budget (``reserve``); the manager evicts pool desktops when a
session needs the room (:meth:`WarmPool.evict`). Invalidation: the image is resolved
again on every refill round; a new content hash, or a base file rebuilt in place (same
hash, another inode or mtime), drops the template and its desktops and builds anew.
Faults: a save or restore that fails is reported in :meth:`WarmPool.status` (and the
log); the template is dropped and rebuilt after
:data:`RETRY_S`, and sessions boot cold meanwhile.

Egress targets (``IMAGE:egress``, :attr:`PoolTarget.egress`): the template boots with a
NIC on an egress attachment of its own that allows nothing (its own bridge, /30 and
DHCP server), takes its DHCP lease, and is saved; then its attachment is removed. No
clone is restored ahead: a session's network exists only once its policy is known, and
a restore needs the bridge its NIC plugs into. So :meth:`WarmPool.claim_state` hands
the saved state itself (and the NIC's MAC baked into it) to the claiming session, which
attaches its own network accepting that MAC and restores onto it (see
``Session.start``). Every clone keeps the template's MAC, each behind its own bridge:
clones never share a link.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.egress.base import Egress
from orchestrator.errors import AccelFailed, ConfigError, DeskvmError, HypervisorError
from orchestrator.hypervisor.base import (
    LIVE_CPU_WEIGHT,
    Domain,
    Hypervisor,
    NicAttachment,
    SavedState,
)
from orchestrator.hypervisor.domain_xml import hard_limit_mib
from orchestrator.session import READY_MARKER, desktop_drawn
from orchestrator.settings import PoolTarget, parse_warm_pool
from orchestrator.spec import BootImage, DisplaySpec, EgressPolicy, SessionSpec

__all__ = [
    "CLAIM_WAIT_S",
    "DEFAULT_CPU_WEIGHT",
    "POOL_CPU_WEIGHT",
    "RETRY_S",
    "SETTLE_MAX_S",
    "TEMPLATE_LEASE_TIMEOUT_S",
    "PoolKey",
    "PoolTarget",
    "WarmDesktop",
    "WarmPool",
    "WarmState",
    "parse_warm_pool",
    "remove_stale_pools",
]

log = logging.getLogger("deskvm.pool")

POOL_CPU_WEIGHT = 64
"""cgroup CPU shares of pool domains and template boots (live sessions have 1024)."""
DEFAULT_CPU_WEIGHT = LIVE_CPU_WEIGHT
"""cgroup CPU shares a claimed desktop gets back (libvirt's default)."""
RETRY_S = 30.0
"""How long the pool waits before it builds a failed template again, seconds."""
CLAIM_WAIT_S = 5.0
"""How long a claim that finds its target empty waits for the restore under way, seconds
(a restore takes 0.6-2 s on a 2-core TCG host; a cold boot 15-30 s)."""
SETTLE_MAX_S = 3.0
"""How long the refill holds a restore back for a claimed desktop whose session is not
ready yet, seconds (see :meth:`WarmPool.settled`)."""
TEMPLATE_LEASE_TIMEOUT_S = 60.0
"""How long an egress target's template may take for its DHCP lease, seconds."""
TEMPLATE_CLOCK_WAIT_S = 30.0
"""How long a template waits for its guest clock to answer before it is saved anyway,
seconds. The guest starts its clock once its desktop is ready; a state saved before then
would wake up in every clone with a clock that cannot be set yet. An image without the guest
clock (imported) is saved after this wait, and its clones keep the clock of the save."""


@dataclass(frozen=True, slots=True)
class PoolKey:
    """What a pooled desktop must share with a requested session to be handed out.

    Attributes:
        image_hash: the image's content hash (a rebuilt image never matches old desktops).
        width_px, height_px: display size.
        memory_mib, vcpus: guest RAM and CPUs.
        network: whether the guest has a NIC (an egress target's, for sessions with an
            egress policy).
    """

    image_hash: str
    width_px: int
    height_px: int
    memory_mib: int
    vcpus: int
    network: bool = False

    @classmethod
    def of(
        cls, image: BootImage, display: DisplaySpec, memory_mib: int, vcpus: int, *, network: bool
    ) -> PoolKey:
        return cls(image.content_hash, display.width_px, display.height_px, memory_mib, vcpus,
                   network)  # fmt: skip

    @property
    def digest(self) -> str:
        """16 hex digits naming the key's template directory."""
        text = f"{self.image_hash}/{self.width_px}x{self.height_px}/{self.memory_mib}/" \
            f"{self.vcpus}/{int(self.network)}"  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class WarmDesktop:
    """A restored desktop, ready to become a session.

    Attributes:
        spec: its spec (the session id is already its own).
        domain: the running domain.
        key: what it matches.
        restore_s: how long its restore took, seconds.
        restored_ns: ``CLOCK_MONOTONIC`` ns when it was ready.
        state: the saved state it was restored from (the session's start state).
    """

    spec: SessionSpec
    domain: Domain
    key: PoolKey
    restore_s: float
    restored_ns: int
    state: SavedState
    running: bool = False
    """Whether it was resumed while pooled (the next one to be claimed runs)."""
    live_weight: bool = False
    """Whether it runs at a live session's CPU weight already (the next one to be claimed
    gets it while pooled: see :meth:`WarmPool._run_head`)."""


@dataclass(slots=True)
class _Spare:
    """A warm session's next generation, restored ahead for its next reset."""

    spec: SessionSpec
    state: SavedState
    key: PoolKey
    mib: int
    phase: str = "wanted"  # "wanted", "restoring", "ready"
    taken: bool = False  # a reset is taking it (a restore under way ends in that reset)


@dataclass(frozen=True, slots=True)
class WarmState:
    """An egress target's saved desktop, handed to a session that restores it itself.

    Attributes:
        key: what it matches.
        state: the saved state (the pool's; it may be dropped once the restore is done).
        guest_mac: the MAC of the saved NIC (a restore keeps it): the session's network
            must accept it.
    """

    key: PoolKey
    state: SavedState
    guest_mac: str


def remove_stale_pools(root: Path, *, alive: Callable[[str], bool], keep: str | None) -> list[str]:
    """Remove the pool directories (``root/<server name>``) of servers that are gone.

    A server killed while its pool was filling leaves its saved states behind (its pool
    domains are reaped like unknown sessions). ``alive(name)``: whether that server
    runs; ``keep``: a directory left alone (this server's own pool's).

    Returns:
        The server names whose pool files were removed (logged as warnings).
    """
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name == keep or alive(path.name):
            continue
        size_mib = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) >> 20
        shutil.rmtree(path, ignore_errors=True)
        log.warning(
            "removed the warm pool files of server %r, which is gone (%d MiB of saved state)",
            path.name, size_mib,
        )  # fmt: skip
        removed.append(path.name)
    return removed


def _display_of(target: PoolTarget) -> DisplaySpec:
    try:
        return DisplaySpec(target.width_px, target.height_px)
    except ConfigError as exc:
        raise ConfigError(f"warm pool target {target.image}: {exc.message}") from exc


@dataclass(slots=True)
class _Entry:
    target: PoolTarget
    key: PoolKey | None = None
    image: BootImage | None = None
    state: SavedState | None = None
    desktops: list[WarmDesktop] = field(default_factory=list)
    phase: str = "new"
    error: str | None = None
    failed_at: float | None = None
    template_boot_s: float | None = None
    save_s: float | None = None
    restore_s: list[float] = field(default_factory=list)
    base_stamp: tuple[int, int, int] | None = None
    restoring: int = 0  # restores under way
    starved: bool = False  # the memory budget refused the last refill
    claims: int = 0  # desktops handed out
    waited_claims: int = 0  # of which waited for a restore under way
    empty_claims: int = 0  # claims that found nothing ready nor coming (sessions boot cold)
    handover_failures: int = 0  # claimed desktops the manager could not take over
    spare_resets: int = 0  # resets of its sessions that ran a spare (or waited for one)
    restored_resets: int = 0  # resets of its sessions that had no spare and restored
    guest_mac: str | None = None

    @property
    def ready(self) -> int:
        """Desktops ready to claim (an egress target's saved state counts as one)."""
        if self.target.egress:
            return int(self.state is not None and self.guest_mac is not None)
        return len(self.desktops)


def _base_stamp(image: BootImage) -> tuple[int, int, int] | None:
    """The base image file's identity (device, inode, mtime): a saved state's frozen disk
    backs onto that file, so a rebuild in place (same content hash, ``--force``) must
    drop the template too."""
    try:
        st = image.base_path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


class WarmPool:
    """Keeps desktops restored from saved states ready for :meth:`claim`.

    Args:
        targets: what to keep ready.
        hypervisor: starts, saves and restores domains.
        resolve_image: image name -> built image (the current hash is looked up on
            every refill round).
        pool_dir: this pool's directory (templates live in ``pool_dir/<key digest>``);
            emptied at :meth:`start` and removed at :meth:`close`.
        new_id: makes session ids (each pool domain gets one at creation).
        reserve: ``reserve(mib)`` says whether the pool may commit ``mib`` more MiB of
            host memory (the manager's budget, pool memory counted).
        memory_overhead_mib: QEMU overhead of each domain (as the manager's sessions).
        boot_timeout_s: deadline for a template's desktop to be drawn.
        ready_poll_s: how often a template's readiness is checked, seconds.
        refill_interval_s: how often the refill thread looks at the pool when nothing
            wakes it, seconds.
        claim_wait_s: how long a claim that finds its target empty waits for a restore
            under way (:data:`CLAIM_WAIT_S`).
        egress: the egress seam, for targets with ``egress`` (their templates boot on
            a deny-all attachment of their own).

    Raises:
        ConfigError: a target has ``egress`` but no ``egress`` seam was given.
    """

    def __init__(
        self,
        targets: tuple[PoolTarget, ...],
        *,
        hypervisor: Hypervisor,
        resolve_image: Callable[[str], BootImage],
        pool_dir: Path,
        new_id: Callable[[], str],
        reserve: Callable[[int], bool] = lambda _mib: True,
        memory_overhead_mib: int = 768,
        boot_timeout_s: float = 300.0,
        ready_poll_s: float = 0.5,
        refill_interval_s: float = 2.0,
        claim_wait_s: float = CLAIM_WAIT_S,
        egress: Egress | None = None,
    ) -> None:
        if egress is None and any(t.egress for t in targets):
            raise ConfigError(
                "an egress warm pool target needs egress configured on this server "
                "(--egress-upstream-iface, --egress-upstream-dns)"
            )
        self._hv = hypervisor
        self._egress = egress
        self._resolve = resolve_image
        self.pool_dir = pool_dir
        self._new_id = new_id
        self._reserve = reserve
        self._overhead_mib = memory_overhead_mib
        self._boot_timeout_s = boot_timeout_s
        self._ready_poll_s = ready_poll_s
        self._interval_s = refill_interval_s
        self._claim_wait_s = claim_wait_s
        for target in targets:
            _display_of(target)  # a bad display fails here, not in the refill thread
        self._entries = [_Entry(target=t) for t in targets]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a desktop came, or a refill stopped
        self._busy: dict[str, int] = {}  # ids being booted/restored -> hard limit MiB
        self._handed: set[str] = set()  # claimed, not yet a registered session
        self._settling: dict[str, float] = {}  # claimed, session not ready -> claim time
        self._waiting = 0  # claims waiting for a restore
        self._spares: dict[str, _Spare] = {}  # session id -> its reset spare
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the manager's side -----------------------------------------------------------

    def start(self) -> None:
        """Empty ``pool_dir`` (a previous run's templates) and start refilling."""
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        self.pool_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="deskvm-warm-pool", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop refilling, destroy every pool domain, remove the templates. Idempotent."""
        self._stop.set()
        self._wake.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self._boot_timeout_s + 60)
        with self._lock:
            entries = list(self._entries)
        for entry in entries:
            self._drop(entry, "the server is stopping")
        shutil.rmtree(self.pool_dir, ignore_errors=True)

    def key_of(self, target: PoolTarget, image: BootImage) -> PoolKey:
        return PoolKey.of(
            image, _display_of(target), target.memory_mib, target.vcpus, network=target.egress
        )

    def claim_state(self, key: PoolKey) -> WarmState | None:
        """The saved desktop of the egress target matching ``key`` (``None``: none saved).

        The state stays the pool's (every claim restores the same one); the caller
        restores it onto its own network at once (a rebuilt image drops it).
        """
        with self._lock:
            for e in self._entries:
                if e.key == key and e.target.egress and e.state is not None and e.guest_mac:
                    e.claims += 1
                    return WarmState(key, e.state, e.guest_mac)
        return None

    def claim(self, key: PoolKey) -> WarmDesktop | None:
        """Take a ready desktop matching ``key`` out of the pool (``None``: boot cold).

        When none is ready but one is being restored for ``key`` (or its refill is about
        to start one: the template is saved, nothing failed, the memory budget has room
        and no template boot holds the refill thread), the claim waits for it, up to
        ``claim_wait_s``. A claim that gets nothing is logged and counted
        (``empty_claims``); before any template of ``key`` exists (the pool starting, or
        dropped for a new image) it returns ``None`` at once, unlogged. A desktop whose
        domain stopped is destroyed and skipped. The refill thread is woken. The
        desktop's id stays in :meth:`ids` (out of the reaper's reach) until
        :meth:`release` says the caller has registered it.
        """
        deadline = time.monotonic() + self._claim_wait_s
        waited = False
        while True:
            desktop, why = None, ""
            with self._changed:
                entry = next((e for e in self._entries if e.key == key), None)
                if entry is None:
                    return None  # no target of this shape (or its template is not built)
                while not (entry.key == key and entry.desktops):
                    left_s = deadline - time.monotonic()
                    coming = entry.key == key and self._coming(entry)
                    if left_s <= 0 or not coming:
                        entry.empty_claims += 1
                        why = (
                            f"none came within {self._claim_wait_s:g} s" if coming
                            else self._idle_reason(entry)
                        )  # fmt: skip
                        break
                    waited = True
                    self._waiting += 1
                    self._wake.set()
                    self._changed.notify_all()  # a refill holding back for settling claims
                    try:
                        self._changed.wait(left_s)
                    finally:
                        self._waiting -= 1
                else:
                    desktop = entry.desktops.pop(0)
                    self._handed.add(desktop.spec.session_id)
                    self._settling[desktop.spec.session_id] = time.monotonic()
                    entry.claims += 1
                    entry.waited_claims += waited
            if desktop is None:
                log.warning(
                    "warm pool %s: no desktop ready for a claim (%s); the session boots cold",
                    entry.target.image, why,
                )  # fmt: skip
                return None
            # The refill starts once the claimed session is ready (settled), not now: its
            # restore would compete for the CPU with the claim's resume and first frame.
            self._wake.set()
            if desktop.domain.is_running():
                return desktop
            self.release(desktop.spec.session_id)
            self.settled(desktop.spec.session_id)
            log.warning("warm desktop %s stopped while pooled", desktop.spec.session_id)
            with contextlib.suppress(DeskvmError):
                self._hv.destroy(desktop.spec.session_id)

    def _coming(self, entry: _Entry) -> bool:
        """Whether a desktop for ``entry`` is being restored or about to be (under the
        lock): a claim may wait for it."""
        if entry.restoring:
            return True
        return (
            not self._stop.is_set()
            and entry.state is not None
            and entry.failed_at is None
            and not entry.starved
            and not any(e.phase == "building" for e in self._entries)
        )

    def _idle_reason(self, entry: _Entry) -> str:
        """Why no desktop of ``entry`` is coming (under the lock), for the log."""
        if self._stop.is_set():
            return "the pool is closing"
        if entry.failed_at is not None:
            return f"the pool failed: {entry.error}"
        if entry.starved:
            return "the memory budget has no room for another pool desktop"
        if entry.key is None or entry.state is None:
            return "its template is being built"
        return "the refill thread is building another template"

    def handover_failed(self, desktop: WarmDesktop, why: str) -> None:
        """Count and log a claimed desktop the caller could not take over (it is destroyed
        by the caller, and the session boots cold)."""
        with self._lock:
            for entry in self._entries:
                if entry.key == desktop.key:
                    entry.handover_failures += 1
        log.warning(
            "warm desktop %s could not be handed over (%s); the session boots cold",
            desktop.spec.session_id, why,
        )  # fmt: skip

    def release(self, session_id: str) -> None:
        """Forget a claimed desktop's id (it is a registered session now, or destroyed)."""
        with self._lock:
            self._handed.discard(session_id)

    def settled(self, session_id: str) -> None:
        """Say that a claimed desktop's session is ready (or failed): the refill's next
        restore, held back meanwhile (up to :data:`SETTLE_MAX_S` after the claim), may
        start. Idempotent."""
        with self._changed:
            if self._settling.pop(session_id, None) is not None:
                self._changed.notify_all()
        self._wake.set()

    def _hold_for_claims(self) -> None:
        """Wait (the refill thread) while a claimed desktop's session is getting ready,
        unless a claim waits for a desktop; at most :data:`SETTLE_MAX_S` after its claim.

        On a 2-core host a restore beside a claim slowed the claim's first frame from
        ~0.2 s to 0.7-1.9 s (docs/performance.md)."""
        with self._changed:
            while not self._stop.is_set() and self._waiting == 0:
                now = time.monotonic()
                for sid, at in list(self._settling.items()):
                    if now - at >= SETTLE_MAX_S:
                        del self._settling[sid]  # its manager never said: do not wait for ever
                if not self._settling:
                    return
                self._changed.wait(SETTLE_MAX_S - (now - min(self._settling.values())))

    def ids(self) -> set[str]:
        """Session ids of every pool domain (ready, being restored, template boots)."""
        with self._lock:
            ready = {d.spec.session_id for e in self._entries for d in e.desktops}
            return ready | set(self._busy) | self._handed

    def memory_mib(self) -> int:
        """Host memory committed to pool domains (their hard limits), MiB."""
        with self._lock:
            ready = sum(hard_limit_mib(d.spec) for e in self._entries for d in e.desktops)
            spares = sum(sp.mib for sp in self._spares.values() if sp.phase != "wanted")
            return ready + sum(self._busy.values()) + spares

    def evict(self, need_mib: int, *, keep: PoolKey | None = None) -> int:
        """Destroy ready desktops (other keys than ``keep`` first) until ``need_mib`` MiB
        are freed or none is left; returns the MiB freed."""
        freed = 0
        while freed < need_mib:
            with self._lock:
                victims = [e for e in self._entries if e.desktops and e.key != keep]
                victims = victims or [e for e in self._entries if e.desktops]
                if not victims:
                    break
                desktop = victims[0].desktops.pop()
            freed += hard_limit_mib(desktop.spec)
            with contextlib.suppress(DeskvmError):
                self._hv.destroy(desktop.spec.session_id)
        while freed < need_mib:  # then reset spares (their sessions' resets restore)
            mib = self._evict_spare()
            if not mib:
                break
            freed += mib
        return freed

    def _evict_spare(self) -> int:
        """Destroy one ready reset spare (its session's next reset restores); the MiB
        freed, 0 when there is none."""
        with self._lock:
            sid = next((i for i, sp in self._spares.items() if sp.phase == "ready"), None)
            if sid is None:
                return 0
            mib = self._spares.pop(sid).mib
        with contextlib.suppress(DeskvmError):
            self._hv.discard_reset_spare(sid)
        return mib

    # --- reset spares -----------------------------------------------------------------

    def want_spare(self, spec: SessionSpec, state: SavedState, key: PoolKey) -> None:
        """Ask for a *spare* of a warm session: its start state restored ahead, paused, as
        its next generation (:meth:`~orchestrator.hypervisor.base.Hypervisor.prepare_reset`),
        so that its next reset runs it instead of restoring (~1 s less).

        The refill thread restores it after the pool's own desktops, at the pool's CPU
        weight, within the memory budget (it counts in :meth:`memory_mib`; a session
        that must boot cold evicts it). A no-op when the session has one or no target
        has ``key``."""
        with self._lock:
            had = self._spares.get(spec.session_id)
            if (had is not None and not had.taken) or not any(e.key == key for e in self._entries):
                return
            self._spares[spec.session_id] = _Spare(spec, state, key, hard_limit_mib(spec))
        self._wake.set()

    def take_spare(self, session_id: str, key: PoolKey) -> bool:
        """A reset of ``session_id`` begins: whether its spare is ready or being restored
        (the reset then runs it); the pool forgets it (the reset consumes it), and counts
        the reset (``spare_resets`` or ``restored_resets`` in :meth:`status`)."""
        with self._lock:
            spare = self._spares.get(session_id)
            hit = spare is not None and spare.phase in ("ready", "restoring")
            if spare is not None:
                if spare.phase == "restoring":
                    spare.taken = True  # the refill thread forgets it when done
                else:
                    del self._spares[session_id]
            for entry in self._entries:
                if entry.key == key:
                    if hit:
                        entry.spare_resets += 1
                    else:
                        entry.restored_resets += 1
            return hit

    def drop_spare(self, session_id: str) -> None:
        """Forget ``session_id``'s spare (the session ended: its domains are gone)."""
        with self._lock:
            self._spares.pop(session_id, None)

    def _fill_spares(self) -> None:
        """Restore the spares asked for (the refill thread, after the pool's desktops)."""
        while not self._stop.is_set():
            with self._lock:
                sid = next((i for i, sp in self._spares.items() if sp.phase == "wanted"), None)
                if sid is None:
                    return
                spare = self._spares[sid]
            self._hold_for_claims()
            if self._stop.is_set() or not self._reserve(spare.mib):
                return  # no room: its reset restores
            with self._lock:
                if self._spares.get(sid) is not spare or spare.phase != "wanted":
                    continue
                spare.phase = "restoring"
            try:
                self._hv.prepare_reset(spare.spec, spare.state, cpu_weight=POOL_CPU_WEIGHT)
            except DeskvmError as exc:
                log.info("reset spare of %s: %s", sid, exc.message)
                with self._lock:
                    if self._spares.get(sid) is spare:
                        del self._spares[sid]
                continue
            with self._lock:
                current = self._spares.get(sid) is spare
                if current and spare.taken:
                    del self._spares[sid]  # a reset is running it
                elif current:
                    spare.phase = "ready"
            if not current and not spare.taken:  # the session ended meanwhile
                with contextlib.suppress(DeskvmError):
                    self._hv.discard_reset_spare(sid)

    def status(self) -> list[dict[str, Any]]:
        """One entry per target: ``image``, ``size``, ``ready``, ``phase`` (``new``,
        ``building``, ``filling``, ``full``, ``failed``), ``error``, ``image_hash``,
        ``template_boot_s``, ``save_s``, ``restore_s`` (last restores, seconds), and
        counts since the start: ``claims`` (desktops handed out), ``waited_claims`` (of
        which waited for a restore under way), ``empty_claims`` (claims that found none
        ready nor coming: those sessions booted cold) and ``handover_failures`` (claimed
        desktops that could not be taken over: those sessions booted cold too);
        ``reset_spares`` (spares of its sessions ready now), ``spare_resets`` and
        ``restored_resets`` (resets of its sessions that found their spare ready or under
        way, and that had none)."""
        with self._lock:
            return [
                {
                    "image": e.target.image,
                    "egress": e.target.egress,
                    "size": e.target.size,
                    "display": [e.target.width_px, e.target.height_px],
                    "memory_mib": e.target.memory_mib,
                    "vcpus": e.target.vcpus,
                    "ready": e.ready,
                    "phase": e.phase,
                    "error": e.error,
                    "image_hash": e.key.image_hash if e.key else None,
                    "template_boot_s": e.template_boot_s,
                    "save_s": e.save_s,
                    "restore_s": list(e.restore_s[-5:]),
                    "claims": e.claims,
                    "waited_claims": e.waited_claims,
                    "empty_claims": e.empty_claims,
                    "handover_failures": e.handover_failures,
                    "reset_spares": sum(
                        sp.key == e.key and sp.phase == "ready" for sp in self._spares.values()
                    ),
                    "spare_resets": e.spare_resets,
                    "restored_resets": e.restored_resets,
                }
                for e in self._entries
            ]

    def wait_full(self, timeout_s: float) -> bool:
        """Block until every target has its desktops (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(e.ready >= e.target.size for e in self._entries):
                    return True
            time.sleep(0.2)
        return False

    # --- the refill thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            for entry in self._entries:
                if self._stop.is_set():
                    break
                try:
                    self._fill(entry)
                except Exception:  # the pool must outlive any one failure
                    log.exception("warm pool refill of %s failed", entry.target.image)
            try:
                self._fill_spares()
            except Exception:
                log.exception("warm pool: restoring reset spares failed")
            self._wake.wait(self._interval_s)
            self._wake.clear()

    def _fail(self, entry: _Entry, message: str) -> None:
        log.warning("warm pool %s: %s; sessions boot cold", entry.target.image, message)
        with self._changed:
            entry.phase, entry.error, entry.failed_at = "failed", message, time.monotonic()
            self._changed.notify_all()

    def _fill(self, entry: _Entry) -> None:
        target = entry.target
        if entry.failed_at is not None and time.monotonic() - entry.failed_at < RETRY_S:
            return
        try:
            image = self._resolve(target.image)
        except DeskvmError as exc:
            self._fail(entry, f"image {target.image!r}: {exc.message}")
            return
        key = self.key_of(target, image)
        stamp = _base_stamp(image)
        if entry.key is not None and entry.key != key:
            self._drop(entry, f"image {target.image} changed ({key.image_hash[:12]})")
        elif entry.key is not None and entry.base_stamp != stamp:
            self._drop(entry, f"image {target.image} was rebuilt in place")
        if entry.state is None:
            self._build_template(entry, image, key)
            if entry.state is None:
                return
        if target.egress:  # restored at each claim, onto the session's own network
            with self._lock:
                entry.phase = "full"
            return
        self._run_head(entry)
        while not self._stop.is_set():
            with self._lock:
                if len(entry.desktops) >= target.size:
                    entry.phase = "full"
                    return
                entry.phase = "filling"
            self._hold_for_claims()
            if self._stop.is_set():
                return
            if not self._restore_one(entry, image, key):
                return

    def _spec(self, image: BootImage, target: PoolTarget, session_id: str) -> SessionSpec:
        return SessionSpec(
            session_id=session_id,
            image=image,
            display=_display_of(target),
            memory_mib=target.memory_mib,
            vcpus=target.vcpus,
            boot_timeout_s=self._boot_timeout_s,
            memory_overhead_mib=self._overhead_mib,
        )

    def _take_id(self, entry: _Entry, spec_mib: int) -> str | None:
        """A fresh id registered as busy (before any domain exists), or ``None`` when the
        memory budget has no room (``entry`` is then marked starved: claims do not wait)."""
        room = self._reserve(spec_mib)
        while not room and self._evict_spare():
            # A pooled desktop saves a cold boot, a spare ~1 s of a reset: spares give way.
            room = self._reserve(spec_mib)
        with self._changed:
            entry.starved = not room
            if not room:
                self._changed.notify_all()
                return None
            session_id = self._new_id()
            self._busy[session_id] = spec_mib
        return session_id

    def _build_template(self, entry: _Entry, image: BootImage, key: PoolKey) -> None:
        target = entry.target
        need = hard_limit_mib(self._spec(image, target, "template0000"))
        session_id = self._take_id(entry, need)
        if session_id is None:
            return
        spec = self._spec(image, target, session_id)
        dest = self.pool_dir / key.digest
        stamp = _base_stamp(image)  # before the boot: a rebuild meanwhile is seen next round
        with self._changed:
            entry.phase, entry.key, entry.image = "building", key, image
            self._changed.notify_all()  # claims stop waiting: the refill thread is busy
        t0 = time.monotonic()
        boot_accel = self._hv.accel
        nic: NicAttachment | None = None
        try:
            shutil.rmtree(dest, ignore_errors=True)
            if target.egress:
                assert self._egress is not None
                # Its own network, allowing nothing: the template's guest only gets a lease.
                attachment = self._egress.attach(session_id, EgressPolicy())
                nic = NicAttachment(attachment.bridge, attachment.guest_mac, attachment.guest_port)
            domain = self._hv.start(spec, nic=nic)
            self._hv.set_cpu_weight(session_id, POOL_CPU_WEIGHT)
            self._wait_drawn(spec, domain)
            self._hv.kvm_ran_linux()  # a no-op unless it still runs KVM
            if nic is not None:
                self._wait_leased(session_id)
            self._wait_clock(target.image, domain)
            boot_s = time.monotonic() - t0
            t1 = time.monotonic()
            state = self._hv.save(session_id, dest)
            save_s = time.monotonic() - t1
        except DeskvmError as exc:
            with contextlib.suppress(DeskvmError):
                self._hv.destroy(session_id)
            shutil.rmtree(dest, ignore_errors=True)
            if (
                isinstance(exc, AccelFailed)
                and boot_accel == "kvm"
                and self._hv.fall_back_to_tcg(exc.message)
            ):
                log.warning(
                    "warm pool %s: KVM stopped the template's guest; booting it again under "
                    "TCG now", target.image,
                )  # fmt: skip
                with self._changed:
                    entry.phase = "failed"
                    entry.error, entry.failed_at = f"KVM stopped the template: {exc.message}", None
                    self._changed.notify_all()
                return
            self._fail(entry, f"template boot or save failed: {exc.message}")
            return
        finally:
            if target.egress and self._egress is not None:
                with contextlib.suppress(DeskvmError):
                    self._egress.detach(session_id)
            with self._lock:
                self._busy.pop(session_id, None)
        log.info(
            "warm pool %s: template %s booted in %.1f s, saved in %.1f s",
            target.image, key.digest, boot_s, save_s,
        )  # fmt: skip
        with self._lock:
            entry.state, entry.template_boot_s, entry.save_s = state, boot_s, save_s
            entry.error, entry.failed_at = None, None
            entry.base_stamp = stamp
            entry.guest_mac = nic.mac if nic is not None else None

    def _poll(
        self, done: Callable[[], bool], timeout_s: float, domain: Domain | None = None
    ) -> bool:
        """Call ``done`` every ``ready_poll_s`` until it is true (``True``) or ``timeout_s``
        passed (``False``). Raises :class:`HypervisorError` when the pool closes or
        ``domain`` (if given) stops."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._stop.is_set():
                raise HypervisorError("the pool is closing")
            if domain is not None and not domain.is_running():
                raise HypervisorError("the template domain stopped while booting")
            if domain is not None and (stopped := domain.stop_error()) is not None:
                raise AccelFailed(f"QEMU stopped the template's guest: {stopped}")
            if done():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(self._ready_poll_s)

    def _wait_drawn(self, spec: SessionSpec, domain: Domain) -> None:
        def drawn() -> bool:
            if READY_MARKER not in domain.read_guest_log():
                return False
            d = spec.display
            ready, _why = desktop_drawn(
                domain.display.screendump(),
                width_px=d.width_px,
                height_px=d.height_px,
                background_rgb=spec.image.background_rgb,
                ready=spec.image.ready,
            )
            helper = domain.helper
            return ready and (helper is None or helper.unavailable_reason(wait_s=5.0) is None)

        if not self._poll(drawn, spec.boot_timeout_s, domain):
            raise HypervisorError(
                f"the template desktop was not drawn within {spec.boot_timeout_s:.0f} s"
            )

    def _wait_clock(self, image_name: str, domain: Domain) -> None:
        """Until the template's guest clock confirms a setting (it starts once the desktop is
        ready), at most :data:`TEMPLATE_CLOCK_WAIT_S`; then the template is saved anyway."""
        if not self._poll(
            lambda: domain.set_clock(timeout_s=1.0) is not None, TEMPLATE_CLOCK_WAIT_S, domain
        ):
            log.warning(
                "warm pool %s: the template's guest clock did not answer within %.0f s; "
                "saving it anyway (its clones keep the clock of the save)",
                image_name, TEMPLATE_CLOCK_WAIT_S,
            )  # fmt: skip

    def _wait_leased(self, session_id: str) -> None:
        """Until the template's guest holds its DHCP lease (saved with a settled network)."""
        egress = self._egress
        assert egress is not None
        if not self._poll(
            lambda: egress.leased_ip(session_id) is not None, TEMPLATE_LEASE_TIMEOUT_S
        ):
            raise HypervisorError(
                f"the template took no DHCP lease within {TEMPLATE_LEASE_TIMEOUT_S:.0f} s"
            )

    def _restore_one(self, entry: _Entry, image: BootImage, key: PoolKey) -> bool:
        """Restore one desktop into ``entry``; ``False`` when the round should stop."""
        assert entry.state is not None
        need = hard_limit_mib(self._spec(image, entry.target, "template0000"))
        session_id = self._take_id(entry, need)
        if session_id is None:
            return False
        spec = self._spec(image, entry.target, session_id)
        with self._lock:
            entry.restoring += 1
        t0 = time.monotonic()
        try:
            domain = self._hv.restore(spec, entry.state, cpu_weight=POOL_CPU_WEIGHT, paused=True)
        except DeskvmError as exc:
            with self._lock:
                self._busy.pop(session_id, None)
                entry.restoring -= 1
            # A state that cannot be restored is dropped: it is rebuilt after RETRY_S.
            self._drop(entry, None)
            self._fail(entry, f"restore failed: {exc.message}")
            return False
        restore_s = time.monotonic() - t0
        desktop = WarmDesktop(spec, domain, key, restore_s, time.monotonic_ns(), entry.state)
        with self._changed:
            self._busy.pop(session_id, None)
            entry.restoring -= 1
            if self._stop.is_set():
                stale = True
            else:
                stale = False
                entry.desktops.append(desktop)
                entry.restore_s.append(round(restore_s, 3))
                del entry.restore_s[:-20]
            self._changed.notify_all()
        if stale:
            with contextlib.suppress(DeskvmError):
                self._hv.destroy(session_id)
            return False
        self._run_head(entry)
        return True

    def _run_head(self, entry: _Entry) -> None:
        """Resume the desktop to be claimed next, if it waits paused, at a live session's
        CPU weight.

        The others wait paused (no CPU); the head runs (2.2-4 % of a core under TCG) so
        that a claim gets a guest that is not just waking up: the first screenshot after
        a claim of a just-resumed desktop took ~0.6 s more (docs/performance.md). It gets
        the live weight here, not at the claim: a weight change waited for a restore under
        way (0.3-0.6 s of a claim in the bench); an idle desktop's few percent of a core
        starve nobody whatever its weight.
        """
        with self._lock:
            head = entry.desktops[0] if entry.desktops else None
            if head is None or head.running:
                return
            head.running = True
        try:
            self._hv.set_cpu_weight(head.spec.session_id, DEFAULT_CPU_WEIGHT)
            head.live_weight = True
            self._hv.resume(head.spec.session_id)
        except DeskvmError as exc:  # a claim got it meanwhile, or it died: claim sees
            log.info("warm pool %s: resuming %s: %s", entry.target.image,
                     head.spec.session_id, exc.message)  # fmt: skip

    def _drop(self, entry: _Entry, why: str | None) -> None:
        """Destroy ``entry``'s desktops and remove its template."""
        with self._changed:
            desktops, entry.desktops = entry.desktops, []
            state, entry.state = entry.state, None
            entry.key, entry.guest_mac = None, None
            if why is not None:
                entry.phase = "new"
            self._changed.notify_all()
        if why is not None and (desktops or state is not None):
            log.info("warm pool %s: dropped (%s)", entry.target.image, why)
        for desktop in desktops:
            with contextlib.suppress(DeskvmError):
                self._hv.destroy(desktop.spec.session_id)
        if state is not None:
            shutil.rmtree(state.root, ignore_errors=True)
