"""The matching core: frames in, matches out. Pure (numpy arrays, OpenCV, scikit-image).

Nothing here touches the network, the disk or the clock; :mod:`agent_bridge.qa.waits`
drives it with frames and :mod:`agent_bridge.qa.refs` loads references from files.

Arrays are ``(height, width, 3)`` uint8 **RGB** in display pixels.

How a reference is found (:func:`find`):

1. Each *match area* of the reference (default: the whole reference image) is cut out of
   the reference image; the reference's *exclude areas* become zeros of a mask.
2. The area is searched in a window of the frame: the whole frame, or, with a
   ``margin_px``, the area's own position grown by that margin (clipped to ``region`` when
   one is given). The search is OpenCV ``matchTemplate`` on grey levels with
   ``TM_CCOEFF_NORMED`` (normalised cross-correlation: 1 = identical up to brightness and
   contrast); for a flat area (one colour: correlation is undefined there) ``TM_SQDIFF``.
   The few best grey-level positions (peaks within 0.1 of the best) go on to step 3.
3. Each is scored **in colour**; the best score wins. The score is the lower of
   - the colour ``TM_CCOEFF_NORMED`` of the area, clipped to 0..1 (shape), and
   - ``1 - RMS / 255`` of the area's *worst* 24x24 tile, RMS being the root mean square
     colour error (appearance: a red button is not a green one of the same brightness,
     and "12:00" is not "12:59" even inside a large dialog, which a correlation over
     the whole area would forgive).
   A flat area takes only the second. Excluded pixels and ``ignore`` boxes (the pointer)
   count in neither.
4. The reference matches when every area's score reaches its threshold; its score is the
   lowest area score, its box the union of the areas' boxes.

Screens of a VM are pixel-exact: the same state draws the same pixels, so the default
threshold 0.95 tolerates roughly two wholly different pixels per 24x24 tile (or a shift of
brightness by 12 levels) and nothing more; exclude what legitimately changes (clocks,
cursors) rather than lowering thresholds.

Change and stillness (:func:`changed`, :func:`similarity`): a pixel *changed* when any
channel moved by more than ``level`` (absolute difference, OpenCV); *stillness* is the
structural similarity (SSIM, scikit-image) of grey levels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from agent_bridge.qa.errors import ReferenceInvalid
from agent_bridge.qa.model import Box, Point

if TYPE_CHECKING:
    import numpy.typing as npt

    Pixels = npt.NDArray[np.uint8]

__all__ = [
    "DEFAULT_THRESHOLD",
    "Area",
    "AreaHit",
    "Candidate",
    "RefSpec",
    "Reference",
    "annotate",
    "changed",
    "crop",
    "diff_overlay",
    "find",
    "similarity",
]

DEFAULT_THRESHOLD = 0.95
_FLAT_STD = 2.0  # grey levels: below this an area counts as flat (one colour)


@dataclass(frozen=True, slots=True)
class Area:
    """A match area of a reference, in reference-image pixels.

    Attributes:
        box: where in the reference image.
        threshold: this area's own minimum score (0..1); ``None``: the reference's.
    """

    box: Box
    threshold: float | None = None


@dataclass(frozen=True, slots=True)
class RefSpec:
    """How a reference image is matched (``refs/<name>.json``; every field optional).

    Attributes:
        match: the areas that must match; empty: the whole image is one area.
        exclude: areas ignored inside match areas (clocks, cursors, counters).
        threshold: minimum score 0..1 of each match area.
        margin_px: search only this far around each area's position in the image
            (the image is then a full screen, as ``--deskvm-update-refs`` and imported
            needles write it); ``None``: search the whole screen.
        click: where ``click(ref)`` clicks, in reference-image pixels (moved with the
            match); ``None``: the centre of the matched box.
        tags: free labels (an imported needle's tags).
        ocr: areas a needle marked for OCR (kept for reference; not matched).
    """

    match: tuple[Area, ...] = ()
    exclude: tuple[Box, ...] = ()
    threshold: float = DEFAULT_THRESHOLD
    margin_px: int | None = None
    click: Point | None = None
    tags: tuple[str, ...] = ()
    ocr: tuple[Box, ...] = ()


@dataclass(frozen=True, eq=False)
class Reference:
    """A named reference image with its matching rules.

    Attributes:
        name: what tests call it (``refs/<name>.png``).
        pixels: ``(height, width, 3)`` uint8 RGB.
        spec: areas, threshold, margin, click point.
        path: where it was loaded from (for messages), if from a file.

    Raises:
        ReferenceInvalid: (on construction) an area or the click point lies outside the
            image, a threshold is outside 0..1, a match area is wholly excluded.
    """

    name: str
    pixels: Pixels = field(repr=False)
    spec: RefSpec = RefSpec()
    path: str | None = None

    def __post_init__(self) -> None:
        where = self.path or self.name
        if self.pixels.ndim != 3 or self.pixels.shape[2] != 3 or self.pixels.dtype != np.uint8:
            raise ReferenceInvalid(f"{where}: reference pixels must be (h, w, 3) uint8 RGB")
        image = Box(0, 0, self.width, self.height)
        for area in self.areas:
            if area.box.area_px == 0 or area.box.intersection(image) != area.box:
                raise ReferenceInvalid(
                    f"{where}: match area {area.box} is not inside the {self.width}x"
                    f"{self.height} reference image"
                )
            if not _mask(self, area).any():
                raise ReferenceInvalid(f"{where}: match area {area.box} is wholly excluded")
        for threshold in (self.spec.threshold, *(a.threshold for a in self.spec.match)):
            if threshold is not None and not 0.0 <= threshold <= 1.0:
                raise ReferenceInvalid(f"{where}: threshold {threshold} is not within 0..1")
        if self.spec.margin_px is not None and self.spec.margin_px < 0:
            raise ReferenceInvalid(f"{where}: margin_px must be >= 0")
        click = self.spec.click
        if click is not None and not image.contains(click):
            raise ReferenceInvalid(f"{where}: click point {click} is outside the image")

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def areas(self) -> tuple[Area, ...]:
        """The match areas (the whole image when the spec names none)."""
        return self.spec.match or (Area(Box(0, 0, self.width, self.height)),)

    @classmethod
    def from_frame(
        cls, name: str, pixels: Pixels, region: Box | None = None, *, path: str | None = None
    ) -> Reference:
        """A reference of a whole frame (``region`` becomes its one match area)."""
        spec = RefSpec(match=(Area(region),)) if region is not None else RefSpec()
        return cls(name, np.ascontiguousarray(pixels), spec, path)


@dataclass(frozen=True, slots=True)
class AreaHit:
    """One match area's best position on a frame.

    Attributes:
        area: the area (reference-image pixels).
        box: where it was found (display pixels).
        score: its colour score 0..1 there.
        threshold: the score it needed.
    """

    area: Area
    box: Box
    score: float
    threshold: float

    @property
    def ok(self) -> bool:
        return self.score >= self.threshold


@dataclass(frozen=True, slots=True)
class Candidate:
    """A reference's best position on one frame (matching or not).

    Attributes:
        hits: one per match area, in the reference's order.
        click_point: where a click on it lands, display pixels.
    """

    hits: tuple[AreaHit, ...]
    click_point: Point

    @property
    def score(self) -> float:
        """The lowest area score."""
        return min(h.score for h in self.hits)

    @property
    def ok(self) -> bool:
        """Every area reached its threshold."""
        return all(h.ok for h in self.hits)

    @property
    def box(self) -> Box:
        return Box.union([h.box for h in self.hits])


def crop(pixels: Pixels, box: Box) -> Pixels:
    """``pixels`` inside ``box`` (a view, clipped to the image)."""
    return pixels[max(box.y, 0) : max(box.y1, 0), max(box.x, 0) : max(box.x1, 0)]


def _grey(pixels: Pixels) -> Pixels:
    return np.asarray(cv2.cvtColor(pixels, cv2.COLOR_RGB2GRAY), dtype=np.uint8)


def _mask(ref: Reference, area: Area) -> Pixels:
    """1 where the area counts, 0 where an exclude area covers it."""
    mask = np.ones((area.box.height, area.box.width), dtype=np.uint8)
    for excluded in ref.spec.exclude:
        overlap = excluded.intersection(area.box)
        if overlap is not None:
            local = overlap.shifted(-area.box.x, -area.box.y)
            mask[local.y : local.y1, local.x : local.x1] = 0
    return mask


_TILE_PX = 24
_PEAKS = 5
_PEAK_SPREAD = 0.1


def _worst_tile(error: npt.NDArray[np.float64], keep: npt.NDArray[np.bool_]) -> float:
    """``1 - RMS/255`` of the worst tile of a per-pixel squared-error map (masked)."""
    h, w = error.shape
    th, tw = min(_TILE_PX, h), min(_TILE_PX, w)
    ph, pw = -h % th, -w % tw
    err = np.pad(np.where(keep, error, 0.0), ((0, ph), (0, pw)))
    cnt = np.pad(keep.astype(np.float64), ((0, ph), (0, pw)))
    shape = (err.shape[0] // th, th, err.shape[1] // tw, tw)
    sums = err.reshape(shape).sum(axis=(1, 3))
    counts = cnt.reshape(shape).sum(axis=(1, 3))
    valid = counts >= 0.25 * th * tw
    if not valid.any():
        valid = counts > 0
    if not valid.any():
        return 0.0
    worst_mse = float((sums[valid] / counts[valid]).max())
    return max(0.0, 1.0 - float(np.sqrt(worst_mse)) / 255.0)


def _colour_score(patch: Pixels, template: Pixels, mask: Pixels, flat: bool) -> float:
    keep = mask.astype(bool)
    diff = patch.astype(np.float64) - template.astype(np.float64)
    appearance = _worst_tile((diff * diff).mean(axis=2), keep)
    if flat:
        return appearance
    masked = None if mask.all() else mask
    result = cv2.matchTemplate(patch, template, cv2.TM_CCOEFF_NORMED, mask=masked)
    shape = float(np.nan_to_num(result, nan=0.0, posinf=0.0, neginf=0.0).max())
    return min(appearance, min(1.0, max(0.0, shape)))


def _peaks(result: npt.NDArray[Any], flat: bool, size: tuple[int, int]) -> list[tuple[int, int]]:
    """The best positions of a matchTemplate result: the best, and up to ``_PEAKS - 1``
    more within ``_PEAK_SPREAD`` of it, at least a template apart (non-maximum
    suppression)."""
    work = -result if flat else result.copy()
    w, h = size
    out: list[tuple[int, int]] = []
    best: float | None = None
    for _ in range(_PEAKS):
        _, value, _, (x, y) = cv2.minMaxLoc(work)
        if best is None:
            best = value
        elif value < best - (_PEAK_SPREAD if not flat else abs(best) * _PEAK_SPREAD + 1.0):
            break
        out.append((int(x), int(y)))
        work[max(0, y - h // 2) : y + h // 2 + 1, max(0, x - w // 2) : x + w // 2 + 1] = -np.inf
    return out


def _search_window(ref: Reference, area: Area, width: int, height: int, region: Box | None) -> Box:
    window = Box(0, 0, width, height)
    if ref.spec.margin_px is not None:
        window = area.box.grown(ref.spec.margin_px).intersection(window) or Box(0, 0, 0, 0)
    if region is not None:
        window = window.intersection(region) or Box(0, 0, 0, 0)
    return window


def find(
    pixels: Pixels, ref: Reference, region: Box | None = None, ignore: Sequence[Box] = ()
) -> Candidate:
    """The best position of ``ref`` on a frame (see the module docstring for how).

    Args:
        pixels: the frame, ``(height, width, 3)`` uint8 RGB.
        ref: the reference.
        region: only look inside this box (display pixels); ``None``: everywhere the
            reference's margin allows.
        ignore: frame boxes left out of the score at the best position (the pointer:
            a cursor drawn over a button does not make it a different button).

    Returns:
        The best candidate; ``candidate.ok`` says whether it matches. An area that cannot
        fit in its search window scores 0 at its own position.
    """
    height, width = pixels.shape[:2]
    grey = _grey(pixels)
    hits: list[AreaHit] = []
    for area in ref.areas:
        threshold = area.threshold if area.threshold is not None else ref.spec.threshold
        template = crop(ref.pixels, area.box)
        mask = _mask(ref, area)
        window = _search_window(ref, area, width, height, region)
        if window.width < area.box.width or window.height < area.box.height:
            hits.append(AreaHit(area, area.box, 0.0, threshold))
            continue
        template_grey = _grey(np.ascontiguousarray(template))
        flat = float(template_grey[mask.astype(bool)].std()) < _FLAT_STD
        masked = None if mask.all() else mask
        result = cv2.matchTemplate(
            crop(grey, window),
            template_grey,
            cv2.TM_SQDIFF if flat else cv2.TM_CCOEFF_NORMED,
            mask=masked,
        )
        bad = np.inf if flat else -1.0
        result = np.nan_to_num(result, nan=bad, posinf=bad, neginf=-1.0 if not flat else bad)
        best: AreaHit | None = None
        contiguous = np.ascontiguousarray(template)
        for x, y in _peaks(result, flat, (area.box.width, area.box.height)):
            box = Box(window.x + x, window.y + y, area.box.width, area.box.height)
            patch = np.ascontiguousarray(crop(pixels, box))
            score_mask = _without(mask, box, ignore)
            if not score_mask.any():
                score_mask = mask
            score = _colour_score(patch, contiguous, score_mask, flat)
            if best is None or score > best.score:
                best = AreaHit(area, box, score, threshold)
        assert best is not None
        hits.append(best)
    return Candidate(tuple(hits), _click_point(ref, hits))


def _without(mask: Pixels, at: Box, ignore: Sequence[Box]) -> Pixels:
    """``mask`` (of a patch at ``at`` on the frame) with the ``ignore`` boxes zeroed."""
    out = mask
    for box in ignore:
        overlap = box.intersection(at)
        if overlap is not None:
            if out is mask:
                out = mask.copy()
            local = overlap.shifted(-at.x, -at.y)
            out[local.y : local.y1, local.x : local.x1] = 0
    return out


def _click_point(ref: Reference, hits: list[AreaHit]) -> Point:
    click = ref.spec.click
    if click is None:
        return Box.union([h.box for h in hits]).center
    # Move the click point with the area that holds it (else with the first area).
    hit = next((h for h in hits if h.area.box.contains(click)), hits[0])
    return Point(click.x + hit.box.x - hit.area.box.x, click.y + hit.box.y - hit.area.box.y)


def changed(
    before: Pixels,
    after: Pixels,
    region: Box | None = None,
    *,
    level: int = 24,
    ignore: Sequence[Box] = (),
) -> tuple[int, Box | None]:
    """How many pixels differ between two frames, and the box around them.

    Args:
        before, after: same-sized frames.
        region: only compare inside this box.
        level: a pixel changed when a channel moved by more than this (0..255).
        ignore: boxes not compared (the pointer before and after).

    Returns:
        ``(changed_px, box)``; ``box`` is ``None`` when nothing changed. A size change
        counts as every pixel changed.
    """
    if before.shape != after.shape:
        h, w = after.shape[:2]
        return h * w, Box(0, 0, w, h)
    offset = Box(0, 0, before.shape[1], before.shape[0])
    if region is not None:
        offset = region.intersection(offset) or Box(0, 0, 0, 0)
    a, b = crop(before, offset), crop(after, offset)
    if a.size == 0:
        return 0, None
    diff = cv2.absdiff(np.ascontiguousarray(a), np.ascontiguousarray(b)).max(axis=2)
    moved = _without(np.asarray(diff > level, dtype=np.uint8), offset, ignore)
    count = int(cv2.countNonZero(moved))
    if count == 0:
        return 0, None
    x, y, w, h = cv2.boundingRect(moved)
    return count, Box(offset.x + x, offset.y + y, w, h)


def similarity(a: Pixels, b: Pixels, region: Box | None = None) -> float:
    """Structural similarity (SSIM, scikit-image) of two frames' grey levels, 0..1.

    Frames larger than 640 pixels on their long edge are halved first (INTER_AREA):
    the verdict is the same and it is four times cheaper. Different sizes give 0.
    """
    from skimage.metrics import structural_similarity  # scipy: 0.3 s to import, load late

    if a.shape != b.shape:
        return 0.0
    if region is not None:
        box = region.intersection(Box(0, 0, a.shape[1], a.shape[0]))
        if box is None:
            return 1.0
        a, b = crop(a, box), crop(b, box)
    ga, gb = _grey(np.ascontiguousarray(a)), _grey(np.ascontiguousarray(b))
    if max(ga.shape) > 640:
        size = (ga.shape[1] // 2, ga.shape[0] // 2)
        ga = np.asarray(cv2.resize(ga, size, interpolation=cv2.INTER_AREA), dtype=np.uint8)
        gb = np.asarray(cv2.resize(gb, size, interpolation=cv2.INTER_AREA), dtype=np.uint8)
    if min(ga.shape) < 7:  # SSIM's window is 7x7
        return 1.0 if np.array_equal(ga, gb) else 0.0
    value = structural_similarity(ga, gb, data_range=255)  # type: ignore[no-untyped-call]
    return max(0.0, min(1.0, float(value)))


_GREEN = (40, 200, 70)
_RED = (230, 40, 40)
_AMBER = (250, 180, 0)


def annotate(pixels: Pixels, boxes: list[tuple[Box, tuple[int, int, int]]]) -> Pixels:
    """A copy of ``pixels`` with each box outlined (2 px) in its RGB colour."""
    out = np.ascontiguousarray(pixels.copy())
    for box, colour in boxes:
        cv2.rectangle(out, (box.x - 1, box.y - 1), (box.x1, box.y1), colour, 2)
    return out


def diff_overlay(
    pixels: Pixels, ref: Reference, candidate: Candidate, *, level: int = 40
) -> Pixels:
    """The frame dimmed, each match area's best position shown at full brightness with the
    pixels that differ from the reference painted red, outlined green (area matched) or
    red (area failed). Excluded pixels are painted amber."""
    out = (pixels.astype(np.uint16) * 2 // 5).astype(np.uint8)
    boxes: list[tuple[Box, tuple[int, int, int]]] = []
    for hit in candidate.hits:
        box = hit.box.clipped(pixels.shape[1], pixels.shape[0])
        if box is None:
            continue
        local = box.shifted(-hit.box.x, -hit.box.y)
        template = crop(crop(ref.pixels, hit.area.box), local)
        patch = crop(pixels, box)
        mask = crop(_mask(ref, hit.area)[..., None], local)[..., 0].astype(bool)
        differs = (cv2.absdiff(np.ascontiguousarray(patch), np.ascontiguousarray(template))
                   .max(axis=2) > level)  # fmt: skip
        region = out[box.y : box.y1, box.x : box.x1]
        region[...] = patch
        region[differs & mask] = _RED
        region[~mask] = _AMBER
        boxes.append((box, _GREEN if hit.ok else _RED))
    return annotate(out, boxes)
