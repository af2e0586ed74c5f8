"""Keys paced by the guest X server's own count of the keys it has processed.

Why: QEMU's virtio keyboard hands each key event to the guest kernel, whose evdev buffer
holds 63 unread events per reader (Linux ``evdev_compute_buffer_size``: 8 packets of 8
events for a keyboard). When more arrive while the X server is not reading (a busy guest:
an application saving, the network coming up), the kernel drops *every* unread event and
reports ``SYN_DROPPED``. The virtio queue's acknowledgement
(:meth:`orchestrator.display.qmp.QmpDisplay.send`) only says the kernel took the event, so a
host that sends as fast as the queue allows lost characters from the middle of lines
(``bench/key_loss.py``, 6 CPU hogs in the guest: 2 of 60 lines in 2 of 4 runs, 17,520 key
events sent and 17,416 processed; with this pacing 0 of 60; docs/performance.md).

How: the in-guest helper counts the X server's XInput2 raw key events from every keyboard
but XTEST's and reports the count (``key_events``, see
:mod:`orchestrator.display.guest_helper`). :class:`KeyPacer` holds each batch of key events
back until at most :data:`KEY_ACK_WINDOW` of the key events sent are unprocessed, and
waits only before the first press of a press..release group, never while a key is down (a
held key autorepeats in the guest). A count that stops moving for :data:`KEY_ACK_STALL_S`
(a stopped helper, a guest that lies), or waits longer than the action's budget
(:data:`KEY_ACK_WAIT_PER_KEY_S`), ends the pacing for the rest of the action: keys then go
as before, never not at all.

The count is the guest's word: it can only make its own keys go faster (and be lost) or
slower; it never reaches anything but this pacing.
"""

from __future__ import annotations

import logging
import threading
import time

from orchestrator.display.guest_helper import GuestHelper

__all__ = [
    "KEY_ACK_RESYNC_S",
    "KEY_ACK_STALL_S",
    "KEY_ACK_WAIT_PER_KEY_S",
    "KEY_ACK_WINDOW",
    "KeyPacer",
]

log = logging.getLogger("deskvm.display")

KEY_ACK_WINDOW = 16
"""Key events (presses and releases) that may be sent and not yet processed by the guest X
server. With a report (``SYN_REPORT``) per typed character that is at most about 24 evdev
events, with a report per key event (one-key actions) 32: under the kernel's 63."""

KEY_ACK_STALL_S = 5.0
"""How long the X server's count may stand still while keys wait before the pacer gives up
for the rest of the action and sends without waiting, seconds."""

KEY_ACK_WAIT_PER_KEY_S = 0.05
"""With :data:`KEY_ACK_STALL_S`, the most one action's keys may wait in all: ``stall_s`` plus
this per key event of the action, seconds (an X server taking 20 key events a second keeps
up; a count that creeps forward just fast enough to dodge the stall rule is cut off)."""

KEY_ACK_RESYNC_S = 1.0
"""After this long without sending a key, if the X server has processed keys since the last
were sent, what it has still not counted is taken as never to be counted (keys the kernel
dropped before this pacing could help) and counting starts afresh, seconds. A count that has
not moved since is an X server not reading yet: its keys stay counted as unprocessed."""

_POLL_S = 0.1
"""Longest single wait, so a closing session is noticed, seconds."""


