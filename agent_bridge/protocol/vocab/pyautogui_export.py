"""deskvm actions written back as OSWorld pyautogui code (for trajectory export).

The inverse of :mod:`agent_bridge.protocol.vocab.pyautogui`: :func:`to_pyautogui` turns one
deskvm action into the code an OSWorld ``pyautogui`` agent would have sent for it
(``import pyautogui`` then calls such as ``pyautogui.click(200, 150)``), or one of OSWorld's
special action strings (``WAIT``). Code written here parses back into the same action
with :func:`~agent_bridge.protocol.vocab.pyautogui.parse_pyautogui` wherever that parser
can express it; a drag over several points comes back as ``mouse_down``, ``move``s and
``mouse_up`` (the same input events), and held keys around a move or a drag are written
with ``keyDown``/``keyUp`` (valid pyautogui, which deskvm's parser refuses to hold).

Pure: builds strings, runs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

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
from agent_bridge.protocol.vocab.osworld import OSWORLD_WAIT_MS

__all__ = ["OBSERVATIONS", "PYAUTOGUI_KEY_NAMES", "pyautogui_key", "to_pyautogui"]

OBSERVATIONS = (Screenshot, Zoom, CursorPosition)
"""Actions that only observe: OSWorld has no action for them (every step observes)."""

_PUNCTUATION = {
    "minus": "-", "equal": "=", "bracket_left": "[", "bracket_right": "]",
    "backslash": "\\", "semicolon": ";", "apostrophe": "'", "grave_accent": "`",
    "comma": ",", "dot": ".", "slash": "/",
}  # fmt: skip

PYAUTOGUI_KEY_NAMES: dict[str, str] = {
    **{c: c for c in "abcdefghijklmnopqrstuvwxyz0123456789"},
    **_PUNCTUATION,
    "spc": "space", "ret": "enter", "kp_enter": "enter", "tab": "tab", "esc": "esc",
    "backspace": "backspace", "delete": "delete", "insert": "insert", "home": "home",
    "end": "end", "pgup": "pageup", "pgdn": "pagedown", "left": "left", "right": "right",
    "up": "up", "down": "down", "compose": "apps", "caps_lock": "capslock",
    "num_lock": "numlock", "scroll_lock": "scrolllock", "print": "printscreen",
    "pause": "pause",
    "ctrl": "ctrl", "ctrl_r": "ctrlright", "shift": "shift", "shift_r": "shiftright",
    "alt": "alt", "alt_r": "altright", "meta_l": "win", "meta_r": "winright",
    "kp_add": "add", "kp_subtract": "subtract", "kp_multiply": "multiply",
    "kp_divide": "divide", "kp_decimal": "decimal", "kp_comma": "separator",
    **{f"f{n}": f"f{n}" for n in range(1, 13)},
    **{f"kp_{n}": f"num{n}" for n in range(10)},
}  # fmt: skip
"""pyautogui's name (``KEYBOARD_KEYS``) for each QEMU qcode deskvm sends."""

_BUTTONS = {Button.LEFT: "left", Button.MIDDLE: "middle", Button.RIGHT: "right"}


def pyautogui_key(qcode: str) -> str | None:
    """pyautogui's name of the key with this qcode (``None``: pyautogui has none)."""
    return PYAUTOGUI_KEY_NAMES.get(qcode)


def _keys(combo: KeyCombo) -> list[str] | None:
    names = [pyautogui_key(q) for q in combo.qcodes]
    return None if any(n is None for n in names) else [str(n) for n in names]


def _args(*positional: object, **keywords: object) -> str:
    parts = [repr(p) for p in positional]
    parts += [f"{k}={v!r}" for k, v in keywords.items() if v is not None]
    return ", ".join(parts)


def _xy(x: int | None, y: int | None) -> tuple[object, ...]:
    return () if x is None or y is None else (x, y)


