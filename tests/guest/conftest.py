"""Fixtures of the guest control tests: the bridge on the fake hypervisor, helper included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from agent_bridge.server import create_app
from orchestrator.errors import ImageNotFound
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import BootImage

TOKEN = "test-token-0123456789"
IMAGE = "test-desktop"


def _resolver(root: Path):  # type: ignore[no-untyped-def]
    def resolve(name: str) -> BootImage:
        if name != IMAGE:
            raise ImageNotFound(f"no built image {name!r}")
        return BootImage(
            name=name,
            content_hash="0" * 64,
            base_path=root / "base.qcow2",
            kernel_path=root / "vmlinuz",
            initrd_path=root / "initrd.img",
            helper_port="dev.deskvm.helper.0",
        )

    return resolve


@pytest.fixture
def hypervisor() -> FakeHypervisor:
    return FakeHypervisor()


@pytest.fixture
def manager(tmp_path: Path, hypervisor: FakeHypervisor) -> SessionManager:
    return SessionManager(
        hypervisor=hypervisor,
        resolve_image=_resolver(tmp_path),
        recordings_dir=tmp_path / "recordings",
        max_sessions=2,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
    )


@pytest.fixture
def app(manager: SessionManager) -> FastAPI:
    return create_app(manager, token=TOKEN, settings=Settings(default_image=IMAGE))


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c
