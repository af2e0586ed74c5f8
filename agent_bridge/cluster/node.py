"""The NodeAgent: one Ray actor per VM host, running the one-machine bridge there.

The agent owns the host's :class:`~orchestrator.manager.SessionManager` (libvirt, or the
fake hypervisor for tests and benchmarks), unchanged, and serves the very same bridge app
``deskvm serve`` serves (:func:`agent_bridge.server.create_app`) on the node's address, built
with the cluster's admin token and token-signing secret. Bridges proxy every call about a
session to it (docs/scale-out.md). A thread heartbeats the registry with the manager's
sessions and ships each recording to the storage URL while it runs and once at its end.

:func:`start_node_agent` creates the agent pinned to one Ray node (named
``deskvm-node-<name>``, detached, restarted by Ray if its process dies).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agent_bridge.cluster.capacity import NodeCapacity
from agent_bridge.cluster.registry import NAMESPACE, get_registry
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from agent_bridge.tokens import TokenAuthority
from orchestrator.errors import ConfigError, DeskvmError, ImageNotFound, StorageError
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import BootImage, new_session_id
from orchestrator.storage import BundleShipper, Store, open_store

__all__ = [
    "PLACED_ID_HEADER",
    "NodeAgent",
    "NodeConfig",
    "agent_name",
    "start_node_agent",
]

log = logging.getLogger("deskvm.cluster")

PLACED_ID_HEADER = "x-deskvm-session-id"
"""Header of a bridge's ``POST /v1/sessions`` to a node: the id it placed the session as."""

_placed_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "deskvm_placed_id", default=None
)
_ID_RE = re.compile(r"^[a-z0-9]{12}$")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything a NodeAgent needs (picklable: it travels to the node's worker).

    Attributes:
        capacity: what the node declared (slots, memory, labels).
        settings: the node's deskvm settings (state dir, images, libvirt URI, egress,
            rate limits, token lifetimes, capture rate); ``max_sessions`` and
            ``max_total_memory_mib`` are taken from ``capacity``.
        host: address the node's bridge app binds and advertises (default: Ray's node IP).
        port: its TCP port (0: a free one).
        recordings_url: where recordings are shipped (``None``: kept on the node only).
        ship_interval_s: how often running recordings are shipped, s.
        heartbeat_interval_s: how often the registry hears from the node, s.
        fake_images: with the fake backend, the image names it pretends to have.
    """

    capacity: NodeCapacity
    settings: Settings
    host: str | None = None
    port: int = 0
    recordings_url: str | None = None
    ship_interval_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    fake_images: tuple[str, ...] = field(default=())


def agent_name(node_name: str) -> str:
    """The Ray actor name of a node's agent."""
    return f"deskvm-node-{node_name}"


