"""Build the egress test world, run every bypass attempt, print the table (needs root).

    python3 bench/egress_bypass_table.py

Traffic stays on loopback and in the namespaces the world creates; everything is removed
at the end, also on failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "egress")]

from egress_world import World, leftovers, print_table, run_bypass_table  # noqa: E402

from orchestrator.interrupt import run_main  # noqa: E402


def main() -> int:
    world = World()
    try:
        world.open()
        world.attach()
        rows = run_bypass_table(world)
        print(print_table(rows))
        decisions = world.egress.decisions(world.session_id)
        print(f"\n{len(decisions)} decisions recorded:")
        for kind in ("dns_answered", "dns_refused", "conn_allowed", "conn_dropped"):
            print(f"  {kind}: {sum(1 for d in decisions if d.kind == kind)}")
    finally:
        errors = world.close()
    left = leftovers()
    print(f"\nteardown errors: {errors or 'none'}; leftovers: {left or 'none'}")
    return 0 if all(r.passed for r in rows) and not errors and not left else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
