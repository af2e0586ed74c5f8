"""What an executed action returns, as frozen values, and their deskvm wire shape. Pure."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = ["CursorResult", "Done", "GuestResult", "ImageResult", "Result", "to_deskvm_result"]


@dataclass(frozen=True, slots=True)
class ImageResult:
    """An image of the screen (``screenshot``) or of a region of it (``zoom``).

    Attributes:
        width_px, height_px: size of the encoded image.
        mime: ``"image/png"``.
        data: the encoded image bytes.
        frame_seq: recording sequence number of the frame event it was cut from.
        t_s: that frame's time in the recording: seconds from the recording's monotonic
            origin to the frame's ``pts_ns`` (what ``deskvm replay frames --at`` takes).
    """

    width_px: int
    height_px: int
    mime: str
    data: bytes
    frame_seq: int | None = None
    t_s: float | None = None


@dataclass(frozen=True, slots=True)
class CursorResult:
    """Pointer position in display pixels (origin top-left)."""

    x: int
    y: int


@dataclass(frozen=True, slots=True)
class Done:
    """An action that returns nothing but completion (``click``, ``type``...).

    Attributes:
        detail: optional facts about the execution, e.g. ``{"chars": 12}``.
    """

    detail: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class GuestResult:
    """What a guest control action returned (``exec``, ``get_file``, ``windows``...).

    Attributes:
        data: the reply's ``result`` object (JSON-ready; shapes in docs/protocol.md).
        record: what the recording keeps of it: sizes and hashes, never contents.
    """

    data: Mapping[str, Any]
    record: Mapping[str, Any]


Result: TypeAlias = ImageResult | CursorResult | Done | GuestResult


def to_deskvm_result(result: Result) -> dict[str, Any]:
    """The ``result`` object of a deskvm-schema reply.

    ``ImageResult`` -> ``{"width", "height", "mime", "data", "frame_seq", "t_s"}``
    (``data`` base64, RFC 4648; ``frame_seq``/``t_s`` only when known).
    """
    match result:
        case ImageResult():
            out: dict[str, Any] = {
                "width": result.width_px,
                "height": result.height_px,
                "mime": result.mime,
                "data": base64.b64encode(result.data).decode("ascii"),
            }
            if result.frame_seq is not None:
                out["frame_seq"] = result.frame_seq
            if result.t_s is not None:
                out["t_s"] = result.t_s
            return out
        case CursorResult(x=x, y=y):
            return {"x": x, "y": y}
        case Done(detail=detail):
            return dict(detail)
        case GuestResult(data=data):
            return dict(data)
