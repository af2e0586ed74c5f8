"""Keyboard layouts: the generated tables, typing and key combos on us/de/fr.

The tables (``agent_bridge/protocol/layout_tables.py``) and the guest's compose file are
generated from the host's XKB data by ``python -m vm_images.keyboard_tables``. Besides spot
checks, every table entry is *played back* here: its strokes are pressed in a libxkbcommon
keyboard state of that layout (and fed to the guest's generated compose file), and what comes
out must be the character. That check reads the layout data itself, not the generator's
choices.
"""

from __future__ import annotations

import string

import pytest
from xkbcommon import xkb

from agent_bridge.protocol import parse_deskvm_action
from agent_bridge.protocol.actions import Type
from agent_bridge.protocol.keys import (
    _CHAR_TO_KEY,
    KEYBOARD_LAYOUTS,
    KeyCombo,
    layout_combos,
    parse_combo,
    text_to_combos,
)
from agent_bridge.protocol.layout_tables import TABLES, XKB_DATA_VERSION
from orchestrator.display.base import KeyEvent
from orchestrator.errors import ActionError
from orchestrator.input_plan import HelperStep, Pacing, plan_action
from vm_images import keyboard_tables
from vm_images.keyboard_tables import COMPOSE_PATH, MODEL, QCODE_EVDEV

PRINTABLE_ASCII = "".join(chr(c) for c in range(0x20, 0x7F))
MODIFIER_EVDEV = {"shift": 42, "shift_r": 54, "alt_r": 100, "ctrl": 29, "alt": 56}


# --- the committed tables are what the layout data gives --------------------------------


def test_regenerating_gives_the_committed_tables() -> None:
    """The generated files are up to date with the generator and the host's xkb-data."""
    host_version = keyboard_tables.xkb_data_version()
    assert host_version == XKB_DATA_VERSION, (
        f"the tables were generated from xkb-data {XKB_DATA_VERSION}, this host has "
        f"{host_version}: run python -m vm_images.keyboard_tables and review the diff"
    )
    for path, text in keyboard_tables.outputs().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path} is stale: run python -m vm_images.keyboard_tables"
        )


def test_the_generated_us_table_is_the_protocol_us_table() -> None:
    """Key names are parsed on US keys; the generated US table must agree with them."""
    generated = {c: s for c, s in TABLES["us"].items()}
    parsed = {
        c: ((("shift", q) if shifted else (q,)),)
        for c, (q, shifted) in _CHAR_TO_KEY.items()
        if c not in "\n\r\t"
    }
    assert generated == parsed


# --- spot checks named by the issue -------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "char", "strokes"),
    [
        ("de", "z", (("y",),)),  # QEMU qcode "y" is Linux KEY_Y
        ("de", "y", (("z",),)),
        ("de", "Z", (("shift", "y"),)),
        ("de", "@", (("alt_r", "q"),)),
        ("de", "{", (("alt_r", "7"),)),
        ("de", "~", (("alt_r", "bracket_right"),)),
        ("de", "|", (("alt_r", "less"),)),
        ("de", "<", (("less",),)),
        ("de", "^", (("grave_accent",), ("spc",))),  # dead circumflex, then Space
        ("de", "`", (("shift", "equal"), ("spc",))),  # dead grave
        ("de", "ü", (("bracket_left",),)),
        ("de", "ß", (("minus",),)),
        ("de", "é", (("equal",), ("e",))),  # dead acute + e
        ("fr", "a", (("q",),)),
        ("fr", "q", (("a",),)),
        ("fr", "z", (("w",),)),
        ("fr", "m", (("semicolon",),)),
        ("fr", "1", (("shift", "1"),)),
        ("fr", "é", (("2",),)),
        ("fr", "@", (("alt_r", "0"),)),
        ("fr", "ü", (("shift", "bracket_left"), ("u",))),  # dead diaeresis + u
        ("us", "z", (("z",),)),
        ("us", "<", (("shift", "comma"),)),
    ],
)
def test_table_entries(layout: str, char: str, strokes: tuple[tuple[str, ...], ...]) -> None:
    assert TABLES[layout][char] == strokes
    assert QCODE_EVDEV["y"] == ("KEY_Y", 21)


