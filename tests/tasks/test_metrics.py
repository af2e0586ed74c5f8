"""Comparators, each shown to accept what matches and reject what does not."""

from __future__ import annotations

import json
from pathlib import Path

import openpyxl
import pytest

from agent_bridge.tasks.metrics import METRICS, MetricError

m = METRICS


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_rule_metrics() -> None:
    assert m["exact_match"]("a", {"expected": "a"}) == 1.0
    assert m["exact_match"]("a\n", {"expected": "a"}) == 0.0
    assert m["match_in_list"]("b", {"expected": ["a", "b"]}) == 1.0
    assert m["match_in_list"]("c", {"expected": ["a", "b"]}) == 0.0
    assert m["is_in_list"](["x", "Calc"], {"expected": "Calc"}) == 1.0
    assert m["is_in_list"](["x"], {"expected": "Calc"}) == 0.0
    with pytest.raises(MetricError, match="rule object with 'expected'"):
        m["exact_match"]("a", "a")


def test_include_exclude_on_text_and_lists() -> None:
    rules = {"include": ["keep.txt"], "exclude": ["a.tmp"]}
    assert m["check_include_exclude"]("keep.txt\nz\n", rules) == 1.0
    assert m["check_include_exclude"]("keep.txt\na.tmp\n", rules) == 0.0
    assert m["check_include_exclude"]("other\n", rules) == 0.0
    assert m["check_include_exclude"](None, rules) == 0.0
    titles = ["desk@vm: ~", "notes-window"]
    assert m["check_include_exclude"](titles, {"exclude": ["notes-window"]}) == 0.0
    assert m["check_include_exclude"](titles[:1], {"exclude": ["notes-window"]}) == 1.0


def test_literal_match() -> None:
    assert m["literal_match"]("Linux\n", "Linux\n") == 1.0
    assert m["literal_match"]("linux\n", "Linux\n") == 0.0
    assert m["literal_match"]("linux\n", "Linux\n", ignore_case=True) == 1.0
    assert m["literal_match"](["A", 1], ["a", "1"], type="list", ignore_case=True) == 1.0
    assert m["literal_match"](None, "x") == 0.0


def test_compare_text_file(tmp_path: Path) -> None:
    a = write(tmp_path, "a", "hello deskvm\n")
    assert m["compare_text_file"](a, write(tmp_path, "b", "hello deskvm\n")) == 1.0
    assert m["compare_text_file"](a, write(tmp_path, "c", "hello deskvm!\n")) == 0.0
    spaced = write(tmp_path, "d", "  hello\t deskvm  \n\n")
    assert m["compare_text_file"](a, spaced) == 0.0
    assert m["compare_text_file"](a, spaced, ignore_blanks=True) == 1.0
    assert (
        m["compare_text_file"](a, write(tmp_path, "e", "HELLO deskvm\n"), ignore_case=True) == 1.0
    )
    assert m["compare_text_file"](None, a) == 0.0


def test_compare_csv(tmp_path: Path) -> None:
    want = write(tmp_path, "want.csv", "name,age\nalice,30\nbob,25\n")
    assert m["compare_csv"](write(tmp_path, "a.csv", 'name,age\n"alice",30\nbob,25'), want) == 1.0
    swapped = write(tmp_path, "b.csv", "name,age\nbob,25\nalice,30\n")
    assert m["compare_csv"](swapped, want) == 0.0
    spaced = write(tmp_path, "c.csv", "name, age\nalice , 30\nbob,25\n")
    assert m["compare_csv"](spaced, want) == 0.0
    assert m["compare_csv"](spaced, want, strict=False) == 1.0
    assert m["compare_csv"](spaced, [swapped, want], strict=False) == 1.0


def workbook(path: Path, rows: list[tuple[object, ...]], title: str = "Q1") -> str:
    wb = openpyxl.Workbook()
    ws = wb.active
    assert ws is not None
    ws.title = title
    for r in rows:
        ws.append(r)
    wb.create_sheet("notes").append(("by", "deskvm"))
    wb.save(path)
    return str(path)


def test_compare_table_xlsx(tmp_path: Path) -> None:
    rows = [("region", "units"), ("north", 120), ("south", 80.5)]
    want = workbook(tmp_path / "want.xlsx", rows)
    assert m["compare_table"](workbook(tmp_path / "same.xlsx", rows), want) == 1.0
    changed = workbook(tmp_path / "changed.xlsx", [*rows[:2], ("south", 81)])
    assert m["compare_table"](changed, want) == 0.0
    renamed = workbook(tmp_path / "renamed.xlsx", rows, title="Sheet")
    assert m["compare_table"](renamed, want) == 0.0
    data_only = [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "Q1"}]
    assert m["compare_table"](renamed, want, rules=data_only) == 1.0
    assert m["compare_table"](renamed, want, rules=[{"type": "sheet_name"}]) == 0.0
    assert m["compare_table"](None, want) == 0.0
    with pytest.raises(MetricError, match="not an XLSX workbook"):
        m["compare_table"](write(tmp_path, "fake.xlsx", "sales\n"), want)


