"""Anthropic's computer-use tool, versions ``computer_20241022`` / ``_20250124`` / ``_20251124``.

The request body is the ``input`` of the model's ``tool_use`` block, as is::

    {"action": "left_click", "coordinate": [10, 20], "text": "shift"}

Parameters (Anthropic's names): ``coordinate`` ``[x, y]`` and ``start_coordinate`` in
screenshot pixels (integers); ``text`` (text to type, the xdotool key spec for ``key`` and
``hold_key``, or the modifier keys held during a click or a scroll); ``scroll_direction``
(``up``/``down``/``left``/``right``) and ``scroll_amount`` (wheel notches); ``duration``
(seconds, for ``hold_key`` and ``wait``); ``region`` ``[x0, y0, x1, y1]`` (``zoom``).

Actions by version (each version keeps the previous ones):

* ``computer_20241022``: ``key``, ``type``, ``mouse_move``, ``left_click``,
  ``left_click_drag``, ``right_click``, ``middle_click``, ``double_click``,
  ``screenshot``, ``cursor_position``.
* ``computer_20250124`` adds ``left_mouse_down``, ``left_mouse_up``, ``scroll``,
  ``hold_key``, ``wait``, ``triple_click``.
* ``computer_20251124`` adds ``zoom``.

The tool result is the ``tool_result`` block without its ``tool_use_id`` (the client adds
it): ``{"type": "tool_result", "content": [blocks]}`` with base64 image blocks and text
blocks as the Messages API expects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
from agent_bridge.protocol.keys import KeyCombo, parse_combo, parse_combos
from agent_bridge.protocol.results import CursorResult, ImageResult, Result
from agent_bridge.protocol.vocab._base import (
    MAX_SCROLL_NOTCHES,
    b64,
    read_number,
    read_pixel,
    read_point,
    read_str,
    read_text,
    seconds_to_ms,
    unknown_action,
)
from orchestrator.errors import ActionError

__all__ = [
    "ACTIONS_BY_VERSION",
    "AnthropicVersion",
    "AnthropicVocabulary",
]

AnthropicVersion = Literal["computer_20241022", "computer_20250124", "computer_20251124"]

_V20241022 = (
    "key",
    "type",
    "mouse_move",
    "left_click",
    "left_click_drag",
    "right_click",
    "middle_click",
    "double_click",
    "screenshot",
    "cursor_position",
)
_V20250124 = (
    *_V20241022,
    "left_mouse_down",
    "left_mouse_up",
    "scroll",
    "hold_key",
    "wait",
    "triple_click",
)
_V20251124 = (*_V20250124, "zoom")

ACTIONS_BY_VERSION: Mapping[AnthropicVersion, tuple[str, ...]] = {
    "computer_20241022": _V20241022,
    "computer_20250124": _V20250124,
    "computer_20251124": _V20251124,
}
"""Action names each Anthropic computer tool version accepts."""

_NO_SCREENSHOT_AFTER = frozenset({"screenshot", "zoom", "cursor_position"})
_SCROLL_SIGNS: Mapping[str, tuple[int, int]] = {
    "up": (0, -1),
    "down": (0, 1),
    "left": (-1, 0),
    "right": (1, 0),
}
_CLICKS: Mapping[str, tuple[Button, int]] = {
    "left_click": (Button.LEFT, 1),
    "right_click": (Button.RIGHT, 1),
    "middle_click": (Button.MIDDLE, 1),
    "double_click": (Button.LEFT, 2),
    "triple_click": (Button.LEFT, 3),
}


def _coordinate(
    body: Mapping[str, Any], where: str, *, required: bool
) -> tuple[int | None, int | None]:
    value = body.get("coordinate")
    if value is None:
        if required:
            raise ActionError(f"{where}: missing parameter 'coordinate'", code="missing_parameter")
        return None, None
    return read_point(value, "coordinate", where, round_to_pixel=False)


def _held(body: Mapping[str, Any], where: str) -> KeyCombo | None:
    """Anthropic's ``text`` on a click or scroll: modifier keys held during it."""
    if body.get("text") is None:
        return None
    return parse_combo(read_str(body, "text", where))


