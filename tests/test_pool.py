"""The warm pool against the fake hypervisor: claims, refills, memory, faults, reaping."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.clock import FakeClock
from orchestrator.errors import ConfigError, HypervisorError, SessionClosed
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.instance import Instance
from orchestrator.manager import SessionManager
from orchestrator.pool import DEFAULT_CPU_WEIGHT, POOL_CPU_WEIGHT, PoolTarget, parse_warm_pool
from orchestrator.spec import BootImage, DisplaySpec
from tests.accel_verdict import Verdict

IMAGE = BootImage("debian12-desktop", "cd" * 32, Path("/b"), Path("/k"), Path("/i"))
HARD_MIB = 2048 + 768


class Images:
    """An image store whose image can be 'rebuilt' (a new content hash)."""

    def __init__(self) -> None:
        self.image = IMAGE

    def __call__(self, name: str) -> BootImage:
        return self.image


def manager(tmp_path: Path, hv: FakeHypervisor, *, size: int = 2, **kw) -> SessionManager:
    m = SessionManager(
        hypervisor=hv,
        resolve_image=kw.pop("resolve", Images()),
        recordings_dir=tmp_path / "rec",
        ready_poll_s=0.01,
        warm_pool=(PoolTarget("debian12-desktop", size),),
        pool_dir=tmp_path / "pool" / "serve-1",
        **kw,
    )
    assert m.pool is not None
    m.pool._interval_s = 0.05
    return m


@contextlib.contextmanager
def running_pool(m: SessionManager, hv: FakeHypervisor) -> Iterator[SessionManager]:
    """``m`` with its pool started; at the end every session and the pool are closed,
    and (when the body passed) nothing is left with the hypervisor, spares included."""
    m.start_pool()
    try:
        yield m
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {} and hv.spares == {}


def create(m: SessionManager, **kw):
    return m.create(image="debian12-desktop", display=kw.pop("display", DisplaySpec()), **kw)


def lifecycle(session) -> list[dict]:
    lines = (Path(session.recorder.path) / "events.jsonl").read_text().splitlines()
    return [e["data"] for e in map(json.loads, lines) if e["kind"] == "lifecycle"]


def test_parse_warm_pool() -> None:
    assert parse_warm_pool("debian12-desktop:2, other:1") == (
        PoolTarget("debian12-desktop", 2),
        PoolTarget("other", 1),
    )
    assert parse_warm_pool("") == ()
    for bad in ("debian12-desktop", "x:0", "x:two", ":2", "x:1,x:2", "x:65"):
        with pytest.raises(ConfigError):
            parse_warm_pool(bad)


def test_a_matching_session_is_handed_a_restored_desktop(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    m = manager(tmp_path, hv)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        assert len(hv.saved) == 1 and len(hv.restored) == 2
        pooled = m.pool.ids()
        # The next to be claimed runs at a live weight already; the other waits at the pool's.
        weights = sorted(hv.domains[i].cpu_weight for i in pooled)
        assert weights == [POOL_CPU_WEIGHT, DEFAULT_CPU_WEIGHT]
        assert all(hv.domains[i].paused == (hv.domains[i].cpu_weight == POOL_CPU_WEIGHT)
                   for i in pooled)  # fmt: skip
        session = create(m)
        assert session.start_kind == "warm" and session.id in pooled
        assert set(session.start_phases_s) == {"claim_s", "clock_s", "ready_s"}
        assert hv.domains[session.id].clock_set == 1 and session.clock_offset_s == 0.0
        assert hv.domains[session.id].cpu_weight == DEFAULT_CPU_WEIGHT
        assert hv.domains[session.id].restored_from is not None
        events = lifecycle(session)
        assert events[0]["event"] == "starting" and events[0]["start"] == "warm"
        assert events[1]["event"] == "ready" and events[1]["start"] == "warm"
        assert session.id not in m.pool.ids()
        assert m.pool.wait_full(5) and len(hv.restored) == 3  # refilled
        other = create(m, display=DisplaySpec(1024, 768))
        assert other.start_kind == "cold" and "domain_start_s" in other.start_phases_s
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {}
    assert not (tmp_path / "pool" / "serve-1").exists()


def test_the_reaper_leaves_pool_domains_alone(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    m = manager(tmp_path, hv)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        pooled = m.pool.ids()
        assert m.reap() == []
        assert pooled <= set(hv.domains)
    finally:
        m.close_pool()
    # A server that did not close its pool leaves domains its successor reaps.
    hv2 = FakeHypervisor()
    m2 = manager(tmp_path, hv2, size=1)
    m2.pool._interval_s = 3600
    m2.start_pool()
    assert m2.pool.wait_full(5)
    hv2.domains.update({"leftover0000": hv2.domains[next(iter(m2.pool.ids()))]})
    assert m2.reap() == ["leftover0000"]
    m2.close_pool()


def test_pool_memory_counts_and_a_cold_session_evicts_pooled_desktops(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=3, max_total_memory_mib=3 * HARD_MIB)
    m.start_pool()
    try:
        # The template boots within the budget; three restored desktops fill it.
        assert m.pool.wait_full(5)
        assert m.pool.memory_mib() == 3 * HARD_MIB
        cold = create(m, display=DisplaySpec(1024, 768))
        assert cold.start_kind == "cold"
        assert m.pool.memory_mib() <= 2 * HARD_MIB
        time.sleep(0.3)  # the refill respects the budget
        assert m.pool.memory_mib() + HARD_MIB <= 3 * HARD_MIB
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {}


def test_a_new_image_hash_drops_the_pool_and_builds_anew(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    images = Images()
    m = manager(tmp_path, hv, resolve=images)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        old = m.pool.ids()
        images.image = BootImage("debian12-desktop", "ef" * 32, Path("/b"), Path("/k"), Path("/i"))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            m.pool.status()[0]["image_hash"] != "ef" * 32 or m.pool.status()[0]["ready"] < 2
        ):
            time.sleep(0.02)
        assert m.pool.status()[0]["image_hash"] == "ef" * 32
        assert not old & set(hv.domains)
        session = create(m)
        assert session.start_kind == "warm" and session.spec.image.content_hash == "ef" * 32
        assert len(hv.saved) == 2
    finally:
        m.close_all()
        m.close_pool()


@pytest.mark.parametrize("fault", ["corrupt", "deleted"])
def test_a_broken_saved_state_is_reported_and_sessions_boot_cold(
    tmp_path: Path, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        state = next((tmp_path / "pool" / "serve-1").glob("*/state.save"))
        if fault == "corrupt":
            state.write_bytes(b"\x00garbage")
        else:
            state.unlink()
        first = create(m)  # the ready desktop was restored before the fault
        assert first.start_kind == "warm"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and m.pool.status()[0]["phase"] != "failed":
            time.sleep(0.02)
        status = m.pool.status()[0]
        assert status["phase"] == "failed" and "restore failed" in status["error"]
        assert "state.save" in status["error"]
        assert "sessions boot cold" in caplog.text
        second = create(m)
        assert second.start_kind == "cold"
        # Nothing is left of the failed restore, and the broken state is gone.
        assert set(hv.domains) == {first.id, second.id}
        assert not state.parent.exists()
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {}


def test_a_failed_template_save_leaves_nothing_and_is_reported(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    hv.fail_on.add("save")
    m = manager(tmp_path, hv, size=1)
    m.start_pool()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and m.pool.status()[0]["phase"] != "failed":
            time.sleep(0.02)
        assert "template boot or save failed" in m.pool.status()[0]["error"]
        assert hv.domains == {} and m.pool.ids() == set()
        assert list((tmp_path / "pool" / "serve-1").iterdir()) == []
        assert create(m).start_kind == "cold"
    finally:
        m.close_all()
        m.close_pool()


def test_a_pool_needs_server_made_ids(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="warm pool"):
        manager(tmp_path, FakeHypervisor(), new_id=lambda: "abcdef012345")


def test_a_reset_session_has_a_live_sessions_cpu_weight(tmp_path: Path) -> None:
    # The template was saved at the pool's low weight: a restore of its state inherits it.
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        session = create(m)
        assert hv.domains[session.id].cpu_weight == DEFAULT_CPU_WEIGHT
        m.reset(session.id)
        assert hv.domains[session.id].cpu_weight == DEFAULT_CPU_WEIGHT
        assert set(session.reset_phases_s) == {"restore_s", "clock_s", "ready_s"}
    finally:
        m.close_all()
        m.close_pool()


def _blocked_reset(hv: FakeHypervisor) -> tuple[threading.Event, threading.Event]:
    """Make the next reset stop between destroying the old domain and restoring the new
    one (where a real reset spends its second); returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = hv.reset

    def reset(spec, state):
        hv.domains[spec.session_id].running = False  # the old domain is destroyed first
        entered.set()
        assert release.wait(5)
        return real(spec, state)

    hv.reset = reset  # type: ignore[method-assign]
    return entered, release


