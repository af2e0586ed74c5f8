"""DesktopEnv, setup steps, getters and the runner against the in-package fake session."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agent_bridge.tasks import (
    DesktopEnv,
    FakeTaskSession,
    TaskConfigError,
    TaskSetupError,
    collect_tasks,
    load_agent,
    parse_task,
    run_tasks,
)
from agent_bridge.tasks.guest import FakeExec
from agent_bridge.tasks.ops import egress_allows
from orchestrator.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"
HOME = "/home/desk"


def make_env(fake: FakeTaskSession, tmp_path: Path, **kw: Any) -> DesktopEnv:
    slept: list[float] = []
    env = DesktopEnv(fake, cache_dir=tmp_path / "cache", sleep=slept.append, **kw)
    env.slept = slept  # type: ignore[attr-defined]
    return env


def hello_task(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "hello",
        "instruction": "Create ~/hello.txt",
        "config": [{"type": "execute", "parameters": {"command": "rm -f ~/hello.txt"}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": ["cat", "~/hello.txt"]},
            "expected": {"type": "rule", "rules": {"expected": "hello\n"}},
        },
    }
    base.update(over)
    return base


def test_setup_steps_reach_the_guest_as_the_control_plane_calls(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_bytes(b"42\n7\n")
    fake = FakeTaskSession(windows_list=[
        {"id": 11, "title": "desk@vm: ~", "class": "XTerm", "focused": False},
        {"id": 12, "title": "notes-window", "class": "XTerm", "focused": True},
    ])  # fmt: skip
    task = parse_task({
        "id": "steps", "instruction": "x",
        "config": [
            {"type": "execute", "parameters": {"command": "rm -f ~/a.txt", "stdout": "out.txt"}},
            {"type": "command", "parameters": {"command": "echo $HOME", "shell": True}},
            {"type": "launch", "parameters": {"command": ["xterm", "-T", "n"]}},
            {"type": "sleep", "parameters": {"seconds": 1.5}},
            {"type": "upload_file", "parameters": {"files": [{"local_path": "in.txt",
                                                              "path": "~/in.txt"}]}},
            {"type": "close_window", "parameters": {"window_name": "notes-window", "strict": True}},
            {"type": "activate_window", "parameters": {"window_name": "xterm", "by_class": True}},
        ],
        "evaluator": {"func": "infeasible"},
    }, path=tmp_path / "t.json")  # fmt: skip
    env = make_env(fake, tmp_path)
    obs = env.reset(task)
    assert obs["instruction"] == "x" and obs["screenshot"].startswith(b"\x89PNG")
    assert obs["accessibility_tree"] is None and obs["terminal"] is None
    execs = [c[1] for c in fake.calls if c[0] == "exec"]
    assert execs[0] == ["pwd"]
    assert execs[1] == ["rm", "-f", f"{HOME}/a.txt"]
    assert execs[2] == ["sh", "-c", "echo $HOME"]
    assert execs[3][:2] == ["sh", "-c"] and "setsid -f" in execs[3][2]
    assert execs[3][-3:] == ["xterm", "-T", "n"]
    assert env.slept == [1.5]  # type: ignore[attr-defined]
    assert fake.files[f"{HOME}/in.txt"] == b"42\n7\n"
    assert ("window_close", 12) in fake.calls and ("window_activate", 11) in fake.calls
    assert (tmp_path / "cache" / "steps" / "out.txt").read_text() == ""


def test_a_failed_step_names_itself_and_until_is_bounded(tmp_path: Path) -> None:
    fake = FakeTaskSession(windows_list=[{"id": 1, "title": "desk@vm", "class": "XTerm"}])
    env = make_env(fake, tmp_path)
    bad = {"type": "activate_window", "parameters": {"window_name": "Calculator"}}
    with pytest.raises(TaskSetupError) as info:
        env.reset(hello_task(config=[bad]))
    assert info.value.message == (
        "config[0] activate_window: no window title matching 'Calculator' (windows: 'desk@vm')"
    )
    fake.exec_handler = lambda argv, stdin: FakeExec(1, "", "not yet")
    until = {"type": "execute",
             "parameters": {"command": ["pgrep", "x"], "until": {"returncode": 0}}}  # fmt: skip
    with pytest.raises(TaskSetupError, match=r"config\[0\] execute: 'until' not reached after 100"):
        env.reset(hello_task(config=[until]))
    runs = iter([FakeExec(1), FakeExec(1), FakeExec(0, "ready\n")])
    fake.exec_handler = lambda argv, stdin: next(runs)
    until["parameters"]["until"] = {"stdout": "ready"}
    env.reset(hello_task(config=[until]))
    assert env.slept[-2:] == [0.3, 0.3]  # type: ignore[attr-defined]


def test_open_without_xdg_open_and_a_refused_upload_are_setup_errors(tmp_path: Path) -> None:
    fake = FakeTaskSession(exec_handler=lambda argv, stdin: FakeExec(1))
    env = make_env(fake, tmp_path)
    step = {"type": "open", "parameters": {"path": "~/report.odt"}}
    with pytest.raises(TaskSetupError, match="the guest has no xdg-open to open /home/desk/report"):
        env.reset(hello_task(config=[step]))
    (tmp_path / "x").write_text("x")
    up = {"type": "upload_file", "parameters": {"files": [{"local_path": "x", "path": "/etc/x"}]}}
    with pytest.raises(TaskSetupError, match="upload_file: path_not_allowed"):
        env.reset(parse_task(hello_task(config=[up]), path=tmp_path / "t.json"))


def test_an_upload_over_put_files_cap_goes_in_parts_and_is_checked(tmp_path: Path) -> None:
    """A file larger than one put_file: parts into a private /tmp directory, then one exec
    joins them, checks the SHA-256 and moves the result into place. The fake keeps
    put_file's cap and runs that exec's argv for real on this host (sh, cat, sha256sum)."""
    import os
    import shutil
    import subprocess

    from agent_bridge.protocol.guest import PUT_FILE_MAX_BYTES

    root = tmp_path / "guest"
    home = HOME
    data = os.urandom(2 * PUT_FILE_MAX_BYTES + 12345)
    (tmp_path / "big.bin").write_bytes(data)
    fake = FakeTaskSession(home=home)

    def guest_exec(argv: list[str], stdin: str | None) -> FakeExec:
        # Lay the fake's files out on disk (under root), run argv there, read them back.
        def real(path: str) -> Path:
            return root / path.lstrip("/")

        shutil.rmtree(root / "tmp", ignore_errors=True)
        (root / "tmp").mkdir(parents=True)
        real(HOME).mkdir(parents=True, exist_ok=True)
        for path, content in fake.files.items():
            real(path).parent.mkdir(parents=True, exist_ok=True)
            real(path).write_bytes(content)
        args = [f"{root}{a}" if a.startswith(("/tmp/", HOME)) else a for a in argv]
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        fake.files = {
            "/" + str(f.relative_to(root)): f.read_bytes() for f in root.rglob("*") if f.is_file()
        }
        return FakeExec(done.returncode, done.stdout, done.stderr)

    fake.exec_handler = guest_exec
    up = {"type": "upload_file",
          "parameters": {"files": [{"local_path": "big.bin", "path": "~/big.bin"}]}}  # fmt: skip
    env = make_env(fake, tmp_path)
    env.reset(parse_task(hello_task(config=[up]), path=tmp_path / "t.json"))
    assert fake.files[f"{home}/big.bin"] == data
    assert [p for p in fake.files if p.startswith("/tmp/")] == []  # the parts are gone
    puts = [c[1] for c in fake.calls if c[0] == "put_file"]
    assert len(puts) == 3 and all(p.startswith("/tmp/.deskvm-upload-") for p in puts)
    # A part that arrives wrong is caught by the hash, and nothing replaces the file.
    real_put = fake.put_file

    def corrupting_put(path: str, content: bytes) -> dict[str, Any]:
        return real_put(path, content[:-1] + b"?" if path.endswith("1") else content)

    fake.put_file = corrupting_put  # type: ignore[method-assign]
    fake.files[f"{home}/big.bin"] = b"old"
    with pytest.raises(TaskSetupError, match=r"upload_file: .*big\.bin: the joined parts' SHA-256"):
        env.reset(parse_task(hello_task(config=[up]), path=tmp_path / "t.json"))
    assert fake.files[f"{home}/big.bin"] == b"old"
    assert [p for p in fake.files if p.startswith("/tmp/")] == []


def test_the_fake_keeps_put_files_cap() -> None:
    from agent_bridge.client import RemoteError
    from agent_bridge.protocol.guest import PUT_FILE_MAX_BYTES

    fake = FakeTaskSession()
    fake.put_file("/tmp/ok", b"x" * PUT_FILE_MAX_BYTES)
    with pytest.raises(RemoteError, match="larger than"):
        fake.put_file("/tmp/big", b"x" * (PUT_FILE_MAX_BYTES + 1))


def test_download_needs_an_egress_policy_allowing_it_before_anything_runs(tmp_path: Path) -> None:
    step = {"type": "download",
            "parameters": {"files": [{"url": "https://files.example.org/a.csv",
                                      "path": "~/a.csv"}]}}  # fmt: skip
    fake = FakeTaskSession(allow=None)
    env = make_env(fake, tmp_path)
    with pytest.raises(TaskConfigError, match="the session has no network"):
        env.reset(hello_task(config=[step]))
    assert [c for c in fake.calls if c[0] == "exec" and c[1][0] != "pwd"] == []
    fake.allow = ["example.com"]
    with pytest.raises(TaskConfigError, match="not allowed by the session's egress policy"):
        env.reset(hello_task(config=[step]))
    fake.allow = ["*.example.org:443"]
    env.reset(hello_task(config=[step]))
    curl = [c[1] for c in fake.calls if c[0] == "exec" and c[1][0] == "curl"]
    assert curl == [["curl", "-fsSL", "--max-time", "300", "-o", f"{HOME}/a.csv",
                     "https://files.example.org/a.csv"]]  # fmt: skip
    fake.exec_handler = lambda argv, stdin: FakeExec(22, "", "curl: (22) 404")
    with pytest.raises(TaskSetupError, match=r"download: .*curl exit 22: curl: \(22\) 404"):
        env.reset(hello_task(config=[step]))


def test_egress_allows() -> None:
    assert egress_allows(["example.org"], "http://example.org/x")
    assert not egress_allows(["example.org"], "http://sub.example.org/x")
    assert egress_allows(["*.example.org"], "https://a.b.example.org/x")
    assert egress_allows(["198.51.100.0/24:8080"], "http://198.51.100.7:8080/x")
    assert not egress_allows(["198.51.100.0/24:8080"], "http://198.51.100.7/x")
    assert not egress_allows([], "http://example.org/")


def test_step_speaks_every_vocabulary_and_reports_refusals(tmp_path: Path) -> None:
    fake = FakeTaskSession()
    env = make_env(fake, tmp_path)
    env.reset(hello_task())
    obs, reward, done, info = env.step("pyautogui.click(10, 20)")
    assert (reward, done, info) == (0.0, False, {}) and obs["screenshot"].startswith(b"\x89PNG")
    env.step({"action_type": "CLICK", "x": 5, "y": 5})
    env.step({"action": "key", "keys": "ctrl+l"})
    env.step({"command": "pyautogui.press('enter')"})
    assert [s for s, _ in fake.actions] == ["pyautogui", "computer_13", "deskvm", "pyautogui"]
    _, _, done, info = env.step("import os\nos.system('rm -rf /')")
    assert not done and info["error"]["code"] == "refused_code"
    _, _, done, info = env.step("DONE")
    assert done and info == {"done": True}
    with pytest.raises(ConfigError, match="an action is pyautogui code"):
        env.step(42)


def test_evaluate_follows_osworlds_rules(tmp_path: Path) -> None:
    files: dict[str, str] = {}

    def shell(argv: list[str], stdin: str | None) -> FakeExec:
        if argv[0] == "cat":
            return FakeExec(0, files[argv[1]]) if argv[1] in files else FakeExec(1, "", "no")
        return FakeExec()

    def typed(schema: str, body: Mapping[str, Any]) -> None:  # the "agent" writes the file
        if "hello" in str(body):
            files[f"{HOME}/hello.txt"] = "hello\n"

    fake = FakeTaskSession(exec_handler=shell, on_action=typed)
    env = make_env(fake, tmp_path)
    env.reset(hello_task())
    assert env.evaluate() == 0.0
    assert env.evaluation[0]["result"] == ""
    env.step("pyautogui.write('echo hello > ~/hello.txt\\n')")
    assert env.evaluate() == 1.0
    env.step("FAIL")
    assert env.evaluate() == 0.0 and env.evaluation[0]["error"] == "the agent gave up"
    env.reset(hello_task(evaluator={"func": "infeasible"}))
    assert env.evaluate() == 0.0
    env.step("FAIL")
    assert env.evaluate() == 1.0


def test_several_metrics_combine_with_conj_and_getters_feed_them(tmp_path: Path) -> None:
    fake = FakeTaskSession(
        clipboard="copied",
        files={f"{HOME}/a.txt": b"A\n"},
        windows_list=[{"id": 3, "title": "Editor", "class": "Gedit", "focused": True},
                      {"id": 4, "title": "desk@vm", "class": "XTerm", "focused": False}],
    )  # fmt: skip
    (tmp_path / "a.txt").write_text("A\n")
    ev = {
        "func": ["exact_match", "compare_text_file", "is_in_list", "check_include_exclude"],
        "result": [{"type": "clipboard"},
                   {"type": "vm_file", "path": "~/a.txt", "dest": "a.txt"},
                   {"type": "window_list", "field": "title", "focused_only": True},
                   {"type": "accessibility_tree"}],
        "expected": [{"type": "rule", "rules": {"expected": "copied"}},
                     {"type": "local_file", "path": "a.txt"},
                     {"type": "rule", "rules": {"expected": "Editor"}},
                     {"type": "rule", "rules": {"include": ["desktop frame"]}}],
    }  # fmt: skip
    task = parse_task(hello_task(config=[], evaluator=ev), path=tmp_path / "t.json")
    env = make_env(fake, tmp_path)
    env.reset(task)
    assert env.evaluate() == 1.0
    assert [e["score"] for e in env.evaluation] == [1.0] * 4
    fake.clipboard = "other"
    assert env.evaluate() == 0.0 and len(env.evaluation) == 1  # "and" stops at the first 0
    either = parse_task(hello_task(config=[], evaluator={**ev, "conj": "or"}),
                        path=tmp_path / "t.json")  # fmt: skip
    env.reset(either)
    assert env.evaluate() == 1.0 and [e["score"] for e in env.evaluation] == [0.0, 1.0]


def test_a_missing_guest_file_scores_zero_and_says_why(tmp_path: Path) -> None:
    (tmp_path / "want.txt").write_text("x")
    ev = {"func": "compare_text_file",
          "result": {"type": "vm_file", "path": "~/nothing.txt", "dest": "n.txt"},
          "expected": {"type": "local_file", "path": "want.txt"}}  # fmt: skip
    env = make_env(FakeTaskSession(), tmp_path)
    env.reset(parse_task(hello_task(config=[], evaluator=ev), path=tmp_path / "t.json"))
    assert env.evaluate() == 0.0
    assert env.evaluation[0]["result"] is None
    assert "file_not_found" in env.evaluation[0]["notes"][0]


def test_the_runner_writes_results_and_goes_on_after_a_broken_task(tmp_path: Path) -> None:
    files: dict[str, str] = {}

    def shell(argv: list[str], stdin: str | None) -> FakeExec:
        if argv[0] == "cat":
            return FakeExec(0, files.get(argv[1], ""))
        if argv[:2] == ["rm", "-f"]:
            files.pop(argv[2], None)
        return FakeExec()

    def typed(schema: str, body: Mapping[str, Any]) -> None:
        if "echo hello" in str(body):
            files[f"{HOME}/hello.txt"] = "hello\n"

    class Agent:
        def __init__(self) -> None:
            self.calls = 0

        def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[Any]]:
            self.calls += 1
            if "broken" in instruction:
                raise RuntimeError("model exploded")
            if "wrong" in instruction:
                return "oops", ["pyautogui.write('echo bye\\n')", "DONE"]
            return "ok", ["pyautogui.write('echo hello\\n')", "DONE"]

    tasks = [
        parse_task(hello_task(id="good")),
        parse_task(hello_task(id="wrong", instruction="wrong")),
        parse_task(hello_task(id="broken", instruction="broken")),
        parse_task(hello_task(id="setup", config=[{"type": "close_window",
                                                   "parameters": {"window_name": "x"}}])),
    ]  # fmt: skip
    fake = FakeTaskSession(exec_handler=shell, on_action=typed)
    env = make_env(fake, tmp_path)
    out = tmp_path / "out"
    seen: list[str] = []
    report = run_tasks(tasks, Agent, env=env, agent_name="t", out_dir=out,
                       on_outcome=lambda o: seen.append(o.id))  # fmt: skip
    assert seen == ["good", "wrong", "broken", "setup"]
    by_id = {o.id: o for o in report.outcomes}
    assert by_id["good"].passed and by_id["good"].steps == 2 and by_id["good"].done
    assert not by_id["wrong"].passed and by_id["wrong"].error is None
    assert by_id["broken"].error == {"code": "agent_error",
                                     "message": "RuntimeError: model exploded"}  # fmt: skip
    assert by_id["setup"].error is not None and by_id["setup"].error["code"] == "task_setup_failed"
    assert by_id["good"].recording == fake.recording_dir
    results = json.loads((out / "results.json").read_text())
    summary = results["summary"]
    assert summary["duration_s"] >= 0
    assert {k: v for k, v in summary.items() if k != "duration_s"} == {
        "total": 4, "passed": 1, "failed": 1, "errors": 2, "mean_score": 0.25
    }  # fmt: skip
    assert results["tasks"][0]["evaluation"][0]["func"] == "exact_match"
    assert (out / "good" / "final.png").read_bytes().startswith(b"\x89PNG")
    assert "1/4 passed" in (out / "summary.txt").read_text()


def test_load_agent_from_a_file_or_module() -> None:
    factory = load_agent(f"{EXAMPLES / 'agents.py'}:SolvingAgent")
    assert hasattr(factory(), "predict")
    assert load_agent("agent_bridge.tasks.runner:DoneAgent")().predict("x", {})[1] == ["DONE"]
    with pytest.raises(ConfigError, match="expected MODULE:CALLABLE"):
        load_agent("nocolon")
    with pytest.raises(ConfigError, match="cannot import"):
        load_agent("no_such_module_xyz:A")
    with pytest.raises(ConfigError, match="has no callable 'Nope'"):
        load_agent("agent_bridge.tasks.runner:Nope")


def test_example_agents_answer_every_example_task() -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import agents  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES))
    from agent_bridge.protocol.replies import split_screenshot_after
    from agent_bridge.protocol.vocab import get_vocabulary
    from agent_bridge.tasks.env import action_schema

    answers: dict[str, list[object]] = {}
    for t in collect_tasks([EXAMPLES, EXAMPLES / "full"]):
        for cls in (agents.SolvingAgent, agents.FailingAgent):
            _, actions = cls().predict(t.instruction, {})
            assert actions[-1] == "DONE" and len(actions) > 1, (t.id, cls)
            for action in actions:  # each parses in its vocabulary, as the bridge will
                schema, body = action_schema(action)
                body, _ = split_screenshot_after(body)
                assert get_vocabulary(schema).parse(body), (t.id, cls, action)
            answers.setdefault(t.id, []).append(actions)
    assert all(solving != failing for solving, failing in answers.values())


def test_a_kept_session_is_reset_to_its_start_state_between_tasks(tmp_path: Path) -> None:
    fake = FakeTaskSession(resettable=True)
    env = make_env(fake, tmp_path)
    env.reset(hello_task())
    assert env.desktop_restored is None  # the first task: nothing to restore
    env.reset(hello_task())
    env.reset(hello_task())
    assert env.desktop_restored is True
    assert [c for c in fake.calls if c[0] == "reset_desktop"] == [("reset_desktop", True)] * 2
    cold = FakeTaskSession(resettable=False)
    env = make_env(cold, tmp_path)
    for _ in range(3):
        env.reset(hello_task())
    assert env.desktop_restored is None  # asked once, then never again
    assert [c for c in cold.calls if c[0] == "reset_desktop"] == [("reset_desktop", False)]
    off = FakeTaskSession(resettable=True)
    env = make_env(off, tmp_path, reset_desktop=False)
    env.reset(hello_task())
    env.reset(hello_task())
    assert not [c for c in off.calls if c[0] == "reset_desktop"]
