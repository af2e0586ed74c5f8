"""Key names, key combos and text, mapped to QEMU qcodes; keyboard layouts.

A *qcode* is a name from QEMU's QMP ``QKeyCode`` enum (``"ctrl"``, ``"a"``, ``"ret"``,
``"kp_enter"``...): the physical key the guest receives through ``input-send-event``.

Parsing names keys as they are on the US layout: a parsed :class:`KeyCombo` means "the keys
that give these keysyms on US" (``ctrl+z`` is ``("ctrl", "z")``). The session's guest may use
another layout (:data:`KEYBOARD_LAYOUTS`); just before injection :func:`layout_combos` maps a
combo to the keys that give the *same keysyms* on that layout (``ctrl+z`` on ``de`` is
``("ctrl", "y")``: undo stays undo) and :func:`text_to_combos` types text with that layout's
keys (``@`` on ``de`` is AltGr+Q, ``^`` the dead circumflex then Space). The per-layout tables
(:mod:`agent_bridge.protocol.layout_tables`) are generated from XKB data by
``python -m vm_images.keyboard_tables``.

Accepted key names (case-insensitive): X11 keysym names as xdotool spells them
(``Return``, ``KP_Enter``, ``Control_L``, ``Super_L``, ``BackSpace``, ``Page_Up``,
``ISO_Left_Tab``, ``F1``..``F12``...), the common spellings agents use (``ctrl``, ``cmd``,
``win``, ``enter``, ``esc``, ``pgdn``, ``ArrowLeft``...) and any single character that has
a key on the US layout (a shifted character such as ``"?"`` implies shift).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from agent_bridge.protocol.layout_tables import TABLES
from orchestrator.errors import ActionError

__all__ = [
    "KEYBOARD_LAYOUTS",
    "MODIFIER_QCODES",
    "KeyCombo",
    "KeyboardLayout",
    "char_to_combo",
    "combo_text",
    "key_to_combo",
    "layout_combos",
    "parse_combo",
    "parse_combos",
    "text_to_combos",
]

KeyboardLayout = Literal["us", "de", "fr"]
"""A guest keyboard layout deskvm types on (XKB layout name, model pc105, no variant)."""

KEYBOARD_LAYOUTS: tuple[str, ...] = get_args(KeyboardLayout)
"""The closed set of :data:`KeyboardLayout` names (each has a generated table)."""
assert set(KEYBOARD_LAYOUTS) == set(TABLES), "layout_tables.py and KeyboardLayout disagree"

MODIFIER_QCODES = frozenset(
    {"shift", "shift_r", "ctrl", "ctrl_r", "alt", "alt_r", "meta_l", "meta_r"}
)


@dataclass(frozen=True, slots=True)
class KeyCombo:
    """Keys pressed together, in press order (modifiers first); released in reverse.

    Attributes:
        qcodes: QEMU ``QKeyCode`` names, e.g. ``("ctrl", "shift", "t")``.
    """

    qcodes: tuple[str, ...]

    def __str__(self) -> str:
        return "+".join(self.qcodes)


# Unshifted and shifted characters on a US layout, by qcode.
_US_KEYS: dict[str, tuple[str, str]] = {
    "grave_accent": ("`", "~"),
    "1": ("1", "!"), "2": ("2", "@"), "3": ("3", "#"), "4": ("4", "$"), "5": ("5", "%"),
    "6": ("6", "^"), "7": ("7", "&"), "8": ("8", "*"), "9": ("9", "("), "0": ("0", ")"),
    "minus": ("-", "_"), "equal": ("=", "+"),
    "bracket_left": ("[", "{"), "bracket_right": ("]", "}"), "backslash": ("\\", "|"),
    "semicolon": (";", ":"), "apostrophe": ("'", '"'),
    "comma": (",", "<"), "dot": (".", ">"), "slash": ("/", "?"),
    "spc": (" ", " "),
}  # fmt: skip
for _letter in "abcdefghijklmnopqrstuvwxyz":
    _US_KEYS[_letter] = (_letter, _letter.upper())

_CHAR_TO_KEY: dict[str, tuple[str, bool]] = {}
for _qcode, (_plain, _shifted) in _US_KEYS.items():
    _CHAR_TO_KEY.setdefault(_plain, (_qcode, False))
    _CHAR_TO_KEY.setdefault(_shifted, (_qcode, True))
_CHAR_TO_KEY["\n"] = ("ret", False)
_CHAR_TO_KEY["\r"] = ("ret", False)
_CHAR_TO_KEY["\t"] = ("tab", False)

# Named keys: lower-cased spelling -> qcode.
_NAMED: dict[str, str] = {
    # modifiers
    "ctrl": "ctrl", "control": "ctrl", "control_l": "ctrl", "ctrl_l": "ctrl", "lctrl": "ctrl",
    "control_r": "ctrl_r", "ctrl_r": "ctrl_r", "rctrl": "ctrl_r",
    "shift": "shift", "shift_l": "shift", "lshift": "shift",
    "shift_r": "shift_r", "rshift": "shift_r",
    "alt": "alt", "alt_l": "alt", "lalt": "alt", "option": "alt",
    "alt_r": "alt_r", "ralt": "alt_r", "altgr": "alt_r", "iso_level3_shift": "alt_r",
    "super": "meta_l", "super_l": "meta_l", "win": "meta_l", "windows": "meta_l",
    "cmd": "meta_l", "command": "meta_l", "meta": "meta_l", "meta_l": "meta_l", "hyper_l": "meta_l",
    "super_r": "meta_r", "meta_r": "meta_r",
    # editing and navigation
    "return": "ret", "enter": "ret", "ret": "ret", "linefeed": "ret",
    "kp_enter": "kp_enter",
    "tab": "tab", "iso_left_tab": "tab",
    "escape": "esc", "esc": "esc",
    "backspace": "backspace", "back_space": "backspace",
    "delete": "delete", "del": "delete",
    "insert": "insert", "ins": "insert",
    "home": "home", "end": "end",
    "page_up": "pgup", "pageup": "pgup", "pgup": "pgup", "prior": "pgup",
    "page_down": "pgdn", "pagedown": "pgdn", "pgdn": "pgdn", "next": "pgdn",
    "left": "left", "arrowleft": "left", "right": "right", "arrowright": "right",
    "up": "up", "arrowup": "up", "down": "down", "arrowdown": "down",
    "space": "spc", "spc": "spc",
    # The PC "Menu" (application) key is Linux KEY_COMPOSE: QEMU qcode "compose" (its qcode
    # "menu" is KEY_MENU, which X maps to XF86MenuKB, and PS/2 had no scancode for it).
    "menu": "compose", "apps": "compose", "compose": "compose",
    "caps_lock": "caps_lock", "capslock": "caps_lock",
    "num_lock": "num_lock", "numlock": "num_lock",
    "scroll_lock": "scroll_lock", "scrolllock": "scroll_lock",
    "print": "print", "printscreen": "print", "sys_req": "sysrq", "pause": "pause",
    # keypad
    "kp_add": "kp_add", "kp_subtract": "kp_subtract", "kp_multiply": "kp_multiply",
    "kp_divide": "kp_divide", "kp_decimal": "kp_decimal", "kp_separator": "kp_comma",
    "kp_equal": "kp_equals",
    # punctuation by keysym name
    "minus": "minus", "equal": "equal", "comma": "comma", "period": "dot", "dot": "dot",
    "slash": "slash", "backslash": "backslash", "semicolon": "semicolon",
    "apostrophe": "apostrophe", "grave": "grave_accent", "quoteleft": "grave_accent",
    "bracketleft": "bracket_left", "bracketright": "bracket_right",
}  # fmt: skip
for _n in range(10):
    _NAMED[f"kp_{_n}"] = f"kp_{_n}"
# F13..F24 are valid keysyms but QEMU 7.2's QKeyCode has no such keys (input-send-event
# refuses them): they are refused here, with that reason, instead of failing at injection.
for _n in range(1, 13):
    _NAMED[f"f{_n}"] = f"f{_n}"
_NO_QCODE = {f"f{_n}" for _n in range(13, 25)}

# Keysym names of shifted characters: these imply shift.
_SHIFTED_NAMES: dict[str, str] = {
    "plus": "+", "asterisk": "*", "exclam": "!", "at": "@", "numbersign": "#",
    "dollar": "$", "percent": "%", "asciicircum": "^", "ampersand": "&",
    "parenleft": "(", "parenright": ")", "underscore": "_", "braceleft": "{",
    "braceright": "}", "bar": "|", "colon": ":", "quotedbl": '"', "less": "<",
    "greater": ">", "question": "?", "asciitilde": "~",
}  # fmt: skip


def char_to_combo(char: str) -> KeyCombo:
    """The keystroke that types ``char`` on a US layout.

    Raises:
        ActionError: ``char`` has no key on the US layout (e.g. ``"ñ"``).
    """
    try:
        qcode, shifted = _CHAR_TO_KEY[char]
    except KeyError:
        raise ActionError(
            f"character {char!r} (U+{ord(char):04X}) has no key on the guest's US keyboard layout",
            code="untypeable_text",
        ) from None
    return KeyCombo(("shift", qcode) if shifted else (qcode,))


def key_to_combo(name: str) -> KeyCombo:
    """One key by name (see module docstring); shifted characters include ``shift``.

    Raises:
        ActionError: unknown key name.
    """
    if len(name) == 1:
        if name.isalpha() and name.isascii():
            return KeyCombo((name.lower(),))
        return char_to_combo(name)
    lowered = name.lower()
    if lowered in _NO_QCODE:
        raise ActionError(
            f"key {name!r} cannot be sent: QEMU's key codes (QKeyCode, 7.2) stop at F12",
            code="unknown_key",
        )
    if lowered in _NAMED:
        return KeyCombo((_NAMED[lowered],))
    if lowered in _SHIFTED_NAMES:
        return char_to_combo(_SHIFTED_NAMES[lowered])
    raise ActionError(f"unknown key name {name!r}", code="unknown_key")


def parse_combo(spec: str) -> KeyCombo:
    """Parse one combo such as ``"ctrl+shift+t"``, ``"Control_L+a"``, ``"ctrl++"``.

    Duplicate keys are pressed once. Returns modifiers first, in the order given.

    Raises:
        ActionError: empty combo or unknown key name.
    """
    text = spec.strip()
    if not text:
        raise ActionError("empty key combo", code="unknown_key")
    parts: list[str] = []
    token = ""
    for i, ch in enumerate(text):
        # A '+' that is a separator sits between two tokens; '+' alone or last is the key.
        if ch == "+" and token and i != len(text) - 1:
            parts.append(token)
            token = ""
        else:
            token += ch
    if token:
        parts.append(token)
    qcodes: list[str] = []
    for part in parts:
        for qcode in key_to_combo(part.strip()).qcodes:
            if qcode not in qcodes:
                qcodes.append(qcode)
    modifiers = [q for q in qcodes if q in MODIFIER_QCODES]
    others = [q for q in qcodes if q not in MODIFIER_QCODES]
    return KeyCombo(tuple(modifiers + others))


def parse_combos(spec: str) -> tuple[KeyCombo, ...]:
    """Parse whitespace-separated combos, xdotool style: ``"ctrl+a ctrl+c"``.

    Raises:
        ActionError: empty input or any unknown key name.
    """
    combos = tuple(parse_combo(part) for part in spec.split())
    if not combos:
        raise ActionError("no keys given", code="unknown_key")
    return combos


def text_to_combos(text: str, layout: str = "us") -> list[KeyCombo]:
    """Keystrokes that type ``text`` on ``layout`` (``\\n`` -> Return, ``\\t`` -> Tab).

    A character that needs a dead key is two keystrokes (``^`` on ``de``: the dead
    circumflex, then Space).

    Args:
        text: the text.
        layout: one of :data:`KEYBOARD_LAYOUTS`.

    Raises:
        ActionError: code ``untypeable_text`` naming the first character with no key on
            ``layout``; ``unknown_layout`` for a layout deskvm has no table for.
    """
    table = _table(layout)
    combos: list[KeyCombo] = []
    for ch in text:
        if ch in _CONTROL_KEYS:
            combos.append(KeyCombo((_CONTROL_KEYS[ch],)))
            continue
        strokes = table.get(ch)
        if strokes is None:
            raise ActionError(
                f"character {ch!r} (U+{ord(ch):04X}) has no key on the guest's "
                f"{_LAYOUT_TITLE.get(layout, layout)} keyboard layout",
                code="untypeable_text",
            )
        combos.extend(KeyCombo(stroke) for stroke in strokes)
    return combos


_CONTROL_KEYS = {"\n": "ret", "\r": "ret", "\t": "tab"}
_LAYOUT_TITLE = {"us": "US", "de": "German (de)", "fr": "French (fr)"}
_SHIFTS = ("shift", "shift_r")


def _table(layout: str) -> dict[str, tuple[tuple[str, ...], ...]]:
    try:
        return TABLES[layout]
    except KeyError:
        raise ActionError(
            f"keyboard layout {layout!r} is not one of: {', '.join(KEYBOARD_LAYOUTS)}",
            code="unknown_layout",
        ) from None


def layout_combos(combo: KeyCombo, layout: str, *, sequence: bool = True) -> tuple[KeyCombo, ...]:
    """The keys that give ``combo``'s keysyms on ``layout`` (``combo`` is parsed, US keys).

    Each character key of ``combo`` becomes the key (and Shift/AltGr) that gives the same
    character on ``layout``; ctrl, alt and meta stay; keys without a character (F-keys,
    Return, arrows, keypad) stay. ``ctrl+z`` on ``de`` -> ``ctrl+y``; ``ctrl+shift+t`` ->
    ``ctrl+shift+t``; ``ctrl++`` on ``de`` -> ``ctrl+bracket_right`` (``+`` is unshifted
    there). A character only a dead key gives: alone (no ctrl/alt/meta) and with
    ``sequence``, the dead key then its second key (it types the character); otherwise the
    dead key itself.

    Returns:
        ``(combo,)`` on ``us``; one or (a dead-key sequence) two combos otherwise.

    Raises:
        ActionError: ``unknown_key`` when a character of the combo has no key on
            ``layout``; ``unknown_layout`` for an unsupported layout.
    """
    table = _table(layout)
    if layout == "us":
        return (combo,)
    mods = [q for q in combo.qcodes if q in MODIFIER_QCODES]
    keys = [q for q in combo.qcodes if q not in MODIFIER_QCODES]
    if not any(q in _US_KEYS for q in keys):
        return (combo,)
    shifted = any(q in _SHIFTS for q in mods)
    only_chars = all(q in _US_KEYS for q in keys)
    kept = [q for q in mods if q not in _SHIFTS or not only_chars]
    added: list[str] = []
    targets: list[str] = []
    for qcode in keys:
        if qcode not in _US_KEYS:
            targets.append(qcode)
            continue
        char = _US_KEYS[qcode][1 if shifted else 0]
        strokes = table.get(char)
        if strokes is None:
            raise ActionError(
                f"key {char!r} has no key on the guest's {_LAYOUT_TITLE[layout]} keyboard layout",
                code="unknown_key",
            )
        if len(strokes) > 1 and sequence and not kept and len(keys) == 1:
            return tuple(KeyCombo(stroke) for stroke in strokes)
        stroke = strokes[0]
        added += [q for q in stroke[:-1] if q not in added]
        targets.append(stroke[-1])
    qcodes = [*kept, *(q for q in added if q not in kept)]
    qcodes += [q for q in targets if q not in qcodes]
    return (KeyCombo(tuple(qcodes)),)


_KEYPAD_TEXT: dict[str, str] = {
    **{f"kp_{_n}": str(_n) for _n in range(10)},
    "kp_add": "+", "kp_subtract": "-", "kp_multiply": "*", "kp_divide": "/",
    "kp_decimal": ".", "kp_comma": ",", "kp_equals": "=", "kp_enter": "\n",
}  # fmt: skip
_SHIFT_QCODES = frozenset({"shift", "shift_r"})


def combo_text(combo: KeyCombo) -> str | None:
    """The text a combo types on a US layout, or ``None`` if it types none.

    The inverse of :func:`char_to_combo` for combos of one key with optional shift:
    ``a`` -> ``"a"``, ``shift+1`` -> ``"!"``, ``ret`` / ``kp_enter`` -> ``"\\n"``, ``tab``
    -> ``"\\t"``, ``spc`` -> ``" "``, keypad digits and operators as their characters (Num
    Lock assumed on). A combo with ctrl, alt or meta, or a key without a character
    (arrows, F-keys, ``backspace``...), types no text.
    """
    keys = [q for q in combo.qcodes if q not in _SHIFT_QCODES]
    if len(keys) != 1:
        return None
    (qcode,) = keys
    shifted = len(keys) != len(combo.qcodes)
    if qcode in _US_KEYS:
        return _US_KEYS[qcode][1 if shifted else 0]
    if qcode == "ret":
        return "\n"
    if qcode == "tab":
        return "\t"
    return _KEYPAD_TEXT.get(qcode)
