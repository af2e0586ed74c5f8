"""References beside the tests: ``refs/<name>.png`` + optional ``refs/<name>.json``.

The PNG is what to look for: a crop (searched on the whole screen) or a full screen whose
JSON names the areas that matter. The JSON (every key optional; unknown keys are refused
so a typo is not silently ignored)::

    {
      "match":     [{"x": 578, "y": 380, "width": 125, "height": 77, "threshold": 0.9}],
      "exclude":   [{"x": 600, "y": 384, "width": 60, "height": 12}],
      "threshold": 0.95,
      "margin_px": 50,
      "click":     {"x": 597, "y": 438},
      "tags":      ["dialog"],
      "ocr":       [],
      "source":    "free text: where this reference came from"
    }

All coordinates are pixels of the PNG, origin top-left; ``threshold`` is a score 0..1 (see
:mod:`agent_bridge.qa.match`); ``margin_px`` limits the search to that distance around each
area's position (omit it to search the whole screen); ``click`` is where ``click(ref)``
clicks (default: the centre of the match).

Names are relative paths without ``..`` (``"dialog_ok"``, ``"gimp/toolbox"``); a name
maps to ``<root>/<name>.png``. A PNG with transparency is matched on its RGB channels.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_bridge.qa.errors import ReferenceInvalid, ReferenceMissing
from agent_bridge.qa.match import Area, Reference, RefSpec
from agent_bridge.qa.model import Box, Point

__all__ = ["RefStore", "decode_png", "encode_png", "spec_from_json", "spec_to_json"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


class _Rect(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int = Field(ge=0)
    y: int = Field(ge=0)
    width: int = Field(gt=0)
    height: int = Field(gt=0)


class _MatchRect(_Rect):
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)


class _Point(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int = Field(ge=0)
    y: int = Field(ge=0)


class _RefFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    match: list[_MatchRect] = []
    exclude: list[_Rect] = []
    threshold: float = Field(default=0.95, ge=0.0, le=1.0)
    margin_px: int | None = Field(default=None, ge=0)
    click: _Point | None = None
    tags: list[str] = []
    ocr: list[_Rect] = []
    source: str | None = None


def _box(rect: _Rect) -> Box:
    return Box(rect.x, rect.y, rect.width, rect.height)


def spec_from_json(obj: Mapping[str, Any], *, where: str = "reference JSON") -> RefSpec:
    """Parse a ``refs/<name>.json`` object.

    Raises:
        ReferenceInvalid: unknown keys, wrong types, negative sizes, threshold outside 0..1
            (the message names the field).
    """
    try:
        parsed = _RefFile.model_validate(obj)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise ReferenceInvalid(f"{where}: {problems}") from None
    return RefSpec(
        match=tuple(Area(_box(r), r.threshold) for r in parsed.match),
        exclude=tuple(_box(r) for r in parsed.exclude),
        threshold=parsed.threshold,
        margin_px=parsed.margin_px,
        click=Point(parsed.click.x, parsed.click.y) if parsed.click is not None else None,
        tags=tuple(parsed.tags),
        ocr=tuple(_box(r) for r in parsed.ocr),
    )


def _rect(box: Box) -> dict[str, int]:
    return {"x": box.x, "y": box.y, "width": box.width, "height": box.height}


def spec_to_json(spec: RefSpec, *, source: str | None = None) -> dict[str, Any]:
    """The JSON object of a spec (defaults left out)."""
    out: dict[str, Any] = {}
    if spec.match:
        out["match"] = [
            {**_rect(a.box), **({"threshold": a.threshold} if a.threshold is not None else {})}
            for a in spec.match
        ]
    if spec.exclude:
        out["exclude"] = [_rect(b) for b in spec.exclude]
    out["threshold"] = spec.threshold
    if spec.margin_px is not None:
        out["margin_px"] = spec.margin_px
    if spec.click is not None:
        out["click"] = {"x": spec.click.x, "y": spec.click.y}
    if spec.tags:
        out["tags"] = list(spec.tags)
    if spec.ocr:
        out["ocr"] = [_rect(b) for b in spec.ocr]
    if source:
        out["source"] = source
    return out


def decode_png(data: bytes, *, where: str = "image") -> np.ndarray[Any, np.dtype[np.uint8]]:
    """PNG (or any Pillow-readable) bytes -> ``(h, w, 3)`` uint8 RGB.

    Raises:
        ReferenceInvalid: not an image.
    """
    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ReferenceInvalid(f"{where}: not a readable image ({exc})") from exc


def encode_png(pixels: np.ndarray[Any, np.dtype[np.uint8]]) -> bytes:
    """``(h, w, 3)`` uint8 RGB -> PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


