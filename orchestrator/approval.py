"""Human in the loop: which actions need an operator's approval, and the wait for it.

Two parts, kept apart:

* :class:`ApprovalPolicy` is pure: given an action it says whether it must be held, and
  why (action kinds, key combos, typed-text regular expressions, or every action in
  supervised mode). No I/O, no clock. Text rules look at the action's own text *and* at
  the session's recent typed text (:class:`TypedWindow`), so a rule cannot be dodged by
  splitting the text over several actions (``"rm -"``, then ``"rf"``); see
  :func:`typed_effect` for exactly what counts as typed text.
* :class:`ApprovalDesk` is the small waiting mechanism: the caller (the bridge, before it
  injects an action) files a :class:`PendingAction` and blocks until an operator decides
  or the deadline passes; no answer before the deadline means deny.

Errors: :class:`ApprovalDenied` (code ``approval_denied``) and :class:`ApprovalTimeout`
(code ``approval_timeout``) derive from :class:`~orchestrator.errors.ActionError`, so the
agent gets a structured error and nothing reaches the guest.
"""

from __future__ import annotations

import secrets
import shlex
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from agent_bridge.protocol.actions import ACTION_KINDS, Action, HoldKey, Key, Type, action_name
from agent_bridge.protocol.guest import Exec, GetFile, PutFile
from agent_bridge.protocol.keys import KeyCombo, combo_text, parse_combo
from orchestrator.bounded_regex import (
    BoundedPattern,
    RegexError,
    RegexTimeout,
    compile_bounded,
)
from orchestrator.clock import Clock, SystemClock
from orchestrator.errors import ActionError, ConfigError, DeskvmError

__all__ = [
    "TYPED_WINDOW_CHARS",
    "ApprovalDenied",
    "ApprovalDesk",
    "ApprovalPolicy",
    "ApprovalTimeout",
    "Decision",
    "PendingAction",
    "TypedWindow",
    "typed_effect",
]

Decision = Literal["approve", "deny"]
_MAX_RULES = 64
_OBSERVATION_KINDS = ("screenshot", "zoom", "cursor_position")
_KIND_HINTS = {
    # Vendor (Anthropic, OpenAI, OSWorld) names and deskvm vocabulary spellings of kinds:
    # the action each becomes, which is what a rule must name.
    "left_click": "click", "right_click": "click", "middle_click": "click",
    "double_click": "click", "triple_click": "click", "doubleclick": "click",
    "mouse_move": "move", "left_click_drag": "drag", "left_mouse_down": "mouse_down",
    "left_mouse_up": "mouse_up", "keypress": "key", "press": "key", "hotkey": "key",
    "typing": "type", "write": "type", "hold": "hold_key", "key_down": "hold_key",
    "move_to": "move", "drag_to": "drag", "scroll_up": "scroll", "scroll_down": "scroll",
}  # fmt: skip
_MAX_PATTERN_CHARS = 200
MATCH_BUDGET_S = 0.25
"""Seconds all the patterns of one action may take to decide, together; past it the
action is held (see :meth:`ApprovalPolicy.reason`)."""

TYPED_WINDOW_CHARS = 1024
"""How many of the most recently typed characters a session keeps for text rules."""

_BACKSPACE = "\b"
"""Marks a ``backspace`` key press in :func:`typed_effect` (it removes one character)."""


def _key_effect(combo: KeyCombo) -> str:
    if combo.qcodes == ("backspace",):
        return _BACKSPACE
    text = combo_text(combo)
    return "" if text is None else text


def typed_effect(action: Action) -> str:
    """What ``action`` types into the guest, as text rules see it.

    * ``type``: its text (``\\r`` read as ``\\n``), secret or not.
    * ``key``: every combo that types a character on the US layout, in order
      (``shift+1`` is ``!``, ``Return`` and ``KP_Enter`` are ``\\n``, ``Tab`` is ``\\t``,
      ``space``, keypad digits and operators); ``BackSpace`` is returned as ``"\\b"``
      and removes the character before it. Combos with ctrl, alt or meta type nothing.
    * ``hold_key`` of such a key: its character once (the guest's autorepeat may type
      more; that is not modelled).
    * everything else (pointer actions, waits, observations): nothing.

    Returns:
        The text, possibly with ``"\\b"`` marks; ``""`` when the action types nothing.
    """
    match action:
        case Type(text=text):
            return text.replace("\r", "\n")
        case Key(combos=combos):
            return "".join(_key_effect(c) for c in combos)
        case HoldKey(combo=combo):
            return _key_effect(combo)
        case _:
            return ""


