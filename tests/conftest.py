"""Fixtures shared by the host tests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def xserver() -> Iterator[str]:
    """An Xvfb display (``:N``), stopped at the end. It keeps its state when its last
    client leaves (``-noreset``): keyboard maps set with ``setxkbmap`` stay."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [
            "Xvfb",
            "-displayfd",
            str(write_fd),
            "-noreset",
            "-screen",
            "0",
            "1280x800x24",
            "-nolisten",
            "tcp",
        ],
        pass_fds=(write_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        number = pipe.readline().strip()
    try:
        assert number, "Xvfb did not report its display number"
        yield f":{number}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
