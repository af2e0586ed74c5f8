"""The in-guest helper script's request handling, run on the host over a pty (no X, no VM).

The X11 side is replaced by a recording injector; the real script in a real guest is
exercised by ``tests/vm/test_input_fidelity_vm.py`` and ``tests/vm/test_session_vm.py``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import multiprocessing
import os
import pty
import select
import threading
import time
import tty
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from vm_images.recipe import GUEST_DIR

SCRIPT = GUEST_DIR / "base" / "usr" / "local" / "bin" / "deskvm-helper"


def load_helper() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("deskvm_helper_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class FakeInjector:
    """Stands in for the X11 injector: printable ASCII on the map, 3 spare keycodes."""

    def __init__(self, helper: ModuleType) -> None:
        self.on_map = {cp: (8 + cp % 100, cp > 0x60) for cp in range(0x20, 0x7F)}
        self.on_map[helper.RETURN] = (36, False)
        self.spare = [200, 201, 202]
        self.typed: list[str] = []
        self.wheels: list[tuple[str, int]] = []

    def type_text(self, text: str) -> int:
        self.typed.append(text)
        return len(text)

    def wheel(self, direction: str, count: int, at: Any, mods: int) -> int:
        self.wheels.append((direction, count))
        return count


class Port:
    """The host end of a pty standing in for the virtio-serial port."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def send(self, obj: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(obj, ensure_ascii=False) + "\n").encode())

    def read(self, timeout_s: float = 3.0) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            self.buf += os.read(self.fd, 65536)
        line, self.buf = self.buf.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Port, FakeInjector, ModuleType]]:
    helper = load_helper()
    monkeypatch.setattr(helper, "GO_WAIT_S", 0.4)
    host_fd, guest_fd = pty.openpty()
    tty.setraw(guest_fd)
    tty.setraw(host_fd)
    injector = FakeInjector(helper)
    thread = threading.Thread(target=helper.serve, args=(guest_fd, injector), daemon=True)
    thread.start()
    port = Port(host_fd)
    hello = port.read()
    assert hello is not None and hello["hello"] == "deskvm-helper"
    assert hello["spare_keycodes"] == 3
    yield port, injector, helper
    os.close(host_fd)


def test_a_request_runs_only_after_go(served) -> None:  # type: ignore[no-untyped-def]
    port, injector, _ = served
    port.send({"id": 1, "op": "type", "text": "Ñandú\r"})
    assert port.read() == {"id": 1, "ready": True}
    assert injector.typed == []
    port.send({"id": 1, "op": "go"})
    assert port.read() == {"id": 1, "ok": True, "count": 6}
    assert injector.typed == ["Ñandú\r"]


def test_an_unconfirmed_request_is_dropped(served) -> None:  # type: ignore[no-untyped-def]
    port, injector, _ = served
    port.send({"id": 1, "op": "type", "text": "STALE-ñ"})
    assert port.read() == {"id": 1, "ready": True}
    time.sleep(0.8)  # longer than GO_WAIT_S: the host gave up
    port.send({"id": 1, "op": "go"})
    assert port.read() == {"id": 1, "ok": False, "error": "no such request is waiting"}
    assert injector.typed == []


def test_a_newer_request_supersedes_an_unconfirmed_one(served) -> None:  # type: ignore[no-untyped-def]
    port, injector, _ = served
    port.send({"id": 1, "op": "type", "text": "old-ñ"})
    port.send({"id": 2, "op": "wheel", "direction": "left", "count": 2, "x": 1, "y": 2})
    assert port.read() == {"id": 1, "ready": True}
    assert port.read() == {"id": 2, "ready": True}
    port.send({"id": 1, "op": "go"})
    assert port.read() == {"id": 1, "ok": False, "error": "no such request is waiting"}
    port.send({"id": 3, "op": "wheel", "direction": "right", "count": 1})
    assert port.read() == {"id": 3, "ready": True}
    port.send({"id": 3, "op": "go"})
    assert port.read() == {"id": 3, "ok": True, "count": 1}
    assert injector.typed == [] and injector.wheels == [("right", 1)]


