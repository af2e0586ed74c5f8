"""DesktopEnv over the real client, HTTP and WebSocket, on the fake backend (its in-memory
guest helper answers the control plane as the real one does on the wire)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_bridge.client import Client
from agent_bridge.runtime import BackgroundServer
from agent_bridge.server import create_app
from agent_bridge.tasks import DesktopEnv, parse_task, run_tasks
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import BootImage

TOKEN = "tasks-bridge-token-0123456789"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    def resolve(name: str) -> BootImage:
        return BootImage(
            name=name, content_hash="0" * 64, base_path=tmp_path / "base.qcow2",
            kernel_path=tmp_path / "vmlinuz", initrd_path=tmp_path / "initrd.img",
            helper_port="dev.deskvm.helper.0",
        )  # fmt: skip

    manager = SessionManager(
        hypervisor=FakeHypervisor(), resolve_image=resolve,
        recordings_dir=tmp_path / "recordings", max_sessions=4,
        pacing=Pacing(0, 0, 0, 0, 0), ready_poll_s=0.01,
    )  # fmt: skip
    app = create_app(manager, token=TOKEN, settings=Settings(default_image="fake-desktop"))
    with BackgroundServer(app) as server, Client(server.url, TOKEN) as c:
        yield c


def test_a_task_runs_end_to_end_through_the_bridge(client: Client, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("42\n")
    task = parse_task({
        "id": "bridge",
        "instruction": "nothing to do",
        "config": [
            {"type": "upload_file",
             "parameters": {"files": [{"local_path": "in.txt", "path": "~/in.txt"}]}},
            {"type": "execute", "parameters": {"command": "cat ~/in.txt", "stdout": "cat.txt"}},
            {"type": "activate_window", "parameters": {"window_name": "desk@"}},
        ],
        "evaluator": {
            "func": ["compare_text_file", "check_include_exclude", "check_accessibility_tree",
                     "literal_match"],
            "result": [{"type": "vm_file", "path": "~/in.txt", "dest": "in.txt"},
                       {"type": "window_list", "field": "title"},
                       {"type": "accessibility_tree"},
                       {"type": "vm_command_line", "command": ["ls", "~/"]}],
            "expected": [{"type": "local_file", "path": "in.txt"},
                         {"type": "rule", "rules": {"include": ["desk@deskvm"]}},
                         {"type": "rule", "rules": [{"xpath": "//frame[@name='desk@deskvm']"}]},
                         {"type": "vm_command_line", "command": ["echo", ".bashrc\nin.txt"]}],
        },
    }, path=tmp_path / "task.json")  # fmt: skip
    env = DesktopEnv(client=client, cache_dir=tmp_path / "cache", reuse_session=True)
    obs = env.reset(task)
    session_id = env.session.id if env.session is not None else ""
    assert client.get_session(session_id).raw["guest_control"] is True
    assert obs["screenshot"].startswith(b"\x89PNG") and obs["instruction"] == "nothing to do"
    assert (tmp_path / "cache" / "bridge" / "cat.txt").read_text() == "42\n"
    # Every vocabulary reaches the session's (fake) screen.
    _, _, done, info = env.step("pyautogui.write('hi')")
    assert not done and info == {}
    env.step({"action_type": "TYPING", "text": " there"})
    env.step({"action": "key", "keys": "ctrl+l"})
    _, _, done, info = env.step("import os")
    assert info["error"]["code"] == "refused_code" and not done
    assert env.evaluate() == 1.0, env.evaluation
    _, _, done, info = env.step("DONE")
    assert done and info == {"done": True}
    recording = Path(env.recording or "")
    env.close()
    assert client.get_session(session_id).state in ("closed", "closing")
    events = [json.loads(x) for x in (recording / "events.jsonl").read_text().splitlines()]
    assert any("put_file" in json.dumps(e) for e in events)


def test_a_fresh_session_per_task_by_default(client: Client, tmp_path: Path) -> None:
    task = {"id": "t", "instruction": "x", "config": [],
            "evaluator": {"func": "exact_match", "result": {"type": "clipboard"},
                          "expected": {"type": "rule", "rules": {"expected": ""}}}}  # fmt: skip
    tasks = [parse_task(task), parse_task({**task, "id": "u"})]

    class Agent:
        def predict(self, instruction: str, obs: dict[str, object]) -> tuple[str, list[str]]:
            return "", ["DONE"]

    with DesktopEnv(client=client, cache_dir=tmp_path / "cache") as env:
        report = run_tasks(tasks, Agent, env=env)
    a, b = report.outcomes
    assert a.passed and b.passed and a.session_id != b.session_id
    assert a.recording != b.recording
    assert {client.get_session(o.session_id or "").state for o in (a, b)} <= {"closed", "closing"}


def test_deskvm_task_run_against_a_running_bridge(client: Client, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agent_bridge.cli import app

    ok = {"id": "empty-clipboard", "instruction": "x", "config": [],
          "evaluator": {"func": "exact_match", "result": {"type": "clipboard"},
                        "expected": {"type": "rule", "rules": {"expected": ""}}}}  # fmt: skip
    bad = {**ok, "id": "wants-text",
           "evaluator": {**ok["evaluator"],
                         "expected": {"type": "rule", "rules": {"expected": "text"}}}}  # fmt: skip
    (tmp_path / "tasks").mkdir()
    for t in (ok, bad):
        (tmp_path / "tasks" / f"{t['id']}.json").write_text(json.dumps(t))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "task", "run", str(tmp_path / "tasks"), "--url", client.url, "--token", TOKEN,
        "--reuse-session", "--out", str(out), "--state-dir", str(tmp_path / "state"),
    ])  # fmt: skip
    text = " ".join(result.output.split())
    assert result.exit_code == 1, text  # one task failed
    assert "1/2 passed, 1 failed, 0 errors" in text
    assert "empty-clipboard" in text and "PASS" in text and "FAIL" in text
    results = json.loads((out / "results.json").read_text())
    assert results["agent"] == "DoneAgent"
    rows = {r["id"]: r for r in results["tasks"]}
    assert rows["empty-clipboard"]["passed"] and not rows["wants-text"]["passed"]
    assert rows["wants-text"]["recording"] == rows["empty-clipboard"]["recording"] is not None
    assert (out / "summary.txt").read_text().startswith("agent: DoneAgent")


def test_deskvm_task_run_in_a_given_session_keeps_it(client: Client, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agent_bridge.cli import app

    rule = {"type": "rule", "rules": {"expected": "given"}}
    evaluator = {"func": "exact_match", "result": {"type": "clipboard"}, "expected": rule}
    task = {"id": "clip", "instruction": "x", "config": [], "evaluator": evaluator}
    (tmp_path / "t.json").write_text(json.dumps(task))
    session = client.create_session(guest_control=True)
    session.clipboard_set("given")
    for run in ("a", "b"):  # twice in the one session
        result = CliRunner().invoke(app, [
            "task", "run", str(tmp_path / "t.json"), "--url", client.url, "--token", TOKEN,
            "--session", session.id, "--out", str(tmp_path / run),
            "--state-dir", str(tmp_path / "state"),
        ])  # fmt: skip
        assert result.exit_code == 0, result.output
        row = json.loads((tmp_path / run / "results.json").read_text())["tasks"][0]
        assert row["passed"] and row["session_id"] == session.id
        assert row["recording"] == session.info_at_start.recording
    assert client.get_session(session.id).state == "ready"  # not deleted
    assert len(client.list_sessions()) == 1
    session.delete()


def test_task_run_session_needs_a_url(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agent_bridge.cli import app

    examples = Path(__file__).resolve().parents[2] / "examples" / "tasks"
    state = tmp_path / "state"
    result = CliRunner().invoke(
        app, ["task", "run", str(examples), "--session", "abc", "--state-dir", str(state)]
    )
    assert result.exit_code == 1
    assert "give its --url too" in " ".join(result.output.split())
    assert not state.exists()
