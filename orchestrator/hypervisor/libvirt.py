"""The real hypervisor: libvirt ``qemu:///system``, transient domains, qcow2 overlays.

QEMU runs as the unprivileged ``libvirt-qemu`` user under libvirt's seccomp sandbox and
DAC labelling; session files live in directories that user can reach.

Several servers may share one installation (a test server beside ``deskvm serve``): each
:class:`LibvirtHypervisor` belongs to a server :class:`~orchestrator.instance.Instance`
(an exclusive ``flock`` on ``<sessions_dir>/.instances/<name>.lock`` for its lifetime) and
writes the instance's name into every session directory it creates.
:meth:`LibvirtHypervisor.list_sessions` (what the reaper removes) skips sessions of other
instances that are still alive; the lock of a process killed with SIGKILL is released by
the kernel, so its leftovers become reapable (the session manager keeps those a restarted
server of the same name will re-adopt, see :meth:`LibvirtHypervisor.adopt`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import libvirt
import libvirt_qemu

from orchestrator.display.guest_helper import HelperChannel
from orchestrator.display.qmp import QmpDisplay, keyboard_qom_path
from orchestrator.errors import (
    CapacityError,
    ConfigError,
    GuestHelperError,
    HostSetupError,
    HypervisorError,
)
from orchestrator.hypervisor.base import (
    LIVE_CPU_WEIGHT,
    Accel,
    AccelSwitch,
    AccelSwitched,
    AccelVerdict,
    NicAttachment,
    SavedState,
    SessionPaths,
)
from orchestrator.hypervisor.domain_xml import (
    KEYBOARD_ALIAS,
    METADATA_NS,
    clone_domain_xml,
    domain_name,
    generation_of,
    hard_limit_mib,
    metadata_owner,
    render_domain_xml,
    session_id_of,
)
from orchestrator.hypervisor.save_image import read_header, stream_clone
from orchestrator.instance import Instance
from orchestrator.spec import SessionSpec, validate_session_id

log = logging.getLogger("deskvm.hypervisor")

_SESSION_DIR_RE = re.compile(r"^[a-z0-9]{12}$")
_INSTANCE_RE = re.compile(r"^[0-9a-f]{12}$")

__all__ = [
    "DISK_RESERVE_MIB",
    "RESTORE_TIMEOUT_S",
    "LibvirtDomain",
    "LibvirtHypervisor",
    "open_connection",
]

RESTORE_TIMEOUT_S = 60.0
"""How long libvirt may take to start reading a restore stream, seconds."""

_SUN_PATH_MAX = 107
"""Longest unix socket path (``sockaddr_un.sun_path`` is 108 bytes with the NUL)."""

_LIBVIRT_QEMU_RUN = Path("/run/libvirt/qemu")
"""Where libvirt's system QEMU driver keeps each running domain's pid file."""
_GONE = (libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_ERR_OPERATION_INVALID)
"""libvirt error codes of a destroy whose domain is already gone or stopped."""

_QEMU_LOG_DIR = Path("/var/log/libvirt/qemu")
"""Where libvirt's system QEMU driver writes each domain's QEMU log (``<name>.log``)."""
_STOPPED_STATE = "internal-error"
"""QEMU's run state (QMP ``RunState``) of a guest its accelerator could not run on."""
_QEMU_ERROR_LINE = re.compile(
    r"^(KVM internal error.*|emulation failure.*|.*qemu-system-\S+: .*(error|fail).*)$",
    re.MULTILINE | re.IGNORECASE,
)

DISK_RESERVE_MIB = 1024
"""Space that must stay free on the sessions' file system after every session's disk cap."""

_handler_lock = threading.Lock()
_handler_set = False


def open_connection(uri: str = "qemu:///system") -> libvirt.virConnect:
    """Open a libvirt connection, keeping libvirt's default stderr printer quiet.

    Raises:
        HypervisorError: libvirtd is not reachable (with the fix in the message).
    """
    global _handler_set
    with _handler_lock:
        if not _handler_set:
            libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
            _handler_set = True
    try:
        return libvirt.open(uri)
    except libvirt.libvirtError as exc:
        raise HypervisorError(
            f"cannot connect to libvirt at {uri}: {exc.get_error_message()} "
            "(is libvirtd running? `deskvm doctor --fix` starts it)"
        ) from exc


def _paused(dom: libvirt.virDomain) -> bool:
    """Whether ``dom`` is paused (a reset's spare waits so); ``False`` when it is gone."""
    try:
        return bool(dom.info()[0] == libvirt.VIR_DOMAIN_PAUSED)
    except libvirt.libvirtError:
        return False


