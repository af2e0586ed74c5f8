"""An in-package fake display: a drawn desktop that keeps every input event it receives.

Use it (through :class:`orchestrator.hypervisor.fake.FakeHypervisor`) to test clients
and servers without a VM. It models a US keyboard typing into a shell: printable keys
accumulate on a line and Return hands the line to ``on_line`` (the fake guest echoes it
to its guest log).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from PIL import Image, ImageDraw

from orchestrator.display.base import AbsMove, ButtonEvent, InputEvent, KeyEvent, WheelEvent
from orchestrator.errors import DisplayError, GuestHelperError

__all__ = ["FakeDisplay", "FakeGuestHelper"]

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
        horizontal_wheel: whether it takes horizontal wheel events (a QEMU 8.1+ host);
            when not, the session scrolls sideways through the guest helper.
        boot_screens: how many screendumps show a boot console first (a text screen of
            ``boot_size_px``, as a real guest shows before X starts).
        boot_size_px: the boot console's size.
        key_flow_control: what :meth:`key_flow_control` answers (a virtio keyboard whose
            queue the host can read).
    """

    def __init__(
        self,
        width_px: int,
        height_px: int,
        *,
        background_rgb: tuple[int, int, int] = (0x2E, 0x4A, 0x62),
        on_line: Callable[[str], None] | None = None,
        horizontal_wheel: bool = True,
        boot_screens: int = 0,
        boot_size_px: tuple[int, int] = (720, 400),
        key_flow_control: bool = False,
    ) -> None:
        self.boot_screens = boot_screens
        self.boot_size_px = boot_size_px
        self.has_horizontal_wheel = horizontal_wheel
        self.has_key_flow_control = key_flow_control
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
            if self.boot_screens > 0:
                self.boot_screens -= 1
                console = Image.new("RGB", self.boot_size_px, (0, 0, 0))
                text = f"[    {self.boot_screens:2d}.000000] booting"
                ImageDraw.Draw(console).text((4, 4), text, fill=(170, 170, 170))
                return console
            image = Image.new("RGB", (self.width_px, self.height_px), self.background_rgb)
            draw = ImageDraw.Draw(image)
            w, h = self.width_px, self.height_px
            draw.rectangle((w // 8, h // 8, w // 2, h // 2), fill=(250, 250, 250))
            draw.text((w // 8 + 4, h // 8 + 4), "desk@deskvm:~$ " + self._line, fill=(0, 0, 0))
            x, y = self.pointer
            draw.rectangle((x, y, min(w - 1, x + 3), min(h - 1, y + 3)), fill=(255, 0, 0))
            return image

    def horizontal_wheel(self) -> bool:
        return self.has_horizontal_wheel

    def close(self) -> None:
        """Nothing to release."""

    def key_flow_control(self) -> bool:
        return self.has_key_flow_control

    def type_text(self, text: str) -> None:
        """Text as the guest helper types it (XTEST): any character, ``\n`` is Return."""
        with self._lock:
            for char in text:
                if char == "\n":
                    line, self._line = self._line, ""
                    if self._on_line is not None:
                        self._on_line(line)
                else:
                    self._line += char

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
            case WheelEvent(direction=direction):
                if direction in ("left", "right") and not self.has_horizontal_wheel:
                    raise DisplayError("input-send-event refused: no horizontal wheel")
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


class FakeGuestHelper:
    """:class:`~orchestrator.display.guest_helper.GuestHelper` acting on a :class:`FakeDisplay`.

    ``type`` requests type into the fake shell line (any character); ``wheel`` requests are
    kept in :attr:`wheels`. Every request is kept in :attr:`requests`.

    Args:
        display: the display it acts on.
        available: ``False`` models a guest whose helper never announced itself.
    """

    def __init__(self, display: FakeDisplay, *, available: bool = True) -> None:
        self.display = display
        self.available = available
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.wheels: list[tuple[str, int, int, int, int]] = []
        self.fail_next: str | None = None
        self.spare_keycodes = 110

    @property
    def hello_info(self) -> dict[str, Any]:
        if not self.available:
            return {}
        return {"hello": "deskvm-helper", "protocol": 1, "ops": ["hello", "type", "wheel"],
                "spare_keycodes": self.spare_keycodes}  # fmt: skip

    def unavailable_reason(self, wait_s: float = 0.0) -> str | None:
        return None if self.available else "the guest helper has not announced itself"

    def request(self, op: str, args: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
        if not self.available:
            raise GuestHelperError("the guest helper has not announced itself")
        self.requests.append((op, dict(args)))
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise GuestHelperError(f"the guest helper could not {op}: {error}")
        if op == "type":
            self.display.type_text(str(args["text"]))
            return {"ok": True, "count": len(str(args["text"]))}
        if op == "wheel":
            self.wheels.append(
                (str(args["direction"]), int(args["count"]), int(args["x"]), int(args["y"]),
                 int(args.get("mods", 0)))
            )  # fmt: skip
            return {"ok": True, "count": int(args["count"])}
        raise GuestHelperError(f"the guest helper could not {op}: unknown op {op!r}")

    def close(self) -> None:
        self.available = False
