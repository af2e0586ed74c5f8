"""deskvm's own action vocabulary: frozen values, no I/O.

Coordinates are display pixels of the session's screen (origin top-left, x to the right,
y down), integers in ``0..width_px-1`` / ``0..height_px-1``. Scroll amounts are wheel
notches ("clicks"); positive ``dy`` scrolls down, positive ``dx`` scrolls right.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, TypeAlias

from agent_bridge.protocol.guest import (
    GUEST_ACTION_NAMES,
    A11yTree,
    ClipboardGet,
    ClipboardSet,
    Exec,
    GetFile,
    GuestAction,
    ListWindows,
    PutFile,
    SetResolution,
    WindowActivate,
    WindowClose,
    guest_record,
)
from agent_bridge.protocol.keys import KeyCombo
from orchestrator.errors import ActionError

__all__ = [
    "ACTION_KINDS",
    "MAX_WAIT_MS",
    "Action",
    "Button",
    "Click",
    "CursorPosition",
    "Drag",
    "HoldKey",
    "Key",
    "MouseDown",
    "MouseUp",
    "Move",
    "Point",
    "Screenshot",
    "Scroll",
    "Type",
    "Wait",
    "Zoom",
    "action_name",
    "action_to_dict",
    "is_guest_action",
]

MAX_WAIT_MS = 60_000

# C0 controls except \t \n \r, DEL, C1 controls, and surrogates (never characters).
_UNTYPEABLE_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")

Point: TypeAlias = tuple[int, int]


class Button(StrEnum):
    """Pointer buttons, named as QEMU's QMP ``InputButton`` enum names them."""

    LEFT = "left"
    MIDDLE = "middle"
    RIGHT = "right"
    BACK = "side"
    FORWARD = "extra"

    @classmethod
    def parse(cls, name: str) -> Button:
        aliases = {"back": cls.BACK, "forward": cls.FORWARD, "wheel": cls.MIDDLE}
        key = name.strip().lower()
        if key in aliases:
            return aliases[key]
        try:
            return cls(key)
        except ValueError:
            names = ", ".join(["left", "middle", "right", "back", "forward"])
            raise ActionError(f"unknown button {name!r}; supported: {names}") from None


@dataclass(frozen=True, slots=True)
class Screenshot:
    """Capture the screen. Result: PNG of the whole display (or scaled, see session)."""


@dataclass(frozen=True, slots=True)
class Zoom:
    """A full-resolution crop of the region ``[x0, x1) x [y0, y1)`` in display pixels."""

    x0: int
    y0: int
    x1: int
    y1: int


@dataclass(frozen=True, slots=True)
class Move:
    """Move the absolute pointer to ``(x, y)``.

    ``hold`` keys are pressed before the move and released after it (OpenAI's batched
    ``move`` with ``keys``).
    """

    x: int
    y: int
    hold: KeyCombo | None = None


@dataclass(frozen=True, slots=True)
class Click:
    """Press and release ``button`` ``count`` times (2 = double click) at ``(x, y)``.

    ``x``/``y`` of ``None`` clicks where the pointer is. ``hold`` keys are held down during
    the click (e.g. shift-click) and released afterwards.
    """

    x: int | None
    y: int | None
    button: Button = Button.LEFT
    count: int = 1
    hold: KeyCombo | None = None


@dataclass(frozen=True, slots=True)
class MouseDown:
    """Press ``button`` (at ``(x, y)`` if given) and keep it down."""

    button: Button = Button.LEFT
    x: int | None = None
    y: int | None = None


@dataclass(frozen=True, slots=True)
class MouseUp:
    """Release ``button`` (at ``(x, y)`` if given)."""

    button: Button = Button.LEFT
    x: int | None = None
    y: int | None = None


@dataclass(frozen=True, slots=True)
class Drag:
    """Press ``button`` at ``path[0]``, move through every point, release at ``path[-1]``.

    ``hold`` keys are pressed before the button and released after it (e.g. a shift-drag
    extends a selection; OpenAI's batched ``drag`` with ``keys``).
    """

    path: tuple[Point, ...]
    button: Button = Button.LEFT
    hold: KeyCombo | None = None


@dataclass(frozen=True, slots=True)
class Scroll:
    """Move to ``(x, y)`` (if given) and turn the wheel ``dy`` notches down, ``dx`` right.

    Negative values scroll up / left. ``hold`` keys are held during the scroll.
    """

    x: int | None
    y: int | None
    dx: int = 0
    dy: int = 0
    hold: KeyCombo | None = None


