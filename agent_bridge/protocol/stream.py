"""The live stream's wire format (``/v1/sessions/{id}/stream``). Pure: bytes in, values out.

Every frame is one binary WebSocket message: a fixed header followed by one complete
encoded image (a JPEG, WebP or PNG file). All header fields are big-endian (network order)::

    offset size field
    0      2    header_bytes  u16  size of the header (24 in version 1; skip extra bytes
                                   a later version may add)
    2      1    version       u8   1
    3      1    codec         u8   1 = JPEG, 2 = WebP, 3 = PNG
    4      4    frame         u32  the session's frame number (grows by one per changed
                                   screen; gaps mean frames this viewer skipped)
    8      8    pts_ns        u64  capture time, CLOCK_MONOTONIC ns of the server host
    16     2    width_px      u16  size of the encoded image
    18     2    height_px     u16
    20     4    flags         u32  bit 0: the first frame of this connection (the screen
                                   as it was, not a change); other bits 0
    24     ...  image bytes

Text messages on the same socket are JSON events (``{"event": "hello", ...}``,
``{"event": "status", ...}``); see ``docs/protocol.md``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

from orchestrator.errors import ProtocolError

__all__ = [
    "CODECS",
    "FLAG_FIRST",
    "HEADER_BYTES",
    "MAX_STREAM_FPS",
    "STREAM_VERSION",
    "Codec",
    "FrameHeader",
    "StreamParams",
    "decode_frame",
    "encode_frame",
    "parse_stream_query",
]

Codec = Literal["jpeg", "webp", "png"]
CODECS: tuple[Codec, ...] = ("jpeg", "webp", "png")
_CODEC_IDS: dict[Codec, int] = {"jpeg": 1, "webp": 2, "png": 3}
_CODEC_NAMES: dict[int, Codec] = {v: k for k, v in _CODEC_IDS.items()}
MIME: dict[Codec, str] = {"jpeg": "image/jpeg", "webp": "image/webp", "png": "image/png"}

STREAM_VERSION = 1
HEADER_BYTES = 24
FLAG_FIRST = 1
"""Header flag: the connection's first frame (the current screen, sent on connect)."""
MAX_STREAM_FPS = 30.0
"""Highest frame rate a viewer may ask for (frames per second)."""

_HEADER = struct.Struct(">HBBIQHHI")
assert _HEADER.size == HEADER_BYTES


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The header of one stream frame (see the module docstring).

    Attributes:
        frame: the session's frame number.
        pts_ns: capture time, ``CLOCK_MONOTONIC`` ns of the server host.
        width_px, height_px: size of the encoded image, pixels.
        codec: ``jpeg``, ``webp`` or ``png``.
        flags: bit field (:data:`FLAG_FIRST`).
    """

    frame: int
    pts_ns: int
    width_px: int
    height_px: int
    codec: Codec
    flags: int = 0

    @property
    def first(self) -> bool:
        """Whether this is the connection's first frame."""
        return bool(self.flags & FLAG_FIRST)

    @property
    def mime(self) -> str:
        """The image's media type (``image/jpeg``...)."""
        return MIME[self.codec]


def encode_frame(header: FrameHeader, image: bytes) -> bytes:
    """One binary stream message: the header, then the encoded image."""
    packed = _HEADER.pack(
        HEADER_BYTES,
        STREAM_VERSION,
        _CODEC_IDS[header.codec],
        header.frame & 0xFFFFFFFF,
        header.pts_ns,
        header.width_px,
        header.height_px,
        header.flags,
    )
    return packed + image


def decode_frame(message: bytes) -> tuple[FrameHeader, bytes]:
    """Split one binary stream message into its header and image bytes.

    Raises:
        ProtocolError: code ``invalid_frame``: too short, unknown version or codec.
    """
    if len(message) < HEADER_BYTES:
        raise ProtocolError(
            f"stream frame of {len(message)} bytes is shorter than its header",
            code="invalid_frame",
        )
    size, version, codec_id, frame, pts_ns, width, height, flags = _HEADER.unpack_from(message)
    if version != STREAM_VERSION or size < HEADER_BYTES or size > len(message):
        raise ProtocolError(
            f"unsupported stream frame (version {version}, header {size} bytes)",
            code="invalid_frame",
        )
    codec = _CODEC_NAMES.get(codec_id)
    if codec is None:
        raise ProtocolError(f"unknown stream codec id {codec_id}", code="invalid_frame")
    return FrameHeader(frame, pts_ns, width, height, codec, flags), message[size:]


@dataclass(frozen=True, slots=True)
class StreamParams:
    """What a viewer asked for.

    Attributes:
        codec: image format of every frame.
        quality: 1..100 for JPEG and WebP (higher is better); ignored for PNG.
        max_fps: at most this many frames per second (0 < max_fps <= 30).
        max_long_edge: shrink frames (aspect kept, never enlarged) so the long edge is at
            most this many pixels; ``None``: full display resolution.
    """

    codec: Codec = "jpeg"
    quality: int = 80
    max_fps: float = 15.0
    max_long_edge: int | None = None


_STREAM_QUERY = ("codec", "quality", "max_fps", "max_long_edge")


def parse_stream_query(query: dict[str, str] | list[tuple[str, str]]) -> StreamParams:
    """The viewer's parameters from the stream URL's query.

    Args:
        query: name -> value (or pairs, to catch repeated names).

    Raises:
        ProtocolError: code ``invalid_query``: an unknown or repeated parameter (the
            message names it and lists the known ones), or a bad value.
    """
    pairs = list(query.items()) if isinstance(query, dict) else list(query)
    names = [k for k, _ in pairs]
    unknown = sorted({k for k in names if k not in _STREAM_QUERY})
    if unknown:
        raise ProtocolError(
            f"unknown query parameter{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(k) for k in unknown)}; the stream takes: {', '.join(_STREAM_QUERY)}",
            code="invalid_query",
        )
    repeated = sorted({k for k in names if names.count(k) > 1})
    if repeated:
        raise ProtocolError(
            f"query parameter {repeated[0]!r} given more than once", code="invalid_query"
        )
    values = dict(pairs)
    codec = values.get("codec", "jpeg")
    if codec not in CODECS:
        raise ProtocolError(
            f"codec must be one of {', '.join(CODECS)}, not {codec!r}", code="invalid_query"
        )
    quality = _int(values, "quality", 80, 1, 100) or 80
    fps_text = values.get("max_fps", "15")
    try:
        max_fps = float(fps_text)
    except ValueError:
        max_fps = -1.0
    if not 0 < max_fps <= MAX_STREAM_FPS:
        raise ProtocolError(
            f"max_fps must be a number in (0, {MAX_STREAM_FPS:g}], not {fps_text!r}",
            code="invalid_query",
        )
    edge = _int(values, "max_long_edge", None, 16, 4096)
    return StreamParams(codec=codec, quality=quality, max_fps=max_fps, max_long_edge=edge)


def _int(values: dict[str, str], name: str, default: int | None, lo: int, hi: int) -> int | None:
    text = values.get(name)
    if text is None:
        return default
    if not text.isdigit() or not lo <= int(text) <= hi:
        raise ProtocolError(
            f"{name} must be an integer {lo}..{hi}, not {text!r}", code="invalid_query"
        )
    return int(text)
