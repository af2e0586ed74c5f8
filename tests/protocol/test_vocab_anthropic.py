"""Anthropic computer tool (computer_20241022 / 20250124 / 20251124) -> deskvm actions."""

from __future__ import annotations

from typing import Any

import pytest

from agent_bridge.protocol.actions import (
    Action,
    Button,
    Click,
    CursorPosition,
    Drag,
    HoldKey,
    Key,
    MouseDown,
    MouseUp,
    Move,
    Screenshot,
    Scroll,
    Type,
    Wait,
    Zoom,
)
from agent_bridge.protocol.keys import KeyCombo
from agent_bridge.protocol.results import CursorResult, Done, ImageResult
from agent_bridge.protocol.vocab import ACTIONS_BY_VERSION, AnthropicVocabulary
from agent_bridge.protocol.vocab.anthropic import AnthropicVersion
from orchestrator.errors import ActionError, ProtocolError

V1: AnthropicVersion = "computer_20241022"
V2: AnthropicVersion = "computer_20250124"
V3: AnthropicVersion = "computer_20251124"
SHOT = Screenshot()


def k(*qcodes: str) -> KeyCombo:
    return KeyCombo(qcodes)


# (first version that has it, tool input, expected deskvm actions, without the trailing shot)
CASES: list[tuple[AnthropicVersion, dict[str, Any], tuple[Action, ...]]] = [
    (V1, {"action": "screenshot"}, (SHOT,)),
    (V1, {"action": "cursor_position"}, (CursorPosition(),)),
    (V1, {"action": "mouse_move", "coordinate": [10, 20]}, (Move(10, 20),)),
    (V1, {"action": "left_click"}, (Click(None, None),)),
    (V1, {"action": "left_click", "coordinate": [10, 20]}, (Click(10, 20),)),
    (V1, {"action": "right_click", "coordinate": [0, 0]}, (Click(0, 0, Button.RIGHT),)),
    (V1, {"action": "middle_click"}, (Click(None, None, Button.MIDDLE),)),
    (V1, {"action": "double_click", "coordinate": [5, 6]}, (Click(5, 6, count=2),)),
    (
        V1,
        {"action": "left_click_drag", "coordinate": [30, 40]},
        (MouseDown(Button.LEFT), Move(30, 40), MouseUp(Button.LEFT, 30, 40)),
    ),
    (
        V2,
        {"action": "left_click_drag", "start_coordinate": [1, 2], "coordinate": [30, 40]},
        (Drag(((1, 2), (30, 40))),),
    ),
    (V1, {"action": "type", "text": "Hello_World-42"}, (Type("Hello_World-42"),)),
    (V1, {"action": "key", "text": "ctrl+shift+t"}, (Key((k("ctrl", "shift", "t"),)),)),
    (V1, {"action": "key", "text": "Return"}, (Key((k("ret"),)),)),
    (V1, {"action": "key", "text": "KP_0"}, (Key((k("kp_0"),)),)),
    (V1, {"action": "key", "text": "ctrl+a ctrl+c"}, (Key((k("ctrl", "a"), k("ctrl", "c"))),)),
    (V2, {"action": "triple_click", "coordinate": [7, 8]}, (Click(7, 8, count=3),)),
    (
        V2,
        {"action": "left_click", "coordinate": [7, 8], "text": "shift"},
        (Click(7, 8, hold=k("shift")),),
    ),
    (
        V2,
        {"action": "left_click", "coordinate": [7, 8], "text": "ctrl+shift"},
        (Click(7, 8, hold=k("ctrl", "shift")),),
    ),
    (V2, {"action": "left_mouse_down"}, (MouseDown(Button.LEFT),)),
    (V2, {"action": "left_mouse_up", "coordinate": [3, 4]}, (MouseUp(Button.LEFT, 3, 4),)),
    (
        V2,
        {
            "action": "scroll",
            "coordinate": [100, 200],
            "scroll_direction": "down",
            "scroll_amount": 5,
        },
        (Scroll(100, 200, dy=5),),
    ),
    (
        V2,
        {"action": "scroll", "scroll_direction": "up", "scroll_amount": 20},
        (Scroll(None, None, dy=-20),),
    ),
    (
        V2,
        {"action": "scroll", "scroll_direction": "left", "scroll_amount": 3, "text": "shift"},
        (Scroll(None, None, dx=-3, hold=k("shift")),),
    ),
    (
        V2,
        {"action": "scroll", "scroll_direction": "right", "scroll_amount": 1},
        (Scroll(None, None, dx=1),),
    ),
    (V2, {"action": "hold_key", "text": "shift", "duration": 1.5}, (HoldKey(k("shift"), 1500),)),
    (V2, {"action": "wait", "duration": 2}, (Wait(2000),)),
    (V2, {"action": "wait", "duration": 0.25}, (Wait(250),)),
    (V3, {"action": "zoom", "region": [0, 0, 400, 300]}, (Zoom(0, 0, 400, 300),)),
]

_NO_SHOT_AFTER = {"screenshot", "zoom", "cursor_position"}
_ORDER: list[AnthropicVersion] = [V1, V2, V3]


@pytest.mark.parametrize(("since", "body", "expected"), CASES)
def test_each_version_that_has_the_action_parses_it(
    since: AnthropicVersion, body: dict[str, Any], expected: tuple[Action, ...]
) -> None:
    for version in _ORDER[_ORDER.index(since) :]:
        vocab = AnthropicVocabulary(version)
        shot = () if body["action"] in _NO_SHOT_AFTER else (SHOT,)
        assert vocab.parse(body) == expected + shot
        assert AnthropicVocabulary(version, screenshot_after_action=False).parse(body) == expected


