"""Real-VM tests: every test here boots real libvirt/QEMU domains.

The in-process bridge server and its session manager come from the deskvm pytest plugin
(``agent_bridge.pytest_plugin``); this file adds helpers that read the host's state.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from orchestrator.settings import Settings

BACKGROUND_RGB = (0x2E, 0x4A, 0x62)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/vm/" in str(item.fspath):
            item.add_marker(pytest.mark.vm)


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings.from_env()


def window_box(
    image: Image.Image, background_rgb: tuple[int, int, int] = BACKGROUND_RGB
) -> tuple[int, int, int, int]:
    """Bounding box (x0, y0, x1, y1) of everything that is not desktop background."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    other = np.any(np.abs(pixels - np.array(background_rgb, dtype=np.int16)) > 6, axis=2)
    ys, xs = np.nonzero(other)
    assert xs.size, "no window on the screen"
    return int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())