def _apply(text: str, effect: str) -> str:
    """``text`` followed by ``effect``, each ``"\\b"`` removing the character before it."""
    if _BACKSPACE not in effect:
        return text + effect
    out = list(text)
    for char in effect:
        if char == _BACKSPACE:
            if out:
                out.pop()
        else:
            out.append(char)
    return "".join(out)


class TypedWindow:
    """Recent text typed into one session, for text rules.

    Fed with every action that reaches the guest (:meth:`feed`); text rules of an
    :class:`ApprovalPolicy` search the last ``max_chars`` characters followed by the next
    action's text. A backspace removes the last character; up to ``history_chars``
    characters are remembered so that text erased with backspaces brings earlier text
    back into the window (typing filler and erasing it does not push a rule's start out).
    Secret text takes part in the matching but is never exported: :meth:`to_json`
    replaces each secret character by U+FFFD. Not thread-safe: the session feeds it under
    its action lock.

    Args:
        max_chars: how many of the latest characters text rules see.
        history_chars: how many characters are remembered for backspaces.
    """

    def __init__(
        self, max_chars: int = TYPED_WINDOW_CHARS, history_chars: int = 64 * TYPED_WINDOW_CHARS
    ) -> None:
        self.max_chars = max_chars
        self.history_chars = max(history_chars, max_chars)
        self._text = ""
        self._secret: list[bool] = []

    @property
    def text(self) -> str:
        """The text rules see now: the last ``max_chars`` characters (oldest first)."""
        return self._text[-self.max_chars :]

    def preview(self, action: Action) -> tuple[str, int]:
        """``(text, kept)``: what text rules see once ``action`` has typed, and how many of
        its first characters were already there before ``action``."""
        effect = typed_effect(action)
        before = self._text
        after = _apply(before, effect)
        kept = len(before)
        if _BACKSPACE in effect:
            kept = 0
            limit = min(len(before), len(after))
            while kept < limit and before[kept] == after[kept]:
                kept += 1
        # Rules see max_chars of the old text before the action's part (all of it).
        start = max(0, kept - self.max_chars)
        return after[start:], kept - start

    def feed(self, action: Action) -> None:
        """Add what ``action`` types (see :func:`typed_effect`)."""
        effect = typed_effect(action)
        if not effect:
            return
        secret = isinstance(action, Type) and action.secret
        marks = self._secret
        for char in effect:
            if char == _BACKSPACE:
                if marks:
                    marks.pop()
            else:
                marks.append(secret)
        self._text = _apply(self._text, effect)[-self.history_chars :]
        self._secret = marks[-len(self._text) :] if self._text else []

    def clear(self) -> None:
        """Forget everything typed so far."""
        self._text = ""
        self._secret = []

    def to_json(self) -> str:
        """The last ``max_chars`` characters for storage, secret ones replaced by U+FFFD."""
        n = self.max_chars
        pairs = zip(self._text[-n:], self._secret[-n:], strict=True)
        return "".join("\ufffd" if secret else char for char, secret in pairs)

    @classmethod
    def from_json(cls, text: str, max_chars: int = TYPED_WINDOW_CHARS) -> TypedWindow:
        """A window restored from :meth:`to_json` (a masked character matches no rule
        character typed later; it stands in for one that was there)."""
        window = cls(max_chars)
        window._text = text[-max_chars:]
        window._secret = [c == "\ufffd" for c in window._text]
        return window


def _match_ending_after(regex: BoundedPattern, text: str, after: int, deadline: float) -> bool:
    """Whether ``regex`` matches somewhere in ``text`` with a match ending past ``after``.

    Tries the leftmost match from each start position in turn, so a match found earlier
    that lies wholly in the old text does not hide a later one that reaches the new text.
    """
    pos = 0
    while pos <= len(text):
        match = regex.search(text, pos, deadline=deadline)
        if match is None:
            return False
        if match.end() > after:
            return True
        pos = match.start() + 1
    return False


class ApprovalDenied(ActionError):
    """An operator denied the action; it was not injected."""

    code = "approval_denied"


