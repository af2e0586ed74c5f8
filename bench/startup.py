#!/usr/bin/env python3
"""Cold and warm session starts, resets, and pool memory, through the real bridge.

Prints, in one run against one in-process server with a warm pool of the default image:

  * cold start: ``POST /v1/sessions`` until the first screenshot arrives at the client
    ("first ready frame at the client"), for sessions that must boot (1280x768: no pool
    desktop matches); p50/p95;
  * warm start: the same for 1280x800 sessions handed a pool desktop, one after the other
    while the pool refills (each session takes a screenshot and is deleted); p50/p95,
    the slowest, and the cold/warm ratio of the p50s;
  * warm claims in a row while the pool refills: none may fall back to cold or take more
    than 3 s (printed: how many did, a fallback counted as slower than 3 s). A fallback is
    either "pool empty" (nothing ready and no restore under way: the pool logs it) or a
    failed hand-over (the claimed desktop could not be resumed: the pool logs why); claims
    that found the pool empty and waited for the restore under way are counted apart
    (the pool's counters, ``GET /healthz``);
  * reset: ``POST /v1/sessions/{id}/reset`` of one warm session until its next screenshot,
    p50/p95, and the server's phases (restore, clock, first frame) of the median reset.
    Between resets the bench waits ``--reset-gap-s`` (a harness's task between resets;
    default 2 s), in which the pool restores the session's next *spare* (its start state,
    restored ahead, paused: the reset runs it instead of restoring); ``0``: resets back to
    back (each waits for the spare's restore under way). Printed: how many resets ran a
    spare;
  * a pooled idle desktop: the QEMU process's resident set (libvirt's ``rss``), its hard
    limit, how many fit in 24 GiB by each, and the CPU it uses while waiting (paused).

Run as root on a host set up by `deskvm doctor --fix` with the default image built, under
the VM lock:
    flock /run/deskvm-vm.lock .venv/bin/python bench/startup.py [--cold 20] [--warm 20]
        [--resets 20] [--pool 3] [--reset-gap-s 2]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import time
from typing import Any

import libvirt

from agent_bridge.client import Client
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.hypervisor.domain_xml import domain_name
from orchestrator.interrupt import run_main
from orchestrator.settings import Settings

GIB_24_MIB = 24 * 1024


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(values: list[float]) -> str:
    if not values:
        return "n=0"
    return (
        f"n={len(values)} p50 {pct(values, 0.5):.2f} s  p95 {pct(values, 0.95):.2f} s  "
        f"min {min(values):.2f} s  max {max(values):.2f} s"
    )


def start_once(client: Client, width: int, height: int) -> tuple[float, float, dict[str, Any]]:
    """Create a session, take one screenshot, delete it.

    Returns:
        (seconds to the create's answer, seconds to the first screenshot, session info).
    """
    t0 = time.monotonic()
    session = client.create_session(width=width, height=height)
    t_created = time.monotonic() - t0
    try:
        session.screenshot()
        t_frame = time.monotonic() - t0
        info = dict(session.info())
    finally:
        client.delete_session(session.id)
    return t_created, t_frame, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", type=int, default=20, help="cold starts to time")
    parser.add_argument("--warm", type=int, default=20, help="warm starts to time")
    parser.add_argument("--resets", type=int, default=20, help="resets to time")
    parser.add_argument("--pool", type=int, default=3, help="warm pool size")
    parser.add_argument(
        "--reset-gap-s",
        type=float,
        default=2.0,
        help="seconds between a reset's screenshot and the next reset (a task; 0: none)",
    )
    args = parser.parse_args()

    base = Settings.from_env()
    settings = base.replace(
        state_dir=base.state_dir / f"bench-startup-{secrets.token_hex(3)}",
        images_dir_override=base.images_dir,
        warm_pool=f"{base.default_image}:{args.pool}",
        max_sessions=4,
    )
    settings.state_dir.mkdir(mode=0o711, parents=True)
    if base.host_file.is_file():
        (settings.state_dir / "host.json").write_bytes(base.host_file.read_bytes())
    try:
        run(args, settings)
    finally:
        shutil.rmtree(settings.state_dir, ignore_errors=True)


def run(args: argparse.Namespace, settings: Settings) -> None:
    token = secrets.token_urlsafe(16)
    manager = build_manager(settings, server_name="bench-startup")
    conn = libvirt.open("qemu:///system")
    pool = ",".join(f"{t.image}:{t.size}" for t in settings.warm_pool)
    print(f"load {os.getloadavg()[0]:.2f}; pool {pool}")
    with (
        BackgroundServer(create_app(manager, token=token, settings=settings)) as server,
        Client(server.url, token) as client,
    ):
        assert manager.pool is not None
        t0 = time.monotonic()
        if not manager.pool.wait_full(600):
            raise SystemExit(f"the pool did not fill: {manager.pool.status()}")
        (status,) = manager.pool.status()
        print(
            f"pool full after {time.monotonic() - t0:.1f} s: template boot "
            f"{status['template_boot_s']:.1f} s, save {status['save_s']:.1f} s, restores "
            f"{status['restore_s']} s"
        )

        rss_kib = []
        pooled = manager.pool.ids()
        domains = [conn.lookupByName(domain_name(sid)) for sid in pooled]
        for dom in domains:
            rss_kib.append(dom.memoryStats().get("rss", 0))
        hard_mib = manager.pool.memory_mib() // len(pooled)
        paused = [dom for dom in domains if dom.info()[0] == libvirt.VIR_DOMAIN_PAUSED]
        running = [dom for dom in domains if dom not in paused]
        cpu0 = {dom.name(): dom.info()[4] for dom in domains}
        t_cpu = time.monotonic()
        time.sleep(10)
        span_s = time.monotonic() - t_cpu

        def cpu_pct(group: list[Any]) -> float:
            used = sum(dom.info()[4] - cpu0[dom.name()] for dom in group)
            return used / 1e9 / span_s * 100 / max(1, len(group))

        running_pct, paused_pct = cpu_pct(running), cpu_pct(paused)

        cold_created, cold_frame = [], []
        for _ in range(args.cold):
            created, frame, info = start_once(client, 1280, 768)
            assert info["start"] == "cold", info
            cold_created.append(created)
            cold_frame.append(frame)

        warm_created, warm_frame, fell_back = [], [], 0
        warm_phases: list[dict[str, float]] = []
        (before,) = manager.pool.status()
        for _ in range(args.warm):
            created, frame, info = start_once(client, 1280, 800)
            if info["start"] != "warm":
                fell_back += 1
                continue
            warm_created.append(created)
            warm_frame.append(frame)
            warm_phases.append(dict(info["start_phases_s"]))
        (after,) = manager.pool.status()
        counts = {
            k: after[k] - before[k]
            for k in ("claims", "waited_claims", "empty_claims", "handover_failures")
        }

        reset_s: list[float] = []
        spare_resets = 0
        reset_phases: list[tuple[float, dict[str, float]]] = []
        if args.resets:
            if not manager.pool.wait_full(120):
                raise SystemExit("the pool did not refill for the reset run")
            session = client.create_session(width=1280, height=800)
            (before_resets,) = manager.pool.status()
            try:
                assert session.info()["start"] == "warm"
                for _ in range(args.resets):
                    time.sleep(args.reset_gap_s)
                    t = time.monotonic()
                    session.reset()
                    session.screenshot()
                    reset_s.append(time.monotonic() - t)
                    live = manager.get(session.id)
                    reset_phases.append((live.last_reset_s or 0.0, dict(live.reset_phases_s)))
            finally:
                client.delete_session(session.id)
            (after_resets,) = manager.pool.status()
            spare_resets = after_resets["spare_resets"] - before_resets["spare_resets"]
    conn.close()
    load_end = os.getloadavg()

    print("load at the end (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in load_end))
    print(f"cold start, create answered:    {summary(cold_created)}")
    print(f"cold start, first frame:        {summary(cold_frame)}")
    print(f"warm start, create answered:    {summary(warm_created)}")
    print(f"warm start, first frame:        {summary(warm_frame)}")
    if args.warm:
        for phase in ("claim_s", "clock_s", "ready_s"):
            values = [p[phase] for p in warm_phases if phase in p]
            print(f"warm start, server {phase + ':':8}     {summary(values)}")
        print(
            f"warm claims that fell back to cold: {fell_back} of {args.warm} (pool empty: "
            f"{counts['empty_claims']}, hand-over failed: {counts['handover_failures']})"
        )
        print(
            f"warm claims that found the pool empty and waited for the restore under way: "
            f"{counts['waited_claims']} of {args.warm}"
        )
        slow = sum(t > 3.0 for t in warm_frame) + fell_back
        print(
            f"warm claims slower than 3 s to the first frame, fallbacks included: {slow} of "
            f"{args.warm} (target: 0)"
        )
    if cold_frame and warm_frame:
        ratio = statistics.median(cold_frame) / statistics.median(warm_frame)
        print(f"cold/warm ratio (p50 first frame): {ratio:.1f}x")
    print(f"reset + first frame:            {summary(reset_s)}")
    if args.resets:
        print(
            f"resets that ran a spare restored ahead: {spare_resets} of {args.resets} "
            f"({args.reset_gap_s:g} s between resets)"
        )
    if reset_phases:
        server_s, phases = sorted(reset_phases, key=lambda p: p[0])[len(reset_phases) // 2]
        print(f"median reset on the server: {server_s:.2f} s, phases {phases}")
    if rss_kib:
        rss_mib = statistics.median(rss_kib) / 1024
        print(
            f"pooled idle desktop: rss {rss_mib:.0f} MiB (median of {len(rss_kib)}), hard limit "
            f"{hard_mib} MiB; in 24 GiB: {int(GIB_24_MIB // rss_mib)} by rss, "
            f"{GIB_24_MIB // hard_mib} by hard limit"
        )
        print(
            f"pooled idle desktops (10 s): {len(running)} running (the next to be claimed), "
            f"{running_pct:.2f} % of a core each; {len(paused)} paused, {paused_pct:.2f} % each"
        )


if __name__ == "__main__":
    run_main(main)
