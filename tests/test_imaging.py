"""Screen image encoding: the fast PNG is a standard PNG of exactly the pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from orchestrator.imaging import encode_image, encode_png, scaled


def _screen() -> np.ndarray:
    rng = np.random.default_rng(7)
    pixels = np.full((200, 320, 3), (46, 74, 98), np.uint8)
    pixels[20:120, 40:200] = 250
    pixels[50:60, 50:300] = rng.integers(0, 255, (10, 250, 3), dtype=np.uint8)
    return pixels


@pytest.mark.parametrize("source", ["array", "image", "rgba-image"])
def test_png_round_trips_exactly(source: str) -> None:
    pixels = _screen()
    image = Image.fromarray(pixels)
    given = {"array": pixels, "image": image, "rgba-image": image.convert("RGBA")}[source]
    data = encode_png(given)
    with Image.open(io.BytesIO(data)) as decoded:
        assert decoded.format == "PNG" and decoded.mode == "RGB"
        assert np.array_equal(np.asarray(decoded), pixels)


def test_png_refuses_other_arrays() -> None:
    with pytest.raises(ValueError, match="uint8"):
        encode_png(np.zeros((4, 4), np.uint8))


@pytest.mark.parametrize(("codec", "fmt"), [("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")])
def test_stream_codecs(codec: str, fmt: str) -> None:
    image = Image.fromarray(_screen())
    with Image.open(io.BytesIO(encode_image(image, codec, 70))) as decoded:  # type: ignore[arg-type]
        assert (decoded.format, decoded.size) == (fmt, (320, 200))


def test_scaled_keeps_the_aspect_and_never_enlarges() -> None:
    image = Image.fromarray(_screen())
    assert scaled(image, 160).size == (160, 100)
    assert scaled(image, 1000) is image
    assert scaled(image, None) is image
