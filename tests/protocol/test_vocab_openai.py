"""OpenAI computer use (preview single action and batched ``actions``) -> deskvm actions."""

from __future__ import annotations

from typing import Any

import pytest

from agent_bridge.protocol.actions import (
    Action,
    Button,
    Click,
    Drag,
    Key,
    Move,
    Screenshot,
    Scroll,
    Type,
    Wait,
)
from agent_bridge.protocol.keys import KeyCombo, parse_combo
from agent_bridge.protocol.results import Done, ImageResult
from agent_bridge.protocol.vocab import OpenAIVocabulary, get_vocabulary
from orchestrator.errors import ActionError, ProtocolError

SHOT = Screenshot()
V = get_vocabulary("openai")


def k(*qcodes: str) -> KeyCombo:
    return KeyCombo(qcodes)


SINGLE: list[tuple[dict[str, Any], tuple[Action, ...]]] = [
    ({"type": "screenshot"}, ()),
    ({"type": "click", "x": 10, "y": 20, "button": "left"}, (Click(10, 20),)),
    ({"type": "click", "x": 10, "y": 20}, (Click(10, 20),)),
    ({"type": "click", "x": 1, "y": 2, "button": "right"}, (Click(1, 2, Button.RIGHT),)),
    ({"type": "click", "x": 1, "y": 2, "button": "wheel"}, (Click(1, 2, Button.MIDDLE),)),
    ({"type": "click", "x": 1, "y": 2, "button": "back"}, (Click(1, 2, Button.BACK),)),
    ({"type": "click", "x": 1, "y": 2, "button": "forward"}, (Click(1, 2, Button.FORWARD),)),
    ({"type": "double_click", "x": 5, "y": 6}, (Click(5, 6, count=2),)),
    (
        {"type": "drag", "path": [{"x": 1, "y": 2}, {"x": 5, "y": 5}, {"x": 9, "y": 8}]},
        (Drag(((1, 2), (5, 5), (9, 8))),),
    ),
    ({"type": "keypress", "keys": ["CTRL", "C"]}, (Key((k("ctrl", "c"),)),)),
    ({"type": "keypress", "keys": ["ENTER"]}, (Key((k("ret"),)),)),
    ({"type": "keypress", "keys": ["ESC"]}, (Key((k("esc"),)),)),
    ({"type": "keypress", "keys": ["SPACE"]}, (Key((k("spc"),)),)),
    ({"type": "keypress", "keys": ["ARROWLEFT"]}, (Key((k("left"),)),)),
    ({"type": "keypress", "keys": ["META", "L"]}, (Key((k("meta_l", "l"),)),)),
    ({"type": "keypress", "keys": ["CMD", "SHIFT", "T"]}, (Key((k("meta_l", "shift", "t"),)),)),
    ({"type": "keypress", "keys": ["ctrl+alt+t"]}, (Key((k("ctrl", "alt", "t"),)),)),
    ({"type": "keypress", "keys": ["/"]}, (Key((k("slash"),)),)),
    ({"type": "move", "x": 3, "y": 4}, (Move(3, 4),)),
    ({"type": "scroll", "x": 5, "y": 6, "scroll_x": 0, "scroll_y": 300}, (Scroll(5, 6, dy=3),)),
    ({"type": "scroll", "x": 5, "y": 6, "scroll_x": 0, "scroll_y": -500}, (Scroll(5, 6, dy=-5),)),
    ({"type": "scroll", "x": 5, "y": 6, "scroll_x": 150, "scroll_y": 0}, (Scroll(5, 6, dx=2),)),
    ({"type": "scroll", "x": 5, "y": 6, "scroll_x": -149, "scroll_y": 0}, (Scroll(5, 6, dx=-1),)),
    ({"type": "scroll", "x": 5, "y": 6, "scroll_x": 0, "scroll_y": 1}, (Scroll(5, 6, dy=1),)),
    ({"type": "scroll", "x": 5, "y": 6, "scroll_x": 0, "scroll_y": 0}, (Scroll(5, 6),)),
    ({"type": "type", "text": "hello\n"}, (Type("hello\n"),)),
    ({"type": "wait"}, (Wait(2000),)),
]


@pytest.mark.parametrize(("body", "expected"), SINGLE)
def test_single_action_ends_with_the_screenshot_the_output_needs(
    body: dict[str, Any], expected: tuple[Action, ...]
) -> None:
    assert V.parse(body) == (*expected, SHOT)


def test_batched_actions_with_held_keys() -> None:
    body = {
        "actions": [
            {"type": "click", "x": 10, "y": 20, "button": "left", "keys": ["SHIFT"]},
            {"type": "double_click", "x": 11, "y": 21, "keys": ["CTRL"]},
            {"type": "screenshot"},
            {"type": "scroll", "x": 1, "y": 1, "scroll_x": 0, "scroll_y": 100, "keys": ["CTRL"]},
            {"type": "type", "text": "hi"},
            {"type": "keypress", "keys": ["CTRL", "S"]},
            {"type": "move", "x": 2, "y": 2, "keys": []},
        ]
    }
    assert V.parse(body) == (
        Click(10, 20, hold=k("shift")),
        Click(11, 21, count=2, hold=k("ctrl")),
        Scroll(1, 1, dy=1, hold=k("ctrl")),
        Type("hi"),
        Key((k("ctrl", "s"),)),
        Move(2, 2),
        SHOT,
    )


