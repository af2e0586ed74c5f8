"""OCR with tesseract (Debian's ``tesseract-ocr``) through ``pytesseract``, and text search.

:func:`read_words` runs tesseract on a region of a frame and returns words with their
boxes in display pixels; :func:`group_lines` and :func:`search` are pure.

Screen text is small (9-15 px): the region is turned to grey, scaled up (``scale``,
default 2, cubic) and binarised locally (OpenCV adaptive Gaussian threshold) before
tesseract reads it with page segmentation mode 11 ("sparse text": text anywhere, as on a
desktop). Measured on frames of the small image (xterm's 9x15 font, an xmessage dialog)
and on drawn windows, these defaults read more words than plain grey levels or Otsu's
threshold; tesseract still confuses look-alike glyphs in fixed fonts (``1``/``l``,
``X11`` read as ``x14``) and text touching borders or the pointer, so search for words,
not punctuation-heavy strings, and give a ``region`` around the text when you can.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from agent_bridge.qa.errors import OcrUnavailable
from agent_bridge.qa.match import crop
from agent_bridge.qa.model import Box, TextBox

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["group_lines", "normalise", "ocr_available", "read_words", "search"]

# Typographic quotes and dashes (OCR reads them for ' " -): left/right/low single and
# double quotes, en dash, em dash, minus sign.
_TYPOGRAPHIC = str.maketrans(
    {
        "\u2018": "'", "\u2019": "'", "\u201a": "'",
        "\u201c": '"', "\u201d": '"', "\u201e": '"',
        "\u2013": "-", "\u2014": "-", "\u2212": "-",
    }
)  # fmt: skip


def ocr_available() -> str | None:
    """``None`` when tesseract can run, else the reason it cannot (for a skip message)."""
    try:
        import pytesseract
    except ImportError:  # pragma: no cover - a dependency of deskvm
        return "pytesseract is not installed (pip install pytesseract)"
    try:
        pytesseract.get_tesseract_version()
    except pytesseract.TesseractNotFoundError:
        return "tesseract is not installed (apt-get install tesseract-ocr)"
    except Exception as exc:  # pytesseract raises bare errors for a broken binary
        return f"tesseract does not run: {exc}"
    return None


def read_words(
    pixels: npt.NDArray[np.uint8],
    region: Box | None = None,
    *,
    scale: float = 2.0,
    psm: int = 11,
    lang: str = "eng",
) -> tuple[TextBox, ...]:
    """Words tesseract reads in ``region`` of a frame, with boxes in display pixels.

    Args:
        pixels: the frame, ``(h, w, 3)`` uint8 RGB.
        region: where to read; ``None``: the whole frame.
        scale: upscaling before OCR (screen fonts are small).
        psm: tesseract page segmentation mode (11: sparse text; 6: one block; 7: one line).
        lang: tesseract language(s), e.g. ``"eng"`` or ``"eng+deu"`` (Debian:
            ``tesseract-ocr-deu``...).

    Returns:
        Words in reading order (see :func:`group_lines`), confidence 0..100; empty words
        and tesseract's non-word rows are dropped.

    Raises:
        OcrUnavailable: tesseract is missing or failed.
    """
    import pytesseract

    box = Box(0, 0, pixels.shape[1], pixels.shape[0])
    if region is not None:
        box = region.intersection(box) or Box(0, 0, 0, 0)
    if box.area_px == 0:
        return ()
    grey = cv2.cvtColor(np.ascontiguousarray(crop(pixels, box)), cv2.COLOR_RGB2GRAY)
    if scale != 1.0:
        grey = cv2.resize(grey, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
    # Local (adaptive) binarisation: coloured title bars and window borders next to text
    # otherwise make tesseract's page layout drop whole text lines.
    grey = cv2.adaptiveThreshold(
        grey, 255, cv2.ADAPTIVE_THRESH_GAUSSIAN_C, cv2.THRESH_BINARY, 31, 10
    )
    # A white border: tesseract misses glyphs touching the image edge.
    pad = 8
    grey = cv2.copyMakeBorder(grey, pad, pad, pad, pad, cv2.BORDER_CONSTANT, value=255)
    try:
        data: dict[str, list[Any]] = pytesseract.image_to_data(
            grey, lang=lang, config=f"--psm {psm}", output_type=pytesseract.Output.DICT
        )
    except pytesseract.TesseractNotFoundError as exc:
        raise OcrUnavailable("tesseract is not installed (apt-get install tesseract-ocr)") from exc
    except pytesseract.TesseractError as exc:
        raise OcrUnavailable(f"tesseract failed: {exc}") from exc
    words: list[TextBox] = []
    for text, conf, left, top, width, height in zip(
        data["text"],
        data["conf"],
        data["left"],
        data["top"],
        data["width"],
        data["height"],
        strict=True,
    ):
        text = str(text).strip()
        if not text or float(conf) < 0:
            continue
        x0 = box.x + int((int(left) - pad) / scale)
        y0 = box.y + int((int(top) - pad) / scale)
        x1 = box.x + int(np.ceil((int(left) + int(width) - pad) / scale))
        y1 = box.y + int(np.ceil((int(top) + int(height) - pad) / scale))
        words.append(TextBox(text, Box(x0, y0, max(1, x1 - x0), max(1, y1 - y0)), float(conf)))
    return group_lines(words)


def group_lines(words: Sequence[TextBox]) -> tuple[TextBox, ...]:
    """Words in reading order, each with the index of its visual line.

    Words whose vertical extents overlap by half the smaller height share a row; a row is
    split into separate lines where the horizontal gap exceeds twice the row's height (two
    widgets side by side are not one phrase).
    """
    rows: list[list[TextBox]] = []
    for word in sorted(words, key=lambda w: (w.box.y + w.box.height / 2, w.box.x)):
        for row in rows:
            ref = row[0].box
            overlap = min(ref.y1, word.box.y1) - max(ref.y, word.box.y)
            if overlap >= 0.5 * min(ref.height, word.box.height):
                row.append(word)
                break
        else:
            rows.append([word])
    out: list[TextBox] = []
    line = 0
    for row in rows:
        row.sort(key=lambda w: w.box.x)
        height = max(w.box.height for w in row)
        previous: TextBox | None = None
        for word in row:
            if previous is not None and word.box.x - previous.box.x1 > 2 * height:
                line += 1
            out.append(TextBox(word.text, word.box, word.confidence, line))
            previous = word
        line += 1
    return tuple(out)


def normalise(text: str) -> str:
    """NFKC, typographic quotes and dashes made ASCII (what OCR reads for ``'`` and ``-``)."""
    return unicodedata.normalize("NFKC", text).translate(_TYPOGRAPHIC)


def search(
    words: Sequence[TextBox], pattern: str | re.Pattern[str], *, ignore_case: bool = False
) -> tuple[str, Box, float] | None:
    """Find ``pattern`` in the lines of ``words``.

    A string is searched as a substring of each line (words joined by single spaces, spaces
    in the pattern collapsed), a compiled regex with ``re.search``; both after
    :func:`normalise`.

    Returns:
        ``(text matched, box of the words it spans, lowest confidence 0..100)`` of the first
        line (reading order) that has it, or ``None``.
    """
    by_line: dict[int, list[TextBox]] = {}
    for word in words:
        by_line.setdefault(word.line, []).append(word)
    if isinstance(pattern, str):
        flags = re.IGNORECASE if ignore_case else 0
        needle = " ".join(normalise(pattern).split())
        regex = re.compile(re.escape(needle), flags)
    else:
        regex = re.compile(pattern.pattern, pattern.flags | (re.IGNORECASE if ignore_case else 0))
    for index in sorted(by_line):
        line_words = by_line[index]
        spans: list[tuple[int, int]] = []
        parts: list[str] = []
        position = 0
        for word in line_words:
            text = normalise(word.text)
            spans.append((position, position + len(text)))
            parts.append(text)
            position += len(text) + 1
        found = regex.search(" ".join(parts))
        if found is None:
            continue
        start, end = found.span()
        end = max(end, start + 1)  # an empty regex match still points at a word
        covered = [w for w, (a, b) in zip(line_words, spans, strict=True) if a < end and b > start]
        covered = covered or line_words[:1]
        return (
            found.group(0),
            Box.union([w.box for w in covered]),
            min(w.confidence for w in covered),
        )
    return None
