"""``deskvm task check`` and ``deskvm task run``'s refusals before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from agent_bridge.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def test_task_check_lists_the_examples() -> None:
    result = CliRunner().invoke(app, ["task", "check", str(EXAMPLES)])
    assert result.exit_code == 0, result.output
    assert "10 task(s) valid" in result.output
    assert "backup-workbook" in result.output


def test_an_unsupported_evaluator_stops_the_run_before_any_session(tmp_path: Path) -> None:
    bad = {"id": "pptx", "instruction": "x", "config": [],
           "evaluator": {"func": "compare_pptx_files", "result": {"type": "clipboard"},
                         "expected": {"type": "rule", "rules": {}}}}  # fmt: skip
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    state = tmp_path / "state"
    result = CliRunner().invoke(
        app, ["task", "run", str(tmp_path), "--state-dir", str(state), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 1
    text = " ".join(result.output.split())  # rich wraps long lines
    assert "error (invalid_task): pptx: evaluator: unsupported evaluator func" in text
    assert "'compare_pptx_files'; supported: check_accessibility_tree" in text
    assert not state.exists() and not (tmp_path / "o").exists()  # nothing was started


def test_a_bad_agent_spec_is_refused_before_any_session(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["task", "run", str(EXAMPLES), "--agent", "nope", "--state-dir", str(tmp_path / "s")]
    )
    assert result.exit_code == 1 and "expected MODULE:CALLABLE" in " ".join(result.output.split())
