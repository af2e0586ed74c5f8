"""Screenshot scaling: map coordinates between the client's image and the display. Pure.

A session may send screenshots scaled to a *client size* (a target size, or the size
:func:`scaled_size` computes for a maximum long edge). The agent then gives coordinates in
the scaled image; :class:`Scaler` maps them to the display's pixels and back.

The mapping, per axis, for a display of ``D`` pixels shown as ``C`` client pixels, is the
straight line through the first and the last pixel centres, rounded half up (integer
arithmetic, no floating point)::

    to_display(c) = round(c * (D - 1) / (C - 1)) = (2c(D - 1) + (C - 1)) // (2(C - 1))
    to_client(d)  = round(d * (C - 1) / (D - 1)) = (2d(C - 1) + (D - 1)) // (2(D - 1))

Hence

* ``0 -> 0`` and ``C - 1 -> D - 1`` for every pair of sizes: corners map to corners, every
  valid coordinate maps inside the screen (``0 <= to_display(c) <= D - 1``), no clamping;
* display 1280 shown as 1024: ``512 -> 640`` (the centre maps to the centre);
* with ``D >= C`` the display pixel chosen overlaps the area ``[c * D/C, (c + 1) * D/C)``
  that the client pixel shows;
* the round trip from the smaller space is exact: with ``D >= C`` (screenshots scaled
  down, the usual case) ``to_client(to_display(c)) == c`` for every client pixel, and
  with ``D <= C``, ``to_display(to_client(d)) == d``. The other way is lossy by nature
  (several display pixels share one client pixel); it lands within ``ceil(D / C)`` pixels.
* an axis of a single pixel maps everything to pixel 0.

Regions (``zoom``) are half-open ``[x0, x1)``; their edges scale outward (``floor`` for
the start, ``ceil`` for the end) so the display region covers everything the client
region showed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from agent_bridge.protocol.actions import (
    Action,
    Click,
    Drag,
    MouseDown,
    MouseUp,
    Move,
    Point,
    Scroll,
    Zoom,
)
from orchestrator.errors import ActionError, ConfigError

__all__ = ["Scaler", "scale_action", "scaled_size"]


def _check_size(width_px: int, height_px: int, what: str) -> None:
    for value in (width_px, height_px):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{what} must be positive integers, got {width_px}x{height_px}")


def scaled_size(width_px: int, height_px: int, max_long_edge_px: int) -> tuple[int, int]:
    """The client size for a display whose long edge may be at most ``max_long_edge_px``.

    Keeps the aspect ratio (the short edge is rounded to the nearest pixel, at least 1) and
    never scales up: a display that already fits is returned unchanged.
    E.g. ``(1280, 800, 1024) -> (1024, 640)``; ``(800, 1280, 1024) -> (640, 1024)``.

    Args:
        width_px, height_px: display size in pixels.
        max_long_edge_px: the longest edge the client accepts, in pixels.

    Returns:
        ``(width_px, height_px)`` of the client image.

    Raises:
        ConfigError: a size or the limit is not a positive integer.
    """
    _check_size(width_px, height_px, "display size")
    _check_size(max_long_edge_px, max_long_edge_px, "max_long_edge_px")
    long_px = max(width_px, height_px)
    if long_px <= max_long_edge_px:
        return width_px, height_px

    def shrink(edge_px: int) -> int:
        if edge_px == long_px:
            return max_long_edge_px
        return max(1, (2 * edge_px * max_long_edge_px + long_px) // (2 * long_px))

    return shrink(width_px), shrink(height_px)


def _scale(value: int, src: int, dst: int) -> int:
    """Pixel ``value`` of an axis of ``src`` pixels to the axis of ``dst`` pixels."""
    if src == 1:
        return 0
    return (2 * value * (dst - 1) + (src - 1)) // (2 * (src - 1))


@dataclass(frozen=True, slots=True)
class Scaler:
    """Maps client (scaled screenshot) pixels to display pixels and back.

    Both spaces have their origin top-left, x to the right, y down. See the module
    docstring for the exact mapping.

    Attributes:
        display_width_px, display_height_px: the guest display.
        client_width_px, client_height_px: the screenshots the client sees.

    Raises:
        ConfigError: on construction, if a size is not a positive integer.
    """

    display_width_px: int
    display_height_px: int
    client_width_px: int
    client_height_px: int

    def __post_init__(self) -> None:
        _check_size(self.display_width_px, self.display_height_px, "display size")
        _check_size(self.client_width_px, self.client_height_px, "client size")

    @classmethod
    def identity(cls, width_px: int, height_px: int) -> Scaler:
        """No scaling: client pixels are display pixels."""
        return cls(width_px, height_px, width_px, height_px)

    @classmethod
    def for_max_long_edge(cls, width_px: int, height_px: int, max_long_edge_px: int) -> Scaler:
        """Scaling to the client size :func:`scaled_size` gives."""
        return cls(width_px, height_px, *scaled_size(width_px, height_px, max_long_edge_px))

    @property
    def is_identity(self) -> bool:
        """True when client and display sizes are equal."""
        return (self.display_width_px, self.display_height_px) == (
            self.client_width_px,
            self.client_height_px,
        )

    def to_display(self, x: int, y: int) -> Point:
        """Client pixel ``(x, y)`` to the display pixel it shows.

        Raises:
            ActionError: code ``out_of_screen`` if ``(x, y)`` is outside the client image.
        """
        if not (0 <= x < self.client_width_px and 0 <= y < self.client_height_px):
            raise ActionError(
                f"point ({x}, {y}) is outside the {self.client_width_px}x"
                f"{self.client_height_px} screenshot (valid x 0..{self.client_width_px - 1}, "
                f"y 0..{self.client_height_px - 1})",
                code="out_of_screen",
            )
        return (
            _scale(x, self.client_width_px, self.display_width_px),
            _scale(y, self.client_height_px, self.display_height_px),
        )

    def to_client(self, x: int, y: int) -> Point:
        """Display pixel ``(x, y)`` (e.g. the pointer position) to the client pixel showing it.

        Raises:
            ActionError: code ``out_of_screen`` if ``(x, y)`` is outside the display.
        """
        if not (0 <= x < self.display_width_px and 0 <= y < self.display_height_px):
            raise ActionError(
                f"point ({x}, {y}) is outside the {self.display_width_px}x"
                f"{self.display_height_px} display",
                code="out_of_screen",
            )
        return (
            _scale(x, self.display_width_px, self.client_width_px),
            _scale(y, self.display_height_px, self.client_height_px),
        )

    def region_to_display(self, x0: int, y0: int, x1: int, y1: int) -> tuple[int, int, int, int]:
        """Half-open client region ``[x0, x1) x [y0, y1)`` to the display region covering it.

        Raises:
            ActionError: code ``out_of_screen`` if the region is empty or leaves the image.
        """
        cw, ch = self.client_width_px, self.client_height_px
        if not (0 <= x0 < x1 <= cw and 0 <= y0 < y1 <= ch):
            raise ActionError(
                f"region [{x0}, {y0}, {x1}, {y1}] is empty or outside the {cw}x{ch} screenshot",
                code="out_of_screen",
            )
        dw, dh = self.display_width_px, self.display_height_px
        return (
            (x0 * dw) // cw,
            (y0 * dh) // ch,
            -((-x1 * dw) // cw),
            -((-y1 * dh) // ch),
        )


def scale_action(action: Action, scaler: Scaler) -> Action:
    """``action`` with every coordinate mapped from client to display pixels.

    Actions without coordinates (and clicks/scrolls "where the pointer is") are returned
    unchanged; scroll amounts are wheel notches and do not scale.

    Raises:
        ActionError: code ``out_of_screen`` for a coordinate outside the client image.
    """
    if scaler.is_identity:
        return action
    match action:
        case Move(x=x, y=y):
            return replace(action, x=scaler.to_display(x, y)[0], y=scaler.to_display(x, y)[1])
        case Click(x=int() as x, y=int() as y) | Scroll(x=int() as x, y=int() as y):
            dx, dy = scaler.to_display(x, y)
            return replace(action, x=dx, y=dy)
        case MouseDown(x=int() as x, y=int() as y) | MouseUp(x=int() as x, y=int() as y):
            dx, dy = scaler.to_display(x, y)
            return replace(action, x=dx, y=dy)
        case Drag(path=path):
            return replace(action, path=tuple(scaler.to_display(px, py) for px, py in path))
        case Zoom(x0=x0, y0=y0, x1=x1, y1=y1):
            return Zoom(*scaler.region_to_display(x0, y0, x1, y1))
        case _:
            return action
