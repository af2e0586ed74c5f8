"""``--help`` of every deskvm command: no value type after flags, defaults shown
(issue 10 section 7)."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from agent_bridge.cli import app
from orchestrator.settings import DEFAULT_STATE_DIR, Settings


def _commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    subs = getattr(command, "commands", None)
    if not subs:
        return [path]
    found = [path]
    for name, sub in subs.items():
        found += _commands(sub, (*path, name))
    return found


COMMANDS = _commands(typer.main.get_command(app))


def _help(*path: str) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "deskvm")
def test_flags_show_no_value_type(path: tuple[str, ...]) -> None:
    output = _help(*path)
    assert "<bool>" not in output, output
    assert "--help" in output
    assert "``" not in output, output  # RST literals are not rendered by rich


def test_config_table_names_survive_rich_markup() -> None:
    serve = " ".join(_help("serve").split())
    assert "a [serve] table" in serve and "and [[warm_pool]] tables" in serve, serve


def test_defaults_are_shown() -> None:
    defaults = Settings()
    serve = _help("serve")
    for shown in (
        f"[default: {defaults.max_sessions}]",
        f"[default: {defaults.session_ttl_s:g}]",
        f"[default: {defaults.idle_timeout_s:g}]",
        "[default: derived from the host's RAM]",
        "[default: 8765]",
        f"[default: {DEFAULT_STATE_DIR}]",
    ):
        assert shown in serve, (shown, serve)
    build = _help("image", "build")
    assert "--force" in build and "[default: no-force]" in build