@pytest.mark.parametrize(
    ("request_body", "error"),
    [
        ({"op": "type", "text": "美国降息"}, "4 different characters with no key; at most 3"),
        ({"op": "type", "text": 5}, "string 'text'"),
        ({"op": "wheel", "direction": "sideways"}, "unknown wheel direction"),
        ({"op": "wheel", "direction": "up", "count": "3"}, "integers"),
        ({"op": "reboot"}, "unknown op"),
    ],
)
def test_bad_requests_are_refused_before_ready(served, request_body, error) -> None:  # type: ignore[no-untyped-def]
    port, injector, _ = served
    port.send({"id": 9, **request_body})
    reply = port.read()
    assert reply is not None and reply["id"] == 9 and reply["ok"] is False
    assert error in reply["error"]
    assert injector.typed == [] and injector.wheels == []


def test_garbage_gets_an_error_and_serving_goes_on(served) -> None:  # type: ignore[no-untyped-def]
    port, _, _ = served
    os.write(port.fd, b"not json\n[1]\n")
    assert port.read() == {"ok": False, "error": "not JSON"}
    assert port.read() == {"ok": False, "error": "request is not a JSON object"}
    port.send({"id": 4, "op": "hello"})
    reply = port.read()
    assert reply is not None and reply["id"] == 4 and reply["protocol"] == 1


def test_keysyms_follow_x11_keysymdef() -> None:
    helper = load_helper()
    assert helper.char_keysym("a") == 0x61
    assert helper.char_keysym("Ñ") == 0xD1  # Latin-1: the code point
    assert helper.char_keysym("€") == 0x010020AC  # otherwise 0x01000000 + code point
    assert helper.char_keysym("美") == 0x01007F8E
    assert helper.char_keysym("😀") == 0x0101F600
    assert helper.char_keysym("\n") == helper.char_keysym("\r") == helper.RETURN
    assert helper.char_keysym("\t") == helper.TAB


class FakeX11:
    """A keyboard map as the X server reads it back (7 keysyms per keycode)."""

    def __init__(self, table: dict[int, list[int]]) -> None:
        self.table = table
        self.bound: list[tuple[int, list[int]]] = []

    def typing_map(self) -> tuple[int, dict[int, list[int]]]:
        return 7, self.table

    def bind(self, keycode: int, keysyms: list[int]) -> None:
        self.bound.append((keycode, keysyms))

    def sync(self) -> None:
        pass

    def open_relay(self) -> bytes | None:
        return None

    def devices_changed(self) -> bool:
        return False


def test_the_relay_is_the_ps2_keyboard_else_any_but_xtest_and_the_host_s_virtio_one() -> None:
    helper = load_helper()
    at, virtio = b"AT Translated Set 2 keyboard", b"QEMU Virtio Keyboard"
    xtest, power = b"Virtual core XTEST keyboard", b"Power Button"
    assert helper.pick_relay([xtest, virtio, power, at]) == at
    assert helper.pick_relay([xtest, virtio, power]) == power
    assert helper.pick_relay([xtest, virtio]) is None


class RecordingX11(FakeX11):
    """FakeX11 that records the calls a ``type`` action makes, in order."""

    def __init__(self, table: dict[int, list[int]]) -> None:
        super().__init__(table)
        self.calls: list[tuple[str, int]] = []

    def open_relay(self) -> bytes | None:
        return b"relay"

    def bind(self, keycode: int, keysyms: list[int]) -> None:
        super().bind(keycode, keysyms)
        self.calls.append(("bind", keycode))

    def switch_through_relay(self, keycode: int) -> None:
        self.calls.append(("switch", keycode))

    def key(self, keycode: int, down: bool) -> None:
        self.calls.append(("key" if down else "release", keycode))

    def keys_down(self) -> list[int]:
        return []

    def flush(self) -> None:
        pass


