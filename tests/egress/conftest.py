"""Fixtures of the egress tests: the namespace world (real ring) and a leftover check."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from egress_world import World, checked_world, leftovers, purge_test_worlds

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


@pytest.fixture(scope="session", autouse=True)
def _no_stale_test_worlds() -> None:
    """Remove test worlds (``dvt*`` namespaces and links: names only these tests create)
    that a killed earlier run left on the host, and say so; deskvm's own leftovers are the
    product's to clear (reap, or the next attach for an older version's objects)."""
    if _real_skip_reason() is not None:
        return
    stale = purge_test_worlds()
    if stale:
        print(f"\nremoved test worlds an earlier run left behind: {stale}")


@pytest.fixture()
def world() -> Iterator[World]:
    """A world with an attached session; torn down in finally, then checked clean (what
    was left before the test is an earlier run's, not this test's)."""
    with checked_world(attach=True, before=leftovers()) as w:
        yield w


@pytest.fixture()
def bare_world() -> Iterator[World]:
    """A world without an attached session (the test attaches as it needs)."""
    with checked_world(before=leftovers()) as w:
        yield w
