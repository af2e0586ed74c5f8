"""The composition root: settings -> the real seams -> a session manager.

Used by the CLI, the pytest plugin and the benchmarks; tests of the layers below inject
fakes instead.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent_bridge.tokens import TokenAuthority
from orchestrator.egress.base import Egress, EgressSettings
from orchestrator.errors import DeskvmError, HostSetupError, HypervisorError
from orchestrator.host import (
    default_total_memory_mib,
    host_memory_mib,
    load_accel,
    load_host_record,
    store_accel,
)
from orchestrator.hypervisor.base import Accel
from orchestrator.instance import Instance
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import BootImage, DisplaySpec, new_session_id
from orchestrator.store import FileSessionStore

__all__ = [
    "EGRESS_RUN_DIR",
    "BackgroundServer",
    "HostAccelVerdict",
    "build_authority",
    "build_egress",
    "build_manager",
    "domains_using",
    "ensure_signing_key",
    "ensure_token",
    "resolve_accel",
    "total_memory_mib",
    "verify_image",
]

EGRESS_RUN_DIR = Path("/run/deskvm/egress")
"""Parent of every installation's egress state directory (tmpfs: gone at reboot, like the
bridges and tables it describes)."""


def resolve_accel(settings: Settings) -> Accel:
    """The acceleration to use: forced by settings, else the doctor's stored verdict.

    Raises:
        HostSetupError: no verdict yet (run ``deskvm doctor``).
    """
    if settings.accel != "auto":
        return settings.accel
    accel = load_accel(settings.host_file)
    if accel is None:
        raise HostSetupError(
            f"acceleration not probed yet ({settings.host_file} missing): run `deskvm doctor --fix`"
        )
    return accel


class HostAccelVerdict:
    """The host file's acceleration verdict, as a hypervisor's
    :class:`~orchestrator.hypervisor.base.AccelVerdict`: a KVM stop before any Linux guest
    reached ready under KVM stores TCG (later processes start under TCG; ``deskvm doctor
    --reprobe`` probes again), and the first ready under KVM is stored as proof.

    Args:
        host_file: the doctor's verdict file (``settings.host_file``).
        pinned: the owner fixed KVM (``DESKVM_ACCEL=kvm``, a cluster node's ``kvm`` label):
            a stop is stored but does not switch this process to TCG.
    """

    def __init__(self, host_file: Path, *, pinned: bool = False) -> None:
        self.host_file = host_file
        self.pinned = pinned
        record = load_host_record(host_file)
        self.kvm_proven = record.get("accel") == "kvm" and record.get("kvm_ran_linux") is True
        self._lock = threading.Lock()

    def kvm_failed(self, reason: str) -> None:
        with self._lock:
            store_accel(
                self.host_file,
                "tcg",
                f"kvm: the probe's boot sector ran but KVM stopped a Linux guest ({reason}); "
                "TCG since then",
                source="boot",
            )

    def kvm_ran_linux(self) -> None:
        with self._lock:
            if self.kvm_proven:
                return
            record = load_host_record(self.host_file)
            if record.get("accel") not in (None, "kvm"):
                return  # another process stored TCG meanwhile: its evidence stands
            store_accel(
                self.host_file,
                "kvm",
                "kvm: a Linux guest reached ready under KVM",
                source="boot",
                kvm_ran_linux=True,
            )
            self.kvm_proven = True


def ensure_token(settings: Settings) -> str:
    """The admin bearer token: from settings, else from the 0600 token file, else a new one.

    A new token is written to ``settings.token_file`` with mode 0600.
    """
    if settings.token:
        return settings.token
    path: Path = settings.token_file
    try:
        token = path.read_text().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def ensure_signing_key(settings: Settings) -> bytes:
    """The installation's token signing key: read from ``settings.token_key_file``, or
    made (32 random bytes, hex, mode 0600) the first time.

    Session tokens are signed with it, so tokens minted before a bridge restart still
    verify after it. Deleting the file invalidates every token at the next start.

    Raises:
        HostSetupError: the file cannot be read or written, or is malformed.
    """
    path = settings.token_key_file
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        raise HostSetupError(f"cannot read the token signing key {path}: {exc}") from exc
    key = secrets.token_bytes(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
    except FileExistsError:  # another server of the installation made it just now
        return bytes.fromhex(path.read_text().strip())
    except OSError as exc:
        raise HostSetupError(f"cannot write the token signing key {path}: {exc}") from exc
    return key


def build_authority(settings: Settings) -> TokenAuthority:
    """A token authority signing with the installation's key (tokens survive restarts)."""
    return TokenAuthority(
        secret=ensure_signing_key(settings),
        default_ttl_s=settings.token_ttl_s,
        max_ttl_s=settings.token_max_ttl_s,
    )


def build_egress(settings: Settings) -> Egress | None:
    """The real egress (``NftEgress``) when an upstream is configured, else ``None``.

    The installation is ``settings.sessions_dir``: its per-session files live in
    ``/run/deskvm/egress/<tag>`` and its nft tables are named ``deskvm_<tag>`` (``tag``:
    :func:`orchestrator.egress.plan.installation_tag` of the sessions directory), so two
    installations on one host never touch each other's. What every installation shares
    (subnet slots, IP forwarding) is in the host-wide ``/run/deskvm/net``.

    Raises:
        ConfigError: the upstream settings are malformed.
    """
    if not settings.egress_upstream_iface:
        return None
    from orchestrator.egress.nftables import NftEgress
    from orchestrator.egress.plan import installation_tag

    owner = str(settings.sessions_dir)
    egress_settings = EgressSettings(
        upstream_iface=settings.egress_upstream_iface,
        upstream_dns=settings.egress_upstream_dns,
        state_dir=EGRESS_RUN_DIR / installation_tag(owner),
    )
    return NftEgress(egress_settings, owner=owner)


def total_memory_mib(settings: Settings) -> int | None:
    """The cap on live sessions' memory hard limits: ``settings.max_total_memory_mib``, or
    derived from the host's RAM (:func:`orchestrator.host.default_total_memory_mib`);
    ``None`` only when the host's RAM cannot be read."""
    if settings.max_total_memory_mib is not None:
        return settings.max_total_memory_mib
    host_mib = host_memory_mib()
    return None if host_mib is None else default_total_memory_mib(host_mib)


def build_manager(
    settings: Settings,
    *,
    egress: Egress | None = None,
    new_id: Callable[[], str] | None = None,
    resolve_image: Callable[[str], BootImage] | None = None,
    server_name: str | None = None,
) -> SessionManager:
    """A :class:`SessionManager` on libvirt with images from ``settings.images_dir``.

    Its sessions keep records in ``settings.session_state_dir`` and it is the server
    instance ``server_name`` (or ``settings.server_name``; neither: an ephemeral name,
    so nothing it leaves behind is ever re-adopted). Call ``manager.adopt()`` before
    serving to take back what a previous run of the same name left running.

    Args:
        settings: the host's settings.
        egress: the egress seam; default :func:`build_egress` of ``settings``.
        new_id: session id factory (a cluster node uses the ids its bridges place).
        resolve_image: image name -> image; default: the verified image of that name in
            ``settings.images_dir`` (:func:`vm_images.find_image`).
        server_name: this server's name in the installation (``deskvm serve`` passes
            ``serve-<port>`` unless ``--name`` says otherwise).

    Raises:
        HypervisorError: libvirt is not reachable.
        HostSetupError: acceleration unknown.
        ConfigError: the egress settings are malformed; code ``instance_busy``: a live
            server of the installation already has this name.
    """
    from orchestrator.hypervisor.libvirt import LibvirtHypervisor
    from vm_images import find_image

    def find_verified(name: str) -> BootImage:
        return find_image(name or settings.default_image, settings.images_dir)

    resolve = resolve_image if resolve_image is not None else find_verified

    warm_pool = settings.warm_pool if new_id is None else ()
    accel = resolve_accel(settings)
    instance = Instance(settings.instances_dir, server_name or settings.server_name)
    try:
        hypervisor = LibvirtHypervisor(
            settings.sessions_dir,
            accel=accel,
            uri=settings.libvirt_uri,
            instance=instance,
            accel_verdict=HostAccelVerdict(settings.host_file, pinned=settings.accel == "kvm"),
        )
    except BaseException:
        instance.close()
        raise
    return SessionManager(
        hypervisor=hypervisor,
        resolve_image=resolve,
        recordings_dir=settings.recordings_dir,
        max_sessions=settings.max_sessions,
        capture_fps=settings.capture_fps,
        max_total_memory_mib=total_memory_mib(settings),
        memory_overhead_mib=settings.memory_overhead_mib,
        egress=egress if egress is not None else build_egress(settings),
        new_id=new_id if new_id is not None else new_session_id,
        store=FileSessionStore(settings.session_state_dir),
        instance=instance,
        adopt_grace_s=settings.adopt_grace_s,
        warm_pool=warm_pool,
        pool_dir=settings.pool_dir / instance.name,
    )


class BackgroundServer:
    """Run a bridge app under uvicorn in a thread on ``127.0.0.1`` (a free port).

    For the demo, the pytest plugin and the benchmarks. Use as a context manager; on
    exit the server stops and its lifespan closes every session.

    Attributes:
        url: ``http://127.0.0.1:<port>`` once started.
    """

    def __init__(self, app: object, *, host: str = "127.0.0.1", port: int = 0) -> None:
        import socket

        from agent_bridge.server import make_server

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self._server = make_server(app, host, port, log_level="warning")  # type: ignore[arg-type]
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BackgroundServer:
        import time

        self._thread = threading.Thread(target=self._server.run, name="deskvm-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise HostSetupError(f"the bridge server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=120)


@dataclass(frozen=True, slots=True)
class VerifyOutcome:
    """What :func:`verify_image` did.

    Attributes:
        image: the verified image.
        boot_to_ready_s: seconds from the session request to the ready frame.
        recording: the verify session's recording directory.
        verified_json: where the verification was recorded.
    """

    image: BootImage
    boot_to_ready_s: float
    recording: Path
    verified_json: Path


def verify_image(
    settings: Settings,
    name: str,
    *,
    width_px: int | None = None,
    height_px: int | None = None,
    boot_timeout_s: float | None = None,
    on_started: Callable[[str], None] | None = None,
    content_hash: str | None = None,
) -> VerifyOutcome:
    """Boot image ``name`` once, wait for its ready frame, and record it as verified.

    The session is an ordinary one (no NIC, overlay, recording in ``recordings_dir``); it
    is ready when the guest reported ``DESKVM_READY`` and the frame check of the image
    (background, windows, bands such as a panel) passed. Then ``verified.json`` and
    ``ready.png`` are written next to the image and the session is deleted.

    Args:
        settings: the host's settings.
        name: image name.
        width_px, height_px: display size (default: the image's default display, else
            1280x800).
        boot_timeout_s: deadline for the ready frame (default: the image's
            ``ready.boot_timeout_s``, at least ``settings.boot_timeout_s``).
        on_started: called with the session id once the domain is defined.
        content_hash: verify this stored version (hash prefix) instead of the current one.

    Raises:
        ImageNotFound: no such image.
        BootTimeout, HypervisorError: the boot did not reach a ready frame (the image stays
            unverified; the message carries the console tail).
    """
    import json

    from agent_bridge.protocol.actions import Screenshot
    from agent_bridge.protocol.results import ImageResult
    from vm_images import VerifyRecord, find_image, mark_verified

    image = find_image(name, settings.images_dir, require_verified=False, content_hash=content_hash)
    try:
        meta = json.loads((image.base_path.parent / "image.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    default = meta.get("display_default") or [1280, 800]
    display = DisplaySpec(
        width_px=width_px if width_px is not None else int(default[0]),
        height_px=height_px if height_px is not None else int(default[1]),
    )
    timeout_s = boot_timeout_s
    if timeout_s is None:
        image_timeout_s = float((meta.get("ready") or {}).get("boot_timeout_s", 180.0))
        timeout_s = max(image_timeout_s, settings.boot_timeout_s)
    manager = build_manager(settings, egress=None, resolve_image=lambda _name: image)
    t0 = time.monotonic()
    session = manager.create(
        image=name,
        display=display,
        boot_timeout_s=timeout_s,
        on_started=(lambda s: on_started(s.id)) if on_started is not None else None,
    )
    boot_s = time.monotonic() - t0
    try:
        shot = session.execute(Screenshot(), source="system")
        if not isinstance(shot, ImageResult):  # pragma: no cover - the action's contract
            raise HypervisorError("verify: the screenshot returned no image")
        recording = manager.recordings_dir / session.id
    finally:
        with contextlib.suppress(DeskvmError):
            session.close(reason="image verified")
    record = VerifyRecord(
        verified_at=_now_iso(),
        boot_to_ready_s=round(boot_s, 1),
        accel=str(manager.hypervisor.accel),
        width_px=display.width_px,
        height_px=display.height_px,
        reason="DESKVM_READY and the image's frame check passed",
    )
    path = mark_verified(image, record, shot.data)
    return VerifyOutcome(
        image=image, boot_to_ready_s=record.boot_to_ready_s, recording=recording,
        verified_json=path,
    )  # fmt: skip


def _now_iso() -> str:
    import datetime

    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def domains_using(settings: Settings, image_dir: Path) -> list[str]:
    """Names of running libvirt domains (any installation) whose disks sit on ``image_dir``.

    Reads each domain's live XML (``<backingStore>`` chain included) on
    ``settings.libvirt_uri``.

    Raises:
        HypervisorError: libvirt is not reachable.
    """
    import xml.etree.ElementTree as ET

    import libvirt

    prefix = str(image_dir.resolve()) + "/"
    try:
        conn = libvirt.open(settings.libvirt_uri)
    except libvirt.libvirtError as exc:
        raise HypervisorError(f"cannot connect to {settings.libvirt_uri}: {exc}") from exc
    users: list[str] = []
    try:
        for dom in conn.listAllDomains():
            try:
                root = ET.fromstring(dom.XMLDesc(0))
            except (libvirt.libvirtError, ET.ParseError):
                continue
            for source in root.iter("source"):
                path = source.get("file") or ""
                if path.startswith(prefix):
                    users.append(dom.name())
                    break
    finally:
        conn.close()
    return sorted(users)
