"""A short input-fidelity check against the guest's input probe, over the bridge client.

Used by ``deskvm doctor --input`` (a user's way to check their own setup) and by
``bench/input_typing.py``. The session must have been created with
``autostart="input-probe"``: the probe (see the image recipe,
``/usr/local/bin/deskvm-input-probe``) writes every pointer, wheel, key and text-field event
it receives as one JSON object per line to the guest log, e.g.::

    {"ev":"button","action":"press","button":1,"x":0,"y":0,"count":1,"state":16,
     "modifiers":["num_lock"],"t_s":12.5}

Each check acts through :class:`agent_bridge.client.Session` (deskvm vocabulary, display
pixels) and compares what the probe reported with what was asked.
"""

from __future__ import annotations

import json
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent_bridge.client import RemoteError, Session

__all__ = [
    "ASCII_ALPHABET",
    "NON_US_ALPHABET",
    "NON_US_TEXT",
    "CheckRow",
    "ProbeReader",
    "TypingRun",
    "measure_typing",
    "run_input_check",
]

Event = dict[str, Any]

NON_US_TEXT = "Ñandú 美国降息新闻"
"""Text with no key on the US layout: typed by the image's guest helper, if it has one."""
ASCII_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " "
"""Printable ASCII: every character has a key on the US layout (typed through QEMU)."""
NON_US_ALPHABET = "ÑñáéíóúüçßàèøåæœЖжΩλ美国降息新闻日本語한국어" + string.ascii_letters
"""Accented, Cyrillic, Greek and CJK characters mixed with ASCII (all typed by the helper)."""

STUCK_MODIFIERS = frozenset(
    {"shift", "caps_lock", "control", "alt", "mod3", "super", "mod5",
     "button1", "button2", "button3", "button4", "button5"}
)  # fmt: skip
"""X11 state-mask names that must be clear between actions (num_lock is left as found)."""


@dataclass(frozen=True, slots=True)
class CheckRow:
    """One line of the check's table.

    Attributes:
        case: what was asked, e.g. ``"click (0,0)"``.
        ok: whether the guest received exactly that.
        detail: what the guest received (or why the check failed).
    """

    case: str
    ok: bool
    detail: str


class ProbeReader:
    """Reads the probe's JSON lines from a session's guest log.

    Args:
        session: a session started with ``autostart="input-probe"``.
    """

    def __init__(self, session: Session) -> None:
        self.session = session

    def mark(self) -> int:
        """The current end of the guest log (characters): events after it are new."""
        return len(self.session.guest_log())

    def events(self, since: int = 0) -> list[Event]:
        """The probe's events after character offset ``since`` of the guest log.

        The guest log is rotated (virtlogd keeps 2 MiB per file, and the probe echoes its
        whole text field on every change): a log shorter than ``since`` was rotated, and
        its events are all new.
        """
        log = self.session.guest_log()
        if len(log) < since:
            since = 0
        out: list[Event] = []
        for line in log[since:].splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def wait(
        self, since: int, done: Callable[[list[Event]], bool], timeout_s: float = 20.0
    ) -> list[Event]:
        """Events after ``since`` as soon as ``done(events)`` holds, or at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            events = self.events(since)
            if done(events) or time.monotonic() > deadline:
                return events
            time.sleep(0.2)

    def text_value(self) -> str:
        """The probe's text field as last reported (``""`` before any change)."""
        values = [e["value"] for e in self.events() if e.get("ev") == "text"]
        return str(values[-1]) if values else ""

    def clear_text(self, timeout_s: float = 20.0) -> bool:
        """Empty the text field (Tk Text: ``ctrl+/`` selects all, ``Delete``); True if empty."""
        if self.text_value() == "":
            return True
        since = self.mark()
        self.session.key("ctrl+slash Delete")
        return has_text(self.wait(since, lambda ev: has_text(ev, ""), timeout_s), "")


def has_text(events: list[Event], value: str) -> bool:
    """Whether the text field was reported holding exactly ``value``."""
    return any(e.get("ev") == "text" and e.get("value") == value for e in events)


def find_key(events: list[Event], keysym: str, action: str) -> Event | None:
    """The first key event with ``keysym`` and ``action`` (``press`` / ``release``)."""
    for e in events:
        if e.get("ev") == "key" and e.get("keysym") == keysym and e.get("action") == action:
            return e
    return None


def presses(events: list[Event]) -> list[Event]:
    """Button presses (wheel notches excluded)."""
    return [e for e in events if e.get("ev") == "button" and e.get("action") == "press"]


def releases(events: list[Event]) -> list[Event]:
    """Button releases."""
    return [e for e in events if e.get("ev") == "button" and e.get("action") == "release"]


