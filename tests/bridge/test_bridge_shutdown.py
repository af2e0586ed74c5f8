"""A server shutdown answers every request in flight with the JSON error shape.

Ctrl-C (SIGINT) or SIGHUP to a real server process while a ``POST /v1/sessions`` boots: the session
is ended and the create answers 503 ``server_shutting_down`` (it was uvicorn's plain-text
500 after the graceful timeout). Any other request still running when the graceful
timeout ends answers the same JSON shape.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest
from fastapi import FastAPI

from agent_bridge.server import create_app
from agent_bridge.server.app import listen, make_server
from orchestrator.errors import ConfigError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from tests.bridge.conftest import AUTH, IMAGE, TOKEN

# A bridge on a fake hypervisor whose desktops never get ready (they boot until ended).
_SERVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from agent_bridge.server import create_app, run_server
    from orchestrator.hypervisor.fake import FakeHypervisor
    from orchestrator.input_plan import Pacing
    from orchestrator.manager import SessionManager
    from orchestrator.settings import Settings
    from orchestrator.spec import BootImage

    root = Path(sys.argv[2])

    def resolve(name):
        return BootImage(name=name, content_hash="0" * 64, base_path=root / "base.qcow2",
                         kernel_path=root / "vmlinuz", initrd_path=root / "initrd.img")

    manager = SessionManager(
        hypervisor=FakeHypervisor(boot_screens=10**9), resolve_image=resolve,
        recordings_dir=root / "recordings", pacing=Pacing(0, 0, 0, 0, 0), ready_poll_s=0.01,
    )
    app = create_app(manager, token=sys.argv[3], settings=Settings(default_image="x"))
    try:
        run_server(app, port=int(sys.argv[1]), log_level="warning")
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down
        sys.exit(130)  # as deskvm serve does
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("sig", "exit_code"),
    # SIGHUP (a closed terminal) stops the server as Ctrl-C does, then ends the process as
    # the signal does by default.
    [(signal.SIGINT, 130), (signal.SIGHUP, -signal.SIGHUP)],
    ids=["SIGINT", "SIGHUP"],
)
def test_a_stop_signal_while_a_session_boots_answers_json_503(
    tmp_path: Path, sig: signal.Signals, exit_code: int
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port), str(tmp_path), TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def up() -> bool:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        _wait_until(up, 30, "the server")
        answers: list[httpx.Response] = []
        create = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{url}/v1/sessions", json={}, headers=AUTH, timeout=60)
            )
        )
        create.start()

        def booting() -> bool:
            listed = httpx.get(f"{url}/v1/sessions", headers=AUTH, timeout=5).json()
            return [s["state"] for s in listed] == ["starting"]

        _wait_until(booting, 10, "the session to boot")
        t0 = time.monotonic()
        proc.send_signal(sig)
        create.join(30)
        output = proc.communicate(timeout=30)[0]
        assert proc.returncode == exit_code, output
        assert "Exception in ASGI application" not in output, output
        # The boot was ended at once, not after uvicorn's 10 s graceful timeout.
        assert time.monotonic() - t0 < 8, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["retry-after"] == "5"
    error = answer.json()["error"]
    assert error["code"] == "server_shutting_down"
    assert "shutting down" in error["message"] and "ended while it booted" in error["message"]
    # The session ended once, with that reason, in its recording.
    (events,) = (tmp_path / "recordings").glob("*/events.jsonl")
    endings = [
        e["data"]
        for e in map(json.loads, events.read_text().splitlines())
        if e["kind"] == "lifecycle" and e["data"]["event"] in ("closed", "start_failed")
    ]
    assert endings == [{"event": "closed", "reason": "server shutdown", "errors": []}]


def test_a_request_cancelled_at_shutdown_answers_json(tmp_path: Path) -> None:
    """uvicorn cancels what still runs after the graceful timeout: JSON 503, not text."""
    manager = SessionManager(
        hypervisor=FakeHypervisor(), resolve_image=lambda name: None,  # type: ignore[arg-type,return-value]
        recordings_dir=tmp_path / "recordings",
    )  # fmt: skip
    app: FastAPI = create_app(manager, token=TOKEN, settings=Settings(default_image=IMAGE))

    @app.get("/slow")
    async def slow() -> dict[str, str]:
        await anyio.sleep(60)
        return {}

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = make_server(app, port=port, log_level="critical", graceful_timeout_s=1)
    thread = threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True)
    thread.start()
    _wait_until(lambda: server.started, 10, "the server")
    answers: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: answers.append(httpx.get(f"http://127.0.0.1:{port}/slow", timeout=30))
    )
    request.start()
    time.sleep(0.5)
    server.should_exit = True
    request.join(30)
    thread.join(30)
    (answer,) = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "server_shutting_down"


def test_listen_on_a_busy_port_says_so() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        try:
            listen("127.0.0.1", port)
        except ConfigError as exc:
            assert exc.code == "address_in_use"
            assert f"127.0.0.1:{port} is already in use" in exc.message
        else:
            raise AssertionError("listen() bound a busy port")
