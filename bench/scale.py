"""Scale-out costs on a local multi-node Ray cluster (fake backend): placement, routing, memory.

Starts a :class:`~agent_bridge.cluster.local.LocalCluster` (a head and ``--nodes`` deskvm
nodes on loopback, fake hypervisor, no continuous capture) and a cluster bridge in this
process, then prints three tables:

1. Time to place and create N sessions (N from ``--sizes``, default 10, 100, 500), with
   ``--concurrency`` clients: wall time, sessions per second, per-create latency p50/p95,
   and the time to delete them all again.
2. Per-action overhead of the cluster's routing: round trips of one action over the
   WebSocket through the bridge (bridge -> owning node's app) against the same session
   reached directly on its node (the one-machine app), alternating between the two
   sockets: p50/p95 of each and the difference. Actions: ``cursor_position`` (no input)
   and ``move``.
3. Control-plane memory per session: resident memory (VmRSS) of the GCS, the raylets,
   the registry actor and the bridge process before and with the largest N sessions
   open, divided by N; the node agents (the session managers, which hold the sessions
   themselves) are reported separately.

The machine's load (``/proc/loadavg``) is printed next to the figures.

Usage: ``python bench/scale.py [--sizes 10,100,500] [--nodes 3] [--rtt-count 500]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import ray
from websockets.sync.client import connect

from agent_bridge.cluster.bridge import create_cluster_app
from agent_bridge.cluster.capacity import node_capacity
from agent_bridge.cluster.local import LocalCluster
from agent_bridge.runtime import BackgroundServer
from orchestrator.interrupt import run_main
from orchestrator.settings import Settings

IMAGE = "bench-desktop"


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def create_many(
    client: httpx.Client, n: int, concurrency: int
) -> tuple[float, list[float], list[str]]:
    def one(_: int) -> tuple[float, str]:
        t0 = time.perf_counter()
        response = client.post(
            "/v1/sessions", json={"display": {"width": 640, "height": 400}, "memory_mib": 256}
        )
        if response.status_code != 201:
            raise SystemExit(f"create failed: {response.status_code} {response.text}")
        return time.perf_counter() - t0, response.json()["id"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(n)))
    return time.perf_counter() - t0, [r[0] for r in results], [r[1] for r in results]


def delete_many(client: httpx.Client, ids: list[str], concurrency: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: client.delete(f"/v1/sessions/{i}"), ids))
    return time.perf_counter() - t0


def round_trips(
    urls: tuple[str, str], token: str, action: dict[str, Any], count: int
) -> tuple[list[float], list[float]]:
    """Round trips over two sockets, alternating one on each (so load drift hits both)."""
    times: tuple[list[float], list[float]] = ([], [])
    headers = {"Authorization": f"Bearer {token}"}
    with (
        connect(urls[0], additional_headers=headers) as a,
        connect(urls[1], additional_headers=headers) as b,
    ):
        for i in range(count + 20):
            for k, ws in enumerate((a, b)):
                t0 = time.perf_counter()
                ws.send(json.dumps({"id": i, **action}))
                reply = json.loads(ws.recv())
                if not reply.get("ok"):
                    raise SystemExit(f"action failed: {reply}")
                if i >= 20:  # warm-up
                    times[k].append((time.perf_counter() - t0) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,100,500")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rtt-count", type=int, default=500)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    slots = -(-max(sizes) // args.nodes) + 5
    print(f"load before start: {load()}")
    t0 = time.perf_counter()
    with LocalCluster() as cluster:
        for i in range(args.nodes):
            capacity = node_capacity(
                name=f"sim{i}", host_memory_mib=1024 * 1024, host_cpus=64, accel="tcg",
                backend="fake", images=[IMAGE], slots=slots,
            )  # fmt: skip
            # The per-session action rate limit (50/s) would throttle the round trips.
            node_settings = Settings(
                state_dir=cluster.root / "nodes" / capacity.name,
                capture_fps=0,
                max_actions_per_s=100_000,
            )
            cluster.add_node(capacity, settings=node_settings, fake_images=(IMAGE,))
        print(f"cluster of {args.nodes} nodes up in {time.perf_counter() - t0:.1f} s")
        settings = Settings(default_image=IMAGE, capture_fps=0)
        app = create_cluster_app(cluster.bridge(settings, placement_timeout_s=10.0))
        token = cluster.credentials["admin_token"]
        headers = {"Authorization": f"Bearer {token}"}
        control_pids = set(cluster._pids) | {ray.get(cluster.registry.pid.remote())}
        import os

        control_pids.add(os.getpid())
        agent_pids = {ray.get(n.agent.pid.remote()) for n in cluster.nodes.values()}
        from ray.util.placement_group import placement_group, remove_placement_group

        placing = []
        for _ in range(100):
            t1 = time.perf_counter()
            group = placement_group(
                [{"deskvm_desktop": 1.0, "deskvm_memory_mib": 1024.0}],
                strategy="STRICT_PACK",
                lifetime="detached",
                bundle_label_selector=[{f"image.deskvm.io/{IMAGE}": "yes"}],
            )
            assert group.wait(10)
            placing.append((time.perf_counter() - t1) * 1000)
            remove_placement_group(group)
            time.sleep(0.05)  # let the node's resources come back
        print(
            f"\n0. Ray placement of one session (placement group create + wait, 100 times):"
            f" p50 {statistics.median(placing):.1f} ms, p95 {pct(placing, 0.95):.1f} ms"
        )
        with (
            BackgroundServer(app, host=cluster.ip) as server,
            httpx.Client(base_url=server.url, headers=headers, timeout=120) as client,
        ):
            print(f"\n1. place and create N sessions ({args.concurrency} clients, load {load()})")
            print(
                f"{'N':>5} {'wall s':>8} {'per s':>7} {'p50 ms':>8} {'p95 ms':>8} {'delete s':>9}"
            )
            memory: dict[str, float] = {}
            for n in sizes:
                before_control = sum(rss_mib(p) for p in control_pids)
                before_agents = sum(rss_mib(p) for p in agent_pids)
                wall, latencies, ids = create_many(client, n, args.concurrency)
                if n == max(sizes):
                    time.sleep(2)
                    memory = {
                        "control_before": before_control,
                        "control_after": sum(rss_mib(p) for p in control_pids),
                        "agents_before": before_agents,
                        "agents_after": sum(rss_mib(p) for p in agent_pids),
                    }
                    sample = ids[0]
                deleted = delete_many(client, ids if n != max(sizes) else ids[1:], args.concurrency)
                print(
                    f"{n:>5} {wall:>8.2f} {n / wall:>7.1f} {pct(latencies, 0.5) * 1000:>8.1f}"
                    f" {pct(latencies, 0.95) * 1000:>8.1f} {deleted:>9.2f}"
                )
            record = ray.get(cluster.registry.lookup.remote(sample))
            node_url = record["url"]
            via_bridge = server.url.replace("http", "ws") + f"/v1/sessions/{sample}/ws"
            direct = node_url.replace("http", "ws") + f"/v1/sessions/{sample}/ws"
            print(f"\n2. action round trip, ms ({args.rtt_count} each, load {load()})")
            print(f"{'action':<16} {'direct p50':>10} {'bridge p50':>10} {'added p50':>9}"
                  f" {'direct p95':>10} {'bridge p95':>10}")  # fmt: skip
            for action in ({"action": "cursor_position"}, {"action": "move", "x": 10, "y": 10}):
                d, b = round_trips((direct, via_bridge), token, action, args.rtt_count)
                print(
                    f"{action['action']:<16} {statistics.median(d):>10.2f}"
                    f" {statistics.median(b):>10.2f}"
                    f" {statistics.median(b) - statistics.median(d):>9.2f}"
                    f" {pct(d, 0.95):>10.2f} {pct(b, 0.95):>10.2f}"
                )
            client.delete(f"/v1/sessions/{sample}")
            n = max(sizes)
            print(f"\n3. memory with {n} sessions open (VmRSS, MiB; load {load()})")
            print(f"{'part':<44} {'before':>8} {'with N':>8} {'per session':>12}")
            for label, key in (
                ("control plane (GCS, raylets, registry, bridge)", "control"),
                ("node agents (session managers, fake sessions)", "agents"),
            ):
                before, after = memory[f"{key}_before"], memory[f"{key}_after"]
                per_kib = (after - before) / n * 1024
                print(f"{label:<44} {before:>8.0f} {after:>8.0f} {per_kib:>9.0f} KiB")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load after: {load()}")


if __name__ == "__main__":
    run_main(main)
