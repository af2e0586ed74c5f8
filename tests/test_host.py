"""Host set-up pieces that need no root: the probe boot sector, settings, tokens."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from agent_bridge.runtime import HostAccelVerdict, ensure_token, resolve_accel
from orchestrator import host
from orchestrator.errors import ConfigError, HostSetupError
from orchestrator.host import PROBE_MESSAGE, boot_sector, load_accel
from orchestrator.settings import Settings


def test_boot_sector_is_bootable_and_prints_the_probe_message() -> None:
    sector = boot_sector()
    assert len(sector) == 512
    assert sector[510:] == b"\x55\xaa"
    # mov si, imm16 points at the message, which ends with NUL
    address = int.from_bytes(sector[9:11], "little")
    offset = address - 0x7C00
    assert sector[offset : offset + len(PROBE_MESSAGE)] == PROBE_MESSAGE
    assert sector[offset + len(PROBE_MESSAGE) : offset + len(PROBE_MESSAGE) + 3] == b"\r\n\x00"


def test_settings_from_env_and_overrides(tmp_path: Path) -> None:
    env = {"DESKVM_STATE_DIR": str(tmp_path), "DESKVM_MAX_SESSIONS": "3", "DESKVM_ACCEL": "tcg"}
    s = Settings.from_env(env, max_sessions=None, token="t")
    assert s.state_dir == tmp_path and s.max_sessions == 3 and s.token == "t"
    assert s.images_dir == tmp_path / "images"
    assert resolve_accel(s) == "tcg"


@pytest.mark.parametrize(
    "env", [{"DESKVM_MAX_SESSIONS": "many"}, {"DESKVM_ACCEL": "warp"}, {"DESKVM_MAX_SESSIONS": "0"}]
)
def test_bad_settings_are_config_errors(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        Settings.from_env(env)


def test_accel_needs_a_probe_verdict(tmp_path: Path) -> None:
    s = Settings.from_env({"DESKVM_STATE_DIR": str(tmp_path)})
    with pytest.raises(HostSetupError) as info:
        resolve_accel(s)
    assert "deskvm doctor" in info.value.message
    s.host_file.write_text('{"accel": "kvm"}')
    assert load_accel(s.host_file) == "kvm"
    assert resolve_accel(s) == "kvm"


def test_the_hosts_verdict_learns_from_real_boots(tmp_path: Path) -> None:
    """A KVM stop before any Linux guest ran stores TCG (later processes start under it);
    the first ready under KVM is stored as proof, which later verdicts read back."""
    s = Settings.from_env({"DESKVM_STATE_DIR": str(tmp_path)})
    s.host_file.write_text('{"accel": "kvm", "why": "kvm: guest ran"}')
    verdict = HostAccelVerdict(s.host_file)
    assert not verdict.kvm_proven and not verdict.pinned
    verdict.kvm_failed("QEMU run state internal-error (KVM internal error. Suberror: 1)")
    assert resolve_accel(s) == "tcg"
    record = json.loads(s.host_file.read_text())
    assert "KVM internal error" in record["why"] and record["source"] == "boot"
    assert [p.name for p in tmp_path.iterdir()] == [s.host_file.name]  # no temporary left
    verdict.kvm_ran_linux()  # another process's TCG verdict stands
    assert resolve_accel(s) == "tcg" and not verdict.kvm_proven

    s.host_file.write_text('{"accel": "kvm", "why": "kvm: guest ran"}')
    HostAccelVerdict(s.host_file).kvm_ran_linux()
    assert json.loads(s.host_file.read_text())["kvm_ran_linux"] is True
    assert HostAccelVerdict(s.host_file, pinned=True).kvm_proven


def test_token_file_is_private_and_stable(tmp_path: Path) -> None:
    s = Settings.from_env({"DESKVM_STATE_DIR": str(tmp_path)})
    token = ensure_token(s)
    assert len(token) >= 32
    assert stat.S_IMODE(s.token_file.stat().st_mode) == 0o600
    assert ensure_token(s) == token
    assert ensure_token(s.replace(token="given")) == "given"


def test_libvirtd_is_started_under_a_reaping_subreaper_when_tini_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert host.libvirtd_command() == ["tini", "-s", "--", "libvirtd"]
    monkeypatch.setattr(host.shutil, "which", lambda name: None)
    assert host.libvirtd_command() == ["libvirtd", "-d"]
    assert "tini" in host.APT_PACKAGES
