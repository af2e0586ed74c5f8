"""``schema=computer_13``: OSWorld's JSON action space (``desktop_env`` ``ACTION_SPACE``).

A request body is one OSWorld action, with its parameters either nested as OSWorld's
controller takes them or flat as models often write them::

    {"action_type": "CLICK", "parameters": {"x": 10, "y": 20, "num_clicks": 2}}
    {"action_type": "CLICK", "x": 10, "y": 20}
    {"action_type": "DONE"}            (or the bare string "DONE" under "action_type")

Actions and OSWorld's parameters: ``MOVE_TO`` (``x``, ``y``), ``CLICK`` (``button`` left /
right / middle, ``x``, ``y``, ``num_clicks`` 1..3, all optional), ``MOUSE_DOWN`` /
``MOUSE_UP`` (``button``), ``RIGHT_CLICK`` / ``DOUBLE_CLICK`` (``x``, ``y`` optional),
``DRAG_TO`` (``x``, ``y``: left-button drag from the pointer), ``SCROLL`` (``dx``, ``dy``
wheel notches with pyautogui's signs: positive ``dy`` scrolls *up*, positive ``dx``
right), ``TYPING`` (``text``), ``PRESS`` (``key``), ``HOTKEY`` (``keys`` list),
``WAIT``, ``FAIL``, ``DONE``. Coordinates may be floats (OSWorld declares them so) and are
rounded to the nearest pixel.

``KEY_DOWN`` / ``KEY_UP`` are refused: deskvm releases every key at the end of each action
so none stays latched, and one request here is one action.

Results follow OSWorld's ``DesktopEnv.step``: ``{"observation": {"screenshot": <base64
PNG>}, "done": bool, "info": {}}``; ``DONE`` and ``FAIL`` end the episode (``done``
true, ``info`` ``{"done": true}`` or ``{"fail": true}``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
from agent_bridge.protocol.keys import KeyCombo, char_to_combo, key_to_combo
from agent_bridge.protocol.results import Result
from agent_bridge.protocol.vocab._base import (
    MAX_SCROLL_NOTCHES,
    b64,
    combo_of,
    last_image,
    read_number,
    read_pixel,
    read_str,
    read_text,
    unknown_action,
)
from orchestrator.errors import ActionError

__all__ = [
    "COMPUTER_13_ACTIONS",
    "OSWORLD_WAIT_MS",
    "Computer13Vocabulary",
    "osworld_key",
    "osworld_step_result",
]

COMPUTER_13_ACTIONS: tuple[str, ...] = (
    "MOVE_TO",
    "CLICK",
    "MOUSE_DOWN",
    "MOUSE_UP",
    "RIGHT_CLICK",
    "DOUBLE_CLICK",
    "DRAG_TO",
    "SCROLL",
    "TYPING",
    "PRESS",
    "HOTKEY",
    "WAIT",
    "FAIL",
    "DONE",
)
"""The OSWorld ``computer_13`` actions deskvm accepts (all but ``KEY_DOWN`` / ``KEY_UP``)."""

OSWORLD_WAIT_MS = 2000
"""How long OSWorld's ``WAIT`` pauses (``DesktopEnv.step``'s default ``pause`` of 2 s)."""

TERMINAL = frozenset({"DONE", "FAIL"})

# pyautogui key names (OSWorld's KEYBOARD_KEYS) that the shared key table spells otherwise.
_PYAUTOGUI_KEYS: Mapping[str, str] = {
    "ctrlleft": "ctrl", "ctrlright": "ctrl_r",
    "shiftleft": "shift", "shiftright": "shift_r",
    "altleft": "alt", "altright": "alt_r",
    "winleft": "super", "winright": "super_r",
    "prtsc": "print", "prtscr": "print", "prntscrn": "print", "printscreen": "print",
    "add": "kp_add", "subtract": "kp_subtract", "multiply": "kp_multiply",
    "divide": "kp_divide", "decimal": "kp_decimal", "separator": "kp_separator",
    **{f"num{n}": f"kp_{n}" for n in range(10)},
}  # fmt: skip


def osworld_key(name: str) -> KeyCombo:
    """One key as pyautogui names it (``"enter"``, ``"ctrlleft"``, ``"num5"``, ``"A"``).

    A single character is typed as pyautogui types it: a shifted character (``"A"``,
    ``"?"``) includes shift.

    Raises:
        ActionError: code ``unknown_key`` or ``untypeable_text``.
    """
    if len(name) == 1:
        return char_to_combo(name)
    lowered = name.lower()
    return key_to_combo(_PYAUTOGUI_KEYS.get(lowered, name))


def osworld_step_result(results: Sequence[Result], *, terminal: str | None) -> dict[str, Any]:
    """OSWorld's step outcome as JSON: observation screenshot (base64), ``done``, ``info``.

    Args:
        results: results of the executed actions; the last image is the observation.
        terminal: ``"DONE"`` or ``"FAIL"`` when the agent ended the episode, else ``None``.
    """
    image = last_image(results)
    info: dict[str, Any] = {}
    if terminal == "DONE":
        info = {"done": True}
    elif terminal == "FAIL":
        info = {"fail": True}
    return {
        "observation": {"screenshot": None if image is None else b64(image.data)},
        "done": terminal is not None,
        "info": info,
    }


def _params(body: Mapping[str, Any]) -> Mapping[str, Any]:
    nested = body.get("parameters")
    if nested is None:
        return body
    if not isinstance(nested, Mapping):
        raise ActionError(f"'parameters' must be an object, got {nested!r}")
    return nested


def _opt_xy(p: Mapping[str, Any], where: str, *, required: bool) -> tuple[int | None, int | None]:
    x, y = p.get("x"), p.get("y")
    if x is None and y is None and not required:
        return None, None
    for name, value in (("x", x), ("y", y)):
        if value is None:
            raise ActionError(f"{where}: missing parameter {name!r}", code="missing_parameter")
    return (
        read_pixel(x, "x", where, round_to_pixel=True),
        read_pixel(y, "y", where, round_to_pixel=True),
    )


def _button(p: Mapping[str, Any], where: str) -> Button:
    value = p.get("button", "left")
    if not isinstance(value, str) or value.lower() not in ("left", "right", "middle"):
        raise ActionError(f"{where}: 'button' must be left, right or middle, got {value!r}")
    return Button.parse(value)


def _click(p: Mapping[str, Any], where: str) -> tuple[Action, ...]:
    x, y = _opt_xy(p, where, required=False)
    count_f = read_number(p, "num_clicks", where) if p.get("num_clicks") is not None else 1.0
    if count_f not in (1.0, 2.0, 3.0):
        raise ActionError(f"{where}: 'num_clicks' must be 1, 2 or 3, got {p.get('num_clicks')!r}")
    return (Click(x=x, y=y, button=_button(p, where), count=int(count_f)),)


def _drag_to(p: Mapping[str, Any], where: str) -> tuple[Action, ...]:
    x, y = _opt_xy(p, where, required=True)
    assert x is not None and y is not None
    return (MouseDown(Button.LEFT), Move(x, y), MouseUp(Button.LEFT, x, y))


def _scroll(p: Mapping[str, Any], where: str) -> tuple[Action, ...]:
    notches: dict[str, int] = {}
    for name in ("dx", "dy"):
        value = read_number(p, name, where)
        if not value.is_integer() or abs(value) > MAX_SCROLL_NOTCHES:
            raise ActionError(
                f"{where}: {name!r} must be a whole number of wheel notches within "
                f"-{MAX_SCROLL_NOTCHES}..{MAX_SCROLL_NOTCHES}, got {p.get(name)!r}"
            )
        notches[name] = int(value)
    # pyautogui (which OSWorld drives) scrolls up for a positive vertical count.
    return (Scroll(x=None, y=None, dx=notches["dx"], dy=-notches["dy"]),)


def _hotkey(p: Mapping[str, Any], where: str) -> tuple[Action, ...]:
    keys = p.get("keys")
    if keys is None:
        raise ActionError(f"{where}: missing parameter 'keys'", code="missing_parameter")
    if isinstance(keys, str):
        keys = keys.split("+") if len(keys) > 1 else [keys]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ActionError(f"{where}: 'keys' must be a list of key names, got {keys!r}")
    return (Key(combos=(combo_of(keys, alias=osworld_key),)),)


_PARSERS: Mapping[str, Callable[[Mapping[str, Any], str], tuple[Action, ...]]] = {
    "MOVE_TO": lambda p, w: (Move(*_req_xy(p, w)),),
    "CLICK": _click,
    "MOUSE_DOWN": lambda p, w: (MouseDown(_button(p, w)),),
    "MOUSE_UP": lambda p, w: (MouseUp(_button(p, w)),),
    "RIGHT_CLICK": lambda p, w: (Click(*_opt_xy(p, w, required=False), button=Button.RIGHT),),
    "DOUBLE_CLICK": lambda p, w: (Click(*_opt_xy(p, w, required=False), count=2),),
    "DRAG_TO": _drag_to,
    "SCROLL": _scroll,
    "TYPING": lambda p, w: (Type(text=read_text(p, "text", w)),),
    "PRESS": lambda p, w: (Key(combos=(osworld_key(read_str(p, "key", w)),)),),
    "HOTKEY": _hotkey,
    "WAIT": lambda p, w: (Wait(ms=OSWORLD_WAIT_MS),),
    "FAIL": lambda p, w: (),
    "DONE": lambda p, w: (),
}


def _req_xy(p: Mapping[str, Any], where: str) -> tuple[int, int]:
    x, y = _opt_xy(p, where, required=True)
    assert x is not None and y is not None
    return x, y


@dataclass(frozen=True, slots=True)
class Computer13Vocabulary:
    """OSWorld's ``computer_13`` actions (see the module docstring).

    Attributes:
        screenshot_after_action: end every request with a :class:`Screenshot`, as OSWorld's
            ``step`` returns an observation after every action.
    """

    name: str = "computer_13"
    supported: tuple[str, ...] = COMPUTER_13_ACTIONS
    screenshot_after_action: bool = True

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]:
        """Parse one OSWorld action.

        Raises:
            ProtocolError: code ``unknown_action`` (``KEY_DOWN`` / ``KEY_UP`` with the reason
                they are refused); ``ActionError`` for a missing or malformed parameter.
        """
        kind = body.get("action_type")
        if kind in ("KEY_DOWN", "KEY_UP"):
            raise unknown_action(
                self.name,
                kind,
                self.supported,
                why=f"{kind} is not supported: deskvm never leaves a key pressed between "
                "actions; use HOTKEY or PRESS (keys go down and up within one action)",
            )
        if not isinstance(kind, str) or kind not in _PARSERS:
            raise unknown_action(self.name, kind, self.supported)
        actions = _PARSERS[kind](_params(body), kind)
        if self.screenshot_after_action or not actions:
            return (*actions, Screenshot())
        return actions

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        """OSWorld's step outcome (see :func:`osworld_step_result`)."""
        kind = body.get("action_type")
        return osworld_step_result(results, terminal=kind if kind in TERMINAL else None)
