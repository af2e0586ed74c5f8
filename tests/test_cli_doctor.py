"""``deskvm doctor``'s report (the checks and "Host ready") goes to stdout, so
``deskvm doctor > file`` keeps it; errors stay on stderr. No host is probed: the
doctor's checks are stand-ins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import orchestrator.host
from agent_bridge.cli import app
from orchestrator.host import Check, HostReport


def _doctor(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, checks: list[Check], accel: str | None
) -> Any:
    def run_doctor(*, on_check: Any, **_: Any) -> HostReport:
        for check in checks:
            on_check(check)
        return HostReport(checks, accel)  # type: ignore[arg-type]

    monkeypatch.setattr(orchestrator.host, "run_doctor", run_doctor)
    return CliRunner().invoke(
        app, ["doctor", "--state-dir", str(tmp_path / "state")], env={"COLUMNS": "200"}
    )


def test_the_report_is_on_stdout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = _doctor(monkeypatch, tmp_path, [Check("libvirtd", "ok", "running")], "kvm")
    assert result.exit_code == 0, result.output
    assert "Checking the host" in result.stdout
    assert "libvirtd: running" in result.stdout
    assert "Host ready (acceleration: kvm)." in result.stdout
    assert result.stderr == ""


def test_a_host_not_ready_is_an_error_on_stderr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    checks = [Check("/dev/kvm", "fail", "missing", fix="modprobe kvm")]
    result = _doctor(monkeypatch, tmp_path, checks, None)
    assert result.exit_code == 1
    assert "/dev/kvm: missing" in result.stdout and "fix: modprobe kvm" in result.stdout
    assert "The host is not ready." in result.stderr
    assert "Host ready" not in result.stdout
