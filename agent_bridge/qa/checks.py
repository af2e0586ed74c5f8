"""The visual QA methods of a session: ``wait_for``, ``click(ref)``, ``expect_change``...

:class:`VisualChecks` is mixed into :class:`agent_bridge.client.Session` (blocking) and
:class:`AsyncVisualChecks` into the asyncio session; both run the same plans
(:mod:`agent_bridge.qa.waits`). A session supplies three primitives: a frame of the whole
screen with its place in the recording and the pointer position, a click at a point, and
its :class:`~agent_bridge.qa.waits.QaOptions` (``session.qa``: references directory,
polling, OCR settings).

Units: coordinates are display pixels (origin top-left), times are seconds
(``timeout_s``, ``for_s``), scores are 0..1. A *ref* is the name of a reference
(``refs/<name>.png``, see :mod:`agent_bridge.qa.refs`) or a
:class:`~agent_bridge.qa.match.Reference`; a *region* is a
:class:`~agent_bridge.qa.model.Box` or ``(x0, y0, x1, y1)`` (x1/y1 exclusive).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar

from agent_bridge.qa.model import (
    DEFAULT_TIMEOUT_S,
    Box,
    Change,
    Frame,
    Match,
    Point,
    RegionLike,
    Still,
    TextReading,
    as_box,
)

if TYPE_CHECKING:
    from agent_bridge.qa import waits
    from agent_bridge.qa.match import Reference
    from agent_bridge.qa.waits import Plan, QaOptions
else:

    class _Lazy:
        """``waits``, imported on first attribute access."""

        def __getattr__(self, name: str) -> object:
            import agent_bridge.qa.waits as module

            return getattr(module, name)

    waits = _Lazy()

__all__ = ["AsyncVisualChecks", "ChangeWatch", "RefLike", "VisualChecks"]

# The matching stack (OpenCV, scikit-image, pydantic) is imported on first use: a client
# that never looks at the screen does not pay for it.
RefLike: TypeAlias = "str | Reference"
T = TypeVar("T")


@dataclass(eq=False)
class ChangeWatch:
    """What ``with session.expect_change() as watch:`` binds.

    Attributes:
        before: the frame taken when the block started.
        change: what changed, set when the block ends (``None`` inside the block).
    """

    before: Frame
    change: Change | None = None


def _region(region: RegionLike | None) -> Box | None:
    return as_box(region) if region is not None else None


def _default_options() -> QaOptions:
    return waits.QaOptions()


class _Options:
    """``qa``: the session's :class:`~agent_bridge.qa.waits.QaOptions`, made on first use."""

    _qa_options: QaOptions | None = None

    @property
    def qa(self) -> QaOptions:
        if self._qa_options is None:
            self._qa_options = _default_options()
        return self._qa_options

    @qa.setter
    def qa(self, options: QaOptions) -> None:
        self._qa_options = options


