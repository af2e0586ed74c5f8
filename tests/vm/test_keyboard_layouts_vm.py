"""Typing and key combos on a non-US guest layout, on a real VM: one probe session per layout.

The session asks for ``keyboard_layout`` (``de``, ``fr``); the guest's X server starts with
that layout and the host sends the keys that produce each character there (generated tables,
``agent_bridge/protocol/layout_tables.py``). The probe reports what X delivered: the text
field's value and each key's keysym and modifiers (``/dev/ttyS1``, as in
``test_input_fidelity_vm.py``, whose probe reader this module reuses).

``pytest -v`` output of this module is the fidelity table per layout (docs/images.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agent_bridge.client import Client
from agent_bridge.input_check import find_key, has_text
from agent_bridge.protocol.keys import text_to_combos
from tests.vm.test_guest_helper_vm import assert_relay_copies_xtest
from tests.vm.test_input_fidelity_vm import BOOT_TIMEOUT_S, H, Probe, W

LAYOUTS = ["de", "fr"]
PRINTABLE_ASCII = "".join(chr(c) for c in range(0x20, 0x7F))
# Characters each layout types through AltGr, dead keys or the ISO key (and Grüße).
LAYOUT_TEXT = "Grüße @{[]}\\|~^`<>€ é à ç ù ê â ï ÿ ẞ"


@pytest.fixture(scope="module", params=LAYOUTS)
def probe(request: pytest.FixtureRequest, deskvm_client: Client) -> Iterator[Probe]:
    layout = request.param
    session = deskvm_client.create_session(
        width=W, height=H, boot_timeout_s=BOOT_TIMEOUT_S, autostart="input-probe",
        keyboard_layout=layout, guest_control=True,
    )  # fmt: skip
    try:
        assert session.info_at_start["keyboard_layout"] == layout
        log = session.guest_log()
        assert '"ev":"probe_ready"' in log, log[-2000:]
        p = Probe(deskvm_client, session)
        p.assert_nothing_stuck(f"{layout} start")
        yield p
        for other in p.vocab_sessions.values():
            if other is not session:
                other.close()
    finally:
        print(f"\n--- {layout} probe guest log tail ---\n" + session.guest_log()[-3000:])
        session.delete()


@pytest.fixture(autouse=True)
def _nothing_stuck_after(request: pytest.FixtureRequest, probe: Probe) -> Iterator[None]:
    yield
    probe.assert_nothing_stuck(request.node.name)


def _type_and_read(probe: Probe, text: str, send: Any) -> str:
    probe.clear_text()
    since = probe.mark()
    send(text)
    events = probe.wait(since, lambda ev: has_text(ev, text))
    values = [e["value"] for e in events if e["ev"] == "text"]
    return values[-1] if values else ""


def test_type_every_printable_ascii_character(probe: Probe) -> None:
    assert _type_and_read(probe, PRINTABLE_ASCII, probe.session.type) == PRINTABLE_ASCII


def test_type_gruesse(probe: Probe) -> None:
    assert _type_and_read(probe, "Grüße", probe.session.type) == "Grüße"


def test_type_altgr_dead_key_and_iso_key_characters(probe: Probe) -> None:
    text = LAYOUT_TEXT
    layout = probe.session.info_at_start["keyboard_layout"]
    assert text_to_combos(text, layout), "every character has keys: no helper involved"
    assert _type_and_read(probe, text, probe.session.type) == text


def test_characters_not_on_the_layout_go_through_the_helper(probe: Probe) -> None:
    text = "zy@ Ñandú 美国 ^`~"
    assert _type_and_read(probe, text, probe.session.type) == text
    # The helper's relay keyboard holds the XTEST map, not the session's layout.
    assert_relay_copies_xtest(probe.session)


VOCABS = ["computer_20250124", "openai", "computer_13", "pyautogui"]


def _type_msg(vocab: str, text: str) -> dict[str, Any]:
    return {
        "computer_20250124": {"action": "type", "text": text},
        "openai": {"type": "type", "text": text},
        "computer_13": {"action_type": "TYPING", "parameters": {"text": text}},
        "pyautogui": {"code": f"pyautogui.typewrite({text!r})"},
    }[vocab]


@pytest.mark.parametrize("vocab", VOCABS)
def test_vendor_type_exact(probe: Probe, vocab: str) -> None:
    text = "Hello_World-42 zy (a>b) & {x|y} ~!@#$%^&*`"
    session = probe.vocab(vocab)
    got = _type_and_read(probe, text, lambda t: session.request(_type_msg(vocab, t)))
    assert got == text


# (combo as sent, keysym the probe must see pressed, modifiers held at that press): combos
# keep their meaning, so ctrl+z is the key whose keysym is z on the layout (undo).
COMBOS: list[tuple[str, str, set[str]]] = [
    ("ctrl+z", "z", {"control"}),
    ("ctrl+y", "y", {"control"}),
    ("ctrl+a", "a", {"control"}),
    ("ctrl+q", "q", {"control"}),
    ("ctrl+w", "w", {"control"}),
    ("ctrl+m", "m", {"control"}),
    ("ctrl+shift+t", "T", {"control", "shift"}),
    ("shift+Tab", "ISO_Left_Tab", {"shift"}),
    ("Return", "Return", set()),
]


@pytest.mark.parametrize(("combo", "keysym", "mods"), COMBOS, ids=[c[0] for c in COMBOS])
def test_key_combo_keeps_its_keysym(probe: Probe, combo: str, keysym: str, mods: set[str]) -> None:
    since = probe.mark()
    probe.session.key(combo)
    events = probe.wait(since, lambda ev: find_key(ev, keysym, "release") is not None)
    press = find_key(events, keysym, "press")
    assert press is not None, [e for e in events if e["ev"] == "key"][-6:]
    assert set(press["modifiers"]) - {"num_lock"} == mods


def _undo_msg(vocab: str) -> dict[str, Any]:
    return {
        "computer_20250124": {"action": "key", "text": "ctrl+z"},
        "openai": {"type": "keypress", "keys": ["CTRL", "Z"]},
        "computer_13": {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "z"]}},
        "pyautogui": {"code": "pyautogui.hotkey('ctrl', 'z')"},
    }[vocab]


@pytest.mark.parametrize("vocab", VOCABS)
def test_vendor_ctrl_z_is_ctrl_z(probe: Probe, vocab: str) -> None:
    since = probe.mark()
    probe.vocab(vocab).request(_undo_msg(vocab))
    events = probe.wait(since, lambda ev: find_key(ev, "z", "release") is not None)
    press = find_key(events, "z", "press")
    assert press is not None, [e for e in events if e["ev"] == "key"][-6:]
    assert set(press["modifiers"]) - {"num_lock"} == {"control"}
