"""Values of deskvm's visual QA layer: boxes, frames, matches, text. Pure, no I/O.

Coordinates are **display pixels, origin top-left** (the coordinates ``click`` and ``zoom``
take). A :class:`Box` is ``x, y, width, height``; a *region* argument anywhere in the QA
API is a :class:`Box` or a 4-sequence ``(x0, y0, x1, y1)`` with ``x1``/``y1`` exclusive,
exactly like the ``zoom`` action's ``region``.

Times: ``t_s`` is seconds since the recording's monotonic origin (the time
``deskvm replay frames PATH --at 12.5s`` takes); ``frame_seq`` is the sequence number of
the recording's ``frame`` event the pixels came from (see docs/recording.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from orchestrator.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Box",
    "Change",
    "Frame",
    "Match",
    "Point",
    "RegionLike",
    "Still",
    "TextBox",
    "TextReading",
    "as_box",
    "pointer_box",
]


DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Point:
    """A point in display pixels."""

    x: int
    y: int


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned rectangle in display pixels.

    Attributes:
        x: left edge (inclusive).
        y: top edge (inclusive).
        width: pixels, >= 0.
        height: pixels, >= 0.
    """

    x: int
    y: int
    width: int
    height: int

    @property
    def x1(self) -> int:
        """Right edge, exclusive."""
        return self.x + self.width

    @property
    def y1(self) -> int:
        """Bottom edge, exclusive."""
        return self.y + self.height

    @property
    def center(self) -> Point:
        """The middle pixel (rounded down)."""
        return Point(self.x + self.width // 2, self.y + self.height // 2)

    @property
    def area_px(self) -> int:
        return max(0, self.width) * max(0, self.height)

    def as_region(self) -> tuple[int, int, int, int]:
        """``(x0, y0, x1, y1)``, x1/y1 exclusive (the ``zoom`` action's ``region``)."""
        return (self.x, self.y, self.x1, self.y1)

    def shifted(self, dx: int, dy: int) -> Box:
        return Box(self.x + dx, self.y + dy, self.width, self.height)

    def grown(self, margin_px: int) -> Box:
        """This box with ``margin_px`` added on every side."""
        m = margin_px
        return Box(self.x - m, self.y - m, self.width + 2 * m, self.height + 2 * m)

    def intersection(self, other: Box) -> Box | None:
        """The overlap of both boxes, ``None`` when they do not overlap."""
        x0, y0 = max(self.x, other.x), max(self.y, other.y)
        x1, y1 = min(self.x1, other.x1), min(self.y1, other.y1)
        if x1 <= x0 or y1 <= y0:
            return None
        return Box(x0, y0, x1 - x0, y1 - y0)

    def clipped(self, width_px: int, height_px: int) -> Box | None:
        """This box cut to a ``width_px`` x ``height_px`` screen (``None`` if outside)."""
        return self.intersection(Box(0, 0, width_px, height_px))

    def contains(self, point: Point) -> bool:
        return self.x <= point.x < self.x1 and self.y <= point.y < self.y1

    @staticmethod
    def union(boxes: Sequence[Box]) -> Box:
        """The smallest box holding every box of a non-empty sequence."""
        if not boxes:
            raise ValueError("union of no boxes")
        x0 = min(b.x for b in boxes)
        y0 = min(b.y for b in boxes)
        x1 = max(b.x1 for b in boxes)
        y1 = max(b.y1 for b in boxes)
        return Box(x0, y0, x1 - x0, y1 - y0)

    def __str__(self) -> str:
        return f"{self.width}x{self.height} at ({self.x}, {self.y})"


RegionLike: TypeAlias = Box | Sequence[int]


def pointer_box(point: Point) -> Box:
    """Where the cursor image may be drawn when the pointer's hotspot is at ``point``.

    40x44 px around the hotspot (16 px up and left, 24/28 px right and down): X cursors at
    their default size fit in it, both those pointing up-left from the hotspot
    (``left_ptr``) and those centred on it (xterm's I-beam, ``hand2``, ``fleur``).
    """
    return Box(point.x - 16, point.y - 16, 40, 44)


def as_box(region: RegionLike) -> Box:
    """A :class:`Box` from a box or an ``(x0, y0, x1, y1)`` sequence (x1/y1 exclusive).

    Raises:
        ConfigError: not four integers, or an empty rectangle.
    """
    if isinstance(region, Box):
        box = region
    else:
        values = list(region)
        if len(values) != 4 or not all(isinstance(v, int) for v in values):
            raise ConfigError(
                f"a region is a Box or (x0, y0, x1, y1) in display pixels, got {region!r}"
            )
        x0, y0, x1, y1 = values
        box = Box(x0, y0, x1 - x0, y1 - y0)
    if box.width <= 0 or box.height <= 0:
        raise ConfigError(f"empty region {region!r} (x1/y1 are exclusive and must exceed x0/y0)")
    return box


@dataclass(frozen=True, eq=False)
class Frame:
    """One screen image and where it sits in the recording.

    Attributes:
        pixels: ``(height, width, 3)`` uint8 RGB array, display pixels.
        frame_seq: the recording's ``frame`` event it came from (``None``: not known,
            e.g. an older server).
        t_s: seconds since the recording's origin (``None``: not known).
        png: the image as received, PNG (kept for reports; ``None`` when built from pixels).
        mono_s: the client's ``time.monotonic()`` when it asked for the frame.
        pointer: where the host had put the pointer when the frame was taken (the guest
            draws the cursor into the frame; checks ignore :func:`pointer_box` around it).
    """

    pixels: npt.NDArray[np.uint8] = field(repr=False)
    frame_seq: int | None = None
    t_s: float | None = None
    png: bytes | None = field(default=None, repr=False)
    mono_s: float = 0.0
    pointer: Point | None = None

    @property
    def ignored(self) -> tuple[Box, ...]:
        """Boxes checks should not look at: the pointer's."""
        return (pointer_box(self.pointer),) if self.pointer is not None else ()

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    def where(self) -> str:
        """``"frame 123 at 12.50 s"`` (or what of it is known)."""
        parts = []
        if self.frame_seq is not None:
            parts.append(f"frame {self.frame_seq}")
        if self.t_s is not None:
            parts.append(f"at {self.t_s:.2f} s")
        return " ".join(parts) or "frame (position in the recording unknown)"


@dataclass(frozen=True, slots=True)
class Match:
    """Where a reference (or a text) was found.

    Attributes:
        name: the reference's name, or the text searched for.
        box: the bounding box of everything matched, display pixels.
        score: similarity, 0..1 (1: identical); for a reference, the lowest of its match
            areas' scores (OpenCV ``TM_CCOEFF_NORMED`` clipped to 0..1, or 1 - RMS error
            for flat areas); for text, the OCR confidence / 100.
        click_point: where :meth:`~agent_bridge.client.Session.click` clicks: the
            reference's click point moved with the match, else the box's centre.
        frame_seq: the recording's frame event the match was seen in.
        t_s: that frame's time in the recording, seconds.
        areas: the box of each match area (references with several areas).
        text: the text read (for :meth:`find_text`), else ``None``.
    """

    name: str
    box: Box
    score: float
    click_point: Point
    frame_seq: int | None = None
    t_s: float | None = None
    areas: tuple[Box, ...] = ()
    text: str | None = None

    def __str__(self) -> str:
        where = f" in frame {self.frame_seq}" if self.frame_seq is not None else ""
        when = f" at {self.t_s:.2f} s" if self.t_s is not None else ""
        return f"{self.name!r} {self.box}, score {self.score:.3f}{where}{when}"


@dataclass(frozen=True, slots=True)
class TextBox:
    """A word or line read by OCR.

    Attributes:
        text: the characters read.
        box: where, display pixels.
        confidence: tesseract's confidence, 0..100.
        line: index of the text line it belongs to (reading order).
    """

    text: str
    box: Box
    confidence: float
    line: int = 0


@dataclass(frozen=True, slots=True)
class TextReading:
    """What OCR read in a region of one frame.

    Attributes:
        words: every word with its box, reading order.
        region: the region read (display pixels).
        frame_seq, t_s: the frame read (see :class:`Frame`).
    """

    words: tuple[TextBox, ...]
    region: Box
    frame_seq: int | None = None
    t_s: float | None = None

    @property
    def lines(self) -> tuple[TextBox, ...]:
        """One :class:`TextBox` per line: its words joined by single spaces, their union box."""
        out: list[TextBox] = []
        by_line: dict[int, list[TextBox]] = {}
        for word in self.words:
            by_line.setdefault(word.line, []).append(word)
        for index in sorted(by_line):
            words = by_line[index]
            out.append(
                TextBox(
                    " ".join(w.text for w in words),
                    Box.union([w.box for w in words]),
                    min(w.confidence for w in words),
                    index,
                )
            )
        return tuple(out)

    @property
    def text(self) -> str:
        """The lines joined by newlines."""
        return "\n".join(line.text for line in self.lines)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Change:
    """What :meth:`expect_change` saw (filled in when the block ends).

    Attributes:
        box: bounding box of the changed pixels, display pixels.
        changed_px: how many pixels changed.
        frame_seq, t_s: the first frame that showed the change.
        before_seq, before_t_s: the frame taken when the block started.
    """

    box: Box
    changed_px: int
    frame_seq: int | None
    t_s: float | None
    before_seq: int | None
    before_t_s: float | None


@dataclass(frozen=True, slots=True)
class Still:
    """What :meth:`wait_still` saw.

    Attributes:
        still_s: how long the screen stayed still, seconds (>= the ``for_s`` asked).
        ssim: the lowest structural similarity of a frame of that span to its first frame.
        frame_seq, t_s: the last frame of the still span.
    """

    still_s: float
    ssim: float
    frame_seq: int | None
    t_s: float | None
