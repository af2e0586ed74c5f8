"""Scale-out with a real VM: a local Ray cluster with one libvirt node and one fake node.

The session asking for the real image is placed by Ray on the libvirt node (the only one
labelled with it), boots a real desktop there, takes input through the cluster bridge, and
its recording lands in the storage directory and verifies. The single slot of the libvirt
node makes the next create answer 503 before anything starts. Run under the VM lock.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import ray

from agent_bridge.client import Client
from agent_bridge.cluster.bridge import create_cluster_app
from agent_bridge.cluster.capacity import node_capacity
from agent_bridge.cluster.launch import host_capacity
from agent_bridge.cluster.local import LocalCluster
from agent_bridge.runtime import BackgroundServer
from orchestrator.replay import verify
from orchestrator.settings import Settings
from orchestrator.storage import fetch_bundle


def test_a_real_vm_is_placed_on_the_libvirt_node(settings: Settings, tmp_path: Path) -> None:
    store = tmp_path / "store"
    with LocalCluster() as cluster:
        real = host_capacity(settings, name="vmhost", backend="libvirt", slots=1)
        assert settings.default_image in real.images
        cluster.add_node(real, settings=settings, recordings_url=str(store), ship_interval_s=2)
        fake = node_capacity(
            name="fakehost", host_memory_mib=8192, host_cpus=2, accel="tcg", backend="fake",
            images=["fake-only"], slots=2,
        )  # fmt: skip
        cluster.add_node(fake, fake_images=("fake-only",))
        bridge_settings = Settings(default_image=settings.default_image, capture_fps=0)
        app = create_cluster_app(cluster.bridge(bridge_settings, placement_timeout_s=2.0))
        token = cluster.credentials["admin_token"]
        with BackgroundServer(app, host=cluster.ip) as server, Client(server.url, token) as client:
            session = client.create_session(width=1024, height=768)
            record = ray.get(cluster.registry.lookup.remote(session.id))
            assert record["node_name"] == "vmhost"
            try:
                shot = session.screenshot()
                assert (shot.width, shot.height) == (1024, 768)
                session.click(1024 // 6, 768 // 6)
                session.type("echo cluster-ok > /dev/ttyS1\n")
                deadline = time.monotonic() + 60
                while "cluster-ok" not in session.guest_log() and time.monotonic() < deadline:
                    time.sleep(0.5)
                assert "cluster-ok" in session.guest_log()
                t0 = time.monotonic()
                full = httpx.post(
                    f"{server.url}/v1/sessions",
                    json={},
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=30,
                )
                assert full.status_code == 503
                assert full.json()["error"]["code"] == "cluster_full"
                assert time.monotonic() - t0 < 10
                other = client.create_session(image="fake-only", width=640, height=400)
                assert ray.get(cluster.registry.lookup.remote(other.id))["node_name"] == "fakehost"
                other.delete()
            finally:
                info = session.delete()
            assert info is not None and info["state"] == "closed"
            domains = subprocess.run(
                ["virsh", "-c", "qemu:///system", "list", "--all", "--name"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert session.id not in domains
            deadline = time.monotonic() + 30
            manifest = store / session.id / "manifest.json"
            while time.monotonic() < deadline and (
                not manifest.is_file() or '"closed"' not in manifest.read_text()
            ):
                time.sleep(0.5)
    bundle = fetch_bundle(f"file://{store}/{session.id}", tmp_path / "fetched")
    report = verify(bundle)
    assert report.ok, report.problem
