"""Waits and checks as sans-I/O *plans*, and the two drivers that run them.

A plan is a generator: it yields what it needs next (:class:`Grab` a frame,
:class:`Sleep`, :class:`ReadText` with OCR) and receives the answer; it returns the result
(:class:`~agent_bridge.qa.model.Match`...) or raises a
:class:`~agent_bridge.qa.errors.CheckFailed` with its evidence. The same plan runs under
:func:`run_sync` (the blocking client) and :func:`run_async` (asyncio: every step of the
plan, matching included, and OCR run in a worker thread, so the event loop never blocks),
and under a scripted driver in the unit tests. Time comes from the ``now`` callable each
plan takes (``time.monotonic`` in the drivers).

Timeouts: a plan checks a frame at once, then about every ``poll_s`` until ``timeout_s``
has passed since it started; the last frame is taken at or after the deadline, so a
``timeout_s`` of 0 checks exactly one frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

from agent_bridge.qa.errors import (
    Evidence,
    MatchTimeout,
    NoChange,
    NotStill,
    ReferenceMissing,
    StillVisible,
    TextNotFound,
)
from agent_bridge.qa.match import Candidate, Reference, changed, find, similarity
from agent_bridge.qa.model import (
    DEFAULT_TIMEOUT_S,
    Box,
    Change,
    Frame,
    Match,
    Still,
    TextBox,
    TextReading,
)
from agent_bridge.qa.ocr import read_words, search
from agent_bridge.qa.refs import RefStore
from orchestrator.errors import ConfigError

__all__ = [
    "DEFAULT_POLL_S",
    "DEFAULT_TIMEOUT_S",
    "Grab",
    "Plan",
    "QaOptions",
    "ReadText",
    "Sleep",
    "change_after",
    "exists",
    "find_text",
    "read_text",
    "resolve",
    "run_async",
    "run_sync",
    "wait_for",
    "wait_gone",
    "wait_still",
]

DEFAULT_POLL_S = 0.25

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Grab:
    """Take a new frame of the whole screen; the answer is a :class:`Frame`."""


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds``; the answer is ``None``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class ReadText:
    """Run OCR on ``region`` of ``frame``; the answer is a tuple of :class:`TextBox`."""

    frame: Frame
    region: Box | None
    options: QaOptions


Request: TypeAlias = Grab | Sleep | ReadText
Plan: TypeAlias = Generator[Request, Any, T]
Now: TypeAlias = Callable[[], float]

_GRAB = Grab()


@dataclass(slots=True)
class QaOptions:
    """A session's QA settings (``session.qa``).

    Attributes:
        refs: where references are loaded from (and written, with ``update_missing``).
        poll_s: seconds between two frames of a wait.
        settle_s: before writing a missing reference (``--deskvm-update-refs``), how long
            the screen must stay still, seconds (at most the wait's ``timeout_s``).
        ocr_scale: OCR upscaling factor (see :func:`agent_bridge.qa.ocr.read_words`).
        ocr_psm: tesseract page segmentation mode.
        ocr_lang: tesseract language(s).
    """

    refs: RefStore = field(default_factory=lambda: RefStore("refs"))
    poll_s: float = DEFAULT_POLL_S
    settle_s: float = 1.0
    ocr_scale: float = 2.0
    ocr_psm: int = 11
    ocr_lang: str = "eng"


def _pause(poll_s: float, frame: Frame, deadline: float, now: Now) -> Sleep:
    """Sleep until ``poll_s`` after ``frame`` was asked for, but not past the deadline."""
    t = now()
    return Sleep(max(0.0, min(frame.mono_s + poll_s, deadline) - t))


def _match(name: str, candidate: Candidate, frame: Frame) -> Match:
    return Match(
        name=name,
        box=candidate.box,
        score=round(candidate.score, 4),
        click_point=candidate.click_point,
        frame_seq=frame.frame_seq,
        t_s=frame.t_s,
        areas=tuple(h.box for h in candidate.hits),
    )


def resolve(
    options: QaOptions, ref: str | Reference, region: Box | None, timeout_s: float, now: Now
) -> Plan[Reference]:
    """The reference named ``ref`` (or ``ref`` itself).

    A missing reference is written from the screen when ``options.refs.update_missing``
    (after the screen stayed still ``settle_s``, or at ``timeout_s``): the whole frame,
    with ``region`` as its match area when given.

    Raises:
        ReferenceMissing: no such reference and not writing.
        ReferenceInvalid: it cannot be read (or written).
    """
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    if isinstance(ref, Reference):
        return ref
    store = options.refs
    try:
        return store.load(ref)
    except ReferenceMissing:
        if not store.update_missing:
            raise
    settle_s = min(options.settle_s, timeout_s)
    with contextlib.suppress(NotStill):  # a screen that never settles is recorded as it is
        yield from wait_still(options, settle_s, timeout_s, now=now)
    frame: Frame = yield _GRAB
    where = frame.where()
    store.write_new(
        ref,
        frame.pixels,
        region=region,
        source=f"written by --deskvm-update-refs from {where}",
    )
    return store.load(ref)


def wait_for(
    options: QaOptions,
    ref: str | Reference,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    region: Box | None = None,
    now: Now = time.monotonic,
) -> Plan[Match]:
    """Until ``ref`` is on the screen (every match area at its threshold).

    Raises:
        MatchTimeout: not seen within ``timeout_s``; the evidence holds the frame with the
            best score, the candidate there (score, box) and the reference.
    """
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    start = now()
    reference = yield from resolve(options, ref, region, timeout_s, now)
    deadline = start + timeout_s
    best: tuple[Candidate, Frame] | None = None
    frames = 0
    last: Frame | None = None
    while True:
        frame: Frame = yield _GRAB
        frames += 1
        last = frame
        candidate = find(frame.pixels, reference, region, frame.ignored)
        if candidate.ok:
            return _match(reference.name, candidate, frame)
        if best is None or candidate.score > best[0].score:
            best = (candidate, frame)
        if now() >= deadline:
            break
        yield _pause(options.poll_s, frame, deadline, now)
    candidate, best_frame = best
    failing = [h for h in candidate.hits if not h.ok]
    worst = min(failing, key=lambda h: h.score - h.threshold) if failing else candidate.hits[0]
    title = (
        f"wait_for({reference.name!r}): not on the screen within {timeout_s:g} s "
        f"({frames} frames); best score {candidate.score:.3f} (needs {worst.threshold:g}), "
        f"found at ({candidate.box.x}, {candidate.box.y}) in {best_frame.where()}"
    )
    raise MatchTimeout(
        title,
        evidence=Evidence(
            "reference",
            title,
            frame=best_frame,
            reference=reference,
            candidate=candidate,
            region=region,
            details={
                "timeout_s": timeout_s,
                "frames": frames,
                "last frame": last.where() if last else None,
            },
        ),
    )


def exists(
    options: QaOptions,
    ref: str | Reference,
    *,
    region: Box | None = None,
    now: Now = time.monotonic,
) -> Plan[Match | None]:
    """Whether ``ref`` is on the screen now (one frame): its match, or ``None``."""
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    reference = yield from resolve(options, ref, region, DEFAULT_TIMEOUT_S, now)
    frame: Frame = yield _GRAB
    candidate = find(frame.pixels, reference, region, frame.ignored)
    return _match(reference.name, candidate, frame) if candidate.ok else None


def wait_gone(
    options: QaOptions,
    ref: str | Reference,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    region: Box | None = None,
    now: Now = time.monotonic,
) -> Plan[Frame]:
    """Until ``ref`` is no longer on the screen; returns the first frame without it.

    Raises:
        ReferenceMissing: an unknown reference is never written by ``wait_gone`` (there is
            nothing to record once something is gone).
        StillVisible: it was still there after ``timeout_s``; the evidence holds the last
            frame and where it was matched.
    """
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    start = now()
    reference = ref if isinstance(ref, Reference) else options.refs.load(ref)
    deadline = start + timeout_s
    frames = 0
    while True:
        frame: Frame = yield _GRAB
        frames += 1
        candidate = find(frame.pixels, reference, region, frame.ignored)
        if not candidate.ok:
            return frame
        if now() >= deadline:
            break
        yield _pause(options.poll_s, frame, deadline, now)
    title = (
        f"wait_gone({reference.name!r}): still on the screen after {timeout_s:g} s "
        f"({frames} frames); score {candidate.score:.3f} at ({candidate.box.x}, "
        f"{candidate.box.y}) in {frame.where()}"
    )
    raise StillVisible(
        title,
        evidence=Evidence(
            "gone",
            title,
            frame=frame,
            reference=reference,
            candidate=candidate,
            region=region,
            details={"timeout_s": timeout_s, "frames": frames, "score": candidate.score},
        ),
    )


def change_after(
    options: QaOptions,
    before: Frame,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    region: Box | None = None,
    min_changed_px: int = 1,
    level: int = 24,
    now: Now = time.monotonic,
) -> Plan[Change]:
    """Until the screen (or ``region``) differs from ``before`` in ``min_changed_px`` pixels.

    The pointer's box in ``before`` and in each new frame is not compared (moving the
    pointer is not a change of the application).

    Raises:
        NoChange: nothing changed within ``timeout_s``; the evidence holds both frames.
    """
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    if min_changed_px < 1:
        raise ConfigError("min_changed_px must be at least 1")
    deadline = now() + timeout_s
    frames = 0
    most = 0
    while True:
        frame: Frame = yield _GRAB
        frames += 1
        count, box = changed(
            before.pixels,
            frame.pixels,
            region,
            level=level,
            ignore=(*before.ignored, *frame.ignored),
        )
        most = max(most, count)
        if count >= min_changed_px and box is not None:
            return Change(box, count, frame.frame_seq, frame.t_s, before.frame_seq, before.t_s)
        if now() >= deadline:
            break
        yield _pause(options.poll_s, frame, deadline, now)
    where = f"in {region}" if region is not None else "on the screen"
    title = (
        f"expect_change: nothing changed {where} within {timeout_s:g} s of the block's end "
        f"({frames} frames; at most {most} px changed, needed {min_changed_px}); before: "
        f"{before.where()}, last: {frame.where()}"
    )
    raise NoChange(
        title,
        evidence=Evidence(
            "change",
            title,
            frame=frame,
            before=before,
            region=region,
            details={
                "timeout_s": timeout_s,
                "frames": frames,
                "most_changed_px": most,
                "min_changed_px": min_changed_px,
                "level": level,
            },
        ),
    )


def wait_still(
    options: QaOptions,
    for_s: float = 1.0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    region: Box | None = None,
    min_ssim: float = 0.995,
    now: Now = time.monotonic,
) -> Plan[Still]:
    """Until the screen (or ``region``) stays still for ``for_s`` seconds.

    *Still* means every frame of the span has a structural similarity (SSIM, grey levels)
    of at least ``min_ssim`` to the span's first frame: a blinking text cursor or a
    character typed stays above the default 0.995 on a whole screen, a window opening or
    a progress bar moving does not (use ``region`` to watch something small).

    Raises:
        ConfigError: ``for_s`` > ``timeout_s`` or ``min_ssim`` outside 0..1.
        NotStill: no still span of ``for_s`` within ``timeout_s``; the evidence holds the
            last two frames that differed.
    """
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    if for_s > timeout_s:
        raise ConfigError(f"wait_still: for_s ({for_s:g}) exceeds timeout_s ({timeout_s:g})")
    if not 0.0 <= min_ssim <= 1.0:
        raise ConfigError("min_ssim must be within 0..1")
    deadline = now() + timeout_s
    anchor: Frame = yield _GRAB
    lowest = 1.0
    frames = 1
    moved: tuple[Frame, Frame, float] | None = None
    frame = anchor
    while True:
        if frame.mono_s - anchor.mono_s >= for_s:
            return Still(
                round(frame.mono_s - anchor.mono_s, 3),
                round(lowest, 4),
                frame.frame_seq,
                frame.t_s,
            )
        if now() >= deadline:
            break
        pause = min(options.poll_s, max(0.0, anchor.mono_s + for_s - now()) + 0.001)
        yield Sleep(max(0.0, min(pause, deadline - now())))
        frame = yield _GRAB
        frames += 1
        ssim = similarity(anchor.pixels, frame.pixels, region)
        if ssim >= min_ssim:
            lowest = min(lowest, ssim)
        else:
            moved = (anchor, frame, ssim)
            anchor, lowest = frame, 1.0
    previous, last, ssim = moved if moved is not None else (anchor, frame, lowest)
    title = (
        f"wait_still: the screen did not stay still for {for_s:g} s within {timeout_s:g} s "
        f"({frames} frames); last change: SSIM {ssim:.4f} < {min_ssim:g} between "
        f"{previous.where()} and {last.where()}"
    )
    raise NotStill(
        title,
        evidence=Evidence(
            "still",
            title,
            frame=last,
            before=previous,
            region=region,
            details={
                "for_s": for_s,
                "timeout_s": timeout_s,
                "frames": frames,
                "ssim": round(ssim, 4),
                "min_ssim": min_ssim,
            },
        ),
    )


def find_text(
    options: QaOptions,
    pattern: str | re.Pattern[str],
    region: Box | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    ignore_case: bool = False,
    now: Now = time.monotonic,
) -> Plan[Match]:
    """Until OCR reads ``pattern`` (substring, or regex) in ``region``.

    Raises:
        OcrUnavailable: tesseract is missing.
        TextNotFound: not read within ``timeout_s``; the evidence holds the last frame and
            every word OCR read on it.
    """
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    deadline = now() + timeout_s
    name = pattern if isinstance(pattern, str) else pattern.pattern
    frames = 0
    while True:
        frame: Frame = yield _GRAB
        frames += 1
        words: tuple[TextBox, ...] = yield ReadText(frame, region, options)
        hit = search(words, pattern, ignore_case=ignore_case)
        if hit is not None:
            text, box, confidence = hit
            return Match(
                name=name,
                box=box,
                score=round(confidence / 100.0, 4),
                click_point=box.center,
                frame_seq=frame.frame_seq,
                t_s=frame.t_s,
                areas=(box,),
                text=text,
            )
        if now() >= deadline:
            break
        yield _pause(options.poll_s, frame, deadline, now)
    read = " | ".join(w.text for w in words[:40]) + (" ..." if len(words) > 40 else "")
    where = f"in {region}" if region is not None else "on the screen"
    title = (
        f"find_text({name!r}): not read {where} within {timeout_s:g} s ({frames} frames); "
        f"OCR read in {frame.where()}: {read or '(nothing)'}"
    )
    raise TextNotFound(
        title,
        evidence=Evidence(
            "text",
            title,
            frame=frame,
            words=words,
            region=region,
            details={"timeout_s": timeout_s, "frames": frames, "pattern": name},
        ),
    )


def read_text(options: QaOptions, region: Box | None = None) -> Plan[TextReading]:
    """OCR of ``region`` (default: the whole screen) of one new frame.

    Raises:
        OcrUnavailable: tesseract is missing.
    """
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    frame: Frame = yield _GRAB
    words: tuple[TextBox, ...] = yield ReadText(frame, region, options)
    full = Box(0, 0, frame.width, frame.height)
    return TextReading(words, region or full, frame.frame_seq, frame.t_s)


def ocr(request: ReadText) -> tuple[TextBox, ...]:
    """Answer a :class:`ReadText` with tesseract."""
    o = request.options
    return read_words(
        request.frame.pixels, request.region, scale=o.ocr_scale, psm=o.ocr_psm, lang=o.ocr_lang
    )


def run_sync(
    plan: Plan[T],
    grab: Callable[[], Frame],
    *,
    read: Callable[[ReadText], Sequence[TextBox]] = ocr,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run a plan to its end, blocking: frames from ``grab``, OCR from ``read``."""
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    value: Any = None
    while True:
        try:
            request = plan.send(value)
        except StopIteration as stop:
            result: T = stop.value
            return result
        match request:
            case Grab():
                value = grab()
            case Sleep(seconds=seconds):
                sleep(seconds)
                value = None
            case ReadText():
                value = tuple(read(request))


def _step(plan: Plan[T], value: Any) -> tuple[bool, Any]:
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    try:
        return False, plan.send(value)
    except StopIteration as stop:  # StopIteration must not cross into a Future
        return True, stop.value


async def run_async(
    plan: Plan[T],
    grab: Callable[[], Awaitable[Frame]],
    *,
    read: Callable[[ReadText], Sequence[TextBox]] = ocr,
) -> T:
    """Run a plan under asyncio: frames from the ``grab`` coroutine; the plan's own steps
    (matching, SSIM) and OCR in a worker thread (``asyncio.to_thread``)."""
    __tracebackhide__ = True  # pytest: show the test's line, not this one
    value: Any = None
    while True:
        done, request = await asyncio.to_thread(_step, plan, value)
        if done:
            result: T = request
            return result
        match request:
            case Grab():
                value = await grab()
            case Sleep(seconds=seconds):
                await asyncio.sleep(seconds)
                value = None
            case ReadText():
                value = tuple(await asyncio.to_thread(read, request))
