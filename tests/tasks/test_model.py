"""Task files are validated before anything runs: unsupported names and bad parameters are
named with their place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent_bridge.tasks import (
    GETTER_PARAMS,
    METRIC_OPTIONS,
    METRICS,
    SETUP_PARAMS,
    TaskConfigError,
    collect_tasks,
    load_task,
    parse_task,
)
from agent_bridge.tasks.ops import GETTERS, SETUP_STEPS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def task(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "t1",
        "instruction": "do it",
        "config": [{"type": "execute", "parameters": {"command": ["true"]}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "clipboard"},
            "expected": {"type": "rule", "rules": {"expected": "x"}},
        },
    }
    base.update(over)
    return base


def refused(data: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(TaskConfigError) as info:
        parse_task(data, **kw)
    assert info.value.code == "invalid_task"
    return info.value.message


def test_every_name_has_an_implementation() -> None:
    assert set(SETUP_STEPS) == set(SETUP_PARAMS)
    assert set(GETTERS) == set(GETTER_PARAMS)
    assert set(METRICS) == set(METRIC_OPTIONS)


def test_the_examples_are_valid_osworld_shaped_tasks() -> None:
    tasks = collect_tasks([EXAMPLES])
    assert len(tasks) == 10
    for t in tasks:
        raw = json.loads(Path(t.path or "").read_text())
        assert {"id", "instruction", "config", "evaluator"} <= set(raw)
        assert t.snapshot == "debian12-desktop"  # OSWorld's other fields are kept
    full = collect_tasks([EXAMPLES / "full"])
    assert [t.id for t in full] == ["calc-total", "mousepad-append", "firefox-colour"]
    assert {t.snapshot for t in full} == {"debian12-full"}


def test_an_unsupported_setup_step_names_itself_and_its_place() -> None:
    msg = refused(task(config=[{"type": "sleep", "parameters": {"seconds": 1}},
                               {"type": "googledrive", "parameters": {}}]))  # fmt: skip
    assert msg.startswith("t1: config[1]:")
    assert "unsupported setup step 'googledrive'" in msg
    assert "supported: activate_window" in msg and "upload_file" in msg


def test_an_unsupported_metric_or_getter_names_itself() -> None:
    ev = task()["evaluator"]
    msg = refused(task(evaluator={**ev, "func": "compare_pptx_files"}))
    assert "unsupported evaluator func 'compare_pptx_files'" in msg
    msg = refused(task(evaluator={**ev, "result": {"type": "cloud_file", "path": "x"}}))
    assert "evaluator.result" in msg and "unsupported getter 'cloud_file'" in msg
    assert "supported: accessibility_tree, clipboard" in msg


def test_unknown_or_bad_parameters_are_named() -> None:
    msg = refused(task(config=[{"type": "sleep", "parameters": {"secs": 1}}]))
    assert "setup step 'sleep'" in msg and "secs: unknown parameter" in msg
    assert "seconds: missing" in msg
    msg = refused(task(config=[{"type": "launch", "parameters": {"command": []}}]))
    assert "config[0]" in msg and "command" in msg
    ev = task()["evaluator"]
    msg = refused(task(evaluator={**ev, "func": "compare_text_file",
                                  "options": {"ignore_blankz": True}}))  # fmt: skip
    assert "options" in msg and "ignore_blankz: unknown parameter" in msg


def test_vm_file_dest_is_a_plain_file_name() -> None:
    ev = {"func": "compare_text_file",
          "result": {"type": "vm_file", "path": "~/a", "dest": "../../etc/passwd"},
          "expected": {"type": "rule", "rules": {}}}  # fmt: skip
    assert "is not a plain file name" in refused(task(evaluator=ev))
    step = {"type": "execute", "parameters": {"command": ["true"], "stdout": "/tmp/x"}}
    assert "is not a plain file name" in refused(task(config=[step]))


def test_metric_lists_must_line_up_and_expected_is_required() -> None:
    ev = {"func": ["exact_match", "exact_match"], "result": [{"type": "clipboard"}],
          "expected": [{"type": "rule", "rules": {"expected": "x"}}] * 2}  # fmt: skip
    assert "result has 1 entries for 2 func(s)" in refused(task(evaluator=ev))
    ev = {"func": "exact_match", "result": {"type": "clipboard"}}
    assert "func 'exact_match' needs an expected getter" in refused(task(evaluator=ev))
    ok = parse_task(task(evaluator={"func": "infeasible"}))
    assert ok.evaluator.funcs == ["infeasible"]


def test_local_files_must_exist_relative_to_the_task_file(tmp_path: Path) -> None:
    step = {"type": "upload_file", "parameters": {"files": [{"local_path": "data/in.txt",
                                                             "path": "~/in.txt"}]}}  # fmt: skip
    f = tmp_path / "t.json"
    f.write_text(json.dumps(task(config=[step])))
    with pytest.raises(
        TaskConfigError, match=r"upload_file files\[0\]: no local file .*data/in.txt"
    ):
        load_task(f)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.txt").write_text("x")
    assert load_task(f).config[0].params.files[0].local_path == "data/in.txt"
    step["parameters"]["files"][0]["path"] = "in.txt"
    assert "must be absolute" in refused(task(config=[step]), path=f)


def test_collect_tasks_reports_every_bad_file_and_duplicate_ids(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(task()))
    (tmp_path / "b.json").write_text(json.dumps(task()))
    (tmp_path / "c.json").write_text("{not json")
    (tmp_path / "d.json").write_text(json.dumps(task(id="d", config=[{"type": "nope"}])))
    with pytest.raises(TaskConfigError) as info:
        collect_tasks([tmp_path])
    lines = info.value.message.splitlines()
    assert any("c.json: not JSON" in line for line in lines)
    assert any("unsupported setup step 'nope'" in line for line in lines)
    assert any("task id 't1' is also the id of" in line for line in lines)
    with pytest.raises(TaskConfigError, match="cannot read the task file"):
        collect_tasks([tmp_path / "missing.json"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskConfigError, match="no task files"):
        collect_tasks([tmp_path / "empty"])


def test_rule_objects_are_checked_before_the_task_starts() -> None:
    rules = {"expect": [{"key": ["a"], "method": "~="}]}
    ev = {"func": "check_json", "result": {"type": "vm_file", "path": "~/c.json", "dest": "c"},
          "expected": {"type": "rule", "rules": rules}}  # fmt: skip
    msg = refused(task(evaluator=ev))
    assert "func 'check_json' rules: expect[0].method" in msg
    ev = {"func": "check_include_exclude", "result": {"type": "clipboard"},
          "expected": {"type": "rule", "rules": {"include": "x", "excludes": ["y"]}}}  # fmt: skip
    msg = refused(task(evaluator=ev))
    assert "include: Input should be a valid list" in msg and "excludes: unknown parameter" in msg
    ev = {"func": "check_accessibility_tree", "result": {"type": "accessibility_tree"},
          "expected": {"type": "rule", "rules": [{"selectors": ["frame"]}]}}  # fmt: skip
    msg = refused(task(evaluator=ev))
    assert "[0].xpath: missing" in msg and "[0].selectors: unknown parameter" in msg
