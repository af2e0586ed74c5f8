"""The approval policy (pure) and the desk's wait: approve, deny, timeout, session end."""

from __future__ import annotations

import threading
import time

import pytest

from agent_bridge.protocol.actions import Click, Key, Screenshot, Type
from agent_bridge.protocol.keys import parse_combo
from orchestrator.approval import ApprovalDesk, ApprovalPolicy, TypedWindow
from orchestrator.errors import ConfigError, DeskvmError


def test_empty_policy_holds_nothing() -> None:
    policy = ApprovalPolicy()
    assert policy.empty
    assert policy.reason(Click(1, 2)) is None


def test_rules_on_kind_combo_and_text() -> None:
    policy = ApprovalPolicy(
        kinds=("click",), key_combos=("ctrl+alt+delete",), text_patterns=(r"rm\s+-rf",)
    )
    assert policy.reason(Click(1, 2)) == "action kind 'click'"
    assert policy.reason(Key((parse_combo("ctrl+alt+delete"),))) is not None
    assert policy.reason(Key((parse_combo("ctrl+c"),))) is None
    assert policy.reason(Type("sudo rm  -rf /")) is not None
    assert policy.reason(Type("ls -l")) is None
    assert policy.reason(Screenshot()) is None


def test_supervised_mode_holds_every_action_but_observations() -> None:
    policy = ApprovalPolicy(every_action=True)
    assert policy.reason(Type("x")) == "supervised: every action"
    assert policy.reason(Screenshot()) is None
    assert ApprovalPolicy(every_action=True, include_observations=True).reason(Screenshot())


@pytest.mark.parametrize(
    "kwargs",
    [{"text_patterns": ("(",)}, {"key_combos": ("ctrl+nosuchkey",)}, {"timeout_s": 0},
     {"kinds": "click"}, {"text_patterns": ("a" * 201,)}],
)  # fmt: skip
def test_bad_policies_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(DeskvmError):
        ApprovalPolicy(**kwargs)  # type: ignore[arg-type]


def test_patterns_without_linear_time_matching_are_refused_at_create() -> None:
    """Backreferences and lookaround need backtracking: RE2 refuses them, naming why."""
    for pattern in (r"(a)\1", "(?=rm)", "(?<!x)rm"):
        with pytest.raises(ConfigError, match="RE2"):
            ApprovalPolicy(text_patterns=(pattern,))
        with pytest.raises(ConfigError, match="RE2"):
            ApprovalPolicy(argv_patterns=(pattern,))


@pytest.mark.parametrize("n", [40, 4000])
def test_typed_text_cannot_make_a_pattern_backtrack(n: int) -> None:
    """``(a+)+$`` against 40 a's and a '!' runs for hours with Python's backtracking ``re``
    (24 a's took 15 s, holding every request); with RE2 it is linear in the text. The
    check runs in a thread so that a regression fails here instead of hanging the run."""
    policy = ApprovalPolicy(text_patterns=("(a+)+$",))
    window = TypedWindow()
    window.feed(Type("a" * n))
    results: list[str | None] = []
    worker = threading.Thread(
        target=lambda: results.append(policy.reason(Type("a" * n + "!"), window)), daemon=True
    )
    worker.start()
    worker.join(30.0)
    assert results == [None]  # finished, and '!' ends the text: no match
    assert policy.reason(Type("aaaa")) is not None


def _decide_later(desk: ApprovalDesk, decision: str, by: str) -> threading.Thread:
    def run() -> None:
        while not desk.pending():
            time.sleep(0.005)
        desk.decide(desk.pending()[0].pending_id, decision, by=by)  # type: ignore[arg-type]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("decision", ["approve", "deny"])
def test_wait_returns_the_operators_decision(decision: str) -> None:
    desk = ApprovalDesk()
    item = desk.file("s", Click(1, 2), "r", timeout_s=5, frame_png=b"png")
    thread = _decide_later(desk, decision, "alice")
    desk.wait(item)
    thread.join()
    assert (item.decision, item.decided_by) == (decision, "alice")
    assert desk.pending() == []
    with pytest.raises(DeskvmError) as info:  # a decision counts once
        desk.decide(item.pending_id, "approve", by="bob")
    assert info.value.code == "pending_not_found"


def test_no_answer_before_the_deadline_is_deny() -> None:
    desk = ApprovalDesk()
    t0 = time.monotonic()
    item = desk.wait(desk.file("s", Click(1, 2), "r", timeout_s=0.2, frame_png=b""))
    assert (item.decision, item.decided_by) == ("deny", "timeout")
    assert 0.2 <= time.monotonic() - t0 < 2
    assert desk.pending() == []


def test_session_end_denies_waiting_actions() -> None:
    desk = ApprovalDesk()
    item = desk.file("s", Click(1, 2), "r", timeout_s=30, frame_png=b"")
    alive = [True]
    threading.Timer(0.1, lambda: alive.clear()).start()
    desk.wait(item, still_wanted=lambda: bool(alive))
    assert (item.decision, item.decided_by) == ("deny", "session ended")


def test_bad_decision_value() -> None:
    desk = ApprovalDesk()
    item = desk.file("s", Click(1, 2), "r", timeout_s=1, frame_png=b"")
    with pytest.raises(ConfigError):
        desk.decide(item.pending_id, "maybe", by="x")  # type: ignore[arg-type]
