#!/usr/bin/env python3
"""Walking-skeleton figures on this host, through the real bridge (REST + WebSocket).

Prints:
  * cold start: POST /v1/sessions until 201 (the desktop is drawn), seconds, N boots;
  * screenshot latency through the bridge: p50/p95 over 50 WebSocket round trips;
  * typing: characters per second with zero loss (text typed into the xterm, sent by the
    guest to its log port, compared byte for byte).

Run as root on a host set up by `deskvm doctor --fix` with the default image built:
    .venv/bin/python bench/walking_skeleton.py [--boots 2] [--shots 50] [--chars 400]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import string
import time

from agent_bridge.client import Client
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.interrupt import run_main
from orchestrator.settings import Settings


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--boots", type=int, default=2, help="cold starts to time")
    parser.add_argument("--shots", type=int, default=50, help="screenshots to time")
    parser.add_argument("--chars", type=int, default=400, help="characters to type")
    args = parser.parse_args()

    settings = Settings.from_env()
    manager = build_manager(settings)
    token = secrets.token_urlsafe(16)
    print(f"host acceleration: {manager.hypervisor.accel}")
    with (
        BackgroundServer(create_app(manager, token=token, settings=settings)) as server,
        Client(server.url, token) as client,
    ):
        boots = []
        for i in range(args.boots):
            t0 = time.perf_counter()
            session = client.create_session(width=1280, height=800)
            boots.append(time.perf_counter() - t0)
            print(f"  boot {i + 1}: {boots[-1]:.1f} s to first ready frame")
            if i < args.boots - 1:
                session.delete()
        print(
            "cold start to first ready frame: "
            f"median {statistics.median(boots):.1f} s over {len(boots)}"
        )

        with session:
            session.screenshot()  # warm the connection
            latencies = []
            for _ in range(args.shots):
                t0 = time.perf_counter()
                shot = session.screenshot()
                latencies.append((time.perf_counter() - t0) * 1000)
            print(
                f"screenshot via bridge ({shot.width}x{shot.height} PNG, "
                f"{len(shot.png) // 1024} KiB): p50 {percentile(latencies, 0.5):.0f} ms, "
                f"p95 {percentile(latencies, 0.95):.0f} ms "
                f"over {len(latencies)}"
            )

            alphabet = (
                string.ascii_letters + string.digits + string.punctuation.replace("'", "") + " "
            )
            rng = secrets.SystemRandom()
            text = "".join(rng.choice(alphabet) for _ in range(args.chars))
            session.click(300, 200)
            session.type("cat > /dev/ttyS1 <<'EOF'\n")
            t0 = time.perf_counter()
            session.type(text)
            elapsed = time.perf_counter() - t0
            session.type("\nEOF\n")
            deadline = time.monotonic() + 60
            lines: list[str] = []
            while time.monotonic() < deadline:
                lines = [line.rstrip("\r") for line in session.guest_log().splitlines()]
                if text in lines:
                    break
                time.sleep(0.3)
            lost = text not in lines
            print(
                f"typing: {len(text) / elapsed:.1f} chars/s over {len(text)} characters, "
                + ("ZERO loss (exact match on the guest log)" if not lost else "MISMATCH")
            )


if __name__ == "__main__":
    run_main(main)
