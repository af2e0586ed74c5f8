"""The display seam: frames out of the guest's screen, input events into it.

Input events follow QEMU's QMP ``input-send-event`` (``InputEvent`` union): absolute
pointer axes on a tablet range of ``0..0x7fff``, buttons by ``InputButton`` name, keys by
``QKeyCode`` (qcode). The backend converts display pixels to the tablet range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias

from PIL import Image

__all__ = [
    "ABS_MAX",
    "AbsMove",
    "ButtonEvent",
    "DisplayBackend",
    "Frame",
    "InputEvent",
    "KeyEvent",
    "WheelEvent",
    "pixel_to_abs",
]

ABS_MAX = 0x7FFF


def pixel_to_abs(pixel: int, size_px: int) -> int:
    """Map a pixel index ``0..size_px-1`` to QEMU's absolute axis ``0..0x7fff``.

    The guest maps the axis back with ``abs * size_px / 0x8000`` (X servers scale
    ``abs * (size_px - 1) / 0x7fff`` or similar); aiming at the centre of the pixel makes
    both land on ``pixel`` exactly, including the last one.
    """
    if size_px <= 1:
        return 0
    centre = (2 * pixel + 1) * (ABS_MAX + 1) // (2 * size_px)
    return max(0, min(ABS_MAX, centre))


@dataclass(frozen=True, slots=True)
class AbsMove:
    """Move the absolute pointer to display pixel ``(x, y)``."""

    x: int
    y: int


@dataclass(frozen=True, slots=True)
class ButtonEvent:
    """Press (``down=True``) or release a QMP ``InputButton`` (left, middle, right, side, extra)."""

    button: str
    down: bool


@dataclass(frozen=True, slots=True)
class WheelEvent:
    """One wheel notch. QMP models it as a press+release of wheel-up/down/left/right."""

    direction: Literal["up", "down", "left", "right"]


@dataclass(frozen=True, slots=True)
class KeyEvent:
    """Press (``down=True``) or release the key with QMP ``QKeyCode`` ``qcode``."""

    qcode: str
    down: bool


InputEvent: TypeAlias = AbsMove | ButtonEvent | WheelEvent | KeyEvent


@dataclass(frozen=True, slots=True)
class Frame:
    """One picture of the guest's screen.

    Attributes:
        image: RGB image, ``width_px`` x ``height_px``.
        pts_ns: monotonic capture time (``CLOCK_MONOTONIC`` ns).
    """

    image: Image.Image
    pts_ns: int

    @property
    def width_px(self) -> int:
        return self.image.width

    @property
    def height_px(self) -> int:
        return self.image.height


class DisplayBackend(Protocol):
    """Screen and input of one running domain."""

    def screendump(self) -> Image.Image:
        """Capture the screen now.

        Returns:
            RGB image at the guest's current resolution.

        Raises:
            DisplayError: the capture failed.
        """
        ...

    def horizontal_wheel(self) -> bool:
        """Whether :class:`WheelEvent` ``left``/``right`` reach the guest.

        (QEMU's ``InputButton`` has ``wheel-left``/``wheel-right`` since 8.1.)

        Raises:
            DisplayError: the backend could not be asked.
        """
        ...

    def close(self) -> None:
        """Release what the backend holds for its domain (called once it is destroyed)."""
        ...

    def key_flow_control(self) -> bool:
        """Whether :meth:`send` waits until the guest can take key events.

        When True, keys need no fixed pause between them: the guest's own acknowledgement
        paces them (see :mod:`orchestrator.display.qmp`). When False, the caller must pace
        them by time.
        """
        ...

    def send(self, events: Sequence[InputEvent], *, width_px: int, height_px: int) -> None:
        """Inject ``events`` in one batch (the guest sees them in order, back to back).

        ``width_px``/``height_px`` give the screen size that absolute moves refer to.

        Raises:
            DisplayError: injection failed.
        """
        ...
