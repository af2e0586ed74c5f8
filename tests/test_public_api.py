"""The public names of each module are what __all__ says, and they all exist."""

from __future__ import annotations

import importlib

import pytest

MODULES = [
    "orchestrator.errors",
    "orchestrator.spec",
    "orchestrator.settings",
    "orchestrator.clock",
    "orchestrator.recorder",
    "orchestrator.instance",
    "orchestrator.store",
    "orchestrator.replay",
    "orchestrator.session",
    "orchestrator.manager",
    "orchestrator.input_plan",
    "orchestrator.interrupt",
    "orchestrator.host",
    "orchestrator.display.base",
    "orchestrator.display.fake",
    "orchestrator.hypervisor.base",
    "orchestrator.hypervisor.fake",
    "orchestrator.hypervisor.domain_xml",
    "agent_bridge.protocol",
    "agent_bridge.protocol.stream",
    "agent_bridge.client",
    "agent_bridge.async_client",
    "orchestrator.capture",
    "orchestrator.imaging",
    "agent_bridge.server",
    "agent_bridge.server.app",
    "agent_bridge.server.deps",
    "agent_bridge.server.models",
    "agent_bridge.server.sockets",
    "agent_bridge.qa",
    "agent_bridge.qa.model",
    "agent_bridge.qa.errors",
    "agent_bridge.qa.match",
    "agent_bridge.qa.refs",
    "agent_bridge.qa.ocr",
    "agent_bridge.qa.waits",
    "agent_bridge.qa.checks",
    "agent_bridge.qa.report",
    "agent_bridge.qa.needles",
    "agent_bridge.tasks",
    "agent_bridge.tasks.model",
    "agent_bridge.tasks.metrics",
    "agent_bridge.tasks.guest",
    "agent_bridge.tasks.ops",
    "agent_bridge.tasks.env",
    "agent_bridge.tasks.runner",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__, name
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol}"


def test_every_error_derives_from_the_root() -> None:
    from orchestrator import errors

    for symbol in errors.__all__:
        cls = getattr(errors, symbol)
        assert issubclass(cls, errors.DeskvmError)
        assert isinstance(cls.code, str) and cls.code


def test_protocol_exports() -> None:
    import agent_bridge.protocol as protocol

    assert {"Action", "parse_deskvm_action", "decode_envelope", "KeyCombo"} <= set(protocol.__all__)


def test_bridge_server_keeps_its_public_import_path() -> None:
    """The CLI, the pytest plugin, benchmarks and users import these from the package."""
    import agent_bridge.server as server

    needed = {"create_app", "run_server", "MAX_MESSAGE_BYTES", "STATUS_BY_CODE", "SessionInfo"}
    assert needed <= set(server.__all__)
