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
from orchestrator.display.base import AbsMove, KeyEvent, WheelEvent
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
        return reply if isinstance(reply, str) else json.dumps({"return": reply})


def display(
    monkeypatch: pytest.MonkeyPatch, replies: dict[str, Any]
) -> tuple[QmpDisplay, Monitor]:
    monitor = Monitor(replies)
    monkeypatch.setattr(qmp.libvirt_qemu, "qemuMonitorCommand", monitor)
    return QmpDisplay(object(), object()), monitor  # type: ignore[arg-type]


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
