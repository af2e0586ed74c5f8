"""The wait plans driven by a scripted driver on a fake clock (no server, no sleeping)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest

from agent_bridge.qa import waits
from agent_bridge.qa.errors import (
    MatchTimeout,
    NoChange,
    NotStill,
    ReferenceMissing,
    StillVisible,
    TextNotFound,
)
from agent_bridge.qa.match import Reference
from agent_bridge.qa.model import Box, Frame, Point, TextBox
from agent_bridge.qa.refs import RefStore
from agent_bridge.qa.waits import QaOptions, ReadText
from orchestrator.errors import ConfigError
from tests.qa.helpers import Script, desktop, frame

DIALOG = Box(200, 120, 180, 90)
EMPTY = desktop()
WITH_DIALOG = desktop(windows=[(DIALOG, "Save changes?")])
OTHER_DIALOG = desktop(windows=[(DIALOG, "Discard all?")])
REF = Reference("dialog", np.ascontiguousarray(WITH_DIALOG[120:210, 200:380]))


def options(tmp_path: Path | None = None, **kw: object) -> QaOptions:
    return QaOptions(refs=RefStore(tmp_path or Path("/nonexistent")), **kw)  # type: ignore[arg-type]


def test_wait_for_returns_the_match_of_the_first_frame_that_has_it() -> None:
    script = Script([EMPTY, EMPTY, WITH_DIALOG])
    match = script.run(waits.wait_for(options(), REF, 10, now=script.now))
    assert match.box == DIALOG and match.score == pytest.approx(1.0)
    assert match.name == "dialog" and match.click_point == DIALOG.center
    assert (match.frame_seq, match.t_s) == (2, 0.2)
    assert script.grabs == 3
    assert all(0 < s <= 0.25 for s in script.sleeps)  # polls every poll_s


def test_wait_for_times_out_with_the_best_frame_as_evidence() -> None:
    script = Script([EMPTY, OTHER_DIALOG, EMPTY])
    with pytest.raises(MatchTimeout) as caught:
        script.run(waits.wait_for(options(), REF, 2.0, now=script.now))
    evidence = caught.value.evidence
    assert evidence.kind == "reference" and evidence.reference is REF
    assert evidence.frame is not None and evidence.frame.frame_seq == 1  # the closest one
    assert evidence.candidate is not None and evidence.candidate.box == DIALOG
    assert "best score" in str(caught.value) and "frame 1 at 0.10 s" in str(caught.value)
    assert 2.0 <= script.t - 100.0 <= 2.0 + 0.25 + 0.05  # stops at the deadline
    assert isinstance(caught.value, AssertionError)  # a failed check fails the test


def test_timeout_zero_checks_exactly_one_frame() -> None:
    script = Script([EMPTY, WITH_DIALOG])
    with pytest.raises(MatchTimeout):
        script.run(waits.wait_for(options(), REF, 0, now=script.now))
    assert script.grabs == 1


def test_exists_looks_once() -> None:
    script = Script([EMPTY, WITH_DIALOG])
    assert script.run(waits.exists(options(), REF, now=script.now)) is None
    assert script.run(waits.exists(options(), REF, now=script.now)) is not None
    assert script.grabs == 2


def test_wait_gone() -> None:
    script = Script([WITH_DIALOG, WITH_DIALOG, EMPTY])
    gone = script.run(waits.wait_gone(options(), REF, 10, now=script.now))
    assert isinstance(gone, Frame) and gone.frame_seq == 2
    script = Script([WITH_DIALOG])
    with pytest.raises(StillVisible) as caught:
        script.run(waits.wait_gone(options(), REF, 1, now=script.now))
    assert caught.value.evidence.candidate is not None


def test_change_after_ignores_the_pointer_and_reports_the_box() -> None:
    before = frame(EMPTY, pointer=Point(50, 50))
    moved_pointer = EMPTY.copy()
    moved_pointer[300:316, 500:510] = 0  # the cursor, drawn where the pointer went
    script = Script([moved_pointer, WITH_DIALOG], pointer=Point(500, 300))
    change = script.run(waits.change_after(options(), before, 5, now=script.now))
    assert script.grabs == 2  # the pointer's move alone was not a change
    assert DIALOG.intersection(change.box) == change.box
    assert (change.before_seq, change.frame_seq) == (0, 1)


def test_no_change_is_a_failure_with_both_frames() -> None:
    script = Script([EMPTY])
    with pytest.raises(NoChange) as caught:
        script.run(waits.change_after(options(), frame(EMPTY), 1, now=script.now))
    assert caught.value.evidence.before is not None and caught.value.evidence.frame is not None
    with pytest.raises(ConfigError):
        Script([EMPTY]).run(waits.change_after(options(), frame(EMPTY), 1, min_changed_px=0))


def test_wait_still_waits_for_a_still_span() -> None:
    def screen(t: float) -> np.ndarray:  # a window moving until t = 101.0, then still
        dx = int(min(t - 100.0, 1.0) * 200)
        return desktop(windows=[(Box(20 + dx, 50, 200, 150), "moving")])

    script = Script(screen)
    still = script.run(waits.wait_still(options(), 0.5, 5, now=script.now))
    assert still.still_s >= 0.5 and still.ssim == 1.0
    assert script.t >= 101.5


def test_wait_still_times_out_on_a_screen_that_keeps_moving() -> None:
    def screen(t: float) -> np.ndarray:
        return desktop(windows=[(Box(20 + int((t - 100) * 100) % 300, 50, 200, 150), "x")])

    script = Script(screen)
    with pytest.raises(NotStill) as caught:
        script.run(waits.wait_still(options(), 1, 2, now=script.now))
    assert caught.value.evidence.details["ssim"] < 0.995
    with pytest.raises(ConfigError, match="exceeds"):
        Script(screen).run(waits.wait_still(options(), 3, 2))


def _ocr(words_by_seq: dict[int, tuple[TextBox, ...]]):  # type: ignore[no-untyped-def]
    def read(request: ReadText) -> tuple[TextBox, ...]:
        assert request.frame.frame_seq is not None
        return words_by_seq.get(request.frame.frame_seq, ())

    return read


def test_find_text_matches_phrases_across_words() -> None:
    words = (
        TextBox("Save", Box(10, 10, 30, 12), 90.0, 0),
        TextBox("changes?", Box(44, 10, 60, 12), 80.0, 0),
    )
    script = Script([EMPTY], ocr=_ocr({2: words}))
    match = script.run(waits.find_text(options(), "Save changes", None, 5, now=script.now))
    assert match.text == "Save changes" and match.box == Box(10, 10, 94, 12)
    assert match.score == 0.8 and match.frame_seq == 2
    script = Script([EMPTY], ocr=_ocr({0: words}))
    match = script.run(waits.find_text(options(), re.compile(r"chan\w+"), None, 5, now=script.now))
    assert match.text == "changes" and match.box == Box(44, 10, 60, 12)


def test_find_text_timeout_lists_what_was_read() -> None:
    words = (TextBox("Hello", Box(0, 0, 10, 10), 95.0, 0),)
    script = Script([EMPTY], ocr=_ocr({i: words for i in range(100)}))
    with pytest.raises(TextNotFound, match=r"OCR read in frame .*: Hello") as caught:
        script.run(waits.find_text(options(), "Goodbye", None, 1, now=script.now))
    assert caught.value.evidence.words == words


def test_read_text_returns_words_and_lines() -> None:
    words = (
        TextBox("a", Box(0, 0, 5, 5), 90.0, 0),
        TextBox("b", Box(8, 0, 5, 5), 90.0, 0),
        TextBox("c", Box(0, 20, 5, 5), 90.0, 1),
    )
    script = Script([EMPTY], ocr=_ocr({0: words}))
    reading = script.run(waits.read_text(options(), Box(0, 0, 100, 100)))
    assert reading.text == "a b\nc" and reading.region == Box(0, 0, 100, 100)
    assert reading.lines[0].box == Box(0, 0, 13, 5)


def test_a_missing_reference_fails_or_is_written_once_the_screen_is_still(tmp_path: Path) -> None:
    script = Script([WITH_DIALOG])
    with pytest.raises(ReferenceMissing):
        script.run(waits.wait_for(options(tmp_path), "dialog", 5, now=script.now))
    store = RefStore(tmp_path, update_missing=True)
    opts = QaOptions(refs=store, settle_s=0.5)
    script = Script([EMPTY, WITH_DIALOG])
    match = script.run(waits.wait_for(opts, "dialog", 5, region=DIALOG, now=script.now))
    assert match.box == DIALOG and store.written == [tmp_path / "dialog.png"]
    assert script.t - 100.0 >= 0.5  # waited for a still screen first
    # a reference that exists now is used, not rewritten
    script = Script([EMPTY])
    with pytest.raises(MatchTimeout):
        script.run(waits.wait_for(opts, "dialog", 0.5, now=script.now))
    assert store.written == [tmp_path / "dialog.png"]
    # wait_gone never writes one (nothing to record once a thing is gone)
    with pytest.raises(ReferenceMissing):
        Script([EMPTY]).run(waits.wait_gone(opts, "other", 1))


def test_run_async_runs_the_same_plan_without_blocking_the_loop() -> None:
    frames = iter([EMPTY, WITH_DIALOG])
    ticks = 0

    async def grab() -> Frame:
        import time

        return frame(next(frames), seq=7, mono_s=time.monotonic())

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    async def main() -> object:
        task = asyncio.create_task(ticker())
        try:
            return await waits.run_async(waits.wait_for(options(poll_s=0.05), REF, 5), grab)
        finally:
            task.cancel()

    match = asyncio.run(main())
    assert match.box == DIALOG  # type: ignore[attr-defined]
    assert ticks > 0


def test_the_async_twin_waits_clicks_and_expects_changes() -> None:
    from agent_bridge.qa.checks import AsyncVisualChecks

    class Screen(AsyncVisualChecks):
        def __init__(self) -> None:
            self.screens = [EMPTY, EMPTY, WITH_DIALOG]
            self.clicked: list[Point] = []
            self.seq = 0

        async def _qa_frame(self) -> Frame:
            import time

            self.seq += 1
            pixels = self.screens[min(self.seq - 1, len(self.screens) - 1)]
            return frame(pixels, seq=self.seq, mono_s=time.monotonic())

        async def _qa_click_at(
            self, point: Point, *, button: str, count: int, hold: str | None
        ) -> None:
            self.clicked.append(point)

    async def main() -> Screen:
        screen = Screen()
        screen.qa = options(poll_s=0.01)
        async with screen.expect_change(timeout_s=2) as watch:
            pass
        assert watch.change is not None and watch.change.frame_seq == 3
        match = await screen.click_ref(REF)
        assert screen.clicked == [match.click_point] == [DIALOG.center]
        assert await screen.exists(REF) is not None
        return screen

    asyncio.run(main())