class ApprovalTimeout(ActionError):
    """No operator decided before the deadline; the action was not injected."""

    code = "approval_timeout"


def _check_kinds(kinds: tuple[str, ...]) -> None:
    """Refuse kinds no action has (a rule that can never match), naming the valid ones.

    Raises:
        ConfigError: a kind is not a deskvm action kind (vendor names get the deskvm kind
            they become as a hint).
    """
    for kind in kinds:
        if not isinstance(kind, str):
            raise ConfigError(f"approval kinds must be strings, got {kind!r}")
        if kind in ACTION_KINDS:
            continue
        hint = _KIND_HINTS.get(kind)
        said = (
            f"; {kind!r} is carried out as a {hint!r} action: name {hint!r} (it holds every {hint})"
            if hint is not None
            else ""
        )
        raise ConfigError(
            f"approval kind {kind!r} matches no action{said}. Rules match deskvm action "
            f"kinds, whatever vocabulary the agent speaks: {', '.join(sorted(ACTION_KINDS))}"
        )


def _compile(name: str, patterns: tuple[str, ...]) -> tuple[BoundedPattern, ...]:
    regexes = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigError(f"approval {name} must be strings, got {pattern!r}")
        if len(pattern) > _MAX_PATTERN_CHARS:
            raise ConfigError(f"approval pattern longer than {_MAX_PATTERN_CHARS} chars")
        try:
            regexes.append(compile_bounded(pattern))
        except RegexError as exc:
            raise ConfigError(f"approval pattern {pattern!r}: {exc}") from exc
    return tuple(regexes)


