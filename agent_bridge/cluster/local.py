"""A multi-node Ray cluster on one machine, for tests, benchmarks and trying scale-out.

Built on Ray's own ``ray.cluster_utils.Cluster``: a head node (no CPUs, no desktops: the
registry lives there) and any number of deskvm nodes, each a real raylet with its own
resources and labels and its own NodeAgent. Everything binds to a loopback address
(``127.0.0.2`` by default: Ray rewrites ``127.0.0.1`` to the host's outward address).
Leaving the ``with`` block stops every Ray process it started (GCS, raylets, workers), also
when the block raised.

    with LocalCluster() as cluster:
        cluster.add_node(capacity, settings=Settings(state_dir=...), fake_images=("img",))
        bridge = cluster.bridge(settings)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from agent_bridge.cluster.bridge import ClusterBridge
from agent_bridge.cluster.capacity import NodeCapacity
from agent_bridge.cluster.node import NodeConfig, start_node_agent
from agent_bridge.cluster.registry import NAMESPACE, ensure_registry
from orchestrator.settings import Settings

__all__ = ["HEALTH_CHECK", "LocalCluster", "LocalNode"]

HEALTH_CHECK = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
"""GCS health checks of the local cluster: a killed node is declared dead in ~1.5-2 s."""


@dataclass
class LocalNode:
    """One deskvm node of a :class:`LocalCluster`."""

    name: str
    raylet: Any  # ray._private.node.Node
    agent: Any  # the NodeAgent actor handle
    url: str
    state_dir: Path

    @property
    def node_id(self) -> str:
        return str(self.raylet.node_id)


class LocalCluster:
    """Ray head + deskvm nodes on this machine (see the module docstring).

    Args:
        ip: loopback address every Ray process binds (not 127.0.0.1, see above).
        admin_token: the cluster's admin token (default: a random one).
        reconcile_interval_s: the registry's reconcile period, s.
        reserve_timeout_s: the registry frees unused reservations and unowned session
            placement groups after this long, s.
        root: where node state and Ray's session files go (default: a new temporary
            directory, removed at exit).
    """

    def __init__(
        self,
        *,
        ip: str = "127.0.0.2",
        admin_token: str | None = None,
        reconcile_interval_s: float = 0.5,
        reserve_timeout_s: float = 60.0,
        root: Path | None = None,
    ) -> None:
        self.ip = ip
        self._admin_token = admin_token
        self._reconcile_interval_s = reconcile_interval_s
        self._reserve_timeout_s = reserve_timeout_s
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="dvr-"))
        self.nodes: dict[str, LocalNode] = {}
        self.cluster: Cluster | None = None
        self.registry: Any = None
        self.credentials: dict[str, str] = {}
        self._pids: set[int] = set()
        self._saved_tmpdir: str | None = None

    @property
    def address(self) -> str:
        assert self.cluster is not None
        return str(self.cluster.address)

    def __enter__(self) -> LocalCluster:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray keeps its session files and the "current cluster" address file under
        # RAY_TMPDIR/ray (default /tmp/ray, which it does not create): keep both in root.
        self._saved_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = str(self.root)
        (self.root / "ray").mkdir(parents=True, exist_ok=True)
        try:
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,
                    "node_ip_address": self.ip,
                    "include_dashboard": False,
                    "temp_dir": str(self.root / "ray"),
                    "object_store_memory": 80 * 1024 * 1024,
                    "_system_config": HEALTH_CHECK,
                },
            )
            self._remember(self.cluster.head_node)
            ray.init(
                address=self.cluster.address,
                namespace=NAMESPACE,
                _node_ip_address=self.ip,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            self.registry, self.credentials = ensure_registry(
                self._admin_token,
                reconcile_interval_s=self._reconcile_interval_s,
                reserve_timeout_s=self._reserve_timeout_s,
            )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _remember(self, raylet: Any) -> None:
        for infos in raylet.all_processes.values():
            for info in infos:
                if info.process is not None:
                    self._pids.add(info.process.pid)

    def add_node(
        self,
        capacity: NodeCapacity,
        *,
        settings: Settings | None = None,
        fake_images: tuple[str, ...] = (),
        recordings_url: str | None = None,
        ship_interval_s: float = 10.0,
        extra_resources: dict[str, float] | None = None,
    ) -> LocalNode:
        """Start a raylet declaring ``capacity`` and its NodeAgent.

        Args:
            capacity: slots, memory, labels (``backend`` ``fake`` or ``libvirt``).
            settings: the node's settings (default: a state dir under :attr:`root`, no
                continuous capture).
            fake_images: images the fake backend pretends to have.
            recordings_url: where the node ships recordings.
            ship_interval_s: shipping period of running recordings, s.
            extra_resources: more Ray resources for the raylet.
        """
        assert self.cluster is not None
        state_dir = self.root / "nodes" / capacity.name
        settings = settings or Settings(state_dir=state_dir, capture_fps=0)
        raylet = self.cluster.add_node(
            num_cpus=0,
            node_ip_address=self.ip,
            resources={**capacity.resources(), **(extra_resources or {})},
            labels=capacity.labels(),
            object_store_memory=80 * 1024 * 1024,
            include_dashboard=False,
        )
        self._remember(raylet)
        config = NodeConfig(
            capacity=capacity,
            settings=settings,
            host=self.ip,
            recordings_url=recordings_url,
            ship_interval_s=ship_interval_s,
            heartbeat_interval_s=0.5,
            fake_images=fake_images,
        )
        agent = start_node_agent(raylet.node_id, config)
        info = ray.get(agent.info.remote())
        node = LocalNode(capacity.name, raylet, agent, info["url"], settings.state_dir)
        self.nodes[capacity.name] = node
        return node

    def kill_node(self, name: str) -> None:
        """Kill a node's raylet and everything under it at once (a machine dying)."""
        assert self.cluster is not None
        node = self.nodes.pop(name)
        self.cluster.remove_node(node.raylet, allow_graceful=False)

    def bridge(self, settings: Settings, **options: Any) -> ClusterBridge:
        """A :class:`ClusterBridge` on this cluster (wrap it with ``create_cluster_app``)."""
        return ClusterBridge(self.registry, self.credentials, settings, **options)

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(Exception):
            for node in list(self.nodes.values()):
                with contextlib.suppress(Exception):
                    ray.kill(node.agent)
        with contextlib.suppress(Exception):
            ray.shutdown()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
        for pid in self._pids:  # whatever Ray's own shutdown missed (still a Ray process)
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"ray" in cmdline:
                    os.kill(pid, signal.SIGKILL)
        if self._saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._saved_tmpdir
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
