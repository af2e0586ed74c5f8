"""``deskvm --version`` (issue 10 section 7)."""

from __future__ import annotations

from importlib.metadata import version

from typer.testing import CliRunner

from agent_bridge.cli import app


def test_version_prints_the_package_version_and_exits() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"deskvm {version('deskvm')}"


def test_commands_still_run_beside_the_version_option() -> None:
    result = CliRunner().invoke(app, ["replay", "--help"])
    assert result.exit_code == 0 and "recordings" in result.output
