#!/usr/bin/env python3
"""Guest control round trips on a real VM, through the real bridge (WebSocket client).

Prints, for one session of the default image created with ``guest_control=True``, the
median and p90 wall time (client side) of: ``exec ["true"]``, ``exec`` of a command
printing 1 MiB, ``put_file``/``get_file`` of 512 KiB and 5 MiB (get only), ``clipboard_set``
(two xclip runs plus a read-back), ``clipboard_get``, ``windows``, ``a11y_tree`` of the
desktop (only the xterm: no accessible application) and one ``set_resolution`` there and
back.

Run as root on a host set up by `deskvm doctor --fix` with the default image built, under
the VM lock:
    flock /run/deskvm-vm.lock .venv/bin/python bench/guest_control.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

from agent_bridge.client import Client, Session
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.interrupt import run_main
from orchestrator.settings import Settings


def timed(label: str, rounds: int, call: Callable[[], Any]) -> None:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1000)
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    print(f"{label:34s} median {statistics.median(times):8.1f} ms   p90 {p90:8.1f} ms   n={rounds}")


def run(session: Session, rounds: int) -> None:
    half_mib = os.urandom(512 * 1024)
    session.exec(["sh", "-c", "head -c 5242880 /dev/urandom > /tmp/five.bin"])
    timed("exec true", rounds, lambda: session.exec(["true"]))
    timed(
        "exec printing 1 MiB",
        rounds,
        lambda: session.exec(["head", "-c", "1048576", "/tmp/five.bin"]),
    )
    timed("put_file 512 KiB", rounds, lambda: session.put_file("/tmp/half.bin", half_mib))
    timed("get_file 512 KiB", rounds, lambda: session.get_file("/tmp/half.bin"))
    timed("get_file 5 MiB", max(1, rounds // 2), lambda: session.get_file("/tmp/five.bin"))
    timed("clipboard_set", rounds, lambda: session.clipboard_set("bench ✓"))
    timed("clipboard_get", rounds, session.clipboard_get)
    timed("windows", rounds, session.windows)
    timed("a11y_tree (desktop)", max(1, rounds // 2), session.a11y_tree)
    t0 = time.perf_counter()
    session.set_resolution(1024, 768)
    session.set_resolution(1280, 800)
    print(f"{'set_resolution there and back':34s} {(time.perf_counter() - t0) * 1000:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    settings = Settings.from_env()
    manager = build_manager(settings)
    token = secrets.token_urlsafe(16)
    app = create_app(manager, token=token, settings=settings)
    with (
        BackgroundServer(app) as server,
        Client(server.url, token, timeout_s=120) as client,
        client.create_session(guest_control=True) as session,
    ):
        run(session, args.rounds)


if __name__ == "__main__":
    run_main(main)
