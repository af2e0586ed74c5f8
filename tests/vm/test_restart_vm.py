"""A bridge server killed with SIGKILL under a live session, restarted: nothing is lost.

One VM boot (issue 10, section 2). A real ``deskvm serve`` subprocess (its own state dir)
creates a session; the client types into the xterm and mints a control token; the server
is SIGKILLed; the domain keeps running; the same server (same port, so the same name)
starts again and re-adopts the session; the client's same ``Session`` object carries on
(its next request opens a new WebSocket), the token minted before the restart works, the
guest helper (non-US text) answers again; the recording verifies intact and closed, with
one marked gap, inputs on both sides of it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path

import libvirt

from agent_bridge.client import Client
from orchestrator.replay import Recording, verify
from orchestrator.settings import Settings
from tests.vm.conftest import window_box
from tests.vm.test_limits_vm import _free_port, _serve, _wait_for


def test_kill_9_of_the_server_loses_no_session(settings: Settings, tmp_path: Path) -> None:
    t_start = time.monotonic()
    port, token, tag = _free_port(), secrets.token_urlsafe(16), secrets.token_hex(3)
    state_dir = settings.state_dir / f"restart-{secrets.token_hex(4)}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "DESKVM_STATE_DIR": str(state_dir),
        "DESKVM_IMAGES_DIR": str(settings.images_dir),
    }
    state_dir.mkdir(mode=0o711)
    if settings.host_file.is_file():  # the acceleration probe's verdict
        shutil.copy(settings.host_file, state_dir / "host.json")
    log = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, token, env, log)
    conn = libvirt.open("qemu:///system")
    sid, restart_s = "", float("nan")
    try:
        with Client(url, token) as client:
            session = client.create_session(width=1024, height=768)
            sid = session.id
            control = client.mint_token(sid, "control")["token"]
            x0, y0, x1, y1 = window_box(session.screenshot().image())
            session.click((x0 + x1) // 2, (y0 + y1) // 2)
            session.type(f"echo before-{tag} > /dev/ttyS1\n")
            _wait_for(lambda: f"before-{tag}" in session.guest_log(), 60, "the first command")

            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert conn.lookupByName(f"deskvm-{sid}").isActive()  # libvirt kept it
            t_kill = time.monotonic()
            proc = _serve(port, token, env, log)  # same port: same name, re-adopts
            restart_s = time.monotonic() - t_kill

            # The same client object carries on: its next request reconnects.
            session.type(f"echo after-{tag} > /dev/ttyS1\n")
            _wait_for(lambda: f"after-{tag}" in session.guest_log(), 60, "the second command")
            assert session.screenshot().image().size == (1024, 768)
        # A token minted before the restart still works; the guest helper answers again.
        with Client(url, control) as holder:
            again = holder.attach(sid)
            again.type(f"echo helper-{tag} Ñandú > /dev/ttyS1\n")
            _wait_for(lambda: f"helper-{tag} Ñandú" in again.guest_log(), 60, "helper text")
            recording = Path(str(again.info()["recording"]))
        with Client(url, token) as client:
            client.delete_session(sid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        alive = [d.name() for d in conn.listAllDomains(0) if d.name() == f"deskvm-{sid}"]
        conn.close()
        serve_log = log.read_text()
        records = list((state_dir / "session-state").glob("*.json"))
    print(f"\nrestart to serving again: {restart_s:.1f} s; test wall time "
          f"{time.monotonic() - t_start:.0f} s")  # fmt: skip
    assert alive == [], f"domain left behind; serve log:\n{serve_log[-3000:]}"
    assert records == []
    assert f"re-adopted session {sid}" in serve_log
    report = verify(recording)
    assert report.ok and report.closed and report.truncated is None, report
    assert len(report.gaps) == 1, report.gaps
    events = Recording(recording).events
    gap = next(e["seq"] for e in events if e["data"].get("event") == "gap")
    typed = [
        (e["seq"], e["data"]["action"].get("text", ""))
        for e in events
        if e["kind"] == "input" and e["data"]["action"]["action"] == "type"
    ]
    assert any(seq < gap and f"before-{tag}" in text for seq, text in typed)
    assert any(seq > gap and f"after-{tag}" in text for seq, text in typed)
    assert any(e["kind"] == "frame" and e["seq"] > gap for e in events)  # capture resumed
    shutil.rmtree(state_dir)
