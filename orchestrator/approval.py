"""Human in the loop: which actions need an operator's approval, and the wait for it.

Two parts, kept apart:

* :class:`ApprovalPolicy` is pure: given an action it says whether it must be held, and
  why (action kinds, key combos, typed-text regular expressions, or every action in
  supervised mode). No I/O, no clock.
* :class:`ApprovalDesk` is the small waiting mechanism: the caller (the bridge, before it
  injects an action) files a :class:`PendingAction` and blocks until an operator decides
  or the deadline passes; no answer before the deadline means deny.

Errors: :class:`ApprovalDenied` (code ``approval_denied``) and :class:`ApprovalTimeout`
(code ``approval_timeout``) derive from :class:`~orchestrator.errors.ActionError`, so the
agent gets a structured error and nothing reaches the guest.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from agent_bridge.protocol.actions import Action, HoldKey, Key, Type, action_name
from agent_bridge.protocol.keys import parse_combo
from orchestrator.clock import Clock, SystemClock
from orchestrator.errors import ActionError, ConfigError, DeskvmError

__all__ = [
    "ApprovalDenied",
    "ApprovalDesk",
    "ApprovalPolicy",
    "ApprovalTimeout",
    "Decision",
    "PendingAction",
]

Decision = Literal["approve", "deny"]
_MAX_RULES = 64
_MAX_PATTERN_CHARS = 200


class ApprovalDenied(ActionError):
    """An operator denied the action; it was not injected."""

    code = "approval_denied"


class ApprovalTimeout(ActionError):
    """No operator decided before the deadline; the action was not injected."""

    code = "approval_timeout"


@dataclass(frozen=True, slots=True)
class ApprovalPolicy:
    """Which actions of a session are held for an operator.

    Attributes:
        every_action: supervised mode: hold every action (screenshots and cursor queries
            included only if ``include_observations``).
        kinds: action names (``"click"``, ``"type"``, ``"key"``...) to hold.
        key_combos: key combos (``"ctrl+alt+delete"``, ``"meta"``) to hold, in any ``key``
            or ``hold_key`` action; parsed like the ``key`` action's ``keys``.
        text_patterns: Python regular expressions; a ``type`` action whose text matches one
            (``re.search``) is held.
        timeout_s: seconds an operator has to decide; then the action is denied.
        include_observations: in supervised mode, also hold screenshot/zoom/cursor queries.

    Raises:
        ConfigError: unknown combo, bad regular expression, too many rules, bad timeout.
    """

    every_action: bool = False
    kinds: tuple[str, ...] = ()
    key_combos: tuple[str, ...] = ()
    text_patterns: tuple[str, ...] = ()
    timeout_s: float = 60.0
    include_observations: bool = False
    _combos: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _regexes: tuple[re.Pattern[str], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("kinds", "key_combos", "text_patterns"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigError(f"approval {name} must be a list, not a string")
            if len(value) > _MAX_RULES:
                raise ConfigError(f"approval {name} has more than {_MAX_RULES} entries")
            object.__setattr__(self, name, tuple(value))
        if not 0 < self.timeout_s <= 3600:
            raise ConfigError(f"approval timeout_s {self.timeout_s} is outside (0, 3600]")
        combos = frozenset(str(parse_combo(c)) for c in self.key_combos)
        regexes = []
        for pattern in self.text_patterns:
            if len(pattern) > _MAX_PATTERN_CHARS:
                raise ConfigError(f"approval pattern longer than {_MAX_PATTERN_CHARS} chars")
            try:
                regexes.append(re.compile(pattern))
            except re.error as exc:
                raise ConfigError(f"approval pattern {pattern!r}: {exc}") from exc
        object.__setattr__(self, "_combos", combos)
        object.__setattr__(self, "_regexes", tuple(regexes))

    @property
    def empty(self) -> bool:
        """Whether the policy holds nothing."""
        return not (self.every_action or self.kinds or self.key_combos or self.text_patterns)

    def reason(self, action: Action) -> str | None:
        """Why ``action`` must wait for approval, or ``None`` if it may run at once."""
        name = action_name(action)
        if self.every_action and (
            self.include_observations or name not in ("screenshot", "zoom", "cursor_position")
        ):
            return "supervised: every action"
        if name in self.kinds:
            return f"action kind {name!r}"
        match action:
            case Key(combos=combos):
                for combo in combos:
                    if str(combo) in self._combos:
                        return f"key combo {combo}"
            case HoldKey(combo=combo) if str(combo) in self._combos:
                return f"key combo {combo}"
            case Type(text=text):
                for regex in self._regexes:
                    if regex.search(text):
                        return f"typed text matches {regex.pattern!r}"
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
