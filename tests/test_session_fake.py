"""Session lifecycle and recording against the in-package fakes (no VM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_bridge.protocol import parse_deskvm_action
from agent_bridge.protocol.results import CursorResult, ImageResult
from orchestrator.capture import FrameCapture
from orchestrator.clock import FakeClock
from orchestrator.display.base import KeyEvent
from orchestrator.errors import (
    AccelFailed,
    ActionError,
    BootTimeout,
    ConfigError,
    DisplayError,
    HypervisorError,
    SessionClosed,
)
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.recorder import FileRecorder, MemoryRecorder
from orchestrator.replay import summarize
from orchestrator.session import Session, desktop_drawn
from orchestrator.spec import BootImage, DisplaySpec, SessionSpec
from tests.accel_verdict import Verdict

IMAGE = BootImage("debian12-desktop", "cd" * 32, Path("/b"), Path("/k"), Path("/i"))


def make(
    hv: FakeHypervisor | None = None, recorder=None, clock=None, sid="abcdef012345", timeout_s=5.0
):
    clock = clock or FakeClock()
    spec = SessionSpec(sid, IMAGE, DisplaySpec(1024, 768), boot_timeout_s=timeout_s)
    return Session(
        spec,
        hypervisor=hv or FakeHypervisor(),
        recorder=recorder if recorder is not None else MemoryRecorder(clock),
        clock=clock,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.5,
    )


def act(session: Session, **body: object):
    return session.execute(parse_deskvm_action(body))


def test_context_manager_starts_and_destroys() -> None:
    hv = FakeHypervisor()
    with make(hv) as session:
        assert session.state == "ready"
        assert hv.domains.keys() == {"abcdef012345"}
    assert session.state == "closed"
    assert hv.domains == {} and hv.destroyed == ["abcdef012345"]


def test_typed_line_reaches_the_fake_guest_log() -> None:
    with make() as session:
        act(session, action="type", text="echo Hi_There > /dev/ttyS1\n")
        assert b"echo Hi_There > /dev/ttyS1\n" in session.guest_log()
        assert session.held() == (set(), set())


def test_with_key_flow_control_typed_text_goes_one_character_per_batch() -> None:
    hv = FakeHypervisor()
    with make(hv) as session:
        display = hv.domains[session.id].display
        display.has_key_flow_control = True
        before = display.batches
        act(session, action="type", text="Hi there\n")
        assert display.batches - before == len("Hi there\n")
        act(session, action="key", keys="ctrl+c")
        assert display.batches - before == len("Hi there\n") + 4
        assert b"Hi there\n" in session.guest_log()
        assert session.held() == (set(), set())


def test_screenshot_result_and_frame_event() -> None:
    recorder = MemoryRecorder(FakeClock())
    with make(recorder=recorder) as session:
        result = act(session, action="screenshot")
        assert isinstance(result, ImageResult)
        assert (result.width_px, result.height_px) == (1024, 768)
        assert result.data.startswith(b"\x89PNG")
        assert recorder.frames[result.frame_seq] == result.data  # type: ignore[index]
        zoom = act(session, action="zoom", region=[10, 20, 110, 70])
        assert (zoom.width_px, zoom.height_px) == (100, 50)  # type: ignore[union-attr]


def test_cursor_position_follows_moves_including_zero() -> None:
    with make() as session:
        act(session, action="move", x=0, y=0)
        assert act(session, action="cursor_position") == CursorResult(0, 0)
        act(session, action="click", x=1023, y=767)
        assert act(session, action="cursor_position") == CursorResult(1023, 767)


def test_out_of_screen_is_refused_before_anything_is_injected() -> None:
    hv = FakeHypervisor()
    with make(hv) as session:
        with pytest.raises(ActionError) as info:
            act(session, action="click", x=1024, y=5)
        assert info.value.code == "out_of_screen"
        assert hv.domains["abcdef012345"].display.events == []
        act(session, action="move", x=1, y=1)  # the session lives on


def test_input_is_recorded_before_it_is_injected() -> None:
    clock = FakeClock()
    recorder = MemoryRecorder(clock)
    with make(recorder=recorder, clock=clock) as session:
        act(session, action="key", keys="ctrl+c")
    kinds = [e.kind for e in recorder.events]
    i = kinds.index("input")
    assert kinds[i : i + 3] == ["input", "injected", "result"]
    assert recorder.events[i].data["action"] == {"action": "key", "combos": ["ctrl+c"]}


def test_display_failure_releases_held_keys() -> None:
    hv = FakeHypervisor()
    with make(hv) as session:
        display = hv.domains["abcdef012345"].display
        original = display.send
        calls = {"n": 0}

        def flaky(events, **kw):  # fail on the third batch: ctrl and shift are down
            calls["n"] += 1
            if calls["n"] == 3:
                raise DisplayError("injected")
            original(events, **kw)

        display.send = flaky  # type: ignore[method-assign]
        with pytest.raises(DisplayError):
            act(session, action="key", keys="ctrl+shift+t")
        display.send = original  # type: ignore[method-assign]
        assert display.pressed_keys == set()
        assert KeyEvent("ctrl", False) in display.events


def test_start_failure_leaves_nothing() -> None:
    hv = FakeHypervisor()
    hv.fail_on.add("start")
    recorder = MemoryRecorder(FakeClock())
    session = make(hv, recorder=recorder)
    with pytest.raises(HypervisorError):
        session.start()
    assert hv.domains == {}
    assert session.state == "failed"
    assert recorder.closed_status is not None


def test_boot_timeout_carries_console_tail_and_tears_down() -> None:
    hv = FakeHypervisor()
    clock = FakeClock()
    session = make(hv, clock=clock, timeout_s=3.0)
    original = hv.start

    def start_without_desktop(spec, nic=None):
        domain = original(spec, nic=nic)
        domain.read_guest_log = lambda offset=0: b""  # type: ignore[method-assign]
        return domain

    hv.start = start_without_desktop  # type: ignore[method-assign]
    with pytest.raises(BootTimeout) as info:
        session.start()
    assert "fake login" in info.value.console_tail
    assert hv.domains == {} and hv.destroyed == ["abcdef012345"]


def test_actions_after_close_are_refused() -> None:
    session = make()
    with session:
        pass
    with pytest.raises(SessionClosed):
        act(session, action="screenshot")


def test_file_recording_is_chained_and_summarized(tmp_path: Path) -> None:
    clock = FakeClock()
    recorder = FileRecorder(tmp_path / "rec", clock, {"session_id": "abcdef012345"})
    with make(recorder=recorder, clock=clock) as session:
        act(session, action="click", x=5, y=5)
        act(session, action="type", text="pw", secret=True)
        act(session, action="screenshot")
        with pytest.raises(ActionError):
            act(session, action="click", x=5000, y=5)
    bundle = tmp_path / "rec"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["status"] == "closed"
    assert manifest["event_count"] == len((bundle / "events.jsonl").read_text().splitlines())
    summary = summarize(bundle)
    assert summary.first_bad_seq is None
    assert summary.actions == {"click": 2, "type": 1, "screenshot": 1}
    assert summary.errors == {"out_of_screen": 1}
    assert summary.frames == 2  # the ready frame and the screenshot
    assert (bundle / "guest.log").read_bytes().startswith(b"DESKVM_READY")
    assert b'"pw"' not in (bundle / "events.jsonl").read_bytes()
    # Any edit breaks the chain at that event.
    lines = (bundle / "events.jsonl").read_text().splitlines()
    lines[3] = lines[3].replace('"x":5', '"x":6')
    (bundle / "events.jsonl").write_text("\n".join(lines) + "\n")
    assert summarize(bundle).first_bad_seq == 3


def test_desktop_drawn_frame_check() -> None:
    from PIL import Image

    bg = (0x2E, 0x4A, 0x62)
    blank = Image.new("RGB", (640, 480), bg)
    assert desktop_drawn(blank, width_px=640, height_px=480, background_rgb=bg)[0] is False
    black = Image.new("RGB", (640, 480), (0, 0, 0))
    assert desktop_drawn(black, width_px=640, height_px=480, background_rgb=bg)[0] is False
    desktop = blank.copy()
    desktop.paste((255, 255, 255), (10, 10, 300, 200))
    assert desktop_drawn(desktop, width_px=640, height_px=480, background_rgb=bg)[0] is True
    assert desktop_drawn(desktop, width_px=800, height_px=600, background_rgb=bg)[0] is False


def test_desktop_drawn_waits_for_each_ready_region() -> None:
    from PIL import Image, ImageDraw

    from orchestrator.spec import ReadyCheck, ReadyRegion

    bg = (0x2E, 0x4A, 0x62)
    check = ReadyCheck(regions=(ReadyRegion("panel", top_px=0, height_px=24, min_colours=4),))
    desktop = Image.new("RGB", (640, 480), bg)
    desktop.paste((255, 255, 255), (40, 60, 400, 300))  # a window, but no panel yet
    ready, reason = desktop_drawn(
        desktop, width_px=640, height_px=480, background_rgb=bg, ready=check
    )
    assert not ready and reason.startswith("panel not drawn")
    desktop.paste((0xDD, 0xDD, 0xDD), (0, 0, 640, 24))  # a flat strip: not drawn yet
    ready, reason = desktop_drawn(
        desktop, width_px=640, height_px=480, background_rgb=bg, ready=check
    )
    assert not ready and "colours" in reason
    draw = ImageDraw.Draw(desktop)
    draw.text((4, 4), "Applications", fill=(0, 0, 0))
    draw.rectangle((590, 4, 630, 20), fill=(0x33, 0x66, 0xCC))
    ready, reason = desktop_drawn(
        desktop, width_px=640, height_px=480, background_rgb=bg, ready=check
    )
    assert ready and "panel drawn" in reason
    bottom = ReadyCheck(regions=(ReadyRegion("dock", top_px=-24, height_px=24),))
    assert not desktop_drawn(desktop, width_px=640, height_px=480, background_rgb=bg, ready=bottom)[
        0
    ]
    strict = ReadyCheck(min_background_share=0.9)
    assert (
        "background covers"
        in desktop_drawn(desktop, width_px=640, height_px=480, background_rgb=bg, ready=strict)[1]
    )


def test_close_cuts_a_running_wait_short() -> None:
    import threading
    import time

    from orchestrator.clock import SystemClock

    hv = FakeHypervisor()
    spec = SessionSpec("abcdef012345", IMAGE, DisplaySpec(1024, 768), boot_timeout_s=5.0)
    session = Session(
        spec,
        hypervisor=hv,
        recorder=MemoryRecorder(SystemClock()),
        clock=SystemClock(),
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
    )
    session.start()
    outcome: list[BaseException | None] = []

    def agent() -> None:
        try:
            act(session, action="wait", ms=60_000)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=agent)
    thread.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    session.close(reason="deleted")
    thread.join(timeout=10)
    assert time.monotonic() - t0 < 5, "close waited for the running action"
    assert session.state == "closed" and hv.domains == {}
    assert len(outcome) == 1 and isinstance(outcome[0], SessionClosed)


def test_closed_while_booting_ends_once_with_the_closers_reason() -> None:
    """A client that leaves while its session boots: one ending, ``client disconnected``
    (it was ``start failed`` with two ``closed`` events)."""
    import threading

    from orchestrator.clock import SystemClock

    clock = SystemClock()
    recorder = MemoryRecorder(clock)
    hv = FakeHypervisor(boot_screens=10**9)  # never ready on its own
    spec = SessionSpec("abcdef012345", IMAGE, DisplaySpec(640, 400), boot_timeout_s=60)
    session = Session(spec, hypervisor=hv, recorder=recorder, clock=clock,
                      pacing=Pacing(0, 0, 0, 0, 0), ready_poll_s=0.01)  # fmt: skip
    failure: list[BaseException] = []

    def boot() -> None:
        try:
            session.start()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=boot)
    thread.start()
    while not hv.started:
        threading.Event().wait(0.01)
    session.close(reason="client disconnected")
    thread.join(10)
    assert isinstance(failure[0], SessionClosed) and "client disconnected" in str(failure[0])
    closed = [e.data for e in recorder.events if e.kind == "lifecycle"
              and e.data.get("event") in ("closed", "start_failed")]  # fmt: skip
    assert closed == [{"event": "closed", "reason": "client disconnected", "errors": []}]
    assert session.state == "closed" and session.closed_reason == "client disconnected"


def test_a_session_larger_than_the_memory_total_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    from orchestrator.manager import SessionManager

    hv = FakeHypervisor()
    manager = SessionManager(
        hypervisor=hv,
        resolve_image=lambda _name: IMAGE,
        recordings_dir=tmp_path,
        max_total_memory_mib=4096,
        memory_overhead_mib=768,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
    )
    with pytest.raises(ConfigError, match=r"memory_mib 8192 needs 8960 MiB.*at most 4096 MiB"):
        manager.create(image="x", display=DisplaySpec(1280, 800), memory_mib=8192)
    assert hv.started == [] and manager.live() == []


def test_the_default_memory_total_follows_the_host(tmp_path: Path) -> None:
    from orchestrator.host import default_total_memory_mib, host_memory_mib

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\n")
    assert host_memory_mib(meminfo) == 24000
    assert default_total_memory_mib(24000) == 24000 - 2400
    assert default_total_memory_mib(8192) == 8192 - 2048
    assert default_total_memory_mib(1024) == 1024
    assert host_memory_mib(tmp_path / "absent") is None


def test_kvm_stopping_the_cold_boot_falls_back_to_tcg_and_boots_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host whose /dev/kvm runs the doctor's boot sector but stops a Linux guest with
    ``KVM internal error`` (a PVM host): the session boots again under TCG at once, the
    hypervisor stays on TCG and the verdict is told once. The stopped domain's capture
    and display are closed before the new domain starts."""
    verdict = Verdict()
    hv = FakeHypervisor(accel="kvm", accel_verdict=verdict)
    hv.fail_on.add("accel")
    booted = []
    original = hv.start

    def start(spec, nic=None):
        booted.append(original(spec, nic=nic))
        return booted[-1]

    hv.start = start  # type: ignore[method-assign]
    captures: list[FrameCapture] = []

    class Capture(FrameCapture):
        def start(self) -> None:
            captures.append(self)
            super().start()

    monkeypatch.setattr("orchestrator.session.FrameCapture", Capture)
    clock = FakeClock()
    recorder = MemoryRecorder(clock)
    session = make(hv, recorder=recorder, clock=clock, timeout_s=600.0)
    session.start()
    assert session.state == "ready" and clock.monotonic_ns() < 10e9
    assert hv.accel == "tcg"
    assert len(verdict.failed) == 1 and "KVM internal error" in verdict.failed[0]
    assert verdict.ran == 0  # a TCG boot proves nothing of KVM
    assert len(booted) == 2 and hv.destroyed == ["abcdef012345"]  # the stopped one
    assert booted[0].display.closed and not booted[1].display.closed
    assert len(captures) == 2 and captures[0]._stopped and not captures[1]._stopped
    assert session._frames is captures[1]
    fallback = [e.data for e in recorder.events if e.data.get("event") == "accel_fallback"]
    assert len(fallback) == 1 and fallback[0]["accel"] == "tcg"
    assert "accel_failed_s" in session.start_phases_s
    session.close()
    assert hv.domains == {}


