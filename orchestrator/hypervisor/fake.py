"""An in-package fake hypervisor: no VM, same contract. For tests of everything above it.

Fake domains "boot" at once, draw a fake desktop (:class:`~orchestrator.display.fake.FakeDisplay`),
write ``DESKVM_READY WxH`` to their guest log (after a ``probe_ready`` line when the spec
asks for the input probe) and then every line typed into them.
Failures can be injected per lifecycle step.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

from orchestrator.display.fake import FakeDisplay, FakeGuestHelper
from orchestrator.errors import HypervisorError
from orchestrator.hypervisor.base import (
    LIVE_CPU_WEIGHT,
    Accel,
    AccelSwitch,
    AccelSwitched,
    AccelVerdict,
    NicAttachment,
    SavedState,
)
from orchestrator.spec import SessionSpec

__all__ = ["FakeDomain", "FakeHypervisor"]


class FakeDomain:
    """A pretend running domain (see :class:`~orchestrator.hypervisor.base.Domain`)."""

    def __init__(
        self,
        spec: SessionSpec,
        nic: NicAttachment | None,
        *,
        horizontal_wheel: bool = True,
        boot_screens: int = 0,
        restored_from: Path | None = None,
    ) -> None:
        self.spec = spec
        self.restored_from = restored_from
        """The saved state this domain was restored from (``None``: booted)."""
        self.cpu_weight = 1024
        self.paused = False
        """Whether its vCPUs are stopped (restored ``paused``, until ``resume``)."""
        self.clock_set = 0
        """How often the host set this guest's clock."""
        self.nic = nic
        self.links: list[bool] = []
        """Link states the host set on its NIC, in order (:meth:`set_link`)."""
        self.running = True
        self.stopped: str | None = None
        """Why QEMU stopped this guest (:meth:`stop_error`); ``None``: it runs."""
        self.console = "[    0.000000] Linux version 6.1.0 (fake)\nfake login: desk\n"
        self._guest_log = bytearray()
        self._lock = threading.Lock()
        d = spec.display
        self._display = FakeDisplay(
            d.width_px,
            d.height_px,
            background_rgb=spec.image.background_rgb,
            on_line=self._on_line,
            horizontal_wheel=horizontal_wheel,
            boot_screens=boot_screens,
        )
        self._helper = (
            FakeGuestHelper(self._display) if spec.image.helper_port is not None else None
        )
        if restored_from is not None:
            return  # a restored guest wrote its readiness before the save (not to this log)
        if spec.autostart == "input-probe":
            self.write_guest_log(
                f'{{"ev":"probe_ready","w":{d.width_px},"h":{d.height_px},"t_s":0.0}}\n'.encode()
            )
        self.write_guest_log(f"DESKVM_READY {d.width_px}x{d.height_px}\n".encode())

    def _on_line(self, line: str) -> None:
        self.write_guest_log((line + "\n").encode())

    def write_guest_log(self, data: bytes) -> None:
        with self._lock:
            self._guest_log += data

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def display(self) -> FakeDisplay:
        return self._display

    @property
    def helper(self) -> FakeGuestHelper | None:
        """The fake guest helper (only for images with a ``helper_port``)."""
        return self._helper

    def is_running(self) -> bool:
        return self.running

    def stop_error(self) -> str | None:
        return self.stopped

    def console_tail(self, max_bytes: int = 4096) -> str:
        return self.console[-max_bytes:]

    def read_guest_log(self, offset: int = 0) -> bytes:
        with self._lock:
            return bytes(self._guest_log[offset:])

    def set_clock(self, timeout_s: float = 1.0) -> float | None:
        """The fake guest's clock is the host's: confirmed at once (offset 0)."""
        self.clock_set += 1
        return 0.0

    def set_link(self, up: bool) -> None:
        """Record the link state (see :attr:`links`); a domain without a NIC refuses."""
        if self.nic is None:
            raise HypervisorError(f"session {self.spec.session_id} has no NIC")
        self.links.append(up)


