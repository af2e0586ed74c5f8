"""The approval policy (pure) and the desk's wait: approve, deny, timeout, session end."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

from agent_bridge.protocol.actions import Click, Key, Screenshot, Type
from agent_bridge.protocol.keys import parse_combo
from orchestrator.approval import ApprovalDesk, ApprovalPolicy
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


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        (r"^sudo .*$", "sudo reboot\n"),  # $ before a final newline (typed with Enter)
        (r"\bжд\b", "жд: x"),  # Unicode word boundaries
        (r"rm\s{,3}-rf", "rm  -rf"),  # {,n}
        (r"(\w)\1", "sudo ll"),  # backreferences
        (r"(?<!no)sudo", "xsudo"),  # lookbehind
        (r"^\d+$", "٣٤"),  # Unicode digits
    ],
)
def test_patterns_keep_pythons_meaning(pattern: str, text: str) -> None:
    """Rules written for Python's ``re`` hold what they held: the bound on matching time
    changes no match."""
    assert re.search(pattern, text) is not None
    policy = ApprovalPolicy(text_patterns=(pattern,))
    reason = policy.reason(Type(text))
    assert reason is not None and reason.startswith("typed text matches")  # decided: a match
    miss = text.replace("sudo", "echo").replace("жд", "жж").replace("rm", "mv")
    miss = miss.replace("ll", "lo").replace("٣٤", "٣x")
    assert re.search(pattern, miss) is None
    assert policy.reason(Type(miss)) is None


@pytest.mark.parametrize(
    "pattern",
    ["(?R)?a", r"\p{L}", "(?V1)a", "sudo{e<=1}", "x{100000000}", "(x{1000}){1000}", "{"],
)
def test_patterns_re_refuses_or_that_cannot_be_bounded_are_refused(pattern: str) -> None:
    """The regex package's own syntax (recursion, \\p, fuzzy matching after a bare brace),
    and repeat counts it would expand into gigabytes, are refused at create."""
    with pytest.raises(ConfigError, match="approval pattern"):
        ApprovalPolicy(text_patterns=(pattern,))


_TRAP = """
from agent_bridge.protocol.actions import Type
from orchestrator.approval import ApprovalPolicy, TypedWindow
policy = ApprovalPolicy(text_patterns=("(a|aa)+$",))
window = TypedWindow()
window.feed(Type("a" * 500))
print(policy.reason(Type("a" * 60 + "!")))
print(policy.reason(Type("a" * 60 + "!"), window))
"""


def test_a_pattern_that_backtracks_on_typed_text_holds_the_action() -> None:
    """``(a|aa)+$`` against 60 a's and a '!' runs for hours with an unbounded search (24
    characters of ``(a+)+$`` held every request of the server for 15 s). Bounded, the rule
    cannot decide within its budget, and a rule that cannot decide holds the action. In
    a subprocess with a timeout, so that a regression fails here instead of hanging."""
    done = subprocess.run(
        [sys.executable, "-c", _TRAP], capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert all("did not decide" in line and "(a|aa)+$" in line for line in lines)


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
