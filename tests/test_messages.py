"""The WebSocket envelope and the deskvm action parser."""

from __future__ import annotations

import json

import pytest

from agent_bridge.protocol import (
    DESKVM_ACTIONS,
    Button,
    Click,
    Drag,
    HoldKey,
    Scroll,
    Type,
    Zoom,
    action_to_dict,
    check_bounds,
    decode_envelope,
    encode_error,
    encode_result,
    parse_deskvm_action,
)
from orchestrator.errors import ActionError, ProtocolError


def test_envelope_keeps_client_id_and_body() -> None:
    env = decode_envelope('{"id": 7, "action": "screenshot"}')
    assert env.id == 7
    assert env.body == {"action": "screenshot"}


@pytest.mark.parametrize(
    "text", ["not json", "[1,2]", '"x"', '{"id": [1], "action": "wait"}', b"\xff"]
)
def test_malformed_envelopes(text: str | bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_envelope(text)


def test_replies_have_the_documented_shape() -> None:
    assert json.loads(encode_result("a", {"x": 1})) == {"id": "a", "ok": True, "result": {"x": 1}}
    err = json.loads(encode_error(3, ActionError("nope", code="out_of_screen")))
    assert err == {"id": 3, "ok": False, "error": {"code": "out_of_screen", "message": "nope"}}


@pytest.mark.parametrize(
    ("body", "action"),
    [
        ({"action": "click", "x": 0, "y": 0}, Click(0, 0)),
        (
            {"action": "click", "x": 5, "y": 6, "button": "right", "count": 2},
            Click(5, 6, Button.RIGHT, 2),
        ),
        ({"action": "double_click", "x": 1, "y": 2}, Click(1, 2, count=2)),
        ({"action": "triple_click", "x": 1, "y": 2}, Click(1, 2, count=3)),
        ({"action": "click"}, Click(None, None)),
        ({"action": "click", "x": 3.0, "y": 4}, Click(3, 4)),
        ({"action": "click", "x": 1, "y": 1, "button": "back"}, Click(1, 1, Button.BACK)),
        ({"action": "scroll", "x": 1, "y": 2, "dy": -3}, Scroll(1, 2, 0, -3)),
        ({"action": "drag", "path": [[0, 0], [5, 5], [9, 9]]}, Drag(((0, 0), (5, 5), (9, 9)))),
        ({"action": "type", "text": "hi\n"}, Type("hi\n")),
        ({"action": "zoom", "region": [0, 0, 10, 20]}, Zoom(0, 0, 10, 20)),
    ],
)
def test_parse_actions(body: dict[str, object], action: object) -> None:
    assert parse_deskvm_action(body) == action


def test_hold_key_and_key() -> None:
    action = parse_deskvm_action({"action": "hold_key", "keys": "shift", "duration_ms": 500})
    assert isinstance(action, HoldKey) and action.duration_ms == 500
    key = parse_deskvm_action({"action": "key", "keys": "ctrl+shift+t"})
    assert action_to_dict(key) == {"action": "key", "combos": ["ctrl+shift+t"]}


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"action": "fly"}, "unknown_action"),
        ({}, "unknown_action"),
        ({"action": "move", "x": 1}, "missing_parameter"),
        ({"action": "move"}, "missing_parameter"),
        ({"action": "click", "x": "1", "y": 2}, "invalid_action"),
        ({"action": "click", "x": True, "y": 2}, "invalid_action"),
        ({"action": "click", "x": 1.5, "y": 2}, "invalid_action"),
        ({"action": "click", "x": 1, "y": 2, "button": "fourth"}, "invalid_action"),
        ({"action": "click", "x": 1, "y": 2, "count": 4}, "invalid_action"),
        ({"action": "drag", "path": [[1, 2]]}, "invalid_action"),
        ({"action": "type"}, "missing_parameter"),
        ({"action": "type", "text": 5}, "invalid_action"),
        ({"action": "key", "keys": "ctrl+warp"}, "unknown_key"),
        ({"action": "wait", "ms": -1}, "invalid_action"),
        ({"action": "scroll", "dy": 1000}, "invalid_action"),
        ({"action": "click", "x": 3, "y": 2, "buton": "right"}, "unknown_parameter"),
        ({"action": "screenshot", "extra": 1}, "unknown_parameter"),
        ({"action": ["click"]}, "unknown_action"),
    ],
)
def test_bad_actions_have_codes(body: dict[str, object], code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_deskvm_action(body)
    assert info.value.code == code


def test_unknown_action_lists_supported_ones() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_deskvm_action({"action": "fly"})
    for name in DESKVM_ACTIONS:
        assert name in info.value.message


@pytest.mark.parametrize(
    ("body", "ok"),
    [
        ({"action": "click", "x": 0, "y": 0}, True),
        ({"action": "click", "x": 1279, "y": 799}, True),
        ({"action": "click", "x": 1280, "y": 799}, False),
        ({"action": "click", "x": -1, "y": 0}, False),
        ({"action": "drag", "path": [[0, 0], [1300, 5]]}, False),
        ({"action": "zoom", "region": [0, 0, 1280, 800]}, True),
        ({"action": "zoom", "region": [0, 0, 1281, 800]}, False),
        ({"action": "click"}, True),
    ],
)
def test_check_bounds(body: dict[str, object], ok: bool) -> None:
    action = parse_deskvm_action(body)
    if ok:
        check_bounds(action, 1280, 800)
    else:
        with pytest.raises(ActionError) as info:
            check_bounds(action, 1280, 800)
        assert info.value.code == "out_of_screen"


def test_secret_text_is_not_in_its_record() -> None:
    record = action_to_dict(
        parse_deskvm_action({"action": "type", "text": "hunter2", "secret": True})
    )
    assert "hunter2" not in json.dumps(record)
    assert record["length"] == 7


@pytest.mark.parametrize(
    "text",
    ['{"id": 1, "action": "type", "text": "a\\ud800b"}', '{"id": 2, "junk": ["\\udfff"]}'],
)
def test_unpaired_surrogates_are_invalid_json(text: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_envelope(text)
    assert info.value.code == "invalid_json" and "surrogate" in info.value.message


def test_a_surrogate_pair_is_one_character() -> None:
    assert decode_envelope('{"id": 1, "text": "\\ud83d\\ude00"}').body == {"text": "😀"}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"action": "click", "x": True, "y": 1}, "'x' must be a number, got true"),
        ({"action": "click", "x": [1], "y": 1}, "got [1]"),
        ({"action": "click", "x": "5", "y": 1}, 'got "5"'),
        ({"action": "type", "text": 5}, "'text' must be a string, got number"),
    ],
)
def test_messages_show_values_as_json_not_python(body: dict[str, object], says: str) -> None:
    """Messages speak the protocol: ``true``/``null``/``"5"``, never ``True``/``None``."""
    with pytest.raises(ActionError) as info:
        parse_deskvm_action(body)
    assert says in info.value.message
    assert "True" not in info.value.message and "None" not in info.value.message
