"""References on disk: JSON format, loading, writing without ever overwriting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent_bridge.qa.errors import ReferenceInvalid, ReferenceMissing
from agent_bridge.qa.match import Area, RefSpec
from agent_bridge.qa.model import Box, Point
from agent_bridge.qa.refs import RefStore, encode_png, spec_from_json, spec_to_json
from tests.qa.helpers import desktop


def test_a_png_alone_is_a_whole_image_reference(tmp_path: Path) -> None:
    pixels = desktop(60, 40)
    (tmp_path / "button.png").write_bytes(encode_png(pixels))
    ref = RefStore(tmp_path).load("button")
    assert ref.name == "button" and ref.path == str(tmp_path / "button.png")
    assert np.array_equal(ref.pixels, pixels)
    assert ref.spec == RefSpec()
    assert [a.box for a in ref.areas] == [Box(0, 0, 60, 40)]


def test_the_json_gives_areas_threshold_margin_click(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "dlg.png").write_bytes(encode_png(desktop(200, 100)))
    spec = {
        "match": [{"x": 10, "y": 10, "width": 50, "height": 20, "threshold": 0.9}],
        "exclude": [{"x": 20, "y": 12, "width": 5, "height": 5}],
        "threshold": 0.97,
        "margin_px": 30,
        "click": {"x": 15, "y": 15},
        "tags": ["dialog"],
        "source": "hand-made",
    }
    (tmp_path / "sub" / "dlg.json").write_text(json.dumps(spec))
    ref = RefStore(tmp_path).load("sub/dlg")
    assert ref.spec == RefSpec(
        match=(Area(Box(10, 10, 50, 20), 0.9),),
        exclude=(Box(20, 12, 5, 5),),
        threshold=0.97,
        margin_px=30,
        click=Point(15, 15),
        tags=("dialog",),
    )
    assert spec_from_json(spec_to_json(ref.spec)) == ref.spec


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"treshold": 0.9}, "treshold: Extra inputs are not permitted"),
        ({"threshold": 95}, "threshold: Input should be less than or equal to 1"),
        ({"match": [{"x": 0, "y": 0, "width": 0, "height": 5}]}, "match.0.width"),
        ({"margin_px": -1}, "margin_px"),
        ({"click": {"x": 1}}, "click.y: Field required"),
    ],
)
def test_malformed_json_is_refused_naming_the_field(obj: dict, message: str) -> None:
    with pytest.raises(ReferenceInvalid, match=message.replace(".", r"\.")):
        spec_from_json(obj, where="refs/x.json")


def test_missing_and_broken_references_say_what_to_do(tmp_path: Path) -> None:
    store = RefStore(tmp_path)
    with pytest.raises(ReferenceMissing, match="--deskvm-update-refs"):
        store.load("nothing")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ReferenceInvalid, match="not a readable image"):
        store.load("bad")
    (tmp_path / "ok.png").write_bytes(encode_png(desktop(20, 20)))
    (tmp_path / "ok.json").write_text("{nope")
    with pytest.raises(ReferenceInvalid, match="not valid JSON"):
        store.load("ok")
    (tmp_path / "ok.json").write_text('{"match": [{"x": 10, "y": 10, "width": 50, "height": 5}]}')
    with pytest.raises(ReferenceInvalid, match="not inside"):
        store.load("ok")
    for name in ("../escape", "/abs", "a//b", ""):
        with pytest.raises(ReferenceInvalid, match="reference name"):
            store.load(name)


def test_write_new_never_overwrites(tmp_path: Path) -> None:
    store = RefStore(tmp_path / "refs")
    pixels = desktop(100, 80)
    path = store.write_new("a/b", pixels, region=Box(10, 10, 30, 20), source="test")
    assert path == tmp_path / "refs" / "a" / "b.png"
    assert json.loads((tmp_path / "refs/a/b.json").read_text())["match"] == [
        {"x": 10, "y": 10, "width": 30, "height": 20}
    ]
    before = path.read_bytes()
    with pytest.raises(ReferenceInvalid, match="never overwritten"):
        store.write_new("a/b", desktop(100, 80, windows=[(Box(0, 0, 50, 50), "x")]))
    assert path.read_bytes() == before
    assert store.written == [path]
    # a stray JSON without its PNG is not replaced either
    (tmp_path / "refs" / "c.json").write_text("{}")
    with pytest.raises(ReferenceInvalid, match="never overwritten"):
        store.write_new("c", pixels, region=Box(0, 0, 5, 5))
    assert not (tmp_path / "refs" / "c.png").exists()


def test_a_changed_file_is_reloaded(tmp_path: Path) -> None:
    store = RefStore(tmp_path)
    (tmp_path / "r.png").write_bytes(encode_png(desktop(20, 20)))
    first = store.load("r")
    assert store.load("r") is first
    (tmp_path / "r.json").write_text('{"threshold": 0.5}')
    assert store.load("r").spec.threshold == 0.5
