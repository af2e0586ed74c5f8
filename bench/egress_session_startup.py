"""End-to-end session create time with vs. without an egress policy (real VMs, needs root).

    python3 bench/egress_session_startup.py [ROUNDS]

Alternates ``SessionManager.create`` (domain start until the desktop is drawn) without a
policy and with one, ROUNDS times each, one VM at a time. The upstream is the egress test
world's namespace (never the real uplink). Prints per-round create times, the attach time
the session recorded (its ``network`` "attached" event), the time until the guest holds
its DHCP lease, and the medians. Uses ``Settings.from_env()`` (state dir, images).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "egress")]

from egress_world import World, leftovers  # noqa: E402

from agent_bridge.runtime import build_manager  # noqa: E402
from orchestrator.interrupt import run_main  # noqa: E402
from orchestrator.settings import Settings  # noqa: E402
from orchestrator.spec import DisplaySpec, EgressPolicy  # noqa: E402

POLICY = EgressPolicy(allow=("allowed.test", "198.51.100.7/32:443"))


def _attach_s(recording: Path) -> float | None:
    for line in (recording / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "network" and event["data"].get("event") == "attached":
            return float(event["data"]["attach_s"])
    return None


def _lease_s(state_dir: Path, session_id: str, t0: float, timeout_s: float = 120) -> float:
    """Seconds from the start of create until dnsmasq acknowledged the guest's lease."""
    log = state_dir / session_id / "dnsmasq.log"
    while time.monotonic() - t0 < timeout_s:
        if log.exists() and "DHCPACK" in log.read_text():
            return time.monotonic() - t0
        time.sleep(0.2)
    return float("nan")


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    settings = Settings.from_env()
    world = World()
    plain: list[float] = []
    egress: list[float] = []
    attach: list[float] = []
    lease: list[float] = []
    errors: list[str] = []
    manager = None
    try:
        world.open()
        manager = build_manager(settings, egress=world.egress)
        display = DisplaySpec(1280, 800)
        for i in range(rounds):
            for policy in (None, POLICY):
                t0 = time.monotonic()
                session = manager.create(
                    image=settings.default_image, display=display, egress=policy
                )
                took = time.monotonic() - t0
                try:
                    if policy is None:
                        plain.append(took)
                        print(f"round {i + 1} no policy:   create {took:.1f} s", flush=True)
                    else:
                        egress.append(took)
                        path = session.recorder.path
                        a = _attach_s(path) if path is not None else None
                        if a is not None:
                            attach.append(a)
                        dhcp = _lease_s(world.settings.state_dir, session.id, t0)
                        lease.append(dhcp)
                        print(
                            f"round {i + 1} with policy: create {took:.1f} s "
                            f"(attach {a} s, DHCP lease at {dhcp:.1f} s)",
                            flush=True,
                        )
                finally:
                    manager.delete(session.id)
    finally:
        if manager is not None:  # a session a signal (run_main) left between create and try
            errors = manager.close_all(reason="bench ended")
        errors += world.close()
    print(f"median create without policy: {statistics.median(plain):.1f} s  ({plain})")
    print(f"median create with policy:    {statistics.median(egress):.1f} s  ({egress})")
    added = statistics.median(egress) - statistics.median(plain)
    print(f"difference of medians:        {added:+.1f} s")
    if attach:
        print(f"median attach (in create):    {statistics.median(attach) * 1000:.0f} ms")
    print(f"median DHCP lease after create start: {statistics.median(lease):.1f} s")
    left = leftovers()
    print(f"teardown errors: {errors or 'none'}; leftovers: {left or 'none'}")
    return 0 if not errors and not left else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
