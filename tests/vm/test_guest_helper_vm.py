"""The guest helper on a real VM, in the default xterm desktop: non-US text reaches a shell,
and a request the host reported as failed is never carried out later.

(The fidelity matrix against the Tk input probe is ``test_input_fidelity_vm.py``.)
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from agent_bridge.client import RemoteError
from tests.vm.conftest import window_box
from tests.vm.test_session_vm import wait_for_line

# Loads the image's own helper as a module (changing nothing) and prints the relay keyboard
# it picks and whether that keyboard's map reads back the same as the XTEST keyboard's.
RELAY_PROBE = (
    "import importlib.machinery as m; "
    "h = m.SourceFileLoader('h', '/usr/local/bin/deskvm-helper').load_module(); "
    "x = h.X11(); kb = x.slave_keyboards(); relay = h.pick_relay(list(kb)); "
    "print(relay.decode(), x.device_rows(kb[relay]) == x.device_rows(kb[h.XTEST_KEYBOARD]))"
)


def assert_relay_copies_xtest(s: Any) -> None:
    """The running helper's relay keyboard (QEMU's PS/2 one) holds the XTEST keyboard's map
    (on a non-US session it would otherwise hold the session's layout)."""
    r = s.exec(["python3", "-c", RELAY_PROBE])
    assert r.exit_code == 0 and r.stdout.strip() == "AT Translated Set 2 keyboard True", r


@pytest.mark.deskvm(guest_control=True)
def test_non_us_text_reaches_the_shell_and_a_failed_request_never_runs_later(
    deskvm_session,
) -> None:
    s = deskvm_session
    x0, y0, x1, y1 = window_box(s.screenshot().image())
    s.click((x0 + x1) // 2, (y0 + y1) // 2)

    # 1. Text with no US key, typed into xterm (not Tk) through the helper.
    s.type("echo Ñandú-美国降息新闻 > /dev/ttyS1\n")
    lines = wait_for_line(s, "Ñandú-美国降息新闻")
    assert "Ñandú-美国降息新闻" in lines, lines[-5:]
    # The keyboard the helper switches through before a rebound key.
    assert_relay_copies_xtest(s)

    # 2. Stop the helper (it stays alive but reads nothing): the request is not
    #    acknowledged, so the action fails without injecting anything.
    s.type("pkill -STOP -f deskvm-helper\n")
    time.sleep(1.0)
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as info:
        s.type("echo GHOST-ñ")
    assert info.value.code == "guest_helper_error"
    assert "did not acknowledge" in str(info.value) and "nothing was injected" in str(info.value)
    assert time.monotonic() - t0 < 15.0

    # 3. Gone until it answers again: refused up front, the session lives on.
    with pytest.raises(RemoteError) as info:
        s.type("ñ")
    assert info.value.code == "untypeable_text" and "did not acknowledge" in str(info.value)

    # 4. Resume it: it now reads the stale "echo GHOST-ñ" request, but the host never
    #    confirms it, so it is dropped. Had it been typed, the next command line would
    #    start with it and the marker would never reach the guest log.
    s.type("pkill -CONT -f deskvm-helper\n")
    time.sleep(7.0)  # past the helper's wait for a confirmation
    s.type("echo after-$((6*7)) > /dev/ttyS1\n")
    lines = wait_for_line(s, "after-42")
    assert "after-42" in lines, lines[-5:]
    assert not any("GHOST" in line for line in lines), lines[-5:]

    # 5. Asked to announce itself again, the helper is back.
    s.type("echo Ñ-again > /dev/ttyS1\n")
    lines = wait_for_line(s, "Ñ-again")
    assert "Ñ-again" in lines, lines[-5:]

    # 6. Killed, it is started again, takes back the keycodes the first one bound (Ñ, ú,
    #    美, 国, ...) and types with them.
    s.type("pkill -KILL -f deskvm-helper\n")
    time.sleep(4.0)
    s.type("echo Ñandú-美国-restarted > /dev/ttyS1\n")
    lines = wait_for_line(s, "Ñandú-美国-restarted")
    assert "Ñandú-美国-restarted" in lines, lines[-5:]