def run_input_check(session: Session, width_px: int, height_px: int) -> list[CheckRow]:
    """Run the short fidelity check on a probe session.

    Cases: typing (symbols, Return, Tab; text with no US key, through the guest helper), a
    key combo with its modifier state, clicks at the corners and the centre, a double
    click's click count, vertical and horizontal wheel notches, and no modifier or button
    left down after all of it.

    Args:
        session: started with ``autostart="input-probe"``.
        width_px, height_px: its display size.

    Returns:
        One :class:`CheckRow` per case, in order.

    Raises:
        RemoteError, BridgeConnectionError: the bridge failed (not a fidelity failure).
    """
    probe = ProbeReader(session)
    rows: list[CheckRow] = []

    def row(case: str, ok: bool, detail: str) -> None:
        rows.append(CheckRow(case, ok, detail))

    for text in ("Hello_World-42 (a>b) & {x|y} ~!@#$%^*", "tab\there\nnext line", NON_US_TEXT):
        probe.clear_text()
        since = probe.mark()
        try:
            session.type(text)
        except RemoteError as exc:  # e.g. untypeable_text: the image has no guest helper
            row(f"type {text!r}", False, f"{exc.code}: {exc}")
            continue
        events = probe.wait(since, _text_is(text))
        got = [e["value"] for e in events if e.get("ev") == "text"]
        last = got[-1] if got else ""
        row(f"type {text!r}", last == text, f"field: {last!r}")

    since = probe.mark()
    session.key("ctrl+shift+t")
    events = probe.wait(since, lambda ev: find_key(ev, "T", "release") is not None)
    press = find_key(events, "T", "press")
    mods = set(press["modifiers"]) - {"num_lock"} if press else set()
    row("key ctrl+shift+t", mods == {"control", "shift"}, f"T with {sorted(mods)}")

    cx, cy = width_px // 2, height_px // 2
    for x, y in ((0, 0), (width_px - 1, height_px - 1), (cx, cy)):
        since = probe.mark()
        session.click(x, y)
        events = probe.wait(since, lambda ev: bool(releases(ev)))
        got_at = [(p["x"], p["y"]) for p in presses(events)]
        row(f"click ({x},{y})", got_at == [(x, y)], f"pressed at {got_at}")

    # A point no earlier click of this check used: toolkits chain clicks within a few
    # pixels only (Tk, GTK: 5), so a late guest cannot chain this one to an earlier one.
    session.move(cx - 90, cy + 110)
    since = probe.mark()
    session.double_click(cx - 90, cy + 150)
    events = probe.wait(since, lambda ev: len(releases(ev)) >= 2)
    counts = [p["count"] for p in presses(events)]
    row("double_click", counts == [1, 2], f"click counts {counts}")

    for dx, dy in ((0, 3), (0, -3), (3, 0), (-3, 0)):
        name = f"scroll dx={dx}" if dx else f"scroll dy={dy}"
        since = probe.mark()
        try:
            session.scroll(cx + 200, cy + 200, dx=dx, dy=dy)
        except RemoteError as exc:  # unsupported_input: no QEMU wheel and no guest helper
            row(name, False, f"{exc.code}: {exc}")
            continue
        events = probe.wait(since, _wheels_at_least(abs(dx) + abs(dy)), timeout_s=8.0)
        notches = [e["direction"] for e in events if e.get("ev") == "wheel"]
        want = [("right" if dx > 0 else "left") if dx else ("down" if dy > 0 else "up")]
        row(name, notches == want * (abs(dx) + abs(dy)), f"notches {notches}")

    since = probe.mark()
    session.key("Escape")
    events = probe.wait(since, lambda ev: find_key(ev, "Escape", "press") is not None)
    press = find_key(events, "Escape", "press")
    stuck = sorted(set(press["modifiers"]) & STUCK_MODIFIERS) if press else ["(no key seen)"]
    row("nothing left pressed", not stuck, f"held: {stuck}")
    return rows


def _text_is(text: str) -> Callable[[list[Event]], bool]:
    return lambda events: has_text(events, text)


def _wheels_at_least(count: int) -> Callable[[list[Event]], bool]:
    return lambda events: sum(e.get("ev") == "wheel" for e in events) >= count


def measure_typing(
    session: Session, chars: int, timeout_s: float = 300.0, *, alphabet: str = ASCII_ALPHABET
) -> TypingRun:
    """Type ``chars`` characters of ``alphabet`` into the probe's field and time it.

    Args:
        session: a probe session.
        chars: how many characters.
        timeout_s: how long to wait for the probe to show the whole text.
        alphabet: characters cycled through; :data:`ASCII_ALPHABET` goes through QEMU's
            keyboard, :data:`NON_US_ALPHABET` through the guest helper.

    Returns:
        The timings and whether the field then held exactly the text (nothing dropped,
        doubled or reordered).
    """
    probe = ProbeReader(session)
    if not probe.clear_text():
        return TypingRun(chars, 0.0, 0.0, False, f"field not cleared: {probe.text_value()[:40]!r}")
    text = (alphabet * (chars // len(alphabet) + 1))[:chars]
    since = probe.mark()
    t0 = time.monotonic()
    session.type(text)
    sent_s = time.monotonic() - t0
    events = probe.wait(since, lambda ev: has_text(ev, text), timeout_s)
    seen_s = time.monotonic() - t0
    if has_text(events, text):
        return TypingRun(chars, sent_s, seen_s, True)
    values = [e["value"] for e in events if e.get("ev") == "text"]
    got = str(values[-1]) if values else ""
    at = next((i for i, (a, b) in enumerate(zip(got, text, strict=False)) if a != b), None)
    at = min(len(got), len(text)) if at is None else at
    detail = (
        f"field has {len(got)} chars; first difference at {at}: "
        f"got {got[at : at + 12]!r}, want {text[at : at + 12]!r}"
    )
    return TypingRun(chars, sent_s, seen_s, False, detail)


@dataclass(frozen=True, slots=True)
class TypingRun:
    """One timed ``type`` into the probe.

    Attributes:
        chars: characters typed.
        sent_s: seconds for the ``type`` request (every key event injected, paced).
        seen_s: seconds until the probe reported the whole text on the guest log (adds
            the guest's own work: the probe echoes its whole field on every change).
        exact: the field held exactly the text typed.
        detail: when not exact, how the field differed ("" when exact).
    """

    chars: int
    sent_s: float
    seen_s: float
    exact: bool
    detail: str = ""

    @property
    def chars_per_s(self) -> float:
        """Injection rate: characters per second of the ``type`` request."""
        return self.chars / self.sent_s if self.sent_s > 0 else 0.0
