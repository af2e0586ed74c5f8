"""openQA needles become references: `deskvm refs import-needles DIR`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from agent_bridge.cli import app
from agent_bridge.qa.errors import ReferenceInvalid
from agent_bridge.qa.match import Area, RefSpec, find
from agent_bridge.qa.model import Box, Point
from agent_bridge.qa.needles import needle_spec
from agent_bridge.qa.refs import RefStore, encode_png
from tests.qa.helpers import desktop

DIALOG = Box(200, 120, 180, 90)
SCREEN = desktop(windows=[(DIALOG, "Save changes?")])

NEEDLE = {
    "tags": ["save-dialog", "ENV-DESKTOP-openbox"],
    "properties": ["workaround"],
    "area": [
        {"xpos": 200, "ypos": 120, "width": 180, "height": 90, "type": "match", "match": 90,
         "margin": 30, "click_point": {"xpos": 20, "ypos": 60}},
        {"xpos": 205, "ypos": 125, "width": 40, "height": 10, "type": "exclude"},
        {"xpos": 208, "ypos": 150, "width": 120, "height": 20, "type": "ocr"},
        {"xpos": 0, "ypos": 0, "width": 60, "height": 20},
    ],
}  # fmt: skip


def test_needle_json_maps_to_a_reference_spec() -> None:
    spec, warnings = needle_spec(NEEDLE)
    assert spec == RefSpec(
        match=(Area(Box(200, 120, 180, 90), 0.9), Area(Box(0, 0, 60, 20), None)),
        exclude=(Box(205, 125, 40, 10),),
        threshold=0.96,
        margin_px=50,  # the largest margin: 30 given, 50 is os-autoinst's default
        click=Point(220, 180),
        tags=("save-dialog", "ENV-DESKTOP-openbox"),
        ocr=(Box(208, 150, 120, 20),),
    )
    assert any("ocr area" in w for w in warnings)
    assert any("margins [30, 50]" in w for w in warnings)
    assert any("properties" in w for w in warnings)


def test_center_click_points_and_bad_needles() -> None:
    spec, _ = needle_spec(
        {"area": [{"xpos": 10, "ypos": 10, "width": 20, "height": 10, "click_point": "center"}]}
    )
    assert spec.click == Point(20, 15)
    for bad, message in [
        ({"tags": []}, "no 'area' list"),
        ({"area": [{"xpos": 1, "ypos": 1, "width": 5, "height": 5, "type": "exclude"}]},
         "no match area"),
        ({"area": [{"xpos": 1, "ypos": 1, "width": 5, "height": 5, "type": "fuzzy"}]},
         "unknown type"),
        ({"area": [{"xpos": 1, "ypos": 1, "width": 0, "height": 5}]}, "width and height"),
        ({"area": [{"xpos": 1, "ypos": 1, "width": 5, "height": 5, "click_point": "left"}]},
         "click_point"),
    ]:  # fmt: skip
        with pytest.raises(ReferenceInvalid, match=message):
            needle_spec(bad)


def _needles(root: Path) -> Path:
    src = root / "needles"
    (src / "dialogs").mkdir(parents=True)
    (src / "dialogs" / "save.png").write_bytes(encode_png(SCREEN))
    (src / "dialogs" / "save.json").write_text(json.dumps(NEEDLE))
    (src / "broken.png").write_bytes(encode_png(SCREEN))
    (src / "broken.json").write_text(json.dumps({"area": []}))
    (src / "nopng.json").write_text(json.dumps(NEEDLE))
    return src


def test_import_needles_command_writes_references_and_reports_failures(tmp_path: Path) -> None:
    src = _needles(tmp_path)
    refs = tmp_path / "refs"
    result = CliRunner().invoke(app, ["refs", "import-needles", str(src), "--out", str(refs)])
    assert result.exit_code == 1, result.output  # two needles could not be converted
    assert "1 written" in result.output and "2 failed" in result.output
    assert "no match area" in result.output and "nopng.png is missing" in result.output
    written = json.loads((refs / "dialogs" / "save.json").read_text())
    assert written["match"][0] == {"x": 200, "y": 120, "width": 180, "height": 90, "threshold": 0.9}
    assert written["tags"] == ["save-dialog", "ENV-DESKTOP-openbox"]
    assert written["source"] == "openQA needle save.json"
    # the reference works: found on a screen where the dialog moved within the margin
    ref = RefStore(refs).load("dialogs/save")
    moved = desktop(windows=[(DIALOG.shifted(25, -20), "Save changes?")])
    moved[0:20, 0:60] = SCREEN[0:20, 0:60]
    candidate = find(moved, ref)
    assert candidate.ok and candidate.hits[0].box == DIALOG.shifted(25, -20)
    assert candidate.click_point == Point(245, 160)

    # again: existing references are kept, and said so
    (src / "broken.json").unlink()
    (src / "nopng.json").unlink()
    before = (refs / "dialogs" / "save.png").read_bytes()
    (src / "dialogs" / "save.png").write_bytes(encode_png(np.zeros_like(SCREEN)))
    again = CliRunner().invoke(app, ["refs", "import-needles", str(src), "--out", str(refs)])
    assert again.exit_code == 0, again.output
    assert "exists" in again.output and "--overwrite" in again.output
    assert (refs / "dialogs" / "save.png").read_bytes() == before
    forced = CliRunner().invoke(
        app, ["refs", "import-needles", str(src), "--out", str(refs), "--overwrite"]
    )
    assert forced.exit_code == 0 and (refs / "dialogs" / "save.png").read_bytes() != before


def test_import_needles_refuses_a_missing_directory(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["refs", "import-needles", str(tmp_path / "none")])
    assert result.exit_code == 1 and "not a directory" in " ".join(result.output.split())


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "qa"


@pytest.mark.parametrize("name", ["terminal", "save_dialog", "yes_button"])
def test_the_example_needles_become_the_example_references(tmp_path: Path, name: str) -> None:
    """examples/qa/os-autoinst/needles (the os-autoinst version of the example suite, see
    docs/qa.md) imported: each finds what the hand-written reference finds, at the same
    place, on the frames of the small image both were cut from."""
    refs = tmp_path / "refs"
    result = CliRunner().invoke(
        app,
        ["refs", "import-needles", str(EXAMPLES / "os-autoinst" / "needles"), "--out", str(refs)],
    )
    assert result.exit_code == 0, result.output
    imported, written = RefStore(refs).load(name), RefStore(EXAMPLES / "refs").load(name)
    assert imported.spec.exclude == written.spec.exclude
    for screen in ("terminal", "save_dialog"):
        frame = RefStore(EXAMPLES / "refs").load(screen).pixels
        a, b = find(frame, imported), find(frame, written)
        assert a.ok == b.ok, screen
        if a.ok:
            assert a.hits[0].box == b.hits[0].box and a.click_point == b.click_point
