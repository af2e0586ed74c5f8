"""Take-over: a person takes the wheel of a session from its agent, then hands it back.

While a person holds a session, the agent's actions that inject input are held as the
session's :class:`TakeoverPolicy` says: refused at once with code ``human_in_control``
(default), or made to wait until the hand-back (then they run, in order). Observations
(screenshot, zoom, cursor position) always pass: the agent may watch.

:class:`ControlDesk` keeps who holds which session. It is thread-safe: an agent's action
waits in a worker thread while the person's hand-back comes from another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from orchestrator.errors import ActionError, ConfigError

__all__ = ["Control", "ControlDesk", "HumanInControl", "TakeoverPolicy"]

AgentRule = Literal["refuse", "wait"]


class HumanInControl(ActionError):
    """A person holds the session: the agent's action was not run."""

    code = "human_in_control"


@dataclass(frozen=True, slots=True)
class TakeoverPolicy:
    """What happens to the agent's input actions while a person holds the session.

    Attributes:
        agent: ``refuse`` (error ``human_in_control`` at once) or ``wait`` (until the
            hand-back, at most ``wait_timeout_s``; then ``human_in_control``).
        wait_timeout_s: longest wait under ``wait``, seconds.
    """

    agent: AgentRule = "refuse"
    wait_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.agent not in ("refuse", "wait"):
            raise ConfigError(f"takeover agent rule must be refuse or wait, not {self.agent!r}")
        if not 0 < self.wait_timeout_s <= 86400:
            raise ConfigError("takeover wait_timeout_s must be in (0, 86400]")


@dataclass(frozen=True, slots=True)
class Control:
    """Who holds a session.

    Attributes:
        session_id: the session.
        holder: ``"admin"`` or ``"token:<id>"`` (as recorded).
        since_ns: monotonic ns when they took over.
        since_unix: Unix time (seconds) when they took over.
        handle: identifies the connection that holds it (hand-back must come from it).
    """

    session_id: str
    holder: str
    since_ns: int
    since_unix: float
    handle: str


class ControlDesk:
    """Who holds which session, and the agents waiting for the hand-back."""

    def __init__(self) -> None:
        self._held: dict[str, Control] = {}
        self._cv = threading.Condition()

    def holder(self, session_id: str) -> Control | None:
        """The session's current holder, or ``None`` (the agent drives)."""
        with self._cv:
            return self._held.get(session_id)

    def take(self, session_id: str, holder: str, handle: str) -> Control:
        """Take the session over (idempotent for the same handle).

        Raises:
            ActionError: code ``control_held``: someone else holds it.
        """
        with self._cv:
            current = self._held.get(session_id)
            if current is not None:
                if current.handle == handle:
                    return current
                raise ActionError(
                    f"{current.holder} holds this session since"
                    f" {time.strftime('%H:%M:%S', time.gmtime(current.since_unix))} UTC",
                    code="control_held",
                )
            control = Control(session_id, holder, time.monotonic_ns(), time.time(), handle)
            self._held[session_id] = control
            return control

    def hand_back(self, session_id: str, handle: str) -> Control | None:
        """Give the session back to its agent; ``None`` if ``handle`` did not hold it."""
        with self._cv:
            current = self._held.get(session_id)
            if current is None or current.handle != handle:
                return None
            del self._held[session_id]
            self._cv.notify_all()
            return current

    def forget(self, session_id: str) -> None:
        """Drop the session's holder (the session ended); waiting agents are released."""
        with self._cv:
            self._held.pop(session_id, None)
            self._cv.notify_all()

    def agent_turn(
        self,
        session_id: str,
        policy: TakeoverPolicy,
        *,
        what: str,
        still_wanted: Callable[[], bool] = lambda: True,
    ) -> None:
        """Return when the agent may act; hold or refuse it while a person holds the session.

        Args:
            what: the action's name (for the message).
            still_wanted: polled while waiting; ``False`` (the session ended) stops it.

        Raises:
            HumanInControl: refused (policy ``refuse``), waited too long, or the session
                ended while waiting.
        """
        with self._cv:
            current = self._held.get(session_id)
            if current is None:
                return
            if policy.agent == "refuse":
                raise HumanInControl(
                    f"{current.holder} has taken over this session; {what} was not run"
                    " (observations still work; retry after the hand-back)"
                )
            deadline = time.monotonic() + policy.wait_timeout_s
            while session_id in self._held:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HumanInControl(
                        f"{what} waited {policy.wait_timeout_s:g} s for the person who took"
                        " over to hand back; it was not run"
                    )
                if not still_wanted():
                    raise HumanInControl(f"the session ended during the take-over; {what} was"
                                         " not run")  # fmt: skip
                self._cv.wait(min(left, 0.5))