def _reset_in_thread(
    m: SessionManager, session_id: str
) -> tuple[threading.Thread, list[BaseException]]:
    """Start ``m.reset(session_id)`` in a thread; what it raised lands in the list."""
    errors: list[BaseException] = []

    def reset() -> None:
        try:
            m.reset(session_id)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reset)
    thread.start()
    return thread, errors


def test_the_sweeper_leaves_a_session_being_reset_alone(tmp_path: Path) -> None:
    clock = FakeClock()
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1, clock=clock)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        session = create(m, idle_timeout_s=60)
        entered, release = _blocked_reset(hv)
        thread, errors = _reset_in_thread(m, session.id)
        assert entered.wait(5)
        clock.advance(61)  # past the idle deadline, and the old domain is gone
        expired, reaped = m.sweep()
        release.set()
        thread.join(5)
        assert (expired, reaped, errors) == ([], [], [])
        assert session.state == "ready" and session.resets == 1
        assert hv.domains[session.id].running
        # The reset counts as activity: the idle deadline starts again after it.
        clock.advance(30)
        assert m.sweep() == ([], [])
        clock.advance(31)
        assert m.sweep()[0] == [session.id]
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {}


def test_a_session_deleted_during_its_reset_stays_deleted(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        session = create(m)
        entered, release = _blocked_reset(hv)
        thread, errors = _reset_in_thread(m, session.id)
        assert entered.wait(5)
        m.delete(session.id, reason="ttl expired")
        release.set()
        thread.join(5)
        assert len(errors) == 1 and isinstance(errors[0], SessionClosed), errors
        assert session.state == "closed" and session.closed_reason == "ttl expired"
        assert session.id not in hv.domains, "the reset brought a deleted session back"
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {}


def test_pooled_desktops_wait_paused_and_run_from_the_claim(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    m = manager(tmp_path, hv)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        pooled = m.pool.ids()
        # The next one to be claimed runs; the others wait paused (no CPU).
        assert sorted(hv.domains[i].paused for i in pooled) == [False, True]
        (head,) = [i for i in pooled if not hv.domains[i].paused]
        session = create(m)
        assert session.id == head and not hv.domains[session.id].paused
        time.sleep(0.3)  # the refill thread runs the new head
        assert sorted(hv.domains[i].paused for i in m.pool.ids()) == [False, True]
        m.reset(session.id)
        assert not hv.domains[session.id].paused
    finally:
        m.close_all()
        m.close_pool()


def test_the_reaper_removes_the_pool_files_of_gone_servers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "pool"
    for name in ("serve-gone", "serve-2", "serve-1"):
        (root / name / "0123456789abcdef").mkdir(parents=True)
        (root / name / "0123456789abcdef" / "state.save").write_bytes(b"x" * (2 << 20))
    me = Instance(tmp_path / "instances", "serve-1")
    other = Instance(tmp_path / "instances", "serve-2")  # alive: its pool is its own
    try:
        m = SessionManager(
            hypervisor=FakeHypervisor(),
            resolve_image=Images(),
            recordings_dir=tmp_path / "rec",
            instance=me,
            pool_dir=root / "serve-1",  # no pool here: a killed predecessor's files go too
        )
        assert m.reap() == []
        assert sorted(p.name for p in root.iterdir()) == ["serve-2"]
        assert "removed the warm pool files of server 'serve-gone'" in caplog.text
        assert "(2 MiB of saved state)" in caplog.text
    finally:
        other.close()
        me.close()


def test_an_image_rebuilt_in_place_drops_the_pool(tmp_path: Path) -> None:
    # Same content hash (deskvm image build --force), new base file: the saved state's
    # frozen disk backs onto that path, so restoring it again would mix two disks.
    base = tmp_path / "base.qcow2"
    base.write_bytes(b"one")
    images = Images()
    images.image = BootImage("debian12-desktop", "cd" * 32, base, Path("/k"), Path("/i"))
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1, resolve=images)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        old = m.pool.ids()
        replacement = tmp_path / "new.qcow2"
        replacement.write_bytes(b"two")
        replacement.rename(base)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (len(hv.saved) < 2 or not m.pool.wait_full(0.1)):
            time.sleep(0.02)
        assert len(hv.saved) == 2 and not old & m.pool.ids() and not old & set(hv.domains)
    finally:
        m.close_all()
        m.close_pool()


def _blocked_restore(hv: FakeHypervisor) -> tuple[threading.Event, threading.Event]:
    """Make the pool's next restore wait (where a real one spends 0.6-2 s) until released;
    returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = hv.restore

    def restore(spec, state, **kw):
        hv.restore = real  # type: ignore[method-assign]
        entered.set()
        assert release.wait(10)
        return real(spec, state, **kw)

    hv.restore = restore  # type: ignore[method-assign]
    return entered, release


def test_a_claim_on_an_empty_pool_waits_for_the_restore_under_way(tmp_path: Path) -> None:
    # Claims one after the other, faster than restores: the pool runs empty while its
    # refill restores the next desktop. The claim waits for it instead of booting cold.
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        entered, release = _blocked_restore(hv)
        first = create(m)
        assert first.start_kind == "warm"
        assert entered.wait(5)  # the refill is restoring the next desktop
        threading.Timer(0.3, release.set).start()
        second = create(m)
        assert second.start_kind == "warm", "the claim booted cold while a restore was under way"
        assert second.start_phases_s["claim_s"] >= 0.25
        status = m.pool.status()[0]
        assert (status["claims"], status["waited_claims"], status["empty_claims"]) == (2, 1, 0)
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {}


def test_a_claim_does_not_wait_when_no_desktop_is_coming(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The memory budget holds one desktop: after the claim, no refill can start.
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1, max_total_memory_mib=HARD_MIB)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        assert create(m).start_kind == "warm"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not m.pool._entries[0].starved:
            time.sleep(0.02)
        t0 = time.monotonic()
        m.pool._claim_wait_s = 30.0
        key = next(iter(m.pool._entries)).key
        assert m.pool.claim(key) is None
        assert time.monotonic() - t0 < 1.0
        assert m.pool.status()[0]["empty_claims"] == 1
        assert "no desktop ready for a claim (the memory budget has no room" in caplog.text
    finally:
        m.close_all()
        m.close_pool()


def test_a_failed_hand_over_is_counted_and_the_session_boots_cold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        (pooled,) = m.pool.ids()
        assert _wait_for(lambda: not hv.domains[pooled].paused)  # the pool ran its head
        real = hv.resume

        def resume(session_id: str) -> None:
            hv.resume = real  # type: ignore[method-assign]
            raise HypervisorError(f"injected failure resuming {session_id}")

        hv.resume = resume  # type: ignore[method-assign]
        session = create(m)
        assert session.start_kind == "cold" and pooled not in hv.domains
        status = m.pool.status()[0]
        assert (status["claims"], status["handover_failures"]) == (1, 1)
        assert f"warm desktop {pooled} could not be handed over" in caplog.text
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {}


def test_the_refill_waits_until_the_claimed_session_is_ready(tmp_path: Path) -> None:
    # On 2 cores a restore beside a claim slowed its first frame from ~0.2 s to 0.7-1.9 s:
    # the refill restores the next desktop once the claimed session is ready.
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        (pooled,) = m.pool.ids()
        in_clock, release = threading.Event(), threading.Event()
        domain = hv.domains[pooled]
        real = domain.set_clock

        def set_clock(timeout_s: float = 1.0) -> float | None:
            in_clock.set()
            assert release.wait(10)
            return real(timeout_s)

        domain.set_clock = set_clock  # type: ignore[method-assign]
        sessions = []
        thread = threading.Thread(target=lambda: sessions.append(create(m)))
        thread.start()
        assert in_clock.wait(5)
        time.sleep(0.5)  # ten refill intervals
        assert len(hv.restored) == 1, "the refill restored while the claimed session started"
        release.set()
        thread.join(5)
        assert sessions and sessions[0].start_kind == "warm"
        assert m.pool.wait_full(5) and len(hv.restored) == 2
    finally:
        release.set()
        m.close_all()
        m.close_pool()


def test_a_refill_held_back_for_a_claim_gives_way_to_a_waiting_claim(tmp_path: Path) -> None:
    # A claimed session that never says it is ready holds the refill back for at most
    # SETTLE_MAX_S; a claim that finds the pool empty meanwhile makes the refill start.
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        key = m.pool._entries[0].key
        first = m.pool.claim(key)  # never settled
        assert first is not None
        t0 = time.monotonic()
        second = m.pool.claim(key)
        assert second is not None and time.monotonic() - t0 < 2.0
        assert m.pool.status()[0]["waited_claims"] == 1
        for desktop in (first, second):
            m.pool.release(desktop.spec.session_id)
            hv.destroy(desktop.spec.session_id)
    finally:
        m.close_all()
        m.close_pool()


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_reset_runs_the_spare_restored_ahead(tmp_path: Path) -> None:
    # A reset restored its start state (~1 s on these hosts); the pool restores the
    # session's next generation ahead, paused at the pool's weight, and the reset runs it.
    hv = FakeHypervisor()
    with running_pool(manager(tmp_path, hv, size=1), hv) as m:
        assert m.pool.wait_full(5)
        session = create(m)
        assert _wait_for(lambda: m.pool.status()[0]["reset_spares"] == 1)
        spare = hv.spares[session.id]
        assert spare.paused and spare.cpu_weight == POOL_CPU_WEIGHT
        assert m.pool.memory_mib() == 2 * HARD_MIB  # the pooled desktop and the spare
        m.reset(session.id)
        assert hv.spares_used == 1 and hv.domains[session.id] is spare
        assert not spare.paused and spare.cpu_weight == DEFAULT_CPU_WEIGHT
        assert spare.clock_set == 1
        done = [e for e in lifecycle(session) if e["event"] == "reset_done"]
        assert done[-1]["spare"] is True
        status = m.pool.status()[0]
        assert (status["spare_resets"], status["restored_resets"]) == (1, 0)
        # The next reset gets a spare of its own.
        assert _wait_for(lambda: session.id in hv.spares)
        m.reset(session.id)
        assert hv.spares_used == 2
        m.delete(session.id)
        assert session.id not in hv.spares and session.id not in hv.domains
        assert _wait_for(lambda: m.pool.memory_mib() == HARD_MIB)


def test_a_reset_without_room_for_a_spare_restores(tmp_path: Path) -> None:
    # The memory budget holds the pooled desktop and the session: no spare, and the
    # reset restores as before.
    hv = FakeHypervisor()
    with running_pool(manager(tmp_path, hv, size=1, max_total_memory_mib=2 * HARD_MIB), hv) as m:
        assert m.pool.wait_full(5)
        session = create(m)
        assert m.pool.wait_full(5)
        time.sleep(0.3)  # refill rounds
        assert hv.spares == {}
        m.reset(session.id)
        assert hv.spares_used == 0 and hv.domains[session.id].restored_from is not None
        assert [e for e in lifecycle(session) if e["event"] == "reset_done"][-1]["spare"] is False
        assert m.pool.status()[0]["restored_resets"] == 1


def test_a_cold_session_evicts_reset_spares(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    with running_pool(manager(tmp_path, hv, size=1, max_total_memory_mib=3 * HARD_MIB), hv) as m:
        assert m.pool.wait_full(5)
        warm = create(m)
        assert _wait_for(lambda: warm.id in hv.spares and m.pool.wait_full(0.1))
        # Needs more than the pooled desktop frees: the spare goes too.
        cold = create(m, memory_mib=4096)
        assert cold.start_kind == "cold"
        assert warm.id not in hv.spares and m.pool.memory_mib() == 0
        m.reset(warm.id)  # without its spare: restored
        assert warm.state == "ready" and hv.spares_used == 0
        assert m.pool.status()[0]["restored_resets"] == 1


def test_a_spare_that_fails_leaves_the_session_alone(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    hv.fail_on.add("prepare_reset")
    with running_pool(manager(tmp_path, hv, size=1), hv) as m:
        assert m.pool.wait_full(5)
        session = create(m)
        time.sleep(0.3)
        assert session.state == "ready" and "prepare_reset" not in hv.fail_on
        m.reset(session.id)
        assert session.state == "ready" and session.resets == 1


def test_a_claim_of_the_running_head_changes_no_cpu_weight(tmp_path: Path) -> None:
    # A weight change waited for the restore under way (0.3-0.6 s of a claim in the
    # bench): the head gets the live weight while pooled, and its claim sets none.
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=2)
    m.start_pool()
    try:
        assert m.pool.wait_full(5)
        assert _wait_for(lambda: any(not hv.domains[i].paused for i in m.pool.ids()))
        calls: list[str] = []
        real = hv.set_cpu_weight

        def set_cpu_weight(session_id: str, cpu_weight: int) -> None:
            calls.append(session_id)
            real(session_id, cpu_weight)

        hv.set_cpu_weight = set_cpu_weight  # type: ignore[method-assign]
        m.pool._interval_s = 60.0
        m.pool._stop.set()  # no refill: only the claim's calls count
        session = create(m)
        assert session.start_kind == "warm" and session.id not in calls
        assert hv.domains[session.id].cpu_weight == DEFAULT_CPU_WEIGHT
    finally:
        m.pool._stop.clear()
        m.close_all()
        m.close_pool()


def test_a_refused_reset_keeps_the_spare_counted(tmp_path: Path) -> None:
    # A reset refused before it starts (here: the session expired, not yet swept) did not
    # run the spare; the pool must still count it (memory budget, reset_spares) while
    # the hypervisor keeps it.
    clock = FakeClock()
    hv = FakeHypervisor()
    with running_pool(manager(tmp_path, hv, size=1, clock=clock), hv) as m:
        assert m.pool.wait_full(5)
        session = create(m, idle_timeout_s=60)
        assert _wait_for(lambda: m.pool.status()[0]["reset_spares"] == 1)
        clock.advance(61)  # expired, not swept yet
        with pytest.raises(SessionClosed):
            m.reset(session.id)
        assert session.id in hv.spares
        assert _wait_for(lambda: m.pool.memory_mib() == 2 * HARD_MIB)
        assert m.pool.status()[0]["reset_spares"] == 1


def test_reset_spares_give_way_to_the_pools_desktops(tmp_path: Path) -> None:
    # Room for four: a spare saves ~0.7 s of a reset, a pooled desktop a cold boot. A
    # spare must not keep the pool from refilling (the next warm start would boot cold).
    hv = FakeHypervisor()
    with running_pool(manager(tmp_path, hv, size=1, max_total_memory_mib=4 * HARD_MIB), hv) as m:
        assert m.pool.wait_full(5)
        first = create(m)
        assert _wait_for(lambda: first.id in hv.spares and m.pool.wait_full(0.1))
        second = create(m)
        assert second.start_kind == "warm"
        assert m.pool.wait_full(5)
        third = create(m)  # the pool's desktop; its refill needs the first's spare's room
        assert third.start_kind == "warm"
        assert m.pool.wait_full(5), m.pool.status()
        assert first.id not in hv.spares
        fourth = create(m)
        assert fourth.start_kind == "warm"
        m.reset(first.id)  # without its spare: restored
        assert first.state == "ready"


def test_a_template_is_saved_once_its_guest_clock_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guest starts its clock only once its desktop is ready: the template is saved
    after the clock's first confirmation, not at the ready frame."""
    from orchestrator.hypervisor.fake import FakeDomain

    answers = iter([None, None, None])
    asked_before_save: list[int] = []
    hv = FakeHypervisor()

    def set_clock(self: FakeDomain, timeout_s: float = 1.0) -> float | None:
        self.clock_set += 1
        if not hv.saved:
            asked_before_save.append(self.clock_set)
        return next(answers, 0.0)

    monkeypatch.setattr(FakeDomain, "set_clock", set_clock)
    m = manager(tmp_path, hv, size=1)
    with running_pool(m, hv):
        assert m.pool.wait_full(5)
        assert asked_before_save == [1, 2, 3, 4]  # three unanswered, then saved
        assert len(hv.saved) == 1


def test_a_template_whose_guest_clock_never_answers_is_saved_anyway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An image without the guest clock (imported) still gets a warm pool."""
    from orchestrator import pool as pool_module
    from orchestrator.hypervisor.fake import FakeDomain

    monkeypatch.setattr(pool_module, "TEMPLATE_CLOCK_WAIT_S", 0.2)
    monkeypatch.setattr(FakeDomain, "set_clock", lambda self, timeout_s=1.0: None)
    hv = FakeHypervisor()
    m = manager(tmp_path, hv, size=1)
    with caplog.at_level("WARNING", logger="deskvm.pool"), running_pool(m, hv):
        assert m.pool.wait_full(5)
        assert len(hv.saved) == 1
        assert "guest clock did not answer" in caplog.text


def test_a_template_kvm_stops_is_booted_again_under_tcg_at_once(tmp_path: Path) -> None:
    """KVM stops the template's Linux guest (a PVM host): the pool does not wait out its
    retry delay; the hypervisor falls back to TCG and the next template boot fills it."""
    verdict = Verdict()
    hv = FakeHypervisor(accel="kvm", accel_verdict=verdict)
    hv.fail_on.add("accel")
    with running_pool(manager(tmp_path, hv, size=1), hv) as m:
        assert m.pool is not None
        assert m.pool.wait_full(5)  # RETRY_S is 30 s: only an immediate retry fills it
        assert hv.accel == "tcg" and len(verdict.failed) == 1
        assert "KVM internal error" in verdict.failed[0] and verdict.ran == 0
        assert create(m).start_kind == "warm"


def test_a_template_ready_under_kvm_is_proof_that_kvm_runs_linux(tmp_path: Path) -> None:
    verdict = Verdict()
    hv = FakeHypervisor(accel="kvm", accel_verdict=verdict)
    with running_pool(manager(tmp_path, hv, size=1), hv) as m:
        assert m.pool is not None and m.pool.wait_full(5)
        assert verdict.ran == 1 and verdict.failed == [] and hv.accel == "kvm"


def test_a_reset_of_a_deleted_session_says_it_is_closed(tmp_path: Path) -> None:
    """Deleted (cold or warm), a session's reset answers session_closed, not
    reset_unavailable; one deleted as its reset finishes stays deleted, and the reset
    says so rather than answer with a closing session."""
    hv = FakeHypervisor()
    with running_pool(manager(tmp_path, hv, size=1), hv) as m:
        assert m.pool is not None and m.pool.wait_full(5)
        cold = create(m, display=DisplaySpec(1024, 768))  # no pooled desktop of that size
        assert cold.start_kind == "cold"
        m.delete(cold.id)
        with pytest.raises(SessionClosed) as info:
            m.reset(cold.id)
        assert info.value.code == "session_closed"
        warm = create(m)
        assert warm.start_kind == "warm"
        reset = warm.reset

        def reset_then_deleted() -> float:
            took = reset()
            m.delete(warm.id)  # the client's DELETE, just as the reset finished
            return took

        warm.reset = reset_then_deleted  # type: ignore[method-assign]
        with pytest.raises(SessionClosed):
            m.reset(warm.id)
        assert warm.state == "closed"
