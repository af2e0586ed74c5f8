"""``schema=openai``: OpenAI's computer-use tool (Responses API ``computer_call`` items).

Two request forms are accepted, each exactly as the model emits it:

* the single-action form of ``computer-use-preview``: the body is the call's ``action``
  object, e.g. ``{"type": "click", "x": 10, "y": 20, "button": "left"}``;
* the batched form: the body carries the call's ``actions`` list,
  ``{"actions": [{"type": "click", ...}, {"type": "type", "text": "hi"}]}``, where
  pointer actions may name modifier ``keys`` held during them.

A whole ``computer_call`` item (``{"type": "computer_call", "action": {...}}`` or with
``"actions"``) is unwrapped too.

Actions and OpenAI's parameters: ``click`` (``x``, ``y``, ``button`` one of ``left``,
``right``, ``wheel``, ``back``, ``forward``), ``double_click`` (``x``, ``y``), ``drag``
(``path``: ``[{"x", "y"}, ...]``), ``keypress`` (``keys``: names pressed together, e.g.
``["CTRL", "C"]``), ``move`` (``x``, ``y``), ``scroll`` (``x``, ``y``, ``scroll_x``,
``scroll_y`` in pixels, positive = right / down), ``type`` (``text``), ``wait`` (no
parameter), ``screenshot``. Coordinates are integer screenshot pixels.

Scroll pixels to wheel notches: OpenAI gives scroll distances in pixels, deskvm turns a
wheel. One notch is ``scroll_px_per_notch`` pixels (default 100, what browsers scroll per
notch); the count is rounded half up, and any non-zero distance turns at least one notch so
a small scroll is never lost. The sign is kept.

Every call's output must be a screenshot, so :meth:`OpenAIVocabulary.parse` ends every
request with a :class:`Screenshot`; the result is the ``computer_call_output`` item without
its ``call_id`` (the client adds it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent_bridge.protocol.actions import (
    Action,
    Button,
    Click,
    Drag,
    Key,
    Move,
    Point,
    Screenshot,
    Scroll,
    Type,
    Wait,
)
from agent_bridge.protocol.keys import KeyCombo, key_to_combo, parse_combo
from agent_bridge.protocol.results import Result
from agent_bridge.protocol.vocab._base import (
    MAX_SCROLL_NOTCHES,
    b64,
    combo_of,
    last_image,
    read_pixel,
    read_text,
    unknown_action,
)
from orchestrator.errors import ActionError, ProtocolError

__all__ = ["MAX_BATCH_ACTIONS", "OPENAI_ACTIONS", "OpenAIVocabulary", "openai_key"]

OPENAI_ACTIONS: tuple[str, ...] = (
    "click",
    "double_click",
    "drag",
    "keypress",
    "move",
    "scroll",
    "type",
    "wait",
    "screenshot",
)
"""OpenAI ``computer_call`` action types."""

MAX_BATCH_ACTIONS = 100
"""Most actions one batched ``computer_call`` may carry."""

# OpenAI key names whose meaning differs from the X11 reading of the same word.
_KEY_ALIASES: Mapping[str, str] = {"meta": "super", "os": "super"}


def openai_key(name: str) -> KeyCombo:
    """One key as OpenAI's models name it (``"CTRL"``, ``"ENTER"``, ``"ARROWLEFT"``, ``"c"``).

    Case-insensitive; ``META`` is the Command/Windows key (X11 ``Super``), as in the
    browsers OpenAI's samples drive. An element such as ``"ctrl+c"`` is read as a combo.

    Raises:
        ActionError: code ``unknown_key``.
    """
    lowered = name.strip().lower()
    if lowered in _KEY_ALIASES:
        return key_to_combo(_KEY_ALIASES[lowered])
    if len(name) > 1 and "+" in name:
        return parse_combo(name)
    return key_to_combo(name)


def _int_xy(obj: Mapping[str, Any], where: str) -> Point:
    for name in ("x", "y"):
        if obj.get(name) is None:
            raise ActionError(f"{where}: missing parameter {name!r}", code="missing_parameter")
    return (
        read_pixel(obj["x"], "x", where, round_to_pixel=False),
        read_pixel(obj["y"], "y", where, round_to_pixel=False),
    )


def _held(obj: Mapping[str, Any], where: str) -> KeyCombo | None:
    keys = obj.get("keys")
    if keys is None or keys == []:
        return None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ActionError(f"{where}: 'keys' must be a list of key names, got {keys!r}")
    return combo_of(keys, alias=openai_key)


def _button(obj: Mapping[str, Any], where: str) -> Button:
    value = obj.get("button", "left")
    if not isinstance(value, str):
        raise ActionError(f"{where}: 'button' must be a string, got {value!r}")
    try:
        return Button.parse(value)
    except ActionError as exc:
        raise ActionError(f"{where}: {exc.message}", code=exc.code) from None


@dataclass(frozen=True, slots=True)
class OpenAIVocabulary:
    """OpenAI's computer-use actions, preview and batched forms (see the module docstring).

    Attributes:
        scroll_px_per_notch: pixels of ``scroll_x`` / ``scroll_y`` per wheel notch.
        wait_ms: how long ``wait`` (which has no duration) waits; 2 s, as OpenAI's samples.
    """

    name: str = "openai"
    supported: tuple[str, ...] = OPENAI_ACTIONS
    scroll_px_per_notch: int = 100
    wait_ms: int = 2000

    def notches(self, pixels: int, where: str, name: str) -> int:
        """Wheel notches for a scroll of ``pixels`` (see the module docstring).

        Raises:
            ActionError: more than ``MAX_SCROLL_NOTCHES`` notches.
        """
        if pixels == 0:
            return 0
        per = self.scroll_px_per_notch
        count = max(1, (abs(pixels) + per // 2) // per)
        if count > MAX_SCROLL_NOTCHES:
            raise ActionError(
                f"{where}: {name!r} of {pixels} px is {count} wheel notches of {per} px; "
                f"at most {MAX_SCROLL_NOTCHES} notches per scroll"
            )
        return count if pixels > 0 else -count

    def _one(self, obj: object, where: str) -> tuple[Action, ...]:
        if not isinstance(obj, Mapping):
            raise ActionError(f"{where}: an action must be an object, got {obj!r}")
        kind = obj.get("type")
        parser = self._parsers().get(kind) if isinstance(kind, str) else None
        if parser is None:
            raise unknown_action(
                self.name, kind, self.supported, why=f"{where}: unknown action type {kind!r}"
            )
        return parser(obj, where)

    def _parsers(self) -> dict[str, Callable[[Mapping[str, Any], str], tuple[Action, ...]]]:
        return {
            "click": self._click,
            "double_click": self._double_click,
            "drag": self._drag,
            "keypress": self._keypress,
            "move": self._move,
            "scroll": self._scroll,
            "type": lambda o, w: (Type(text=read_text(o, "text", w)),),
            "wait": lambda o, w: (Wait(ms=self.wait_ms),),
            "screenshot": lambda o, w: (),
        }

    def _click(self, obj: Mapping[str, Any], where: str) -> tuple[Action, ...]:
        x, y = _int_xy(obj, where)
        return (Click(x=x, y=y, button=_button(obj, where), hold=_held(obj, where)),)

    def _double_click(self, obj: Mapping[str, Any], where: str) -> tuple[Action, ...]:
        x, y = _int_xy(obj, where)
        return (Click(x=x, y=y, button=_button(obj, where), count=2, hold=_held(obj, where)),)

    def _drag(self, obj: Mapping[str, Any], where: str) -> tuple[Action, ...]:
        path = obj.get("path")
        if path is None:
            raise ActionError(f"{where}: missing parameter 'path'", code="missing_parameter")
        if not isinstance(path, list) or len(path) < 2:
            raise ActionError(f"{where}: 'path' must be a list of at least two {{x, y}} points")
        points: list[Point] = []
        for i, point in enumerate(path):
            if not isinstance(point, Mapping):
                raise ActionError(f"{where}: 'path[{i}]' must be an object {{x, y}}, got {point!r}")
            points.append(_int_xy(point, f"{where} path[{i}]"))
        return (Drag(path=tuple(points), hold=_held(obj, where)),)

    def _keypress(self, obj: Mapping[str, Any], where: str) -> tuple[Action, ...]:
        keys = obj.get("keys")
        if keys is None:
            raise ActionError(f"{where}: missing parameter 'keys'", code="missing_parameter")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ActionError(f"{where}: 'keys' must be a list of key names, got {keys!r}")
        return (Key(combos=(combo_of(keys, alias=openai_key),)),)

    def _move(self, obj: Mapping[str, Any], where: str) -> tuple[Action, ...]:
        x, y = _int_xy(obj, where)
        return (Move(x=x, y=y, hold=_held(obj, where)),)

    def _scroll(self, obj: Mapping[str, Any], where: str) -> tuple[Action, ...]:
        x, y = _int_xy(obj, where)
        px = {
            name: read_pixel(obj.get(name, 0), name, where, round_to_pixel=False)
            for name in ("scroll_x", "scroll_y")
        }
        dx = self.notches(px["scroll_x"], where, "scroll_x")
        dy = self.notches(px["scroll_y"], where, "scroll_y")
        return (Scroll(x=x, y=y, dx=dx, dy=dy, hold=_held(obj, where)),)

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]:
        """Parse one OpenAI action or a batch of them; a :class:`Screenshot` always ends it.

        Raises:
            ProtocolError: code ``unknown_action`` naming the offending action (and its index
                in a batch); ``ActionError`` for a missing or malformed parameter, a key
                name deskvm does not know.
        """
        if body.get("type") == "computer_call":
            inner = body.get("actions", body.get("action"))
            return self._parse_payload(inner, batched="actions" in body)
        if "actions" in body:
            return self._parse_payload(body["actions"], batched=True)
        return self._parse_payload(body, batched=False)

    def _parse_payload(self, payload: object, *, batched: bool) -> tuple[Action, ...]:
        actions: list[Action] = []
        if batched:
            if not isinstance(payload, list) or not payload:
                raise ActionError("'actions' must be a non-empty list of actions")
            if len(payload) > MAX_BATCH_ACTIONS:
                raise ActionError(f"'actions' holds more than {MAX_BATCH_ACTIONS} actions")
            for i, obj in enumerate(payload):
                kind = obj.get("type") if isinstance(obj, Mapping) else None
                actions.extend(self._one(obj, f"actions[{i}] ({kind})"))
        else:
            kind = payload.get("type") if isinstance(payload, Mapping) else None
            actions.extend(self._one(payload, str(kind)))
        return (*actions, Screenshot())

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        """The ``computer_call_output`` item (without ``call_id``) carrying the last screenshot.

        Returns:
            ``{"type": "computer_call_output", "output": {"type": "computer_screenshot",
            "image_url": "data:image/png;base64,..."}}``.

        Raises:
            ProtocolError: code ``missing_screenshot`` if ``results`` hold no image (the
                server did not run the screenshot :meth:`parse` asked for).
        """
        image = last_image(results)
        if image is None:
            raise ProtocolError(
                "an OpenAI computer_call_output needs a screenshot and none was taken",
                code="missing_screenshot",
            )
        return {
            "type": "computer_call_output",
            "output": {
                "type": "computer_screenshot",
                "image_url": f"data:{image.mime};base64,{b64(image.data)}",
            },
        }
