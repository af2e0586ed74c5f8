"""Nothing leaks: a failure injected at every lifecycle step, then 100 create/delete cycles.

Fake hypervisor, in process. After each injected failure (and one sweep, as the server runs
periodically) no domain, no live session and no open recording remain. The cycle test
counts the process's threads, file descriptors and resident memory and the host objects
(fake domains, files outside the kept recordings) before and after, and prints them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from agent_bridge.server import create_app
from orchestrator.errors import DeskvmError, DisplayError, RecorderError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.recorder import FileRecorder
from orchestrator.settings import Settings
from orchestrator.spec import BootImage, DisplaySpec

TOKEN = "leak-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _image(root: Path) -> BootImage:
    return BootImage("test-desktop", "0" * 64, root / "b.qcow2", root / "k", root / "i")


@pytest.fixture
def hv() -> FakeHypervisor:
    return FakeHypervisor()


@pytest.fixture
def manager(tmp_path: Path, hv: FakeHypervisor) -> SessionManager:
    image = _image(tmp_path)
    return SessionManager(
        hypervisor=hv,
        resolve_image=lambda name: image,
        recordings_dir=tmp_path / "recordings",
        max_sessions=4,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
    )


def _create(manager: SessionManager, **kw: Any) -> Any:
    return manager.create(image="test-desktop", display=DisplaySpec(640, 480), **kw)


def _assert_clean(manager: SessionManager, hv: FakeHypervisor) -> None:
    manager.sweep()  # what the server does every sweep_interval_s
    assert hv.domains == {}
    assert hv.list_sessions() == set()
    assert manager.live() == []
    for session in manager.all():
        assert session.state in ("closed", "failed")
        manifest = session.recorder.path / "manifest.json"  # type: ignore[operator]
        assert json.loads(manifest.read_text()).get("status"), manifest


@pytest.mark.parametrize("step", ["define", "start", "ready"])
def test_start_failure_at_each_step_leaves_nothing(
    manager: SessionManager, hv: FakeHypervisor, step: str
) -> None:
    hv.fail_on.add(step)
    with pytest.raises(DeskvmError):
        _create(manager, boot_timeout_s=2)
    assert not hv.fail_on, "the failure was injected"
    _assert_clean(manager, hv)


def test_readiness_timeout_leaves_nothing(manager: SessionManager, hv: FakeHypervisor) -> None:
    original = hv.start

    def never_ready(spec: Any, **kw: Any) -> Any:
        domain = original(spec, **kw)
        domain._guest_log.clear()  # never says DESKVM_READY
        return domain

    hv.start = never_ready  # type: ignore[method-assign]
    with pytest.raises(DeskvmError) as info:
        _create(manager, boot_timeout_s=0.2)
    assert info.value.code == "boot_timeout"
    _assert_clean(manager, hv)


def _break_read_guest_log(manager: SessionManager, hv: FakeHypervisor) -> Callable[[], None]:
    def arm() -> None:
        for domain in hv.domains.values():

            def fail(offset: int = 0) -> bytes:
                raise DisplayError("injected: guest log unreadable")

            domain.read_guest_log = fail  # type: ignore[method-assign]

    return arm


@pytest.mark.parametrize(
    "step", ["guest_log_snapshot", "destroy", "record_closed", "recorder_close"]
)
def test_teardown_failure_at_each_step_leaves_nothing(
    manager: SessionManager, hv: FakeHypervisor, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _create(manager)
    if step == "guest_log_snapshot":
        _break_read_guest_log(manager, hv)()
    elif step == "destroy":
        hv.fail_on.add("destroy")
    elif step == "record_closed":
        original_append = FileRecorder.append

        def append(self: FileRecorder, kind: Any, data: Any, **kw: Any) -> Any:
            if kind == "lifecycle" and data.get("event") == "closed":
                raise RecorderError("injected: disk full")
            return original_append(self, kind, data, **kw)

        monkeypatch.setattr(FileRecorder, "append", append)
    else:
        original_close = FileRecorder.close
        calls = []

        def close(self: FileRecorder, **kw: Any) -> None:
            if not calls:
                calls.append(1)
                original_close(self, **kw)  # the file is closed, then the error is raised
                raise RecorderError("injected: close failed")
            original_close(self, **kw)

        monkeypatch.setattr(FileRecorder, "close", close)
    with contextlib.suppress(DeskvmError):  # reported; every other step still ran
        manager.delete(session.id)
    monkeypatch.undo()
    assert session.state == "closed"
    if step == "destroy":
        assert session.id in hv.domains  # leaked: the reaper's job now
    _assert_clean(manager, hv)


def _counts(state_dir: Path, hv: FakeHypervisor) -> dict[str, int]:
    gc.collect()
    rss_kib = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    files = [p for p in state_dir.rglob("*") if p.is_file()]
    return {
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": rss_kib,
        "domains": len(hv.domains),
        "files_outside_recordings": sum(
            1 for p in files if "recordings" not in p.relative_to(state_dir).parts
        ),
        "recordings": len(list((state_dir / "recordings").iterdir()))
        if (state_dir / "recordings").is_dir()
        else 0,
    }


@pytest.fixture
def client(manager: SessionManager) -> Iterator[TestClient]:
    app = create_app(manager, token=TOKEN, settings=Settings(default_image="test-desktop"))
    with TestClient(app, headers=AUTH) as c:
        yield c


def _cycle(client: TestClient) -> None:
    response = client.post("/v1/sessions", json={"display": {"width": 640, "height": 480}})
    assert response.status_code == 201, response.text
    sid = response.json()["id"]
    token = client.post(f"/v1/sessions/{sid}/tokens", json={"scope": "control"}).json()
    headers = {"Authorization": f"Bearer {token['token']}"}
    with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=headers) as ws:
        ws.send_text(json.dumps({"id": 1, "action": "type", "text": "x\n"}))
        assert ws.receive_json()["ok"] is True
        ws.send_text(json.dumps({"id": 2, "action": "screenshot"}))
        assert ws.receive_json()["ok"] is True
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200


def test_100_create_delete_cycles_leave_the_host_as_found(
    client: TestClient, hv: FakeHypervisor, tmp_path: Path
) -> None:
    for _ in range(5):  # warm-up: imports, thread pools, caches
        _cycle(client)
    before = _counts(tmp_path, hv)
    for _ in range(100):
        _cycle(client)
    after = _counts(tmp_path, hv)
    print(f"\nLEAK COUNTS before={json.dumps(before)}\nLEAK COUNTS after ={json.dumps(after)}")
    assert after["domains"] == before["domains"] == 0
    assert after["files_outside_recordings"] == before["files_outside_recordings"] == 0
    assert after["recordings"] == before["recordings"] + 100  # kept on purpose: the audit log
    assert after["threads"] <= before["threads"]
    assert after["os_threads"] <= before["os_threads"]
    assert after["fds"] <= before["fds"]
    assert after["rss_kib"] - before["rss_kib"] < 32 * 1024, "more than 32 MiB RSS growth"