class _PlacedIdMiddleware:
    """ASGI middleware of node apps: ``POST /v1/sessions`` may carry the id its bridge
    placed the session as (:data:`PLACED_ID_HEADER`); the manager's id factory uses it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] == "/v1/sessions"
        ):
            value = next(
                (
                    v.decode("latin-1")
                    for k, v in scope["headers"]
                    if k == PLACED_ID_HEADER.encode()
                ),
                None,
            )
            if value is not None and _ID_RE.match(value):
                token = _placed_id.set(value)
                try:
                    await self.app(scope, receive, send)
                finally:
                    _placed_id.reset(token)
                return
        await self.app(scope, receive, send)


def _placed_or_new_id() -> str:
    return _placed_id.get() or new_session_id()


def _fake_manager(config: NodeConfig, settings: Settings) -> SessionManager:
    from orchestrator.egress.fake import FakeEgress
    from orchestrator.hypervisor.fake import FakeHypervisor

    images = set(config.fake_images)

    def resolve(name: str) -> BootImage:
        if name not in images:
            raise ImageNotFound(f"no built image {name!r} on node {config.capacity.name}")
        root = settings.state_dir / "fake-images" / name
        return BootImage(name, "0" * 64, root / "base.qcow2", root / "vmlinuz", root / "initrd")

    return SessionManager(
        hypervisor=FakeHypervisor(accel="kvm" if config.capacity.accel == "kvm" else "tcg"),
        resolve_image=resolve,
        recordings_dir=settings.recordings_dir,
        max_sessions=config.capacity.slots,
        max_total_memory_mib=config.capacity.memory_mib,
        memory_overhead_mib=settings.memory_overhead_mib,
        capture_fps=settings.capture_fps,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
        egress=FakeEgress() if config.capacity.egress else None,
        new_id=_placed_or_new_id,
    )


class NodeAgent:
    """The per-node actor (see the module docstring). Construct through
    :func:`start_node_agent`.

    Raises:
        ConfigError, HypervisorError, HostSetupError: the node cannot serve sessions.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.incarnation = secrets.token_hex(6)
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self._registry = get_registry()
        credentials = ray.get(self._registry.credentials.remote())
        capacity = config.capacity
        settings = replace(
            config.settings,
            # Sessions run as the node's label says: a KVM node whose KVM stops a guest
            # reports it (and stores TCG for its next start) rather than run TCG as "kvm".
            accel=capacity.accel if capacity.accel in ("kvm", "tcg") else config.settings.accel,
            max_sessions=capacity.slots,
            max_total_memory_mib=capacity.memory_mib,
        )
        self.settings = settings
        if capacity.backend == "fake":
            self.manager = _fake_manager(config, settings)
        else:
            self.manager = build_manager(settings, new_id=_placed_or_new_id)
        reaped = self.manager.reap()
        if reaped:
            log.warning("node %s reaped leftovers: %s", capacity.name, ", ".join(reaped))
        authority = TokenAuthority(
            secret=bytes.fromhex(credentials["token_secret"]),
            default_ttl_s=settings.token_ttl_s,
            max_ttl_s=settings.token_max_ttl_s,
        )
        app = create_app(
            self.manager, token=credentials["admin_token"], settings=settings, authority=authority
        )
        host = config.host or ray.util.get_node_ip_address()
        self._server = BackgroundServer(_PlacedIdMiddleware(app), host=host, port=config.port)
        self._server.__enter__()
        self.url = self._server.url
        self._store: Store | None = (
            open_store(config.recordings_url) if config.recordings_url else None
        )
        self._shippers: dict[str, BundleShipper] = {}
        self._shipped_final: set[str] = set()
        self._last_ship = 0.0
        self._stop = threading.Event()
        self._register()
        self._thread = threading.Thread(target=self._run, name="deskvm-node-agent", daemon=True)
        self._thread.start()

    # --- registry ------------------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        capacity = self.config.capacity
        return {
            "node_id": self.node_id,
            "name": capacity.name,
            "url": self.url,
            "incarnation": self.incarnation,
            "labels": capacity.labels(),
            "resources": capacity.resources(),
            "backend": capacity.backend,
            "accel": capacity.accel,
            "images": list(capacity.images),
            "egress": capacity.egress,
            "recordings_url": self.config.recordings_url,
        }

    def _register(self) -> None:
        ray.get(self._registry.register_node.remote(self._info()))

    def _report(self) -> list[dict[str, Any]]:
        out = []
        for session in self.manager.all():
            shipper = self._shippers.get(session.id)
            out.append(
                {
                    "session_id": session.id,
                    "state": session.state,
                    "closed_reason": session.closed_reason,
                    "recording_url": shipper.url if shipper is not None else None,
                }
            )
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                self._ship_due()
                answer = ray.get(
                    self._registry.heartbeat.remote(self.node_id, self.incarnation, self._report()),
                    timeout=30,
                )
                if not answer.get("ok") and answer.get("reregister"):
                    self._register()
            except Exception:
                log.exception("node agent heartbeat failed")

    # --- recordings ----------------------------------------------------------------

    def _shipper(self, session_id: str, path: Path) -> BundleShipper | None:
        if self._store is None:
            return None
        shipper = self._shippers.get(session_id)
        if shipper is None:
            shipper = BundleShipper(path, self._store, session_id)
            self._shippers[session_id] = shipper
        return shipper

    def _ship_due(self, *, force: bool = False) -> None:
        if self._store is None:
            return
        now = time.monotonic()
        periodic = force or now - self._last_ship >= self.config.ship_interval_s
        if periodic:
            self._last_ship = now
        for session in self.manager.all():
            path = session.recorder.path
            if path is None or session.id in self._shipped_final:
                continue
            shipper = self._shipper(session.id, path)
            if shipper is None:
                continue
            ended = session.state in ("closed", "failed")
            try:
                if ended:
                    report = shipper.ship(final=True)
                    if report.manifest_status not in (None, "recording"):
                        self._shipped_final.add(session.id)
                elif periodic:
                    shipper.ship()
            except StorageError as exc:
                log.error("shipping the recording of %s failed: %s", session.id, exc.message)
        known = {s.id for s in self.manager.all()}
        for session_id in [s for s in self._shippers if s not in known]:
            del self._shippers[session_id]
            self._shipped_final.discard(session_id)

    # --- actor methods -------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """The node as registered (``url``, ``incarnation``, labels, resources...)."""
        return self._info()

    def pid(self) -> int:
        """The agent's process id (benchmarks measure its memory)."""
        return os.getpid()

    def ping(self) -> str:
        """The incarnation id (changes when Ray restarts the agent)."""
        return self.incarnation

    def ship_now(self) -> int:
        """Ship every recording now (tests, drain); returns the sessions still unfinished."""
        self._ship_due(force=True)
        return sum(1 for s in self.manager.all() if s.id not in self._shipped_final)

    def drain(self, reason: str = "node draining") -> dict[str, Any]:
        """Close every live session, ship their recordings, leave the registry, stop serving.

        Returns:
            ``{"closed": [...], "errors": [...]}``.
        """
        closed = [s.id for s in self.manager.live()]
        errors = self.manager.close_all(reason=reason)
        with contextlib.suppress(DeskvmError):
            self._ship_due(force=True)
        self._stop.set()
        with contextlib.suppress(Exception):
            ray.get(self._registry.heartbeat.remote(self.node_id, self.incarnation, self._report()))
            ray.get(self._registry.unregister_node.remote(self.node_id, self.incarnation))
        self._server.__exit__(None, None, None)
        return {"closed": closed, "errors": errors}


def start_node_agent(node_id: str, config: NodeConfig, *, timeout_s: float = 120.0) -> Any:
    """Create (or get) the agent of ``config.capacity.name`` pinned to Ray node ``node_id``.

    Args:
        node_id: the Ray node (hex id) the agent must run on.
        config: the node's configuration.
        timeout_s: how long to wait for the agent to serve.

    Returns:
        The actor handle (its ``info`` has the URL).

    Raises:
        ConfigError: the agent failed to start (the message says why).
    """
    actor = ray.remote(NodeAgent).options(
        name=agent_name(config.capacity.name),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=8,
        max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )
    handle = actor.remote(config)
    try:
        ray.get(handle.ping.remote(), timeout=timeout_s)
    except Exception as exc:
        with contextlib.suppress(Exception):
            ray.kill(handle)
        raise ConfigError(f"the deskvm agent of node {config.capacity.name} failed: {exc}") from exc
    return handle
