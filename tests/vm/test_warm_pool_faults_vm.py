"""Warm pool faults on real VMs (issue 11, "Faults"): each one template boot, kept short.

* The disk fills while the template is saved: the pool's directory is a small tmpfs.
* The saved state is cut in half after the pool filled: the next restore fails.
* ``deskvm serve`` is SIGKILLed while its pool refills; another server (another name, no
  pool) starts in the same state dir.

Each time the server says what happened (pool ``phase``/``error`` in ``/healthz``, or its
log), sessions would boot cold (the fake-hypervisor tests show the fallback), and nothing
is left: no domain, no session directory, no saved state.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import libvirt
import pytest

from agent_bridge.runtime import build_manager
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import DisplaySpec
from tests.vm.test_limits_vm import _free_port, _wait_for

POOL_FILL_TIMEOUT_S = 400.0


def _own_domains(conn: libvirt.virConnect, state_dir: Path) -> list[str]:
    """Names of running domains whose session directory is under ``state_dir``."""
    sessions = state_dir / "sessions"
    return [
        d.name()
        for d in conn.listAllDomains(0)
        if d.name().startswith("deskvm-") and (sessions / d.name().removeprefix("deskvm-")).exists()
    ]


def _session_dirs(state_dir: Path) -> list[str]:
    sessions = state_dir / "sessions"
    return sorted(p.name for p in sessions.iterdir() if not p.name.startswith(".")) if (
        sessions.is_dir()
    ) else []  # fmt: skip


def _wait_phase(manager: SessionManager, phase: str, timeout_s: float) -> dict:
    pool = manager.pool
    assert pool is not None
    return _wait_for(
        lambda: next((t for t in pool.status() if t["phase"] == phase), None),
        timeout_s,
        f"pool phase {phase}",
    )


@pytest.fixture
def state_dir(settings: Settings) -> Iterator[Path]:
    path = settings.state_dir / f"pool-faults-{secrets.token_hex(4)}"
    path.mkdir(mode=0o711)
    if settings.host_file.is_file():
        shutil.copy(settings.host_file, path / "host.json")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_disk_full_during_the_save_is_reported_and_leaves_nothing(
    settings: Settings, state_dir: Path
) -> None:
    # The pool's directory is a 64 MiB tmpfs: the template boots (its overlay is on the
    # state dir's disk), and libvirt's save of its memory (~200 MiB) fills it.
    pool_dir = state_dir / "pool" / "pool-fill"
    pool_dir.mkdir(parents=True, mode=0o711)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0711", "tmpfs", str(pool_dir)], check=True
    )
    fill = settings.replace(
        state_dir=state_dir,
        images_dir_override=settings.images_dir,
        warm_pool=f"{settings.default_image}:1",
        capture_fps=0,
    )
    manager = build_manager(fill, server_name="pool-fill")
    assert manager.pool is not None and manager.pool.pool_dir == pool_dir
    manager.start_pool()
    try:
        failed = _wait_phase(manager, "failed", POOL_FILL_TIMEOUT_S)
        print(f"\npool error: {failed['error']}")
        assert "template boot or save failed" in failed["error"]
        assert "No space left on device" in failed["error"]
        assert manager.pool.ids() == set()
        conn = libvirt.open(settings.libvirt_uri)
        try:
            assert _own_domains(conn, state_dir) == []
        finally:
            conn.close()
        assert _session_dirs(state_dir) == []
        assert list(pool_dir.iterdir()) == []
    finally:
        manager.close_pool()
        leftovers = manager.hypervisor.list_sessions()
        manager.hypervisor.close()  # type: ignore[attr-defined]
        manager.instance.close()  # type: ignore[union-attr]
        subprocess.run(["umount", str(pool_dir)], check=False)
    assert leftovers == set()


def test_a_cut_saved_state_is_reported_and_leaves_nothing(
    settings: Settings, state_dir: Path
) -> None:
    cut = settings.replace(
        state_dir=state_dir,
        images_dir_override=settings.images_dir,
        warm_pool=f"{settings.default_image}:1",
        capture_fps=0,
    )
    manager = build_manager(cut)
    assert manager.pool is not None
    manager.start_pool()
    session = None
    try:
        assert manager.pool.wait_full(POOL_FILL_TIMEOUT_S), manager.pool.status()
        (state,) = manager.pool.pool_dir.glob("*/state.save")
        size = state.stat().st_size
        os.truncate(state, size // 2)  # the session claimed next has its own link: cut too
        session = manager.create(image=settings.default_image, display=DisplaySpec())
        assert session.start_kind == "warm"  # restored before the fault
        failed = _wait_phase(manager, "failed", 120)
        print(f"\npool error: {failed['error']}")
        assert "restore failed" in failed["error"] and "state.save" in failed["error"]
        assert not state.parent.exists()
        conn = libvirt.open(settings.libvirt_uri)
        try:
            assert _own_domains(conn, state_dir) == [f"deskvm-{session.id}"]
        finally:
            conn.close()
        assert _session_dirs(state_dir) == [session.id]
    finally:
        if session is not None:
            manager.delete(session.id)
        manager.close_pool()
        leftovers = manager.hypervisor.list_sessions()
        manager.hypervisor.close()  # type: ignore[attr-defined]
        manager.instance.close()  # type: ignore[union-attr]
    assert leftovers == set()
    assert not manager.pool.pool_dir.exists()


def _serve(port: int, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_bridge.cli", "serve", "--port", str(port), *args],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    _wait_for(lambda: _health(port) is not None or proc.poll() is not None, 60, "server start")
    assert proc.poll() is None, log.read_text()[-2000:]
    return proc


def _health(port: int) -> dict | None:
    with contextlib.suppress(httpx.HTTPError):
        answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        if answer.status_code == 200:
            return answer.json()
    return None


def test_kill_9_while_the_pool_refills_leaves_nothing_behind(
    settings: Settings, state_dir: Path, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "DESKVM_STATE_DIR": str(state_dir),
        "DESKVM_IMAGES_DIR": str(settings.images_dir),
        "DESKVM_TOKEN": secrets.token_urlsafe(16),
        "DESKVM_CAPTURE_FPS": "0",
    }
    log = tmp_path / "serve.log"
    first_port, second_port = _free_port(), _free_port()
    proc = _serve(first_port, env, log, "--warm-pool", f"{settings.default_image}:2")
    second = None
    conn = libvirt.open(settings.libvirt_uri)
    try:
        # Killed once the template is saved and the first desktop restored: the second
        # restore is under way or about to be.
        _wait_for(
            lambda: (_health(first_port) or {}).get("warm_pool", [{}])[0].get("ready", 0) >= 1,
            POOL_FILL_TIMEOUT_S,
            "the first pool desktop",
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        left = _own_domains(conn, state_dir)
        pool_files = [p.name for p in (state_dir / "pool").rglob("*")]
        print(f"\nleft by the killed server: domains {left}, pool files {pool_files}")
        assert left and "state.save" in pool_files  # something to clean up
        # Another server (another name, no pool) in the same installation cleans up at start.
        second = _serve(second_port, env, log)
        _wait_for(lambda: not _own_domains(conn, state_dir), 60, "the pool domains reaped")
        _wait_for(lambda: not any((state_dir / "pool").iterdir()), 30, "the pool files gone")
        assert _session_dirs(state_dir) == []
    finally:
        for p in (proc, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=120)
        for name in _own_domains(conn, state_dir):
            with contextlib.suppress(libvirt.libvirtError):
                conn.lookupByName(name).destroy()
        conn.close()
    serve_log = log.read_text()
    print(serve_log[-1500:])
    assert f"removed the warm pool files of server 'serve-{first_port}'" in serve_log
    assert "reaped leftovers of unknown sessions" in serve_log