class VisualChecks(_Options):
    """Blocking visual checks; see the module docstring for units.

    Subclasses implement :meth:`_qa_frame` and :meth:`_qa_click_at`; ``qa`` holds the
    options (references directory, polling, OCR).
    """

    # --- what a session provides ---------------------------------------------------------

    def _qa_frame(self) -> Frame:
        """A new frame of the whole screen (with ``frame_seq``, ``t_s``, ``pointer``)."""
        raise NotImplementedError

    def _qa_click_at(self, point: Point, *, button: str, count: int, hold: str | None) -> None:
        raise NotImplementedError

    def _qa_run(self, plan: Plan[T]) -> T:
        __tracebackhide__ = True
        return waits.run_sync(plan, self._qa_frame)

    # --- the API -------------------------------------------------------------------------

    def wait_for(
        self,
        ref: RefLike,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        region: RegionLike | None = None,
    ) -> Match:
        """Wait until ``ref`` is on the screen.

        Args:
            ref: reference name or object.
            timeout_s: how long to look, seconds (0: one frame).
            region: only look there (display pixels); with ``--deskvm-update-refs`` a
                missing reference is written with this as its match area.

        Returns:
            Where it is: box (display pixels), score 0..1, click point, frame number and
            time in the recording.

        Raises:
            MatchTimeout: not seen in time (evidence: best score, where, frames).
            ReferenceMissing / ReferenceInvalid: no usable reference.
        """
        __tracebackhide__ = True
        return self._qa_run(waits.wait_for(self.qa, ref, timeout_s, region=_region(region)))

    def wait_gone(
        self,
        ref: RefLike,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        region: RegionLike | None = None,
    ) -> None:
        """Wait until ``ref`` is no longer on the screen.

        Raises:
            StillVisible: still there after ``timeout_s`` seconds.
            ReferenceMissing / ReferenceInvalid: no usable reference.
        """
        __tracebackhide__ = True
        self._qa_run(waits.wait_gone(self.qa, ref, timeout_s, region=_region(region)))

    def exists(self, ref: RefLike, *, region: RegionLike | None = None) -> Match | None:
        """``ref``'s match on the current screen, or ``None`` (one frame, no waiting)."""
        __tracebackhide__ = True
        return self._qa_run(waits.exists(self.qa, ref, region=_region(region)))

    def click_ref(
        self,
        ref: RefLike | Match,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        button: str = "left",
        count: int = 1,
        hold: str | None = None,
    ) -> Match:
        """Wait for ``ref`` and click its click point (else the centre of the match).

        ``session.click(ref)`` calls this. A :class:`Match` is clicked without waiting.

        Raises:
            MatchTimeout: not seen within ``timeout_s`` (nothing is clicked).
        """
        __tracebackhide__ = True
        match = ref if isinstance(ref, Match) else self.wait_for(ref, timeout_s)
        self._qa_click_at(match.click_point, button=button, count=count, hold=hold)
        return match

    @contextmanager
    def expect_change(
        self,
        region: RegionLike | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        min_changed_px: int = 1,
        level: int = 24,
    ) -> Iterator[ChangeWatch]:
        """Expect the block to change the screen (or ``region``).

        The "before" frame is taken when the block starts, so a fast application cannot
        change the screen before it is looked at. When the block ends, frames are taken
        until ``min_changed_px`` pixels differ by more than ``level`` (0..255) from
        "before" — the pointer's box is not compared — or ``timeout_s`` passes.
        An exception inside the block propagates without waiting.

        Yields:
            A :class:`ChangeWatch`; its ``change`` (box, pixels, frame) is set on exit.

        Raises:
            NoChange: nothing changed in time (evidence: before and last frames).
        """
        __tracebackhide__ = True
        box = _region(region)
        watch = ChangeWatch(self._qa_frame())
        yield watch
        watch.change = self._qa_run(
            waits.change_after(
                self.qa,
                watch.before,
                timeout_s,
                region=box,
                min_changed_px=min_changed_px,
                level=level,
            )
        )

    def wait_still(
        self,
        for_s: float = 1.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        region: RegionLike | None = None,
        min_ssim: float = 0.995,
    ) -> Still:
        """Wait until the screen (or ``region``) stays still ``for_s`` seconds (SSIM >=
        ``min_ssim`` to the still span's first frame).

        Raises:
            NotStill: no still span within ``timeout_s``.
        """
        __tracebackhide__ = True
        return self._qa_run(
            waits.wait_still(self.qa, for_s, timeout_s, region=_region(region), min_ssim=min_ssim)
        )

    def find_text(
        self,
        text_or_regex: str | re.Pattern[str],
        region: RegionLike | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        ignore_case: bool = False,
    ) -> Match:
        """Wait until OCR (tesseract) reads the text (substring) or regex in ``region``.

        Returns:
            A :class:`Match`: ``text`` as read, box of the words, score = OCR confidence.

        Raises:
            TextNotFound: not read in time (evidence: the frame and every word read).
            OcrUnavailable: tesseract is not installed.
        """
        __tracebackhide__ = True
        return self._qa_run(
            waits.find_text(
                self.qa, text_or_regex, _region(region), timeout_s, ignore_case=ignore_case
            )
        )

    def read_text(self, region: RegionLike | None = None) -> TextReading:
        """OCR of ``region`` (default: whole screen) now: words with boxes, ``.text``.

        Raises:
            OcrUnavailable: tesseract is not installed.
        """
        __tracebackhide__ = True
        return self._qa_run(waits.read_text(self.qa, _region(region)))


