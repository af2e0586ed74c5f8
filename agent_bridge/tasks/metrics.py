"""Comparators (OSWorld's "metrics"): ``metric(result, expected, **options) -> float``.

``result`` and ``expected`` are what the getters produced: strings, lists, rule objects,
or local file paths (``vm_file``, ``local_file``; ``None`` when the guest had no such
file, which scores 0). Every metric returns 1.0 or 0.0. The names, argument shapes and
options are OSWorld's (``desktop_env/evaluators/metrics``) so its task files evaluate the
same; tables are read with :mod:`csv` and openpyxl, nothing is executed.

Metrics raise :class:`MetricError` for inputs of the wrong shape (a rule object without
``expected``...); the environment scores that 0 and reports the message.
"""

from __future__ import annotations

import csv
import json
import operator
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent_bridge.tasks.model import METRIC_OPTIONS
from orchestrator.bounded_regex import RegexError, RegexTimeout, compile_bounded
from orchestrator.errors import DeskvmError

__all__ = ["A11Y_NAMESPACES", "METRICS", "Metric", "MetricError", "a11y_xml"]

Metric = Callable[..., float]


class MetricError(DeskvmError):
    """A metric got a value of the wrong shape (scored 0, message reported)."""

    code = "metric_error"


def _rule(rules: Any, key: str, func: str) -> Any:
    if not isinstance(rules, Mapping) or key not in rules:
        raise MetricError(f"{func}: the expected getter must give a rule object with {key!r}")
    return rules[key]


def exact_match(result: Any, rules: Any) -> float:
    """1 if ``result == rules["expected"]``."""
    return float(result == _rule(rules, "expected", "exact_match"))


def match_in_list(result: Any, rules: Any) -> float:
    """1 if ``result`` is one of ``rules["expected"]`` (a list)."""
    expected = _rule(rules, "expected", "match_in_list")
    return float(isinstance(expected, list | tuple | str) and result in expected)


def is_in_list(result: Any, rules: Any) -> float:
    """1 if ``rules["expected"]`` is in ``result`` (a list or a string)."""
    expected = _rule(rules, "expected", "is_in_list")
    return float(isinstance(result, list | tuple | str) and expected in result)


def check_include_exclude(result: Any, rules: Any) -> float:
    """1 if every ``rules["include"]`` entry is in ``result`` and no ``rules["exclude"]``
    entry is (substrings of a string, or members of a list)."""
    if result is None:
        return 0.0
    if not isinstance(rules, Mapping):
        raise MetricError("check_include_exclude: the expected getter must give a rule object")
    include = rules.get("include", [])
    exclude = rules.get("exclude", [])
    return float(all(r in result for r in include) and all(r not in result for r in exclude))


def literal_match(
    result: Any, expected: Any, *, type: str = "str", ignore_case: bool = False
) -> float:
    """1 if ``result`` and ``expected`` are equal as strings (``type: "str"``) or as lists of
    strings (``type: "list"``), optionally ignoring case."""

    def norm(v: Any) -> str:
        return str(v).lower() if ignore_case else str(v)

    if type == "list":
        if not isinstance(result, list | tuple) or not isinstance(expected, list | tuple):
            return 0.0
        return float([norm(v) for v in result] == [norm(v) for v in expected])
    if result is None or expected is None:
        return 0.0
    return float(norm(result) == norm(expected))


def _read_text(path: Any) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def compare_text_file(
    result: Any, expected: Any, *, ignore_blanks: bool = False, ignore_case: bool = False
) -> float:
    """1 if the two text files are equal (``ignore_blanks``: whitespace runs collapsed and
    ends stripped; ``ignore_case``)."""
    a, b = _read_text(result), _read_text(expected)
    if a is None or b is None:
        return 0.0
    if ignore_blanks:
        a, b = (re.sub(r"\s+", " ", t).strip() for t in (a, b))
    if ignore_case:
        a, b = a.lower(), b.lower()
    return float(a == b)


def _csv_rows(path: Any) -> list[list[str]] | None:
    text = _read_text(path)
    if text is None:
        return None
    return [row for row in csv.reader(text.splitlines()) if row]


def compare_csv(
    result: Any, expected: Any, *, strict: bool = True, ignore_case: bool = False
) -> float:
    """1 if the two CSV files hold the same rows of cells (``strict: false`` strips each
    cell; ``ignore_case``). ``expected`` may be a list of files: any one matching is 1."""
    got = _csv_rows(result)
    if got is None:
        return 0.0

    def norm(rows: list[list[str]]) -> list[list[str]]:
        return [
            [(c if strict else c.strip()).lower() if ignore_case else (c if strict else c.strip())
             for c in row]
            for row in rows
        ]  # fmt: skip

    for exp in expected if isinstance(expected, list) else [expected]:
        want = _csv_rows(exp)
        if want is not None and norm(got) == norm(want):
            return 1.0
    return 0.0