def _tail(path: Path, max_bytes: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read()
    except OSError:
        return b""


class LibvirtDomain:
    """A running session domain (see :class:`~orchestrator.hypervisor.base.Domain`)."""

    def __init__(
        self,
        conn: libvirt.virConnect,
        dom: libvirt.virDomain,
        session_id: str,
        paths: SessionPaths,
        helper: HelperChannel | None = None,
    ) -> None:
        self._dom = dom
        self._session_id = session_id
        self._paths = paths
        self._display = QmpDisplay(conn, dom, keyboard_path=keyboard_qom_path(KEYBOARD_ALIAS))
        self._helper = helper

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def display(self) -> QmpDisplay:
        return self._display

    @property
    def helper(self) -> HelperChannel | None:
        return self._helper

    def is_running(self) -> bool:
        try:
            return bool(self._dom.isActive())
        except libvirt.libvirtError:
            return False

    def stop_error(self) -> str | None:
        # libvirt shows such a guest as paused with reason "unknown" (QEMU paused it, not
        # libvirt): only then ask QEMU, so the usual poll costs one state call.
        try:
            state, reason = self._dom.state()
        except libvirt.libvirtError:
            return None
        if state != libvirt.VIR_DOMAIN_PAUSED or reason != libvirt.VIR_DOMAIN_PAUSED_UNKNOWN:
            return None
        try:
            reply = libvirt_qemu.qemuMonitorCommand(
                self._dom, json.dumps({"execute": "query-status"}), 0
            )
            status = str(json.loads(reply)["return"]["status"])
        except (libvirt.libvirtError, ValueError, KeyError, TypeError):
            return None
        if status != _STOPPED_STATE:
            return None
        try:
            log = _tail(_QEMU_LOG_DIR / f"{self._dom.name()}.log", 16384).decode("utf-8", "replace")
        except libvirt.libvirtError:
            log = ""
        # The log is the domain name's: an earlier domain of the session wrote above this
        # one's "starting up" line.
        log = log[log.rfind("starting up") :] if "starting up" in log else log
        lines = [m.group(0).strip() for m in _QEMU_ERROR_LINE.finditer(log)][-4:]
        return f"QEMU run state {status}" + (f" ({'; '.join(lines)})" if lines else "")

    def console_tail(self, max_bytes: int = 4096) -> str:
        return _tail(self._paths.console_log, max_bytes).decode("utf-8", "replace")

    def read_guest_log(self, offset: int = 0) -> bytes:
        try:
            with self._paths.guest_log.open("rb") as f:
                f.seek(offset)
                return f.read()
        except OSError:
            return b""

    def set_clock(self, timeout_s: float = 1.0) -> float | None:
        return set_guest_clock(self._paths.clock_socket, timeout_s=timeout_s)

    def set_link(self, up: bool) -> None:
        """See :meth:`Domain.set_link`: the live ``<interface>`` with ``<link state=.../>``
        through ``virDomainUpdateDeviceFlags`` (QEMU's ``set_link``)."""
        try:
            dom_xml = ET.fromstring(self._dom.XMLDesc(0))
            ifaces = dom_xml.findall("devices/interface")
            if len(ifaces) != 1:
                raise HypervisorError(f"session {self._session_id} has {len(ifaces)} NICs, not one")
            iface = ifaces[0]
            for el in iface.findall("link"):
                iface.remove(el)
            ET.SubElement(iface, "link", state="up" if up else "down")
            self._dom.updateDeviceFlags(
                ET.tostring(iface, encoding="unicode"), libvirt.VIR_DOMAIN_AFFECT_LIVE
            )
        except libvirt.libvirtError as exc:
            raise HypervisorError(
                f"cannot set the link of session {self._session_id}'s NIC "
                f"{'up' if up else 'down'}: {exc.get_error_message()}"
            ) from exc


def set_guest_clock(socket_path: Path, *, timeout_s: float) -> float | None:
    """Send the host's ``CLOCK_REALTIME`` to the guest clock (see ``vm_images/guest/base/
    usr/local/lib/deskvm/clock``) and read its confirmation.

    A reply to an earlier request can come first: the guest writes each reply whether or
    not the host is still connected, and a reply written after the host gave up waits in
    the port (a saved template can hold one). Only a confirmation of *this* setting counts:
    its ``realtime_ns`` is at least the value sent (the guest reads its clock right after
    setting it); others are skipped.

    Returns:
        The guest's clock minus the host's when the reply arrived, seconds; ``None``
        when the guest did not confirm within ``timeout_s`` (no such port or program).
    """
    deadline = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(socket_path))
            sent_ns = time.time_ns()
            sock.sendall(json.dumps({"realtime_ns": sent_ns}).encode() + b"\n")
            buf = b""
            while True:
                while b"\n" not in buf:
                    if len(buf) >= 4096:
                        return None
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    chunk = sock.recv(4096)
                    if not chunk:
                        return None
                    buf += chunk
                line, buf = buf.split(b"\n", 1)
                host_ns = time.time_ns()
                guest_ns = _confirmed_ns(line, sent_ns)
                if guest_ns is not None:
                    return (guest_ns - host_ns) / 1e9
    except (OSError, ValueError):
        return None


