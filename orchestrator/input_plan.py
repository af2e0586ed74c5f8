"""Turn one action into paced batches of input events. Pure: no I/O, no clock.

Events sent back to back with no pacing lose keystrokes under TCG (measured: see
ARCHITECTURE.md), so every key and button transition is its own batch followed by a
pause. Every plan releases whatever it pressed, so no modifier stays latched.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_bridge.protocol.actions import (
    Action,
    Button,
    Click,
    Drag,
    HoldKey,
    Key,
    MouseDown,
    MouseUp,
    Move,
    Scroll,
    Type,
)
from agent_bridge.protocol.keys import KeyCombo, text_to_combos
from orchestrator.display.base import AbsMove, ButtonEvent, InputEvent, KeyEvent, WheelEvent

__all__ = ["Pacing", "Step", "plan_action", "release_all"]


@dataclass(frozen=True, slots=True)
class Pacing:
    """Pauses between input batches, in seconds.

    Attributes:
        key_s: after each key press or release. Measured with ``bench/input_typing.py``
            (TCG guest, 2 shared host cores, probe text field, 3 x 400 printable ASCII
            characters per setting, all exact): 12 ms -> 18-19 chars/s, 4 ms -> 34-39,
            0 ms -> 60-68 on a quiet host. But the guest's PS/2 queue holds 16 bytes (about
            three shifted characters): when the host is loaded and the vCPU stalls, a short
            pause overflows it. At 4 ms a 1000-character text lost 12 characters in a CI run
            with a second VM test running beside it; 12 ms (3x the headroom) is the default.
        button_s: after each button press or release and after pointer moves.
        multi_click_gap_s: between the clicks of a double/triple click (well inside the
            toolkits' double-click time, typically 400 ms).
        drag_step_s: between the intermediate moves of a drag.
        wheel_s: after each wheel notch.
    """

    key_s: float = 0.012
    button_s: float = 0.02
    multi_click_gap_s: float = 0.04
    drag_step_s: float = 0.02
    wheel_s: float = 0.02


@dataclass(frozen=True, slots=True)
class Step:
    """One batch of events sent together, then a pause of ``pause_s`` seconds."""

    events: tuple[InputEvent, ...]
    pause_s: float


def _press(combo: KeyCombo, pacing: Pacing) -> list[Step]:
    return [Step((KeyEvent(q, True),), pacing.key_s) for q in combo.qcodes]


def _release(combo: KeyCombo, pacing: Pacing) -> list[Step]:
    return [Step((KeyEvent(q, False),), pacing.key_s) for q in reversed(combo.qcodes)]


def _tap(combo: KeyCombo, pacing: Pacing) -> list[Step]:
    return _press(combo, pacing) + _release(combo, pacing)


def _move(x: int | None, y: int | None, pacing: Pacing) -> list[Step]:
    if x is None or y is None:
        return []
    return [Step((AbsMove(x, y),), pacing.button_s)]


def _button(button: Button, down: bool, pacing: Pacing, pause_s: float | None = None) -> Step:
    return Step((ButtonEvent(button.value, down),), pacing.button_s if pause_s is None else pause_s)


def _wheel(dx: int, dy: int, pacing: Pacing) -> list[Step]:
    steps: list[Step] = []
    for amount, neg, pos in ((dy, "up", "down"), (dx, "left", "right")):
        direction = pos if amount > 0 else neg
        steps += [Step((WheelEvent(direction),), pacing.wheel_s) for _ in range(abs(amount))]  # type: ignore[arg-type]
    return steps


def plan_action(action: Action, pacing: Pacing) -> list[Step]:
    """The paced input steps that carry out ``action`` (empty for non-input actions).

    Coordinates must already be checked against the screen
    (:func:`agent_bridge.protocol.check_bounds`).

    Raises:
        ActionError: text with a character that has no key on the US layout.
    """
    match action:
        case Move(x=x, y=y, hold=hold):
            if hold is None:
                return _move(x, y, pacing)
            return [*_press(hold, pacing), *_move(x, y, pacing), *_release(hold, pacing)]
        case Click(x=x, y=y, button=button, count=count, hold=hold):
            steps = _move(x, y, pacing)
            if hold is not None:
                steps += _press(hold, pacing)
            for i in range(count):
                steps.append(_button(button, True, pacing, pacing.button_s))
                last = i == count - 1
                steps.append(
                    _button(button, False, pacing, None if last else pacing.multi_click_gap_s)
                )
            if hold is not None:
                steps += _release(hold, pacing)
            return steps
        case MouseDown(button=button, x=x, y=y):
            return [*_move(x, y, pacing), _button(button, True, pacing)]
        case MouseUp(button=button, x=x, y=y):
            return [*_move(x, y, pacing), _button(button, False, pacing)]
        case Drag(path=path, button=button, hold=hold):
            first, *rest = path
            steps = _move(*first, pacing)
            if hold is not None:
                steps += _press(hold, pacing)
            steps.append(_button(button, True, pacing))
            steps += [Step((AbsMove(x, y),), pacing.drag_step_s) for x, y in rest]
            steps.append(_button(button, False, pacing))
            if hold is not None:
                steps += _release(hold, pacing)
            return steps
        case Scroll(x=x, y=y, dx=dx, dy=dy, hold=hold):
            steps = _move(x, y, pacing)
            if hold is not None:
                steps += _press(hold, pacing)
            steps += _wheel(dx, dy, pacing)
            if hold is not None:
                steps += _release(hold, pacing)
            return steps
        case Type(text=text):
            steps = []
            for combo in text_to_combos(text):
                steps += _tap(combo, pacing)
            return steps
        case Key(combos=combos):
            steps = []
            for combo in combos:
                steps += _tap(combo, pacing)
            return steps
        case HoldKey(combo=combo, duration_ms=ms):
            held = _press(combo, pacing)
            if held:
                held[-1] = Step(held[-1].events, max(held[-1].pause_s, ms / 1000))
            return held + _release(combo, pacing)
        case _:
            return []


def release_all(keys: set[str], buttons: set[str]) -> Step:
    """One batch releasing every key (qcode) and button that may still be down."""
    events: list[InputEvent] = [KeyEvent(q, False) for q in sorted(keys)]
    events += [ButtonEvent(b, False) for b in sorted(buttons)]
    return Step(tuple(events), 0.0)
