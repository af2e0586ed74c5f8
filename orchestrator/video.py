"""Continuous capture as a segmented H.264 video (PyAV), and reading frames back out.

A recording's continuous capture is cut into short, self-contained MP4 *segments*
(``video/000000.mp4``, ``video/000001.mp4``...). A segment is finished (file closed) every
``segment_s`` seconds of capture and whenever the frame size changes (a segment has one
size). Segments are *fragmented* MP4 (``empty_moov``, a ``moof``/``mdat`` fragment about
every :data:`FRAGMENT_S` seconds, each written out as soon as it is complete): a crash
(kill -9) leaves the segment being written playable up to its last complete fragment, so
it loses at most the frames of the fragment in progress. Frames have variable timing
(unchanged frames are skipped): each frame's ``pts`` is its capture time in milliseconds
since the segment's first frame (``time_base`` = 1/1000 s), and the recording's ``frame``
events map each (segment, index) to the exact monotonic ``pts_ns``.

Errors: every PyAV/FFmpeg failure is translated into
:class:`~orchestrator.errors.RecorderError`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
from PIL import Image

from orchestrator.errors import RecorderError

__all__ = [
    "CODEC",
    "FRAGMENT_S",
    "SegmentWriter",
    "count_decodable_frames",
    "decode_segment",
    "file_sha256",
    "pixel_hash",
]

CODEC = "libx264"
FRAGMENT_S = 1.0
"""Length of one MP4 fragment, seconds of capture: the most a crash loses of a segment."""
_TIME_BASE = Fraction(1, 1000)


def pixel_hash(image: Image.Image) -> str:
    """sha256 (hex) of the RGB pixels of ``image``: equal frames have equal hashes."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes.

    Raises:
        RecorderError: the file cannot be read.
    """
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise RecorderError(f"cannot read {path}: {exc}") from exc
    return digest.hexdigest()


class SegmentWriter:
    """Encodes one video segment (H.264 in MP4, yuv420p).

    Args:
        path: the ``.mp4`` file to create.
        width_px, height_px: frame size (odd sizes are cropped to even: H.264 4:2:0).
        crf: x264 constant rate factor (lower is better quality; 23 is x264's default).
        preset: x264 speed preset (``ultrafast`` keeps the recording's CPU cost low).

    Raises:
        RecorderError: the file or the encoder cannot be opened.
    """

    def __init__(
        self,
        path: Path,
        *,
        width_px: int,
        height_px: int,
        crf: int = 23,
        preset: str = "ultrafast",
    ) -> None:
        self.path = path
        self.size_px = (width_px, height_px)
        """The frame size this segment takes (as given; encoded cropped to even)."""
        self.width_px = width_px - width_px % 2
        self.height_px = height_px - height_px % 2
        self.frames = 0
        self.first_pts_ns: int | None = None
        self.last_pts_ns: int | None = None
        self._last_pts_ms = -1
        try:
            self._container: Any = av.open(
                str(path),
                mode="w",
                format="mp4",
                options={
                    # Fragmented MP4: an empty moov first, then self-contained fragments
                    # flushed as they complete (a killed writer leaves a playable prefix).
                    "movflags": "frag_keyframe+empty_moov+default_base_moof",
                    "frag_duration": str(int(FRAGMENT_S * 1_000_000)),
                    "flush_packets": "1",
                },
            )
            stream: Any = self._container.add_stream(CODEC, rate=1000)
            stream.width = self.width_px
            stream.height = self.height_px
            stream.pix_fmt = "yuv420p"
            stream.time_base = _TIME_BASE
            stream.codec_context.time_base = _TIME_BASE
            stream.options = {"crf": str(crf), "preset": preset, "tune": "stillimage"}
            self._stream = stream
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise RecorderError(f"cannot open video segment {path}: {exc}") from exc

    def add(self, image: Image.Image, *, pts_ns: int) -> int:
        """Encode one frame captured at ``pts_ns`` (monotonic ns); returns its index.

        Raises:
            RecorderError: encoding or writing failed.
        """
        if self.first_pts_ns is None:
            self.first_pts_ns = pts_ns
        # Strictly increasing pts in ms (two captures within 1 ms get consecutive values).
        pts_ms = max((pts_ns - self.first_pts_ns) // 1_000_000, self._last_pts_ms + 1)
        self._last_pts_ms = pts_ms
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        if rgb.size != (self.width_px, self.height_px):
            rgb = rgb.crop((0, 0, self.width_px, self.height_px))
        try:
            frame = av.VideoFrame.from_image(rgb)  # type: ignore[no-untyped-call]
            frame.pts = pts_ms
            frame.time_base = _TIME_BASE
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise RecorderError(f"cannot encode into {self.path}: {exc}") from exc
        self.last_pts_ns = pts_ns
        self.frames += 1
        return self.frames - 1

    def close(self) -> None:
        """Flush the encoder and finish the file (idempotent).

        Raises:
            RecorderError: the file could not be finished.
        """
        if self._container is None:
            return
        container, self._container = self._container, None
        try:
            for packet in self._stream.encode(None):
                container.mux(packet)
            container.close()
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise RecorderError(f"cannot finish video segment {self.path}: {exc}") from exc


_CACHE: OrderedDict[tuple[str, float], list[Image.Image]] = OrderedDict()
_CACHE_SEGMENTS = 4


def decode_segment(path: Path) -> list[Image.Image]:
    """Every frame of a segment, in order (index ``i`` is the ``frame`` event's ``index``).

    The last few decoded segments are cached (keyed by path and mtime) so that seeking
    within a segment costs one decode.

    Raises:
        RecorderError: missing file, or not a readable video (e.g. the segment a crash
            interrupted).
    """
    try:
        key = (str(path.resolve()), path.stat().st_mtime)
    except OSError as exc:
        raise RecorderError(f"cannot read video segment {path}: {exc}") from exc
    cached = _CACHE.get(key)
    if cached is not None:
        _CACHE.move_to_end(key)
        return cached
    try:
        with av.open(str(path)) as container:
            frames = [f.to_image() for f in container.decode(video=0)]  # type: ignore[no-untyped-call]
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise RecorderError(f"{path} is not a readable video segment: {exc}") from exc
    _CACHE[key] = frames
    while len(_CACHE) > _CACHE_SEGMENTS:
        _CACHE.popitem(last=False)
    return frames


def count_decodable_frames(path: Path) -> int:
    """How many frames of a segment decode, from the start up to the first error.

    For the segment a killed writer left behind: a fragmented MP4 decodes up to its last
    complete fragment. ``0`` for a missing, empty or unreadable file; never raises.
    """
    count = 0
    try:
        with av.open(str(path)) as container:
            for _frame in container.decode(video=0):
                count += 1
    except (av.FFmpegError, OSError, ValueError, EOFError):
        pass
    return count
