"""The gates an agent's action passes before it runs: take-over, then approval.

:func:`control_gate` holds or refuses the agent's input while a person has taken the session
over (:mod:`orchestrator.takeover`). For approvals the session decides *whether*
(``Session.approval_reason``: its policy, its recent typed text) and calls :func:`hold`
under its action lock (``Session.execute(gate=...)``); this module files the pending
action, records the request and the decision, and waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from agent_bridge.protocol.actions import (
    Action,
    CursorPosition,
    Screenshot,
    Zoom,
    action_name,
    action_to_dict,
    is_guest_action,
)
from agent_bridge.protocol.results import ImageResult
from agent_bridge.tokens import Scope, TokenError, scope_allows
from orchestrator.approval import ApprovalDenied, ApprovalDesk, ApprovalPolicy, ApprovalTimeout
from orchestrator.errors import DeskvmError
from orchestrator.session import Session
from orchestrator.takeover import ControlDesk, HumanInControl, TakeoverPolicy

__all__ = ["OBSERVATIONS", "check_scope", "control_gate", "gate", "hold"]

OBSERVATIONS = (Screenshot, Zoom, CursorPosition)
"""Actions that only look: they pass a take-over."""


def check_scope(scope: Scope, actions: Sequence[Action]) -> None:
    """Refuse actions the token's scope does not cover: input needs ``control``, guest
    control actions (exec, files, ...) need ``exec``, which ``control`` does not imply.

    Raises:
        TokenError: code ``forbidden`` naming the scope needed.
    """
    guest = [action_name(a) for a in actions if is_guest_action(a)]
    if guest and not scope_allows(scope, "exec"):
        raise TokenError(
            f"{guest[0]} is a guest control action: it needs a token of scope 'exec' "
            f"(this one has {scope!r}; 'control' does not imply 'exec')",
            code="forbidden",
        )
    if not scope_allows(scope, "control") and not all(isinstance(a, OBSERVATIONS) for a in actions):
        raise TokenError(
            "a view token may only observe (screenshot, zoom, cursor_position)", code="forbidden"
        )


def control_gate(
    session: Session, action: Action, controls: ControlDesk, policy: TakeoverPolicy
) -> None:
    """Return when the agent may run ``action``: at once unless a person has taken over.

    Blocking under the ``wait`` policy (call it from a worker thread).

    Raises:
        HumanInControl: code ``human_in_control``: refused or waited too long.
    """
    if isinstance(action, OBSERVATIONS):
        return
    controls.agent_turn(
        session.id, policy, what=action_name(action), still_wanted=lambda: session.state == "ready"
    )


def gate(
    session: Session, desk: ApprovalDesk, controls: ControlDesk | None = None
) -> Callable[[Action, str], None]:
    """The ``gate`` argument of ``session.execute``: holds what its policy says at ``desk``
    (withdrawn when a person takes the session over at ``controls``)."""

    def check(action: Action, reason: str) -> None:
        policy = session.approval_policy or ApprovalPolicy()
        hold(session, action, reason, policy, desk, controls=controls)

    return check


def hold(
    session: Session,
    action: Action,
    reason: str,
    policy: ApprovalPolicy,
    desk: ApprovalDesk,
    *,
    controls: ControlDesk | None = None,
) -> None:
    """Hold ``action`` (held for ``reason``) for an operator; return only if approved.

    Blocking (call it from a worker thread; the session calls it under its action lock).
    The request (with the frame the operator sees) and the decision (with who decided) are
    appended to the session's recording. A person taking the session over (``controls``)
    withdraws the held action at once (decided ``deny`` by ``take_over``): it would hold the
    action lock, so the person's input would queue behind it, and an approval would slip the
    agent's input in during the take-over.

    Raises:
        ApprovalDenied: an operator denied it (or the session ended meanwhile).
        ApprovalTimeout: nobody decided before ``policy.timeout_s``.
        HumanInControl: a person took the session over while it waited.
    """

    def taken_over() -> bool:
        return controls is not None and controls.holder(session.id) is not None

    frame, frame_seq = b"", None
    with contextlib.suppress(DeskvmError):
        shot = session.execute(Screenshot(), source="system")
        if isinstance(shot, ImageResult):
            frame, frame_seq = shot.data, shot.frame_seq
    item = desk.file(session.id, action, reason, timeout_s=policy.timeout_s, frame_png=frame)
    session.recorder.append(
        "approval",
        {
            "event": "requested",
            "pending_id": item.pending_id,
            "action": action_to_dict(action),
            "reason": reason,
            "frame_seq": frame_seq,
            "timeout_s": policy.timeout_s,
        },
        source="agent",
    )
    desk.wait(item, still_wanted=lambda: session.state == "ready" and not taken_over())
    if item.decided_by == "session ended" and session.state == "ready" and taken_over():
        item.decided_by = "take_over"
    by = item.decided_by or "unknown"
    try:
        session.recorder.append(
            "approval",
            {
                "event": "decided",
                "pending_id": item.pending_id,
                "decision": item.decision,
                "by": by,
            },
            source="system" if by in ("timeout", "session ended", "take_over") else "human",
        )
    except DeskvmError:
        # Deleting a session denies its pending actions and then seals the recording; the
        # waiter may wake after the seal. The denial stands; only a live session's
        # recorder failure is an error.
        if session.state == "ready":
            raise
    if by == "take_over" or (item.decision == "approve" and taken_over()):
        raise HumanInControl(
            f"a person took this session over while {action_name(action)} ({reason}) waited"
            " for approval; it was not run (retry after the hand-back)"
        )
    if item.decision == "approve":
        return
    if by == "timeout":
        raise ApprovalTimeout(
            f"no operator approved {action_name(action)} ({reason}) within"
            f" {policy.timeout_s:g} s; it was not executed"
        )
    raise ApprovalDenied(
        f"{action_name(action)} ({reason}) was denied by {by}; it was not executed"
    )