@pytest.mark.parametrize("layout", KEYBOARD_LAYOUTS)
def test_every_printable_ascii_character_types_with_keys(layout: str) -> None:
    combos = text_to_combos(PRINTABLE_ASCII + "\n\t", layout)
    assert len(combos) >= len(PRINTABLE_ASCII) + 2


@pytest.mark.parametrize("layout", ["de", "fr"])
def test_gruesse_types_with_keys_on_de_and_fr(layout: str) -> None:
    assert len(text_to_combos("Grüße", layout)) >= 5


def test_characters_without_a_key_name_the_layout() -> None:
    with pytest.raises(ActionError) as info:
        text_to_combos("美", "de")
    assert info.value.code == "untypeable_text" and "German (de)" in info.value.message
    with pytest.raises(ActionError) as info:
        text_to_combos("a", "xx")
    assert info.value.code == "unknown_layout"


# --- play every table entry back through the layout data --------------------------------


def _compose_table(context: xkb.Context) -> xkb.ComposeTable:
    return context.compose_table_new_from_buffer(COMPOSE_PATH.read_bytes(), "C")


def _play(context: xkb.Context, keymap: xkb.Keymap, strokes: tuple[tuple[str, ...], ...]) -> str:
    """The text X would deliver for these strokes on this keymap with the guest's compose."""
    compose = _compose_table(context).compose_state_new()
    out = ""
    for stroke in strokes:
        if stroke == ("ret",) or stroke == ("tab",):
            out += "\n" if stroke == ("ret",) else "\t"
            continue
        state = keymap.state_new()
        for qcode in stroke[:-1]:
            state.update_key(MODIFIER_EVDEV[qcode] + 8, xkb.KeyDirection.XKB_KEY_DOWN)
        keycode = QCODE_EVDEV[stroke[-1]][1] + 8
        compose.feed(state.key_get_one_sym(keycode))
        status = compose.get_status()
        if status == xkb.ComposeStatus.XKB_COMPOSE_COMPOSED:
            out += compose.get_utf8()
            compose.reset()
        elif status == xkb.ComposeStatus.XKB_COMPOSE_NOTHING:
            out += state.key_get_string(keycode)
    return out


@pytest.mark.parametrize("layout", KEYBOARD_LAYOUTS)
def test_every_entry_types_its_character_on_the_layout(layout: str) -> None:
    context = xkb.Context()
    keymap = context.keymap_new_from_names(rules="evdev", model=MODEL, layout=layout)
    wrong = {
        char: got
        for char, strokes in TABLES[layout].items()
        if (got := _play(context, keymap, strokes)) != char
    }
    assert not wrong


# --- key combos keep their meaning ------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "spec", "want"),
    [
        ("de", "ctrl+z", [("ctrl", "y")]),  # undo stays undo
        ("de", "ctrl+y", [("ctrl", "z")]),
        ("fr", "ctrl+a", [("ctrl", "q")]),
        ("fr", "ctrl+z", [("ctrl", "w")]),
        ("fr", "ctrl+q", [("ctrl", "a")]),
        ("de", "ctrl+shift+t", [("ctrl", "shift", "t")]),
        ("de", "ctrl+shift+z", [("ctrl", "shift", "y")]),
        ("de", "ctrl++", [("ctrl", "bracket_right")]),  # '+' is unshifted on de
        ("de", "ctrl+minus", [("ctrl", "slash")]),
        ("de", "ctrl+@", [("ctrl", "alt_r", "q")]),
        ("de", "alt+F4", [("alt", "f4")]),
        ("de", "shift+Tab", [("shift", "tab")]),
        ("de", "Return", [("ret",)]),
        ("de", "asciicircum", [("grave_accent",), ("spc",)]),  # types '^'
        ("de", "ctrl+asciicircum", [("ctrl", "grave_accent")]),  # the dead key itself
        ("de", "super", [("meta_l",)]),
        ("us", "ctrl+z", [("ctrl", "z")]),
    ],
)
def test_combos_map_by_keysym(layout: str, spec: str, want: list[tuple[str, ...]]) -> None:
    assert [c.qcodes for c in layout_combos(parse_combo(spec), layout)] == want


