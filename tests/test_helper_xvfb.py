"""The guest helper's injector against a real X server (Xvfb) and a stalled receiving client.

The reproduction of the input-fidelity bug docs/performance.md describes ("Input fidelity
under load"), on the host, without a VM: an Xvfb server with the session's layout
(``setxkbmap``), the guest's Tk input probe (``deskvm-input-probe``) as the receiving
client, and the helper's own ``Injector`` typing into it while the probe is stopped
(SIGSTOP) for up to ``STALL_MAX_S`` at random moments, as a guest's apps are on a loaded
guest. Each round types new characters with no key on the layout (so spare keycodes are
bound and, once all are taken, rebound to other characters) and the ASCII characters whose
keys differ between ``us``, ``de`` and ``fr`` (``zy@`` and more: typed with the keys of the
map the helper's keys are read with). A round counts only if the probe's text field then
holds exactly what was typed. About 95 s on a 2-core host.

Needs ``Xvfb``, ``setxkbmap``, ``xinput`` and Tk (scripts/bootstrap installs them: xvfb,
x11-xkb-utils, xinput, python3-tk); a missing one fails the test, it is not skipped.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.test_helper_script import load_helper
from vm_images.recipe import GUEST_DIR

PROBE = GUEST_DIR / "base" / "usr" / "local" / "bin" / "deskvm-input-probe"
# The probe is stopped for up to STALL_MAX_S, 0 to STALL_GAP_MAX_S apart: a client that
# keeps lagging a little behind the helper (longer, rarer stops make fewer wrong characters
# with the binding-per-key helper: 0-1 of 12 rounds at 400/300 ms against 1-3 at 80/100).
STALL_MAX_S = 0.08
STALL_GAP_MAX_S = 0.1
ROUNDS = 12
NEW_PER_ROUND = 100  # distinct characters with no key, new each round
# ASCII whose keys differ between us, de and fr (z/y, a/q, w/z, m, @, ", ;, digits).
LAYOUT_ASCII = 'zy@qaw m;"1 '
REUSE_AGE_S = 1.0  # the helper's rebinding age, shortened from 5 s: still above any stall
CATCH_UP_S = 20.0  # how long the probe may take to show a round's text


class ProbeClient:
    """The Tk input probe on an X display, its JSON lines in a file."""

    def __init__(self, display: str, tmp_path: Path) -> None:
        self.log = tmp_path / "probe.log"
        self.log.touch()
        ready = tmp_path / "probe.ready"
        env = {**os.environ, "DISPLAY": display}
        self.proc = subprocess.Popen(
            [sys.executable, str(PROBE), "--output", str(self.log), "--ready-file", str(ready)],
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert self.proc.poll() is None, "the input probe exited (is Tk installed?)"
            assert time.monotonic() < deadline, "the input probe was not ready in 30 s"
            time.sleep(0.05)

    def text(self) -> str:
        value = ""
        for line in self.log.read_text(encoding="ascii").splitlines():
            event = json.loads(line)
            if event["ev"] == "text":
                value = event["value"]
        return value

    def stop(self) -> None:
        with_kill(self.proc)


def with_kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Staller:
    """Stops a process (SIGSTOP) for up to ``max_s`` at random moments; always continues it."""

    def __init__(self, pid: int, max_s: float) -> None:
        self.pid = pid
        self.max_s = max_s
        self.rng = random.Random()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(self.rng.uniform(0, STALL_GAP_MAX_S)):
            os.kill(self.pid, signal.SIGSTOP)
            try:
                time.sleep(self.rng.uniform(0, self.max_s))
            finally:
                os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> Staller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        os.kill(self.pid, signal.SIGCONT)


def device_keys(display: str, device_id: int) -> dict[int, str]:
    """{keycode: its ``key <NAME> {...}`` block} of one device's keymap (``xkbcomp -i``)."""
    dump = subprocess.run(
        ["xkbcomp", "-w", "0", "-i", str(device_id), display, "-"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    codes = dict(re.findall(r"^\s*(<[^>]+>) = (\d+);", dump, re.M))
    blocks = re.findall(r"^\s*key (<[^>]+>) \{(.*?)\};", dump, re.M | re.S)
    return {int(codes[name]): " ".join(body.split()) for name, body in blocks if name in codes}


# The session layout, and another one for the stand-in of QEMU's keyboard (see below).
LAYOUTS = {"us": "de", "de": "us", "fr": "us"}


@contextmanager
def _desktop(
    display: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, maps: dict[str, str]
) -> Iterator[tuple[ModuleType, ProbeClient, Any, str, dict[str, int]]]:
    """(the helper module, the probe, the helper's X11 connection, the display name,
    {keyboard device name: XInput id}) on the Xvfb ``display`` (the ``xserver`` fixture),
    its keyboard maps set to ``maps``: ``{"all": LAYOUT, DEVICE NAME: LAYOUT...}``,
    applied in that order."""
    probe = x = None
    try:
        monkeypatch.setenv("DISPLAY", display)
        helper = load_helper()
        monkeypatch.setattr(helper, "REUSE_AGE_S", REUSE_AGE_S)
        x = helper.X11()
        keyboards = {name.decode(): kid for name, kid in x.slave_keyboards().items()}
        setxkbmap = shutil.which("setxkbmap")
        assert setxkbmap, "setxkbmap is missing: scripts/bootstrap installs x11-xkb-utils"
        for device, layout in maps.items():
            where = [] if device == "all" else ["-device", str(keyboards[device])]
            subprocess.run(
                [setxkbmap, "-display", display, *where, "-model", "pc105", layout], check=True
            )
        probe = ProbeClient(display, tmp_path)
        yield helper, probe, x, display, keyboards
    finally:
        if x is not None:
            x.xlib.XCloseDisplay(ctypes.c_void_p(x.dpy))
        if probe is not None:
            probe.stop()


def _new_chars(round_no: int) -> str:
    """``NEW_PER_ROUND`` CJK characters no earlier round typed."""
    start = 0x4E00 + round_no * NEW_PER_ROUND
    return "".join(chr(cp) for cp in range(start, start + NEW_PER_ROUND))


def _wait_text(probe: ProbeClient, expected: str) -> str:
    deadline = time.monotonic() + CATCH_UP_S
    got = probe.text()
    while len(got) < len(expected) and time.monotonic() < deadline:
        time.sleep(0.1)
        got = probe.text()
    return got


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_typed_text_arrives_exactly_while_the_client_stalls(
    layout: str, xserver: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session layout on every keyboard, then another on Xvfb's own keyboard, as QEMU's
    keyboard has on a guest whose layout is not ``us``. Xvfb's keyboard is also the
    helper's relay (Xvfb has no other), so the helper copies the XTEST map onto it: the
    check that a binding leaves every other device's keys alone covers the XTEST keyboard
    only."""
    maps = {"all": layout, "Xvfb keyboard": LAYOUTS[layout]}
    with _desktop(xserver, tmp_path, monkeypatch, maps) as desktop:
        _type_rounds(layout, *desktop)


def test_the_relay_gets_the_xtest_map_again_when_the_server_re_adds_a_keyboard(
    xserver: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Xorg may re-add a keyboard after the helper started (udev's events at boot), with
    the session's layout: the helper's next action copies the XTEST map onto it again."""
    desktop = _desktop(xserver, tmp_path, monkeypatch, {"all": "us"})
    with desktop as (helper, probe, x, display, keyboards):
        injector = helper.Injector(x)
        assert injector.relay == b"Xvfb keyboard"
        relay, xtest = keyboards["Xvfb keyboard"], keyboards["Virtual core XTEST keyboard"]
        assert device_keys(display, relay) == device_keys(display, xtest)
        env = {**os.environ, "DISPLAY": display}
        subprocess.run(["setxkbmap", "-display", display, "-device", str(relay), "de"], check=True)
        xinput = shutil.which("xinput")
        assert xinput, "xinput is missing: scripts/bootstrap installs it"
        subprocess.run([xinput, "disable", str(relay)], env=env, check=True)
        subprocess.run([xinput, "enable", str(relay)], env=env, check=True)
        assert device_keys(display, relay) != device_keys(display, xtest)
        injector.type_text("zy@美")
        assert _wait_text(probe, "zy@美") == "zy@美"
        assert injector.relay == b"Xvfb keyboard"
        assert device_keys(display, relay) == device_keys(display, xtest)


def test_the_helper_types_with_the_xtest_keyboards_map_not_the_core_one(
    xserver: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core map is the last keyboard's that typed (on a guest, QEMU's keyboard with the
    session layout once the host typed); the helper types through the XTEST keyboard and
    must use its map, whenever it starts. Here the XTEST keyboard has ``fr`` and the core
    map ``us``: keys looked up in the core map would type ``q`` for ``a``."""
    maps = {"all": "us", "Virtual core XTEST keyboard": "fr"}
    with _desktop(xserver, tmp_path, monkeypatch, maps) as (helper, probe, x, _, _):
        core_keycode = next(kc for kc, syms in x.keyboard_mapping()[1].items() if syms[0] == 0x61)
        _, rows = x.typing_map()
        xtest_keycode = next(kc for kc, syms in rows.items() if syms[0] == 0x61)
        assert (core_keycode, xtest_keycode) == (38, 24)  # a: us, fr (AZERTY)
        injector = helper.Injector(x)
        injector.type_text("azqw@1")
        assert _wait_text(probe, "azqw@1") == "azqw@1"


def _type_rounds(
    layout: str,
    helper: ModuleType,
    probe: ProbeClient,
    x: Any,
    display: str,
    keyboards: dict[str, int],
) -> None:
    injector = helper.Injector(x)
    before = {name: device_keys(display, kid) for name, kid in keyboards.items()}
    # Enough rounds that every spare keycode is bound and later rebound.
    rounds = max(ROUNDS, len(injector.spare) // NEW_PER_ROUND + 3)
    expected = ""
    wrong: list[str] = []
    with Staller(probe.proc.pid, STALL_MAX_S):
        for round_no in range(rounds):
            # The layout's ASCII between the new characters, as real text has it.
            mixed = "".join(
                char + LAYOUT_ASCII[i % len(LAYOUT_ASCII)] * (i % 3 == 0)
                for i, char in enumerate(_new_chars(round_no))
            )
            injector.type_text(mixed)
            expected += mixed
            got = _wait_text(probe, expected)
            if got != expected:
                diffs = [
                    f"{i}: {e!r}->{g!r}"
                    for i, (e, g) in enumerate(zip(expected, got, strict=False))
                    if e != g
                ]
                wrong.append(f"round {round_no}: {diffs[:8]} (lengths {len(expected)}/{len(got)})")
                expected = got  # go on from what the field holds
    assert not wrong, f"{layout}: {len(wrong)} of {rounds} rounds wrong: {wrong}"
    # Every device keeps its own keys (only the helper's pool keycodes changed), but the
    # relay keyboard, which holds a copy of the XTEST keyboard's map.
    pool = set(injector.spare)
    assert injector.relay is not None, "the helper found no relay keyboard"
    relay = injector.relay.decode()
    xtest = "Virtual core XTEST keyboard"
    assert device_keys(display, keyboards[relay]) == device_keys(display, keyboards[xtest])
    for name, kid in keyboards.items():
        if name == relay:
            continue
        after = device_keys(display, kid)
        changed = sorted(kc for kc in before[name].keys() | after.keys()
                         if kc not in pool and before[name].get(kc) != after.get(kc))  # fmt: skip
        assert not changed, (
            f"{layout}: the helper changed keys of {name!r} it does not own: "
            f"{[(kc, before[name].get(kc), after.get(kc)) for kc in changed[:4]]}"
        )
