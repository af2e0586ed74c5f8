"""The parsing side of the input-fidelity cases (../shared/cases/input_fidelity.json).

Each case must reach deskvm's actions unchanged through every vocabulary that can express
it: text exactly, key spellings to the right keys, scroll signs the right way round,
multi-clicks as one click with a count, and scaled clicks on the exact display pixel.
What the guest then receives is checked on a real VM, not here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent_bridge.protocol.actions import Action, Click, Key, Screenshot, Scroll, Type
from agent_bridge.protocol.keys import KeyCombo
from agent_bridge.protocol.scaling import Scaler, scale_action
from agent_bridge.protocol.vocab import get_vocabulary

CASES_FILE = Path("/work/shared/cases/input_fidelity.json")
_EMBEDDED: dict[str, Any] = {
    "type": [
        {"text": "Hello_World-42 (a>b) & {x|y}"},
        {"text": "http://foo.com/my_file?q=1#top"},
        {"text": "~!@#$%^&*()_+`-=[]\\;',./{}|:\"<>?"},
        {"text": "line one\nline two\n"},
        {"text": "tab\there"},
        {"text": "Ñandú"},
        {"text": "美国降息新闻"},
    ],
    "click": [
        {"at": "scaled", "display": [1280, 800], "scaled_to": [1024, 640], "x": 512, "y": 320,
         "expect": [640, 400]},
    ],
    "multi_click": [
        {"action": "double_click", "expect_clicks": 2},
        {"action": "triple_click", "expect_clicks": 3},
    ],
    "scroll": [{"dy": 1}, {"dy": -1}, {"dy": 5}, {"dy": -20}, {"dx": 3}, {"dx": -3}],
    "keys": [
        {"keys": "ctrl+a"}, {"keys": "shift+Tab"}, {"keys": "alt+F4"}, {"keys": "Return"},
        {"keys": "KP_Enter"},
    ],
}  # fmt: skip
CASES: dict[str, Any] = json.loads(CASES_FILE.read_text()) if CASES_FILE.exists() else _EMBEDDED

SHOT = Screenshot()


def only(actions: tuple[Action, ...]) -> Action:
    """The one input action, without the screenshot a vocabulary appends."""
    inputs = [a for a in actions if a != SHOT]
    assert len(inputs) == 1, actions
    return inputs[0]


# --- type: the text reaches the Type action byte for byte, in every vocabulary ----------

TEXTS = [case["text"] for case in CASES["type"]]


def _type_bodies(text: str) -> dict[str, dict[str, Any]]:
    return {
        "deskvm": {"action": "type", "text": text},
        "computer_20241022": {"action": "type", "text": text},
        "computer_20250124": {"action": "type", "text": text},
        "computer_20251124": {"action": "type", "text": text},
        "openai": {"type": "type", "text": text},
        "computer_13": {"action_type": "TYPING", "text": text},
        "pyautogui": {"code": f"pyautogui.write({text!r})"},
    }


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("schema", list(_type_bodies("")))
def test_type_text_is_exact(schema: str, text: str) -> None:
    body = _type_bodies(text)[schema]
    assert only(get_vocabulary(schema).parse(body)) == Type(text)


# --- keys: the common spellings reach the same keys --------------------------------------

EXPECTED_KEYS = {
    "ctrl+a": ("ctrl", "a"),
    "shift+Tab": ("shift", "tab"),
    "alt+F4": ("alt", "f4"),
    "Return": ("ret",),
    "KP_Enter": ("kp_enter",),
}
# The same keys as OpenAI (keypress list) and OSWorld/pyautogui (hotkey names) spell them.
VENDOR_SPELLINGS = {
    "ctrl+a": (["CTRL", "A"], ["ctrl", "a"]),
    "shift+Tab": (["SHIFT", "TAB"], ["shift", "tab"]),
    "alt+F4": (["ALT", "F4"], ["alt", "f4"]),
    "Return": (["ENTER"], ["enter"]),
    "KP_Enter": (["KP_Enter"], ["KP_Enter"]),
}


@pytest.mark.parametrize("case", CASES["keys"], ids=lambda c: c["keys"])
def test_key_spellings(case: dict[str, str]) -> None:
    spec = case["keys"]
    want = Key((KeyCombo(EXPECTED_KEYS[spec]),))
    openai_keys, osworld_keys = VENDOR_SPELLINGS[spec]
    bodies: dict[str, dict[str, Any]] = {
        "deskvm": {"action": "key", "keys": spec},
        "computer_20241022": {"action": "key", "text": spec},
        "computer_20251124": {"action": "key", "text": spec},
        "openai": {"type": "keypress", "keys": openai_keys},
        "computer_13": {"action_type": "HOTKEY", "keys": osworld_keys},
        "pyautogui": {"code": f"pyautogui.hotkey({', '.join(map(repr, osworld_keys))})"},
    }
    for schema, body in bodies.items():
        assert only(get_vocabulary(schema).parse(body)) == want, schema


@pytest.mark.parametrize(
    ("text", "qcodes"),
    [
        ("Control_L+a", ("ctrl", "a")),
        ("super", ("meta_l",)),
        ("ctrl+shift+t", ("ctrl", "shift", "t")),
    ],
)
def test_more_spellings_from_the_issue(text: str, qcodes: tuple[str, ...]) -> None:
    got = only(get_vocabulary("computer_20250124").parse({"action": "key", "text": text}))
    assert got == Key((KeyCombo(qcodes),))


# --- scroll: the sign gives the direction on both axes, the amount is honoured ----------


def _scroll_bodies(dx: int, dy: int) -> dict[str, dict[str, Any]]:
    """Vendor bodies meaning "dx notches right, dy notches down" (deskvm's signs)."""
    amount = abs(dx or dy)
    direction = ("right" if dx > 0 else "left") if dx else ("down" if dy > 0 else "up")
    pyautogui_call = f"pyautogui.hscroll({dx})" if dx else f"pyautogui.scroll({-dy})"
    return {
        "deskvm": {"action": "scroll", "dx": dx, "dy": dy},
        "computer_20250124": {
            "action": "scroll", "scroll_direction": direction, "scroll_amount": amount,
        },
        "openai": {"type": "scroll", "x": 0, "y": 0, "scroll_x": dx * 100, "scroll_y": dy * 100},
        "computer_13": {"action_type": "SCROLL", "dx": dx, "dy": -dy},  # pyautogui: + is up
        "pyautogui": {"code": pyautogui_call},
    }  # fmt: skip


@pytest.mark.parametrize("case", CASES["scroll"], ids=str)
def test_scroll_signs(case: dict[str, int]) -> None:
    dx, dy = case.get("dx", 0), case.get("dy", 0)
    for schema, body in _scroll_bodies(dx, dy).items():
        got = only(get_vocabulary(schema).parse(body))
        assert isinstance(got, Scroll), schema
        assert (got.dx, got.dy) == (dx, dy), schema


# --- multi-click: one click with a count, so the toolkit sees a double/triple click -----


@pytest.mark.parametrize("case", CASES["multi_click"], ids=lambda c: c["action"])
def test_multi_clicks_are_one_action_with_a_count(case: dict[str, Any]) -> None:
    n = case["expect_clicks"]
    bodies = {
        "deskvm": {"action": case["action"], "x": 5, "y": 5},
        "computer_20250124": {"action": case["action"], "coordinate": [5, 5]},
        "computer_13": {"action_type": "CLICK", "x": 5, "y": 5, "num_clicks": n},
        "pyautogui": {"code": f"pyautogui.{'doubleClick' if n == 2 else 'tripleClick'}(5, 5)"},
    }
    if n == 2:
        bodies["openai"] = {"type": "double_click", "x": 5, "y": 5}
    for schema, body in bodies.items():
        assert only(get_vocabulary(schema).parse(body)) == Click(5, 5, count=n), schema


# --- scaled click: the client's coordinate lands on the exact display pixel -------------


@pytest.mark.parametrize("case", [c for c in CASES["click"] if "scaled_to" in c])
def test_scaled_click_lands_on_the_exact_pixel(case: dict[str, Any]) -> None:
    scaler = Scaler(*case["display"], *case["scaled_to"])
    x, y = case["x"], case["y"]
    bodies = {
        "deskvm": {"action": "click", "x": x, "y": y},
        "computer_20241022": {"action": "left_click", "coordinate": [x, y]},
        "openai": {"type": "click", "x": x, "y": y, "button": "left"},
        "computer_13": {"action_type": "CLICK", "x": x, "y": y},
        "pyautogui": {"code": f"pyautogui.click({x}, {y})"},
    }
    for schema, body in bodies.items():
        click = scale_action(only(get_vocabulary(schema).parse(body)), scaler)
        assert click == Click(*case["expect"]), schema


@pytest.mark.parametrize(("w", "h"), [(1280, 800), (1024, 768), (1920, 1080)])
def test_corner_and_centre_clicks_are_passed_through(w: int, h: int) -> None:
    for x, y in [(0, 0), (w - 1, h - 1), (w // 2, h // 2)]:
        body = {"action": "left_click", "coordinate": [x, y]}
        assert only(get_vocabulary("computer_20251124").parse(body)) == Click(x, y)