class FakeHypervisor(AccelSwitched):
    """:class:`~orchestrator.hypervisor.base.Hypervisor` that keeps domains in memory.

    Failures are injected per lifecycle step, each consumed by its next occurrence:

    * ``"define"``: :meth:`start` raises before anything exists.
    * ``"start"``: the domain is defined (it shows in :attr:`domains` and
      :meth:`list_sessions`) and then :meth:`start` raises: the caller must tear it down.
    * ``"ready"``: the domain starts, then powers off at once (never becomes ready).
    * ``"accel"``: the domain starts, then QEMU stops it as KVM does on a host whose KVM
      cannot run a Linux guest (:meth:`FakeDomain.stop_error`), whatever :attr:`accel` is.
    * ``"destroy"``: :meth:`destroy` raises and leaves the domain behind (a leak the
      reaper must find).
    * ``"adopt"``: :meth:`adopt` raises (the domain is left as it is).
    * ``"save"``: :meth:`save` raises (the domain is destroyed, nothing is saved).
    * ``"restore"``: :meth:`restore` raises (nothing is left).

    A saved state keeps its domain's NIC MAC; :meth:`restore` of it needs a ``nic`` with
    that MAC (and refuses one for a state without a NIC), as the real one does.
    * ``"reset"``: :meth:`reset` raises (the session's domain is gone).
    * ``"prepare_reset"``: :meth:`prepare_reset` raises (the session is not affected).

    :meth:`save` writes a small JSON ``state.save``; :meth:`restore` refuses a state file
    that is missing or does not parse (a corrupt save), as the real one does.

    Args:
        accel: what the fake host "probed".
        accel_verdict: as :class:`~orchestrator.hypervisor.libvirt.LibvirtHypervisor`'s.
        horizontal_wheel: whether the fake displays take horizontal wheel events (a QEMU
            8.1+ host); ``False`` models this project's QEMU 7.2 host.
        boot_screens: screendumps of each new domain that show a 720x400 boot console
            before the desktop (see :class:`~orchestrator.display.fake.FakeDisplay`).
        sessions_dir: where :meth:`keep_state` links a session's start state
            (``<dir>/<id>/start``, removed by :meth:`destroy`), as the real one does;
            ``None``: :meth:`keep_state` hands back the state it was given.

    Attributes:
        domains: running fake domains by session id.
        fail_on: lifecycle step names that raise next time.
        started, destroyed, adopted: session ids in call order.
    """

    def __init__(
        self,
        *,
        accel: Accel = "tcg",
        horizontal_wheel: bool = True,
        boot_screens: int = 0,
        sessions_dir: Path | None = None,
        accel_verdict: AccelVerdict | None = None,
    ) -> None:
        self._accel = AccelSwitch(accel, accel_verdict)
        self._sessions_dir = sessions_dir
        self._horizontal_wheel = horizontal_wheel
        self._boot_screens = boot_screens
        self.domains: dict[str, FakeDomain] = {}
        self.fail_on: set[str] = set()
        self.started: list[str] = []
        self.destroyed: list[str] = []
        self.adopted: list[str] = []
        self.saved: list[str] = []
        self.restored: list[str] = []
        self.spares: dict[str, FakeDomain] = {}
        """Sessions' next generations restored ahead (:meth:`prepare_reset`), paused."""
        self.spares_used = 0
        """Resets that ran a spare instead of restoring."""
        self._lock = threading.Lock()

    @property
    def kvm_ran(self) -> int:
        """How often a guest reached ready under KVM (:meth:`kvm_ran_linux`)."""
        return self._accel.kvm_ran

    def _injected(self, step: str) -> bool:
        if step in self.fail_on:
            self.fail_on.discard(step)
            return True
        return False

    def start(self, spec: SessionSpec, *, nic: NicAttachment | None = None) -> FakeDomain:
        with self._lock:
            if self._injected("define"):
                raise HypervisorError(f"injected failure defining {spec.session_id}")
            if spec.session_id in self.domains:
                raise HypervisorError(f"session {spec.session_id} already exists")
            domain = FakeDomain(
                spec,
                nic,
                horizontal_wheel=self._horizontal_wheel,
                boot_screens=self._boot_screens,
            )
            self.domains[spec.session_id] = domain
            if self._injected("start"):
                raise HypervisorError(f"injected failure starting {spec.session_id}")
            if self._injected("ready"):
                domain.running = False
            if self._injected("accel"):
                domain.stopped = (
                    "QEMU run state internal-error (KVM internal error. Suberror: 1; "
                    "emulation failure)"
                )
            self.started.append(spec.session_id)
            return domain

    def adopt(self, spec: SessionSpec) -> FakeDomain:
        """See :meth:`Hypervisor.adopt` (in-process: the domain must still be in this fake;
        an ``"adopt"`` failure can be injected)."""
        with self._lock:
            domain = self.domains.get(spec.session_id)
            if self._injected("adopt") or domain is None or not domain.running:
                raise HypervisorError(f"no running domain of session {spec.session_id}")
            domain.spec = spec
            self.adopted.append(spec.session_id)
            return domain

    def destroy(self, session_id: str) -> None:
        with self._lock:
            self.destroyed.append(session_id)
            if self._injected("destroy"):
                raise HypervisorError(f"injected failure destroying {session_id}")
            domain = self.domains.pop(session_id, None)
            if domain is not None:
                domain.running = False
            if self._sessions_dir is not None:
                shutil.rmtree(self._sessions_dir / session_id, ignore_errors=True)
            spare = self.spares.pop(session_id, None)
            if spare is not None:
                spare.running = False

    def list_sessions(self) -> set[str]:
        with self._lock:
            return set(self.domains)

    def save(self, session_id: str, dest: Path) -> SavedState:
        with self._lock:
            domain = self.domains.pop(session_id, None)
            if domain is None or not domain.running:
                raise HypervisorError(f"could not save session {session_id}: not running")
            domain.running = False
            if self._injected("save"):
                raise HypervisorError(f"injected failure saving {session_id}")
            dest.mkdir(mode=0o711)
            state = SavedState(root=dest, disk_cap_mib=1024)
            # As libvirt's save image, the state keeps the domain's live CPU weight.
            mac = domain.nic.mac if domain.nic is not None else None
            state.state_file.write_text(
                json.dumps({"session_id": session_id, "cpu_weight": domain.cpu_weight, "mac": mac})
            )
            state.disk.write_bytes(b"frozen")
            self.saved.append(session_id)
            return state

    def restore(
        self,
        spec: SessionSpec,
        state: SavedState,
        *,
        cpu_weight: int | None = None,
        paused: bool = False,
        nic: NicAttachment | None = None,
    ) -> FakeDomain:
        with self._lock:
            try:
                saved = json.loads(state.state_file.read_text())
                saved["session_id"]
                saved_weight = int(saved.get("cpu_weight", 1024))
                saved_mac = saved.get("mac")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise HypervisorError(
                    f"could not restore session {spec.session_id} from {state.state_file}: {exc}"
                ) from exc
            if self._injected("restore"):
                raise HypervisorError(f"injected failure restoring {spec.session_id}")
            if spec.session_id in self.domains:
                raise HypervisorError(f"session {spec.session_id} already exists")
            if (nic.mac if nic is not None else None) != saved_mac:
                raise HypervisorError(
                    f"could not restore session {spec.session_id}: the saved NIC's MAC is "
                    f"{saved_mac}, the attachment's {nic.mac if nic is not None else None}"
                )
            domain = FakeDomain(
                spec,
                nic,
                horizontal_wheel=self._horizontal_wheel,
                restored_from=state.state_file,
            )
            domain.cpu_weight = saved_weight if cpu_weight is None else cpu_weight
            domain.paused = paused
            self.domains[spec.session_id] = domain
            self.restored.append(spec.session_id)
            return domain

    def keep_state(self, session_id: str, state: SavedState) -> SavedState:
        if self._sessions_dir is None:
            return state
        kept = SavedState(self._sessions_dir / session_id / "start", state.disk_cap_mib)
        try:
            kept.root.mkdir(parents=True)
            os.link(state.state_file, kept.state_file)
            if state.disk.exists():
                os.link(state.disk, kept.disk)
        except OSError as exc:
            shutil.rmtree(kept.root.parent, ignore_errors=True)
            raise HypervisorError(f"cannot keep the start state of {session_id}: {exc}") from exc
        return kept

    def prepare_reset(
        self, spec: SessionSpec, state: SavedState, *, cpu_weight: int | None = None
    ) -> None:
        with self._lock:
            if spec.session_id in self.spares:
                return
            if spec.session_id not in self.domains:
                raise HypervisorError(f"session {spec.session_id} has ended")
            if self._injected("prepare_reset"):
                raise HypervisorError(f"injected failure preparing {spec.session_id}")
            if not state.state_file.is_file():
                raise HypervisorError(f"could not restore {spec.session_id}: no state")
            domain = FakeDomain(
                spec, None, horizontal_wheel=self._horizontal_wheel, restored_from=state.state_file
            )
            domain.cpu_weight = 1024 if cpu_weight is None else cpu_weight
            domain.paused = True
            self.spares[spec.session_id] = domain

    def discard_reset_spare(self, session_id: str) -> bool:
        with self._lock:
            spare = self.spares.pop(session_id, None)
            if spare is not None:
                spare.running = False
            return spare is not None

    def reset(self, spec: SessionSpec, state: SavedState) -> tuple[FakeDomain, bool]:
        with self._lock:
            old = self.domains.pop(spec.session_id, None)
            if old is not None:
                old.running = False
            spare = self.spares.pop(spec.session_id, None)
            if spare is not None:
                spare.cpu_weight = LIVE_CPU_WEIGHT
                spare.paused = False
                self.domains[spec.session_id] = spare
                self.spares_used += 1
                return spare, True
            if self._injected("reset"):
                raise HypervisorError(f"injected failure resetting {spec.session_id}")
            if not state.state_file.is_file():
                raise HypervisorError(f"could not reset {spec.session_id}: no {state.state_file}")
            if json.loads(state.state_file.read_text()).get("mac") is not None:
                raise HypervisorError(f"could not reset {spec.session_id}: the state has a NIC")
            domain = FakeDomain(
                spec, None, horizontal_wheel=self._horizontal_wheel, restored_from=state.state_file
            )
            domain.cpu_weight = LIVE_CPU_WEIGHT
            self.domains[spec.session_id] = domain
            self.restored.append(spec.session_id)
            return domain, False

    def resume(self, session_id: str) -> None:
        with self._lock:
            domain = self.domains.get(session_id)
            if domain is None:
                raise HypervisorError(f"no domain of session {session_id}")
            domain.paused = False

    def set_cpu_weight(self, session_id: str, cpu_weight: int) -> None:
        with self._lock:
            domain = self.domains.get(session_id)
            if domain is None:
                raise HypervisorError(f"no domain of session {session_id}")
            domain.cpu_weight = cpu_weight
