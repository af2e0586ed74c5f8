"""Turn one action into paced batches of input events. Pure: no I/O, no clock.

Events sent back to back with no pacing lose keystrokes under TCG (measured: see
ARCHITECTURE.md), so every key and button transition is its own batch followed by a
pause. Every plan releases whatever it pressed, so no modifier stays latched.

With *key flow control* (the display waits until the guest has room for each key batch,
see :mod:`orchestrator.display.qmp`) keys need no fixed pause: key steps pause
:attr:`Pacing.key_flow_s` instead of :attr:`Pacing.key_s`, and each character of typed
text is one batch (its modifier presses, key press and release, modifier releases), which
cuts the round trips to QEMU per character from two or four to one.

Keys follow the guest's keyboard layout (``keyboard_layout``): typed text becomes the keys
that produce each character on that layout, and key combos the keys that give the same
keysyms there (``ctrl+z`` on ``de`` presses the key US calls ``y``); see
:func:`agent_bridge.protocol.keys.layout_combos`.

Two inputs have no QEMU path and become :class:`HelperStep` requests to the in-guest helper
(:mod:`orchestrator.display.guest_helper`): text with a character that has no key on the
guest's layout (the whole text goes to the helper, so its characters stay in order), and the
horizontal wheel when the display has none (QEMU before 8.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias

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
from agent_bridge.protocol.keys import KeyCombo, layout_combos, text_to_combos
from orchestrator.display.base import AbsMove, ButtonEvent, InputEvent, KeyEvent, WheelEvent
from orchestrator.errors import ActionError

__all__ = ["HelperStep", "Pacing", "PlanStep", "Step", "helper_mods", "plan_action", "release_all"]

# X11 core state bits of the modifiers a plan can hold (Shift, Control, Mod1, Mod4).
_X11_MOD_BITS = {
    "shift": 0x01, "shift_r": 0x01, "ctrl": 0x04, "ctrl_r": 0x04,
    "alt": 0x08, "alt_r": 0x08, "meta_l": 0x40, "meta_r": 0x40,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Pacing:
    """Pauses between input batches, in seconds.

    Attributes:
        key_s: after each key press or release, when keys are paced by time (no key flow
            control: a QEMU without ``x-query-virtio-queue-element``, or a guest without a
            virtio-input driver, whose keys QEMU gives to the PS/2 keyboard). Measured on
            the PS/2 keyboard with ``bench/input_typing.py``
            (TCG guest, 2 shared host cores, probe text field, 3 x 400 printable ASCII
            characters per setting, all exact): 12 ms -> 18-19 chars/s, 4 ms -> 34-39,
            0 ms -> 60-68 on a quiet host. But the guest's PS/2 queue holds 16 bytes (about
            three shifted characters): when the host is loaded and the vCPU stalls, a short
            pause overflows it. At 4 ms a 1000-character text lost 12 characters in a CI run
            with a second VM test running beside it; 12 ms (3x the headroom) is the default.
        button_s: after each button press or release and after pointer moves.
        multi_click_gap_s: after each button transition of a double/triple click but the
            last (the first press too): 40 ms, inside every toolkit's multi-click time (Tk
            500 ms, GTK 400 ms, xterm 250 ms, counted by X event times) and above libinput's
            25 ms button debounce (a release and a press closer than that are dropped as a
            bounce when the guest's quirk to turn debouncing off is not in effect). Sending
            the transitions back to back (0) was tried: a quiet CI-like run lost a double
            click that way, so the spaced default stays until that is understood.
        drag_step_s: between the intermediate moves of a drag.
        wheel_s: after each wheel notch.
        key_flow_s: after each key batch when the display has key flow control (the guest's
            acknowledgement paces keys, so no pause is needed for exactness).
    """

    key_s: float = 0.012
    button_s: float = 0.02
    multi_click_gap_s: float = 0.04
    drag_step_s: float = 0.02
    wheel_s: float = 0.02
    key_flow_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Step:
    """One batch of events sent together, then a pause of ``pause_s`` seconds."""

    events: tuple[InputEvent, ...]
    pause_s: float


@dataclass(frozen=True, slots=True)
class HelperStep:
    """One request to the in-guest helper, then a pause of ``pause_s`` seconds.

    Attributes:
        op: ``"type"`` (args: ``text``) or ``"wheel"`` (args: ``direction``, ``count``,
            ``x``, ``y`` display pixels where the pointer must be, ``mods`` X11 state bits
            that must be held).
        args: the request's members (see ``deskvm-helper``'s protocol).
        pause_s: pause after the reply.
    """

    op: Literal["type", "wheel"]
    args: dict[str, Any] = field(default_factory=dict)
    pause_s: float = 0.0

    @property
    def events(self) -> tuple[InputEvent, ...]:
        """No QEMU events: the helper injects in the guest."""
        return ()


PlanStep: TypeAlias = Step | HelperStep


def helper_mods(hold: KeyCombo | None) -> int:
    """X11 state bits (Shift 0x1, Control 0x4, Mod1 0x8, Mod4 0x40) of held modifier qcodes."""
    if hold is None:
        return 0
    bits = 0
    for qcode in hold.qcodes:
        bits |= _X11_MOD_BITS.get(qcode, 0)
    return bits


def _press(combo: KeyCombo, pacing: Pacing) -> list[Step]:
    return [Step((KeyEvent(q, True),), pacing.key_s) for q in combo.qcodes]


def _release(combo: KeyCombo, pacing: Pacing) -> list[Step]:
    return [Step((KeyEvent(q, False),), pacing.key_s) for q in reversed(combo.qcodes)]


def _tap(combo: KeyCombo, pacing: Pacing) -> list[Step]:
    return _press(combo, pacing) + _release(combo, pacing)


def _tap_batch(combo: KeyCombo, pacing: Pacing) -> Step:
    """One batch pressing and releasing ``combo`` (for displays with key flow control)."""
    events = [KeyEvent(q, True) for q in combo.qcodes]
    events += [KeyEvent(q, False) for q in reversed(combo.qcodes)]
    return Step(tuple(events), pacing.key_s)


def _move(x: int | None, y: int | None, pacing: Pacing) -> list[Step]:
    if x is None or y is None:
        return []
    return [Step((AbsMove(x, y),), pacing.button_s)]


def _button(button: Button, down: bool, pacing: Pacing, pause_s: float | None = None) -> Step:
    return Step((ButtonEvent(button.value, down),), pacing.button_s if pause_s is None else pause_s)


def _wheel(
    dx: int,
    dy: int,
    pacing: Pacing,
    *,
    horizontal_wheel: bool,
    at: tuple[int, int],
    hold: KeyCombo | None,
) -> list[PlanStep]:
    steps: list[PlanStep] = []
    for amount, neg, pos in ((dy, "up", "down"), (dx, "left", "right")):
        if not amount:
            continue
        direction = pos if amount > 0 else neg
        if pos == "right" and not horizontal_wheel:
            args = {"direction": direction, "count": abs(amount), "x": at[0], "y": at[1],
                    "mods": helper_mods(hold)}  # fmt: skip
            steps.append(HelperStep("wheel", args, pacing.wheel_s))
            continue
        steps += [Step((WheelEvent(direction),), pacing.wheel_s) for _ in range(abs(amount))]  # type: ignore[arg-type]
    return steps


def plan_action(
    action: Action,
    pacing: Pacing,
    *,
    horizontal_wheel: bool = True,
    cursor: tuple[int, int] = (0, 0),
    key_flow_control: bool = False,
    keyboard_layout: str = "us",
) -> list[PlanStep]:
    """The paced input steps that carry out ``action`` (empty for non-input actions).

    Coordinates must already be checked against the screen
    (:func:`agent_bridge.protocol.check_bounds`).

    Args:
        action: what to do.
        pacing: pauses between steps.
        horizontal_wheel: whether the display carries horizontal wheel events; when not,
            horizontal scrolling is a :class:`HelperStep`.
        cursor: where the pointer is before the action (display pixels), for scrolls
            without coordinates done by the helper.
        key_flow_control: the display waits for the guest before each key batch: key
            steps pause ``pacing.key_flow_s`` and each typed character is one batch.
        keyboard_layout: the guest's layout (:data:`agent_bridge.protocol.keys.KEYBOARD_LAYOUTS`).

    Returns:
        :class:`Step` batches for QEMU and :class:`HelperStep` requests, in order. Text
        with a character that has no key on the layout is one ``HelperStep("type")`` for the
        whole text; the caller decides whether a helper is there to take it.

    Raises:
        ActionError: ``unknown_key``: a key combo names a character that has no key on
            ``keyboard_layout``.
    """
    if key_flow_control:
        pacing = replace(pacing, key_s=pacing.key_flow_s)
    return list(_plan(action, pacing, horizontal_wheel, cursor, key_flow_control, keyboard_layout))


def _plan(
    action: Action,
    pacing: Pacing,
    horizontal_wheel: bool,
    cursor: tuple[int, int],
    batch_chars: bool,
    layout: str,
) -> Sequence[PlanStep]:
    if isinstance(action, Move | Click | Drag | Scroll) and action.hold is not None:
        action = replace(action, hold=_single(action.hold, layout))
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
                press_pause_s = pacing.button_s if count == 1 else pacing.multi_click_gap_s
                steps.append(_button(button, True, pacing, press_pause_s))
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
            at = (x, y) if x is not None and y is not None else cursor
            plan: list[PlanStep] = [*_move(x, y, pacing)]
            if hold is not None:
                plan += _press(hold, pacing)
            plan += _wheel(dx, dy, pacing, horizontal_wheel=horizontal_wheel, at=at, hold=hold)
            if hold is not None:
                plan += _release(hold, pacing)
            return plan
        case Type(text=text):
            try:
                combos = text_to_combos(text, layout)
            except ActionError:
                return [HelperStep("type", {"text": text}, pacing.key_s)]
            if batch_chars:
                return [_tap_batch(combo, pacing) for combo in combos]
            steps = []
            for combo in combos:
                steps += _tap(combo, pacing)
            return steps
        case Key(combos=combos):
            steps = []
            for combo in combos:
                for keys in layout_combos(combo, layout):
                    steps += _tap(keys, pacing)
            return steps
        case HoldKey(combo=combo, duration_ms=ms):
            combo = _single(combo, layout)
            held = _press(combo, pacing)
            if held:
                held[-1] = Step(held[-1].events, max(held[-1].pause_s, ms / 1000))
            return held + _release(combo, pacing)
        case _:
            return []


def _single(combo: KeyCombo, layout: str) -> KeyCombo:
    """``combo`` on ``layout`` as one combo (a dead key stays the dead key)."""
    return layout_combos(combo, layout, sequence=False)[0]


def release_all(keys: set[str], buttons: set[str]) -> Step:
    """One batch releasing every key (qcode) and button that may still be down."""
    events: list[InputEvent] = [KeyEvent(q, False) for q in sorted(keys)]
    events += [ButtonEvent(b, False) for b in sorted(buttons)]
    return Step(tuple(events), 0.0)
