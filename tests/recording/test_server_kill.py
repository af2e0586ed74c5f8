"""kill -9 of a bridge server in the middle of a session, then verify its recording.

The server is a real uvicorn process (a subprocess) serving the real FastAPI app with the
fake hypervisor, the real FileRecorder and a 10 fps capture thread; the client drives it
over the WebSocket until the server is SIGKILLed. What this shows: every action the client
got an answer for is in the bundle with its result, and the bundle verifies up to its last
flushed line. What it does not: a real VM's teardown (the reaper's job on restart).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from typer.testing import CliRunner

from agent_bridge.cli import app
from agent_bridge.client import Client
from orchestrator.errors import DeskvmError
from orchestrator.replay import Recording, verify

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "kill-test-token-0123"

_SERVER = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
import uvicorn
from agent_bridge.server import create_app
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from tests.recording.conftest import IMAGE
manager = SessionManager(
    hypervisor=FakeHypervisor(), resolve_image=lambda name: IMAGE,
    recordings_dir=Path({recordings!r}), pacing=Pacing(0, 0, 0, 0, 0), ready_poll_s=0.01,
    capture_fps=10,
)
app = create_app(manager, token={token!r}, settings=Settings(default_image=IMAGE.name))
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_kill_9_of_the_server_keeps_every_answered_action(tmp_path: Path) -> None:
    port = _free_port()
    recordings = tmp_path / "recordings"
    code = _SERVER.format(root=str(ROOT), recordings=str(recordings), token=TOKEN, port=port)
    server = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    answered = 0
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        client = Client(url, TOKEN)
        session = client.create_session(width=640, height=400)
        stop = threading.Event()

        def act() -> None:
            nonlocal answered
            i = 0
            while not stop.is_set():
                try:
                    session.move((i * 37) % 600 + 5, (i * 11) % 380 + 5)
                except DeskvmError:
                    return
                answered += 1
                i += 1

        worker = threading.Thread(target=act, daemon=True)
        worker.start()
        time.sleep(1.5)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        stop.set()
        worker.join(10)
        with contextlib.suppress(Exception):
            client.close()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert answered > 10
    print(f"answered {answered} moves before the kill")
    (bundle,) = list(recordings.iterdir())
    report = verify(bundle)
    assert report.first_bad_seq is None and not report.closed, report
    assert json.loads((bundle / "manifest.json").read_text())["status"] == "recording"
    recording = Recording(bundle)
    moves = [e for e in recording.events if e["kind"] == "result" and e["data"]["action"] == "move"]
    # The result is appended before the reply is sent: an answered move is recorded.
    assert len(moves) >= answered
    _, image = recording.frame_at(recording.duration_s)
    assert image.size == (640, 400)
    result = CliRunner().invoke(app, ["replay", "verify", str(bundle)])
    assert result.exit_code == 2 and "not closed" in result.output, result.output
