"""Warm vs. cold start of sessions with an egress policy (real VMs, needs root).

    flock /run/deskvm-vm.lock flock /run/deskvm-net.lock \\
        .venv/bin/python bench/warm_egress_startup.py [--warm 5] [--cold 3] \\
        [--link-down-s 1.2 0.3]

One manager with a warm pool of the default image's egress target (``IMAGE:egress``):
the template boots with a NIC on a deny-all network of its own and is saved. Then WARM
sessions with a policy are created one after the other (each restores the saved desktop
onto its own network; create returns once the desktop is drawn and the guest holds the
session's DHCP lease), each deleted before the next; then the pool is closed and COLD
sessions with the same policy boot cold. The upstream is the egress test world's
namespace (never the real uplink). Prints each create time and its phases, and the p50s.

``--link-down-s S [S ...]``: WARM warm starts for each value of
``orchestrator.session.WARM_LINK_DOWN_S`` (how long the restored guest's link stays down
at first; default: the code's): the figures per value, and how many starts needed the
second, longer link-down (``relink_s`` among their phases: the guest missed the first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "egress")]

from egress_world import World, leftovers  # noqa: E402

from agent_bridge.runtime import build_manager  # noqa: E402
from orchestrator import session as session_module  # noqa: E402
from orchestrator.interrupt import run_main  # noqa: E402
from orchestrator.settings import Settings  # noqa: E402
from orchestrator.spec import DisplaySpec, EgressPolicy  # noqa: E402

POLICY = EgressPolicy(allow=("allowed.test", "198.51.100.7/32:443"))


def _create(manager: object, image: str) -> tuple[float, str, dict[str, float]]:
    t0 = time.monotonic()
    session = manager.create(image=image, display=DisplaySpec(1280, 800), egress=POLICY)  # type: ignore[attr-defined]
    took = time.monotonic() - t0
    kind, phases = str(session.start_kind), dict(session.start_phases_s)
    manager.delete(session.id)  # type: ignore[attr-defined]
    return took, kind, phases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--warm", type=int, default=5, help="warm starts to time")
    parser.add_argument("--cold", type=int, default=3, help="cold starts to time")
    parser.add_argument(
        "--link-down-s",
        type=float,
        nargs="+",
        default=[session_module.WARM_LINK_DOWN_S],
        help="first link-down times to time WARM starts with, seconds",
    )
    args = parser.parse_args()
    base = Settings.from_env()
    settings = base.replace(warm_pool=f"{base.default_image}:egress", capture_fps=0)
    world = World()
    warm: dict[float, list[float]] = {down_s: [] for down_s in args.link_down_s}
    relinks: dict[float, int] = dict.fromkeys(args.link_down_s, 0)
    cold: list[float] = []
    fell_back = 0
    errors: list[str] = []
    manager = None
    try:
        world.open()
        manager = build_manager(settings, egress=world.egress)
        assert manager.pool is not None
        manager.start_pool()
        t0 = time.monotonic()
        if not manager.pool.wait_full(400):
            print(f"the pool did not fill: {manager.pool.status()}")
            return 1
        (status,) = manager.pool.status()
        print(
            f"pool ready after {time.monotonic() - t0:.1f} s: template boot "
            f"{status['template_boot_s']:.1f} s (with its DHCP lease), "
            f"save {status['save_s']:.1f} s",
            flush=True,
        )
        for down_s in args.link_down_s:
            session_module.WARM_LINK_DOWN_S = down_s
            for i in range(args.warm):
                took, kind, phases = _create(manager, settings.default_image)
                if kind != "warm":
                    fell_back += 1
                else:
                    warm[down_s].append(took)
                relinks[down_s] += "relink_s" in phases
                print(f"warm {i + 1} (link down {down_s:g} s): create {took:.2f} s ({kind}) "
                      f"{phases}", flush=True)  # fmt: skip
        manager.close_pool()
        for i in range(args.cold):
            took, kind, phases = _create(manager, settings.default_image)
            cold.append(took)
            print(f"cold {i + 1}: create {took:.2f} s ({kind}) {phases}", flush=True)
    finally:
        if manager is not None:  # also when stopped by a signal (run_main) mid-run
            errors = manager.close_all(reason="bench ended")
            manager.close_pool()
            manager.hypervisor.close()  # type: ignore[attr-defined]
        errors += world.close()
    for down_s, times in warm.items():
        if times:
            print(
                f"warm egress start (link down {down_s:g} s) p50 {statistics.median(times):.2f}"
                f" s over {len(times)} (min {min(times):.2f}, max {max(times):.2f}), "
                f"second link-down needed: {relinks[down_s]}: {[round(t, 2) for t in times]}"
            )
    print(f"warm claims that fell back to cold: {fell_back} of {args.warm * len(warm)}")
    if cold:
        print(f"cold egress start p50 {statistics.median(cold):.2f} s over {len(cold)}: {cold}")
    last = warm[args.link_down_s[-1]]
    if last and cold:
        print(f"cold/warm p50 ratio: {statistics.median(cold) / statistics.median(last):.1f}")
    left = leftovers()
    print(f"teardown errors: {errors or 'none'}; leftovers: {left or 'none'}")
    return 0 if not errors and not left and not fell_back else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
