"""Continuous capture, the video's frame map, a crash (kill -9) mid-recording, exports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from agent_bridge.cli import app
from orchestrator.capture import FrameCapture
from orchestrator.clock import FakeClock, SystemClock
from orchestrator.display.base import AbsMove
from orchestrator.display.fake import FakeDisplay
from orchestrator.recorder import FileRecorder, MemoryRecorder
from orchestrator.replay import (
    Recording,
    export_jsonl,
    export_mp4,
    export_osworld,
    verify,
)
from orchestrator.video import decode_segment
from tests.recording.conftest import record

ROOT = Path(__file__).resolve().parents[2]


def _mean_abs_diff(a: Image.Image, b: Image.Image) -> float:
    return float(
        np.abs(
            np.asarray(a.convert("RGB"), np.int16) - np.asarray(b.convert("RGB"), np.int16)
        ).mean()
    )


def test_unchanged_frames_are_skipped() -> None:
    display = FakeDisplay(320, 200)
    recorder = MemoryRecorder(SystemClock())
    capture = FrameCapture(display, recorder, SystemClock(), fps=50)
    assert capture.capture_once() is not None
    assert [capture.capture_once() for _ in range(4)] == [None] * 4
    display.send([AbsMove(100, 100)], width_px=320, height_px=200)
    assert capture.capture_once() is not None
    assert (capture.captured, capture.skipped) == (2, 4)


def test_capture_loop_records_changes_into_the_video(tmp_path: Path) -> None:
    def pause() -> None:
        time.sleep(0.15)

    actions = [{"action": "move", "x": 20 * i + 10, "y": 30} for i in range(12)]
    bundle = record(
        tmp_path / "rec", clock=SystemClock(), actions=actions, capture_fps=10,
        segment_s=0.5, between=pause,
    )  # fmt: skip
    report = verify(bundle)
    assert report.ok, report
    recording = Recording(bundle)
    captures = [e for e in recording.events if e["kind"] == "frame" and "video" in e["data"]]
    segments = sorted((bundle / "video").iterdir())
    assert len(segments) >= 2 and len(captures) >= 12
    # Every capture event maps to a decodable frame of its segment that matches the still
    # taken at the same moment (H.264 is lossy: compare loosely).
    for seg in segments:
        frames = decode_segment(seg)
        n = sum(1 for e in captures if e["data"]["video"] == f"video/{seg.name}")
        assert len(frames) == n
    stills = [e for e in recording.events if e["data"].get("reason") == "input"]
    for still in stills[:5]:
        pts = still["data"]["pts_ns"]
        twin = [e for e in captures if e["data"]["pts_ns"] <= pts][-1]
        diff = _mean_abs_diff(
            recording.frame_image(still["seq"]), recording.frame_image(twin["seq"])
        )
        assert diff < 3.0, diff
    # frame_at: the latest frame at or before the time.
    last = captures[-1]
    t_s = (last["data"]["pts_ns"] - recording.origin_ns) / 1e9
    seq, _ = recording.frame_at(t_s + 0.0001)
    assert recording.events[seq]["data"]["pts_ns"] <= last["data"]["pts_ns"] + 100_000


_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from orchestrator.clock import FakeClock, SystemClock
from tests.recording.conftest import record
actions = [
    {{"action": "move", "x": (37 * i) % 600 + 5, "y": (11 * i) % 380 + 5}} for i in range(100000)
]
record(Path({path!r}), clock=SystemClock(), actions=actions, capture_fps=10, segment_s=0.5,
       between=lambda: time.sleep(0.02))
"""


def test_kill_9_leaves_a_verifiable_prefix(tmp_path: Path) -> None:
    """A recording process (fake hypervisor, real FileRecorder and capture thread) is
    SIGKILLed mid-session. This shows what the bundle's writer guarantees (flushed lines,
    finished segments); a real server dies the same way, its VM is the reaper's job."""
    bundle = tmp_path / "rec"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(root=str(ROOT), path=str(bundle))],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            media = (
                (bundle / "events.jsonl").read_bytes().count(b'"kind":"media"')
                if (bundle / "events.jsonl").exists()
                else 0
            )
            if media >= 2:
                break
            time.sleep(0.1)
        assert media >= 2, "the child never finished two segments"
        time.sleep(0.3)  # mid-segment, likely mid-write
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(10)
    report = verify(bundle)
    assert not report.closed and not report.ok
    assert report.first_bad_seq is None, report  # nothing before the end is damaged
    assert report.events > 50
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["status"] == "recording"
    recording = Recording(bundle)
    finished = [e["data"]["file"] for e in recording.events if e["kind"] == "media"]
    for name in finished:
        assert decode_segment(bundle / name), name
    # The frame shown at the very end is still available (from a still or a finished
    # segment, never from the torn one).
    _, image = recording.frame_at(recording.duration_s + 1)
    assert image.size == (640, 400)
    # Every frame the reader indexes (what the viewer and the exports use) is readable;
    # the torn segment's frames are left out, not served broken.
    for event in recording.events:
        seq = recording.frame_seq_for_event(int(event["seq"]))
        if seq is not None and event["kind"] == "frame" and seq == event["seq"]:
            assert recording.frame_image(seq).size == (640, 400)
    result = CliRunner().invoke(app, ["replay", "verify", str(bundle)])
    assert result.exit_code == 2, result.output
    assert "not closed" in result.output


