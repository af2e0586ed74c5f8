"""Continuous frame capture for one session, behind the display and recorder seams.

:class:`FrameCapture` runs a daemon thread that takes a ``screendump`` every
``1 / fps`` seconds, skips frames whose pixels did not change (sha256 compare) and hands
the others to :meth:`Recorder.add_capture` (the video). :meth:`FrameCapture.still` takes a
full-resolution PNG still on demand (the session calls it at every input moment); a still
also feeds the video when its pixels are new, so the video shows every moment a still
shows.

Errors in the thread never reach the session's actions: the first one is recorded as a
``marker`` event and the loop keeps trying (a display that stops answering is the
session's business, not the recorder's).
"""

from __future__ import annotations

import contextlib
import io
import threading

from PIL import Image

from orchestrator.clock import Clock
from orchestrator.display.base import DisplayBackend
from orchestrator.errors import DeskvmError
from orchestrator.recorder import Event, Recorder, Source
from orchestrator.video import pixel_hash

__all__ = ["FrameCapture"]


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


class FrameCapture:
    """Capture loop of one session.

    Args:
        display: where frames come from (QMP ``screendump`` in production).
        recorder: where they go.
        clock: timestamps (``pts_ns``, monotonic).
        fps: capture rate, frames per second (2-5 is sensible under TCG).

    Thread safety: :meth:`still` and the loop serialize on one lock.
    """

    def __init__(
        self, display: DisplayBackend, recorder: Recorder, clock: Clock, *, fps: float
    ) -> None:
        if fps <= 0:
            raise ValueError("fps must be positive")
        self._display = display
        self._recorder = recorder
        self._clock = clock
        self._period_s = 1.0 / fps
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_pixels: str | None = None
        self._error_reported = False
        self.captured = 0
        self.skipped = 0

    def start(self) -> None:
        """Start the loop (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="deskvm-capture", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and wait for it (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.capture_once()
            except DeskvmError as exc:
                if not self._error_reported:
                    self._error_reported = True
                    with contextlib.suppress(DeskvmError):
                        self._recorder.append(
                            "marker", {"event": "capture_error", "error": exc.message}
                        )

    def capture_once(self) -> Event | None:
        """Take one frame now; returns its ``frame`` event, or ``None`` if unchanged.

        Raises:
            DisplayError: the screendump failed.
            RecorderError: the frame could not be recorded.
        """
        with self._lock:
            pts_ns = self._clock.monotonic_ns()
            image = self._display.screendump()
            return self._feed(image, pts_ns)

    def _feed(self, image: Image.Image, pts_ns: int) -> Event | None:
        pixels = pixel_hash(image)
        if pixels == self._last_pixels:
            self.skipped += 1
            self._recorder.tick(pts_ns)
            return None
        event = self._recorder.add_capture(image, pts_ns=pts_ns, pixels=pixels)
        self._last_pixels = pixels
        self.captured += 1
        return event

    def still(self, *, reason: str, source: Source = "system") -> tuple[Event, Image.Image, bytes]:
        """Record a full-resolution PNG still of the screen now (and feed the video).

        Returns:
            The still's ``frame`` event, the image and its PNG bytes.

        Raises:
            DisplayError: the screendump failed.
            RecorderError: the still could not be recorded.
        """
        with self._lock:
            pts_ns = self._clock.monotonic_ns()
            image = self._display.screendump()
            self._feed(image, pts_ns)
            png = _png(image)
            event = self._recorder.add_frame(png, pts_ns=pts_ns, reason=reason, source=source)
            return event, image, png
