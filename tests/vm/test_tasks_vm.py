"""The example tasks on real VMs, through ``deskvm task run`` as docs/tasks.md shows it:
the solving agent passes every task, the failing agent fails every task, both in one
session per image (``--session``: the tasks' setup steps clear what they check, so one boot
serves both agents' runs).

- ``examples/tasks`` (xterm) on the default image;
- ``examples/tasks/full`` (LibreOffice Calc, Mousepad, Firefox) on ``debian12-full``, with
  the egress test world (``tests/egress/egress_world.py``) as the internet its ``download``
  step and Firefox reach (``allowed.test``).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agent_bridge.cli import app
from agent_bridge.client import Client
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "egress"))
from egress_world import World, leftovers

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"
AGENTS = EXAMPLES / "agents.py"
FULL_IMAGE = "debian12-full"


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


SMALL_IDS = [
    "hello-file", "kernel-name", "rename-report", "clipboard-text", "people-csv",
    "config-json", "sort-numbers", "clean-junk", "close-window", "backup-workbook",
]  # fmt: skip
FULL_IDS = ["calc-total", "mousepad-append", "firefox-colour"]


def check_rows(
    results: dict[str, Any], session_id: str, recording: str, ids: list[str] = SMALL_IDS
) -> list[dict[str, Any]]:
    """Every task has a row in the session, its recording linked, and its last screen."""
    rows: list[dict[str, Any]] = results["tasks"]
    assert [r["id"] for r in rows] == ids
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


@pytest.mark.netns
def test_full_image_tasks_pass_with_the_solving_agent_and_fail_with_the_failing_one(
    settings: Settings, tmp_path: Path
) -> None:
    world = World()
    try:
        world.open()
        manager = build_manager(settings, egress=world.egress)
        token = secrets.token_urlsafe(16)
        app_ = create_app(manager, token=token, settings=settings)
        with BackgroundServer(app_) as server, Client(server.url, token) as client:
            t0 = time.monotonic()
            session = client.create_session(
                image=FULL_IMAGE, memory_mib=3072, egress_allow=["allowed.test"],
                guest_control=True, boot_timeout_s=240,
            )  # fmt: skip
            try:
                booted_s = time.monotonic() - t0
                recording = str(session.info_at_start.recording)
                tasks = EXAMPLES / "full"

                t1 = time.monotonic()
                code, text, results = run_tasks_cli(
                    (server.url, token), session.id, "SolvingAgent", tmp_path / "s", tasks
                )
                solving_s = time.monotonic() - t1
                rows = check_rows(results, session.id, recording, FULL_IDS)
                per_task = {r["id"]: r["duration_s"] for r in rows}
                failed = {r["id"]: (r["error"], r["evaluation"]) for r in rows if not r["passed"]}
                assert not failed, failed
                assert code == 0 and "3/3 passed, 0 failed, 0 errors" in text, text

                t2 = time.monotonic()
                code, text, results = run_tasks_cli(
                    (server.url, token), session.id, "FailingAgent", tmp_path / "f", tasks
                )
                failing_s = time.monotonic() - t2
                rows = check_rows(results, session.id, recording, FULL_IDS)
                passed = {r["id"]: r["evaluation"] for r in rows if r["passed"] or r["score"]}
                assert not passed, passed
                errors = {r["id"]: r["error"] for r in rows if r["error"] is not None}
                assert not errors, errors
                assert code == 1 and "0/3 passed, 3 failed, 0 errors" in text, text
            except BaseException:
                # Keep what failed: results, last screens, fetched files, the screen now.
                where = Path(os.environ.get("DESKVM_TEST_ARTIFACTS") or "artifacts")
                where = where / "test_full_image_tasks"
                shutil.copytree(tmp_path, where, dirs_exist_ok=True)
                session.screenshot().save(str(where / "last_frame.png"))
                (where / "windows.json").write_text(json.dumps(session.windows(), indent=1))
                print(f"\nartifacts in {where}")
                raise
            finally:
                session.delete()
        # What reached the "internet": the download step's file and both agents' pages.
        paths = [e.get("path") for e in world.internet_events() if e.get("kind") == "http"]
        assert paths.count("/note") == 2, paths
        assert "/colour/3A7BC8" in paths and "/colour/3A7BC9" in paths, paths
        print(f"\ntasks on {FULL_IMAGE}: boot {booted_s:.1f} s, solving agent {solving_s:.1f} s, "
              f"failing agent {failing_s:.1f} s; solving per task (s): {per_task}")  # fmt: skip
    finally:
        errors = world.close()
        left = leftovers()
    assert not errors, errors
    assert not left, f"left behind: {left}"
