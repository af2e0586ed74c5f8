"""Guest control requests in the pure layer: parsing, the lexical path check, what the
recording keeps, and approval rules on argv and paths."""

from __future__ import annotations

import pytest

from agent_bridge.protocol.actions import ACTION_KINDS, action_name, action_to_dict
from agent_bridge.protocol.guest import Exec, GetFile, PutFile, check_guest_path
from agent_bridge.protocol.messages import parse_deskvm_action
from orchestrator.approval import ApprovalPolicy
from orchestrator.errors import ActionError, ConfigError


@pytest.mark.parametrize(
    "path", ["/tmp/a", "/home/desk/x/y.txt", "/home/other_user/.config/z", "/tmp/ä b"]
)
def test_allowed_paths(path: str) -> None:
    assert check_guest_path(path) == path


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("tmp/a", "not absolute"),
        ("/tmp/../etc/passwd", "not normalised"),
        ("/tmp/./a", "not normalised"),
        ("/tmp//a", "not normalised"),
        ("//tmp/a", "not normalised"),
        ("/tmp/a/", "not normalised"),
        ("/tmp", "outside"),
        ("/home/desk", "outside"),
        ("/etc/passwd", "outside"),
        ("/root/.ssh/id_rsa", "outside"),
        ("/tmp/a\x00b", "NUL"),
        ("/tmp/" + "a" * 5000, "4096 bytes"),
    ],
)
def test_refused_paths(path: str, why: str) -> None:
    with pytest.raises(ActionError, match=why) as caught:
        check_guest_path(path)
    assert caught.value.code == "path_not_allowed"


def test_guest_actions_are_deskvm_actions_with_recordable_shapes() -> None:
    action = parse_deskvm_action(
        {"action": "exec", "argv": ["sh", "-c", "x"], "stdin": "s", "env": {"B": "2", "A": "1"}}
    )
    assert isinstance(action, Exec) and action.env == (("A", "1"), ("B", "2"))
    assert action_name(action) == "exec" and "exec" in ACTION_KINDS
    record = action_to_dict(action)
    assert record["argv"] == ["sh", "-c", "x"] and record["env_names"] == ["A", "B"]
    assert "s" not in record.values() and record["stdin_bytes"] == 1
    put = parse_deskvm_action({"action": "put_file", "path": "/tmp/x", "data_b64": "aGk="})
    assert isinstance(put, PutFile) and action_to_dict(put)["size_bytes"] == 2
    assert "data" not in action_to_dict(put)


def test_approval_rules_on_argv_and_paths() -> None:
    policy = ApprovalPolicy(argv_patterns=[r"\brm -rf\b"], path_patterns=[r"^/home/[^/]+/\.ssh/"])
    assert policy.reason(Exec(argv=("rm", "-rf", "/tmp/x"))) == r"exec argv matches /\brm -rf\b/"
    assert policy.reason(Exec(argv=("sh", "-c", "rm -rf /"))) is not None  # quoted, still seen
    assert policy.reason(Exec(argv=("ls",))) is None
    assert policy.reason(GetFile(path="/home/desk/.ssh/id_rsa")) is not None
    assert policy.reason(PutFile(path="/tmp/x", data=b"")) is None
    assert ApprovalPolicy(kinds=["exec"]).reason(Exec(argv=("ls",))) == "action kind 'exec'"
    again = ApprovalPolicy.from_json(policy.to_json())
    assert again == policy and not again.empty
    old = {k: v for k, v in policy.to_json().items() if not k.endswith("_patterns")}
    old["text_patterns"] = []
    assert ApprovalPolicy.from_json(old).argv_patterns == ()  # records from before
    with pytest.raises(ConfigError, match="approval argv_patterns must be a list"):
        ApprovalPolicy(argv_patterns="rm")  # type: ignore[arg-type]
