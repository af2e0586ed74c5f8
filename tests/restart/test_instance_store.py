"""Server instances (names, liveness through SIGKILL, heartbeats) and session records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.clock import FakeClock
from orchestrator.errors import ConfigError
from orchestrator.instance import Instance
from orchestrator.spec import BootImage, DisplaySpec, EgressPolicy, SessionSpec
from orchestrator.store import FileSessionStore, SessionRecord, spec_from_json, spec_to_json

ROOT = Path(__file__).resolve().parents[2]


def test_a_name_is_held_until_the_process_dies_even_by_sigkill(tmp_path: Path) -> None:
    code = (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
        "from pathlib import Path\n"
        "from orchestrator.instance import Instance\n"
        f"Instance(Path({str(tmp_path)!r}), 'serve-1'); print('up', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        me = Instance(tmp_path, "serve-2", clock=FakeClock())
        assert me.alive("serve-1") and me.gone_for_s("serve-1") is None
        with pytest.raises(ConfigError) as info:
            Instance(tmp_path, "serve-1")
        assert info.value.code == "instance_busy"
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert not me.alive("serve-1")
        beat = me.last_seen("serve-1")
        assert beat is not None and beat.pid == child.pid and not beat.ephemeral
        Instance(tmp_path, "serve-1").close()  # the name is free again
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_gone_for_counts_from_the_last_heartbeat(tmp_path: Path) -> None:
    clock = FakeClock()
    gone = Instance(tmp_path, "serve-1", clock=clock)
    gone.close(keep_sessions=True)  # a graceful exit that keeps its sessions
    me = Instance(tmp_path, "serve-2", clock=clock)
    clock.advance(42)
    assert me.gone_for_s("serve-1") == pytest.approx(42)
    assert me.last_seen("serve-1").stopped  # type: ignore[union-attr]
    assert me.gone_for_s("nobody") == float("inf")
    eph = Instance(tmp_path, None, clock=clock)
    assert eph.name.startswith("tmp-") and eph.ephemeral
    name = eph.name
    os.close(eph._fd)  # type: ignore[arg-type]  # (killed)
    eph._fd = None
    assert me.gone_for_s(name) == float("inf")  # nobody will come back as it
    Instance(tmp_path, "serve-3", clock=clock)  # a new instance prunes the dead ephemeral
    assert not (tmp_path / f"{name}.lock").exists()
    assert (tmp_path / "serve-1.json").exists()  # a named one keeps its heartbeat


def test_invalid_names_are_refused(tmp_path: Path) -> None:
    for bad in ("", "Serve", "a/b", "-x", "x" * 64):
        with pytest.raises(ConfigError):
            Instance(tmp_path, bad)


def test_a_record_round_trips_and_is_written_atomically(tmp_path: Path) -> None:
    image = BootImage("img", "ab" * 32, Path("/b"), Path("/k"), Path("/i"), helper_port="p")
    spec = SessionSpec(
        "abcdefgh2345", image, DisplaySpec(1024, 768), ttl_s=60, idle_timeout_s=None,
        egress=EgressPolicy(allow=("example.org:443",)), cpu_quota_pct=50, disk_mib=4096,
        autostart="input-probe",
    )  # fmt: skip
    assert spec_from_json(spec_to_json(spec)) == spec
    store = FileSessionStore(tmp_path / "state")
    record = SessionRecord(
        session_id=spec.session_id, owner="serve-1", boot_id="b", state="ready",
        spec=spec_to_json(spec), created_ns=1, last_action_ns=2, cursor=(3, 4),
        typed_text="ab\ufffd", extras={"tokens": {"revoked": {"x": 1.0}}},
    )  # fmt: skip
    store.save(record)
    assert (tmp_path / "state" / "abcdefgh2345.json").stat().st_mode & 0o777 == 0o600
    assert store.load(spec.session_id) == record
    (tmp_path / "state" / "zzzzzzzzzzzz.json").write_text("{torn")  # unreadable: skipped
    (tmp_path / "state" / "notes.txt").write_text("x")
    assert store.records() == [record]
    store.delete(spec.session_id)
    store.delete(spec.session_id)
    assert store.load(spec.session_id) is None
    assert not list((tmp_path / "state").glob("*.tmp*"))
