"""Action -> paced input events: every press has its release, modifiers wrap the key."""

from __future__ import annotations

import pytest

from agent_bridge.protocol import parse_deskvm_action
from orchestrator.display.base import (
    ABS_MAX,
    AbsMove,
    ButtonEvent,
    KeyEvent,
    WheelEvent,
    pixel_to_abs,
)
from orchestrator.input_plan import Pacing, plan_action

PACING = Pacing()


def events(body: dict[str, object]) -> list[object]:
    return [e for step in plan_action(parse_deskvm_action(body), PACING) for e in step.events]


def test_key_combo_presses_modifiers_first_and_releases_in_reverse() -> None:
    assert events({"action": "key", "keys": "ctrl+shift+t"}) == [
        KeyEvent("ctrl", True), KeyEvent("shift", True), KeyEvent("t", True),
        KeyEvent("t", False), KeyEvent("shift", False), KeyEvent("ctrl", False),
    ]  # fmt: skip


def test_each_transition_is_its_own_paced_batch() -> None:
    steps = plan_action(parse_deskvm_action({"action": "type", "text": "aB"}), PACING)
    assert all(len(s.events) == 1 and s.pause_s == PACING.key_s for s in steps)
    assert len(steps) == 2 + 4


def test_with_key_flow_control_each_character_is_one_batch_without_a_pause() -> None:
    """The display waits for the guest's keyboard queue: no fixed pause, one round trip per
    character (its modifier, press, release), and the same events in the same order."""
    pacing = Pacing(key_s=0.012, key_flow_s=0.001)
    action = parse_deskvm_action({"action": "type", "text": "aB~"})
    steps = plan_action(action, pacing, key_flow_control=True)
    assert [s.events for s in steps] == [
        (KeyEvent("a", True), KeyEvent("a", False)),
        (KeyEvent("shift", True), KeyEvent("b", True), KeyEvent("b", False),
         KeyEvent("shift", False)),
        (KeyEvent("shift", True), KeyEvent("grave_accent", True),
         KeyEvent("grave_accent", False), KeyEvent("shift", False)),
    ]  # fmt: skip
    assert all(s.pause_s == 0.001 for s in steps)
    paced = [e for s in plan_action(action, pacing) for e in s.events]
    assert [e for s in steps for e in s.events] == paced


def test_with_key_flow_control_key_combos_keep_one_transition_per_batch() -> None:
    """Shortcuts keep their transitions apart (window managers and grabs see each)."""
    pacing = Pacing(key_s=0.012, key_flow_s=0.0)
    action = parse_deskvm_action({"action": "key", "keys": "alt+F4"})
    steps = plan_action(action, pacing, key_flow_control=True)
    assert [len(s.events) for s in steps] == [1, 1, 1, 1]
    assert all(s.pause_s == 0.0 for s in steps)


def test_double_click_is_two_press_release_pairs_at_one_point() -> None:
    assert events({"action": "double_click", "x": 3, "y": 4}) == [
        AbsMove(3, 4),
        ButtonEvent("left", True), ButtonEvent("left", False),
        ButtonEvent("left", True), ButtonEvent("left", False),
    ]  # fmt: skip


def test_a_multi_click_is_one_transition_per_batch_spaced_by_the_gap() -> None:
    """Each transition of a triple click is its own report (one report would hide press and
    release), spaced by the multi-click gap (above libinput's 25 ms debounce)."""
    action = parse_deskvm_action({"action": "triple_click", "x": 3, "y": 4})
    steps = plan_action(action, Pacing())
    move, *clicks = steps
    assert move.events == (AbsMove(3, 4),)
    assert [s.events for s in clicks] == [
        (ButtonEvent("left", down),) for down in (True, False) * 3
    ]
    assert [s.pause_s for s in clicks[:-1]] == [0.04] * 5


def test_a_single_click_keeps_its_press_pause() -> None:
    action = parse_deskvm_action({"action": "click", "x": 3, "y": 4})
    steps = plan_action(action, Pacing(button_s=0.02))
    assert [s.pause_s for s in steps] == [0.02, 0.02, 0.02]


def test_drag_moves_through_every_point_with_the_button_down() -> None:
    got = events({"action": "drag", "path": [[0, 0], [5, 5], [10, 0]]})
    assert got == [
        AbsMove(0, 0), ButtonEvent("left", True), AbsMove(5, 5), AbsMove(10, 0),
        ButtonEvent("left", False),
    ]  # fmt: skip


def test_held_keys_wrap_a_drag_and_a_move() -> None:
    assert events({"action": "drag", "path": [[0, 0], [5, 5]], "hold": "shift"}) == [
        AbsMove(0, 0), KeyEvent("shift", True), ButtonEvent("left", True), AbsMove(5, 5),
        ButtonEvent("left", False), KeyEvent("shift", False),
    ]  # fmt: skip
    assert events({"action": "move", "x": 2, "y": 3, "hold": "alt"}) == [
        KeyEvent("alt", True), AbsMove(2, 3), KeyEvent("alt", False),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("dx", "dy", "expected"),
    [(0, 1, ["down"]), (0, -1, ["up"]), (0, 5, ["down"] * 5), (0, -20, ["up"] * 20),
     (3, 0, ["right"] * 3), (-3, 0, ["left"] * 3)],
)  # fmt: skip
def test_scroll_sign_and_amount(dx: int, dy: int, expected: list[str]) -> None:
    got = events({"action": "scroll", "dx": dx, "dy": dy})
    assert got == [WheelEvent(d) for d in expected]  # type: ignore[arg-type]


def test_every_plan_releases_what_it_presses() -> None:
    for body in (
        {"action": "type", "text": "Hello, World! ~{}|"},
        {"action": "key", "keys": "ctrl+alt+shift+Delete super"},
        {"action": "hold_key", "keys": "shift+a", "duration_ms": 100},
        {"action": "click", "x": 1, "y": 1, "hold": "ctrl+shift", "count": 3},
        {"action": "scroll", "x": 1, "y": 1, "dy": 2, "hold": "ctrl"},
        {"action": "move", "x": 1, "y": 1, "hold": "alt"},
        {"action": "drag", "path": [[0, 0], [3, 3]], "hold": "ctrl+shift"},
    ):
        down: set[str] = set()
        for e in events(body):
            if isinstance(e, KeyEvent | ButtonEvent):
                name = e.qcode if isinstance(e, KeyEvent) else e.button
                (down.add if e.down else down.discard)(name)
        assert down == set(), body


def test_hold_key_holds_for_the_duration() -> None:
    steps = plan_action(
        parse_deskvm_action({"action": "hold_key", "keys": "a", "duration_ms": 750}), PACING
    )
    assert steps[0].events == (KeyEvent("a", True),)
    assert steps[0].pause_s == pytest.approx(0.75)


@pytest.mark.parametrize("size", [320, 640, 800, 1024, 1080, 1280, 1920, 4096])
def test_pixel_to_abs_lands_on_the_same_pixel_both_ways(size: int) -> None:
    for pixel in {0, 1, size // 2, size - 2, size - 1}:
        value = pixel_to_abs(pixel, size)
        assert 0 <= value <= ABS_MAX
        # QEMU's tablet scales with (value * size) / 0x8000 (floor), X with value*(size-1)/0x7fff.
        assert value * size // (ABS_MAX + 1) == pixel
        assert round(value * (size - 1) / ABS_MAX) == pixel
