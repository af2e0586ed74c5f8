"""Warm starts on real VMs: two sessions handed desktops restored from one saved state.

One template boot (20-60 s of TCG), one save, two restores. The two sessions must be
distinct where it matters: 32 bytes of ``/dev/urandom`` read right after the claim differ
(the VM generation ID changed, the guest kernel reseeded), and each guest's wall clock is
within 1 s of the host's (set at the claim, although the state was saved earlier). A reset
of one of them forgets a file it wrote: the first reset runs the spare the pool restored
ahead (the session's next generation, paused), the second restores (its spare discarded).
Nothing of the pool is left once it is closed.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import libvirt
from PIL import Image

from agent_bridge.protocol import parse_deskvm_action
from agent_bridge.protocol.results import ImageResult
from agent_bridge.runtime import build_manager
from orchestrator.hypervisor.base import LIVE_CPU_WEIGHT
from orchestrator.hypervisor.domain_xml import domain_name, generation_of, session_id_of
from orchestrator.pool import POOL_CPU_WEIGHT
from orchestrator.session import Session
from orchestrator.settings import Settings
from orchestrator.spec import DisplaySpec
from tests.vm.conftest import window_box

POOL_FILL_TIMEOUT_S = 400.0


def _act(session: Session, **body: object):
    return session.execute(parse_deskvm_action(body))


def _wait_for(session: Session, pattern: str, timeout_s: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, session.guest_log().decode("utf-8", "replace"))
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} never reached the guest log of {session.id}")


def _domains(settings: Settings, session_id: str) -> list[str]:
    """The session's domains: ``deskvm-<id>``, then ``deskvm-<id>-r<N>`` after resets."""
    conn = libvirt.open(settings.libvirt_uri)
    try:
        found = [d.name() for d in conn.listAllDomains(0) if session_id_of(d.name()) == session_id]
    finally:
        conn.close()
    return sorted(found, key=generation_of)


def _lookup_all(conn: libvirt.virConnect, names: list[str]) -> list[libvirt.virDomain]:
    """The domains of ``names`` still there (a reset's old one goes in the background)."""
    found = []
    for name in names:
        try:
            found.append(conn.lookupByName(name))
        except libvirt.libvirtError:
            continue
    return found


def _is_running(dom: libvirt.virDomain) -> bool:
    try:
        return bool(dom.info()[0] == libvirt.VIR_DOMAIN_RUNNING)
    except libvirt.libvirtError:  # gone meanwhile
        return False


def _current(settings: Settings, session_id: str, what: str, generation: int | None = None) -> int:
    """``what`` of the session's running domain (its spare waits paused), or of the
    domain of ``generation``."""
    conn = libvirt.open(settings.libvirt_uri)
    try:
        doms = _lookup_all(conn, _domains(settings, session_id))
        if generation is not None:
            dom = next(d for d in doms if generation_of(d.name()) == generation)
        else:
            dom = max(doms, key=lambda d: (_is_running(d), generation_of(d.name())))
        if what == "cpu_shares":
            return int(dom.schedulerParameters()["cpu_shares"])
        return int(dom.info()[0])
    finally:
        conn.close()


def _running_name(settings: Settings, session_id: str) -> str:
    conn = libvirt.open(settings.libvirt_uri)
    try:
        doms = _lookup_all(conn, _domains(settings, session_id))
        return next(d.name() for d in doms if _is_running(d))
    finally:
        conn.close()


def _reset_done(session: Session) -> dict:
    lines = (Path(session.recorder.path) / "events.jsonl").read_text().splitlines()
    events = [e["data"] for e in map(json.loads, lines) if e["kind"] == "lifecycle"]
    return [e for e in events if e["event"] == "reset_done"][-1]


def _cpu_shares(settings: Settings, session_id: str) -> int:
    return _current(settings, session_id, "cpu_shares")


def _state(settings: Settings, session_id: str) -> int:
    return _current(settings, session_id, "state")


