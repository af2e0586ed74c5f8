"""Generate deskvm's keyboard layout tables from XKB layout data (build-time tool).

The host types text through QEMU key codes, so for each guest layout it must know which keys
produce each character *on that layout*. This module derives that from the XKB data the guest
uses (Debian's ``xkb-data``, the same version in the bookworm guest as on a bookworm host),
through libxkbcommon (the PyPI ``xkbcommon`` binding, cffi over ``libxkbcommon0``):

1. compile the keymap ``rules=evdev, model=pc105, layout=L`` (what the guest's X server
   compiles from ``Option "XkbLayout"``);
2. for each modifier set (none, Shift, AltGr, Shift+AltGr; AltGr only where the layout's
   right Alt is ``ISO_Level3_Shift``) press those keys in an ``xkb_state`` and read the
   character each typing key then gives: the keys of a 104-key PC keyboard first, the ISO
   key left of Z (``LSGT``, QEMU's ``less``) only for what they lack;
3. for characters no key gives directly (``^`` and `````` on ``de``, ``ü`` on ``fr``),
   feed dead key + key to the en_US.UTF-8 compose table (libX11's, through
   ``xkb_compose_state``); only ASCII and Latin-1 characters are taken this way.

Outputs (both committed; ``tests/test_keyboard_tables.py`` checks that regenerating gives
the same bytes):

- ``agent_bridge/protocol/layout_tables.py``: ``TABLES[layout][char]`` = the key strokes
  that type ``char``, each stroke a tuple of QEMU ``QKeyCode`` names pressed together
  (modifiers first);
- ``vm_images/guest/base/usr/local/share/deskvm/X11/Compose``: the guest's compose table,
  exactly the dead-key sequences the tables use (a full locale table costs seconds of
  start-up in every X client under TCG).

Run ``python -m vm_images.keyboard_tables`` to regenerate (``--check`` compares instead).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["LAYOUTS", "MODEL", "QCODE_EVDEV", "generate", "main", "render_compose", "render_module"]

LAYOUTS: tuple[str, ...] = ("us", "de", "fr")
"""The layouts deskvm supports (``keyboard_layout``); ``de`` and ``fr`` are tested on a VM."""

MODEL = "pc105"
"""The XKB keyboard model of the guest (``00-deskvm-keyboard.conf``)."""

COMPOSE_LOCALE = "en_US.UTF-8"

ROOT = Path(__file__).resolve().parent.parent
TABLES_PATH = ROOT / "agent_bridge" / "protocol" / "layout_tables.py"
COMPOSE_PATH = ROOT / "vm_images/guest/base/usr/local/share/deskvm/X11/Compose"

# QEMU QKeyCode name -> Linux input event code (linux/input-event-codes.h), for the keys that
# type characters: fixed by the hardware, the same for every layout (QEMU's keycodemapdb).
# XKB's evdev keycodes are the Linux codes + 8. Order: the 104-key block row by row, then
# the ISO key (KEY_102ND), which only the 105-key keyboard has.
QCODE_EVDEV: dict[str, tuple[str, int]] = {
    "grave_accent": ("KEY_GRAVE", 41),
    **{str(n): (f"KEY_{n}", 1 + (n or 10)) for n in range(10)},
    "minus": ("KEY_MINUS", 12), "equal": ("KEY_EQUAL", 13),
    **{c: (f"KEY_{c.upper()}", 16 + i) for i, c in enumerate("qwertyuiop")},
    "bracket_left": ("KEY_LEFTBRACE", 26), "bracket_right": ("KEY_RIGHTBRACE", 27),
    **{c: (f"KEY_{c.upper()}", 30 + i) for i, c in enumerate("asdfghjkl")},
    "semicolon": ("KEY_SEMICOLON", 39), "apostrophe": ("KEY_APOSTROPHE", 40),
    "backslash": ("KEY_BACKSLASH", 43),
    **{c: (f"KEY_{c.upper()}", 44 + i) for i, c in enumerate("zxcvbnm")},
    "comma": ("KEY_COMMA", 51), "dot": ("KEY_DOT", 52), "slash": ("KEY_SLASH", 53),
    "spc": ("KEY_SPACE", 57),
    "less": ("KEY_102ND", 86),
}  # fmt: skip
_ISO_ONLY = ("less",)
_SHIFT = ("shift", "KEY_LEFTSHIFT", 42)
_ALTGR = ("alt_r", "KEY_RIGHTALT", 100)
_EVDEV_OFFSET = 8

Stroke = tuple[str, ...]


def _xkb() -> Any:
    try:
        from xkbcommon import xkb
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise SystemExit(
            "the layout generator needs the 'xkbcommon' Python package (pip install xkbcommon; "
            "it builds against libxkbcommon-dev)"
        ) from exc
    return xkb


def xkb_data_version() -> str:
    """The host's ``xkb-data`` package version (the tables name it)."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", "xkb-data"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def _typing_chars(
    xkb: Any, keymap: Any, mods: tuple[tuple[str, str, int], ...]
) -> dict[str, tuple[str, bool, int]]:
    """qcode -> (character or dead keysym name, is_dead, keysym) with ``mods`` held."""
    state = keymap.state_new()
    for _, _, code in mods:
        state.update_key(code + _EVDEV_OFFSET, xkb.KeyDirection.XKB_KEY_DOWN)
    out: dict[str, tuple[str, bool, int]] = {}
    for qcode, (_, code) in QCODE_EVDEV.items():
        keycode = code + _EVDEV_OFFSET
        sym = state.key_get_one_sym(keycode)
        if not sym:
            continue
        name = xkb.keysym_get_name(sym)
        if name.startswith("dead_"):
            out[qcode] = (name, True, sym)
            continue
        text = state.key_get_string(keycode)
        if len(text) == 1 and text.isprintable():
            out[qcode] = (text, False, sym)
    return out


