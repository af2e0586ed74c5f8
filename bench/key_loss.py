#!/usr/bin/env python3
"""Keys lost inside a busy guest, with and without pacing by the guest X server's count.

Boots the default desktop (its xterm) with guest control, starts ``--guest-hogs`` spinning
shells of the desktop user (each ends by itself after ``--hog-max-s``), then types
``--lines`` shell lines back to back, each ``echo <marker> > /dev/ttyS1`` with a random
marker of ``--marker-chars`` hex digits, one ``type`` action per line. Prints, per run:

- lines whose marker reached the guest log whole;
- key events (presses and releases) sent through QEMU, and how many of them the guest X
  server processed (the guest helper's XInput2 count): a shortfall is keys the guest
  kernel dropped before the X server read them;
- seconds to type the lines.

``--no-key-acks`` turns the pacing by the X server's count off (keys are then paced only by
the guest's virtio keyboard queue, as before it existed); the count is still read.
The count is ``-1`` when the guest helper reported none.
``--runs`` boots a fresh session per run.

Run as root on a host set up by `deskvm doctor --fix` with the default image built:
    python3 bench/key_loss.py [--runs 3] [--lines 15] [--guest-hogs 6] [--no-key-acks]
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import time
from typing import Any

from agent_bridge.client import Client
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.display.base import KeyEvent
from orchestrator.display.key_pacing import KeyPacer
from orchestrator.display.qmp import QmpDisplay
from orchestrator.interrupt import run_main
from orchestrator.settings import Settings

SETTLE_S = 3.0
"""After the last line, time for the X server's count to catch up before it is read, s."""


class KeyTally:
    """Counts the key events every QMP display sends (wraps ``QmpDisplay.send``)."""

    def __init__(self) -> None:
        self.sent = 0
        original = QmpDisplay.send

        def send(display: QmpDisplay, events: Any, **kwargs: Any) -> None:
            original(display, events, **kwargs)
            self.sent += sum(isinstance(e, KeyEvent) for e in events)

        QmpDisplay.send = send  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="sessions, one after another")
    parser.add_argument("--lines", type=int, default=15, help="lines typed per run")
    parser.add_argument("--marker-chars", type=int, default=120, help="hex digits per marker")
    parser.add_argument("--guest-hogs", type=int, default=6, help="CPU hog shells in the guest")
    parser.add_argument(
        "--hog-max-s", type=float, default=300.0, help="guest hogs end by themselves after this"
    )
    parser.add_argument(
        "--no-key-acks", action="store_true",
        help="do not wait for the guest X server's count of processed keys",
    )  # fmt: skip
    args = parser.parse_args()

    if args.no_key_acks:
        KeyPacer.before = lambda self, keys, interrupt=None: None  # type: ignore[method-assign]
    tally = KeyTally()
    settings = dataclasses.replace(Settings.from_env(), max_typed_chars_per_s=100_000.0)
    manager = build_manager(settings)
    token = secrets.token_urlsafe(24)
    acks = "off" if args.no_key_acks else "on"
    print(f"X server key acknowledgements {acks}; {args.guest_hogs} guest CPU hog shell(s); "
          f"{args.lines} lines of {args.marker_chars + 20} characters per run")  # fmt: skip
    totals = {"lines": 0, "whole": 0, "runs_with_loss": 0, "sent": 0, "counted": 0}
    with (
        BackgroundServer(create_app(manager, token=token, settings=settings)) as server,
        Client(server.url, token) as client,
    ):
        for run in range(args.runs):
            session = client.create_session(guest_control=True, boot_timeout_s=180)
            with session:
                internal = manager.get(session.id)
                xterm = next(w for w in session.windows() if "xterm" in w["class"].lower())
                session.click(xterm["x"] + xterm["width"] // 2, xterm["y"] + xterm["height"] // 2)
                spin = f"timeout {args.hog_max_s:.0f} sh -c 'while :; do :; done'"
                start = f"for i in $(seq {args.guest_hogs}); do {spin} & done"
                session.exec(["setsid", "sh", "-c", f"({start}) >/dev/null 2>&1 </dev/null &"])
                time.sleep(2.0)
                before_sent, before_count = tally.sent, internal.guest_key_events()
                markers = [f"K{n:02d}-" + secrets.token_hex(args.marker_chars // 2)
                           for n in range(args.lines)]  # fmt: skip
                t0 = time.monotonic()
                for marker in markers:
                    session.type(f"echo {marker} > /dev/ttyS1\n")
                typed_s = time.monotonic() - t0
                deadline = time.monotonic() + 120.0
                while True:
                    lines = {line.rstrip("\r") for line in session.guest_log().splitlines()}
                    whole = sum(m in lines for m in markers)
                    if whole == len(markers) or time.monotonic() > deadline:
                        break
                    time.sleep(1.0)
                time.sleep(SETTLE_S)
                sent = tally.sent - before_sent
                after = internal.guest_key_events()
                counted = (
                    after - before_count if after is not None and before_count is not None else -1
                )
                print(
                    f"run {run + 1}: {whole}/{len(markers)} lines whole; key events sent "
                    f"{sent}, processed by the X server {counted}; typed in {typed_s:.1f} s"
                )
                totals["lines"] += len(markers)
                totals["whole"] += whole
                totals["runs_with_loss"] += whole < len(markers)
                totals["sent"] += sent
                totals["counted"] += max(counted, 0)  # -1: no count reported
    print(f"key loss, X acks {acks}: {totals['lines'] - totals['whole']} of {totals['lines']} "
          f"lines not whole, {totals['runs_with_loss']} of {args.runs} runs with a loss; "
          f"key events sent {totals['sent']}, processed {totals['counted']}")  # fmt: skip


if __name__ == "__main__":
    run_main(main)
