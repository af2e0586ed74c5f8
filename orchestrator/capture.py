"""One session's screen capture: one loop feeding the live viewers and the recording.

:class:`FrameCapture` owns every ``screendump`` of a running session. A daemon thread
grabs the screen as often as its most demanding consumer needs (the recording's
``record_fps``, or the fastest live viewer's ``max_fps``, at most 30/s) and compares the
raw pixels with the previous grab (an exact buffer compare: a fraction of a millisecond at
1280x800, and nothing is encoded to find out nothing changed). A changed screen becomes a
new :class:`LiveFrame` with the next frame number:

- every :class:`Viewer` gets it in a one-frame slot (a slow viewer skips to the newest
  frame; nothing queues up), encoded on demand and at most once per codec/quality/size;
- the recording gets the newest frame every ``1 / record_fps`` seconds when it changed
  (:meth:`Recorder.add_capture`, the video).

:meth:`FrameCapture.still` takes a full-resolution PNG still on demand (every screenshot
and, with continuous capture, every input moment). It is a grab too, so viewers see it at
once; its pixels reach the video on the loop's next turn (off the action's path), so the
video still shows every moment a still shows.

Errors in the thread never reach the session's actions: the first one is recorded as a
``marker`` event and the loop keeps trying (a display that stops answering is the
session's business, not the recorder's).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from agent_bridge.protocol.stream import MAX_STREAM_FPS, Codec
from orchestrator.clock import Clock
from orchestrator.display.base import DisplayBackend
from orchestrator.errors import DeskvmError
from orchestrator.imaging import encode_image, encode_png, scaled
from orchestrator.recorder import Event, Recorder, Source
from orchestrator.video import pixel_hash

__all__ = ["Encoded", "FrameCapture", "LiveFrame", "Viewer"]

_IDLE_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoding of a live frame.

    Attributes:
        data: the image file (JPEG, WebP or PNG).
        width_px, height_px: its size (smaller than the frame's when scaled down).
    """

    data: bytes
    width_px: int
    height_px: int


@dataclass(eq=False)
class LiveFrame:
    """A screen that differs from the one before it.

    Attributes:
        number: the session's frame number (1, 2, 3...; one per change).
        pts_ns: capture time (the session clock's monotonic ns).
        image: the screen, RGB, display pixels. Shared: never modify it.
        pixels: the same pixels as an ``(h, w, 3)`` array (read-only).
    """

    number: int
    pts_ns: int
    image: Image.Image
    pixels: np.ndarray = field(repr=False, default_factory=lambda: np.empty((0, 0, 3), np.uint8))
    _encoded: dict[tuple[Codec, int, int | None], Encoded] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cached(
        self, codec: Codec, quality: int = 80, max_long_edge: int | None = None
    ) -> Encoded | None:
        """The encoding if some viewer already asked for it (never blocks on an encode)."""
        return self._encoded.get((codec, quality if codec != "png" else 0, max_long_edge))

    def encoded(self, codec: Codec, quality: int = 80, max_long_edge: int | None = None) -> Encoded:
        """This frame as ``codec`` (encoded once per codec/quality/size, then cached).

        Blocking (call it from a worker thread).
        """
        key = (codec, quality if codec != "png" else 0, max_long_edge)
        with self._lock:
            done = self._encoded.get(key)
            if done is None:
                image = scaled(self.image, max_long_edge)
                done = Encoded(encode_image(image, codec, quality), image.width, image.height)
                self._encoded[key] = done
            return done


class Viewer:
    """A live consumer of one session's frames (see :meth:`FrameCapture.subscribe`).

    Holds at most one frame: the newest it has not taken yet. ``wake`` is called (from the
    capture thread) whenever a new frame arrives; it must not block.
    """

    def __init__(self, capture: FrameCapture, max_fps: float, wake: Callable[[], None]) -> None:
        self.max_fps = max_fps
        self._capture = capture
        self._wake = wake
        self._lock = threading.Lock()
        self._slot: LiveFrame | None = None
        self._taken = 0

    def offer(self, frame: LiveFrame) -> None:
        """Put ``frame`` in the slot (replacing an untaken older one) and wake the viewer."""
        with self._lock:
            if frame.number <= self._taken:
                return
            self._slot = frame
        self._wake()

    def take(self) -> LiveFrame | None:
        """The newest frame not taken yet, or ``None``."""
        with self._lock:
            frame, self._slot = self._slot, None
            if frame is not None:
                self._taken = frame.number
            return frame

    def close(self) -> None:
        """Stop receiving frames (idempotent)."""
        self._capture.unsubscribe(self)


