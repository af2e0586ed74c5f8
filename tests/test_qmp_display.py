"""QmpDisplay's QMP traffic, against a scripted monitor (no VM)."""

from __future__ import annotations

import fcntl
import io
import json
import os
from typing import Any

import pytest
from PIL import Image

from orchestrator.display import qmp
from orchestrator.display.base import AbsMove, ButtonEvent, KeyEvent, WheelEvent
from orchestrator.display.qmp import QmpDisplay
from orchestrator.errors import DisplayError


class Monitor:
    """Stands in for ``libvirt_qemu.qemuMonitorCommand``: answers by command name."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies
        self.commands: list[dict[str, Any]] = []

    def __call__(self, _dom: object, command: str, _flags: int) -> str:
        parsed = json.loads(command)
        self.commands.append(parsed)
        reply = self.replies[parsed["execute"]]
        if callable(reply):
            reply = reply()
        return reply if isinstance(reply, str) else json.dumps({"return": reply})


def display(
    monkeypatch: pytest.MonkeyPatch, replies: dict[str, Any], **kwargs: Any
) -> tuple[QmpDisplay, Monitor]:
    monitor = Monitor(replies)
    monkeypatch.setattr(qmp.libvirt_qemu, "qemuMonitorCommand", monitor)
    return QmpDisplay(object(), object(), **kwargs), monitor  # type: ignore[arg-type]


def _version(major: int, minor: int) -> dict[str, Any]:
    return {"qemu": {"major": major, "minor": minor, "micro": 0}, "package": ""}


@pytest.mark.parametrize(
    ("major", "minor", "expected"),
    [(7, 2, False), (8, 0, False), (8, 1, True), (9, 2, True), (10, 0, True)],
)
def test_horizontal_wheel_follows_the_qemu_version(
    monkeypatch: pytest.MonkeyPatch, major: int, minor: int, expected: bool
) -> None:
    d, monitor = display(monkeypatch, {"query-version": _version(major, minor)})
    assert d.horizontal_wheel() is expected
    assert d.horizontal_wheel() is expected
    assert [c["execute"] for c in monitor.commands] == ["query-version"]  # asked once


def test_unexpected_monitor_reply_is_a_display_error(monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = display(monkeypatch, {"query-version": '{"error": {"class": "GenericError"}}'})
    with pytest.raises(DisplayError, match="query-version gave an unexpected reply"):
        d.horizontal_wheel()


def test_send_is_one_input_send_event(monkeypatch: pytest.MonkeyPatch) -> None:
    d, monitor = display(monkeypatch, {"input-send-event": {}})
    d.send(
        [AbsMove(0, 799), KeyEvent("shift", True), WheelEvent("down")], width_px=1280, height_px=800
    )
    (command,) = monitor.commands
    events = command["arguments"]["events"]
    assert events[0] == {"type": "abs", "data": {"axis": "x", "value": 12}}
    assert events[1] == {"type": "abs", "data": {"axis": "y", "value": 32747}}
    key = {"type": "qcode", "data": "shift"}
    assert events[2] == {"type": "key", "data": {"down": True, "key": key}}
    assert [e["data"] for e in events[3:]] == [
        {"down": True, "button": "wheel-down"},
        {"down": False, "button": "wheel-down"},
    ]


def test_refused_input_is_a_display_error(monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = display(monkeypatch, {"input-send-event": '{"error": {"desc": "no"}}'})
    with pytest.raises(DisplayError, match="refused"):
        d.send([KeyEvent("a", True)], width_px=8, height_px=8)


class FdSetQemu:
    """Plays QEMU's side of the fd-set screendump: keeps the fd it is handed (a dup, as
    SCM_RIGHTS would give) and writes a PPM through it on ``screendump``."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.fd: int | None = None
        self.commands: list[dict[str, Any]] = []

    def with_files(self, _dom: object, command: str, files: list[int], _flags: int) -> Any:
        parsed = json.loads(command)
        self.commands.append(parsed)
        assert parsed["execute"] == "add-fd" and len(files) == 1
        assert os.get_blocking(files[0]) and (fcntl.fcntl(files[0], fcntl.F_GETFL) & 3) == 1
        self.fd = os.dup(files[0])
        return json.dumps({"return": {"fd": 90, "fdset-id": 7}}), []

    def command(self, _dom: object, command: str, _flags: int) -> str:
        parsed = json.loads(command)
        self.commands.append(parsed)
        if parsed["execute"] == "screendump":
            assert parsed["arguments"]["filename"] == "/dev/fdset/7"
            assert self.fd is not None
            os.write(self.fd, self.frames.pop(0))
        elif parsed["execute"] == "remove-fd":
            assert parsed["arguments"] == {"fdset-id": 7}
        return json.dumps({"return": {}})


