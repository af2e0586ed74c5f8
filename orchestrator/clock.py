"""Time as a seam: a monotonic clock and a wall clock, real or fake.

All timestamps in recordings are ``CLOCK_MONOTONIC`` nanoseconds (``*_ns``); the wall
clock is read once per session for the manifest.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    def monotonic_ns(self) -> int:
        """Nanoseconds on a monotonic clock (arbitrary origin)."""
        ...

    def wall(self) -> datetime:
        """Current UTC wall-clock time."""
        ...

    def sleep(self, seconds: float, interrupt: threading.Event | None = None) -> bool:
        """Block for ``seconds``, or until ``interrupt`` is set.

        Returns:
            ``True`` if ``interrupt`` was set (the sleep may have been cut short).
        """
        ...


class SystemClock:
    """The host's clocks."""

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def wall(self) -> datetime:
        return datetime.now(UTC)

    def sleep(self, seconds: float, interrupt: threading.Event | None = None) -> bool:
        if interrupt is not None:
            return interrupt.wait(max(0.0, seconds)) if seconds > 0 else interrupt.is_set()
        if seconds > 0:
            time.sleep(seconds)
        return False


class FakeClock:
    """A clock that only moves when slept on or advanced: deterministic tests."""

    def __init__(self, start_ns: int = 1_000_000_000) -> None:
        self._now_ns = start_ns
        self._lock = threading.Lock()

    def monotonic_ns(self) -> int:
        with self._lock:
            return self._now_ns

    def wall(self) -> datetime:
        return datetime(2026, 1, 1, tzinfo=UTC)

    def sleep(self, seconds: float, interrupt: threading.Event | None = None) -> bool:
        if interrupt is not None and interrupt.is_set():
            return True
        self.advance(seconds)
        return interrupt is not None and interrupt.is_set()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now_ns += max(0, int(seconds * 1e9))
