"""Fixtures of the guest control tests: the bridge tests' fake hypervisor, with an image that
has a guest helper channel."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.manager import SessionManager
from tests.bridge.conftest import (  # noqa: F401 (fixtures used by this folder's tests)
    IMAGE,
    TOKEN,
    _resolver,
    app,
    client,
    fake_manager,
    hypervisor,
)

HELPER_PORT = "dev.deskvm.helper.0"


@pytest.fixture
def manager(tmp_path: Path, hypervisor: FakeHypervisor) -> SessionManager:  # noqa: F811
    return fake_manager(tmp_path, hypervisor, helper_port=HELPER_PORT)
