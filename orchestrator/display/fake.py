"""An in-package fake display: a drawn desktop that keeps every input event it receives.

Use it (through :class:`orchestrator.hypervisor.fake.FakeHypervisor`) to test clients
and servers without a VM. It models a US keyboard typing into a shell: printable keys
accumulate on a line and Return hands the line to ``on_line`` (the fake guest echoes it
to its guest log).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from PIL import Image, ImageDraw

from orchestrator.display.base import AbsMove, ButtonEvent, InputEvent, KeyEvent, WheelEvent

__all__ = ["FakeDisplay"]

_PLAIN = {
    "spc": " ", "minus": "-", "equal": "=", "bracket_left": "[", "bracket_right": "]",
    "backslash": "\\", "semicolon": ";", "apostrophe": "'", "grave_accent": "`",
    "comma": ",", "dot": ".", "slash": "/", "tab": "\t",
}  # fmt: skip
_SHIFTED = {
    "1": "!", "2": "@", "3": "#", "4": "$", "5": "%", "6": "^", "7": "&", "8": "*",
    "9": "(", "0": ")", "minus": "_", "equal": "+", "bracket_left": "{",
    "bracket_right": "}", "backslash": "|", "semicolon": ":", "apostrophe": '"',
    "grave_accent": "~", "comma": "<", "dot": ">", "slash": "?", "spc": " ", "tab": "\t",
}  # fmt: skip


class FakeDisplay:
    """:class:`~orchestrator.display.base.DisplayBackend` that draws a fake desktop.

    Args:
        width_px, height_px: screen size.
        background_rgb: root window colour (matches the image's readiness check).
        on_line: called with each line "typed" (on Return).
    """

    def __init__(
        self,
        width_px: int,
        height_px: int,
        *,
        background_rgb: tuple[int, int, int] = (0x2E, 0x4A, 0x62),
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.width_px = width_px
        self.height_px = height_px
        self.background_rgb = background_rgb
        self.events: list[InputEvent] = []
        self.batches: int = 0
        self.pointer: tuple[int, int] = (0, 0)
        self.pressed_keys: set[str] = set()
        self.pressed_buttons: set[str] = set()
        self.fail_next_screendump: Exception | None = None
        self._line = ""
        self._on_line = on_line
        self._lock = threading.Lock()

    def screendump(self) -> Image.Image:
        with self._lock:
            if self.fail_next_screendump is not None:
                exc, self.fail_next_screendump = self.fail_next_screendump, None
                raise exc
            image = Image.new("RGB", (self.width_px, self.height_px), self.background_rgb)
            draw = ImageDraw.Draw(image)
            w, h = self.width_px, self.height_px
            draw.rectangle((w // 8, h // 8, w // 2, h // 2), fill=(250, 250, 250))
            draw.text((w // 8 + 4, h // 8 + 4), "desk@deskvm:~$ " + self._line, fill=(0, 0, 0))
            x, y = self.pointer
            draw.rectangle((x, y, min(w - 1, x + 3), min(h - 1, y + 3)), fill=(255, 0, 0))
            return image

    def send(self, events: Sequence[InputEvent], *, width_px: int, height_px: int) -> None:
        with self._lock:
            self.batches += 1
            for event in events:
                self.events.append(event)
                self._apply(event)

    def _apply(self, event: InputEvent) -> None:
        match event:
            case AbsMove(x=x, y=y):
                self.pointer = (x, y)
            case ButtonEvent(button=b, down=down):
                (self.pressed_buttons.add if down else self.pressed_buttons.discard)(b)
            case WheelEvent():
                pass
            case KeyEvent(qcode=q, down=True):
                self.pressed_keys.add(q)
                self._type(q)
            case KeyEvent(qcode=q, down=False):
                self.pressed_keys.discard(q)

    def _type(self, qcode: str) -> None:
        shift = bool(self.pressed_keys & {"shift", "shift_r"})
        if self.pressed_keys & {"ctrl", "ctrl_r", "alt", "alt_r", "meta_l", "meta_r"}:
            return
        if qcode in ("ret", "kp_enter"):
            line, self._line = self._line, ""
            if self._on_line is not None:
                self._on_line(line)
            return
        if qcode == "backspace":
            self._line = self._line[:-1]
            return
        if len(qcode) == 1:
            self._line += (
                qcode.upper()
                if shift and qcode.isalpha()
                else (_SHIFTED.get(qcode, qcode) if shift else qcode)
            )
            return
        table = _SHIFTED if shift else _PLAIN
        if qcode in table:
            self._line += table[qcode]

    def typed_text(self) -> str:
        """The current (unfinished) line."""
        with self._lock:
            return self._line