class FrameCapture:
    """The capture loop of one session.

    Args:
        display: where frames come from (QMP ``screendump`` in production).
        recorder: where recorded frames and stills go.
        clock: timestamps (``pts_ns``, monotonic).
        fps: recording rate of the video, frames per second (2-5 is sensible under TCG);
            ``None``: no video (the loop then runs only while someone watches).

    Thread safety: every method may be called from any thread; grabs are serialized.
    """

    def __init__(
        self, display: DisplayBackend, recorder: Recorder, clock: Clock, *, fps: float | None
    ) -> None:
        if fps is not None and fps <= 0:
            raise ValueError("fps must be positive")
        self._display = display
        self._recorder = recorder
        self._clock = clock
        self._record_period_s = None if fps is None else 1.0 / fps
        self._grab_lock = threading.Lock()
        self._record_lock = threading.Lock()
        self._cv = threading.Condition()
        self._stopped = False
        self._kick = False
        self._thread: threading.Thread | None = None
        self._viewers: list[Viewer] = []
        self._latest: LiveFrame | None = None
        self._latest_pixels: np.ndarray | None = None
        self._number = 0
        self._recorded_number = 0
        self._recorded_pixels: str | None = None
        self._video_pending: list[LiveFrame] = []
        self._error_reported = False
        self.captured = 0
        """Frames added to the video."""
        self.skipped = 0
        """Recording turns that found the screen unchanged."""
        self.grabs = 0
        """Screendumps taken (loop and stills)."""

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop (idempotent)."""
        with self._cv:
            if self._thread is not None or self._stopped:
                return
            self._thread = threading.Thread(target=self._run, name="deskvm-capture", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop, wait for it and record pending video frames (idempotent)."""
        with self._cv:
            self._stopped = True
            thread, self._thread = self._thread, None
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with contextlib.suppress(DeskvmError):
            self._flush_video()
        with self._grab_lock, self._cv:
            # Ended sessions stay listed for a while: keep no screen in memory.
            self._latest, self._latest_pixels = None, None
            self._viewers.clear()

    def replace_display(self, display: DisplayBackend) -> None:
        """Grab from ``display`` from now on (a session reset restored a new domain);
        viewers stay subscribed."""
        with self._grab_lock:
            self._display = display

    # --- viewers ------------------------------------------------------------------------

    @property
    def latest(self) -> LiveFrame | None:
        """The newest frame grabbed so far (``None`` before the first grab)."""
        return self._latest

    def subscribe(self, max_fps: float, wake: Callable[[], None]) -> Viewer:
        """A new viewer receiving changed frames; it is offered the newest one at once.

        Args:
            max_fps: the viewer's frame-rate cap (the loop grabs at least this often while
                it watches, at most 30 times a second).
            wake: called from the capture thread when a frame arrives (must not block).
        """
        viewer = Viewer(self, min(max_fps, MAX_STREAM_FPS), wake)
        with self._cv:
            self._viewers.append(viewer)
            self._kick = True
            self._cv.notify_all()
        latest = self._latest
        if latest is not None:
            viewer.offer(latest)
        return viewer

    def unsubscribe(self, viewer: Viewer) -> None:
        """Stop offering frames to ``viewer`` (idempotent)."""
        with self._cv:
            if viewer in self._viewers:
                self._viewers.remove(viewer)

    @property
    def viewers(self) -> int:
        """How many viewers watch."""
        return len(self._viewers)

    # --- grabbing -----------------------------------------------------------------------

    def grab(self) -> tuple[LiveFrame, bool]:
        """Take a screendump now and publish it to the viewers if it changed.

        Returns:
            The newest frame (this grab's, or the identical earlier one) and whether the
            screen changed.

        Raises:
            DisplayError: the screendump failed.
        """
        with self._grab_lock:
            pts_ns = self._clock.monotonic_ns()
            image = self._display.screendump()
            self.grabs += 1
            pixels = np.asarray(image)
            previous, latest = self._latest_pixels, self._latest
            if (
                latest is not None
                and previous is not None
                and previous.shape == pixels.shape
                and np.array_equal(previous, pixels)
            ):
                return latest, False
            self._number += 1
            frame = LiveFrame(self._number, pts_ns, image, pixels)
            with self._cv:
                if not self._stopped:
                    self._latest, self._latest_pixels = frame, pixels
                viewers = list(self._viewers)
        for viewer in viewers:
            viewer.offer(frame)
        return frame, True

    def capture_once(self) -> Event | None:
        """Grab now and add the screen to the video if it changed since the last recorded one.

        Returns:
            Its ``frame`` event, or ``None`` if unchanged.

        Raises:
            DisplayError: the screendump failed.
            RecorderError: the frame could not be recorded.
        """
        frame, _ = self.grab()
        return self._record(frame)

    def _record(self, frame: LiveFrame) -> Event | None:
        """Add ``frame`` to the video unless the video already shows these pixels."""
        with self._record_lock:
            if frame.number == self._recorded_number:
                self.skipped += 1
                self._recorder.tick(self._clock.monotonic_ns())
                return None
            pixels = pixel_hash(frame.image)
            self._recorded_number = frame.number
            if pixels == self._recorded_pixels:
                self.skipped += 1
                self._recorder.tick(self._clock.monotonic_ns())
                return None
            event = self._recorder.add_capture(frame.image, pts_ns=frame.pts_ns, pixels=pixels)
            self._recorded_pixels = pixels
            self.captured += 1
            return event

    def _flush_video(self) -> None:
        """Record the stills' frames waiting for the video, oldest first."""
        with self._cv:
            pending, self._video_pending = self._video_pending, []
        for frame in pending:
            self._record(frame)

    def still(self, *, reason: str, source: Source = "system") -> tuple[Event, Image.Image, bytes]:
        """Record a full-resolution PNG still of the screen now.

        Viewers get the grab at once; when the video is recorded, the still's pixels reach
        it on the loop's next turn (or at :meth:`stop`).

        Returns:
            The still's ``frame`` event, the image and its PNG bytes.

        Raises:
            DisplayError: the screendump failed.
            RecorderError: the still could not be recorded.
        """
        frame, _ = self.grab()
        return self.record_still(frame, reason=reason, source=source)

    def record_still(
        self, frame: LiveFrame, *, reason: str, source: Source = "system"
    ) -> tuple[Event, Image.Image, bytes]:
        """Record ``frame`` (a grab of this capture) as a PNG still; see :meth:`still`.

        Raises:
            RecorderError: the still could not be recorded.
        """
        png = encode_png(frame.pixels if frame.pixels.size else frame.image)
        event = self._recorder.add_frame(png, pts_ns=frame.pts_ns, reason=reason, source=source)
        if self._record_period_s is not None:
            with self._cv:
                running = self._thread is not None
                if running:
                    self._video_pending.append(frame)
            if not running:
                self._record(frame)
        return event, frame.image, png

    def wait_still(
        self, still_s: float, timeout_s: float, cancel: threading.Event | None = None
    ) -> tuple[LiveFrame, bool, float]:
        """Grab until the screen has been unchanged for ``still_s`` (at most ``timeout_s``).

        The wait starts now; a change seen by any grab (this wait's or the loop's) restarts
        the still period. Grabs come every ``still_s / 5`` seconds, between 1/30 s and
        0.1 s, so a settled screen is found within about a fifth of ``still_s`` of settling.

        Returns:
            The newest frame, whether it settled (``False``: timed out or cancelled) and
            the seconds waited.

        Raises:
            DisplayError: a screendump failed.
        """
        interval_s = min(max(still_s / 5, 1.0 / MAX_STREAM_FPS), 0.1)
        start = time.monotonic()
        frame, _ = self.grab()
        number, changed_at = frame.number, start
        while True:
            now = time.monotonic()
            if now - changed_at >= still_s:
                return frame, True, now - start
            if now - start >= timeout_s or (cancel is not None and cancel.is_set()):
                return frame, False, now - start
            wake = min(now + interval_s, start + timeout_s, changed_at + still_s)
            if cancel is not None:
                cancel.wait(max(0.0, wake - now))
            else:
                time.sleep(max(0.0, wake - now))
            frame, _ = self.grab()
            if frame.number != number:
                number, changed_at = frame.number, time.monotonic()

    # --- the loop -----------------------------------------------------------------------

    def _period_s(self) -> float | None:
        """Seconds between grabs now (``None``: nobody needs grabs)."""
        periods = [1.0 / v.max_fps for v in self._viewers]
        if self._record_period_s is not None:
            periods.append(self._record_period_s)
        return max(min(periods), 1.0 / MAX_STREAM_FPS) if periods else None

    def _run(self) -> None:
        next_grab: float | None = None
        next_record = time.monotonic()
        while True:
            with self._cv:
                if self._stopped:
                    return
                period = self._period_s()
                if self._kick:
                    self._kick = False
                    next_grab = time.monotonic()
                if period is None:
                    next_grab = None
                    self._cv.wait(_IDLE_WAIT_S)
                    continue
                if next_grab is None:  # the first turn comes one period after the start
                    next_grab = time.monotonic() + period
                wait_s = next_grab - time.monotonic()
                if wait_s > 0:
                    self._cv.wait(wait_s)
                    continue
            try:
                t0 = time.monotonic()
                next_grab = max(next_grab + period, t0)
                self._flush_video()
                frame, _ = self.grab()
                if self._record_period_s is not None and t0 >= next_record:
                    next_record = max(next_record + self._record_period_s, t0)
                    self._record(frame)
            except DeskvmError as exc:
                if not self._error_reported:
                    self._error_reported = True
                    with contextlib.suppress(DeskvmError):
                        self._recorder.append(
                            "marker", {"event": "capture_error", "error": exc.message}
                        )
