"""The hypervisor seam: start and destroy one session's disposable domain.

A :class:`Hypervisor` creates the session's qcow2 overlay on the read-only base image,
starts a transient domain labelled with the session id, and on :meth:`destroy` removes
both. The running :class:`Domain` exposes its display (frames and input) and its logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from orchestrator.display.base import DisplayBackend
from orchestrator.display.guest_helper import GuestHelper
from orchestrator.spec import SessionSpec

__all__ = ["Accel", "Domain", "Hypervisor", "NicAttachment", "SessionPaths"]

Accel = Literal["kvm", "tcg"]


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
    """

    root: Path

    @classmethod
    def under(cls, sessions_dir: Path, session_id: str) -> SessionPaths:
        return cls(root=sessions_dir / session_id)

    @property
    def overlay(self) -> Path:
        return self.root / "overlay.qcow2"

    @property
    def console_log(self) -> Path:
        return self.root / "console.log"

    @property
    def guest_log(self) -> Path:
        return self.root / "guest.log"

    @property
    def nvram(self) -> Path:
        """UEFI variable store of a ``uefi`` image's domain (copied from the firmware's)."""
        return self.root / "nvram.fd"

    @property
    def helper_socket(self) -> Path:
        return self.root / "helper.sock"


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

    def console_tail(self, max_bytes: int = 4096) -> str:
        """The last ``max_bytes`` of the guest console, decoded leniently."""
        ...

    def read_guest_log(self, offset: int = 0) -> bytes:
        """Bytes the guest wrote to ``/dev/ttyS1`` from ``offset`` on."""
        ...


class Hypervisor(Protocol):
    """Starts and destroys disposable session domains."""

    @property
    def accel(self) -> Accel: ...

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
