"""The hypervisor seam: start and destroy one session's disposable domain.

A :class:`Hypervisor` creates the session's qcow2 overlay on the read-only base image,
starts a transient domain labelled with the session id, and on :meth:`destroy` removes
both. The running :class:`Domain` exposes its display (frames and input) and its logs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from orchestrator.display.base import DisplayBackend
from orchestrator.display.guest_helper import GuestHelper
from orchestrator.spec import SessionSpec

__all__ = [
    "Accel",
    "AccelSwitch",
    "AccelVerdict",
    "Domain",
    "Hypervisor",
    "NicAttachment",
    "SavedState",
    "SessionPaths",
]

Accel = Literal["kvm", "tcg"]

log = logging.getLogger("deskvm.hypervisor")


@dataclass(frozen=True, slots=True)
class SessionPaths:
    """Host files of one session (all under ``root``, removed on destroy).

    Attributes:
        root: ``<state_dir>/sessions/<session_id>``.
        overlay: the qcow2 overlay whose backing file is the image's base.
        console_log: the guest's first serial port (kernel and systemd messages).
        guest_log: the guest's second serial port (``/dev/ttyS1``), written by the desktop.
        helper_socket: host end of the guest helper's virtio-serial channel (QEMU listens).
        nvram: UEFI variables of an image that boots with UEFI firmware.
        generation: how often the session was reset: each reset's domain has its own
            overlay, sockets and logs (it is restored while the old domain still exists:
            virtlogd holds the old one's logs, and libvirt removes its sockets when it
            has cleaned it up).
    """

    root: Path
    generation: int = 0

    @classmethod
    def under(cls, sessions_dir: Path, session_id: str) -> SessionPaths:
        return cls(root=sessions_dir / session_id)

    def _name(self, stem: str, suffix: str) -> Path:
        return self.root / (f"{stem}{suffix}" if self.generation == 0 else
                            f"{stem}.r{self.generation}{suffix}")  # fmt: skip

    @property
    def overlay(self) -> Path:
        return self._name("overlay", ".qcow2")

    @property
    def console_log(self) -> Path:
        return self._name("console", ".log")

    @property
    def guest_log(self) -> Path:
        return self._name("guest", ".log")

    @property
    def nvram(self) -> Path:
        """UEFI variable store of a ``uefi`` image's domain (copied from the firmware's)."""
        return self.root / "nvram.fd"

    @property
    def helper_socket(self) -> Path:
        return self._name("helper", ".sock")

    @property
    def clock_socket(self) -> Path:
        """Host end of the guest clock's virtio-serial channel (QEMU listens)."""
        return self._name("clock", ".sock")


@dataclass(frozen=True, slots=True)
class NicAttachment:
    """Where a session's one NIC plugs in (only sessions with an egress policy get one).

    ``nic=None`` (no attachment) means the domain has no ``<interface>`` element at all.

    Attributes:
        bridge: host bridge name (``dvm<session_id>``, see ``orchestrator.egress``).
        mac: the guest NIC's MAC address, ``52:54:00:xx:xx:xx``.
        tap: the name the host side of the NIC (the tap) must get, ``dvg<session_id>``
            (libvirt ``<target dev=.../>``): the bridge's non-IP filter matches frames by
            this port name. ``None`` lets libvirt pick ``vnetN`` (no port match).
    """

    bridge: str
    mac: str
    tap: str | None = None


LIVE_CPU_WEIGHT = 1024
"""cgroup CPU shares of a live session's domain (libvirt's default)."""


@dataclass(frozen=True, slots=True)
class SavedState:
    """A session domain's saved running state: what warm starts and resets restore.

    Attributes:
        root: the directory holding both files (owned by whoever saved it).
        disk_cap_mib: the virtual size of the saved overlay, MiB (clones get the same).
    """

    root: Path
    disk_cap_mib: int

    @property
    def state_file(self) -> Path:
        """libvirt's save image (domain XML + QEMU migration stream)."""
        return self.root / "state.save"

    @property
    def disk(self) -> Path:
        """The saved overlay, read-only from now on: the backing file of every clone's."""
        return self.root / "disk.qcow2"


