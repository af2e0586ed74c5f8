"""Encoding screen images: PNG for screenshots and stills, JPEG/WebP/PNG for the live stream.

PNG is written here rather than by Pillow's encoder: a desktop screen compresses as well
without PNG's per-row filters (measured on 1280x800 desktop frames: 20-38 kB either way),
and the deflate runs in ISA-L (``isal``: Intel's optimized zlib-compatible compressor),
0.25 ms at level 1 where zlib takes 4.3 ms and Pillow's filtered encode 13 ms on the same
frame. That was most of what a screenshot cost beyond the screendump itself. The output is
a standard PNG (ISO/IEC 15948): 8-bit RGB, filter type 0 on every row, one zlib stream
(stdlib ``zlib`` where ``isal`` is not installed). JPEG and WebP come from Pillow
(libjpeg-turbo, libwebp).
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
from PIL import Image

try:
    from isal import isal_zlib

    _compress: Callable[[bytes | memoryview, int], bytes] = isal_zlib.compress
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the same format
    _compress = zlib.compress

from agent_bridge.protocol.stream import Codec

__all__ = ["encode_image", "encode_png", "scaled"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(image: Image.Image | np.ndarray, *, level: int = 1) -> bytes:
    """PNG bytes of ``image`` (an image, converted to 8-bit RGB, or an ``(h, w, 3)``
    ``uint8`` array), deflate ``level`` 0..3 (1: fast; ISA-L's levels).

    Raises:
        ValueError: ``level`` out of range, or an array of another shape.
    """
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"need an (h, w, 3) uint8 array, not {image.shape} {image.dtype}")
        height, width = image.shape[:2]
        pixels = image.reshape(height, width * 3)
    else:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        width, height = rgb.size
        pixels = np.asarray(rgb, dtype=np.uint8).reshape(height, width * 3)
    rows = np.empty((height, width * 3 + 1), dtype=np.uint8)
    rows[:, 0] = 0  # filter type None
    rows[:, 1:] = pixels
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join(
        (
            _PNG_SIGNATURE,
            _chunk(b"IHDR", ihdr),
            _chunk(b"IDAT", _compress(rows.data, level)),
            _chunk(b"IEND", b""),
        )
    )


def scaled(image: Image.Image, max_long_edge: int | None) -> Image.Image:
    """``image`` shrunk (aspect kept, never enlarged) so its long edge is <= ``max_long_edge``."""
    if max_long_edge is None or max(image.size) <= max_long_edge:
        return image
    factor = max_long_edge / max(image.size)
    size = (max(1, round(image.width * factor)), max(1, round(image.height * factor)))
    return image.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0)


def encode_image(image: Image.Image, codec: Codec, quality: int = 80) -> bytes:
    """``image`` as a JPEG, WebP or PNG file.

    Args:
        codec: ``jpeg``, ``webp`` or ``png``.
        quality: 1..100 for JPEG and WebP (ignored for PNG).
    """
    if codec == "png":
        return encode_png(image)
    buf = io.BytesIO()
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    if codec == "jpeg":
        rgb.save(buf, format="JPEG", quality=quality)
    else:
        # method 0: libwebp's fastest (a live stream favours time over bytes).
        rgb.save(buf, format="WEBP", quality=quality, method=0)
    return buf.getvalue()
