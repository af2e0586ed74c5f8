"""Encoding screen images: PNG for screenshots and stills, JPEG/WebP/PNG for the live stream.

PNG is written here rather than by Pillow's encoder: a desktop screen compresses as well
without PNG's per-row filters (measured on 1280x800 desktop frames: 38 kB either way), and
skipping the adaptive filter choice makes the encode about twice as fast (6 ms instead of
13 ms), which is most of what a screenshot costs beyond the screendump itself. The output
is a standard PNG (ISO/IEC 15948): 8-bit RGB, filter type 0 on every row, one zlib stream.
JPEG and WebP come from Pillow (libjpeg-turbo, libwebp).
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from agent_bridge.protocol.stream import Codec

__all__ = ["encode_image", "encode_png", "scaled"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(image: Image.Image, *, level: int = 1) -> bytes:
    """PNG bytes of ``image`` (converted to 8-bit RGB), zlib ``level`` 0..9 (1: fast).

    Raises:
        ValueError: ``level`` out of range.
    """
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
            _chunk(b"IDAT", zlib.compress(rows.data, level)),
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