@dataclass(frozen=True, slots=True)
class ApprovalPolicy:
    """Which actions of a session are held for an operator.

    Attributes:
        every_action: supervised mode: hold every action (screenshots and cursor queries
            included only if ``include_observations``).
        kinds: action names (``"click"``, ``"type"``, ``"key"``...) to hold.
        key_combos: key combos (``"ctrl+alt+delete"``, ``"meta"``) to hold, in any ``key``
            or ``hold_key`` action; parsed like the ``key`` action's ``keys``.
        text_patterns: regular expressions (:mod:`re` syntax and meaning; searched with a
            deadline, :mod:`orchestrator.bounded_regex`); an action is held when one
            matches (a search) its own ``type`` text, or the
            session's recent typed text followed by what the action types, with the match
            reaching into the action's part (see :meth:`reason` and :func:`typed_effect`).
        timeout_s: seconds an operator has to decide; then the action is denied.
        include_observations: in supervised mode, also hold screenshot/zoom/cursor queries.
        argv_patterns: regular expressions (as ``text_patterns``) held against a guest
            ``exec``'s command line: a search over its argv joined as a shell would quote it
            (``shlex.join``, e.g. ``rm -rf /tmp/x``).
        path_patterns: regular expressions (as ``text_patterns``) held against the path of
            a ``put_file`` or ``get_file`` (a search; the path as sent, already normalised).

    Raises:
        ConfigError: unknown combo, bad regular expression, too many rules, bad timeout.
    """

    every_action: bool = False
    kinds: tuple[str, ...] = ()
    key_combos: tuple[str, ...] = ()
    text_patterns: tuple[str, ...] = ()
    timeout_s: float = 60.0
    include_observations: bool = False
    argv_patterns: tuple[str, ...] = ()
    path_patterns: tuple[str, ...] = ()
    _combos: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _regexes: tuple[BoundedPattern, ...] = field(default=(), init=False, repr=False, compare=False)
    _argv_res: tuple[BoundedPattern, ...] = field(default=(), init=False, repr=False, compare=False)
    _path_res: tuple[BoundedPattern, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("kinds", "key_combos", "text_patterns", "argv_patterns", "path_patterns"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigError(f"approval {name} must be a list, not a string")
            if len(value) > _MAX_RULES:
                raise ConfigError(f"approval {name} has more than {_MAX_RULES} entries")
            object.__setattr__(self, name, tuple(value))
        if not 0 < self.timeout_s <= 3600:
            raise ConfigError(f"approval timeout_s {self.timeout_s} is outside (0, 3600]")
        _check_kinds(self.kinds)
        if self.include_observations and not self.every_action:
            raise ConfigError(
                "approval include_observations only applies with every_action: true (it adds "
                "screenshot, zoom and cursor_position to supervised mode); to hold one of "
                "them alone, name it in kinds"
            )
        combos = frozenset(str(parse_combo(c)) for c in self.key_combos)
        object.__setattr__(self, "_combos", combos)
        object.__setattr__(self, "_regexes", _compile("text_patterns", self.text_patterns))
        object.__setattr__(self, "_argv_res", _compile("argv_patterns", self.argv_patterns))
        object.__setattr__(self, "_path_res", _compile("path_patterns", self.path_patterns))

    def to_json(self) -> dict[str, object]:
        """The policy's fields as JSON-ready data (what :meth:`from_json` takes)."""
        return {
            "every_action": self.every_action,
            "kinds": list(self.kinds),
            "key_combos": list(self.key_combos),
            "text_patterns": list(self.text_patterns),
            "timeout_s": self.timeout_s,
            "include_observations": self.include_observations,
            "argv_patterns": list(self.argv_patterns),
            "path_patterns": list(self.path_patterns),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ApprovalPolicy:
        """A policy from :meth:`to_json` data.

        Raises:
            ConfigError: a field is missing or invalid.
        """
        try:
            return cls(
                every_action=bool(data["every_action"]),
                kinds=tuple(data["kinds"]),
                key_combos=tuple(data["key_combos"]),
                text_patterns=tuple(data["text_patterns"]),
                timeout_s=float(data["timeout_s"]),
                include_observations=bool(data["include_observations"]),
                argv_patterns=tuple(data.get("argv_patterns", ())),
                path_patterns=tuple(data.get("path_patterns", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not an approval policy: {exc!r}") from exc

    @property
    def empty(self) -> bool:
        """Whether the policy holds nothing."""
        return not (
            self.every_action
            or self.kinds
            or self.key_combos
            or self.text_patterns
            or self.argv_patterns
            or self.path_patterns
        )

    def reason(self, action: Action, typed: TypedWindow | None = None) -> str | None:
        """Why ``action`` must wait for approval, or ``None`` if it may run at once.

        Args:
            action: the action about to run.
            typed: the session's recent typed text; text rules then also match across
                actions: the window's text followed by what ``action`` types
                (:func:`typed_effect`, backspaces applied), where a match must end in the
                action's part (a match wholly in earlier text was checked when that
                text was typed).
        """
        name = action_name(action)
        if self.every_action and (
            self.include_observations or name not in ("screenshot", "zoom", "cursor_position")
        ):
            return "supervised: every action"
        if name in self.kinds:
            return f"action kind {name!r}"
        # Every pattern of this action shares one deadline; one that cannot decide in time
        # (it backtracks on this text) holds the action: an agent's text cannot stall the
        # server, nor get past a rule by being slow to match.
        deadline = time.monotonic() + MATCH_BUDGET_S
        try:
            return self._pattern_reason(action, typed, deadline)
        except RegexTimeout as exc:
            return (
                f"pattern /{exc.pattern}/ did not decide within {MATCH_BUDGET_S:g} s on this "
                "text (held: a rule that cannot decide holds)"
            )

    def _pattern_reason(
        self, action: Action, typed: TypedWindow | None, deadline: float
    ) -> str | None:
        match action:
            case Key(combos=combos):
                for combo in combos:
                    if str(combo) in self._combos:
                        return f"key combo {combo}"
            case HoldKey(combo=combo) if str(combo) in self._combos:
                return f"key combo {combo}"
            case Type(text=text):
                for regex in self._regexes:
                    if regex.search(text, deadline=deadline):
                        return f"typed text matches /{regex.pattern}/"
            case Exec(argv=argv):
                line = shlex.join(argv)
                for regex in self._argv_res:
                    if regex.search(line, deadline=deadline):
                        return f"exec argv matches /{regex.pattern}/"
            case PutFile(path=path) | GetFile(path=path):
                for regex in self._path_res:
                    if regex.search(path, deadline=deadline):
                        return f"path matches /{regex.pattern}/"
        if typed is not None and self._regexes and typed_effect(action):
            combined, kept = typed.preview(action)
            for regex in self._regexes:
                if _match_ending_after(regex, combined, kept, deadline):
                    return f"recent typed text matches /{regex.pattern}/"
        return None


@dataclass(slots=True)
class PendingAction:
    """An action held for an operator.

    Attributes:
        pending_id: random id, used to decide.
        session_id: whose action.
        action: the held action (display pixels).
        reason: which rule held it.
        requested_ns: monotonic time it was filed.
        deadline_ns: monotonic time after which it is denied.
        frame_png: the screen when it was filed (PNG), for the operator; may be empty.
        decision: ``None`` while pending.
        decided_by: who decided (``"timeout"`` when nobody did).
    """

    pending_id: str
    session_id: str
    action: Action
    reason: str
    requested_ns: int
    deadline_ns: int
    frame_png: bytes = b""
    decision: Decision | None = None
    decided_by: str | None = None


class ApprovalDesk:
    """Holds pending actions until an operator decides or the deadline passes.

    Thread-safe: :meth:`wait` blocks the calling worker thread; :meth:`decide` is called from
    another. Operators poll :meth:`pending`.

    Args:
        clock: time source (monotonic deadlines).
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        self._cond = threading.Condition()
        self._pending: dict[str, PendingAction] = {}

    def file(
        self, session_id: str, action: Action, reason: str, *, timeout_s: float, frame_png: bytes
    ) -> PendingAction:
        """Register a held action; returns it (pending)."""
        now = self._clock.monotonic_ns()
        item = PendingAction(
            pending_id=secrets.token_hex(6),
            session_id=session_id,
            action=action,
            reason=reason,
            requested_ns=now,
            deadline_ns=now + int(timeout_s * 1e9),
            frame_png=frame_png,
        )
        with self._cond:
            self._pending[item.pending_id] = item
        return item

    def wait(
        self,
        item: PendingAction,
        *,
        poll_s: float = 0.05,
        still_wanted: Callable[[], bool] | None = None,
    ) -> PendingAction:
        """Block until ``item`` is decided or its deadline passes (then: deny, by ``timeout``).

        Args:
            item: from :meth:`file`.
            poll_s: seconds between checks of the deadline and ``still_wanted``.
            still_wanted: returns ``False`` when waiting is pointless (the session ended);
                the action is then denied by ``"session ended"``.

        Returns:
            The item with ``decision`` and ``decided_by`` set.
        """
        with self._cond:
            while item.decision is None:
                left_s = (item.deadline_ns - self._clock.monotonic_ns()) / 1e9
                if left_s <= 0:
                    item.decision, item.decided_by = "deny", "timeout"
                    break
                if still_wanted is not None and not still_wanted():
                    item.decision, item.decided_by = "deny", "session ended"
                    break
                self._cond.wait(min(left_s, poll_s))
            self._pending.pop(item.pending_id, None)
        return item

    def decide(self, pending_id: str, decision: Decision, *, by: str) -> PendingAction:
        """Approve or deny a pending action.

        Args:
            pending_id: from :meth:`pending`.
            decision: ``"approve"`` or ``"deny"``.
            by: who decided (recorded), e.g. ``"admin"`` or a token id.

        Raises:
            DeskvmError: code ``pending_not_found`` (unknown, already decided or expired).
            ConfigError: bad decision.
        """
        if decision not in ("approve", "deny"):
            raise ConfigError(f"decision must be 'approve' or 'deny', not {decision!r}")
        with self._cond:
            item = self._pending.get(pending_id)
            if item is None or item.decision is not None:
                raise DeskvmError(
                    f"no pending action {pending_id!r} (decided or expired)",
                    code="pending_not_found",
                )
            item.decision, item.decided_by = decision, by
            self._cond.notify_all()
        return item

    def pending(self, session_id: str | None = None) -> list[PendingAction]:
        """Undecided actions (of one session, or all), oldest first."""
        with self._cond:
            return sorted(
                (
                    p
                    for p in self._pending.values()
                    if p.decision is None and (session_id is None or p.session_id == session_id)
                ),
                key=lambda p: p.requested_ns,
            )

    def deny_all(self, session_id: str, *, by: str) -> int:
        """Deny every pending action of a session (it is ending); returns how many."""
        with self._cond:
            items = [p for p in self._pending.values() if p.session_id == session_id]
            for item in items:
                if item.decision is None:
                    item.decision, item.decided_by = "deny", by
            self._cond.notify_all()
        return len(items)
