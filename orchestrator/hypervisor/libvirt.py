"""The real hypervisor: libvirt ``qemu:///system``, transient domains, qcow2 overlays.

QEMU runs as the unprivileged ``libvirt-qemu`` user under libvirt's seccomp sandbox and
DAC labelling; session files live in directories that user can reach.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
from datetime import UTC, datetime
from pathlib import Path

import libvirt

from orchestrator.display.qmp import QmpDisplay
from orchestrator.errors import HypervisorError
from orchestrator.hypervisor.base import Accel, NicAttachment, SessionPaths
from orchestrator.hypervisor.domain_xml import (
    METADATA_NS,
    domain_name,
    metadata_owner,
    render_domain_xml,
    session_id_of,
)
from orchestrator.spec import SessionSpec, validate_session_id

__all__ = ["LibvirtDomain", "LibvirtHypervisor", "open_connection"]

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
        self, conn: libvirt.virConnect, dom: libvirt.virDomain, session_id: str, paths: SessionPaths
    ) -> None:
        self._dom = dom
        self._session_id = session_id
        self._paths = paths
        self._display = QmpDisplay(conn, dom)

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def display(self) -> QmpDisplay:
        return self._display

    def is_running(self) -> bool:
        try:
            return bool(self._dom.isActive())
        except libvirt.libvirtError:
            return False

    def console_tail(self, max_bytes: int = 4096) -> str:
        return _tail(self._paths.console_log, max_bytes).decode("utf-8", "replace")

    def read_guest_log(self, offset: int = 0) -> bytes:
        try:
            with self._paths.guest_log.open("rb") as f:
                f.seek(offset)
                return f.read()
        except OSError:
            return b""


class LibvirtHypervisor:
    """:class:`~orchestrator.hypervisor.base.Hypervisor` on libvirt.

    Args:
        sessions_dir: where per-session directories (overlay, logs) are created.
        accel: ``"kvm"`` or ``"tcg"``, as found by the host's acceleration probe.
        uri: libvirt connection URI.
    """

    def __init__(self, sessions_dir: Path, *, accel: Accel, uri: str = "qemu:///system") -> None:
        self._sessions_dir = sessions_dir
        self._accel: Accel = accel
        self._uri = uri
        self._conn = open_connection(uri)
        self._lock = threading.Lock()

    @property
    def accel(self) -> Accel:
        return self._accel

    def close(self) -> None:
        with contextlib.suppress(libvirt.libvirtError):
            self._conn.close()

    def _paths(self, session_id: str) -> SessionPaths:
        return SessionPaths.under(self._sessions_dir, validate_session_id(session_id))

    def start(self, spec: SessionSpec, *, nic: NicAttachment | None = None) -> LibvirtDomain:
        paths = self._paths(spec.session_id)
        try:
            self._sessions_dir.mkdir(parents=True, exist_ok=True)
            self._sessions_dir.chmod(0o711)
            paths.root.mkdir(mode=0o711)
            subprocess.run(
                [
                    "qemu-img", "create", "-q", "-f", "qcow2",
                    "-F", "qcow2", "-b", str(spec.image.base_path), str(paths.overlay),
                ],
                check=True, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            xml = render_domain_xml(
                spec,
                paths,
                accel=self._accel,
                created=datetime.now(UTC),
                nic=nic,
                owner=str(self._sessions_dir),
            )
            with self._lock:
                dom = self._conn.createXML(xml, 0)
            return LibvirtDomain(self._conn, dom, spec.session_id, paths)
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

    def destroy(self, session_id: str) -> None:
        paths = self._paths(session_id)
        failures: list[str] = []
        try:
            with self._lock:
                dom = self._conn.lookupByName(domain_name(session_id))
                dom.destroy()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() not in (
                libvirt.VIR_ERR_NO_DOMAIN,
                libvirt.VIR_ERR_OPERATION_INVALID,
            ):
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
        """Session ids of this installation's domains (by metadata owner) and directories."""
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
            found.update(p.name for p in self._sessions_dir.iterdir() if p.is_dir())
        return found