class RefStore:
    """A directory of references.

    Args:
        root: the directory (``refs/`` beside the tests, for the pytest plugin).
        update_missing: write a missing reference from the current frame instead of
            failing (``pytest --deskvm-update-refs``). An existing reference is never
            overwritten.

    Attributes:
        written: PNGs written by :meth:`write_new` in this run, in order.
    """

    def __init__(self, root: str | os.PathLike[str], *, update_missing: bool = False) -> None:
        self.root = Path(root)
        self.update_missing = update_missing
        self.written: list[Path] = []
        self._cache: dict[str, tuple[tuple[float, float], Reference]] = {}

    def __repr__(self) -> str:
        return f"RefStore({str(self.root)!r}, update_missing={self.update_missing})"

    def _paths(self, name: str) -> tuple[Path, Path]:
        if not _NAME.match(name) or ".." in name.split("/"):
            raise ReferenceInvalid(
                f"reference name {name!r}: use letters, digits, '_', '-', '.', and '/' "
                "between parts (no '..', no leading '/')"
            )
        return self.root / f"{name}.png", self.root / f"{name}.json"

    def exists(self, name: str) -> bool:
        """Whether ``<root>/<name>.png`` exists."""
        return self._paths(name)[0].is_file()

    def load(self, name: str) -> Reference:
        """The reference ``name`` (cached until its files change).

        Raises:
            ReferenceMissing: no PNG (the message says how to write one).
            ReferenceInvalid: unreadable PNG, malformed JSON, areas outside the image.
        """
        png, spec_file = self._paths(name)
        try:
            png_mtime = png.stat().st_mtime
        except FileNotFoundError:
            raise ReferenceMissing(
                f"no reference {name!r}: {png} does not exist (run pytest with "
                "--deskvm-update-refs to write it from the screen, then check and crop it)"
            ) from None
        json_mtime = spec_file.stat().st_mtime if spec_file.is_file() else 0.0
        cached = self._cache.get(name)
        if cached is not None and cached[0] == (png_mtime, json_mtime):
            return cached[1]
        pixels = decode_png(png.read_bytes(), where=str(png))
        spec = RefSpec()
        if json_mtime:
            try:
                obj = json.loads(spec_file.read_text(encoding="utf-8"))
            except (ValueError, OSError) as exc:
                raise ReferenceInvalid(f"{spec_file}: not valid JSON ({exc})") from exc
            if not isinstance(obj, dict):
                raise ReferenceInvalid(f"{spec_file}: must hold a JSON object")
            spec = spec_from_json(obj, where=str(spec_file))
        ref = Reference(name, pixels, spec, str(png))
        self._cache[name] = ((png_mtime, json_mtime), ref)
        return ref

    def write_new(
        self,
        name: str,
        pixels: np.ndarray[Any, np.dtype[np.uint8]],
        *,
        region: Box | None = None,
        source: str | None = None,
        spec: RefSpec | None = None,
    ) -> Path:
        """Write a new reference: the whole frame as PNG and, with a ``region`` (or a
        ``spec``), a JSON naming the match area.

        Never replaces an existing file: the PNG is created exclusively (``O_EXCL``).

        Returns:
            The PNG's path.

        Raises:
            ReferenceInvalid: the reference (PNG or JSON) already exists, or cannot be
                written.
        """
        png, spec_file = self._paths(name)
        if spec is None and region is not None:
            spec = RefSpec(match=(Area(region),))
        Reference(name, pixels, spec or RefSpec())  # validates the areas against the image
        data = encode_png(pixels)
        try:
            png.parent.mkdir(parents=True, exist_ok=True)
            if spec is not None and spec_file.exists():
                raise FileExistsError(spec_file)
            with png.open("xb") as f:
                f.write(data)
            if spec is not None:
                with spec_file.open("x", encoding="utf-8") as f:
                    f.write(json.dumps(spec_to_json(spec, source=source), indent=2) + "\n")
        except FileExistsError as exc:
            raise ReferenceInvalid(
                f"reference {name!r} already exists ({exc.args[0] if exc.args else png}); "
                "references are never overwritten: delete it first to record it again"
            ) from None
        except OSError as exc:
            raise ReferenceInvalid(f"cannot write reference {name!r} to {png}: {exc}") from exc
        self.written.append(png)
        return png
