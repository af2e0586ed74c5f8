"""Synthetic frames and a scripted driver for the QA tests (no VM, no server)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from agent_bridge.qa.model import Box, Frame, Point, TextBox
from agent_bridge.qa.waits import Grab, Plan, ReadText, Sleep

BG = (0x2E, 0x4A, 0x62)


def desktop(
    width: int = 640, height: int = 400, *, windows: Sequence[tuple[Box, str]] = ()
) -> np.ndarray:
    """A desktop background with white "windows", each with a caption in black."""
    image = Image.new("RGB", (width, height), BG)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=16)
    for box, caption in windows:
        draw.rectangle(
            (box.x, box.y, box.x1 - 1, box.y1 - 1), fill=(250, 250, 250), outline=(0, 0, 0)
        )
        draw.rectangle((box.x, box.y, box.x1 - 1, box.y + 22), fill=(60, 110, 200))
        draw.text((box.x + 8, box.y + 30), caption, fill=(0, 0, 0), font=font)
    return np.asarray(image, dtype=np.uint8).copy()


def frame(
    pixels: np.ndarray, seq: int = 0, mono_s: float = 0.0, pointer: Point | None = None
) -> Frame:
    return Frame(pixels, frame_seq=seq, t_s=seq / 10, mono_s=mono_s, pointer=pointer)


class Script:
    """Drive a plan with scripted frames on a fake clock: each Sleep advances the clock,
    each Grab takes the next frame (the last one repeats), each ReadText asks ``ocr``."""

    def __init__(
        self,
        frames: Sequence[np.ndarray] | Callable[[float], np.ndarray],
        *,
        ocr: Callable[[ReadText], tuple[TextBox, ...]] | None = None,
        grab_s: float = 0.05,
        pointer: Point | None = None,
    ) -> None:
        self.frames = frames
        self.pointer = pointer
        self.ocr = ocr
        self.t = 100.0
        self.grab_s = grab_s
        self.grabs = 0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def run(self, plan: Plan[Any]) -> Any:
        value: Any = None
        while True:
            try:
                request = plan.send(value)
            except StopIteration as stop:
                return stop.value
            if isinstance(request, Grab):
                mono = self.t
                if callable(self.frames):
                    pixels = self.frames(self.t)
                else:
                    pixels = self.frames[min(self.grabs, len(self.frames) - 1)]
                self.t += self.grab_s
                value = frame(pixels, seq=self.grabs, mono_s=mono, pointer=self.pointer)
                self.grabs += 1
            elif isinstance(request, Sleep):
                assert request.seconds >= 0
                self.sleeps.append(request.seconds)
                self.t += request.seconds
                value = None
            else:
                assert isinstance(request, ReadText) and self.ocr is not None
                value = self.ocr(request)
