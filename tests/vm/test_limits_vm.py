"""Host-enforced limits read from the outside, on ONE real VM (Firecracker-style checks).

One session boots with explicit limits and an approval policy; the test then reads the
QEMU process's real state (user, seccomp of every thread, cgroup memory and CPU limits),
the live domain XML, runs the approval flow end to end (checked on the guest log) and lets
the guest fill its disk. A second test kills a ``deskvm serve`` subprocess with SIGKILL
while a domain is starting and shows the restarted server's reaper removes every leftover.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import libvirt
import pytest

from agent_bridge.client import Client, RemoteError
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.replay import verify
from orchestrator.settings import Settings
from tests.vm.conftest import window_box

MEMORY_MIB = 1024
OVERHEAD_MIB = 768
CPU_QUOTA_PCT = 150
PERIOD_US = 100_000


def _qemu_pid(name: str) -> int:
    return int(Path(f"/run/libvirt/qemu/{name}.pid").read_text().strip())


def _cgroup_dir(pid: int, controller: str) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return Path("/sys/fs/cgroup") / controller / path.lstrip("/")
    raise AssertionError(f"no {controller} cgroup for pid {pid}")


def _wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(settings: Settings) -> Iterator[tuple[str, str]]:
    manager = build_manager(settings.replace(memory_overhead_mib=OVERHEAD_MIB))
    manager.reap()
    token = secrets.token_urlsafe(24)
    app = create_app(manager, token=token, settings=settings)
    with BackgroundServer(app) as background:
        yield background.url, token


def test_one_vm_limits_seccomp_xml_approvals_and_full_disk(
    server: tuple[str, str], settings: Settings
) -> None:
    url, token = server
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=400)
    body = {
        "memory_mib": MEMORY_MIB,
        "vcpus": 2,
        "cpu_quota_pct": CPU_QUOTA_PCT,
        "ttl_s": 1200,
        "idle_timeout_s": 600,
        "boot_timeout_s": 240,
        "approval": {"text_patterns": ["HOLD_"], "timeout_s": 60},
    }
    response = admin.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    info = response.json()
    sid = info["id"]
    name = f"deskvm-{sid}"
    try:
        assert info["limits"]["memory_hard_limit_mib"] == MEMORY_MIB + OVERHEAD_MIB
        pid = _qemu_pid(name)
        report: dict[str, Any] = {"session": sid, "pid": pid}

        # -- the process: not root, seccomp filter mode 2 on every thread ---------------
        status = Path(f"/proc/{pid}/status").read_text()
        uid = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
        assert uid != 0
        import pwd

        assert pwd.getpwuid(uid).pw_name == "libvirt-qemu"
        modes = {
            t.name: next(
                ln.split()[1]
                for ln in (t / "status").read_text().splitlines()
                if ln.startswith("Seccomp:")
            )
            for t in Path(f"/proc/{pid}/task").iterdir()
        }
        assert modes and set(modes.values()) == {"2"}, modes
        report["threads_seccomp_2"] = len(modes)

        # -- cgroups: memory hard limit and CPU bandwidth equal to the request ----------
        mem_dir = _cgroup_dir(pid, "memory")
        limit = int((mem_dir / "memory.limit_in_bytes").read_text())
        assert limit == (MEMORY_MIB + OVERHEAD_MIB) * 1024 * 1024, (mem_dir, limit)
        cpu_dir = _cgroup_dir(pid, "cpu")
        quotas = []
        for d in (cpu_dir, *cpu_dir.parents):
            if (d / "cpu.cfs_quota_us").is_file():
                quota = int((d / "cpu.cfs_quota_us").read_text())
                if quota > 0:
                    period = int((d / "cpu.cfs_period_us").read_text())
                    quotas.append((str(d), quota, period))
        assert (PERIOD_US * CPU_QUOTA_PCT // 100, PERIOD_US) in [(q, p) for _, q, p in quotas], (
            quotas
        )
        report["cpu_cgroups"] = quotas

        # -- live domain XML: no host sharing, no NIC without a policy, limits present ---
        conn = libvirt.open("qemu:///system")
        try:
            live = ET.fromstring(conn.lookupByName(name).XMLDesc(0))
        finally:
            conn.close()
        devices = live.find("devices")
        assert devices is not None
        for forbidden in ("filesystem", "hostdev", "interface", "redirdev", "shmem", "smartcard"):
            assert devices.findall(forbidden) == [], forbidden
        hard = live.find("memtune/hard_limit")
        assert hard is not None and int(hard.text or 0) == (MEMORY_MIB + OVERHEAD_MIB) * 1024
        assert live.findtext("cputune/global_quota") == str(PERIOD_US * CPU_QUOTA_PCT // 100)
        balloon = devices.find("memballoon")
        assert balloon is not None and balloon.get("model") == "none"

        # -- approvals, checked on the guest log --------------------------------------
        with Client(url, token, timeout_s=120) as client:
            session = client.attach(sid)
            x0, y0, x1, y1 = window_box(session.screenshot().image())
            session.click((x0 + x1) // 2, (y0 + y1) // 2)
            denied, approved = "HOLD_D" + secrets.token_hex(4), "HOLD_A" + secrets.token_hex(4)
            decisions = {denied: "deny", approved: "approve"}
            seen: list[str] = []

            def operator() -> None:
                while len(seen) < 2:
                    for item in admin.get(f"/v1/sessions/{sid}/pending").json():
                        text = item["action"].get("text", "")
                        marker = next(m for m in decisions if m in text)
                        frame = admin.get(item["frame_url"])
                        assert frame.content.startswith(b"\x89PNG")
                        admin.post(
                            f"/v1/sessions/{sid}/pending/{item['pending_id']}",
                            json={"decision": decisions[marker]},
                        ).raise_for_status()
                        seen.append(marker)
                    time.sleep(0.2)

            worker = threading.Thread(target=operator, daemon=True)
            worker.start()
            with pytest.raises(RemoteError) as excinfo:
                session.type(f"echo {denied} > /dev/ttyS1\n")
            assert excinfo.value.code == "approval_denied"
            session.type(f"echo {approved} > /dev/ttyS1\n")
            worker.join(timeout=30)
            lines = _wait_for(
                lambda: approved in session.guest_log() and session.guest_log(), 60, "approved"
            ).splitlines()
            assert sum(ln.strip() == approved for ln in lines) == 1
            assert denied not in session.guest_log()

            # -- the guest fills its disk: ENOSPC inside, the host is untouched --------
            overlay = settings.sessions_dir / sid / "overlay.qcow2"
            free_before = os.statvfs(overlay.parent).f_bavail
            session.type(
                "dd if=/dev/zero of=$HOME/fill bs=1M 2>&1 | tr '\\n' ' ' | sed 's/^/DD: /'"
                " > /dev/ttyS1; echo > /dev/ttyS1; sync; echo DDDONE > /dev/ttyS1\n"
            )
            log = _wait_for(
                lambda: "DDDONE" in session.guest_log() and session.guest_log(), 400, "dd"
            )
            dd_line = next(ln for ln in log.splitlines() if ln.startswith("DD: "))
            # The honest outcome: the guest's own file system is full (ENOSPC inside the
            # guest); QEMU is alive, the overlay stayed under its cap, the host is fine.
            assert "No space left on device" in dd_line, dd_line
            assert Path(f"/proc/{pid}").exists(), "QEMU died (memory hard limit too tight?)"
            qemu_info = json.loads(
                subprocess.run(
                    ["qemu-img", "info", "-U", "--output=json", str(overlay)],
                    check=True, capture_output=True, text=True,
                ).stdout
            )  # fmt: skip
            allocated = overlay.stat().st_blocks * 512
            virtual = int(qemu_info["virtual-size"])
            assert allocated <= virtual * 1.02, (allocated, virtual)
            assert client.get_session(sid)["state"] == "ready"  # the VM is not paused/dead
            report.update(
                dd=dd_line,
                overlay_allocated_mib=allocated // 2**20,
                overlay_virtual_mib=virtual // 2**20,
                host_free_drop_mib=(free_before - os.statvfs(overlay.parent).f_bavail)
                * os.statvfs(overlay.parent).f_frsize
                // 2**20,
                memory_max_usage_mib=int((mem_dir / "memory.max_usage_in_bytes").read_text())
                // 2**20,
                qemu_rss_mib=int(
                    next(
                        ln.split()[1]
                        for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if ln.startswith("VmHWM:")
                    )
                )
                // 1024,
            )
        print("\nLIMITS REPORT " + json.dumps(report, indent=1))
    finally:
        admin.delete(f"/v1/sessions/{sid}")
        admin.close()
    conn = libvirt.open("qemu:///system")
    try:
        assert name not in [d.name() for d in conn.listAllDomains(0)]
    finally:
        conn.close()
    assert not (settings.sessions_dir / sid).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int, token: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_bridge.cli", "serve", "--port", str(port), "--token", token],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    _wait_for(
        lambda: (proc.poll() is None and _healthy(port)) or proc.poll() is not None,
        60,
        "server start",
    )
    assert proc.poll() is None, log.read_text()[-2000:]
    return proc


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_kill_9_server_mid_boot_then_restart_reaps_everything(
    settings: Settings, tmp_path: Path
) -> None:
    port, token = _free_port(), secrets.token_urlsafe(16)
    # A state dir of its own: no other server's reaper can tidy up before ours restarts.
    state_dir = settings.state_dir / f"kill9-{secrets.token_hex(4)}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "DESKVM_STATE_DIR": str(state_dir),
        "DESKVM_IMAGES_DIR": str(settings.images_dir),
    }
    (state_dir).mkdir(mode=0o711)
    if settings.host_file.is_file():  # the acceleration probe's verdict
        shutil.copy(settings.host_file, state_dir / "host.json")
    log = tmp_path / "serve.log"
    proc = _serve(port, token, env, log)
    sessions_dir = state_dir / "sessions"
    before: set[str] = set()

    def post() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server dies under us
            httpx.post(
                f"http://127.0.0.1:{port}/v1/sessions",
                headers={"Authorization": f"Bearer {token}"},
                json={"memory_mib": 512, "vcpus": 1},
                timeout=300,
            )

    threading.Thread(target=post, daemon=True).start()
    conn = libvirt.open("qemu:///system")

    def ours() -> list[str]:
        return [
            d.name()
            for d in conn.listAllDomains(0)
            if d.name().startswith("deskvm-")
            and d.name().removeprefix("deskvm-") not in before
            and (sessions_dir / d.name().removeprefix("deskvm-")).is_dir()  # ours only
        ]

    try:
        leaked = _wait_for(ours, 120, "the domain to be started")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        sid = leaked[0].removeprefix("deskvm-")
        # SIGKILL runs no teardown: the domain and its overlay are still there.
        assert leaked[0] in [d.name() for d in conn.listAllDomains(0)]
        assert (sessions_dir / sid / "overlay.qcow2").exists()

        # The same server (same port: same name) restarts: a session that was still
        # booting cannot be taken back, so it is reaped at start, its recording sealed.
        proc = _serve(port, token, env, log)
        assert leaked[0] not in [d.name() for d in conn.listAllDomains(0)]
        assert not (sessions_dir / sid).exists()
        assert ours() == []
        assert f"reaped session {sid}: this server stopped while it was starting" in (
            log.read_text()
        )
        sealed = verify(state_dir / "recordings" / sid)
        assert sealed.ok and sealed.truncated is not None, sealed
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        conn.close()
        leftovers = sorted(p.name for p in sessions_dir.iterdir() if p.name != ".instances")
        shutil.rmtree(state_dir)  # the recordings of this test
    assert leftovers == []
