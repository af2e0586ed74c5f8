"""What every deskvm installation on one host shares, kept in one host-wide directory.

Several installations (servers with different state directories, a test run beside
``deskvm serve``) may attach session networks on the same host. Their own objects carry
their own names (see :mod:`.plan`); three things cannot, and live here under one lock:

* **slots**: ``slots/<n>`` holds ``"<installation tag> <session id>"``. A slot is one /30
  of the subnet pool and one NFLOG group; claiming it also claims the session id host-wide,
  so bridge and tap names (``dvm<id>``, ``dvg<id>``) can never collide between
  installations (a second attach of the same id is refused before anything is created);
* **IP forwarding** (``net.ipv4.ip_forward``, a host-wide switch): the value found before
  the first session is saved in ``ip_forward.saved``; forwarding stays on while any slot
  is claimed, by any installation, and the saved value is written back when the last one
  is released;
* the lock ``egress.lock`` serialising attach, detach and reap of every installation.

Layout: ``<host_dir>/{egress.lock, slots/<n>, ip_forward.saved}`` (default ``host_dir``
``/run/deskvm/net``: tmpfs, gone at reboot with the kernel objects it describes).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import EgressError

__all__ = ["FORWARD_SYSCTL", "HostRegistry", "SlotClaim"]

FORWARD_SYSCTL = Path("/proc/sys/net/ipv4/ip_forward")

_CLAIM_RE = re.compile(r"^([0-9a-f]{8}) ([a-z0-9]{12})$")


@dataclass(frozen=True, slots=True)
class SlotClaim:
    """One claimed slot: which installation (tag) holds it for which session."""

    slot: int
    installation: str
    session_id: str


class HostRegistry:
    """The host-wide slots and IP forwarding bookkeeping (see the module docstring).

    Args:
        host_dir: the host-wide directory (the same for every installation on the host).
        forward_sysctl: the ``ip_forward`` file (tests point it elsewhere).
    """

    def __init__(self, host_dir: Path, *, forward_sysctl: Path = FORWARD_SYSCTL) -> None:
        self.host_dir = host_dir
        self.forward_sysctl = forward_sysctl
        self._mutex = threading.Lock()

    @property
    def _slots(self) -> Path:
        return self.host_dir / "slots"

    @property
    def _saved(self) -> Path:
        return self.host_dir / "ip_forward.saved"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the host-wide lock (and this process's mutex) for the block."""
        try:
            self.host_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fh = open(self.host_dir / "egress.lock", "w")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise EgressError(f"cannot open the host lock in {self.host_dir}: {exc}") from exc
        with self._mutex, fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def claims(self) -> list[SlotClaim]:
        """Every claimed slot on the host (unreadable or foreign-format files skipped)."""
        found = []
        if self._slots.is_dir():
            for path in self._slots.iterdir():
                with contextlib.suppress(OSError, ValueError):
                    m = _CLAIM_RE.match(path.read_text().strip())
                    if m:
                        found.append(SlotClaim(int(path.name), m.group(1), m.group(2)))
        return sorted(found, key=lambda c: c.slot)

    def claim(self, installation: str, session_id: str, slot_count: int) -> int:
        """Claim the lowest free slot for ``session_id`` of ``installation`` (under the lock).

        Raises:
            EgressError: the session id is already attached on this host (by any
                installation), or every slot is taken.
        """
        for held in self.claims():
            if held.session_id == session_id:
                owner = "this" if held.installation == installation else "another"
                raise EgressError(
                    f"session {session_id} is already attached on this host ({owner} "
                    f"deskvm installation, slot {held.slot})"
                )
        self._slots.mkdir(parents=True, exist_ok=True, mode=0o700)
        for slot in range(slot_count):
            try:
                fd = os.open(self._slots / str(slot), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{installation} {session_id}\n")
            return slot
        raise EgressError(f"the egress subnet pool is exhausted ({slot_count} sessions)")

    def prune(self, has_bridge: Callable[[str], bool]) -> list[SlotClaim]:
        """Release claims whose session has no bridge (call under the lock): attach creates
        the bridge before it lets go of the lock and detach deletes it after taking it, so
        such a claim is a killed process's (say, a test run killed mid-attach on an earlier
        run of this host). Left alone, it would keep IP forwarding on for ever.

        Returns:
            the released claims.
        """
        stale = [c for c in self.claims() if not has_bridge(c.session_id)]
        for claim in stale:
            (self._slots / str(claim.slot)).unlink(missing_ok=True)
        return stale

    def slot_of(self, installation: str, session_id: str) -> int | None:
        """The slot ``installation`` holds for ``session_id``, if any."""
        for held in self.claims():
            if held.installation == installation and held.session_id == session_id:
                return held.slot
        return None

    def release(self, installation: str, session_id: str) -> None:
        """Release the slot ``installation`` holds for ``session_id`` (no-op if none)."""
        slot = self.slot_of(installation, session_id)
        if slot is not None:
            (self._slots / str(slot)).unlink(missing_ok=True)

    def sessions(self, installation: str | None = None) -> set[str]:
        """Session ids holding a slot (of ``installation`` only, when given)."""
        return {
            c.session_id
            for c in self.claims()
            if installation is None or c.installation == installation
        }

    def forwarding_on(self) -> None:
        """Switch IP forwarding on, saving the value found first (once for all sessions)."""
        try:
            if not self._saved.exists():
                self._saved.write_text(self.forward_sysctl.read_text().strip() + "\n")
            self.forward_sysctl.write_text("1\n")
        except OSError as exc:
            raise EgressError(f"cannot switch IP forwarding on: {exc}") from exc

    def forwarding_restore(self) -> None:
        """Write back the saved value, if one was saved; call when no slot is claimed."""
        try:
            if self._saved.exists():
                self.forward_sysctl.write_text(self._saved.read_text().strip() + "\n")
                self._saved.unlink()
        except OSError as exc:
            raise EgressError(f"cannot restore IP forwarding: {exc}") from exc