@pytest.mark.parametrize("layout", ["de", "fr"])
def test_mapped_letter_combos_give_the_same_keysym(layout: str) -> None:
    """ctrl+<letter> on the layout presses the key whose keysym is that letter."""
    keymap = xkb.Context().keymap_new_from_names(rules="evdev", model=MODEL, layout=layout)
    for letter in string.ascii_lowercase:
        (combo,) = layout_combos(KeyCombo(("ctrl", letter)), layout)
        assert combo.qcodes[0] == "ctrl"
        state = keymap.state_new()
        sym = state.key_get_one_sym(QCODE_EVDEV[combo.qcodes[-1]][1] + 8)
        assert xkb.keysym_get_name(sym) == letter, (layout, letter, combo)


# --- the input plan follows the session's layout ----------------------------------------


def _key_events(body: dict[str, object], layout: str) -> list[KeyEvent]:
    steps = plan_action(parse_deskvm_action(body), Pacing(), keyboard_layout=layout)
    return [e for s in steps for e in s.events if isinstance(e, KeyEvent)]


def test_type_on_de_sends_de_keys() -> None:
    assert _key_events({"action": "type", "text": "z@"}, "de") == [
        KeyEvent("y", True), KeyEvent("y", False),
        KeyEvent("alt_r", True), KeyEvent("q", True), KeyEvent("q", False),
        KeyEvent("alt_r", False),
    ]  # fmt: skip


def test_key_combo_on_fr_sends_fr_keys() -> None:
    assert _key_events({"action": "key", "keys": "ctrl+a"}, "fr") == [
        KeyEvent("ctrl", True), KeyEvent("q", True), KeyEvent("q", False),
        KeyEvent("ctrl", False),
    ]  # fmt: skip


def test_held_keys_and_hold_key_follow_the_layout() -> None:
    assert _key_events({"action": "hold_key", "keys": "z", "duration_ms": 10}, "de") == [
        KeyEvent("y", True), KeyEvent("y", False),
    ]  # fmt: skip


def test_text_with_a_character_the_layout_lacks_goes_whole_to_the_helper() -> None:
    steps = plan_action(
        parse_deskvm_action({"action": "type", "text": "z美"}), Pacing(), keyboard_layout="de"
    )
    assert len(steps) == 1 and isinstance(steps[0], HelperStep)
    assert steps[0].args == {"text": "z美"}


def test_a_combo_with_a_character_the_layout_lacks_is_refused() -> None:
    # US backslash exists on every supported layout; a combo naming a layout-less char
    # is made up here from a table without it.
    table = dict(TABLES["de"])
    del table["\\"]
    saved = TABLES["de"]
    TABLES["de"] = table
    try:
        with pytest.raises(ActionError) as info:
            layout_combos(parse_combo("ctrl+backslash"), "de")
        assert info.value.code == "unknown_key"
    finally:
        TABLES["de"] = saved


# --- every vocabulary's typed text, planned on each layout, is the text ------------------


@pytest.mark.parametrize("layout", KEYBOARD_LAYOUTS)
def test_fidelity_type_cases_in_every_vocabulary_on_each_layout(layout: str) -> None:
    """The shared fidelity cases' texts, parsed by every vocabulary and planned on the
    layout: either the keys X turns back into exactly that text, or (a character the layout
    lacks) one helper request with the whole text."""
    from agent_bridge.protocol.vocab import get_vocabulary
    from tests.protocol.test_vocab_fidelity import TEXTS, _type_bodies

    context = xkb.Context()
    keymap = context.keymap_new_from_names(rules="evdev", model=MODEL, layout=layout)
    texts = [*TEXTS, PRINTABLE_ASCII, "Grüße"]
    for text in texts:
        for schema, body in _type_bodies(text).items():
            (action,) = [a for a in get_vocabulary(schema).parse(body) if isinstance(a, Type)]
            steps = plan_action(action, Pacing(), keyboard_layout=layout)
            if any(isinstance(s, HelperStep) for s in steps):
                assert [s.args for s in steps] == [{"text": text}], (schema, text)
                assert any(c not in TABLES[layout] and c not in "\n\t" for c in text)
                continue
            strokes: list[tuple[str, ...]] = []
            down: list[str] = []
            for event in (e for s in steps for e in s.events):
                assert isinstance(event, KeyEvent)
                if event.down:
                    down.append(event.qcode)
                elif event.qcode == down[-1] and event.qcode not in MODIFIER_EVDEV:
                    strokes.append(tuple(down))
                if not event.down:
                    down.remove(event.qcode)
            assert _play(context, keymap, tuple(strokes)) == text, (layout, schema, text)
