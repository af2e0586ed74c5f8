"""OCR through the real tesseract (Debian's tesseract-ocr, installed by scripts/bootstrap)."""

from __future__ import annotations

import re

import pytest

from agent_bridge.qa.errors import OcrUnavailable
from agent_bridge.qa.model import Box, TextBox
from agent_bridge.qa.ocr import group_lines, normalise, ocr_available, read_words, search
from tests.qa.helpers import desktop

SCREEN = desktop(
    640,
    400,
    windows=[(Box(40, 40, 300, 90), "Save changes?"), (Box(360, 200, 240, 90), "Quit now")],
)


def test_tesseract_is_installed_here() -> None:
    # CI must use OCR, never skip it: scripts/bootstrap installs tesseract-ocr.
    assert ocr_available() is None


def test_read_words_gives_words_with_boxes_in_display_pixels() -> None:
    words = read_words(SCREEN)
    text = " ".join(w.text for w in words)
    assert "Save changes?" in text and "Quit now" in text
    save = next(w for w in words if w.text == "Save")
    # the caption is drawn at (48, 70), 16 px font
    assert 44 <= save.box.x <= 52 and 66 <= save.box.y <= 76, save.box
    assert save.box.height < 24 and save.confidence > 50
    assert {w.line for w in words if w.text in ("Save", "changes?")} == {save.line}


def test_a_region_limits_what_is_read_and_boxes_stay_screen_relative() -> None:
    words = read_words(SCREEN, Box(350, 190, 280, 110))
    assert [w.text for w in words] == ["Quit", "now"]
    assert all(w.box.x >= 350 and w.box.y >= 190 for w in words)


def test_search_substring_regex_and_case() -> None:
    words = group_lines(
        [
            TextBox("Save", Box(10, 10, 30, 12), 90.0),
            TextBox("\u2018changes?\u2019", Box(44, 11, 60, 12), 70.0),
            TextBox("Quit", Box(400, 10, 30, 12), 95.0),  # far right: another line
            TextBox("now", Box(10, 40, 30, 12), 95.0),
        ]
    )
    assert [w.line for w in words] == [0, 0, 1, 2]
    assert search(words, "Save 'changes") == ("Save 'changes", Box(10, 10, 94, 13), 70.0)
    assert search(words, "save", ignore_case=True) is not None
    assert search(words, "save") is None
    assert search(words, "changes? Quit") is None  # not one phrase
    assert search(words, re.compile(r"n[o0]w$")) == ("now", Box(10, 40, 30, 12), 95.0)
    assert normalise("\u201cok\u201d \u2013 fine") == '"ok" - fine'


def test_missing_tesseract_raises_ocr_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import pytesseract

    monkeypatch.setattr(pytesseract.pytesseract, "tesseract_cmd", "/nonexistent/tesseract")
    assert "apt-get install tesseract-ocr" in (ocr_available() or "")
    with pytest.raises(OcrUnavailable, match="apt-get install tesseract-ocr"):
        read_words(SCREEN)