def generate(layout: str) -> tuple[dict[str, tuple[Stroke, ...]], dict[tuple[str, str], str]]:
    """Character -> key strokes on ``layout`` (see the module docstring).

    Returns:
        ``({char: (stroke, ...)}, {(dead keysym name, keysym name): char})``: a stroke is a
        tuple of QKeyCode names pressed together, modifiers first (``("alt_r", "q")``); two
        strokes for a dead-key sequence, whose compose entry is in the second dict.
        ``"\\n"`` and ``"\\t"`` are not included (Return and Tab on every layout).
    """
    xkb = _xkb()
    context = xkb.Context()
    keymap = context.keymap_new_from_names(rules="evdev", model=MODEL, layout=layout)
    ralt = keymap.key_get_syms_by_level(_ALTGR[2] + _EVDEV_OFFSET, 0, 0)
    has_altgr = [xkb.keysym_get_name(s) for s in ralt] == ["ISO_Level3_Shift"]
    mod_sets: list[tuple[tuple[str, str, int], ...]] = [(), (_SHIFT,)]
    if has_altgr:
        mod_sets += [(_ALTGR,), (_SHIFT, _ALTGR)]
    produced = [(mods, _typing_chars(xkb, keymap, mods)) for mods in mod_sets]

    table: dict[str, tuple[Stroke, ...]] = {}
    keysyms: dict[str, int] = {}
    dead: dict[str, tuple[Stroke, int]] = {}
    # Fewest modifiers first, AltGr last; the ISO key only after the 104 others at that rank
    # (``<`` is Shift+comma on ``us``, the ISO key on ``de`` and ``fr``).
    ranks = [(False, False), (False, True), (True, False), (True, True)]
    for altgr_rank, iso_rank in ranks:
        for mods, chars in produced:
            if (_ALTGR in mods) != altgr_rank:
                continue
            for qcode, (value, is_dead, sym) in chars.items():
                if (qcode in _ISO_ONLY) != iso_rank:
                    continue
                stroke = (*(m[0] for m in mods), qcode)
                if is_dead:
                    dead.setdefault(value, (stroke, sym))
                elif value not in table:
                    table[value] = (stroke,)
                    keysyms[value] = sym

    # Dead key + key: only for ASCII and Latin-1 characters no key gives directly.
    compose = context.compose_table_new_from_locale(COMPOSE_LOCALE).compose_state_new()
    bases = sorted(table, key=lambda c: (c != " ", len(table[c][0]), table[c][0]))
    sequences: dict[tuple[str, str], str] = {}
    for dead_name in sorted(dead, key=lambda d: (len(dead[d][0]), dead[d][0])):
        dead_stroke, dead_sym = dead[dead_name]
        for base in bases:
            compose.reset()
            compose.feed(dead_sym)
            compose.feed(keysyms[base])
            if compose.get_status() != xkb.ComposeStatus.XKB_COMPOSE_COMPOSED:
                continue
            result = compose.get_utf8()
            if len(result) != 1 or ord(result) > 0xFF or not result.isprintable():
                continue
            if result not in table:
                table[result] = (dead_stroke, table[base][0])
                sequences[(dead_name, xkb.keysym_get_name(keysyms[base]))] = result
    return dict(sorted(table.items())), sequences


