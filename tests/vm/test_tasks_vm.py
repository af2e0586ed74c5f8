"""The example tasks (examples/tasks) on a real VM of the default image, through
``deskvm task run`` as docs/tasks.md shows it: the solving agent passes every task, the
failing agent fails every task, both in one session (``--session``: the tasks' setup steps
clear what they check, so one boot serves all twenty runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from agent_bridge.cli import app
from agent_bridge.client import Client

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"
AGENTS = EXAMPLES / "agents.py"


def run_tasks_cli(
    server: tuple[str, str], session_id: str, agent: str, out: Path, tasks: Path = EXAMPLES
) -> tuple[int, str, dict[str, Any]]:
    """``deskvm task run`` in the given session; its exit code, output and results.json."""
    url, token = server
    result = CliRunner().invoke(app, [
        "task", "run", str(tasks), "--url", url, "--token", token, "--session", session_id,
        "--agent", f"{AGENTS}:{agent}", "--out", str(out),
    ])  # fmt: skip
    text = " ".join(result.output.split())
    assert (out / "results.json").is_file(), text
    return result.exit_code, text, json.loads((out / "results.json").read_text())


def check_rows(results: dict[str, Any], session_id: str, recording: str) -> list[dict[str, Any]]:
    """Every task has a row in the session, its recording linked, and its last screen."""
    rows: list[dict[str, Any]] = results["tasks"]
    assert [r["id"] for r in rows] == [
        "hello-file", "kernel-name", "rename-report", "clipboard-text", "people-csv",
        "config-json", "sort-numbers", "clean-junk", "close-window", "backup-workbook",
    ]  # fmt: skip
    for row in rows:
        assert row["session_id"] == session_id, row
        assert row["recording"] == recording, row
        assert Path(row["screenshot"]).read_bytes().startswith(b"\x89PNG"), row
    return rows


def test_example_tasks_pass_with_the_solving_agent_and_fail_with_the_failing_one(
    deskvm_server: tuple[str, str], deskvm_client: Client, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    session = deskvm_client.create_session(guest_control=True)
    try:
        booted_s = time.monotonic() - t0
        recording = session.info_at_start.recording
        assert recording is not None and Path(recording, "events.jsonl").is_file()

        t1 = time.monotonic()
        code, text, results = run_tasks_cli(
            deskvm_server, session.id, "SolvingAgent", tmp_path / "solving"
        )
        solving_s = time.monotonic() - t1
        rows = check_rows(results, session.id, recording)
        failed = {r["id"]: (r["error"], r["evaluation"]) for r in rows if not r["passed"]}
        assert not failed, failed
        assert code == 0 and "10/10 passed, 0 failed, 0 errors" in text, text
        assert results["summary"]["mean_score"] == 1.0
        assert all(r["done"] and not r["agent_failed"] for r in rows)

        t2 = time.monotonic()
        code, text, results = run_tasks_cli(
            deskvm_server, session.id, "FailingAgent", tmp_path / "failing"
        )
        failing_s = time.monotonic() - t2
        rows = check_rows(results, session.id, recording)
        passed = {r["id"]: r["evaluation"] for r in rows if r["passed"] or r["score"] > 0}
        assert not passed, passed
        errors = {r["id"]: r["error"] for r in rows if r["error"] is not None}
        assert not errors, errors  # wrong work is a failed task, not a broken harness
        assert code == 1 and "0/10 passed, 10 failed, 0 errors" in text, text

        # A file over put_file's cap goes up in parts (upload_file), joined in the guest.
        big = os.urandom(1_600_000)
        (tmp_path / "big.bin").write_bytes(big)
        (tmp_path / "big.json").write_text(json.dumps({
            "id": "big-upload", "instruction": "nothing to do",
            "config": [{"type": "upload_file", "parameters": {"files": [
                {"local_path": "big.bin", "path": "~/big.bin"}]}}],
            "evaluator": {"func": "check_include_exclude",
                          "result": {"type": "vm_command_line", "command": "sha256sum ~/big.bin"},
                          "expected": {"type": "rule", "rules": {
                              "include": [hashlib.sha256(big).hexdigest()]}}},
        }))  # fmt: skip
        url, token = deskvm_server
        result = CliRunner().invoke(app, [
            "task", "run", str(tmp_path / "big.json"), "--url", url, "--token", token,
            "--session", session.id, "--out", str(tmp_path / "big"),
        ])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert session.exec(["sh", "-c", "ls -A /tmp | grep -c deskvm-upload"]).stdout == "0\n"

        # The recording holds the tasks' control calls (sizes and hashes) beside the input.
        lines = Path(recording, "events.jsonl").read_text().splitlines()
        inputs = [e["data"]["action"] for e in map(json.loads, lines) if e["kind"] == "input"]
        kinds = {a.get("action") for a in inputs}
        assert {"exec", "put_file", "get_file", "windows", "clipboard_get", "type"} <= kinds
        print(f"\ntasks on {session.info_at_start.image}: boot {booted_s:.1f} s, "
              f"solving agent {solving_s:.1f} s, failing agent {failing_s:.1f} s")  # fmt: skip
    finally:
        session.delete()
