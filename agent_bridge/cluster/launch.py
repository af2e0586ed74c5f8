"""What ``deskvm node`` and ``deskvm serve --ray`` do (the CLI only parses options).

* :func:`connect` — join an existing Ray cluster as a driver, in namespace ``deskvm``.
* :func:`serve_cluster` — a cluster bridge: the registry (created if this is the first),
  the cluster's credentials, the app.
* :func:`run_node` — a VM host joins: starts its raylet (``ray start --block`` as a child
  process, declaring the host's resources and labels), starts its NodeAgent, waits, and on
  Ctrl-C/SIGTERM/SIGHUP drains (sessions closed, recordings shipped), leaves and stops the raylet.
  If the raylet dies under it, every domain this node owns is destroyed before it exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI

from agent_bridge.cluster.bridge import ClusterBridge, create_cluster_app
from agent_bridge.cluster.capacity import LABEL_NODE, NodeCapacity, host_cpus, host_memory_mib
from agent_bridge.cluster.capacity import node_capacity as derive_capacity
from agent_bridge.cluster.node import NodeConfig, start_node_agent
from agent_bridge.cluster.registry import NAMESPACE, ensure_registry
from orchestrator.errors import ConfigError, HostSetupError
from orchestrator.interrupt import STOP_SIGNALS
from orchestrator.settings import Settings

__all__ = ["built_images", "connect", "host_capacity", "run_node", "serve_cluster"]


def _node_ip_for(address: str, node_ip: str | None) -> str | None:
    if node_ip:
        return node_ip
    host = address.rsplit(":", 1)[0]
    return host if host.startswith("127.") else None


def connect(address: str, *, node_ip: str | None = None) -> None:
    """Join the Ray cluster at ``address`` (``host:port`` of its GCS) as a driver.

    Ray's usage statistics stay off unless ``RAY_USAGE_STATS_ENABLED`` says otherwise.

    Args:
        node_ip: this host's address in the cluster (default: the address's host when
            it is a loopback one, else Ray's choice).

    Raises:
        HostSetupError: the cluster cannot be reached.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            _node_ip_address=_node_ip_for(address, node_ip),
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError from Ray
        raise HostSetupError(f"cannot join the Ray cluster at {address}: {exc}") from exc


def serve_cluster(
    settings: Settings,
    *,
    admin_token: str | None,
    placement_timeout_s: float,
    require_accel: str | None,
) -> tuple[FastAPI, str]:
    """The cluster bridge app and the cluster's admin token (after :func:`connect`).

    Raises:
        ConfigError: ``admin_token`` differs from the cluster's.
    """
    registry, credentials = ensure_registry(admin_token)
    bridge = ClusterBridge(
        registry,
        credentials,
        settings,
        placement_timeout_s=placement_timeout_s,
        require_accel=require_accel,
    )
    return create_cluster_app(bridge), credentials["admin_token"]


def built_images(settings: Settings) -> list[str]:
    """Names of the images built in ``settings.images_dir`` (current recipe content)."""
    from orchestrator.errors import ImageNotFound
    from vm_images import find_image, list_recipes

    names = []
    for recipe in list_recipes():
        with contextlib.suppress(ImageNotFound):
            find_image(recipe, settings.images_dir)
            names.append(recipe)
    return names


def host_capacity(
    settings: Settings,
    *,
    name: str,
    backend: str,
    slots: int | None,
    fake_images: tuple[str, ...] = (),
    accel: str | None = None,
) -> NodeCapacity:
    """This host's declaration (see :func:`agent_bridge.cluster.capacity.node_capacity`).

    Raises:
        ConfigError, HostSetupError: no acceleration verdict (run ``deskvm doctor``), no
            image, or no room for a session.
    """
    from agent_bridge.runtime import resolve_accel

    if backend == "fake":
        images = list(fake_images)
        chosen = accel or "tcg"
    else:
        images = built_images(settings)
        chosen = accel or resolve_accel(settings)
    if not images:
        raise ConfigError(
            "this node has no image to offer: build one (deskvm image build) or, with"
            " --backend fake, name some with --fake-image"
        )
    return derive_capacity(
        name=name,
        host_memory_mib=host_memory_mib(),
        host_cpus=host_cpus(),
        accel=chosen,
        backend="fake" if backend == "fake" else "libvirt",
        images=images,
        egress=bool(settings.egress_upstream_iface),
        memory_overhead_mib=settings.memory_overhead_mib,
        slots=slots,
    )


