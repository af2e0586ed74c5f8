"""The small image's terminal must not wait for the window manager (issue 11, cold boot).

Xt's shell widget waits up to ``wmTimeout`` (5000 ms by default) for a window manager's
answer to a geometry request when ``waitforwm`` is true (the default). At a cold boot openbox
starts beside the xterm, and a request that openbox redirects but does not answer stalled
about half of all boots by 5 s with the whole guest idle. The resource name is case-sensitive
and all lower case (``XtNwaitForWm`` is ``"waitforwm"`` in Xt's ``Shell.h``): the image set
``*waitForWm: false`` for a while, which matches nothing.

The test runs the host's own xterm on Xvfb under a stand-in window manager (python-xlib)
that takes over the screen (``SubstructureRedirect``), maps what asks to be mapped and never
answers a configure request. ``wmTimeout`` is raised to 10 minutes, so an xterm that waits
hangs rather than being slow: the check is whether the shell starts, not how fast.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from Xlib import X, display

from vm_images.recipe import GUEST_DIR

DESKTOP = GUEST_DIR / "openbox/usr/local/lib/deskvm/desktop"
# An xterm that waits for the window manager waits this long (ms): far past the test.
HANG_MS = 600_000
STARTED_TIMEOUT_S = 60.0
# How long the control case (no resources of the image) must stay without a shell.
CONTROL_S = 3.0


def image_xterm_resources() -> list[str]:
    """The ``-xrm`` resources the image's desktop script gives its xterm."""
    text = DESKTOP.read_text()
    call = text[text.index("\n    xterm ") :]
    call = call[: call.index("&\n")]
    return re.findall(r"-xrm\s+'([^']*)'", call)


@pytest.fixture
def silent_wm(xserver: str) -> Iterator[None]:
    """A window manager that maps windows and never answers configure requests."""
    conn = display.Display(xserver)
    root = conn.screen().root
    root.change_attributes(event_mask=X.SubstructureRedirectMask)
    conn.sync()
    stop = threading.Event()
    configure_requests: list[int] = []

    def serve() -> None:
        while not stop.is_set():
            if not conn.pending_events():
                time.sleep(0.01)
                continue
            event = conn.next_event()
            if event.type == X.MapRequest:
                event.window.map()
                conn.flush()
            elif event.type == X.ConfigureRequest:
                configure_requests.append(event.window.id)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        conn.close()


def start_xterm(xserver: str, resources: list[str], started: Path) -> subprocess.Popen[bytes]:
    xrm = [arg for resource in [*resources, f"*wmTimeout: {HANG_MS}"] for arg in ("-xrm", resource)]
    shell = f"touch {shlex.quote(str(started))}; exec sleep 600"
    return subprocess.Popen(
        ["xterm", "-geometry", "85x30+40+40", "-fn", "fixed", *xrm, "-e", "/bin/sh", "-c", shell],
        # xterm keeps a directory in TMPDIR (xtermXX...) that a killed xterm leaves behind.
        env={**os.environ, "DISPLAY": xserver, "TMPDIR": str(started.parent)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for(path: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.05)
    return path.exists()


def test_the_image_sets_the_resource_by_its_real_name() -> None:
    resources = image_xterm_resources()
    assert "*waitforwm: false" in resources, resources


@pytest.mark.usefixtures("silent_wm")
def test_the_images_xterm_starts_its_shell_without_the_window_managers_answer(
    xserver: str, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    proc = start_xterm(xserver, image_xterm_resources(), started)
    try:
        assert wait_for(started, STARTED_TIMEOUT_S), (
            "the image's xterm waits for the window manager's answer to its geometry request"
        )
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.usefixtures("silent_wm")
def test_control_without_the_resource_the_xterm_waits(xserver: str, tmp_path: Path) -> None:
    """The stand-in window manager does make a default xterm wait (so the test above can
    fail), and so does the mistyped ``*waitForWm`` the image once set."""
    for resources in ([], ["*waitForWm: false"]):
        started = tmp_path / f"started-{len(resources)}"
        proc = start_xterm(xserver, resources, started)
        try:
            assert not wait_for(started, CONTROL_S), f"xterm did not wait with {resources}"
        finally:
            proc.kill()
            proc.wait()
