"""Measure NftEgress.attach() + detach() wall time (needs root).

    python3 bench/egress_startup.py [ROUNDS]

Uses the test world's upstream veth (never the real uplink). Prints per-round figures
and the median; the first attach also creates the shared table and switches forwarding on.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "egress")]

from egress_world import POLICY, World, leftovers  # noqa: E402

from orchestrator.interrupt import run_main  # noqa: E402
from orchestrator.spec import new_session_id  # noqa: E402


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    world = World()
    attach_ms: list[float] = []
    detach_ms: list[float] = []
    try:
        world.open()
        for _ in range(rounds):
            sid = new_session_id()
            t0 = time.perf_counter()
            world.egress.attach(sid, POLICY)
            t1 = time.perf_counter()
            world.egress.detach(sid)
            t2 = time.perf_counter()
            attach_ms.append((t1 - t0) * 1000)
            detach_ms.append((t2 - t1) * 1000)
        # the usual case on a busy server: another session keeps the shared table alive
        keeper = new_session_id()
        world.egress.attach(keeper, POLICY)
        warm_attach: list[float] = []
        warm_detach: list[float] = []
        for _ in range(rounds):
            sid = new_session_id()
            t0 = time.perf_counter()
            world.egress.attach(sid, POLICY)
            t1 = time.perf_counter()
            world.egress.detach(sid)
            t2 = time.perf_counter()
            warm_attach.append((t1 - t0) * 1000)
            warm_detach.append((t2 - t1) * 1000)
        world.egress.detach(keeper)
    finally:
        errors = world.close()

    def show(label: str, values: list[float]) -> None:
        figures = ", ".join(f"{x:.0f}" for x in values)
        print(f"  {label} ms: {figures}  median {statistics.median(values):.0f}")

    print(f"first session on the host ({rounds} rounds):")
    show("attach", attach_ms)
    show("detach", detach_ms)
    print(f"with another session alive ({rounds} rounds):")
    show("attach", warm_attach)
    show("detach", warm_detach)
    left = leftovers()
    print(f"teardown errors: {errors or 'none'}; leftovers: {left or 'none'}")
    return 0 if not errors and not left else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
