"""LibvirtDomain.stop_error: a guest QEMU stopped for good (KVM internal error), told apart
from a domain the host paused, against stand-ins for libvirt's domain and QEMU's monitor."""

from __future__ import annotations

import json
from pathlib import Path

import libvirt
import pytest

from orchestrator.hypervisor import libvirt as lv
from orchestrator.hypervisor.base import SessionPaths

LOG = """2026-12-02 12:13:31.000+0000: starting up libvirt version: 9.0.0
KVM internal error. Suberror: 1
emulation failure
2026-12-02 12:16:31.000+0000: shutting down, reason=destroyed
2026-12-02 12:16:32.000+0000: starting up libvirt version: 9.0.0
-msg timestamp=on
KVM internal error. Suberror: 3
extra data[0]: 0x0000000000000001
emulation failure
RAX=0000000000000000 RBX=ffff888004401000
"""


class Dom:
    def __init__(self, state: tuple[int, int]) -> None:
        self._state = state

    def state(self) -> list[int]:
        return list(self._state)

    def name(self) -> str:
        return "deskvm-abcdef012345"


@pytest.fixture
def domain_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    (tmp_path / "deskvm-abcdef012345.log").write_text(LOG)
    monkeypatch.setattr(lv, "_QEMU_LOG_DIR", tmp_path)
    asked: list[str] = []

    def make(state: tuple[int, int], status: str = "internal-error") -> lv.LibvirtDomain:
        def monitor(_dom: object, command: str, _flags: int) -> str:
            asked.append(json.loads(command)["execute"])
            return json.dumps({"return": {"status": status, "running": False}})

        monkeypatch.setattr(lv.libvirt_qemu, "qemuMonitorCommand", monitor)
        dom = Dom(state)
        return lv.LibvirtDomain(
            None,  # type: ignore[arg-type]
            dom,  # type: ignore[arg-type]
            "abcdef012345",
            SessionPaths.under(tmp_path, "abcdef012345"),
        )

    make.asked = asked  # type: ignore[attr-defined]
    return make


def test_a_guest_kvm_stopped_is_reported_with_qemus_own_lines(domain_with) -> None:
    domain = domain_with((libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_UNKNOWN))
    stopped = domain.stop_error()
    assert stopped is not None
    assert stopped.startswith("QEMU run state internal-error")
    # Only this domain's lines: the earlier domain of the same name logged Suberror 1.
    assert "Suberror: 3" in stopped and "Suberror: 1" not in stopped
    assert "emulation failure" in stopped and "RAX" not in stopped


@pytest.mark.parametrize(
    ("state", "status"),
    [
        ((libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_BOOTED), "running"),
        ((libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_USER), "paused"),
        ((libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_FROM_SNAPSHOT), "restore-vm"),
        ((libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_UNKNOWN), "paused"),
    ],
    ids=["running", "paused-by-the-host", "restored-paused", "paused-unknown-but-not-an-error"],
)
def test_a_domain_that_runs_or_that_the_host_paused_is_not_stopped(
    domain_with, state: tuple[int, int], status: str
) -> None:
    domain = domain_with(state, status)
    assert domain.stop_error() is None
    # Only a pause libvirt cannot explain asks QEMU: the usual poll is one state call.
    unexplained = state == (libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_UNKNOWN)
    assert domain_with.asked == (["query-status"] if unexplained else [])