def render_module(tables: dict[str, dict[str, tuple[Stroke, ...]]], version: str) -> str:
    """``agent_bridge/protocol/layout_tables.py`` for ``tables``."""
    lines = [
        "# ruff: noqa: RUF001  (the tables hold every character a layout types)",
        '"""Keyboard layout tables: the QEMU key strokes that type each character per layout.',
        "",
        f"GENERATED by ``python -m vm_images.keyboard_tables`` from xkb-data {version}",
        f"(rules evdev, model {MODEL}) and the {COMPOSE_LOCALE} compose table. Do not edit.",
        "",
        "``TABLES[layout][char]`` is a tuple of strokes; a stroke is a tuple of QEMU",
        "``QKeyCode`` names pressed together, modifiers first (``alt_r`` is AltGr where the",
        "layout has it). Two strokes: a dead key, then the key it combines with.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        '__all__ = ["MODEL", "TABLES", "XKB_DATA_VERSION"]',
        "",
        f"XKB_DATA_VERSION = {version!r}",
        f"MODEL = {MODEL!r}",
        "",
        "TABLES: dict[str, dict[str, tuple[tuple[str, ...], ...]]] = {",
    ]
    for layout, table in tables.items():
        lines.append(f"    {layout!r}: {{")
        for char, strokes in table.items():
            lines.append(f"        {char!r}: {strokes!r},")
        lines.append("    },")
    lines.append("}  # fmt: skip")
    return "\n".join(lines) + "\n"


def render_compose(sequences: dict[tuple[str, str], str]) -> str:
    """The guest's compose file: exactly ``sequences`` (``(dead, base) -> char``)."""
    lines = [
        "# deskvm: the guest's X11 compose table (XCOMPOSEFILE of every X client of the session).",
        "# GENERATED by `python -m vm_images.keyboard_tables` from the en_US.UTF-8 table: only the",
        "# dead-key sequences deskvm's layout tables type with (libX11 would otherwise parse the",
        "# locale's full table, about 6000 lines, in every client that opens an input method,",
        "# seconds of start-up under TCG). Do not edit.",
    ]
    for (dead, base), char in sequences.items():
        quoted = char.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'<{dead}> <{base}> : "{quoted}"')
    return "\n".join(lines) + "\n"


def outputs() -> dict[Path, str]:
    """Every generated file and its content."""
    tables: dict[str, dict[str, tuple[Stroke, ...]]] = {}
    sequences: dict[tuple[str, str], str] = {}
    for layout in LAYOUTS:
        tables[layout], used = generate(layout)
        sequences.update(used)
    return {
        TABLES_PATH: render_module(tables, xkb_data_version()),
        COMPOSE_PATH: render_compose(dict(sorted(sequences.items()))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(f"{path.relative_to(ROOT)} differs from what the xkb data generates", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
