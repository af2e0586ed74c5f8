"""openQA needles -> deskvm references (``deskvm refs import-needles DIR``).

An os-autoinst *needle* is ``<name>.png`` (a full screenshot) plus ``<name>.json``::

    {"tags": ["inst-bootmenu"], "properties": [],
     "area": [{"xpos": 10, "ypos": 20, "width": 100, "height": 30, "type": "match",
               "match": 95, "margin": 50,
               "click_point": {"xpos": 5, "ypos": 5}}]}

``type`` is ``match`` (default), ``exclude`` or ``ocr``; ``match`` is a similarity
percentage (os-autoinst's default 96); ``margin`` is how far around its position an area is
searched, pixels (default 50); ``click_point`` is relative to its area's top-left corner, or
the string ``"center"``; ``tags`` name what a needle shows (tests ask for tags).

How each becomes a reference (``refs/<name>.png`` + ``refs/<name>.json``):

=====================  ==============================================================
needle                 reference
=====================  ==============================================================
``match`` area         a ``match`` area; ``match``/100 becomes its ``threshold``
``exclude`` area       an ``exclude`` area
``ocr`` area           kept under ``ocr`` (not matched; deskvm reads text with
                       ``find_text``/``read_text`` instead)
``margin``             ``margin_px``: the largest margin of the needle's match areas
                       (deskvm has one margin per reference)
default match (96)     ``threshold`` 0.96
``click_point``        ``click`` in PNG pixels (area corner + offset; ``"center"``: the
                       area's centre); with several, the last one (as os-autoinst)
``tags``               ``tags``
``properties``,        not carried over (listed in the import's warnings)
``max_offset``,
``processing_flags``
=====================  ==============================================================

os-autoinst scores similarity differently from deskvm (see
:mod:`agent_bridge.qa.match`): a threshold carried over may need tuning, which the
import's table makes easy to spot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_bridge.qa.errors import ReferenceInvalid
from agent_bridge.qa.match import Area, Reference, RefSpec
from agent_bridge.qa.model import Box, Point
from agent_bridge.qa.refs import RefStore, decode_png

__all__ = ["NeedleImport", "import_needles", "needle_spec"]

OPENQA_DEFAULT_MATCH = 96
OPENQA_DEFAULT_MARGIN = 50


@dataclass
class NeedleImport:
    """The outcome of importing one needle.

    Attributes:
        name: the reference name (the needle's path below the imported directory).
        status: ``written``, ``exists`` (left alone), or ``failed``.
        spec: the reference's spec (``None`` when it failed).
        path: the PNG written or left alone.
        warnings: what was not carried over, and why it failed.
    """

    name: str
    status: str
    spec: RefSpec | None = None
    path: Path | None = None
    warnings: list[str] = field(default_factory=list)


def _int(area: Mapping[str, Any], key: str, where: str) -> int:
    value = area.get(key, 0) or 0
    if not isinstance(value, int | float) or value < 0:
        raise ReferenceInvalid(f"{where}: {key} must be a number >= 0, got {value!r}")
    return int(value)


def needle_spec(obj: Mapping[str, Any], *, where: str = "needle") -> tuple[RefSpec, list[str]]:
    """A reference spec from a needle's JSON object, and the warnings of the conversion.

    Raises:
        ReferenceInvalid: no ``area`` list, no match area, an area of an unknown type or
            with a bad size or click point.
    """
    areas = obj.get("area")
    if not isinstance(areas, list):
        raise ReferenceInvalid(f"{where}: no 'area' list (is this an openQA needle?)")
    warnings: list[str] = []
    match: list[Area] = []
    exclude: list[Box] = []
    ocr: list[Box] = []
    margins: list[int] = []
    click: Point | None = None
    clicks = 0
    for i, area in enumerate(areas):
        here = f"{where}: area {i}"
        if not isinstance(area, Mapping):
            raise ReferenceInvalid(f"{here} is not an object")
        box = Box(
            _int(area, "xpos", here),
            _int(area, "ypos", here),
            _int(area, "width", here),
            _int(area, "height", here),
        )
        if box.width == 0 or box.height == 0:
            raise ReferenceInvalid(f"{here}: width and height must be > 0")
        kind = area.get("type") or "match"
        for key in ("max_offset", "processing_flags"):
            if area.get(key):
                warnings.append(f"area {i}: {key} is not supported (ignored)")
        if kind == "match":
            percent = area.get("match")
            threshold = None
            if percent:
                if not isinstance(percent, int | float) or not 0 < percent <= 100:
                    raise ReferenceInvalid(f"{here}: match must be a percentage, got {percent!r}")
                threshold = float(percent) / 100.0
            match.append(Area(box, threshold))
            margins.append(_int(area, "margin", here) or OPENQA_DEFAULT_MARGIN)
        elif kind == "exclude":
            exclude.append(box)
        elif kind == "ocr":
            ocr.append(box)
            warnings.append(f"area {i}: ocr area kept under 'ocr' (not matched)")
        else:
            raise ReferenceInvalid(f"{here}: unknown type {kind!r} (match, exclude or ocr)")
        point = area.get("click_point")
        if point:
            clicks += 1
            if point == "center":
                click = box.center
            elif isinstance(point, Mapping) and isinstance(point.get("xpos"), int | float):
                click = Point(box.x + int(point["xpos"]), box.y + int(point.get("ypos") or 0))
            else:
                raise ReferenceInvalid(f"{here}: click_point must be {{xpos, ypos}} or 'center'")
    if not match:
        raise ReferenceInvalid(f"{where}: no match area")
    if clicks > 1:
        warnings.append(f"{clicks} click points: the last one is used (as os-autoinst does)")
    if len(set(margins)) > 1:
        warnings.append(f"margins {sorted(set(margins))}: the largest is used for every area")
    if obj.get("properties"):
        warnings.append(f"properties {obj['properties']!r} are not carried over")
    tags = obj.get("tags") or []
    spec = RefSpec(
        match=tuple(match),
        exclude=tuple(exclude),
        threshold=OPENQA_DEFAULT_MATCH / 100.0,
        margin_px=max(margins),
        click=click,
        tags=tuple(str(t) for t in tags),
        ocr=tuple(ocr),
    )
    return spec, warnings


def _needles(source: Path, recursive: bool) -> Iterator[Path]:
    pattern = "**/*.json" if recursive else "*.json"
    yield from sorted(p for p in source.glob(pattern) if p.is_file())


def import_needles(
    source: Path, dest: RefStore, *, recursive: bool = True, overwrite: bool = False
) -> list[NeedleImport]:
    """Convert every needle under ``source`` into a reference in ``dest``.

    A needle ``source/a/b.json`` (+ ``b.png``) becomes reference ``a/b``. Existing
    references are left alone (status ``exists``) unless ``overwrite``. One bad needle does
    not stop the others (status ``failed``, reason in ``warnings``).

    Raises:
        ReferenceInvalid: ``source`` is not a directory.
    """
    if not source.is_dir():
        raise ReferenceInvalid(f"{source} is not a directory of needles")
    results: list[NeedleImport] = []
    for json_path in _needles(source, recursive):
        name = json_path.relative_to(source).with_suffix("").as_posix()
        item = NeedleImport(name, "failed")
        results.append(item)
        try:
            obj = json.loads(json_path.read_text(encoding="utf-8"))
            if not isinstance(obj, dict):
                raise ReferenceInvalid(f"{json_path}: not a JSON object")
            spec, item.warnings = needle_spec(obj, where=str(json_path))
            png_path = json_path.with_name(str(obj.get("png") or json_path.stem + ".png"))
            if not png_path.is_file():
                raise ReferenceInvalid(f"{json_path}: its image {png_path.name} is missing")
            pixels = decode_png(png_path.read_bytes(), where=str(png_path))
            Reference(name, pixels, spec, str(png_path))  # areas inside the image?
            item.spec = spec
            if dest.exists(name) and not overwrite:
                item.status, item.path = "exists", dest.root / f"{name}.png"
                continue
            if overwrite:
                for suffix in (".png", ".json"):
                    (dest.root / f"{name}{suffix}").unlink(missing_ok=True)
            item.path = dest.write_new(
                name, pixels, spec=spec, source=f"openQA needle {json_path.name}"
            )
            item.status = "written"
        except (ReferenceInvalid, ValueError, OSError) as exc:
            item.status = "failed"
            message = exc.message if isinstance(exc, ReferenceInvalid) else str(exc)
            item.warnings.append(message)
    return results
