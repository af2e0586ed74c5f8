#!/usr/bin/env python3
"""Input fidelity under host load on a real VM: rebound characters and multi-clicks.

Boots one session with ``autostart="input-probe"``, loads the host with ``--hogs`` ordinary
CPU-spinning processes (nice 0, never a real-time priority; each ends by itself after
``--hog-max-s`` seconds at the latest), and repeats two kinds of input whose result
depends on timing inside the guest:

- **rebind** (``--rebind-rounds``): two ``type`` actions of 100 distinct CJK characters
  each, new characters every round, so the in-guest helper binds spare keycodes and then
  rebinds them to other characters (the default image has 110). A round counts only if the
  probe's text field then holds exactly the 200 characters; a wrong one is printed with
  where it came from.
- **clicks** (``--click-rounds``): a ``double_click`` and a ``triple_click``, each after
  0.6 s of quiet; the probe (a Tk window: click count from X event times, 500 ms) must
  count 1, 2 and 1, 2, 3.

``--stall-ms N`` adds what a busier host does to a guest: the session's QEMU process is
stopped (SIGSTOP) for up to N ms at random moments, 0 to 300 ms apart, and always continued
(SIGCONT): a guest whose vCPUs the host does not schedule for a while.

Prints each failure, then one line per kind: failures / tries, with the load average.

Run as root on a host set up by `deskvm doctor --fix` with the default image built:
    python3 bench/input_load.py [--hogs 4] [--rebind-rounds 4] [--click-rounds 10]
        [--stall-ms 300]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agent_bridge.client import Client, Session
from agent_bridge.input_check import ProbeReader, has_text, presses, releases
from agent_bridge.runtime import BackgroundServer, HostAccelVerdict, resolve_accel
from agent_bridge.server import create_app
from orchestrator.hypervisor.domain_xml import domain_name
from orchestrator.hypervisor.libvirt import LibvirtHypervisor
from orchestrator.interrupt import run_main
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from vm_images import find_image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from input_typing import cpu_hogs

CJK_BASE = 0x4E00
DISTINCT_PER_ACTION = 100


def qemu_pid(session_id: str) -> int:
    """The pid of the QEMU process running the session's domain (``-name guest=NAME``)."""
    want = f"guest={domain_name(session_id)},".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if want in (entry / "cmdline").read_bytes():
                    return int(entry.name)
    raise RuntimeError(f"no QEMU process for session {session_id}")