def test_an_action_binds_everything_then_switches_once_then_types(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    helper = load_helper()
    monkeypatch.setattr(helper, "REBIND_PAUSE_S", 0.0)
    table = {
        10: [0x61, 0x41, 0x61, 0x41, 0, 0, 0],  # a A
        50: [0xFFE1, 0, 0xFFE1, 0, 0, 0, 0],  # Shift_L
        **{kc: [0] * 7 for kc in range(100, 104)},  # four spare keycodes
    }
    x = RecordingX11(table)
    injector = helper.Injector(x)
    injector.type_text("a美国a美")
    kinds = [kind for kind, _ in x.calls]
    assert kinds == ["bind", "bind", "switch"] + ["key", "release"] * 5, x.calls
    # An action that needs no new binding makes no switch.
    x.calls.clear()
    injector.type_text("国a")
    assert [kind for kind, _ in x.calls] == ["key", "release"] * 2, x.calls
    # A new one: its binding, then one switch, before the first key (even a layout key).
    x.calls.clear()
    injector.type_text("a新")
    assert [kind for kind, _ in x.calls][:3] == ["bind", "switch", "key"], x.calls


def test_a_restarted_helper_takes_back_the_keycodes_an_earlier_one_bound() -> None:
    helper = load_helper()
    n = [0] * 7
    table = {
        10: [0x61, 0x41, 0x61, 0x41, 0, 0, 0],  # a A
        50: [0xFFE1, 0, 0xFFE1, 0, 0, 0, 0],  # Shift_L
        100: list(n),  # empty
        101: [0x1008FF14, 0, 0x1008FF14, 0, 0, 0, 0],  # XF86AudioPlay: never sent
        102: [0xD1, 0xD1, 0xD1, 0xD1, 0, 0, 0],  # Ñ, bound by an earlier helper
        103: [0x01007F8E] * 4 + [0] * 3,  # 美, bound by an earlier helper
        104: [0xF1, 0xD1, 0xF1, 0xD1, 0, 0, 0],  # a real ñ/Ñ key: not ours
    }
    injector = helper.Injector(FakeX11(table))
    assert injector.spare == [100, 101, 102, 103]
    # Ñ has a real key (104, second level): the old binding of it is simply free again.
    assert dict(injector.bound) == {0x01007F8E: 103}
    assert injector.free == [100, 101, 102]
    assert injector.on_map[0xF1] == (104, False) and 0x01007F8E not in injector.on_map
    assert injector.on_map[0xD1] == (104, True)  # the real key's second level wins


# --- key acknowledgements: the real counter on a real X server (Xvfb) ---------------------


def xtest_keys(name: str, keycodes: list[int]) -> None:
    """Another X client presses and releases each key through XTEST."""
    from Xlib import X, display
    from Xlib.ext import xtest

    conn = display.Display(name)
    try:
        for keycode in keycodes:
            xtest.fake_input(conn, X.KeyPress, keycode)
            xtest.fake_input(conn, X.KeyRelease, keycode)
        conn.sync()
    finally:
        conn.close()


def pump_until(counter: Any, count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while counter.count < count and time.monotonic() < deadline:
        select.select([counter.fd], [], [], 0.05)
        counter.pump()


def test_the_key_counter_counts_processed_keys_but_never_xtest_s(
    xserver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPLAY", xserver)
    helper = load_helper()
    every_keyboard = helper.KeyCounter(counted=lambda name: True)
    default = helper.KeyCounter()
    assert every_keyboard.count == default.count == 0
    xtest_keys(xserver, [38, 56, 54])  # a b c
    pump_until(every_keyboard, 6)
    assert every_keyboard.count == 6  # 3 presses, 3 releases, once each (no master copy)
    default.pump()
    assert default.count == 0  # the helper's own typing (XTEST) is not an acknowledgement
    names = set(default.devices.values())
    assert names == {True, False}  # Xvfb's own keyboard counts, XTEST's does not


def _serve_counting_every_keyboard(guest_fd: int) -> None:
    """The helper's serve loop counting XTEST's keys too (Xvfb has no other keyboard)."""
    helper = load_helper()
    counter = helper.KeyCounter(counted=lambda name: True)
    helper.serve(guest_fd, FakeInjector(helper), None, counter)


def test_the_helper_reports_the_count_in_its_hello_and_on_each_change(
    xserver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPLAY", xserver)
    host_fd, guest_fd = pty.openpty()
    tty.setraw(guest_fd)
    tty.setraw(host_fd)
    # A process, not a thread: Xlib ends the whole process when its X server goes away.
    guest = multiprocessing.get_context("fork").Process(
        target=_serve_counting_every_keyboard, args=(guest_fd,), daemon=True
    )
    guest.start()
    port = Port(host_fd)
    try:
        hello = port.read(timeout_s=10.0)
        assert hello is not None and hello["key_events"] == 0
        xtest_keys(xserver, [38, 56])
        seen: list[int] = []
        while (message := port.read()) is not None:
            assert set(message) == {"key_events"}, message
            seen.append(message["key_events"])
            if seen[-1] == 4:
                break
        assert seen and seen[-1] == 4 and seen == sorted(seen)
        # A request still works between the reports, and hello gives the count now.
        port.send({"id": 3, "op": "hello"})
        reply = port.read()
        assert reply is not None and reply["id"] == 3 and reply["key_events"] == 4
    finally:
        guest.kill()
        guest.join(timeout=10.0)
        os.close(host_fd)
        os.close(guest_fd)