def test_exports(tmp_path: Path) -> None:
    bundle = record(tmp_path / "rec", clock=SystemClock(), capture_fps=5)
    steps = export_jsonl(bundle, tmp_path / "jsonl")
    rows = [json.loads(x) for x in (tmp_path / "jsonl" / "steps.jsonl").read_text().splitlines()]
    assert steps == len(rows) == 7
    click = rows[1]
    assert click["action"]["action"] == "click" and click["result"] == {"action": "click"}
    assert (tmp_path / "jsonl" / click["screenshot_before"]).is_file()
    assert (tmp_path / "jsonl" / click["screenshot_after"]).is_file()
    assert rows[2]["action"]["text"] is None  # the secret stays out of datasets too

    # OSWorld steps are the actions that act (the two screenshots only observe).
    assert export_osworld(bundle, tmp_path / "osw") == 5
    traj = [json.loads(x) for x in (tmp_path / "osw" / "traj.jsonl").read_text().splitlines()]
    assert [t["step_num"] for t in traj] == list(range(1, 6))
    assert all((tmp_path / "osw" / t["screenshot_file"]).is_file() for t in traj)
    assert (tmp_path / "osw" / "initial_state.png").is_file()

    frames = export_mp4(bundle, tmp_path / "out.mp4", fps=10)
    assert frames >= 1 and decode_segment(tmp_path / "out.mp4")


def test_cli_frames_and_export(tmp_path: Path) -> None:
    bundle = record(tmp_path / "rec", clock=SystemClock(), capture_fps=5)
    runner = CliRunner()
    result = runner.invoke(
        app, ["replay", "frames", str(bundle), "--at", "0.5s", "--out", str(tmp_path / "f")]
    )
    assert result.exit_code == 0, result.output
    assert Image.open(tmp_path / "f" / "frame-0.500s.png").size == (640, 400)
    result = runner.invoke(
        app, ["replay", "export", str(bundle), "--jsonl", "--out", str(tmp_path / "j")]
    )
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["replay", "verify", str(bundle)]).exit_code == 0
    lines = (bundle / "events.jsonl").read_bytes().splitlines(keepends=True)
    (bundle / "events.jsonl").write_bytes(b"".join(lines[:3] + lines[4:]))
    result = runner.invoke(app, ["replay", "verify", str(bundle)])
    assert result.exit_code == 1 and "bad at event 3" in result.output


def test_an_idle_screen_still_finishes_its_segment(tmp_path: Path) -> None:
    clock = FakeClock()
    recorder = FileRecorder(tmp_path / "rec", clock, {"session_id": "x"}, segment_s=1.0)
    display = FakeDisplay(320, 200)
    capture = FrameCapture(display, recorder, clock, fps=2)
    assert capture.capture_once() is not None
    clock.advance(0.5)
    assert capture.capture_once() is None
    assert not (tmp_path / "rec" / "events.jsonl").read_text().count('"media"')
    clock.advance(0.6)
    assert capture.capture_once() is None  # unchanged, but the segment is now 1.1 s old
    events = (tmp_path / "rec" / "events.jsonl").read_text()
    assert events.count('"kind":"media"') == 1
    recorder.close()
    assert verify(tmp_path / "rec").ok


def test_a_viewer_holds_only_the_newest_frame() -> None:
    display = FakeDisplay(320, 200)
    capture = FrameCapture(display, MemoryRecorder(SystemClock()), SystemClock(), fps=None)
    wakes: list[int] = []
    viewer = capture.subscribe(30, lambda: wakes.append(1))
    first, changed = capture.grab()
    assert changed and first.number == 1
    assert capture.grab() == (first, False)  # unchanged: nothing new, nothing offered
    for x in range(5):
        display.send([AbsMove(10 * x, 10)], width_px=320, height_px=200)
        capture.grab()
    assert len(wakes) == 6
    newest = viewer.take()
    assert newest is not None and newest.number == 6  # the older five were replaced
    assert viewer.take() is None
    assert newest._encoded == {}  # nothing is encoded until a viewer sends it
    assert newest.encoded("png").data == newest.encoded("png").data
    assert len(newest._encoded) == 1  # encoded once
    late = capture.subscribe(5, lambda: None)
    assert late.take() is newest  # a new viewer starts from the current screen
    viewer.close()
    late.close()
    assert capture.viewers == 0


def test_the_loop_grabs_at_the_fastest_viewers_rate_and_idles_without_one() -> None:
    display = FakeDisplay(320, 200)
    capture = FrameCapture(display, MemoryRecorder(SystemClock()), SystemClock(), fps=None)
    capture.start()
    try:
        time.sleep(0.3)
        assert capture.grabs == 0  # no video, nobody watching: no screendumps
        viewer = capture.subscribe(20, lambda: None)
        time.sleep(1.0)
        assert 12 <= capture.grabs <= 24, capture.grabs
        viewer.close()
        time.sleep(0.2)
        idle = capture.grabs
        time.sleep(0.5)
        assert capture.grabs == idle
    finally:
        capture.stop()
    assert capture.latest is None  # a stopped capture keeps no screen