class Domain(Protocol):
    """A running session domain."""

    @property
    def session_id(self) -> str: ...

    @property
    def display(self) -> DisplayBackend: ...

    @property
    def helper(self) -> GuestHelper | None:
        """The in-guest helper's channel, or ``None`` when the image has no helper."""
        ...

    def is_running(self) -> bool:
        """Whether the domain is still running (a guest may power itself off)."""
        ...

    def stop_error(self) -> str | None:
        """Why QEMU stopped the guest on its own, else ``None``.

        Such a guest stays paused and alive (``is_running`` is still true) but never runs
        again: QEMU's run state (QMP ``query-status``) is ``internal-error``, its
        accelerator could not run an instruction (``KVM internal error ... emulation
        failure``). The text names that state and QEMU's error lines from its log. A
        domain the host paused (a save, a reset's spare) gives ``None``.
        """
        ...

    def console_tail(self, max_bytes: int = 4096) -> str:
        """The last ``max_bytes`` of the guest console, decoded leniently."""
        ...

    def read_guest_log(self, offset: int = 0) -> bytes:
        """Bytes the guest wrote to ``/dev/ttyS1`` from ``offset`` on."""
        ...

    def set_clock(self, timeout_s: float = 1.0) -> float | None:
        """Set the guest's wall clock to the host's (after a restore from a saved state).

        Goes over the guest clock's own virtio-serial port (``dev.deskvm.clock.0``, read
        by root in the guest); images without it never answer.

        Returns:
            The guest's clock minus the host's right after, seconds (the guest's word),
            or ``None`` when the guest did not confirm within ``timeout_s``.
        """
        ...

    def set_link(self, up: bool) -> None:
        """Set the link state of the domain's NIC (its virtual cable), as the guest sees it.

        A warm start with egress takes the restored guest's link down and up again: the
        guest drops its saved DHCP lease on the carrier loss and asks the session's DHCP
        server anew when the carrier is back (a host-side signal through the NIC's
        emulated hardware: no guest program, no network path into the guest).

        Raises:
            HypervisorError: the domain has no NIC, or the hypervisor refused.
        """
        ...


class AccelVerdict(Protocol):
    """What a hypervisor learns of the host's KVM, kept by its owner (the runtime keeps it in
    the host file, :func:`orchestrator.host.store_accel`).

    The host's probe boots a boot sector; some hosts (a PVM ``/dev/kvm``) run that but stop
    every Linux kernel with ``KVM internal error``. The first such stop, before any Linux
    guest reached ready under KVM on the host, makes TCG the verdict; once one did, a stop
    is that guest's (a one-off emulation failure, or an image that provokes one) and moves
    nothing.

    Attributes:
        pinned: the owner fixed KVM (``DESKVM_ACCEL=kvm``, or a cluster node whose label
            says ``kvm``): a stop is stored but the hypervisor does not switch.
        kvm_proven: a Linux guest reached ready under KVM on this host before.
    """

    pinned: bool
    kvm_proven: bool

    def kvm_failed(self, reason: str) -> None:
        """Store TCG as the host's verdict, with ``reason``."""
        ...

    def kvm_ran_linux(self) -> None:
        """Store that a Linux guest reached ready under KVM (sets ``kvm_proven``)."""
        ...