def _sheets(path: Any) -> list[tuple[str, list[list[Any]]]] | None:
    """(name, rows of cell values) of every sheet; a ``.csv`` file is one sheet."""
    if path is None or not Path(path).is_file():
        return None
    if str(path).lower().endswith(".csv"):
        rows = _csv_rows(path)
        return None if rows is None else [("csv", [list(r) for r in rows])]
    try:
        import openpyxl
    except ImportError as exc:  # a dependency of deskvm: only a broken install lacks it
        raise MetricError("compare_table needs openpyxl (pip install deskvm)") from exc
    try:
        book = openpyxl.load_workbook(path, read_only=True, data_only=True)
    except Exception as exc:  # openpyxl raises many types for a non-XLSX file
        raise MetricError(
            f"compare_table: {Path(path).name} is not an XLSX workbook: {exc}"
        ) from exc
    try:
        out = []
        for sheet in book.worksheets:
            rows = [list(r) for r in sheet.iter_rows(values_only=True)]
            while rows and all(v is None for v in rows[-1]):
                rows.pop()
            out.append((sheet.title, [_trim(r) for r in rows]))
        return out
    finally:
        book.close()


def _trim(row: list[Any]) -> list[Any]:
    while row and row[-1] is None:
        row.pop()
    return row


def _sheet(sheets: list[tuple[str, list[list[Any]]]], idx: int | str) -> list[list[Any]] | None:
    if isinstance(idx, int):
        return sheets[idx][1] if 0 <= idx < len(sheets) else None
    for name, rows in sheets:
        if name == idx:
            return rows
    return None


def compare_table(result: Any, expected: Any, *, rules: Sequence[Any] | None = None) -> float:
    """1 if the result workbook matches the expected one (XLSX via openpyxl, or CSV).

    Without ``rules``: the same sheet names and the same cell values in every sheet (trailing
    empty cells and rows ignored). Rules: ``{"type": "sheet_name"}`` (names in order) and
    ``{"type": "sheet_data", "sheet_idx0": i, "sheet_idx1": j}`` (values of result sheet
    ``i`` equal those of expected sheet ``j``; index or name).
    """
    got, want = _sheets(result), _sheets(expected)
    if got is None or want is None:
        return 0.0
    if rules is None:
        return float(got == want)
    for rule in rules:
        kind = rule["type"] if isinstance(rule, Mapping) else rule.type
        if kind == "sheet_name":
            if [n for n, _ in got] != [n for n, _ in want]:
                return 0.0
        else:
            i = rule["sheet_idx0"] if isinstance(rule, Mapping) else rule.sheet_idx0
            j = rule["sheet_idx1"] if isinstance(rule, Mapping) else rule.sheet_idx1
            a, b = _sheet(got, i), _sheet(want, j)
            if a is None or b is None or a != b:
                return 0.0
    return 1.0


CHECK_REGEX_BUDGET_S = 1.0
"""Seconds a ``check_json`` ``re`` rule may take on the guest's value; past it the check
fails with a :class:`MetricError` (it could not decide)."""

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}


def _match_value(value: Any, rule: Mapping[str, Any]) -> bool:
    method = rule.get("method", "eq")
    ref = rule.get("ref")
    if method == "re":
        # The value is the guest's: a pattern that backtracks on it must not stall the
        # check; one that cannot decide in time fails it.
        try:
            regex = compile_bounded(str(ref))
        except RegexError as exc:
            raise MetricError(f"check_json: pattern {ref!r}: {exc}") from exc
        if not isinstance(value, str):
            return False
        try:
            found = regex.search(value, deadline=time.monotonic() + CHECK_REGEX_BUDGET_S)
        except RegexTimeout as exc:
            raise MetricError(
                f"check_json: pattern {ref!r} did not decide within {CHECK_REGEX_BUDGET_S:g} s "
                "on the guest's value"
            ) from exc
        return found is not None
    op = _OPS.get(method)
    if op is None:
        raise MetricError(
            f"check_json: unknown method {method!r}; supported: re, {', '.join(_OPS)}"
        )
    try:
        return bool(op(value, ref))
    except TypeError:
        return False


def _dig(data: Any, keys: Sequence[Any]) -> tuple[bool, Any]:
    for k in keys:
        try:
            data = data[k]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data


