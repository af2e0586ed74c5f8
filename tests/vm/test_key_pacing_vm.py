"""Keys wait for the guest X server on a real VM (``orchestrator.display.key_pacing``).

The image's helper counts the keys the X server has processed; typing actions wait for
that count, and their ``result`` events say how long (``key_wait_s``). With the helper
stopped the count stands still: keys are held back until the stall limit, then sent, and
nothing is lost either way. Long lines typed while the guest's CPUs are busy arrive whole
(the loss this pacing fixes dropped 20-30 characters from such lines).
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from agent_bridge.client import Session
from orchestrator.display.key_pacing import KEY_ACK_STALL_S
from tests.vm.conftest import window_box
from tests.vm.test_session_vm import wait_for_line

# CPU hogs in the guest while the long lines are typed (the desktop user's, each ends by
# itself), and how many 135-character lines are typed back to back.
GUEST_HOGS = 6
GUEST_HOG_S = 120
LINES = 15


def type_results(session: Session) -> list[dict[str, Any]]:
    """The ``result`` events of the session's ``type`` actions, in order."""
    path = Path(str(session.info_at_start.recording), "events.jsonl")
    events = [json.loads(line) for line in path.read_text().splitlines()]
    return [e["data"] for e in events if e["kind"] == "result" and e["data"]["action"] == "type"]


def echo_line(session: Session, marker: str) -> None:
    """Type a command that writes ``marker`` to the guest log; fail unless it arrives whole."""
    session.type(f"echo {marker} > /dev/ttyS1\n")
    lines = wait_for_line(session, marker)
    assert marker in lines, [line for line in lines if line.startswith(marker[:6])][-3:]


def test_keys_wait_for_the_x_server_and_a_stalled_count_loses_nothing(deskvm_session) -> None:
    s = deskvm_session
    x0, y0, x1, y1 = window_box(s.screenshot().image())
    s.click((x0 + x1) // 2, (y0 + y1) // 2)

    # 1. The helper counts: a typing action's result says how long its keys waited. (The
    #    helper may announce itself a moment after the desktop is ready.)
    deadline = time.monotonic() + 30.0
    while True:
        echo_line(s, "P1-" + secrets.token_hex(8))
        first = type_results(s)[-1]
        if "key_wait_s" in first or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert "key_wait_s" in first and "key_acks_stalled" not in first, first

    # 2. Helper stopped (SIGSTOP): its count stands still. The next line is held back for
    #    the stall limit, then sent whole.
    s.type("pkill -STOP -f deskvm-helper\n")
    time.sleep(1.0)
    marker = "P2-" + secrets.token_hex(24)
    t0 = time.monotonic()
    echo_line(s, marker)
    stalled = type_results(s)[-1]
    assert stalled.get("key_acks_stalled") is True, stalled
    assert stalled["key_wait_s"] >= KEY_ACK_STALL_S - 0.5, stalled
    assert time.monotonic() - t0 >= KEY_ACK_STALL_S - 0.5

    # 2b. A key combo is held back before its first press, never between its press and
    #     release: a wait with shift+x down would have the guest repeat the X for 5 s.
    s.type("echo R")  # past the window with the combo: the combo must wait
    s.key("shift+x")
    s.type(" > /dev/ttyS1\n")
    lines = wait_for_line(s, "RX")
    assert "RX" in lines, [line for line in lines if line.startswith("RX")][-3:]

    # 3. Continued: counted again, no stall.
    s.type("pkill -CONT -f deskvm-helper\n")
    time.sleep(1.0)
    echo_line(s, "P3-" + secrets.token_hex(8))
    again = type_results(s)[-1]
    assert "key_wait_s" in again and "key_acks_stalled" not in again, again

    # 4. Long lines typed back to back while the guest's CPUs are busy (six spinning shells
    #    of the desktop user) arrive whole. Without the pacing 2 of 15 such lines lost
    #    characters (docs/performance.md, "Keys lost in a busy guest").
    spin = f"timeout {GUEST_HOG_S} sh -c 'while :; do :; done'"
    s.type(f"for i in $(seq {GUEST_HOGS}); do {spin} & done\n")
    time.sleep(3.0)
    markers = [f"L{n:02d}-" + secrets.token_hex(60) for n in range(LINES)]
    for marker in markers:
        s.type(f"echo {marker} > /dev/ttyS1\n")
    deadline = time.monotonic() + 120.0
    while True:
        lines = {line.rstrip("\r") for line in s.guest_log().splitlines()}
        missing = [m for m in markers if m not in lines]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    garbled = sorted(line for line in lines if line.startswith("L") and line not in markers)
    assert not missing, f"{len(missing)} of {LINES} lines not whole: {garbled[:3]}"
    loaded = type_results(s)[-LINES:]
    assert all("key_wait_s" in r and "key_acks_stalled" not in r for r in loaded), loaded
    waits = sorted(r["key_wait_s"] for r in loaded)
    print(f"\nkey waits with {GUEST_HOGS} guest hogs (s): min {waits[0]}, max {waits[-1]}")
