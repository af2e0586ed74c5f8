"""A writer killed with SIGKILL: seal the bundle as truncated, or continue it after a gap.

Issue 10, section 3: after kill -9 a bundle stays ``recording`` and ``verify`` exits 2;
``deskvm replay seal`` (and a server start) seals it as truncated with the last intact
event and the reason, ``verify`` then says "intact up to event N, truncated" (exit 3), and
the segment that was open either plays (fragmented MP4, up to its last complete fragment)
or is flagged. A re-adopted session continues its bundle with a marked gap instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from agent_bridge.cli import app
from orchestrator.clock import FakeClock, SystemClock
from orchestrator.errors import RecorderError
from orchestrator.recorder import FileRecorder, seal, writer_alive
from orchestrator.replay import Recording, verify
from orchestrator.video import decode_segment

ROOT = Path(__file__).resolve().parents[2]
FRAMES = 20

# Records a start event, FRAMES captures 0.25 s apart (5 s of video: about four complete
# 1 s fragments) and an input, then kills itself: the segment is never finished.
_CHILD = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from PIL import Image
from orchestrator.clock import SystemClock
from orchestrator.recorder import FileRecorder
rec = FileRecorder(Path({path!r}), SystemClock(), {{"session_id": "abcdefgh2345"}}, segment_s=3600)
rec.append("lifecycle", {{"event": "starting"}})
t0 = time.monotonic_ns()
for i in range({frames}):
    image = Image.new("RGB", (320, 200), (i * 12, 40, 200 - i * 5))
    rec.add_capture(image, pts_ns=t0 + i * 250_000_000, pixels=str(i))
rec.append("input", {{"action": {{"action": "move", "x": 1, "y": 2}}}})
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_bundle(tmp_path: Path, *, torn: bytes = b'{"seq":22,"t_ns":1') -> Path:
    bundle = tmp_path / "rec"
    code = _CHILD.format(root=str(ROOT), path=str(bundle), frames=FRAMES)
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ}, timeout=120)
    assert done.returncode == -9
    with (bundle / "events.jsonl").open("ab") as f:
        f.write(torn)  # a line the writer was in the middle of
    return bundle


def test_seal_after_kill_9(tmp_path: Path) -> None:
    bundle = killed_bundle(tmp_path)
    runner = CliRunner()
    before = runner.invoke(app, ["replay", "verify", str(bundle)])
    assert before.exit_code == 2, before.output
    assert not writer_alive(bundle)

    result = runner.invoke(app, ["replay", "seal", str(bundle), "--reason", "server killed"])
    assert result.exit_code == 0, result.output
    assert "intact up to event 21" in result.output

    report = verify(bundle)
    assert report.ok and report.closed, report
    assert report.truncated is not None
    assert report.truncated["last_intact_seq"] == 21
    assert report.truncated["reason"] == "server killed"
    (video,) = report.truncated_video
    assert video["file"] == "video/000000.mp4" and video["frames_recorded"] == FRAMES
    # Fragmented MP4: the open segment plays up to its last complete fragment.
    assert video["playable"] and 0 < video["frames"] < FRAMES
    assert len(decode_segment(bundle / "video/000000.mp4")) == video["frames"]

    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["status"] == "truncated"
    assert manifest["truncated_reason"] == "server killed"
    events = [json.loads(x) for x in (bundle / "events.jsonl").read_text().splitlines()]
    assert events[-1]["data"]["event"] == "truncated"
    assert events[-1]["data"]["torn_tail_bytes"] == len(b'{"seq":22,"t_ns":1')
    assert events[-2]["kind"] == "media" and events[-2]["data"]["truncated"] is True

    result = runner.invoke(app, ["replay", "verify", str(bundle)])
    assert result.exit_code == 3, result.output
    assert "intact up to event 21, truncated" in result.output
    assert "server killed" in result.output

    # Readers serve the frames that play and skip the lost ones.
    recording = Recording(bundle)
    _, image = recording.frame_at(recording.duration_s)
    assert image.size == (320, 200)

    # Sealed is closed: not sealed twice, and tampering still shows.
    with pytest.raises(RecorderError, match="already closed"):
        seal(bundle, SystemClock(), reason="again")
    lines = (bundle / "events.jsonl").read_bytes().splitlines(keepends=True)
    (bundle / "events.jsonl").write_bytes(b"".join(lines[:-1]))
    assert runner.invoke(app, ["replay", "verify", str(bundle)]).exit_code == 1


def test_continue_after_kill_9_marks_the_gap(tmp_path: Path) -> None:
    bundle = killed_bundle(tmp_path)
    clock = SystemClock()
    recorder = FileRecorder.reopen(bundle, clock, reason="bridge restarted", segment_s=3600)
    assert recorder.resumed_after_seq == 21
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert recorder.origin_ns == manifest["monotonic_origin_ns"]  # times stay comparable
    for i in range(3):  # the capture resumes into a new segment
        image = Image.new("RGB", (320, 200), (0, 100 + 40 * i, 0))
        recorder.add_capture(image, pts_ns=clock.monotonic_ns() + i, pixels=f"n{i}")
    recorder.append("input", {"action": {"action": "move", "x": 5, "y": 6}})
    recorder.close()

    report = verify(bundle)
    assert report.ok and report.closed and report.truncated is None, report
    (gap,) = report.gaps
    assert gap["after_seq"] == 21 and gap["reason"] == "bridge restarted"
    assert gap["gap_s"] is not None and gap["gap_s"] >= 0
    assert [v["file"] for v in report.truncated_video] == ["video/000000.mp4"]
    assert json.loads((bundle / "manifest.json").read_text())["resumed"][0]["after_seq"] == 21
    assert sorted(p.name for p in (bundle / "video").iterdir()) == ["000000.mp4", "000001.mp4"]
    assert len(decode_segment(bundle / "video/000001.mp4")) == 3
    result = CliRunner().invoke(app, ["replay", "verify", str(bundle)])
    assert result.exit_code == 0 and "gap" in result.output, result.output


def test_a_live_writer_is_never_sealed(tmp_path: Path) -> None:
    recorder = FileRecorder(tmp_path / "rec", FakeClock(), {"session_id": "x"})
    recorder.append("marker", {"event": "x"})
    assert writer_alive(tmp_path / "rec")
    with pytest.raises(RecorderError, match="still being written"):
        seal(tmp_path / "rec", FakeClock(), reason="no")
    with pytest.raises(RecorderError, match="still being written"):
        FileRecorder.reopen(tmp_path / "rec", FakeClock(), reason="no")
    recorder.close()
    assert not writer_alive(tmp_path / "rec")


def test_a_changed_bundle_is_neither_sealed_nor_continued(tmp_path: Path) -> None:
    bundle = killed_bundle(tmp_path, torn=b"")
    lines = (bundle / "events.jsonl").read_bytes().splitlines(keepends=True)
    lines[3] = lines[3].replace(b'"index":2', b'"index":9')
    (bundle / "events.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(RecorderError, match=r"event 3 .* does not verify"):
        seal(bundle, SystemClock(), reason="x")
    assert json.loads((bundle / "manifest.json").read_text())["status"] == "recording"


def test_a_resolution_change_starts_a_new_segment(tmp_path: Path) -> None:
    """Boot console, then the desktop: each segment keeps one frame size."""
    clock = FakeClock()
    recorder = FileRecorder(tmp_path / "rec", clock, {"session_id": "x"}, segment_s=3600)
    sizes = [(720, 400)] * 3 + [(640, 480)] * 2 + [(1280, 800)] * 3
    for i, size in enumerate(sizes):
        clock.advance(0.3)
        image = Image.new("RGB", size, (i * 20, 0, 0))
        recorder.add_capture(image, pts_ns=clock.monotonic_ns(), pixels=str(i))
    recorder.close()
    segments = sorted((tmp_path / "rec" / "video").iterdir())
    decoded = [decode_segment(p) for p in segments]
    assert [(len(d), d[0].size) for d in decoded] == [
        (3, (720, 400)), (2, (640, 480)), (3, (1280, 800))
    ]  # fmt: skip
    assert all(f.size == d[0].size for d in decoded for f in d)
    recording = Recording(tmp_path / "rec")
    assert recording.frame_at(0.35)[1].size == (720, 400)
    assert recording.frame_at(10)[1].size == (1280, 800)
    assert verify(tmp_path / "rec").ok


def test_the_boot_is_recorded(tmp_path: Path) -> None:
    """Capture starts when the domain starts: the boot console (720x400) is in the video,
    in its own segment, before the ready event; the desktop follows in a new segment."""
    from orchestrator.hypervisor.fake import FakeHypervisor
    from tests.recording.conftest import record

    bundle = record(
        tmp_path / "rec",
        clock=SystemClock(),
        actions=[{"action": "move", "x": 10, "y": 10}],
        capture_fps=20,
        hypervisor=FakeHypervisor(boot_screens=8),
        ready_poll_s=0.2,
    )
    events = [json.loads(x) for x in (bundle / "events.jsonl").read_text().splitlines()]
    ready = next(e["seq"] for e in events if e["data"].get("event") == "ready")
    boot = [e for e in events[:ready] if e["kind"] == "frame" and "video" in e["data"]]
    assert boot, "no frame captured while booting"
    recording = Recording(bundle)
    assert recording.frame_image(boot[0]["seq"]).size == (720, 400)
    segments = sorted((bundle / "video").iterdir())
    sizes = [decode_segment(p)[0].size for p in segments]
    assert sizes[0] == (720, 400) and sizes[-1] == (640, 400)
    assert verify(bundle).ok
    out = tmp_path / "boot.mp4"
    from orchestrator.replay import export_mp4

    assert export_mp4(bundle, out, fps=10) > 0
    assert {f.size for f in decode_segment(out)} == {(640, 400)}


def test_a_segment_named_before_its_file_existed_is_not_reused(tmp_path: Path) -> None:
    """A writer killed after chaining a segment's first frame but before the segment's file
    was on disk (a CI run's kill -9 of the server): the continued bundle starts its next
    segment after the named one instead of writing a file the chain says is absent."""
    bundle = killed_bundle(tmp_path)
    (bundle / "video/000000.mp4").unlink()  # named by the frame events, never written
    clock = SystemClock()
    recorder = FileRecorder.reopen(bundle, clock, reason="bridge restarted", segment_s=3600)
    for i in range(3):
        image = Image.new("RGB", (320, 200), (0, 100 + 40 * i, 0))
        recorder.add_capture(image, pts_ns=clock.monotonic_ns() + i, pixels=f"n{i}")
    recorder.close()

    report = verify(bundle)
    assert report.ok and report.closed and report.truncated is None, report
    (lost,) = report.truncated_video
    assert lost["file"] == "video/000000.mp4" and not lost["playable"]
    assert sorted(p.name for p in (bundle / "video").iterdir()) == ["000001.mp4"]
    assert len(decode_segment(bundle / "video/000001.mp4")) == 3