def _ray_start_command(address: str, capacity: NodeCapacity, node_ip: str | None) -> list[str]:
    ray_exe = Path(sys.executable).with_name("ray")
    labels = ",".join(f"{k}={v}" for k, v in capacity.labels().items())
    command = [
        str(ray_exe) if ray_exe.exists() else "ray",
        "start",
        "--address",
        address,
        "--block",
        "--num-cpus",
        "0",
        "--resources",
        json.dumps(capacity.resources()),
        "--labels",
        labels,
        "--disable-usage-stats",
    ]
    if node_ip:
        command += ["--node-ip-address", node_ip]
    return command


def _find_node(name: str, exclude: set[str]) -> str | None:
    for node in ray.nodes():
        labels = node.get("Labels", {})
        if node.get("Alive") and labels.get(LABEL_NODE) == name and node["NodeID"] not in exclude:
            return str(node["NodeID"])
    return None


def run_node(
    address: str,
    capacity: NodeCapacity,
    settings: Settings,
    *,
    node_ip: str | None = None,
    host: str | None = None,
    port: int = 0,
    recordings_url: str | None = None,
    ship_interval_s: float = 10.0,
    fake_images: tuple[str, ...] = (),
    say: Callable[[str], None] = print,
    join_timeout_s: float = 90.0,
) -> int:
    """Join the cluster as a deskvm node and serve until stopped (see module docstring).

    Returns:
        The exit code: 0 after a clean stop, 1 if the raylet died under it.

    Raises:
        ConfigError: a node of that name is already in the cluster.
        HostSetupError: the raylet or the agent could not start.
    """
    node_ip = _node_ip_for(address, node_ip)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    command = _ray_start_command(address, capacity, node_ip)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": os.environ.get("RAY_USAGE_STATS_ENABLED", "0")}
    log_path = settings.state_dir / "ray-node.log"
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        raylet = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    agent: Any = None
    code = 0
    try:
        connect(address, node_ip=node_ip)
        for sig in previous:  # ray.init installed its own SIGTERM handler (sys.exit)
            signal.signal(sig, lambda *_: stop.set())
        deadline = time.monotonic() + join_timeout_s
        node_id = None
        while node_id is None:
            if raylet.poll() is not None:
                raise HostSetupError(f"`ray start` exited with {raylet.returncode}; see {log_path}")
            if time.monotonic() > deadline or stop.is_set():
                raise HostSetupError(f"this node did not join within {join_timeout_s:.0f} s")
            node_id = _find_node(capacity.name, set())
            time.sleep(0.3)
        if _find_node(capacity.name, {node_id}) is not None:
            raise ConfigError(f"a node named {capacity.name!r} is already in the cluster")
        config = NodeConfig(
            capacity=capacity,
            settings=settings,
            host=host,
            port=port,
            recordings_url=recordings_url,
            ship_interval_s=ship_interval_s,
            fake_images=fake_images,
        )
        agent = start_node_agent(node_id, config)
        info = ray.get(agent.info.remote())
        say(
            f"node {capacity.name} joined {address}: {capacity.slots} desktop slots,"
            f" {capacity.memory_mib} MiB, accel {capacity.accel}, images"
            f" {', '.join(capacity.images)}; sessions served at {info['url']}"
        )
        if recordings_url:
            say(f"recordings shipped to {recordings_url}/<session id>")
        while not stop.wait(1.0):
            if raylet.poll() is not None:
                say(f"the raylet exited ({raylet.returncode}); destroying this node's sessions")
                code = 1
                break
    finally:
        if agent is not None and code == 0:
            say("draining: closing sessions, shipping recordings")
            with contextlib.suppress(Exception):
                ray.get(agent.drain.remote(), timeout=300)
            with contextlib.suppress(Exception):
                ray.kill(agent)
        with contextlib.suppress(Exception):
            ray.shutdown()
        if raylet.poll() is None:
            raylet.terminate()
            try:
                raylet.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raylet.kill()
                raylet.wait()
        if code == 1 and capacity.backend == "libvirt":
            from agent_bridge.runtime import build_manager

            with contextlib.suppress(Exception):
                reaped = build_manager(settings).reap()
                say(f"destroyed leftovers: {', '.join(reaped) or 'none'}")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
