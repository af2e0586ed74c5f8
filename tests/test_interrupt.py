"""Long-running commands stopped by SIGINT, SIGTERM or SIGHUP leave nothing running.

Each test starts the real command as a process (`deskvm image build` with a stub
``mmdebstrap`` first on PATH; ``bench/boot.py`` on the fake hypervisor), waits until it has
started its work, sends the signal, and checks that the command exits non-zero with a line
saying so, and that nothing it started is left: no process of the build tool's group, no
mount, no build directory, no domain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.interrupt import Interrupted, interruptible, stop_process_group
from vm_images import DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]

# A build tool that mounts in its target (as mmdebstrap mounts /proc), starts a child of its
# own (as apt and dpkg are) and waits; it writes its pid and the child's once under way.
_STUB_MMDEBSTRAP = textwrap.dedent(
    """\
    #!/bin/bash
    rootfs="${@: -2:1}"
    mkdir -p "$rootfs/proc"
    mount -t tmpfs deskvm-test-stub "$rootfs/proc"
    sleep 600 &
    echo "$$ $!" > "$STUB_PIDS.tmp" && mv "$STUB_PIDS.tmp" "$STUB_PIDS"
    wait
    """
)


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(str(path))]


def _stop(proc: subprocess.Popen[str], sig: signal.Signals) -> str:
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="image builds need root (mmdebstrap --mode=root)")
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_stopped_image_build_leaves_no_build_tool_mount_or_directory(
    tmp_path: Path, sig: signal.Signals
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "mmdebstrap"
    stub.write_text(_STUB_MMDEBSTRAP)
    stub.chmod(0o755)
    pids_file = tmp_path / "pids"
    images = tmp_path / "images"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_PIDS": str(pids_file),
        "DESKVM_STATE_DIR": str(tmp_path / "state"),
        "DESKVM_IMAGES_DIR": str(images),
        "COLUMNS": "200",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_bridge.cli", "image", "build", "--no-verify"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        tool, child = map(int, _wait_for(pids_file, proc).split())
        output = _stop(proc, sig)
        assert proc.returncode == 128 + sig, output
        assert f"interrupted ({sig.name})" in output, output
        assert not _alive(tool) and not _alive(child), output
        assert _mounts_under(tmp_path) == [], output
        assert list(images.glob("*/.build-*")) == [], output
        assert list((images / DEFAULT_IMAGE).glob("[!.]*")) == [], output  # no image either
    finally:
        for pid in (locals().get("tool"), locals().get("child")):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for mount in _mounts_under(tmp_path):
            subprocess.run(["umount", "--lazy", mount], check=False)


# bench/boot.py on the fake hypervisor: the fake's domains are noted in a file as they
# start and end, so what is left after the process is gone can be told.
_BENCH_ON_FAKE = textwrap.dedent(
    """\
    import runpy, sys
    from pathlib import Path

    import agent_bridge.runtime
    import vm_images
    from orchestrator.hypervisor.fake import FakeHypervisor
    from orchestrator.input_plan import Pacing
    from orchestrator.manager import SessionManager
    from orchestrator.spec import BootImage

    root, script = Path(sys.argv[1]), sys.argv[2]
    ledger = root / "domains"

    class NotingHypervisor(FakeHypervisor):
        def start(self, spec, *, nic=None):
            domain = super().start(spec, nic=nic)
            with ledger.open("a") as f:
                f.write(f"start {spec.session_id}\\n")
            return domain

        def destroy(self, session_id):
            super().destroy(session_id)
            with ledger.open("a") as f:
                f.write(f"destroy {session_id}\\n")

    def find_image(name, *args, **kwargs):
        return BootImage(name=name, content_hash="0" * 64, base_path=root / "base.qcow2",
                         kernel_path=root / "vmlinuz", initrd_path=root / "initrd.img")

    def build_manager(settings, *, egress=None, resolve_image=None, **kwargs):
        return SessionManager(
            hypervisor=NotingHypervisor(), resolve_image=resolve_image or find_image,
            recordings_dir=settings.recordings_dir, pacing=Pacing(0, 0, 0, 0, 0),
            ready_poll_s=0.01,
        )

    agent_bridge.runtime.build_manager = build_manager
    vm_images.find_image = find_image
    sys.argv = [script, "--runs", "3", "--stats-timeout", "120"]
    runpy.run_path(script, run_name="__main__")
    """
)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_stopped_boot_bench_destroys_its_vm(tmp_path: Path, sig: signal.Signals) -> None:
    env = {**os.environ, "DESKVM_STATE_DIR": str(tmp_path / "state"), "DESKVM_ACCEL": "tcg"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _BENCH_ON_FAKE, str(tmp_path), str(ROOT / "bench" / "boot.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    ledger = tmp_path / "domains"
    _wait_for(ledger, proc)  # a VM is up; the bench waits for its counters
    time.sleep(0.3)
    output = _stop(proc, sig)
    assert proc.returncode == 128 + sig, output
    assert f"boot.py: {sig.name}: stopped" in output, output
    events = ledger.read_text().split()
    started = {sid for kind, sid in zip(events[::2], events[1::2], strict=True) if kind == "start"}
    destroyed = {
        sid for kind, sid in zip(events[::2], events[1::2], strict=True) if kind == "destroy"
    }
    assert started and started == destroyed, ledger.read_text()


def test_a_repeated_signal_does_not_cut_the_cleanup_short() -> None:
    cleaned: list[str] = []
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Interrupted) as caught, interruptible():
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            signal.raise_signal(signal.SIGHUP)  # ignored: the cleanup goes on
            cleaned.append("done")
    assert caught.value.signum == signal.SIGTERM and caught.value.exit_code == 143
    assert cleaned == ["done"]
    # The previous handlers are back.
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_stop_process_group_ends_children_that_outlive_the_leader(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    proc = subprocess.Popen(
        # The child ignores SIGTERM: only the SIGKILL after the grace period ends it.
        ["sh", "-c", f"(trap '' TERM; exec sleep 600) & echo $! > {pids}; wait"],
        start_new_session=True,
    )
    while not pids.exists() or not pids.read_text().strip():
        time.sleep(0.02)
    child = int(pids.read_text())
    stop_process_group(proc, grace_s=0.5)
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child)


def test_a_forked_child_keeps_the_default_action() -> None:
    import multiprocessing

    with interruptible():
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
        time.sleep(0.2)
        child.terminate()
        child.join(10)
    assert child.exitcode == -signal.SIGTERM