@pytest.mark.parametrize(
    ("accel", "verdict", "stored"),
    [
        ("kvm", None, 0),
        ("kvm", Verdict(pinned=True), 1),
        ("kvm", Verdict(kvm_proven=True), 0),
        ("tcg", Verdict(), 0),
    ],
    ids=["forced-kvm", "pinned", "kvm-ran-linux-before", "already-tcg"],
)
def test_a_stop_that_cannot_fall_back_fails_the_start_at_once(
    accel: str, verdict: Verdict | None, stored: int
) -> None:
    """No verdict (KVM forced) or a pinned one (a cluster node labelled kvm) reports the
    failure, the pinned one storing TCG for the next start; a host where KVM already ran
    a Linux guest does not move to TCG for one stop (a one-off, or an image that provokes
    it); a guest TCG could not run is not booted again. Each at once, not at the boot
    deadline, and nothing is left behind."""
    hv = FakeHypervisor(accel=accel, accel_verdict=verdict)  # type: ignore[arg-type]
    hv.fail_on.add("accel")
    clock = FakeClock()
    session = make(hv, clock=clock, timeout_s=600.0)
    with pytest.raises(AccelFailed, match="internal-error") as info:
        session.start()
    assert info.value.code == "accel_failed"
    if accel == "kvm":
        assert "doctor --reprobe" in info.value.message
    assert clock.monotonic_ns() < 5e9
    assert hv.accel == accel
    assert (len(verdict.failed) if verdict is not None else 0) == stored
    assert hv.started == ["abcdef012345"] and hv.domains == {}
    assert session.state == "failed"


def test_the_first_cold_ready_under_kvm_is_stored_as_proof_once() -> None:
    verdict = Verdict()
    hv = FakeHypervisor(accel="kvm", accel_verdict=verdict)
    for sid in ("abcdef012345", "bcdef0123456"):
        session = make(hv, sid=sid)
        session.start()
        session.close()
    assert verdict.ran == 1 and verdict.kvm_proven and hv.kvm_ran == 2
    assert hv.accel == "kvm"