def test_a_whole_computer_call_item_is_unwrapped() -> None:
    single = {"type": "computer_call", "call_id": "c1", "action": {"type": "move", "x": 1, "y": 1}}
    batch = {"type": "computer_call", "call_id": "c2", "actions": [{"type": "wait"}]}
    assert V.parse(single) == (Move(1, 1), SHOT)
    assert V.parse(batch) == (Wait(2000), SHOT)


def test_scroll_pixels_per_notch_is_configurable() -> None:
    v = OpenAIVocabulary(scroll_px_per_notch=40)
    body = {"type": "scroll", "x": 0, "y": 0, "scroll_x": 0, "scroll_y": 120}
    assert v.parse(body) == (Scroll(0, 0, dy=3), SHOT)


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "click", "x": 1}, "missing_parameter", "'y'"),
    ({"type": "click", "x": 1.5, "y": 2}, "invalid_action", "whole number"),
    ({"type": "click", "x": "1", "y": 2}, "invalid_action", "'x'"),
    ({"type": "click", "x": 1, "y": 2, "button": "thumb"}, "invalid_action", "thumb"),
    ({"type": "drag"}, "missing_parameter", "path"),
    ({"type": "drag", "path": [{"x": 1, "y": 2}]}, "invalid_action", "at least two"),
    ({"type": "drag", "path": [[1, 2], [3, 4]]}, "invalid_action", "path[0]"),
    ({"type": "drag", "path": [{"x": 1, "y": 2}, {"x": 3}]}, "missing_parameter", "path[1]"),
    ({"type": "move", "x": 1, "y": 2, "keys": "ALT"}, "invalid_action", "keys"),
    ({"type": "keypress"}, "missing_parameter", "keys"),
    ({"type": "keypress", "keys": "CTRL"}, "invalid_action", "list"),
    ({"type": "keypress", "keys": []}, "unknown_key", "no keys"),
    ({"type": "keypress", "keys": ["HYPERSPACE"]}, "unknown_key", "HYPERSPACE"),
    ({"type": "click", "x": 1, "y": 2, "keys": "SHIFT"}, "invalid_action", "keys"),
    ({"type": "scroll", "x": 1, "y": 2, "scroll_y": 10_100}, "invalid_action", "at most 100"),
    ({"type": "type"}, "missing_parameter", "text"),
    ({"actions": []}, "invalid_action", "non-empty"),
    ({"actions": {"type": "wait"}}, "invalid_action", "list"),
    ({"actions": [{"type": "wait"}] * 101}, "invalid_action", "100"),
    ({"actions": ["wait"]}, "invalid_action", "object"),
]


@pytest.mark.parametrize(("body", "code", "needle"), BAD)
def test_bad_parameters_give_structured_errors(
    body: dict[str, Any], code: str, needle: str
) -> None:
    with pytest.raises(ActionError) as info:
        V.parse(body)
    assert info.value.code == code
    assert needle in info.value.message


def test_unknown_action_in_a_batch_names_its_index() -> None:
    with pytest.raises(ProtocolError) as info:
        V.parse({"actions": [{"type": "wait"}, {"type": "left_click"}]})
    assert info.value.code == "unknown_action"
    assert "actions[1]" in info.value.message
    assert "supported: click, double_click, drag" in info.value.message


def test_result_is_a_computer_call_output_with_the_last_screenshot() -> None:
    first = ImageResult(1, 1, "image/png", b"old")
    last = ImageResult(1, 1, "image/png", b"new")
    result = V.format_result({"type": "click"}, [first, Done(), last])
    assert result == {
        "type": "computer_call_output",
        "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64,bmV3"},
    }


def test_result_without_screenshot_is_an_error() -> None:
    with pytest.raises(ProtocolError) as info:
        V.format_result({"type": "click"}, [Done()])
    assert info.value.code == "missing_screenshot"


def test_held_keys_on_drag_and_move_become_hold() -> None:
    vocab = OpenAIVocabulary()
    drag, _ = vocab.parse(
        {"type": "drag", "path": [{"x": 1, "y": 2}, {"x": 3, "y": 4}], "keys": ["SHIFT"]}
    )
    assert drag == Drag(path=((1, 2), (3, 4)), hold=parse_combo("shift"))
    move, _ = vocab.parse({"type": "move", "x": 5, "y": 6, "keys": ["CTRL", "ALT"]})
    assert move == Move(5, 6, hold=parse_combo("ctrl+alt"))
    batch = vocab.parse(
        {
            "actions": [
                {"type": "move", "x": 5, "y": 6, "keys": ["ALT"]},
                {"type": "move", "x": 7, "y": 8},
            ]
        }
    )
    assert batch[:2] == (Move(5, 6, hold=parse_combo("alt")), Move(7, 8))
