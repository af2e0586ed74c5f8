"""Fixtures of the in-process bridge tests: a SessionManager on the fake hypervisor."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from agent_bridge.server import MAX_MESSAGE_BYTES, create_app
from orchestrator.errors import ImageNotFound
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import BootImage

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def create_session(client: TestClient, **body: Any) -> dict[str, Any]:
    """POST /v1/sessions with ``body``; asserts 201 and returns the session JSON."""
    response = client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def ask(ws: Any, message: dict[str, Any]) -> dict[str, Any]:
    """Send one WebSocket message and return the reply."""
    ws.send_text(json.dumps(message))
    return ws.receive_json()  # type: ignore[no-any-return]


IMAGE = "test-desktop"


def _resolver(root: Path, helper_port: str | None = None):  # type: ignore[no-untyped-def]
    """An image resolver knowing only ``IMAGE`` (files under ``root``, never read by the fake
    hypervisor); ``helper_port`` gives the image a guest helper channel."""

    def resolve(name: str) -> BootImage:
        if name != IMAGE:
            raise ImageNotFound(f"no built image {name!r}; build it with 'deskvm image build'")
        return BootImage(
            name=name,
            content_hash="0" * 64,
            base_path=root / "base.qcow2",
            kernel_path=root / "vmlinuz",
            initrd_path=root / "initrd.img",
            helper_port=helper_port,
        )

    return resolve


@pytest.fixture
def hypervisor() -> FakeHypervisor:
    return FakeHypervisor()


def fake_manager(tmp_path: Path, hypervisor: FakeHypervisor, **resolver: Any) -> SessionManager:
    """A SessionManager on the fake hypervisor with no input pacing (``resolver``: see
    ``_resolver``)."""
    return SessionManager(
        hypervisor=hypervisor,
        resolve_image=_resolver(tmp_path, **resolver),
        recordings_dir=tmp_path / "recordings",
        max_sessions=2,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
    )


@pytest.fixture
def manager(tmp_path: Path, hypervisor: FakeHypervisor) -> SessionManager:
    return fake_manager(tmp_path, hypervisor)


@pytest.fixture
def app(manager: SessionManager) -> FastAPI:
    return create_app(manager, token=TOKEN, settings=Settings(default_image=IMAGE))


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


@pytest.fixture
def anon(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def server_url(app: FastAPI) -> Iterator[str]:
    """The app served by uvicorn in a thread on a free port (real sockets)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
        ws_max_size=MAX_MESSAGE_BYTES,
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