@pytest.mark.parametrize(
    ("version", "action", "since"),
    [
        (V1, "scroll", V2),
        (V1, "hold_key", V2),
        (V1, "wait", V2),
        (V1, "triple_click", V2),
        (V1, "left_mouse_down", V2),
        (V1, "left_mouse_up", V2),
        (V1, "zoom", V3),
        (V2, "zoom", V3),
    ],
)
def test_actions_of_later_versions_are_refused(
    version: AnthropicVersion, action: str, since: str
) -> None:
    vocab = AnthropicVocabulary(version)
    with pytest.raises(ProtocolError) as info:
        vocab.parse({"action": action, "region": [0, 0, 1, 1]})
    assert info.value.code == "unknown_action"
    assert f"not in {version}" in info.value.message
    assert since in info.value.message
    assert "supported: " + ", ".join(ACTIONS_BY_VERSION[version]) in info.value.message


def test_versions_only_add_actions() -> None:
    assert set(ACTIONS_BY_VERSION[V1]) < set(ACTIONS_BY_VERSION[V2]) < set(ACTIONS_BY_VERSION[V3])
    assert set(ACTIONS_BY_VERSION[V3]) - set(ACTIONS_BY_VERSION[V2]) == {"zoom"}


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"action": "mouse_move"}, "missing_parameter", "coordinate"),
    ({"action": "left_click", "coordinate": [1]}, "invalid_action", "coordinate"),
    ({"action": "left_click", "coordinate": "1,2"}, "invalid_action", "coordinate"),
    ({"action": "left_click", "coordinate": [1.5, 2]}, "invalid_action", "whole number"),
    ({"action": "left_click", "coordinate": [True, 2]}, "invalid_action", "coordinate[0]"),
    ({"action": "left_click", "text": "hyperdrive"}, "unknown_key", "hyperdrive"),
    ({"action": "type"}, "missing_parameter", "text"),
    ({"action": "type", "text": 5}, "invalid_action", "text"),
    ({"action": "type", "text": "x" * 100_001}, "invalid_action", "longer"),
    ({"action": "key", "text": "ctrl+nokey"}, "unknown_key", "nokey"),
    ({"action": "key", "text": ""}, "unknown_key", "no keys"),
    ({"action": "left_click_drag", "start_coordinate": [1, 2]}, "missing_parameter", "coordinate"),
    ({"action": "scroll", "scroll_amount": 3}, "missing_parameter", "scroll_direction"),
    ({"action": "scroll", "scroll_direction": "in", "scroll_amount": 3}, "invalid_action", "up"),
    ({"action": "scroll", "scroll_direction": "up"}, "missing_parameter", "scroll_amount"),
    (
        {"action": "scroll", "scroll_direction": "up", "scroll_amount": -1},
        "invalid_action",
        "0..100",
    ),
    (
        {"action": "scroll", "scroll_direction": "up", "scroll_amount": 2.5},
        "invalid_action",
        "whole",
    ),
    (
        {"action": "scroll", "scroll_direction": "up", "scroll_amount": 101},
        "invalid_action",
        "0..100",
    ),
    ({"action": "hold_key", "text": "shift"}, "missing_parameter", "duration"),
    ({"action": "hold_key", "duration": 1}, "missing_parameter", "text"),
    ({"action": "hold_key", "text": "shift", "duration": 61}, "invalid_action", "seconds"),
    ({"action": "wait", "duration": -1}, "invalid_action", "duration"),
    ({"action": "wait", "duration": "1"}, "invalid_action", "duration"),
    ({"action": "zoom"}, "missing_parameter", "region"),
    ({"action": "zoom", "region": [0, 0, 10]}, "invalid_action", "region"),
    ({"action": "zoom", "region": [10, 0, 10, 5]}, "invalid_action", "x1 > x0"),
]


@pytest.mark.parametrize(("body", "code", "needle"), BAD)
def test_bad_parameters_give_structured_errors(
    body: dict[str, Any], code: str, needle: str
) -> None:
    with pytest.raises(ActionError) as info:
        AnthropicVocabulary(V3).parse(body)
    assert info.value.code == code
    assert needle in info.value.message


class TestResults:
    vocab = AnthropicVocabulary(V3)
    image = ImageResult(4, 2, "image/png", b"png-bytes")

    def test_screenshot_is_one_base64_image_block(self) -> None:
        result = self.vocab.format_result({"action": "screenshot"}, [self.image])
        assert result == {
            "type": "tool_result",
            "content": [
                {
                    "type": "image",
                    "source": {
                        "type": "base64",
                        "media_type": "image/png",
                        "data": "cG5nLWJ5dGVz",
                    },
                }
            ],
        }

    def test_click_result_carries_the_screenshot_taken_after_it(self) -> None:
        result = self.vocab.format_result({"action": "left_click"}, [Done(), self.image])
        assert [block["type"] for block in result["content"]] == ["image"]

    def test_cursor_position_is_text(self) -> None:
        result = self.vocab.format_result({"action": "cursor_position"}, [CursorResult(512, 320)])
        assert result["content"] == [{"type": "text", "text": "X=512,Y=320"}]

    def test_nothing_to_show_still_gives_a_text_block(self) -> None:
        result = self.vocab.format_result({"action": "key"}, [Done()])
        assert result["content"] == [{"type": "text", "text": "key done"}]