def _held(hold: KeyCombo | None, body: Iterable[str]) -> list[str] | None:
    if hold is None:
        return list(body)
    names = _keys(hold)
    if names is None:
        return None
    down = [f"pyautogui.keyDown({n!r})" for n in names]
    up = [f"pyautogui.keyUp({n!r})" for n in reversed(names)]
    return [*down, *body, *up]


def _button(button: Button) -> str | None:
    return _BUTTONS.get(button)


def _lines(action: Action) -> list[str] | None:
    """The pyautogui calls for ``action``, or ``None`` if pyautogui cannot express it."""
    match action:
        case Move(x=x, y=y, hold=hold):
            return _held(hold, [f"pyautogui.moveTo({_args(x, y)})"])
        case Click(x=x, y=y, button=button, count=count, hold=hold):
            name = _button(button)
            if name is None:
                return None
            keywords: dict[str, object] = {}
            if count != 1:
                keywords["clicks"] = count
            if name != "left":
                keywords["button"] = name
            return _held(hold, [f"pyautogui.click({_args(*_xy(x, y), **keywords)})"])
        case MouseDown(button=button, x=x, y=y) | MouseUp(button=button, x=x, y=y):
            name = _button(button)
            call = "mouseDown" if isinstance(action, MouseDown) else "mouseUp"
            return None if name is None else [f"pyautogui.{call}({_args(*_xy(x, y), button=name)})"]
        case Drag(path=path, button=button, hold=hold):
            name = _button(button)
            if name is None or not path:
                return None
            (x0, y0), rest = path[0], path[1:]
            body = [f"pyautogui.moveTo({_args(x0, y0)})"]
            if len(rest) == 1:
                body.append(f"pyautogui.dragTo({_args(*rest[0], button=name)})")
            else:
                body.append(f"pyautogui.mouseDown({_args(button=name)})")
                body += [f"pyautogui.moveTo({_args(x, y)})" for x, y in rest]
                body.append(f"pyautogui.mouseUp({_args(*path[-1], button=name)})")
            return _held(hold, body)
        case Scroll(x=x, y=y, dx=dx, dy=dy, hold=hold):
            where = dict(zip(("x", "y"), _xy(x, y), strict=False))
            body = []
            if dy:  # pyautogui: positive clicks scroll up; deskvm: positive dy is down
                body.append(f"pyautogui.scroll({_args(-dy, **where)})")
            if dx:
                body.append(f"pyautogui.hscroll({_args(dx, **where)})")
            return _held(hold, body)
        case Type(text=text):
            return [f"pyautogui.write({text!r})"]
        case Key(combos=combos):
            out = []
            for combo in combos:
                names = _keys(combo)
                if names is None:
                    return None
                if len(names) == 1:
                    out.append(f"pyautogui.press({names[0]!r})")
                else:
                    out.append(f"pyautogui.hotkey({_args(*names)})")
            return out
        case HoldKey(combo=combo, duration_ms=ms):
            return _held(combo, [f"time.sleep({ms / 1000:g})"])
        case Wait(ms=ms):
            return [f"time.sleep({ms / 1000:g})"]
        case _:
            return None


def to_pyautogui(action: Action) -> str | None:
    """The OSWorld ``pyautogui`` action string for one deskvm action.

    Args:
        action: a deskvm action (display pixels, the same as the guest's screen).

    Returns:
        Python source (``import pyautogui`` first, ``import time`` when it sleeps), or
        ``"WAIT"`` for a 2 s wait (OSWorld's special action); ``None`` when pyautogui has
        no way to express the action (observations; the back/forward buttons; a key
        without a pyautogui name).
    """
    if isinstance(action, OBSERVATIONS):
        return None
    if isinstance(action, Wait) and action.ms == OSWORLD_WAIT_MS:
        return "WAIT"
    lines = _lines(action)
    if lines is None:
        return None
    imports = ["import pyautogui"]
    if any(line.startswith("time.") for line in lines):
        imports.append("import time")
    return "\n".join([*imports, *lines])