class KeyPacer:
    """Paces a session's key batches by the guest X server's processed-key count.

    One per guest helper (a new domain, a new pacer): the count is compared with every key
    event sent since the last resync, across actions, so many short actions cannot run
    ahead either. Call :meth:`begin_action` at the start of each action. With no helper,
    or a helper that reports no count, :meth:`before` returns at once (keys are then paced
    by the display alone).

    Args:
        helper: the domain's guest helper, or ``None``.
        window: :data:`KEY_ACK_WINDOW`.
        stall_s: :data:`KEY_ACK_STALL_S`.
        resync_s: :data:`KEY_ACK_RESYNC_S`.
    """

    def __init__(
        self,
        helper: GuestHelper | None,
        *,
        window: int = KEY_ACK_WINDOW,
        stall_s: float = KEY_ACK_STALL_S,
        resync_s: float = KEY_ACK_RESYNC_S,
    ) -> None:
        self.helper = helper
        self._window = window
        self._stall_s = stall_s
        self._resync_s = resync_s
        self._origin: int | None = None  # the count when _sent was 0
        self._sent = 0
        self._last_send = float("-inf")
        self._count_at_send: int | None = None  # the count when keys were last sent
        self._action_keys = 0
        self._counted = False
        self.waited_s = 0.0
        """Seconds :meth:`before` waited in this action."""
        self.gave_up = False
        """Whether the count stood still for ``stall_s`` in this action (pacing stopped)."""

    def begin_action(self) -> None:
        """Start an action's statistics (:meth:`summary`) and pacing afresh."""
        self.waited_s, self.gave_up, self._action_keys = 0.0, False, 0
        self._counted = False

    def before(self, keys: int, interrupt: threading.Event | None = None) -> None:
        """Wait until ``keys`` more key events keep at most ``window`` unprocessed.

        Returns early when ``interrupt`` is set (the caller checks it), the helper reports
        no count, or the count stands still for ``stall_s`` (then pacing stops for the rest
        of the action).
        """
        if self.helper is None or keys <= 0 or self.gave_up:
            return
        keys = min(keys, self._window)  # more than a window: wait until all are processed
        count = self.helper.key_events()
        if count is None:
            return
        self._counted = True
        start = time.monotonic()
        if (
            self._origin is None
            or count < self._origin  # a restarted helper counts from 0
            # Idle, and the X server has read keys since the last were sent: what it has
            # not counted by now it never will. (A count that has not moved since may be
            # an X server that is not reading: those keys are still in the kernel buffer.)
            or (start - self._last_send >= self._resync_s and count != self._count_at_send)
        ):
            self._origin, self._sent = count, 0
        last_progress, last = start, count
        while True:
            if count - self._origin > self._sent:  # more than sent: not ours, or repeats
                self._origin = count - self._sent
            if self._sent - (count - self._origin) + keys <= self._window:
                break
            if interrupt is not None and interrupt.is_set():
                break
            clock = time.monotonic()
            if count != last:
                last_progress, last = clock, count
            elif clock - last_progress >= self._stall_s:
                log.warning(
                    "the guest X server processed no key for %.1f s with %d keys unprocessed: "
                    "sending the rest of the action without waiting",
                    clock - last_progress,
                    self._sent - (count - self._origin),
                )
                self.gave_up = True
                self._origin, self._sent = count, 0
                break
            # A count that creeps (one key just inside every stall_s) may not stretch an
            # action without end: its waits are bounded by its size.
            budget_s = self._stall_s + KEY_ACK_WAIT_PER_KEY_S * (self._action_keys + keys)
            if self.waited_s + (clock - start) >= budget_s:
                log.warning(
                    "keys of this action waited %.1f s in all for the guest X server: "
                    "sending the rest of the action without waiting",
                    self.waited_s + (clock - start),
                )
                self.gave_up = True
                self._origin, self._sent = count, 0
                break
            wait_s = min(_POLL_S, self._stall_s - (clock - last_progress))
            target = self._origin + self._sent + keys - self._window
            got = self.helper.wait_key_events(target, max(wait_s, 0.001))
            if got is None:
                break
            if got < self._origin:
                self._origin, self._sent = got, 0
            count = got
        self.waited_s += time.monotonic() - start

    def sent(self, keys: int) -> None:
        """Count ``keys`` key events as sent (after the display took them)."""
        if keys <= 0:
            return
        self._sent += keys
        self._action_keys += keys
        self._last_send = time.monotonic()
        self._count_at_send = None if self.helper is None else self.helper.key_events()

    def summary(self) -> dict[str, object]:
        """For the action's ``result`` record: ``{"key_wait_s": s}`` (seconds its keys
        waited for the guest X server) and ``"key_acks_stalled": true`` when the count stood
        still and pacing stopped; empty when no key was sent or the helper counts none."""
        if not self._counted or not self._action_keys:
            return {}
        out: dict[str, object] = {"key_wait_s": round(self.waited_s, 3)}
        if self.gave_up:
            out["key_acks_stalled"] = True
        return out