def _wait(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _focus_xterm(session: Session) -> None:
    shot = _act(session, action="screenshot")
    assert isinstance(shot, ImageResult)
    import io

    x0, y0, x1, y1 = window_box(Image.open(io.BytesIO(shot.data)))
    _act(session, action="click", x=(x0 + x1) // 2, y=(y0 + y1) // 2)


def test_two_warm_sessions_are_distinct_and_on_time(settings: Settings) -> None:
    settings = settings.replace(warm_pool=f"{settings.default_image}:2", capture_fps=0)
    manager = build_manager(settings)
    assert manager.pool is not None
    manager.start_pool()
    sessions: list[Session] = []
    try:
        assert manager.pool.wait_full(POOL_FILL_TIMEOUT_S), manager.pool.status()
        # The next pooled desktop to be claimed runs; the other waits paused (no CPU).
        states = sorted(_state(settings, i) for i in manager.pool.ids())
        assert states == [libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_PAUSED], states
        time.sleep(3)  # the saved state is now seconds old: a clock left alone is behind
        for _ in range(2):
            session = manager.create(image=settings.default_image, display=DisplaySpec())
            sessions.append(session)
            assert session.start_kind == "warm", session.start_phases_s
            assert session.clock_offset_s is not None and abs(session.clock_offset_s) < 1.0
            assert _cpu_shares(settings, session.id) == LIVE_CPU_WEIGHT
            assert _state(settings, session.id) == libvirt.VIR_DOMAIN_RUNNING
        randoms, offsets = [], []
        for n, session in enumerate(sessions):
            _focus_xterm(session)
            _act(
                session,
                action="type",
                text=f"echo rnd{n}=$(head -c32 /dev/urandom | od -An -tx1 | tr -d ' \\n')"
                f" > /dev/ttyS1; echo clk{n}=$(date +%s.%N) > /dev/ttyS1",
            )
            t0 = time.time()
            _act(session, action="key", keys="enter")
            t1 = time.time()
            randoms.append(_wait_for(session, rf"rnd{n}=([0-9a-f]{{64}})", 60).group(1))
            guest_t = float(_wait_for(session, rf"clk{n}=([0-9.]+)", 60).group(1))
            offsets.append(guest_t - t0)
            # The command ran after Return was sent; under TCG it may take a moment more.
            assert t0 - 1.0 <= guest_t <= t1 + 3.0, (guest_t, t0, t1)
        assert randoms[0] != randoms[1], "two clones read the same /dev/urandom bytes"
        print(f"warm starts: {[s.start_phases_s for s in sessions]}, clock offsets {offsets}")

        # Reset: what the first session wrote is gone, the desktop is back, clock set again.
        first = sessions[0]
        # Its spare: the next generation restored ahead, paused, at the pool's weight.
        pool = manager.pool
        _wait(lambda: getattr(pool._spares.get(first.id), "phase", "") == "ready", 120, "spare")
        assert _domains(settings, first.id) == [
            domain_name(first.id),
            f"{domain_name(first.id)}-r1",
        ]
        assert _current(settings, first.id, "state", 1) == libvirt.VIR_DOMAIN_PAUSED
        assert _current(settings, first.id, "cpu_shares", 1) == POOL_CPU_WEIGHT
        _act(first, action="type", text="touch /tmp/deskvm-mark; echo marked > /dev/ttyS1\n")
        _wait_for(first, r"marked", 60)
        reset_s = manager.reset(first.id).last_reset_s
        assert first.resets == 1 and reset_s is not None
        assert _reset_done(first)["spare"] is True
        # The spare ran with the pool's low CPU weight: the reset one runs as live.
        assert _cpu_shares(settings, first.id) == LIVE_CPU_WEIGHT
        assert _state(settings, first.id) == libvirt.VIR_DOMAIN_RUNNING
        # The reset's domain has the next generation's name; libvirt lets go of the old.
        assert generation_of(_running_name(settings, first.id)) == 1
        _wait(lambda: domain_name(first.id) not in _domains(settings, first.id), 15, "old gone")
        assert not (settings.sessions_dir / first.id / "overlay.qcow2").exists()
        print(f"reset phases: {first.reset_phases_s}")
        assert first.clock_offset_s is not None and abs(first.clock_offset_s) < 1.0
        _focus_xterm(first)
        _act(
            first,
            action="type",
            text="test -e /tmp/deskvm-mark && echo mark=kept > /dev/ttyS1"
            " || echo mark=gone > /dev/ttyS1\n",
        )
        assert _wait_for(first, r"mark=(kept|gone)", 60).group(1) == "gone"
        print(f"reset took {reset_s:.2f} s")
        # A second reset without a spare (discarded): restored as generation 2; the guest
        # helper and the clock answer again.
        _wait(lambda: getattr(pool._spares.get(first.id), "phase", "") == "ready", 120, "spare")
        assert manager.hypervisor.discard_reset_spare(first.id)
        second_s = manager.reset(first.id).last_reset_s
        assert _reset_done(first)["spare"] is False
        assert generation_of(_running_name(settings, first.id)) == 2
        assert first.clock_offset_s is not None and abs(first.clock_offset_s) < 1.0
        _act(first, action="type", text="echo second-reset-ok > /dev/ttyS1\n")
        _wait_for(first, r"second-reset-ok", 60)
        print(f"second reset took {second_s:.2f} s: {first.reset_phases_s}")
    finally:
        for session in sessions:
            manager.delete(session.id)
        manager.close_pool()
        leftovers = manager.hypervisor.list_sessions()
        manager.hypervisor.close()  # type: ignore[attr-defined]
    assert leftovers == set()
    assert not (settings.pool_dir / manager.owner).exists()
    assert [_domains(settings, s.id) for s in sessions] == [[], []]
