"""QmpDisplay's QMP traffic, against a scripted monitor (no VM)."""

from __future__ import annotations

import json
from typing import Any

import pytest

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
