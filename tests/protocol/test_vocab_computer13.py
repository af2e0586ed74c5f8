"""OSWorld computer_13 actions -> deskvm actions, and OSWorld-shaped step results."""

from __future__ import annotations

from typing import Any

import pytest

from agent_bridge.protocol.actions import (
    Action,
    Button,
    Click,
    Key,
    MouseDown,
    MouseUp,
    Move,
    Screenshot,
    Scroll,
    Type,
    Wait,
)
from agent_bridge.protocol.keys import KeyCombo
from agent_bridge.protocol.results import Done, ImageResult
from agent_bridge.protocol.vocab import Computer13Vocabulary, get_vocabulary
from orchestrator.errors import ActionError, ProtocolError

SHOT = Screenshot()
V = get_vocabulary("computer_13")


def k(*qcodes: str) -> KeyCombo:
    return KeyCombo(qcodes)


CASES: list[tuple[dict[str, Any], tuple[Action, ...]]] = [
    ({"action_type": "MOVE_TO", "x": 1, "y": 2}, (Move(1, 2),)),
    ({"action_type": "MOVE_TO", "parameters": {"x": 1319.11, "y": 65.5}}, (Move(1319, 66),)),
    ({"action_type": "CLICK", "x": 1, "y": 2}, (Click(1, 2),)),
    ({"action_type": "CLICK"}, (Click(None, None),)),
    (
        {
            "action_type": "CLICK",
            "parameters": {"button": "right", "x": 3, "y": 4, "num_clicks": 2},
        },
        (Click(3, 4, Button.RIGHT, count=2),),
    ),
    ({"action_type": "CLICK", "num_clicks": 3, "x": 0, "y": 0}, (Click(0, 0, count=3),)),
    ({"action_type": "MOUSE_DOWN"}, (MouseDown(Button.LEFT),)),
    ({"action_type": "MOUSE_UP", "parameters": {"button": "middle"}}, (MouseUp(Button.MIDDLE),)),
    ({"action_type": "RIGHT_CLICK", "x": 5, "y": 6}, (Click(5, 6, Button.RIGHT),)),
    ({"action_type": "RIGHT_CLICK"}, (Click(None, None, Button.RIGHT),)),
    ({"action_type": "DOUBLE_CLICK", "x": 5, "y": 6}, (Click(5, 6, count=2),)),
    (
        {"action_type": "DRAG_TO", "parameters": {"x": 30, "y": 20}},
        (MouseDown(Button.LEFT), Move(30, 20), MouseUp(Button.LEFT, 30, 20)),
    ),
    # pyautogui's signs: positive dy scrolls up, positive dx scrolls right.
    ({"action_type": "SCROLL", "dx": 0, "dy": 5}, (Scroll(None, None, dy=-5),)),
    ({"action_type": "SCROLL", "dx": 0, "dy": -20}, (Scroll(None, None, dy=20),)),
    ({"action_type": "SCROLL", "parameters": {"dx": 3, "dy": 0}}, (Scroll(None, None, dx=3),)),
    ({"action_type": "SCROLL", "dx": -3, "dy": 0}, (Scroll(None, None, dx=-3),)),
    ({"action_type": "TYPING", "text": "tab\there"}, (Type("tab\there"),)),
    ({"action_type": "PRESS", "key": "enter"}, (Key((k("ret"),)),)),
    ({"action_type": "PRESS", "key": "ctrlleft"}, (Key((k("ctrl"),)),)),
    ({"action_type": "PRESS", "key": "num5"}, (Key((k("kp_5"),)),)),
    ({"action_type": "PRESS", "key": "A"}, (Key((k("shift", "a"),)),)),
    ({"action_type": "PRESS", "key": "?"}, (Key((k("shift", "slash"),)),)),
    ({"action_type": "HOTKEY", "keys": ["ctrl", "c"]}, (Key((k("ctrl", "c"),)),)),
    ({"action_type": "HOTKEY", "keys": ["ctrl", "shift", "t"]}, (Key((k("ctrl", "shift", "t"),)),)),
    ({"action_type": "HOTKEY", "keys": "Ctrl+Shift+>"}, (Key((k("ctrl", "shift", "dot"),)),)),
    ({"action_type": "WAIT"}, (Wait(2000),)),
    ({"action_type": "DONE"}, ()),
    ({"action_type": "FAIL"}, ()),
]


@pytest.mark.parametrize(("body", "expected"), CASES)
def test_actions(body: dict[str, Any], expected: tuple[Action, ...]) -> None:
    assert V.parse(body) == (*expected, SHOT)
    quiet = Computer13Vocabulary(screenshot_after_action=False)
    assert quiet.parse(body) == (expected or (SHOT,))


@pytest.mark.parametrize("kind", ["KEY_DOWN", "KEY_UP"])
def test_key_down_and_up_are_refused_with_the_reason(kind: str) -> None:
    with pytest.raises(ProtocolError) as info:
        V.parse({"action_type": kind, "key": "shift"})
    assert info.value.code == "unknown_action"
    assert "never leaves a key pressed" in info.value.message
    assert "HOTKEY" in info.value.message


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"action_type": "MOVE_TO", "x": 1}, "missing_parameter", "'y'"),
    ({"action_type": "CLICK", "x": 1}, "missing_parameter", "'y'"),
    ({"action_type": "CLICK", "x": "1", "y": 2}, "invalid_action", "'x'"),
    ({"action_type": "CLICK", "num_clicks": 4}, "invalid_action", "num_clicks"),
    ({"action_type": "CLICK", "button": "back"}, "invalid_action", "button"),
    ({"action_type": "DRAG_TO"}, "missing_parameter", "'x'"),
    ({"action_type": "SCROLL", "dy": 1}, "missing_parameter", "dx"),
    ({"action_type": "SCROLL", "dx": 0, "dy": 1.5}, "invalid_action", "whole number"),
    ({"action_type": "SCROLL", "dx": 0, "dy": 101}, "invalid_action", "-100..100"),
    ({"action_type": "TYPING"}, "missing_parameter", "text"),
    ({"action_type": "PRESS"}, "missing_parameter", "key"),
    ({"action_type": "PRESS", "key": "volumeup"}, "unknown_key", "volumeup"),
    ({"action_type": "HOTKEY"}, "missing_parameter", "keys"),
    ({"action_type": "HOTKEY", "keys": [1, 2]}, "invalid_action", "keys"),
    ({"action_type": "CLICK", "parameters": [1, 2]}, "invalid_action", "parameters"),
]


@pytest.mark.parametrize(("body", "code", "needle"), BAD)
def test_bad_parameters_give_structured_errors(
    body: dict[str, Any], code: str, needle: str
) -> None:
    with pytest.raises(ActionError) as info:
        V.parse(body)
    assert info.value.code == code
    assert needle in info.value.message


def test_step_results_follow_osworld() -> None:
    image = ImageResult(1, 1, "image/png", b"png")
    assert V.format_result({"action_type": "CLICK"}, [Done(), image]) == {
        "observation": {"screenshot": "cG5n"},
        "done": False,
        "info": {},
    }
    assert V.format_result({"action_type": "DONE"}, [image]) == {
        "observation": {"screenshot": "cG5n"},
        "done": True,
        "info": {"done": True},
    }
    assert V.format_result({"action_type": "FAIL"}, [image])["info"] == {"fail": True}
    assert V.format_result({"action_type": "WAIT"}, [Done()])["observation"] == {"screenshot": None}
