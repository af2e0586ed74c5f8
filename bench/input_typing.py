#!/usr/bin/env python3
"""Typing throughput with zero loss on a real VM, measured by the guest's input probe.

Boots one session with ``autostart="input-probe"`` and types printable ASCII into the
probe's text field over the bridge (deskvm vocabulary), ``--rounds`` times ``--chars``
characters. A round counts only if the probe then reports exactly the text typed (nothing
dropped, doubled or reordered). Prints, per round and overall: characters, seconds to
inject them (the ``type`` request, paced), characters per second, seconds until the probe
reported the whole text, exact or not.

``--non-us`` types accented, Cyrillic, Greek, CJK and ASCII characters mixed
(``input_check.NON_US_ALPHABET``): every such text goes whole through the in-guest helper
(XTEST over virtio-serial), so this measures that path instead of QEMU's keyboard.

Keys are paced by the guest's virtio keyboard queue (key flow control, see
``orchestrator.display.qmp``) with ``Pacing.key_flow_s`` after each transition;
``--key-flow-ms`` changes that pause. ``--no-flow-control`` turns flow control off, so keys
are paced by time alone (``Pacing.key_s``, set with ``--key-ms``), to compare. The
bridge's typed-characters rate limit is raised for the run so it measures the input path,
not the limiter.

Each batch of keys also waits until the guest X server has processed all but
``KEY_ACK_WINDOW`` of the action's keys (the guest helper's count, see
``orchestrator.display.key_pacing``); ``--no-key-acks`` turns that off to compare.

``--guest-hogs N`` loads the guest instead: N spinning shells of the desktop user, started
through guest control before the rounds (each ends by itself after ``--hog-max-s``). That
is the load that made the guest kernel drop keys before they were paced by the X server.

``--hogs N`` loads the host while the rounds run: N ordinary processes (nice 0, never a
real-time priority) that spin on the CPU, each ending by itself after ``--hog-max-s``
seconds at the latest and stopped when the rounds end. The 1-minute load average is
printed after each round.

Run as root on a host set up by `deskvm doctor --fix` with the default image built:
    python3 bench/input_typing.py [--chars 1000] [--rounds 3] [--hogs 4] [--guest-hogs 6]
        [--non-us]
        [--key-flow-ms 0] [--no-flow-control --key-ms 12] [--no-key-acks]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager

from agent_bridge.client import Client
from agent_bridge.input_check import ASCII_ALPHABET, NON_US_ALPHABET, measure_typing
from agent_bridge.runtime import BackgroundServer, HostAccelVerdict, resolve_accel
from agent_bridge.server import create_app
from orchestrator.display.key_pacing import KeyPacer
from orchestrator.display.qmp import QmpDisplay
from orchestrator.hypervisor.libvirt import LibvirtHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.interrupt import run_main
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from vm_images import find_image


def _spin(deadline: float) -> None:
    """Burn CPU until ``deadline`` (``time.monotonic()``); an ordinary-priority hog."""
    x = 0
    while time.monotonic() < deadline:
        for _ in range(10_000):
            x += 1


@contextmanager
def cpu_hogs(count: int, max_s: float) -> Iterator[None]:
    """``count`` CPU-spinning processes for the duration of the block (at most ``max_s``)."""
    deadline = time.monotonic() + max_s
    hogs = [multiprocessing.Process(target=_spin, args=(deadline,), daemon=True)
            for _ in range(count)]  # fmt: skip
    for hog in hogs:
        hog.start()
    try:
        yield
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chars", type=int, default=400, help="characters per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds to time")
    parser.add_argument(
        "--key-ms", type=float, default=None, help="pause after each key transition, ms"
    )
    parser.add_argument(
        "--key-flow-ms", type=float, default=None,
        help="pause after each key transition with key flow control, ms",
    )  # fmt: skip
    parser.add_argument(
        "--no-flow-control", action="store_true",
        help="pace keys by time only (--key-ms), not by the guest's keyboard queue",
    )  # fmt: skip
    parser.add_argument(
        "--no-key-acks", action="store_true",
        help="do not wait for the guest X server's count of processed keys",
    )  # fmt: skip
    parser.add_argument(
        "--non-us", action="store_true", help="type non-US text (through the guest helper)"
    )
    parser.add_argument("--hogs", type=int, default=0, help="CPU hog processes during rounds")
    parser.add_argument(
        "--guest-hogs", type=int, default=0, help="CPU hog shells in the guest during rounds"
    )
    parser.add_argument(
        "--hog-max-s", type=float, default=1800.0, help="hogs end by themselves after this"
    )
    args = parser.parse_args()
    alphabet = NON_US_ALPHABET if args.non_us else ASCII_ALPHABET

    settings = dataclasses.replace(Settings.from_env(), max_typed_chars_per_s=100_000.0)
    pacing = Pacing()
    if args.key_ms is not None:
        pacing = dataclasses.replace(pacing, key_s=args.key_ms / 1000)
    if args.key_flow_ms is not None:
        pacing = dataclasses.replace(pacing, key_flow_s=args.key_flow_ms / 1000)
    if args.no_flow_control:
        QmpDisplay.key_flow_control = lambda self: False  # type: ignore[method-assign]
    if args.no_key_acks:
        KeyPacer.before = lambda self, keys, interrupt=None: None  # type: ignore[method-assign]
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
        pacing=pacing,
    )
    manager.reap()
    token = secrets.token_urlsafe(24)
    flow = "off" if args.no_flow_control else "on"
    key_pause_ms = (pacing.key_s if args.no_flow_control else pacing.key_flow_s) * 1000
    acks = "off" if args.no_key_acks else "on"
    print(f"key flow control {flow}; pause after each key transition {key_pause_ms:.1f} ms; "
          f"X server key acknowledgements {acks}")  # fmt: skip
    print(f"load: {args.hogs} CPU hog(s) during the rounds on {os.cpu_count()} CPUs")
    print("text: " + ("non-US, through the guest helper" if args.non_us else "ASCII, via QEMU"))
    with (
        BackgroundServer(create_app(manager, token=token, settings=settings)) as server,
        Client(server.url, token) as client,
    ):
        t0 = time.monotonic()
        session = client.create_session(
            autostart="input-probe", boot_timeout_s=180, guest_control=args.guest_hogs > 0
        )
        with session:
            print(f"probe session {session.id} ready in {time.monotonic() - t0:.1f} s")
            if args.guest_hogs:
                spin = f"timeout {args.hog_max_s:.0f} sh -c 'while :; do :; done'"
                start = f"for i in $(seq {args.guest_hogs}); do {spin} & done"
                detached = f"({start}) >/dev/null 2>&1 </dev/null &"
                session.exec(["setsid", "sh", "-c", detached], timeout_s=30)
                print(f"guest load: {args.guest_hogs} CPU hog shell(s) of the desktop user")
                time.sleep(2.0)
            rates, exact_all = [], True
            with cpu_hogs(args.hogs, args.hog_max_s):
                for i in range(args.rounds):
                    run = measure_typing(session, args.chars, alphabet=alphabet)
                    rates.append(run.chars_per_s)
                    exact_all &= run.exact
                    print(
                        f"round {i + 1}: {run.chars} chars injected in {run.sent_s:.2f} s "
                        f"({run.chars_per_s:.1f} chars/s), whole text reported by the probe "
                        f"after {run.seen_s:.2f} s, "
                        f"{'exact' if run.exact else 'LOSS or reordering'}; "
                        f"load average {os.getloadavg()[0]:.2f}"
                    )
                    if not run.exact:
                        print(f"  {run.detail}")
    verdict = "zero loss" if exact_all else "NOT exact"
    print(
        f"typing throughput: {min(rates):.1f}..{max(rates):.1f} chars/s "
        f"(median {sorted(rates)[len(rates) // 2]:.1f}), {verdict}, "
        f"{args.rounds} x {args.chars} {'non-US' if args.non_us else 'printable ASCII'} chars, "
        f"key flow control {flow}, key pause {key_pause_ms:.1f} ms, X key acks {acks}, "
        f"{args.hogs} CPU hog(s), {args.guest_hogs} in the guest"
    )


if __name__ == "__main__":
    run_main(main)