def test_compare_table_csv(tmp_path: Path) -> None:
    a = write(tmp_path, "a.csv", "x,y\n1,2\n")
    assert m["compare_table"](a, write(tmp_path, "b.csv", "x,y\n1,2\n")) == 1.0
    assert m["compare_table"](a, write(tmp_path, "c.csv", "x,y\n1,3\n")) == 0.0


def test_check_json(tmp_path: Path) -> None:
    rules = {"expect": [{"key": ["theme"], "method": "eq", "ref": "dark"},
                        {"key": ["size"], "method": "ge", "ref": 12}],
             "unexpect": [{"key": ["debug"], "method": "eq", "ref": True}]}  # fmt: skip
    good = write(tmp_path, "good.json", json.dumps({"theme": "dark", "size": 12}))
    assert m["check_json"](good, rules) == 1.0
    as_text = write(tmp_path, "text.json", json.dumps({"theme": "dark", "size": "12"}))
    assert m["check_json"](as_text, rules) == 0.0
    debug = write(tmp_path, "debug.json", json.dumps({"theme": "dark", "size": 14, "debug": True}))
    assert m["check_json"](debug, rules) == 0.0
    assert m["check_json"](write(tmp_path, "bad.json", "{"), rules) == 0.0
    regex = {"expect": [{"key": ["theme"], "method": "re", "ref": "^da"}]}
    assert m["check_json"](good, regex) == 1.0
    with pytest.raises(MetricError, match="unknown method 'approx'"):
        m["check_json"](good, {"expect": [{"key": ["size"], "method": "approx", "ref": 1}]})
    # re's meaning (lookahead here); the guest writes the value, and a pattern that
    # backtracks on it cannot decide within its budget: the check fails, saying so.
    look = {"expect": [{"key": ["theme"], "method": "re", "ref": "(?=d)"}]}
    assert m["check_json"](good, look) == 1.0
    trap = write(tmp_path, "trap.json", json.dumps({"theme": "a" * 60 + "!"}))
    slow = {"expect": [{"key": ["theme"], "method": "re", "ref": "(a|aa)+$"}]}
    with pytest.raises(MetricError, match="did not decide"):
        m["check_json"](trap, slow)
    for bad in ("(", "(?R)?a", "x{100000000}"):  # re refuses it, or it cannot be bounded
        with pytest.raises(MetricError, match="pattern"):
            m["check_json"](good, {"expect": [{"key": ["theme"], "method": "re", "ref": bad}]})


def test_check_direct_json_object() -> None:
    rules = {"expected": {"a": 1}}
    assert m["check_direct_json_object"]('{"a": 1, "b": 2}\n', rules) == 1.0
    assert m["check_direct_json_object"]({"a": 2}, rules) == 0.0
    assert m["check_direct_json_object"]("not json", rules) == 0.0


TREE = {
    "role": "desktop frame", "name": "main", "states": [], "x": 0, "y": 0,
    "width": 800, "height": 600,
    "children": [{
        "role": "frame", "name": "Calculator", "states": ["active", "focused"],
        "x": 10, "y": 10, "width": 200, "height": 100,
        "children": [{"role": "push button", "name": "OK", "states": ["focusable"],
                      "x": 20, "y": 20, "width": 50, "height": 20, "children": []}],
    }],
}  # fmt: skip


def test_check_accessibility_tree_uses_osworlds_xml_form() -> None:
    check = m["check_accessibility_tree"]
    text = json.dumps(TREE)
    assert check(text, [{"xpath": "//push-button[@name='OK']"}]) == 1.0
    assert check(text, [{"xpath": "//push-button[@name='Cancel']"}]) == 0.0
    focused = [{"xpath": "//frame[@st:focused='true']", "text": "Calculator", "exact": True}]
    assert check(text, focused) == 1.0
    assert check(json.dumps({"tree": TREE, "truncated": False}), focused) == 1.0
    assert check(text, [{"xpath": "//frame", "text": "Calculater", "exact": True}]) == 0.0
    assert check(text, [{"xpath": "//frame", "text": "Calculater", "exact": False}]) == 0.9
    assert check(None, focused) == 0.0
    with pytest.raises(MetricError, match="xpath"):
        check(text, [{"xpath": "//frame[@name="}])
