"""Fixtures of the egress tests: the namespace world (real ring) and a leftover check."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from egress_world import World, leftovers

NEEDED = ("nft", "ip", "dnsmasq", "ulogd", "busybox")


def _real_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = _real_skip_reason()
    if reason is None:
        return
    for item in items:
        if "netns" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture()
def world() -> Iterator[World]:
    """A world with an attached session; torn down in finally, then checked clean."""
    w = World()
    try:
        w.open()
        w.attach()
        yield w
    finally:
        errors = w.close()
        left = leftovers()
        assert not errors, errors
        assert not left, f"left behind: {left}"


@pytest.fixture()
def bare_world() -> Iterator[World]:
    """A world without an attached session (the test attaches as it needs)."""
    w = World()
    try:
        w.open()
        yield w
    finally:
        errors = w.close()
        assert not errors, errors
        assert not leftovers(), leftovers()
