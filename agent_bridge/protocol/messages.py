"""The WebSocket envelope and deskvm's own (``schema=deskvm``) action parser. Pure.

Requests are JSON text messages ``{"id": <client id>, "action": <name>, ...params}``;
replies are ``{"id", "ok": true, "result": {...}}`` or
``{"id", "ok": false, "error": {"code", "message"}}``. ``id`` is echoed as given
(string, number or null). See ``docs/protocol.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent_bridge.protocol.actions import (
    MAX_WAIT_MS,
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
    Point,
    Screenshot,
    Scroll,
    Type,
    Wait,
    Zoom,
)
from agent_bridge.protocol.guest import GUEST_ACTIONS, GUEST_PARAMETERS, parse_guest_action
from agent_bridge.protocol.keys import parse_combo, parse_combos
from orchestrator.errors import ActionError, DeskvmError, ProtocolError

__all__ = [
    "DESKVM_ACTIONS",
    "MAX_TEXT_CHARS",
    "ClientId",
    "Envelope",
    "check_bounds",
    "decode_envelope",
    "encode_error",
    "encode_result",
    "json_type",
    "parse_deskvm_action",
    "shown",
]


def shown(value: Any, limit: int = 60) -> str:
    """A received value as the client wrote it, for messages: JSON (``true``, ``null``,
    ``"text"``, ``[1, 2]``), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError):
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def json_type(value: Any) -> str:
    """The JSON type name of a received value (``null``, ``boolean``, ``number``,
    ``string``, ``array``, ``object``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    return "object"


MAX_TEXT_CHARS = 100_000

ClientId = str | int | float | None


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded request: the client's ``id`` and the rest of the object (the action)."""

    id: ClientId
    body: Mapping[str, Any]


def decode_envelope(text: str | bytes) -> Envelope:
    """Decode one WebSocket text message into its envelope.

    Raises:
        ProtocolError: not JSON, not an object, or an ``id`` that is not a string/number/null.
            The error's ``client_id`` attribute carries the id when it could be read.
    """
    try:
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"message is not valid JSON: {exc}", code="invalid_json") from None
    if _LONE_SURROGATE.search(text if isinstance(text, str) else "") or (
        "\\u" in (text if isinstance(text, str) else "") and _has_lone_surrogate(obj)
    ):
        # JSON may spell one ("\ud800"); it is no character, and nothing can encode it.
        raise ProtocolError(
            "message holds an unpaired UTF-16 surrogate (\\ud800-\\udfff): not Unicode text",
            code="invalid_json",
        )
    if not isinstance(obj, dict):
        raise ProtocolError("message must be a JSON object", code="invalid_message")
    client_id = obj.get("id")
    if client_id is not None and (
        isinstance(client_id, bool) or not isinstance(client_id, str | int | float)
    ):
        raise ProtocolError("'id' must be a string, a number or null", code="invalid_message")
    body = {k: v for k, v in obj.items() if k != "id"}
    return Envelope(id=client_id, body=body)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _LONE_SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def encode_result(client_id: ClientId, result: Mapping[str, Any]) -> str:
    """The success reply for ``client_id``."""
    return json.dumps({"id": client_id, "ok": True, "result": dict(result)})


def encode_error(client_id: ClientId, error: DeskvmError) -> str:
    """The error reply for ``client_id``: ``{"code", "message"}`` from a deskvm error."""
    return json.dumps(
        {"id": client_id, "ok": False, "error": {"code": error.code, "message": error.message}}
    )


# --- parameter readers -------------------------------------------------------------


