"""The composition root: settings -> the real seams -> a session manager.

Used by the CLI, the pytest plugin and the benchmarks; tests of the layers below inject
fakes instead.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from orchestrator.egress.base import Egress, EgressSettings
from orchestrator.errors import HostSetupError
from orchestrator.host import load_accel
from orchestrator.hypervisor.base import Accel
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import BootImage, new_session_id

__all__ = ["BackgroundServer", "build_egress", "build_manager", "ensure_token", "resolve_accel"]


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


def build_egress(settings: Settings) -> Egress | None:
    """The real egress (``NftEgress``) when an upstream is configured, else ``None``.

    Its per-session files live in the host-wide ``/run/deskvm/egress`` (so subnets and
    NFLOG groups never collide between installations); each session is owned by
    ``settings.sessions_dir``, the same owner label the hypervisor uses.

    Raises:
        ConfigError: the upstream settings are malformed.
    """
    if not settings.egress_upstream_iface:
        return None
    from orchestrator.egress.nftables import NftEgress

    egress_settings = EgressSettings(
        upstream_iface=settings.egress_upstream_iface,
        upstream_dns=settings.egress_upstream_dns,
    )
    return NftEgress(egress_settings, owner=str(settings.sessions_dir))


def build_manager(
    settings: Settings,
    *,
    egress: Egress | None = None,
    new_id: Callable[[], str] | None = None,
) -> SessionManager:
    """A :class:`SessionManager` on libvirt with images from ``settings.images_dir``.

    Args:
        settings: the host's settings.
        egress: the egress seam; default :func:`build_egress` of ``settings``.
        new_id: session id factory (a cluster node uses the ids its bridges place).

    Raises:
        HypervisorError: libvirt is not reachable.
        HostSetupError: acceleration unknown.
        ConfigError: the egress settings are malformed.
    """
    from orchestrator.hypervisor.libvirt import LibvirtHypervisor
    from vm_images import find_image

    def resolve(name: str) -> BootImage:
        return find_image(name or settings.default_image, settings.images_dir)

    hypervisor = LibvirtHypervisor(
        settings.sessions_dir, accel=resolve_accel(settings), uri=settings.libvirt_uri
    )
    return SessionManager(
        hypervisor=hypervisor,
        resolve_image=resolve,
        recordings_dir=settings.recordings_dir,
        max_sessions=settings.max_sessions,
        capture_fps=settings.capture_fps,
        max_total_memory_mib=settings.max_total_memory_mib,
        memory_overhead_mib=settings.memory_overhead_mib,
        egress=egress if egress is not None else build_egress(settings),
        new_id=new_id if new_id is not None else new_session_id,
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

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        from agent_bridge.server import MAX_MESSAGE_BYTES

        config = uvicorn.Config(
            app,  # type: ignore[arg-type]
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
            ws_max_size=MAX_MESSAGE_BYTES,
        )
        self._server = uvicorn.Server(config)
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