class AsyncVisualChecks(_Options):
    """The asyncio twin of :class:`VisualChecks` (same arguments, awaitable).

    Subclasses implement :meth:`_qa_frame` and :meth:`_qa_click_at` as coroutines.
    Matching, SSIM and OCR run in worker threads.
    """

    async def _qa_frame(self) -> Frame:
        raise NotImplementedError

    async def _qa_click_at(
        self, point: Point, *, button: str, count: int, hold: str | None
    ) -> None:
        raise NotImplementedError

    async def _qa_run(self, plan: Plan[T]) -> T:
        __tracebackhide__ = True
        return await waits.run_async(plan, self._qa_frame)

    async def wait_for(
        self,
        ref: RefLike,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        region: RegionLike | None = None,
    ) -> Match:
        """See :meth:`VisualChecks.wait_for`."""
        __tracebackhide__ = True
        return await self._qa_run(waits.wait_for(self.qa, ref, timeout_s, region=_region(region)))

    async def wait_gone(
        self,
        ref: RefLike,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        region: RegionLike | None = None,
    ) -> None:
        """See :meth:`VisualChecks.wait_gone`."""
        __tracebackhide__ = True
        await self._qa_run(waits.wait_gone(self.qa, ref, timeout_s, region=_region(region)))

    async def exists(self, ref: RefLike, *, region: RegionLike | None = None) -> Match | None:
        """See :meth:`VisualChecks.exists`."""
        __tracebackhide__ = True
        return await self._qa_run(waits.exists(self.qa, ref, region=_region(region)))

    async def click_ref(
        self,
        ref: RefLike | Match,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        button: str = "left",
        count: int = 1,
        hold: str | None = None,
    ) -> Match:
        """See :meth:`VisualChecks.click_ref`."""
        __tracebackhide__ = True
        match = ref if isinstance(ref, Match) else await self.wait_for(ref, timeout_s)
        await self._qa_click_at(match.click_point, button=button, count=count, hold=hold)
        return match

    @asynccontextmanager
    async def expect_change(
        self,
        region: RegionLike | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        min_changed_px: int = 1,
        level: int = 24,
    ) -> AsyncIterator[ChangeWatch]:
        """See :meth:`VisualChecks.expect_change` (``async with``)."""
        __tracebackhide__ = True
        box = _region(region)
        watch = ChangeWatch(await self._qa_frame())
        yield watch
        watch.change = await self._qa_run(
            waits.change_after(
                self.qa,
                watch.before,
                timeout_s,
                region=box,
                min_changed_px=min_changed_px,
                level=level,
            )
        )

    async def wait_still(
        self,
        for_s: float = 1.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        region: RegionLike | None = None,
        min_ssim: float = 0.995,
    ) -> Still:
        """See :meth:`VisualChecks.wait_still`."""
        __tracebackhide__ = True
        return await self._qa_run(
            waits.wait_still(self.qa, for_s, timeout_s, region=_region(region), min_ssim=min_ssim)
        )

    async def find_text(
        self,
        text_or_regex: str | re.Pattern[str],
        region: RegionLike | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        ignore_case: bool = False,
    ) -> Match:
        """See :meth:`VisualChecks.find_text`."""
        __tracebackhide__ = True
        return await self._qa_run(
            waits.find_text(
                self.qa, text_or_regex, _region(region), timeout_s, ignore_case=ignore_case
            )
        )

    async def read_text(self, region: RegionLike | None = None) -> TextReading:
        """See :meth:`VisualChecks.read_text`."""
        __tracebackhide__ = True
        return await self._qa_run(waits.read_text(self.qa, _region(region)))