def _int(body: Mapping[str, Any], name: str, *, default: int | None = None) -> int:
    value = body.get(name, default)
    if value is None:
        raise ActionError(f"missing parameter {name!r}", code="missing_parameter")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ActionError(f"{name!r} must be a number, got {shown(value)}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ActionError(f"{name!r} must be a whole number of pixels, got {shown(value)}")
        value = int(value)
    return value


def _opt_int(body: Mapping[str, Any], name: str) -> int | None:
    return None if body.get(name) is None else _int(body, name)


def _str(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise ActionError(f"missing parameter {name!r}", code="missing_parameter")
    if not isinstance(value, str):
        raise ActionError(f"{name!r} must be a string, got {json_type(value)}")
    return value


def _xy(body: Mapping[str, Any], *, required: bool) -> tuple[int | None, int | None]:
    x, y = _opt_int(body, "x"), _opt_int(body, "y")
    if (x is None) != (y is None):
        raise ActionError("give both 'x' and 'y' or neither", code="missing_parameter")
    if required and x is None:
        raise ActionError("missing parameters 'x' and 'y'", code="missing_parameter")
    return x, y


def _point(value: Any) -> Point:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ActionError(f"a point must be [x, y] integers, got {shown(value)}")
    return (int(value[0]), int(value[1]))


def _button(body: Mapping[str, Any]) -> Button:
    value = body.get("button", "left")
    if not isinstance(value, str):
        raise ActionError(f"'button' must be a string, got {shown(value)}")
    return Button.parse(value)


def _hold(body: Mapping[str, Any]) -> Any:
    value = body.get("hold")
    return None if value is None else parse_combo(_str(body, "hold"))


def _text(body: Mapping[str, Any]) -> Type:
    text = _str(body, "text")
    if len(text) > MAX_TEXT_CHARS:
        raise ActionError(f"text is longer than {MAX_TEXT_CHARS} characters")
    secret = body.get("secret", False)
    if not isinstance(secret, bool):
        raise ActionError("'secret' must be true or false")
    return Type(text=text, secret=secret)


def _click(body: Mapping[str, Any], count: int | None = None) -> Click:
    x, y = _xy(body, required=False)
    n = count if count is not None else _int(body, "count", default=1)
    if not 1 <= n <= 3:
        raise ActionError(f"'count' must be 1, 2 or 3, got {n}")
    return Click(x=x, y=y, button=_button(body), count=n, hold=_hold(body))


def _drag(body: Mapping[str, Any]) -> Drag:
    path = body.get("path")
    if not isinstance(path, list) or len(path) < 2:
        raise ActionError("'path' must be a list of at least two [x, y] points")
    return Drag(path=tuple(_point(p) for p in path), button=_button(body), hold=_hold(body))


def _wait(body: Mapping[str, Any]) -> Wait:
    ms = _int(body, "ms")
    if not 0 <= ms <= MAX_WAIT_MS:
        raise ActionError(f"'ms' must be within 0..{MAX_WAIT_MS}")
    return Wait(ms=ms)


def _hold_key(body: Mapping[str, Any]) -> HoldKey:
    ms = _int(body, "duration_ms")
    if not 0 <= ms <= MAX_WAIT_MS:
        raise ActionError(f"'duration_ms' must be within 0..{MAX_WAIT_MS}")
    return HoldKey(combo=parse_combo(_str(body, "keys")), duration_ms=ms)


def _scroll(body: Mapping[str, Any]) -> Scroll:
    x, y = _xy(body, required=False)
    dx, dy = _int(body, "dx", default=0), _int(body, "dy", default=0)
    if abs(dx) > 100 or abs(dy) > 100:
        raise ActionError("'dx' and 'dy' must be within -100..100 notches")
    return Scroll(x=x, y=y, dx=dx, dy=dy, hold=_hold(body))


def _zoom(body: Mapping[str, Any]) -> Zoom:
    region = body.get("region")
    if not isinstance(region, list) or len(region) != 4:
        raise ActionError("'region' must be [x0, y0, x1, y1]")
    x0, y0 = _point(region[:2])
    x1, y1 = _point(region[2:])
    if x1 <= x0 or y1 <= y0:
        raise ActionError("'region' must have x1 > x0 and y1 > y0")
    return Zoom(x0=x0, y0=y0, x1=x1, y1=y1)


def _mouse(kind: type[MouseDown] | type[MouseUp]) -> Callable[[Mapping[str, Any]], Action]:
    def parse(body: Mapping[str, Any]) -> Action:
        x, y = _xy(body, required=False)
        return kind(button=_button(body), x=x, y=y)

    return parse


def _move(body: Mapping[str, Any]) -> Move:
    x, y = _xy(body, required=True)
    assert x is not None and y is not None
    return Move(x=x, y=y, hold=_hold(body))


_PARSERS: dict[str, Callable[[Mapping[str, Any]], Action]] = {
    "screenshot": lambda b: Screenshot(),
    "zoom": _zoom,
    "move": _move,
    "click": _click,
    "double_click": lambda b: _click(b, 2),
    "triple_click": lambda b: _click(b, 3),
    "mouse_down": _mouse(MouseDown),
    "mouse_up": _mouse(MouseUp),
    "drag": _drag,
    "scroll": _scroll,
    "type": _text,
    "key": lambda b: Key(combos=parse_combos(_str(b, "keys"))),
    "hold_key": _hold_key,
    "wait": _wait,
    "cursor_position": lambda b: CursorPosition(),
}


def _guest_parser(name: str) -> Callable[[Mapping[str, Any]], Action]:
    def parse(body: Mapping[str, Any]) -> Action:
        return parse_guest_action(name, body)

    return parse


for _guest in GUEST_ACTIONS:
    _PARSERS[_guest] = _guest_parser(_guest)

DESKVM_ACTIONS: tuple[str, ...] = tuple(sorted(_PARSERS))

_POINTER = frozenset({"x", "y"})
# The parameters each action takes: anything else is refused, so that a misspelt
# parameter ("buton") is an error instead of a silent default (a left click).
_PARAMETERS: dict[str, frozenset[str]] = {
    "screenshot": frozenset(),
    "zoom": frozenset({"region"}),
    "move": _POINTER | {"hold"},
    "click": _POINTER | {"button", "count", "hold"},
    "double_click": _POINTER | {"button", "hold"},
    "triple_click": _POINTER | {"button", "hold"},
    "mouse_down": _POINTER | {"button"},
    "mouse_up": _POINTER | {"button"},
    "drag": frozenset({"path", "button", "hold"}),
    "scroll": _POINTER | {"dx", "dy", "hold"},
    "type": frozenset({"text", "secret"}),
    "key": frozenset({"keys"}),
    "hold_key": frozenset({"keys", "duration_ms"}),
    "wait": frozenset({"ms"}),
    "cursor_position": frozenset(),
    **GUEST_PARAMETERS,
}


def parse_deskvm_action(body: Mapping[str, Any]) -> Action:
    """Parse the body of a ``schema=deskvm`` request into an :class:`Action`.

    Raises:
        ProtocolError: code ``unknown_action`` (message lists the supported actions),
            ``unknown_parameter`` (a parameter the action does not take, named),
            ``missing_parameter`` or ``invalid_action``.
    """
    name = body.get("action")
    if name is None:
        raise ProtocolError(
            "missing 'action'; supported: " + ", ".join(DESKVM_ACTIONS), code="unknown_action"
        )
    if not isinstance(name, str):
        raise ProtocolError(
            f"'action' must be a string, got {type(name).__name__}; supported: "
            + ", ".join(DESKVM_ACTIONS),
            code="unknown_action",
        )
    parser = _PARSERS.get(name)
    if parser is None:
        raise ProtocolError(
            f"unknown action {name!r}; supported: " + ", ".join(DESKVM_ACTIONS),
            code="unknown_action",
        )
    unknown = sorted(set(body) - _PARAMETERS[name] - {"action"})
    if unknown:
        allowed = ", ".join(sorted(_PARAMETERS[name])) or "none"
        raise ActionError(
            f"{name} does not take {', '.join(map(repr, unknown))}; its parameters: {allowed}",
            code="unknown_parameter",
        )
    return parser(body)


def _points(action: Action) -> list[Point]:
    match action:
        case Move(x=x, y=y):
            return [(x, y)]
        case Click(x=x, y=y) | Scroll(x=x, y=y) | MouseDown(x=x, y=y) | MouseUp(x=x, y=y):
            return [] if x is None or y is None else [(x, y)]
        case Drag(path=path):
            return list(path)
        case Zoom(x0=x0, y0=y0, x1=x1, y1=y1):
            return [(x0, y0), (x1 - 1, y1 - 1)]
        case _:
            return []


def check_bounds(action: Action, width_px: int, height_px: int) -> None:
    """Check that every coordinate of ``action`` lies on a ``width_px`` x ``height_px`` screen.

    Raises:
        ActionError: code ``out_of_screen`` naming the first offending point.
    """
    if isinstance(action, Zoom):
        x0, y0, x1, y1 = action.x0, action.y0, action.x1, action.y1
        if not (0 <= x0 < x1 <= width_px and 0 <= y0 < y1 <= height_px):
            raise ActionError(
                f"zoom region [{x0}, {y0}, {x1}, {y1}] is not inside the "
                f"{width_px}x{height_px} screen (x0 < x1 <= {width_px}, y0 < y1 <= "
                f"{height_px}; x1 and y1 are exclusive)",
                code="out_of_screen",
            )
        return
    for x, y in _points(action):
        if not (0 <= x < width_px and 0 <= y < height_px):
            raise ActionError(
                f"point ({x}, {y}) is outside the {width_px}x{height_px} screen "
                f"(valid x 0..{width_px - 1}, y 0..{height_px - 1})",
                code="out_of_screen",
            )