def _confirmed_ns(line: bytes, sent_ns: int) -> int | None:
    """The guest clock's ``realtime_ns`` if ``line`` confirms a setting to ``sent_ns``."""
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        return None
    guest_ns = answer.get("realtime_ns")
    if isinstance(guest_ns, bool) or not isinstance(guest_ns, int) or guest_ns < sent_ns:
        return None
    return guest_ns


@dataclass(slots=True)
class _Spare:
    """A session's next generation, restored paused ahead of its reset."""

    generation: int
    dom: libvirt.virDomain
    paths: SessionPaths
    helper: HelperChannel | None


class LibvirtHypervisor(AccelSwitched):
    """:class:`~orchestrator.hypervisor.base.Hypervisor` on libvirt.

    Args:
        sessions_dir: where per-session directories (overlay, logs) are created.
        accel: ``"kvm"`` or ``"tcg"``, as found by the host's acceleration probe.
        uri: libvirt connection URI.
        accel_verdict: what this hypervisor learns of the host's KVM is kept there, and
            whether a KVM stop may move it to TCG (:meth:`fall_back_to_tcg`); ``None``: KVM
            was forced, a stop is reported.
    """

    def __init__(
        self,
        sessions_dir: Path,
        *,
        accel: Accel,
        uri: str = "qemu:///system",
        instance: Instance | None = None,
        accel_verdict: AccelVerdict | None = None,
    ) -> None:
        self._sessions_dir = sessions_dir
        self._accel = AccelSwitch(accel, accel_verdict)
        self._uri = uri
        self._conn = open_connection(uri)
        self._lock = threading.Lock()
        self._caps: dict[str, int] = {}
        self._helpers: dict[str, HelperChannel] = {}
        self._generations: dict[str, int] = {}  # sessions reset at least once
        self._spares: dict[str, _Spare] = {}  # sessions' next generations, restored ahead
        self._session_locks: dict[str, threading.RLock] = {}  # spare vs reset vs destroy
        self._own_instance = instance is None
        try:
            self.instance = instance or Instance(self._instances_dir)
        except HostSetupError as exc:
            raise HypervisorError(exc.message) from exc
        """The server instance this hypervisor belongs to (an ephemeral one by default)."""
        self.instance_id = self.instance.name
        """The instance's name, written into its session directories (``instance``)."""

    @property
    def _instances_dir(self) -> Path:
        return self._sessions_dir / ".instances"

    def _instance_alive(self, instance: str) -> bool:
        """Whether the instance ``instance`` still holds its lock."""
        return self.instance.alive(instance)

    def close(self) -> None:
        """Close the connection; an instance it made itself is released too (its sessions
        become reapable). An instance passed in is its owner's to close."""
        for helper in list(self._helpers.values()):
            helper.close()
        self._helpers.clear()
        with contextlib.suppress(libvirt.libvirtError):
            self._conn.close()
        if self._own_instance:
            self.instance.close()

    def _paths(self, session_id: str) -> SessionPaths:
        """The files of the session's current domain (its reset generation's)."""
        return SessionPaths(
            root=self._sessions_dir / validate_session_id(session_id),
            generation=self._generations.get(session_id, 0),
        )

    def _session_lock(self, session_id: str) -> threading.RLock:
        """Serializes a session's spare restore, reset and destroy."""
        with self._lock:
            return self._session_locks.setdefault(session_id, threading.RLock())

    def _lookup(self, session_id: str) -> libvirt.virDomain:
        """The session's current domain; after a restart (generations unknown) the
        newest of its domains.

        Raises:
            libvirt.libvirtError: none (``VIR_ERR_NO_DOMAIN``) or libvirt failed.
        """
        try:
            with self._lock:
                return self._conn.lookupByName(
                    domain_name(session_id, self._generations.get(session_id, 0))
                )
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise
            found = self._domains_of(session_id)
            if not found:
                raise
        dom = max(found, key=lambda d: (not _paused(d), generation_of(d.name())))
        self._generations[session_id] = generation_of(dom.name())
        return dom

    def _domains_of(self, session_id: str) -> list[libvirt.virDomain]:
        """Every domain of the session (the current one and old ones being cleaned up)."""
        with self._lock:
            domains = self._conn.listAllDomains(0)
        return [d for d in domains if session_id_of(d.name()) == session_id]

    def _pid(self, name: str) -> int | None:
        """The QEMU process of the domain ``name`` when it runs on this host (found by
        libvirt's pid file and checked to be this domain's, ``-name guest=<name>,``);
        ``None`` elsewhere (a remote URI) or when it is gone."""
        try:
            pid = int((_LIBVIRT_QEMU_RUN / f"{name}.pid").read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if b"guest=" + name.encode() + b"," in cmdline else None

    def _kill(self, name: str) -> bool:
        """SIGKILL the QEMU process of the domain ``name`` (see :meth:`_pid`); whether
        it was."""
        pid = self._pid(name)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return False
        return True

    def _discard_old(self, dom: libvirt.virDomain, paths: SessionPaths) -> None:
        """Destroy a reset's old domain (its QEMU killed already) and remove its overlay
        once libvirt has let go of it; errors are logged, the reaper retries."""
        try:
            dom.destroy()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() not in _GONE:
                log.warning("reset: destroying the old domain %s: %s", dom.name(), exc)
        with contextlib.suppress(FileNotFoundError):
            paths.overlay.unlink()

    def _virtual_size_mib(self, image: Path) -> int:
        try:
            out = subprocess.run(
                ["qemu-img", "info", "--output=json", "-U", str(image)],
                check=True, capture_output=True, text=True, timeout=60,
            ).stdout  # fmt: skip
            return -(-int(json.loads(out)["virtual-size"]) // (1024 * 1024))
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            raise HypervisorError(f"cannot read the virtual size of {image}: {exc}") from exc

    def disk_cap_mib(self, spec: SessionSpec) -> int:
        """The overlay's virtual size for ``spec``, MiB (the guest's disk can never be larger).

        Raises:
            ConfigError: ``spec.disk_mib`` is smaller than the base image.
            HypervisorError: the base image cannot be read.
        """
        base_mib = self._virtual_size_mib(spec.image.base_path)
        if spec.disk_mib is None:
            return base_mib
        if spec.disk_mib < base_mib:
            raise ConfigError(
                f"disk_mib {spec.disk_mib} is smaller than image {spec.image.name}'s {base_mib} MiB"
            )
        return spec.disk_mib

    def _check_free_space(self, cap_mib: int) -> None:
        # Overlays already running may still grow up to their caps: count that growth too.
        self._sessions_dir.mkdir(parents=True, exist_ok=True)
        free_mib = shutil.disk_usage(self._sessions_dir).free // (1024 * 1024)
        growth_mib = 0
        for session_id, cap in list(self._caps.items()):
            try:
                used = self._paths(session_id).overlay.stat().st_blocks * 512 // (1024 * 1024)
            except OSError:
                continue
            growth_mib += max(0, cap - used)
        need_mib = cap_mib + growth_mib + DISK_RESERVE_MIB
        if free_mib < need_mib:
            raise CapacityError(
                f"only {free_mib} MiB free under {self._sessions_dir}; need {need_mib} MiB"
                f" ({cap_mib} MiB disk cap + {growth_mib} MiB the running overlays may still"
                f" grow + {DISK_RESERVE_MIB} MiB reserve)",
                code="insufficient_disk",
            )

    def start(self, spec: SessionSpec, *, nic: NicAttachment | None = None) -> LibvirtDomain:
        """See :meth:`Hypervisor.start`.

        Raises:
            CapacityError: ``insufficient_disk``: less than the disk cap plus
                :data:`DISK_RESERVE_MIB` is free (checked before anything is created).
            ConfigError: the disk cap is smaller than the base image.
            HypervisorError: overlay creation or domain start failed.
        """
        paths = self._paths(spec.session_id)
        if spec.image.helper_port is not None and len(bytes(paths.helper_socket)) > _SUN_PATH_MAX:
            raise ConfigError(
                f"the sessions directory {self._sessions_dir} is too long a path for the guest "
                f"helper's unix socket {paths.helper_socket} (at most {_SUN_PATH_MAX} bytes): "
                "use a shorter DESKVM_STATE_DIR"
            )
        cap_mib = self.disk_cap_mib(spec)
        with self._lock:
            self._check_free_space(cap_mib)
            self._caps[spec.session_id] = cap_mib
        try:
            self._sessions_dir.mkdir(parents=True, exist_ok=True)
            self._sessions_dir.chmod(0o711)
            paths.root.mkdir(mode=0o711)
            (paths.root / "instance").write_text(self.instance_id)
            subprocess.run(
                [
                    "qemu-img", "create", "-q", "-f", "qcow2",
                    "-F", "qcow2", "-b", str(spec.image.base_path), str(paths.overlay),
                    f"{cap_mib}M",
                ],
                check=True, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            xml = render_domain_xml(
                spec,
                paths,
                accel=self._accel.accel,
                created=datetime.now(UTC),
                nic=nic,
                owner=str(self._sessions_dir),
            )
            with self._lock:
                # Paused until the memory hard limit is in place (see render_domain_xml).
                dom = self._conn.createXML(xml, libvirt.VIR_DOMAIN_START_PAUSED)
                dom.setMemoryParameters(
                    {"hard_limit": hard_limit_mib(spec) * 1024}, libvirt.VIR_DOMAIN_AFFECT_LIVE
                )
                dom.resume()
            helper = None
            if spec.image.helper_port is not None:
                helper = HelperChannel(paths.helper_socket)
                self._helpers[spec.session_id] = helper
                helper.connect()
            return LibvirtDomain(self._conn, dom, spec.session_id, paths, helper)
        except GuestHelperError as exc:
            with contextlib.suppress(HypervisorError):
                self.destroy(spec.session_id)
            raise HypervisorError(f"could not start session {spec.session_id}: {exc}") from exc
        except FileExistsError as exc:
            raise HypervisorError(f"session {spec.session_id} already exists") from exc
        except (OSError, subprocess.SubprocessError, libvirt.libvirtError) as exc:
            detail = (
                exc.get_error_message()
                if isinstance(exc, libvirt.libvirtError)
                else getattr(exc, "stderr", None) or str(exc)
            )
            with contextlib.suppress(HypervisorError):
                self.destroy(spec.session_id)
            raise HypervisorError(f"could not start session {spec.session_id}: {detail}") from exc

    def adopt(self, spec: SessionSpec) -> LibvirtDomain:
        """See :meth:`Hypervisor.adopt`: look the domain up, check it runs and belongs to
        this installation, write this instance's name into its session directory, and open
        the display (QMP through libvirt) and the guest helper's socket again.

        Raises:
            HypervisorError: no running domain of this installation for ``spec``.
        """
        try:
            dom = self._lookup(spec.session_id)
            active = bool(dom.isActive())
        except libvirt.libvirtError as exc:
            raise HypervisorError(
                f"session {spec.session_id} has no domain any more: {exc.get_error_message()}"
            ) from exc
        if not active:
            raise HypervisorError(f"the domain of session {spec.session_id} is not running")
        if not self._owns(dom):
            raise HypervisorError(
                f"the domain of session {spec.session_id} belongs to another installation"
            )
        paths = self._paths(spec.session_id)  # its generation is known now
        self._discard_spares_of(spec.session_id, above=paths.generation)
        try:
            (paths.root / "instance").write_text(self.instance_id)
        except OSError as exc:
            raise HypervisorError(f"session {spec.session_id} has no directory: {exc}") from exc
        with self._lock:
            self._caps[spec.session_id] = self.disk_cap_mib(spec)
        helper = None
        if spec.image.helper_port is not None:
            helper = HelperChannel(paths.helper_socket)
            try:
                helper.connect()
            except GuestHelperError as exc:
                raise HypervisorError(
                    f"cannot reconnect to the guest helper of {spec.session_id}: {exc}"
                ) from exc
            self._helpers[spec.session_id] = helper
        return LibvirtDomain(self._conn, dom, spec.session_id, paths, helper)

    def destroy(self, session_id: str) -> None:
        with self._session_lock(session_id):  # a spare being restored ends first
            self._destroy(session_id)
        with self._lock:
            self._session_locks.pop(session_id, None)

    def _destroy(self, session_id: str) -> None:
        paths = self._paths(session_id)
        failures: list[str] = []
        spare = self._spares.pop(session_id, None)
        if spare is not None and spare.helper is not None:
            spare.helper.close()
        self._caps.pop(session_id, None)
        helper = self._helpers.pop(session_id, None)
        if helper is not None:
            helper.close()
        self._generations.pop(session_id, None)
        try:
            domains = self._domains_of(session_id)  # a reset's old one may still be there
        except libvirt.libvirtError as exc:
            failures.append(f"list domains: {exc.get_error_message()}")
            domains = []
        for dom in domains:
            try:
                dom.destroy()
            except libvirt.libvirtError as exc:
                if exc.get_error_code() not in _GONE:
                    failures.append(f"destroy domain: {exc.get_error_message()}")
        try:
            shutil.rmtree(paths.root)
        except FileNotFoundError:
            pass
        except OSError as exc:
            failures.append(f"remove {paths.root}: {exc}")
        if failures:
            raise HypervisorError(f"teardown of {session_id} incomplete: " + "; ".join(failures))

    def _owns(self, dom: libvirt.virDomain) -> bool:
        try:
            xml = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS, 0)
        except libvirt.libvirtError:
            return False
        return metadata_owner(xml) == str(self._sessions_dir)

    def list_sessions(self) -> set[str]:
        """Session ids of this installation's domains (by metadata owner) and directories,
        except those of *other* instances that are still alive."""
        found: set[str] = set()
        try:
            with self._lock:
                domains = self._conn.listAllDomains(0)
            for dom in domains:
                sid = session_id_of(dom.name())
                if sid is not None and self._owns(dom):
                    found.add(sid)
        except libvirt.libvirtError as exc:
            raise HypervisorError(f"cannot list domains: {exc.get_error_message()}") from exc
        if self._sessions_dir.is_dir():
            found.update(
                p.name
                for p in self._sessions_dir.iterdir()
                if p.is_dir() and _SESSION_DIR_RE.match(p.name)
            )
        return {sid for sid in found if not self._held_by_live_peer(sid)}

    def _held_by_live_peer(self, session_id: str) -> bool:
        try:
            instance = (self._sessions_dir / session_id / "instance").read_text().strip()
        except OSError:
            return False  # no marker: nobody can be serving it
        return instance != self.instance_id and self._instance_alive(instance)

    # --- saved states: warm starts and resets ---------------------------------------

    def save(self, session_id: str, dest: Path) -> SavedState:
        """See :meth:`Hypervisor.save`: ``virDomainSave`` into ``dest/state.save``; the
        overlay moves to ``dest/disk.qcow2`` (mode 0444)."""
        paths = self._paths(session_id)
        cap_mib = self._caps.get(session_id)
        try:
            dest.mkdir(mode=0o711, parents=False)
        except OSError as exc:
            raise HypervisorError(f"cannot create the saved state directory {dest}: {exc}") from exc
        state = SavedState(root=dest, disk_cap_mib=cap_mib or 0)
        try:
            if cap_mib is None:
                state = SavedState(root=dest, disk_cap_mib=self._virtual_size_mib(paths.overlay))
            helper = self._helpers.pop(session_id, None)
            if helper is not None:
                helper.close()
            dom = self._lookup(session_id)
            dom.save(str(state.state_file))
            os.rename(paths.overlay, state.disk)
            state.disk.chmod(0o444)
            read_header(state.state_file)  # what libvirt wrote can be read back
        except (OSError, libvirt.libvirtError, HypervisorError) as exc:
            detail = exc.get_error_message() if isinstance(exc, libvirt.libvirtError) else exc
            shutil.rmtree(dest, ignore_errors=True)
            with contextlib.suppress(HypervisorError):
                self.destroy(session_id)
            raise HypervisorError(f"could not save session {session_id}: {detail}") from exc
        with contextlib.suppress(HypervisorError):
            self.destroy(session_id)
        return state

    def restore(
        self,
        spec: SessionSpec,
        state: SavedState,
        *,
        cpu_weight: int | None = None,
        paused: bool = False,
        nic: NicAttachment | None = None,
    ) -> LibvirtDomain:
        """See :meth:`Hypervisor.restore`.

        libvirt's restore insists on the saved UUID, and two domains never share one, so
        the clone's XML (:func:`~orchestrator.hypervisor.domain_xml.clone_domain_xml`)
        goes into the header of a save image streamed through a FIFO
        (:func:`~orchestrator.hypervisor.save_image.stream_clone`). The domain is
        restored paused, gets its memory hard limit (and CPU weight), then runs (unless
        ``paused``: then at :meth:`resume`).

        Raises:
            CapacityError: ``insufficient_disk`` (as :meth:`start`).
            HypervisorError: the state is missing or corrupt, or libvirt failed.
        """
        return self._restore(spec, state, cpu_weight=cpu_weight, fresh=True, paused=paused, nic=nic)

    def keep_state(self, session_id: str, state: SavedState) -> SavedState:
        """See :meth:`Hypervisor.keep_state` (hard links under ``<session>/start``; the
        session directory is made, with this instance's marker, when it does not exist)."""
        root = self._paths(session_id).root
        kept = SavedState(root=root / "start", disk_cap_mib=state.disk_cap_mib)
        try:
            if not root.is_dir():
                self._sessions_dir.mkdir(parents=True, exist_ok=True)
                root.mkdir(mode=0o711)
                (root / "instance").write_text(self.instance_id)
            kept.root.mkdir(mode=0o711)
            os.link(state.state_file, kept.state_file)
            os.link(state.disk, kept.disk)
        except OSError as exc:
            shutil.rmtree(kept.root, ignore_errors=True)
            raise HypervisorError(f"cannot keep the start state of {session_id}: {exc}") from exc
        return kept

    def prepare_reset(
        self, spec: SessionSpec, state: SavedState, *, cpu_weight: int | None = None
    ) -> None:
        """See :meth:`Hypervisor.prepare_reset`: ``state`` restored paused as the
        session's next generation (``deskvm-<id>-r<N+1>``, its overlay and sockets) beside
        the running one, which is not touched."""
        sid = spec.session_id
        with self._session_lock(sid):
            if sid in self._spares:
                return
            current = self._paths(sid)
            if not current.root.is_dir():
                raise HypervisorError(f"session {sid} has ended: no spare for its reset")
            paths = SessionPaths(root=current.root, generation=current.generation + 1)
            self._discard_spares_of(sid, above=current.generation)  # a failed one's leftovers
            dom, helper = self._restore_domain(
                spec, state, paths, cpu_weight=cpu_weight, paused=True, fresh=False, spare=True
            )
            self._spares[sid] = _Spare(paths.generation, dom, paths, helper)

    def discard_reset_spare(self, session_id: str) -> bool:
        """See :meth:`Hypervisor.discard_reset_spare`."""
        with self._session_lock(session_id):
            if session_id not in self._spares:
                return False
            current = self._generations.get(session_id, 0)
            self._discard_spares_of(session_id, above=current)
            return True

    def _discard_spares_of(self, session_id: str, *, above: int) -> None:
        """Destroy the session's domains of generations above ``above`` (its spare, or one
        a failed restore or a previous server left) and remove their overlays."""
        spare = self._spares.pop(session_id, None)
        if spare is not None and spare.helper is not None:
            spare.helper.close()
        try:
            doms = self._domains_of(session_id)
        except libvirt.libvirtError:
            doms = []
        root = self._sessions_dir / session_id
        for dom in doms:
            generation = generation_of(dom.name())
            if generation <= above:
                continue
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
            with contextlib.suppress(OSError):
                SessionPaths(root=root, generation=generation).overlay.unlink()

    def reset(self, spec: SessionSpec, state: SavedState) -> tuple[LibvirtDomain, bool]:
        """See :meth:`Hypervisor.reset`.

        With a spare (:meth:`prepare_reset`; one under way is waited for): the old domain
        is paused, the spare gets a live session's CPU weight and runs. Without one: the
        old domain is paused and the new one restored beside it under the next
        generation's name (``deskvm-<id>-r<N>``), overlay and sockets. Either way the old
        domain's QEMU is then killed (SIGKILL: its disk is thrown away, nothing to
        flush) and libvirt cleans it up in the background. libvirt's destroy waits until
        the QEMU process is reaped, and on these hosts (a firecracker init as PID 1 that
        reaps orphans every ~2 s) that was 2.0 s of a 3.0 s reset. Where the QEMU process
        cannot be found (a remote URI) the old domain is destroyed first, as before.
        """
        sid = spec.session_id
        with self._session_lock(sid):
            return self._reset_locked(spec, state)

    def _reset_locked(self, spec: SessionSpec, state: SavedState) -> tuple[LibvirtDomain, bool]:
        sid = spec.session_id
        old_paths = self._paths(sid)
        spare = self._spares.pop(sid, None)
        if spare is not None and spare.generation != old_paths.generation + 1:
            self._spares[sid] = spare
            self._discard_spares_of(sid, above=old_paths.generation)
            spare = None
        helper = self._helpers.pop(sid, None)
        if helper is not None:
            helper.close()
        old: libvirt.virDomain | None = None
        try:
            old = self._lookup(sid)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise HypervisorError(
                    f"cannot find session {sid}'s domain for a reset: {exc.get_error_message()}"
                ) from exc
        local = old is not None and self._pid(old.name()) is not None
        if old is not None:
            try:
                if local:
                    old.suspend()  # no CPU, no guest I/O while the new one is restored
                else:
                    old.destroy()
            except libvirt.libvirtError as exc:
                if exc.get_error_code() not in _GONE:
                    raise HypervisorError(
                        f"cannot stop session {sid} for a reset: {exc.get_error_message()}"
                    ) from exc
        self._generations[sid] = old_paths.generation + 1
        with contextlib.suppress(FileNotFoundError):
            (old_paths.root / "restore.fifo").unlink()
        try:
            if spare is not None:
                try:
                    spare.dom.setSchedulerParametersFlags(
                        {"cpu_shares": LIVE_CPU_WEIGHT}, libvirt.VIR_DOMAIN_AFFECT_LIVE
                    )
                    spare.dom.resume()
                except libvirt.libvirtError as exc:
                    log.warning("reset of %s: its spare failed (%s); restoring",
                                sid, exc.get_error_message())  # fmt: skip
                    self._spares[sid] = spare
                    self._discard_spares_of(sid, above=old_paths.generation)
                else:
                    with self._lock:
                        self._caps[sid] = state.disk_cap_mib
                    if spare.helper is not None:
                        self._helpers[sid] = spare.helper
                    domain = LibvirtDomain(self._conn, spare.dom, sid, spare.paths, spare.helper)
                    return domain, True
            return self._restore(spec, state, cpu_weight=LIVE_CPU_WEIGHT, fresh=False), False
        finally:
            if old is not None:
                # Only now: libvirt's cleanup of a domain slows a restore that runs beside it.
                self._kill(old.name())
                threading.Thread(
                    target=self._discard_old, args=(old, old_paths), name=f"reset-{sid}",
                    daemon=True,
                ).start()  # fmt: skip

    def _restore(
        self,
        spec: SessionSpec,
        state: SavedState,
        *,
        cpu_weight: int | None,
        fresh: bool,
        paused: bool = False,
        nic: NicAttachment | None = None,
    ) -> LibvirtDomain:
        paths = self._paths(spec.session_id)
        dom, helper = self._restore_domain(
            spec, state, paths, cpu_weight=cpu_weight, paused=paused, fresh=fresh, nic=nic
        )
        if helper is not None:
            self._helpers[spec.session_id] = helper
        return LibvirtDomain(self._conn, dom, spec.session_id, paths, helper)

    def _restore_domain(
        self,
        spec: SessionSpec,
        state: SavedState,
        paths: SessionPaths,
        *,
        cpu_weight: int | None,
        fresh: bool,
        paused: bool = False,
        nic: NicAttachment | None = None,
        spare: bool = False,
    ) -> tuple[libvirt.virDomain, HelperChannel | None]:
        """Restore ``state`` as the domain of ``paths``'s generation. On failure a
        ``spare`` leaves the session alone (only its own domain and overlay go); any
        other restore destroys the session."""
        header = read_header(state.state_file)
        if not state.disk.is_file():
            raise HypervisorError(f"the saved disk {state.disk} is missing")
        with self._lock:
            if fresh or spare:
                self._check_free_space(state.disk_cap_mib)
            if not spare:
                self._caps[spec.session_id] = state.disk_cap_mib
        fifo = paths.root / ("spare.fifo" if spare else "restore.fifo")
        errors: list[BaseException] = []
        helper = None
        try:
            if fresh:
                self._sessions_dir.mkdir(parents=True, exist_ok=True)
                # The one thing a fresh session's directory may hold already: its own copy
                # of the state (keep_state before the restore, a warm start with egress).
                paths.root.mkdir(mode=0o711, exist_ok=state.root == paths.root / "start")
                (paths.root / "instance").write_text(self.instance_id)
            subprocess.run(
                [
                    "qemu-img", "create", "-q", "-f", "qcow2",
                    "-F", "qcow2", "-b", str(state.disk), str(paths.overlay),
                    f"{state.disk_cap_mib}M",
                ],
                check=True, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            xml = clone_domain_xml(
                header.xml,
                session_id=spec.session_id,
                paths=paths,
                created=datetime.now(UTC),
                owner=str(self._sessions_dir),
                uuid=str(uuid.uuid4()),
                genid=str(uuid.uuid4()),
                nic=nic,
            )
            os.mkfifo(fifo, 0o600)

            def writer() -> None:
                try:
                    stream_clone(state.state_file, header, xml, fifo, timeout_s=RESTORE_TIMEOUT_S)
                except HypervisorError as exc:
                    errors.append(exc)

            thread = threading.Thread(target=writer, name=f"restore-{spec.session_id}")
            thread.start()
            try:
                self._conn.restoreFlags(str(fifo), None, libvirt.VIR_DOMAIN_SAVE_PAUSED)
            finally:
                if thread.is_alive():
                    # libvirt never opened the FIFO: open it ourselves to end the writer.
                    with contextlib.suppress(OSError):
                        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
                thread.join(timeout=RESTORE_TIMEOUT_S)
            if errors:
                raise errors[0]
            fifo.unlink()
            with self._lock:
                dom = self._conn.lookupByName(domain_name(spec.session_id, paths.generation))
            dom.setMemoryParameters(
                {"hard_limit": hard_limit_mib(spec) * 1024}, libvirt.VIR_DOMAIN_AFFECT_LIVE
            )
            if cpu_weight is not None:
                dom.setSchedulerParametersFlags(
                    {"cpu_shares": cpu_weight}, libvirt.VIR_DOMAIN_AFFECT_LIVE
                )
            if not paused:
                dom.resume()
            if spec.image.helper_port is not None:
                helper = HelperChannel(paths.helper_socket)
                helper.connect()
            return dom, helper
        except FileExistsError as exc:
            raise HypervisorError(f"session {spec.session_id} already exists") from exc
        except (
            OSError, subprocess.SubprocessError, libvirt.libvirtError, HypervisorError,
            GuestHelperError, ValueError,
        ) as exc:  # fmt: skip
            if isinstance(exc, libvirt.libvirtError):
                detail = exc.get_error_message()
            elif isinstance(exc, HypervisorError | GuestHelperError):
                detail = exc.message
            else:
                detail = getattr(exc, "stderr", None) or str(exc)
            if helper is not None:
                helper.close()
            if spare:
                with contextlib.suppress(OSError):
                    fifo.unlink()
                self._discard_spares_of(spec.session_id, above=paths.generation - 1)
            else:
                with contextlib.suppress(HypervisorError):
                    self.destroy(spec.session_id)
            raise HypervisorError(
                f"could not restore session {spec.session_id} from {state.state_file}: {detail}"
            ) from exc

    def resume(self, session_id: str) -> None:
        try:
            dom = self._lookup(session_id)
            if dom.info()[0] == libvirt.VIR_DOMAIN_PAUSED:
                dom.resume()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_OPERATION_INVALID:
                # Resumed meanwhile (the pool runs the head of its queue)?
                with contextlib.suppress(libvirt.libvirtError):
                    if self._lookup(session_id).info()[0] == libvirt.VIR_DOMAIN_RUNNING:
                        return
            raise HypervisorError(
                f"cannot resume the domain of {session_id}: {exc.get_error_message()}"
            ) from exc

    def set_cpu_weight(self, session_id: str, cpu_weight: int) -> None:
        try:
            dom = self._lookup(session_id)
            dom.setSchedulerParametersFlags(
                {"cpu_shares": cpu_weight}, libvirt.VIR_DOMAIN_AFFECT_LIVE
            )
        except libvirt.libvirtError as exc:
            raise HypervisorError(
                f"cannot set the CPU weight of {session_id}: {exc.get_error_message()}"
            ) from exc