@contextmanager
def stalls(pid: int, max_ms: float) -> Iterator[None]:
    """Stop ``pid`` for up to ``max_ms`` at random moments while the block runs."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(random.uniform(0.0, 0.3)):
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(random.uniform(0.0, max_ms / 1000))
            finally:
                os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    if max_ms > 0:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if max_ms > 0:
            thread.join()
            os.kill(pid, signal.SIGCONT)


def _cjk(round_index: int, part: int) -> str:
    """100 distinct CJK ideographs, different for every (round, part)."""
    base = CJK_BASE + (round_index * 2 + part) * DISTINCT_PER_ACTION * 3
    return "".join(chr(base + i * 3) for i in range(DISTINCT_PER_ACTION))


def rebind_round(probe: ProbeReader, session: Session, index: int) -> str | None:
    """Two helper ``type`` actions that rebind keycodes; ``None`` if exact, else what differs."""
    if not probe.clear_text():
        return "the text field did not clear"
    want = _cjk(index, 0) + _cjk(index, 1)
    since = probe.mark()
    session.type(want[:DISTINCT_PER_ACTION])
    session.type(want[DISTINCT_PER_ACTION:])
    events = probe.wait(since, lambda ev: has_text(ev, want), 90.0)
    values = [e["value"] for e in events if e.get("ev") == "text"]
    got = values[-1] if values else ""
    if got == want:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
              min(len(got), len(want)))  # fmt: skip
    if at >= len(got):
        return f"{len(got)} of {len(want)} characters arrived"
    earlier = want.find(got[at])
    origin = f"the character typed at index {earlier}" if earlier >= 0 else "not in the text"
    return (f"index {at}: want {want[at]!r} U+{ord(want[at]):04X}, got {got[at]!r} "
            f"U+{ord(got[at]):04X} ({origin})")  # fmt: skip


def click_round(probe: ProbeReader, session: Session, action: str, count: int) -> str | None:
    """One multi-click; ``None`` if the probe counted 1..count, else what it counted."""
    x, y = 540, 550
    session.move(x + 40, y + 40)
    time.sleep(0.6)  # no multi-click chain with an earlier click
    since = probe.mark()
    getattr(session, action)(x, y)
    events = probe.wait(since, lambda ev: len(releases(ev)) >= count, 20.0)
    counts = [p["count"] for p in presses(events)]
    if counts == list(range(1, count + 1)):
        return None
    times = [round(p["t_s"], 3) for p in presses(events)]
    return f"{action}: counts {counts}, press times {times}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hogs", type=int, default=4, help="CPU hog processes during rounds")
    parser.add_argument("--hog-max-s", type=float, default=900.0,
                        help="hogs end by themselves after this")  # fmt: skip
    parser.add_argument("--rebind-rounds", type=int, default=4)
    parser.add_argument("--click-rounds", type=int, default=10)
    parser.add_argument("--stall-ms", type=float, default=0.0,
                        help="stop the QEMU for up to this long at random moments")  # fmt: skip
    args = parser.parse_args()

    settings = dataclasses.replace(Settings.from_env(), max_typed_chars_per_s=100_000.0)
    manager = SessionManager(
        hypervisor=LibvirtHypervisor(
            settings.sessions_dir,
            accel=resolve_accel(settings),
            uri=settings.libvirt_uri,
            accel_verdict=HostAccelVerdict(settings.host_file, pinned=settings.accel == "kvm"),
        ),
        resolve_image=lambda name: find_image(name or settings.default_image, settings.images_dir),
        recordings_dir=settings.recordings_dir,
        max_sessions=settings.max_sessions,
        memory_overhead_mib=settings.memory_overhead_mib,
    )
    manager.reap()
    token = secrets.token_urlsafe(24)
    print(f"load: {args.hogs} CPU hog(s) on {os.cpu_count()} CPUs; "
          f"load average before {os.getloadavg()[0]:.2f}; QEMU stalls up to "
          f"{args.stall_ms:.0f} ms")  # fmt: skip
    results: dict[str, list[str | None]] = {"rebind": [], "double_click": [],
                                            "triple_click": []}  # fmt: skip
    with (
        BackgroundServer(create_app(manager, token=token, settings=settings)) as server,
        Client(server.url, token) as client,
    ):
        t0 = time.monotonic()
        session = client.create_session(autostart="input-probe", boot_timeout_s=240)
        with session:
            print(f"probe session {session.id} ready in {time.monotonic() - t0:.1f} s")
            probe = ProbeReader(session)
            pid = qemu_pid(session.id)
            with cpu_hogs(args.hogs, args.hog_max_s), stalls(pid, args.stall_ms):
                for i in range(args.click_rounds):
                    for action, count in (("double_click", 2), ("triple_click", 3)):
                        failure = click_round(probe, session, action, count)
                        results[action].append(failure)
                        if failure:
                            print(f"click round {i + 1}: {failure}")
                for i in range(args.rebind_rounds):
                    r0 = time.monotonic()
                    failure = rebind_round(probe, session, i)
                    results["rebind"].append(failure)
                    print(f"rebind round {i + 1}: {failure or 'exact'} "
                          f"({time.monotonic() - r0:.1f} s)")  # fmt: skip
                load = os.getloadavg()[0]
    for kind, outcomes in results.items():
        failed = sum(o is not None for o in outcomes)
        print(f"{kind}: {failed} failed of {len(outcomes)}, {args.hogs} CPU hog(s), QEMU "
              f"stalls up to {args.stall_ms:.0f} ms, load average {load:.2f}")  # fmt: skip


if __name__ == "__main__":
    run_main(main)