def _ppm(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    return f"P6\n{width} {height}\n255\n".encode() + bytes(rgb) * (width * height)


def test_screendump_goes_through_an_fd_set_memfd(monkeypatch: pytest.MonkeyPatch) -> None:
    qemu = FdSetQemu([_ppm(4, 2, (1, 2, 3)), _ppm(3, 3, (9, 8, 7))])
    monkeypatch.setattr(qmp.libvirt_qemu, "qemuMonitorCommandWithFiles", qemu.with_files)
    monkeypatch.setattr(qmp.libvirt_qemu, "qemuMonitorCommand", qemu.command)
    d = QmpDisplay(object(), object())  # type: ignore[arg-type]
    first = d.screendump()
    assert (first.size, first.mode, first.getpixel((3, 1))) == ((4, 2), "RGB", (1, 2, 3))
    # The second dump is shorter: the file starts over (offset and size reset).
    second = d.screendump()
    assert (second.size, second.getpixel((2, 2))) == ((3, 3), (9, 8, 7))
    assert [c["execute"] for c in qemu.commands] == ["add-fd", "screendump", "screendump"]
    d.close()
    assert qemu.commands[-1]["execute"] == "remove-fd"
    d.close()  # idempotent
    assert qemu.fd is not None
    os.close(qemu.fd)


def test_screendump_falls_back_to_libvirt_when_fd_sets_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_files(*_args: object) -> Any:
        raise qmp.libvirt.libvirtError("this libvirt cannot pass files")

    png = io.BytesIO()
    Image.new("RGB", (5, 4), (200, 100, 50)).save(png, format="PNG")

    class Stream:
        def recvAll(self, handler: Any, chunks: list[bytes]) -> None:
            handler(self, png.getvalue(), chunks)

        def finish(self) -> None: ...

        def abort(self) -> None: ...

    class Conn:
        def newStream(self, _flags: int) -> Stream:
            return Stream()

    class Dom:
        def screenshot(self, *_args: object) -> None: ...

    monkeypatch.setattr(qmp.libvirt_qemu, "qemuMonitorCommandWithFiles", no_files)
    d = QmpDisplay(Conn(), Dom())  # type: ignore[arg-type]
    assert d.screendump().getpixel((4, 3)) == (200, 100, 50)
    assert d.screendump().size == (5, 4)  # no second attempt at the fd set
    assert d._fds == []


@pytest.mark.parametrize(
    "data", [b"P5\n2 2\n255\n" + b"\0" * 4, b"P6\n2 2\n255\n" + b"\0" * 11, b"P6\n2 2\n65535\n"]
)
def test_bad_ppm_is_a_display_error(data: bytes) -> None:
    with pytest.raises(DisplayError):
        qmp.parse_ppm(data)


KEYBOARD = qmp.keyboard_qom_path("ua-deskvm-keyboard")


class VirtioKeyboard:
    """The guest side of a virtio keyboard's event queue (64 buffers), as QMP shows it.

    ``input-send-event`` uses one buffer per key event plus one for the report's
    ``SYN_REPORT`` (dropping the report when there are not enough, as QEMU does); the guest
    gives buffers back only when :meth:`refill` is called (its interrupt handler ran).
    """

    def __init__(self, size: int = 64, posted: int = 64) -> None:
        self.size, self.avail, self.used = size, posted, 0
        self.delivered: list[str] = []
        self.dropped = 0

    def status(self) -> dict[str, Any]:
        return {"vring-num": self.size, "last-avail-idx": self.used, "used-idx": self.used}

    def element(self) -> dict[str, Any]:
        return {"avail": {"idx": self.avail & 0xFFFF}, "used": {"idx": self.used & 0xFFFF}}

    def send(self, events: list[dict[str, Any]]) -> None:
        keys = [e for e in events if e["type"] == "key"]
        if self.avail - self.used < len(keys) + 1:
            self.dropped += len(keys)
            return
        self.used += len(keys) + 1
        self.delivered += [
            ("+" if e["data"]["down"] else "-") + e["data"]["key"]["data"] for e in keys
        ]

    def refill(self) -> None:
        self.avail = self.used + self.size


def keyboard_display(
    monkeypatch: pytest.MonkeyPatch, kbd: VirtioKeyboard, on_query: Any = None, **kwargs: Any
) -> tuple[QmpDisplay, Monitor]:
    def element() -> dict[str, Any]:
        if on_query is not None:
            on_query()
        return kbd.element()

    monitor: Monitor

    def send_event() -> dict[str, Any]:
        kbd.send(monitor.commands[-1]["arguments"]["events"])
        return {}

    d, monitor = display(
        monkeypatch,
        {
            "x-query-virtio-queue-status": kbd.status,
            "x-query-virtio-queue-element": element,
            "input-send-event": send_event,
        },
        keyboard_path=KEYBOARD,
        **kwargs,
    )
    return d, monitor


def test_key_flow_control_needs_the_query_command_and_posted_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, monitor = keyboard_display(monkeypatch, VirtioKeyboard())
    assert d.key_flow_control() is True
    assert d.key_flow_control() is True
    queried = [c for c in monitor.commands if c["execute"].startswith("x-query-virtio")]
    assert len(queried) == 2  # asked once
    assert queried[0]["arguments"] == {"path": KEYBOARD, "queue": 0}
    # A guest without a virtio-input driver posts nothing: QEMU gives keys to PS/2.
    d, _ = keyboard_display(monkeypatch, VirtioKeyboard(posted=0))
    assert d.key_flow_control() is False
    # QEMU before 7.2 has no x-query-virtio-queue-status.
    missing = '{"error": {"class": "CommandNotFound", "desc": "no"}}'
    d, _ = display(monkeypatch, {"x-query-virtio-queue-status": missing}, keyboard_path=KEYBOARD)
    assert d.key_flow_control() is False
    d, monitor = display(monkeypatch, {})
    assert d.key_flow_control() is False and monitor.commands == []  # no keyboard path


def test_keys_wait_for_the_guest_and_none_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    kbd = VirtioKeyboard()
    queries = 0

    def stalled_guest() -> None:
        # The guest gives its buffers back only every third look.
        nonlocal queries
        queries += 1
        if queries % 3 == 0:
            kbd.refill()

    d, _ = keyboard_display(monkeypatch, kbd, stalled_guest)
    assert d.key_flow_control()
    want = []
    for i in range(300):
        q = "abc"[i % 3]
        d.send([KeyEvent("shift", True), KeyEvent(q, True)], width_px=8, height_px=8)
        d.send([KeyEvent(q, False), KeyEvent("shift", False)], width_px=8, height_px=8)
        want += ["+shift", f"+{q}", f"-{q}", "-shift"]
    assert kbd.dropped == 0
    assert kbd.delivered == want


def test_without_flow_control_a_full_queue_loses_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model drops as QEMU does: what flow control is there to prevent."""
    kbd = VirtioKeyboard()
    d, _ = keyboard_display(monkeypatch, kbd)
    monkeypatch.setattr(d, "key_flow_control", lambda: False)
    for _ in range(40):
        d.send([KeyEvent("a", True)], width_px=8, height_px=8)
        d.send([KeyEvent("a", False)], width_px=8, height_px=8)
    assert kbd.dropped > 0


def test_a_guest_that_takes_no_keys_is_an_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kbd = VirtioKeyboard()
    d, _ = keyboard_display(monkeypatch, kbd, key_room_timeout_s=0.05)
    for _ in range(32):  # 64 buffers: 32 one-key reports
        d.send([KeyEvent("a", True)], width_px=8, height_px=8)
    with pytest.raises(DisplayError, match="took no keyboard input") as info:
        d.send([KeyEvent("a", False)], width_px=8, height_px=8)
    assert info.value.code == "guest_not_taking_input"
    assert kbd.dropped == 0


def test_nonsense_ring_indexes_count_as_one_queue_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hostile guest may write any avail index: the host never counts on more than a
    queue's worth of buffers between two looks."""
    kbd = VirtioKeyboard()
    kbd.avail = 40_000
    d, monitor = keyboard_display(monkeypatch, kbd)
    assert d.key_flow_control()
    for _ in range(200):
        d.send([KeyEvent("a", True)], width_px=8, height_px=8)
    kinds = [c["execute"] for c in monitor.commands]
    runs = "".join("q" if k.startswith("x-query") else "s" for k in kinds).split("q")
    assert max(len(run) for run in runs) <= 32  # 64 buffers / 2 per one-key report


def test_pointer_events_do_not_wait_for_the_keyboard(monkeypatch: pytest.MonkeyPatch) -> None:
    kbd = VirtioKeyboard()
    d, monitor = keyboard_display(monkeypatch, kbd, key_room_timeout_s=0.05)
    assert d.key_flow_control()
    kbd.avail = kbd.used  # the guest stops taking events: its keyboard queue is full
    sent = len(monitor.commands)
    d.send([AbsMove(1, 1), ButtonEvent("left", True)], width_px=8, height_px=8)
    assert [c["execute"] for c in monitor.commands[sent:]] == ["input-send-event"]