@dataclass(frozen=True, slots=True)
class Type:
    """Type ``text`` as keystrokes. ``\\n`` and ``\\r`` are Return, ``\\t`` is Tab.

    Any other Unicode character may appear (those with no key on the guest's US layout are
    typed by the guest helper). Other control characters (C0, DEL, C1) and unpaired
    surrogates are refused: send keys such as Escape with :class:`Key`.

    ``secret`` text is recorded as its length and a keyed hash only.

    Raises:
        ActionError: ``invalid_action``: a control character or unpaired surrogate.
    """

    text: str
    secret: bool = False

    def __post_init__(self) -> None:
        bad = _UNTYPEABLE_CONTROL.search(self.text)
        if bad is None:
            return
        cp = ord(bad.group())
        what = "an unpaired surrogate" if 0xD800 <= cp <= 0xDFFF else "the control character"
        named = "" if self.secret else f" U+{cp:04X}"
        raise ActionError(
            f"text has {what}{named} at index {bad.start()}: only \\t, \\n and \\r are "
            "typed as keys (send others, e.g. Escape, with the key action)"
        )


@dataclass(frozen=True, slots=True)
class Key:
    """Press one or more key combos in order (``"ctrl+shift+t"``, ``"ctrl+a ctrl+c"``)."""

    combos: tuple[KeyCombo, ...]


@dataclass(frozen=True, slots=True)
class HoldKey:
    """Hold ``combo`` down for ``duration_ms`` milliseconds, then release it."""

    combo: KeyCombo
    duration_ms: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Do nothing for ``ms`` milliseconds (the reply comes after the wait)."""

    ms: int


@dataclass(frozen=True, slots=True)
class CursorPosition:
    """Report where the pointer is (as last placed by the host)."""


Action: TypeAlias = (
    Screenshot
    | Zoom
    | Move
    | Click
    | MouseDown
    | MouseUp
    | Drag
    | Scroll
    | Type
    | Key
    | HoldKey
    | Wait
    | CursorPosition
    | GuestAction
)


_NAMES: dict[type, str] = {
    Screenshot: "screenshot",
    Zoom: "zoom",
    Move: "move",
    Click: "click",
    MouseDown: "mouse_down",
    MouseUp: "mouse_up",
    Drag: "drag",
    Scroll: "scroll",
    Type: "type",
    Key: "key",
    HoldKey: "hold_key",
    Wait: "wait",
    CursorPosition: "cursor_position",
}
_GUEST_TYPES = (
    Exec, PutFile, GetFile, ClipboardGet, ClipboardSet, ListWindows, WindowActivate,
    WindowClose, A11yTree, SetResolution,
)  # fmt: skip
_NAMES.update(GUEST_ACTION_NAMES)


ACTION_KINDS: frozenset[str] = frozenset(_NAMES.values())
"""Every deskvm action kind (what :func:`action_name` returns): the names approval rules
match, whatever vocabulary the agent speaks."""


def action_name(action: Action) -> str:
    """The deskvm name of an action's kind (``"click"``, ``"type"``, ``"exec"``...)."""
    return _NAMES[type(action)]


def is_guest_action(action: Action) -> bool:
    """Whether ``action`` is a guest control action (:mod:`agent_bridge.protocol.guest`)."""
    return isinstance(action, _GUEST_TYPES)


def action_to_dict(action: Action) -> dict[str, Any]:
    """A JSON-ready description of ``action`` (for recordings and logs).

    ``{"action": name, ...fields}``; key combos as ``"ctrl+shift+t"`` strings (qcodes),
    points as ``[x, y]`` lists, secret text replaced by its length. Guest control actions
    as :func:`~agent_bridge.protocol.guest.guest_record` (sizes and hashes, no contents).
    """
    if isinstance(action, _GUEST_TYPES):
        return guest_record(action)
    out: dict[str, Any] = {"action": action_name(action)}
    for f in fields(action):
        value = getattr(action, f.name)
        if isinstance(value, KeyCombo):
            value = str(value)
        elif isinstance(value, tuple):
            value = [str(v) if isinstance(v, KeyCombo) else list(v) for v in value]
        elif isinstance(value, Button):
            value = value.value
        out[f.name] = value
    if isinstance(action, Type) and action.secret:
        out["text"] = None
        out["length"] = len(action.text)
    return out