class AccelSwitch:
    """The acceleration a hypervisor starts domains with, and what it learns of the host's
    KVM: the shared body of :meth:`Hypervisor.fall_back_to_tcg` and
    :meth:`Hypervisor.kvm_ran_linux`. Thread-safe.

    Args:
        accel: the host's verdict (or the forced acceleration).
        verdict: where what is learnt is kept; ``None``: KVM was forced, a stop is reported.

    Attributes:
        kvm_ran: how often a guest reached ready under KVM.
    """

    def __init__(self, accel: Accel, verdict: AccelVerdict | None) -> None:
        self._accel: Accel = accel
        self._verdict = verdict
        self._told = False
        self._lock = threading.Lock()
        self.kvm_ran = 0

    @property
    def accel(self) -> Accel:
        return self._accel

    def fall_back_to_tcg(self, reason: str) -> bool:
        """See :meth:`Hypervisor.fall_back_to_tcg`. A verdict that cannot be stored is
        logged: the switch holds for this process all the same."""
        with self._lock:
            if self._accel == "tcg":
                return True
            verdict = self._verdict
            if verdict is None or verdict.kvm_proven:
                return False
            try:
                verdict.kvm_failed(reason)
            except Exception as exc:
                log.warning("could not store the TCG verdict: %s", exc)
            if verdict.pinned:
                return False
            self._accel = "tcg"
        log.warning(
            "KVM stopped a guest (%s): this and every later domain run under TCG, which is "
            "slower and, as QEMU documents, not a security boundary",
            reason,
        )
        return True

    def kvm_ran_linux(self) -> None:
        """See :meth:`Hypervisor.kvm_ran_linux`; the verdict is told once."""
        with self._lock:
            if self._accel != "kvm":
                return
            self.kvm_ran += 1
            verdict, self._told = (None if self._told else self._verdict), True
        if verdict is not None and not verdict.kvm_proven:
            try:
                verdict.kvm_ran_linux()
            except Exception as exc:
                log.warning("could not store that KVM ran a Linux guest: %s", exc)


class AccelSwitched:
    """The acceleration part of :class:`Hypervisor`, for a class whose ``_accel`` is its
    :class:`AccelSwitch`."""

    _accel: AccelSwitch

    @property
    def accel(self) -> Accel:
        return self._accel.accel

    def fall_back_to_tcg(self, reason: str) -> bool:
        """See :meth:`Hypervisor.fall_back_to_tcg`."""
        return self._accel.fall_back_to_tcg(reason)

    def kvm_ran_linux(self) -> None:
        """See :meth:`Hypervisor.kvm_ran_linux`."""
        self._accel.kvm_ran_linux()


