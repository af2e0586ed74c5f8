"""Per-session rate limits on actions and typed characters (token buckets).

Limits are per session, shared by all of its connections, so opening more WebSockets buys
an agent nothing. Thread-safe: checked on the event loop, refunded from worker threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from agent_bridge.protocol.actions import Action, Type
from orchestrator.errors import DeskvmError

__all__ = ["Bucket", "RateLimits"]


class Bucket:
    """A token bucket: ``rate_per_s`` refill, ``burst`` capacity (monotonic seconds).

    With ``allow_debt`` a request larger than what is left still passes while the bucket
    is not in debt, and the bucket goes negative: one long ``type`` (up to the protocol's
    text limit) is allowed, and the session then waits until the debt is repaid.
    """

    def __init__(self, rate_per_s: float, burst: float, *, allow_debt: bool = False) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.allow_debt = allow_debt
        self._level = burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def give(self, amount: float) -> None:
        """Return ``amount`` taken by a request that did not run (never above ``burst``)."""
        with self._lock:
            self._level = min(self.burst, self._level + amount)

    def take(self, amount: float) -> bool:
        """Take ``amount`` if the bucket allows it; ``False`` (and nothing taken) if not."""
        with self._lock:
            now = time.monotonic()
            self._level = min(self.burst, self._level + (now - self._t) * self.rate_per_s)
            self._t = now
            if amount > self._level and not (self.allow_debt and self._level > 0):
                return False
            self._level -= amount
            return True


class RateLimits:
    """Per-session limits on actions and typed characters, shared by its connections.

    Args:
        actions_per_s: sustained actions per second (burst: twice that).
        chars_per_s: sustained typed characters per second (burst: twice that; one longer
            ``type`` may go into debt).
    """

    def __init__(self, actions_per_s: float, chars_per_s: float) -> None:
        self._actions_per_s = actions_per_s
        self._chars_per_s = chars_per_s
        self._buckets: dict[str, tuple[Bucket, Bucket]] = {}
        self._lock = threading.Lock()

    def check(self, session_id: str, actions: Sequence[Action]) -> None:
        """Raises: DeskvmError: code ``rate_limited``."""
        with self._lock:
            if session_id not in self._buckets:
                self._buckets[session_id] = (
                    Bucket(self._actions_per_s, 2 * self._actions_per_s),
                    Bucket(self._chars_per_s, 2 * self._chars_per_s, allow_debt=True),
                )
            action_bucket, char_bucket = self._buckets[session_id]
        chars = sum(len(a.text) for a in actions if isinstance(a, Type))
        if not action_bucket.take(len(actions)):
            raise DeskvmError(
                f"more than {self._actions_per_s:g} actions/s on this session; slow down",
                code="rate_limited",
            )
        if chars and not char_bucket.take(chars):
            raise DeskvmError(
                f"more than {self._chars_per_s:g} typed characters/s on this session",
                code="rate_limited",
            )

    def refund(self, session_id: str, chars: int) -> None:
        """Give back typed characters of actions that were refused or never ran."""
        with self._lock:
            buckets = self._buckets.get(session_id)
        if buckets is not None and chars > 0:
            buckets[1].give(chars)

    def forget(self, known: set[str]) -> None:
        """Drop the buckets of sessions not in ``known``."""
        with self._lock:
            for session_id in [k for k in self._buckets if k not in known]:
                del self._buckets[session_id]