def check_json(result: Any, rules: Any) -> float:
    """1 if the JSON file satisfies every ``rules["expect"]`` and no ``rules["unexpect"]``
    rule: each rule ``{"key": [k1, k2...], "method": "eq"|"ne"|"lt"|"le"|"gt"|"ge"|"re",
    "ref": value}`` looks the value up by the key path."""
    text = _read_text(result)
    if text is None:
        return 0.0
    if not isinstance(rules, Mapping):
        raise MetricError("check_json: the expected getter must give a rule object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return 0.0
    for r in rules.get("expect", []):
        found, value = _dig(data, r["key"])
        if not found or not _match_value(value, r):
            return 0.0
    for r in rules.get("unexpect", []):
        found, value = _dig(data, r["key"])
        if found and _match_value(value, r):
            return 0.0
    return 1.0


def check_direct_json_object(result: Any, rules: Any) -> float:
    """1 if every key of ``rules["expected"]`` has the same value in ``result`` (a JSON
    object, or text holding one, e.g. a command's output)."""
    expected = _rule(rules, "expected", "check_direct_json_object")
    if isinstance(result, str):
        try:
            result = json.loads(result.strip())
        except json.JSONDecodeError:
            return 0.0
    if not isinstance(result, Mapping) or not isinstance(expected, Mapping):
        return 0.0
    return float(all(k in result and result[k] == v for k, v in expected.items()))


A11Y_NAMESPACES: Mapping[str, str] = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
}
"""OSWorld's namespaces (Ubuntu) for states and geometry in the tree's XML form."""

_XML_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def a11y_xml(tree: Any) -> Any:
    """The tree as OSWorld's XML form (an :class:`xml.etree.ElementTree.Element`).

    A node ``{role, name, states, x, y, width, height, children}`` becomes an element named
    after its role (spaces as ``-``: ``push-button``), with attribute ``name``, one
    ``st:<state>="true"`` per state, ``cp:screencoord="(x, y)"`` and ``cp:size="(w, h)"``;
    its text is its name.
    """
    from xml.etree import ElementTree as ET

    st, cp = A11Y_NAMESPACES["st"], A11Y_NAMESPACES["cp"]

    def build(node: Any) -> ET.Element:
        if not isinstance(node, Mapping):
            raise MetricError("check_accessibility_tree: a tree node is not an object")
        tag = _XML_NAME.sub("-", str(node.get("role") or "unknown").replace(" ", "-"))
        el = ET.Element(tag if tag[:1].isalpha() else f"n-{tag}")
        name = str(node.get("name") or "")
        el.set("name", name)
        el.text = name or None
        for state in node.get("states") or []:
            el.set(f"{{{st}}}{_XML_NAME.sub('-', str(state))}", "true")
        if node.get("x") is not None and node.get("y") is not None:
            el.set(f"{{{cp}}}screencoord", f"({node.get('x')}, {node.get('y')})")
        if node.get("width") is not None and node.get("height") is not None:
            el.set(f"{{{cp}}}size", f"({node.get('width')}, {node.get('height')})")
        for child in node.get("children") or []:
            el.append(build(child))
        return el

    return build(tree)


def check_accessibility_tree(result: Any, rules: Any) -> float:
    """OSWorld's ``check_accessibility_tree`` with ``xpath`` rules: the product over the
    rules of 0 (no element found), 1 (found, no ``text``) or the best text match (1/0 with
    ``exact``, else the :class:`difflib.SequenceMatcher` ratio). ``result`` is the
    ``accessibility_tree`` getter's JSON text (or the tree); XPath is ElementTree's subset
    (``//push-button[@name='OK']``, ``[@st:focused='true']``), CSS ``selectors`` are not
    supported."""
    import difflib
    from xml.etree import ElementTree as ET

    if result is None:
        return 0.0
    tree = json.loads(result) if isinstance(result, str) else result
    if isinstance(tree, Mapping) and "tree" in tree:
        tree = tree["tree"]
    root = ET.Element("root")
    root.append(a11y_xml(tree))
    score = 1.0
    for rule in rules if isinstance(rules, list) else []:
        path = str(rule["xpath"])
        path = "." + path if path.startswith("//") else path
        try:
            found = root.findall(path, dict(A11Y_NAMESPACES))
        except (SyntaxError, KeyError, TypeError) as exc:  # ElementPath's ways to say "bad"
            raise MetricError(f"check_accessibility_tree: xpath {rule['xpath']!r}: {exc}") from exc
        if not found:
            return 0.0
        text = rule.get("text")
        if text is not None:
            if rule.get("exact", True):
                best = float(any((el.text or "") == text for el in found))
            else:
                best = max(
                    difflib.SequenceMatcher(None, el.text or "", text).ratio() for el in found
                )
            score *= best
    return score


def infeasible(*_: Any) -> float:
    """Placeholder: the environment scores ``infeasible`` by the agent's last action."""
    return 0.0


METRICS: Mapping[str, Metric] = {
    "exact_match": exact_match,
    "match_in_list": match_in_list,
    "is_in_list": is_in_list,
    "check_include_exclude": check_include_exclude,
    "literal_match": literal_match,
    "compare_text_file": compare_text_file,
    "compare_csv": compare_csv,
    "compare_table": compare_table,
    "check_json": check_json,
    "check_direct_json_object": check_direct_json_object,
    "check_accessibility_tree": check_accessibility_tree,
    "infeasible": infeasible,
}
"""Every metric by its ``func`` name (the same names as :data:`METRIC_OPTIONS`)."""

assert set(METRICS) == set(METRIC_OPTIONS)
