"""Failure reports: expected / actual / diff images side by side, and one HTML page.

:func:`write_report` turns what a failed test saw (the :class:`Evidence` of a failed check,
the last frame, the recording's path) into files in one directory::

    report.html        self-contained (images inline as data: URIs): open it anywhere
    expected.png       the reference with its areas outlined (or the "before" frame)
    actual.png         the frame the verdict rests on, best candidate outlined
    diff.png           where they differ (see agent_bridge.qa.match.diff_overlay)
    expected-area.png, actual-area.png, diff-area.png
                       the same three cut to the worst match area (reference checks)
    side-by-side.png   three in one image (the close-up when there is one), for CI
                       servers that show one attachment
    last-frame.png     the screen when the test failed

It returns the paths and the figures (best score, where, frame number and time, recording)
that the pytest plugin writes into JUnit XML as properties and attachments.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from agent_bridge.qa.errors import Evidence
from agent_bridge.qa.match import annotate, changed, crop, diff_overlay
from agent_bridge.qa.model import Box, Frame
from agent_bridge.qa.refs import encode_png

__all__ = ["Report", "write_report"]

_GREEN = (40, 200, 70)
_RED = (230, 40, 40)
_AMBER = (250, 180, 0)
_BLUE = (40, 120, 240)
_PANEL_HEIGHT_PX = 400
_CONTEXT_PX = 12  # around an area in the close-up panels


@dataclass(frozen=True)
class Report:
    """What :func:`write_report` wrote.

    Attributes:
        html: the report page.
        images: every PNG written, by role (``expected``, ``actual``, ``diff``,
            ``side_by_side``, ``last_frame``).
        properties: ``name -> value`` facts for JUnit XML (``deskvm_best_score``...).
    """

    html: Path
    images: Mapping[str, Path]
    properties: Mapping[str, str] = field(default_factory=dict)


def _png_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _panel(pixels: np.ndarray[Any, np.dtype[np.uint8]], label: str) -> np.ndarray[Any, Any]:
    """``pixels`` scaled to the panel height, a caption band above."""
    h, w = pixels.shape[:2]
    scale = _PANEL_HEIGHT_PX / max(h, 1)
    size = (max(1, round(w * scale)), _PANEL_HEIGHT_PX)
    interpolation = cv2.INTER_NEAREST if scale > 1 else cv2.INTER_AREA
    body = cv2.resize(pixels, size, interpolation=interpolation)
    band = np.full((28, size[0], 3), 255, dtype=np.uint8)
    cv2.putText(band, label, (6, 20), cv2.FONT_HERSHEY_SIMPLEX, 0.6, (0, 0, 0), 1, cv2.LINE_AA)
    return np.vstack([band, body])


def _side_by_side(panels: Sequence[tuple[str, np.ndarray[Any, Any]]]) -> np.ndarray[Any, Any]:
    parts: list[np.ndarray[Any, Any]] = []
    for label, pixels in panels:
        if parts:
            parts.append(np.full((_PANEL_HEIGHT_PX + 28, 8, 3), 255, dtype=np.uint8))
        parts.append(_panel(pixels, label))
    return np.hstack(parts)


def _crop_padded(pixels: np.ndarray[Any, Any], box: Box) -> np.ndarray[Any, Any]:
    """``box`` of ``pixels``; the parts outside the image are grey."""
    out = np.full((box.height, box.width, 3), 128, dtype=np.uint8)
    inside = box.clipped(pixels.shape[1], pixels.shape[0])
    if inside is not None:
        local = inside.shifted(-box.x, -box.y)
        out[local.y : local.y1, local.x : local.x1] = crop(pixels, inside)
    return out


def _images_for(evidence: Evidence) -> dict[str, np.ndarray[Any, Any]]:
    """expected / actual / diff arrays for one piece of evidence."""
    out: dict[str, np.ndarray[Any, Any]] = {}
    frame, ref, cand = evidence.frame, evidence.reference, evidence.candidate
    region_box: list[tuple[Box, tuple[int, int, int]]] = (
        [(evidence.region, _BLUE)] if evidence.region is not None else []
    )
    if ref is not None:
        marks = [(a.box, _GREEN) for a in ref.areas] + [(b, _AMBER) for b in ref.spec.exclude]
        expected = annotate(ref.pixels, marks)
        if ref.spec.click is not None:
            c = ref.spec.click
            cv2.drawMarker(expected, (c.x, c.y), _RED, cv2.MARKER_CROSS, 12, 2)
        out["expected"] = expected
        if frame is not None and cand is not None:
            colour = _GREEN if cand.ok else _RED
            out["actual"] = annotate(frame.pixels, [*region_box, (cand.box, colour)])
            out["diff"] = diff_overlay(frame.pixels, ref, cand)
            # A closer look at the worst area: the reference's pixels, the frame's at the
            # best position, and the difference, each with a little context around.
            hit = min(cand.hits, key=lambda h: h.score - h.threshold)
            pad = _CONTEXT_PX
            out["expected_area"] = _crop_padded(expected, hit.area.box.grown(pad))
            out["actual_area"] = _crop_padded(frame.pixels, hit.box.grown(pad))
            out["diff_area"] = _crop_padded(out["diff"], hit.box.grown(pad))
    elif evidence.before is not None and frame is not None:
        out["expected"] = annotate(evidence.before.pixels, region_box)
        out["actual"] = annotate(frame.pixels, region_box)
        _, box = changed(evidence.before.pixels, frame.pixels, evidence.region, level=0)
        moved = cv2.absdiff(evidence.before.pixels, frame.pixels).max(axis=2) > 0
        diff = (frame.pixels.astype(np.uint16) * 2 // 5).astype(np.uint8)
        diff[moved] = _RED
        out["diff"] = annotate(diff, [*region_box, *([(box, _AMBER)] if box else [])])
    elif frame is not None:
        words = [(w.box, _BLUE) for w in evidence.words]
        out["actual"] = annotate(frame.pixels, [*region_box, *words])
    return out


def _facts(evidence: Evidence, recording: str | None) -> list[tuple[str, str]]:
    facts: list[tuple[str, str]] = [("check", evidence.kind)]
    cand, frame = evidence.candidate, evidence.frame
    if evidence.reference is not None:
        facts.append(("reference", evidence.reference.path or evidence.reference.name))
    if cand is not None:
        facts.append(("best score", f"{cand.score:.4f}"))
        for i, hit in enumerate(cand.hits):
            verdict = "ok" if hit.ok else "below threshold"
            facts.append(
                (
                    f"area {i + 1} ({hit.area.box.width}x{hit.area.box.height})",
                    f"score {hit.score:.4f} / threshold {hit.threshold:g} ({verdict}), "
                    f"best position ({hit.box.x}, {hit.box.y}); in the reference at "
                    f"({hit.area.box.x}, {hit.area.box.y})",
                )
            )
    if evidence.region is not None:
        facts.append(("region", str(evidence.region)))
    if evidence.before is not None:
        facts.append(("before", evidence.before.where()))
    if frame is not None:
        facts.append(("frame", frame.where()))
    for key, value in evidence.details.items():
        facts.append((key, str(value)))
    if recording:
        facts.append(("recording", recording))
        if frame is not None and frame.t_s is not None:
            facts.append(("see it", f"deskvm replay frames {recording} --at {frame.t_s:.3f}s"))
    return facts


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.5em}
pre{background:#f5f5f5;padding:.8em;overflow:auto;white-space:pre-wrap}
table{border-collapse:collapse}
td{border-bottom:1px solid #ddd;padding:.25em .8em;vertical-align:top}
td:first-child{color:#555;white-space:nowrap}
.row{display:flex;gap:12px;align-items:flex-start;flex-wrap:wrap}
figure{margin:0;flex:1 1 30%;min-width:240px} figure img{width:100%;image-rendering:pixelated;
border:1px solid #ccc} figcaption{font-weight:600;margin-bottom:.3em}
""".strip()