class Hypervisor(Protocol):
    """Starts and destroys disposable session domains."""

    @property
    def accel(self) -> Accel: ...

    def fall_back_to_tcg(self, reason: str) -> bool:
        """KVM stopped a guest (:class:`~orchestrator.errors.AccelFailed`): start every later
        domain under TCG, as its :class:`AccelVerdict` allows.

        Returns:
            ``True`` when later domains run TCG (switched now, or already); ``False`` when
            the failure is to be reported: no verdict (KVM forced), a pinned one, or KVM
            already ran a Linux guest to ready here.
        """
        ...

    def kvm_ran_linux(self) -> None:
        """A guest reached ready under KVM: tell the verdict (once); a no-op under TCG."""
        ...

    def start(self, spec: SessionSpec, *, nic: NicAttachment | None = None) -> Domain:
        """Create the overlay and start the domain for ``spec``.

        Leaves nothing behind when it fails.

        Raises:
            HypervisorError: overlay creation or domain start failed.
        """
        ...

    def adopt(self, spec: SessionSpec) -> Domain:
        """Take back the running domain of ``spec`` (a restarted server's session).

        Nothing is started or changed: the domain must be running and belong to this
        installation; the display and the guest helper's channel are opened anew.

        Raises:
            HypervisorError: no such running domain of this installation.
        """
        ...

    def destroy(self, session_id: str) -> None:
        """Destroy the domain and delete the overlay and session files. Idempotent.

        Every step runs even when one fails.

        Raises:
            HypervisorError: some step failed (the message lists which).
        """
        ...

    def list_sessions(self) -> set[str]:
        """Session ids of every deskvm domain or session directory on the host."""
        ...

    def save(self, session_id: str, dest: Path) -> SavedState:
        """Save the running domain's state (memory, devices) and freeze its disk.

        The domain stops; its overlay moves to ``dest`` as a read-only layer and its
        session files are removed. ``dest`` must not exist.

        Raises:
            HypervisorError: the save failed (``dest`` is removed, the domain destroyed).
        """
        ...

    def restore(
        self,
        spec: SessionSpec,
        state: SavedState,
        *,
        cpu_weight: int | None = None,
        paused: bool = False,
        nic: NicAttachment | None = None,
    ) -> Domain:
        """Start ``spec``'s domain from ``state`` on a fresh overlay over ``state.disk``.

        The clone has its own name, UUID, VM generation ID (the guest reseeds its RNG),
        overlay, logs and helper socket. ``cpu_weight`` (cgroup CPU shares, default 1024)
        below the default makes it yield to live sessions (see :meth:`set_cpu_weight`).
        ``paused``: its vCPUs stay stopped (no CPU used, the guest's clocks stand still)
        until :meth:`resume`. ``nic``: where the saved NIC plugs in now (the session's
        bridge and tap; its ``mac`` must be the saved NIC's, which a restore keeps), for a
        state saved with a NIC; a state without one takes no ``nic``. Leaves nothing
        behind when it fails.

        Raises:
            HypervisorError: the state file is missing or corrupt, the state's NIC and
                ``nic`` do not match (one without the other, another MAC), or the
                restore failed.
        """
        ...

    def keep_state(self, session_id: str, state: SavedState) -> SavedState:
        """Give the session its own reference to ``state`` (its start state).

        The files are hard links in the session's directory: they outlive the pool's
        template and go with the session (:meth:`destroy` removes them). Called for a
        running session (a claimed warm desktop), or before the session's :meth:`restore`
        (which then takes the returned state: the clone's overlay backs onto the
        session's own copy, whatever becomes of the pool's files).

        Raises:
            HypervisorError: the links could not be made.
        """
        ...

    def reset(self, spec: SessionSpec, state: SavedState) -> tuple[Domain, bool]:
        """Replace the session's running domain by a fresh restore of ``state``; returns
        the new domain and whether it was the session's spare.

        The domain is destroyed, its overlay deleted; the same session id and directory
        are used again (the new domain is the session's next *generation*, with its own
        overlay and sockets). The new domain runs at a live session's CPU weight
        (:data:`LIVE_CPU_WEIGHT`) and memory hard limit, whatever the saved state had (a
        warm pool saves its template at a low weight). When :meth:`prepare_reset` has
        restored the next generation ahead (a *spare*), that domain is run instead of a
        restore (a spare being restored is waited for). On failure the session's domain
        is gone.

        Raises:
            HypervisorError: the restore failed (the session has no domain any more).
        """
        ...

    def prepare_reset(
        self, spec: SessionSpec, state: SavedState, *, cpu_weight: int | None = None
    ) -> None:
        """Restore ``state`` ahead, paused, as the running session's next generation (a
        *spare*), for its next :meth:`reset` to run. A no-op when it has a spare.

        The running domain is not touched. The spare has its own name, UUID, VM
        generation ID, overlay and sockets, runs at ``cpu_weight`` until the reset, and
        goes with the session (:meth:`destroy`, :meth:`discard_reset_spare`). Leaves
        nothing behind when it fails.

        Raises:
            CapacityError: ``insufficient_disk``.
            HypervisorError: the session has ended, or the restore failed (the session is
                not affected).
        """
        ...

    def discard_reset_spare(self, session_id: str) -> bool:
        """Destroy the session's spare (:meth:`prepare_reset`); whether it had one."""
        ...

    def resume(self, session_id: str) -> None:
        """Run a domain restored ``paused`` (a no-op for a running one).

        Raises:
            HypervisorError: no such domain, or libvirt refused.
        """
        ...

    def set_cpu_weight(self, session_id: str, cpu_weight: int) -> None:
        """Set the running domain's CPU shares (cgroup weight; 1024 is the default).

        Raises:
            HypervisorError: no such domain, or libvirt refused.
        """
        ...
