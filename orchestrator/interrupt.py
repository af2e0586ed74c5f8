"""Stopping a long-running command cleanly: SIGINT, SIGTERM and SIGHUP, and child process groups.

Python turns only SIGINT into an exception (:class:`KeyboardInterrupt`); SIGTERM and SIGHUP
end the process at once, without running a single ``finally`` block, so a killed build or
benchmark would leave its VM (libvirt domain, overlay) or its build tool running. Inside
:func:`interruptible` all three signals raise :class:`Interrupted` (a ``KeyboardInterrupt``)
in the main thread, so the cleanup that already runs on Ctrl-C (``with`` blocks,
``except BaseException``) runs for each of them; :func:`run_main` wraps a script's ``main``
with it and exits ``128 + signal`` with one line saying so. A repeated signal while the
cleanup runs is noted on stderr and ignored (SIGKILL still ends the process).

Children that start children of their own (``mmdebstrap``: apt, dpkg, maintainer scripts)
are started in their own session (``start_new_session=True``) and ended as a group by
:func:`stop_process_group`: SIGTERM to the group, a grace period, SIGKILL, reaped.

Errors: none of its own; :class:`Interrupted` is a ``KeyboardInterrupt`` (not a
:class:`~orchestrator.errors.DeskvmError`) so that nothing catching ``Exception`` swallows it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

__all__ = [
    "STOP_SIGNALS",
    "Interrupted",
    "interruptible",
    "run_main",
    "stop_process_group",
]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that ask a command to stop: Ctrl-C, ``kill``, a closed terminal."""

_T = TypeVar("_T")


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived (raised in the main thread inside :func:`interruptible`).

    Attributes:
        signum: the signal's number (``signal.SIGTERM`` ...).
        exit_code: ``128 + signum``, the shell's convention for a command a signal ended.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def signal_name(self) -> str:
        """``"SIGTERM"`` and the like."""
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def interruptible(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, each of ``signals`` raises :class:`Interrupted` in the main thread.

    The first signal raises; later ones (while the cleanup it started runs) print a line on
    stderr and are otherwise ignored. The previous handlers are restored at the end. Outside
    the main thread (where Python cannot handle signals) the block runs unchanged; a process
    forked inside the block (``multiprocessing``) keeps each signal's default action.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []
    owner = os.getpid()

    def handler(signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked child (multiprocessing): the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if raised:
            name = signal.Signals(signum).name
            print(f"{name} again: still cleaning up (SIGKILL would leave work behind)",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        raised.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_main(main: Callable[[], _T], *, what: str | None = None) -> _T:
    """Run a script's ``main()`` under :func:`interruptible`; exit ``128 + signal`` if stopped.

    Usage: ``raise SystemExit(run_main(main))`` (or ``run_main(main)``) under
    ``if __name__ == "__main__":``.

    Args:
        main: the script's entry point; its ``with``/``finally`` blocks do the cleanup.
        what: the command's name in the message (default: the script's file name).

    Returns:
        What ``main()`` returned.

    Raises:
        SystemExit: with code ``128 + signal`` after a stop signal, once ``main``'s cleanup
            has run (a line on stderr says which signal).
    """
    name = what or os.path.basename(sys.argv[0])
    try:
        with interruptible():
            return main()
    except Interrupted as exc:
        print(f"{name}: {exc.signal_name}: stopped; everything it started was torn down",
              file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(exc.exit_code) from None


def stop_process_group(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """End ``proc`` and every process of its process group; reap ``proc``.

    ``proc`` must lead its own group (started with ``start_new_session=True``). Sends
    SIGTERM to the group, waits up to ``grace_s`` seconds in all for the group to end (a
    tool such as mmdebstrap unmounts what it mounted then), sends SIGKILL to whatever of it
    is left, and reaps the leader. Safe to call on a process that has already exited.
    """
    pgid = proc.pid

    def signal_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    deadline = time.monotonic() + grace_s
    signal_group(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    # The leader may be gone (and reaped) while members of its group live on.
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_group(signal.SIGKILL)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    """Whether any process (not a zombie) is still in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies not yet reaped by their parent; look closer.
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields: state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