def write_report(
    out_dir: Path,
    *,
    test_id: str,
    message: str,
    evidence: Sequence[Evidence] = (),
    last_frame: Frame | None = None,
    recording: str | None = None,
    session_id: str | None = None,
    notes: Sequence[str] = (),
) -> Report:
    """Write the failure report of one test into ``out_dir`` (created).

    Args:
        out_dir: the test's artifact directory.
        test_id: pytest node id.
        message: the failure (exception text or pytest's short report).
        evidence: what failed checks saw (first is the main one), maybe none.
        last_frame: the screen when the test failed.
        recording: the session's recording directory (on the server host).
        session_id: the session.
        notes: more lines for the page (e.g. "recording deleted: --deskvm-record off").

    Returns:
        The files written and the JUnit properties.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    images: dict[str, Path] = {}
    sections: list[str] = []
    properties: dict[str, str] = {}
    for index, item in enumerate(evidence):
        prefix = "" if index == 0 else f"check{index + 1}-"
        arrays = _images_for(item)
        figures: list[str] = []
        labels = {
            "expected": "expected",
            "actual": "actual",
            "diff": "difference",
            "expected_area": "expected (the area)",
            "actual_area": "actual (at the best position)",
            "diff_area": "difference (red: differs, amber: excluded)",
        }
        if item.kind in ("change", "still"):
            labels.update(expected="before", actual="after")
        close_up = ("expected_area", "actual_area", "diff_area")
        rows: list[str] = []
        for roles in (close_up, ("expected", "actual", "diff")):
            row: list[str] = []
            for role in roles:
                if role not in arrays:
                    continue
                png = encode_png(np.ascontiguousarray(arrays[role]))
                path = out_dir / f"{prefix}{role.replace('_', '-')}.png"
                path.write_bytes(png)
                images[f"{prefix}{role}"] = path
                row.append(
                    f'<figure><figcaption>{labels[role]}</figcaption><a href="{path.name}">'
                    f'<img alt="{labels[role]}" src="{_png_uri(png)}"></a></figure>'
                )
            if row:
                rows.append(f'<div class="row">{"".join(row)}</div>')
        figures.extend(rows)
        shown = close_up if "expected_area" in arrays else ("expected", "actual", "diff")
        panels = [(labels[r].split(" (")[0], arrays[r]) for r in shown if r in arrays]
        if len(panels) > 1:
            path = out_dir / f"{prefix}side-by-side.png"
            path.write_bytes(encode_png(np.ascontiguousarray(_side_by_side(panels))))
            images[f"{prefix}side_by_side"] = path
        facts = _facts(item, recording)
        fact_rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in facts
        )
        sections.append(
            f"<h2>{html.escape(item.title)}</h2><table>{fact_rows}</table>{''.join(figures)}"
        )
        if item.words:
            read = " ".join(w.text for w in item.words)
            sections.append(f"<h3>OCR read</h3><pre>{html.escape(read)}</pre>")
        if index == 0:
            properties.update(_properties(item))
    if last_frame is not None:
        png = last_frame.png or encode_png(last_frame.pixels)
        path = out_dir / "last-frame.png"
        path.write_bytes(png)
        images["last_frame"] = path
        sections.append(
            f"<h2>The screen when the test failed ({html.escape(last_frame.where())})</h2>"
            f'<div class="row"><figure><a href="{path.name}"><img alt="last frame" '
            f'src="{_png_uri(png)}"></a></figure></div>'
        )
    if recording:
        properties["deskvm_recording"] = recording
    if session_id:
        properties["deskvm_session"] = session_id
    head = [("test", test_id), ("session", session_id or "-"), ("recording", recording or "-")]
    head_rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in head
    )
    note_html = "".join(f"<p>{html.escape(n)}</p>" for n in notes)
    page = (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>deskvm: {html.escape(test_id)} failed</title><style>{_CSS}</style></head>"
        f"<body><h1>{html.escape(test_id)} failed</h1><table>{head_rows}</table>{note_html}"
        f"<pre>{html.escape(message)}</pre>{''.join(sections)}</body></html>\n"
    )
    report_path = out_dir / "report.html"
    report_path.write_text(page, encoding="utf-8")
    properties["deskvm_report"] = str(report_path)
    for role, path in images.items():
        properties[f"deskvm_{role}"] = str(path)
    return Report(report_path, images, properties)


def _properties(evidence: Evidence) -> dict[str, str]:
    out = {"deskvm_check": evidence.kind, "deskvm_failure": evidence.title}
    if evidence.candidate is not None:
        out["deskvm_best_score"] = f"{evidence.candidate.score:.4f}"
        b = evidence.candidate.box
        out["deskvm_best_box"] = f"{b.x},{b.y},{b.x1},{b.y1}"
    frame = evidence.frame
    if frame is not None:
        if frame.frame_seq is not None:
            out["deskvm_frame_seq"] = str(frame.frame_seq)
        if frame.t_s is not None:
            out["deskvm_t_s"] = f"{frame.t_s:.3f}"
    return out
