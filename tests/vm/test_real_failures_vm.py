"""A failure injected into the real hypervisor's start leaves nothing behind (no boot needed)."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import libvirt
import pytest

from orchestrator.errors import CapacityError, ConfigError, HypervisorError
from orchestrator.hypervisor.libvirt import LibvirtHypervisor
from orchestrator.settings import Settings
from orchestrator.spec import BootImage, SessionSpec, new_session_id


@pytest.fixture
def base(settings: Settings) -> Iterator[BootImage]:
    root = settings.state_dir / "test-images-broken"
    root.mkdir(parents=True, exist_ok=True)
    base = root / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "512M"], check=True)
    # The kernel does not exist: libvirt accepts the XML, QEMU fails to start.
    yield BootImage("broken", "0" * 64, base, root / "no-such-vmlinuz", root / "no-initrd")
    shutil.rmtree(root)


def _domains() -> list[str]:
    conn = libvirt.open("qemu:///system")
    try:
        return [d.name() for d in conn.listAllDomains(0)]
    finally:
        conn.close()


def test_real_start_failure_leaves_no_domain_and_no_files(
    settings: Settings, base: BootImage
) -> None:
    hv = LibvirtHypervisor(settings.sessions_dir, accel="tcg", uri=settings.libvirt_uri)
    try:
        spec = SessionSpec(new_session_id(), base, memory_mib=256, vcpus=1)
        with pytest.raises(HypervisorError):
            hv.start(spec)
        assert f"deskvm-{spec.session_id}" not in _domains()
        assert not (settings.sessions_dir / spec.session_id).exists()
        assert spec.session_id not in hv.list_sessions()
        # Refusals before anything is created: a disk cap below the image, a full disk.
        with pytest.raises(ConfigError):
            hv.start(SessionSpec(new_session_id(), base, disk_mib=256))
        huge = SessionSpec(new_session_id(), base, disk_mib=1024 * 1024)
        with pytest.raises(CapacityError) as info:
            hv.start(huge)
        assert info.value.code == "insufficient_disk"
        assert not (settings.sessions_dir / huge.session_id).exists()
    finally:
        hv.close()


def test_disk_cap_is_the_overlays_virtual_size(settings: Settings, base: BootImage) -> None:
    hv = LibvirtHypervisor(settings.sessions_dir, accel="tcg", uri=settings.libvirt_uri)
    try:
        assert hv.disk_cap_mib(SessionSpec(new_session_id(), base)) == 512
        assert hv.disk_cap_mib(SessionSpec(new_session_id(), base, disk_mib=2048)) == 2048
    finally:
        hv.close()


def test_reaper_spares_a_live_peers_sessions_and_reaps_a_dead_ones(settings: Settings) -> None:
    a = LibvirtHypervisor(settings.sessions_dir, accel="tcg", uri=settings.libvirt_uri)
    b = LibvirtHypervisor(settings.sessions_dir, accel="tcg", uri=settings.libvirt_uri)
    sid = new_session_id()
    root = settings.sessions_dir / sid
    try:
        root.mkdir(mode=0o711)
        (root / "instance").write_text(b.instance_id)  # as b.start() writes it
        assert sid in b.list_sessions()
        assert sid not in a.list_sessions()  # b is alive: a's reaper leaves it alone
        b.close()  # (SIGKILL releases the flock the same way)
        assert sid in a.list_sessions()
        a.destroy(sid)
        assert not root.exists()
        assert not (settings.sessions_dir / ".instances" / f"{b.instance_id}.lock").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        a.close()
        b.close()


def test_10_real_start_destroy_cycles_leave_the_host_as_found(settings: Settings) -> None:
    from vm_images import find_image

    image = find_image(settings.default_image, settings.images_dir)
    hv = LibvirtHypervisor(settings.sessions_dir, accel="tcg", uri=settings.libvirt_uri)

    def counts() -> dict[str, int]:
        return {
            "our_domains_and_dirs": len(hv.list_sessions()),  # by owner metadata and dir
            "session_dirs": sum(
                1 for p in settings.sessions_dir.iterdir() if p.name != ".instances"
            ),
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")),
        }

    def fd_targets() -> list[str]:
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sorted(targets)

    try:
        hv.destroy(hv.start(SessionSpec(new_session_id(), image, memory_mib=512)).session_id)
        before = counts()
        for _ in range(10):
            domain = hv.start(SessionSpec(new_session_id(), image, memory_mib=512, vcpus=1))
            assert domain.is_running()
            hv.destroy(domain.session_id)

        # Other threads of this process (an earlier test's client, the garbage collector's
        # finalizers) open and close fds now and then: a leak grows with the cycles, such
        # noise comes and goes. So no fd more than before (fewer is someone else closing),
        # waiting a moment for a transient one to close.
        def settled(now: dict[str, int]) -> bool:
            fds = now.pop("fds")
            return fds <= before["fds"] and now == {k: v for k, v in before.items() if k != "fds"}

        gc.collect()
        deadline = time.monotonic() + 10
        while not settled(after := counts()) and time.monotonic() < deadline:
            time.sleep(0.2)
            gc.collect()
        after = counts()
        open_now = fd_targets()
    finally:
        hv.close()
    print(f"\nREAL CYCLES before={before} after={after}")
    assert settled(dict(after)), f"before={before} after={after}; fds now open: {open_now}"