def _click(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    button, count = _CLICKS[name]
    x, y = _coordinate(body, name, required=False)
    return (Click(x=x, y=y, button=button, count=count, hold=_held(body, name)),)


def _drag(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    x, y = _coordinate(body, name, required=True)
    assert x is not None and y is not None
    start = body.get("start_coordinate")
    if start is None:
        # computer_20241022 drags from wherever the pointer is.
        return (MouseDown(Button.LEFT), Move(x, y), MouseUp(Button.LEFT, x, y))
    sx, sy = read_point(start, "start_coordinate", name, round_to_pixel=False)
    return (Drag(path=((sx, sy), (x, y)), button=Button.LEFT),)


def _mouse_move(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    x, y = _coordinate(body, name, required=True)
    assert x is not None and y is not None
    return (Move(x, y),)


def _mouse_button(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    x, y = _coordinate(body, name, required=False)
    if name == "left_mouse_down":
        return (MouseDown(Button.LEFT, x, y),)
    return (MouseUp(Button.LEFT, x, y),)


def _scroll(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    direction = read_str(body, "scroll_direction", name)
    if direction not in _SCROLL_SIGNS:
        raise ActionError(
            f"{name}: 'scroll_direction' must be one of up, down, left, right; got {direction!r}"
        )
    amount_f = read_number(body, "scroll_amount", name)
    if not amount_f.is_integer() or not 0 <= amount_f <= MAX_SCROLL_NOTCHES:
        raise ActionError(
            f"{name}: 'scroll_amount' must be a whole number of wheel notches within "
            f"0..{MAX_SCROLL_NOTCHES}, got {body.get('scroll_amount')!r}"
        )
    amount = int(amount_f)
    sx, sy = _SCROLL_SIGNS[direction]
    x, y = _coordinate(body, name, required=False)
    return (Scroll(x=x, y=y, dx=sx * amount, dy=sy * amount, hold=_held(body, name)),)


def _key(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    return (Key(combos=parse_combos(read_str(body, "text", name))),)


def _hold_key(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    combo = parse_combo(read_str(body, "text", name))
    ms = seconds_to_ms(read_number(body, "duration", name), "duration", name)
    return (HoldKey(combo=combo, duration_ms=ms),)


def _wait(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    return (Wait(ms=seconds_to_ms(read_number(body, "duration", name), "duration", name)),)


def _zoom(name: str, body: Mapping[str, Any]) -> tuple[Action, ...]:
    region = body.get("region")
    if region is None:
        raise ActionError(f"{name}: missing parameter 'region'", code="missing_parameter")
    if not isinstance(region, list | tuple) or len(region) != 4:
        raise ActionError(f"{name}: 'region' must be [x0, y0, x1, y1], got {region!r}")
    x0, y0, x1, y1 = (
        read_pixel(v, f"region[{i}]", name, round_to_pixel=False) for i, v in enumerate(region)
    )
    if x1 <= x0 or y1 <= y0:
        raise ActionError(f"{name}: 'region' must have x1 > x0 and y1 > y0, got {list(region)}")
    return (Zoom(x0=x0, y0=y0, x1=x1, y1=y1),)


_PARSERS: Mapping[str, Callable[[str, Mapping[str, Any]], tuple[Action, ...]]] = {
    "key": _key,
    "type": lambda n, b: (Type(text=read_text(b, "text", n)),),
    "mouse_move": _mouse_move,
    "left_click": _click,
    "right_click": _click,
    "middle_click": _click,
    "double_click": _click,
    "triple_click": _click,
    "left_click_drag": _drag,
    "screenshot": lambda n, b: (Screenshot(),),
    "cursor_position": lambda n, b: (CursorPosition(),),
    "left_mouse_down": _mouse_button,
    "left_mouse_up": _mouse_button,
    "scroll": _scroll,
    "hold_key": _hold_key,
    "wait": _wait,
    "zoom": _zoom,
}


@dataclass(frozen=True, slots=True)
class AnthropicVocabulary:
    """One version of Anthropic's computer-use tool (see the module docstring).

    Attributes:
        name: the tool type, e.g. ``"computer_20250124"``; also the ``schema`` value.
        screenshot_after_action: append a :class:`Screenshot` to every action that does not
            return an image or a position itself, so its tool result carries the screen
            after the action, as Anthropic's reference implementation does.
    """

    name: AnthropicVersion
    screenshot_after_action: bool = True
    supported: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "supported", ACTIONS_BY_VERSION[self.name])

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]:
        """Parse the ``input`` of a ``computer`` tool_use block.

        Raises:
            ProtocolError: code ``unknown_action`` for an action that is not in this
                version (the message says which version added it and lists the supported
                ones); ``ActionError`` for a missing or malformed parameter or key name.
        """
        action = body.get("action")
        if not isinstance(action, str) or action not in _PARSERS:
            raise unknown_action(self.name, action, self.supported)
        if action not in self.supported:
            since = next(v for v, names in ACTIONS_BY_VERSION.items() if action in names)
            raise unknown_action(
                self.name,
                action,
                self.supported,
                why=f"action {action!r} is not in {self.name} (it exists from {since})",
            )
        actions = _PARSERS[action](action, body)
        if self.screenshot_after_action and action not in _NO_SCREENSHOT_AFTER:
            return (*actions, Screenshot())
        return actions

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        """The ``tool_result`` block (without ``tool_use_id``) for the action's results.

        Returns:
            ``{"type": "tool_result", "content": [...]}``: an ``image`` block
            (``{"type": "base64", "media_type", "data"}`` source) per image, a text block
            ``"X=<x>,Y=<y>"`` for ``cursor_position``, and a text block naming the action
            when there is nothing else to say.
        """
        content: list[dict[str, Any]] = []
        for result in results:
            if isinstance(result, ImageResult):
                content.append(
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": result.mime,
                            "data": b64(result.data),
                        },
                    }
                )
            elif isinstance(result, CursorResult):
                content.append({"type": "text", "text": f"X={result.x},Y={result.y}"})
        if not content:
            content.append({"type": "text", "text": f"{body.get('action')} done"})
        return {"type": "tool_result", "content": content}
