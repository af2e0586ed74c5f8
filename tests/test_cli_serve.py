"""``deskvm serve``'s start: the port is checked before anything is printed, and the
banner says truthfully where the admin token lives (issue 10 section 1).

The manager is a fake-hypervisor one and uvicorn is not run: what is tested is the
command's own order of work and its output.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import agent_bridge.runtime
import agent_bridge.server
from agent_bridge.cli import app
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.manager import SessionManager


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    """Stand-ins for libvirt and uvicorn; returns the calls of both (``built`` marks a
    manager built)."""
    calls: list[dict[str, Any]] = []

    def build_manager(settings: Any, **_: Any) -> SessionManager:
        calls.append({"built": True})
        return SessionManager(
            hypervisor=FakeHypervisor(),
            resolve_image=lambda name: None,  # type: ignore[arg-type,return-value]
            recordings_dir=tmp_path / "recordings",
        )

    def run_server(app_: Any, host: str, port: int, **kw: Any) -> None:
        calls.append({"host": host, "port": port, **kw})
        kw["sock"].close()

    monkeypatch.setattr(agent_bridge.runtime, "build_manager", build_manager)
    monkeypatch.setattr(agent_bridge.server, "run_server", run_server)
    return calls


def _serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(
        app,
        ["serve", "--state-dir", str(tmp_path / "state"), *args],
        env={"COLUMNS": "200", "DESKVM_TOKEN": "", **(env or {})},
    )
    return result.exit_code, result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_busy_port_fails_before_the_banner(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, output = _serve(tmp_path, "--port", str(port), "--token", "secret-token-xyz")
    assert code == 1, output
    assert f"(address_in_use): 127.0.0.1:{port} is already in use" in output
    assert "secret-token-xyz" not in output and "token" not in output.lower()
    assert "deskvm bridge" not in output
    assert not served, "a manager was built (sessions adopted, reaped) before the port check"


def test_a_given_token_is_not_claimed_to_be_on_disk(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    port = _free_port()
    code, output = _serve(tmp_path, "--port", str(port), "--token", "secret-token-xyz")
    assert code == 0, output
    token_file = tmp_path / "state" / "token"
    assert "token: secret-token-xyz  (given by --token; not stored" in output
    assert f"also in {token_file}" not in output and not token_file.exists()
    built, call = served
    assert built == {"built": True}
    assert call["port"] == port and call["sock"].fileno() == -1  # served on the bound socket

    code, output = _serve(tmp_path, "--port", str(port), env={"DESKVM_TOKEN": "env-token-abc"})
    assert code == 0, output
    assert "token: env-token-abc  (from DESKVM_TOKEN; not stored" in output
    assert not token_file.exists()


def test_a_new_token_is_in_the_token_file(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    code, output = _serve(tmp_path, "--port", str(_free_port()))
    assert code == 0, output
    token_file = tmp_path / "state" / "token"
    token = token_file.read_text().strip()
    assert f"token: {token}  (also in {token_file})" in output
    # The session list (README) and the replay viewer, each with the token in the fragment.
    assert f"/ui/#token={token}" in output
    assert f"/replay/#token={token}" in output
