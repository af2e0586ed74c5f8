"""Key names, combos and US-layout text -> qcodes."""

from __future__ import annotations

import string

import pytest

from agent_bridge.protocol.keys import (
    MODIFIER_QCODES,
    KeyCombo,
    char_to_combo,
    parse_combo,
    parse_combos,
    text_to_combos,
)
from orchestrator.errors import ActionError


@pytest.mark.parametrize(
    ("spec", "qcodes"),
    [
        ("ctrl+shift+t", ("ctrl", "shift", "t")),
        ("Control_L+a", ("ctrl", "a")),
        ("ctrl+a", ("ctrl", "a")),
        ("shift+Tab", ("shift", "tab")),
        ("alt+F4", ("alt", "f4")),
        ("Return", ("ret",)),
        ("enter", ("ret",)),
        ("KP_Enter", ("kp_enter",)),
        ("super", ("meta_l",)),
        ("cmd+c", ("meta_l", "c")),
        ("ctrl+C", ("ctrl", "c")),
        ("a+ctrl", ("ctrl", "a")),
        ("ctrl++", ("ctrl", "shift", "equal")),
        ("+", ("shift", "equal")),
        ("ctrl+plus", ("ctrl", "shift", "equal")),
        ("Page_Down", ("pgdn",)),
        ("BackSpace", ("backspace",)),
        ("Escape", ("esc",)),
        ("ctrl+ctrl+x", ("ctrl", "x")),
    ],
)
def test_parse_combo(spec: str, qcodes: tuple[str, ...]) -> None:
    assert parse_combo(spec).qcodes == qcodes


def test_parse_combos_is_xdotool_style_sequence() -> None:
    assert parse_combos("ctrl+a  ctrl+c") == (KeyCombo(("ctrl", "a")), KeyCombo(("ctrl", "c")))


@pytest.mark.parametrize("spec", ["", "   ", "ctrl+nosuchkey", "hyperdrive"])
def test_bad_combos_are_refused(spec: str) -> None:
    with pytest.raises(ActionError):
        parse_combos(spec)


def test_every_printable_ascii_character_has_exactly_one_keystroke() -> None:
    printable = string.ascii_letters + string.digits + string.punctuation + " "
    for ch in printable:
        combo = char_to_combo(ch)
        non_mods = [q for q in combo.qcodes if q not in MODIFIER_QCODES]
        assert len(non_mods) == 1, ch
        assert set(combo.qcodes) - set(non_mods) <= {"shift"}, ch


def test_shift_is_used_exactly_for_shifted_characters() -> None:
    assert char_to_combo("a").qcodes == ("a",)
    assert char_to_combo("A").qcodes == ("shift", "a")
    assert char_to_combo("{").qcodes == ("shift", "bracket_left")
    assert char_to_combo("[").qcodes == ("bracket_left",)
    assert char_to_combo('"').qcodes == ("shift", "apostrophe")


def test_newline_and_tab_are_return_and_tab_keys() -> None:
    assert [c.qcodes for c in text_to_combos("a\tb\n")] == [("a",), ("tab",), ("b",), ("ret",)]


@pytest.mark.parametrize("text", ["Ñandú", "美国降息新闻", "caf\u00e9"])
def test_text_without_a_key_is_a_clear_error(text: str) -> None:
    with pytest.raises(ActionError) as info:
        text_to_combos(text)
    assert info.value.code == "untypeable_text"
    assert "U+" in info.value.message


@pytest.mark.parametrize("name", ["F13", "f24", "ctrl+F20"])
def test_function_keys_beyond_f12_are_refused_with_the_reason(name: str) -> None:
    with pytest.raises(ActionError) as info:
        parse_combo(name)
    assert info.value.code == "unknown_key" and "F12" in info.value.message
