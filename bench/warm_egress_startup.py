"""Warm vs. cold start of sessions with an egress policy (real VMs, needs root).

    flock /run/deskvm-vm.lock flock /run/deskvm-net.lock \\
        .venv/bin/python bench/warm_egress_startup.py [--warm 5] [--cold 3]

One manager with a warm pool of the default image's egress target (``IMAGE:egress``):
the template boots with a NIC on a deny-all network of its own and is saved. Then WARM
sessions with a policy are created one after the other (each restores the saved desktop
onto its own network; create returns once the desktop is drawn and the guest holds the
session's DHCP lease), each deleted before the next; then the pool is closed and COLD
sessions with the same policy boot cold. The upstream is the egress test world's
namespace (never the real uplink). Prints each create time and its phases, and the p50s.
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
    args = parser.parse_args()
    base = Settings.from_env()
    settings = base.replace(warm_pool=f"{base.default_image}:egress", capture_fps=0)
    world = World()
    warm: list[float] = []
    cold: list[float] = []
    fell_back = 0
    errors: list[str] = []
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
        for i in range(args.warm):
            took, kind, phases = _create(manager, settings.default_image)
            if kind != "warm":
                fell_back += 1
            else:
                warm.append(took)
            print(f"warm {i + 1}: create {took:.2f} s ({kind}) {phases}", flush=True)
        manager.close_pool()
        for i in range(args.cold):
            took, kind, phases = _create(manager, settings.default_image)
            cold.append(took)
            print(f"cold {i + 1}: create {took:.2f} s ({kind}) {phases}", flush=True)
        manager.hypervisor.close()  # type: ignore[attr-defined]
    finally:
        errors = world.close()
    if warm:
        print(f"warm egress start p50 {statistics.median(warm):.2f} s over {len(warm)}: {warm}")
    print(f"warm claims that fell back to cold: {fell_back} of {args.warm}")
    if cold:
        print(f"cold egress start p50 {statistics.median(cold):.2f} s over {len(cold)}: {cold}")
    if warm and cold:
        print(f"cold/warm p50 ratio: {statistics.median(cold) / statistics.median(warm):.1f}")
    left = leftovers()
    print(f"teardown errors: {errors or 'none'}; leftovers: {left or 'none'}")
    return 0 if not errors and not left and not fell_back else 1


if __name__ == "__main__":
    raise SystemExit(main())
