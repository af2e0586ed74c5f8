"""``deskvm replay`` on what is not there: a time before the first frame, a directory
that is no recording (issue 10 section 7)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from agent_bridge.cli import app
from orchestrator.clock import SystemClock
from orchestrator.replay import Recording
from tests.recording.conftest import record


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_frames_before_the_first_frame_say_when_it_is(tmp_path: Path) -> None:
    bundle = record(tmp_path / "rec", clock=SystemClock(), capture_fps=5)
    recording = Recording(bundle)
    first_seq = recording.frame_seq_at(recording.duration_s)
    assert first_seq is not None
    first_s = min(
        (int(e["data"].get("pts_ns", e["t_ns"])) - recording.origin_ns) / 1e9
        for e in recording.events
        if e["kind"] == "frame"
    )
    before = f"{first_s - 0.25:.3f}"
    code, output = _run("replay", "frames", str(bundle), "--at", before, "--out", str(tmp_path))
    assert code == 1, output
    assert f"error (no_frame): no frame yet at {float(before):.3f} s: the first frame is at " \
           f"{first_s:.3f} s" in output, output  # fmt: skip
    assert "recorder_error" not in output
    # At the first frame's time it is there.
    code, output = _run("replay", "frames", str(bundle), "--at", f"{first_s + 0.0005:.4f}",
                        "--out", str(tmp_path))  # fmt: skip
    assert code == 0, output


def test_info_of_a_directory_that_is_no_recording(tmp_path: Path) -> None:
    (tmp_path / "some-file").write_text("x")
    for command in ("info", "verify", "export"):
        extra = ["--jsonl", "--out", str(tmp_path / "o")] if command == "export" else []
        args = ["replay", command, str(tmp_path), *extra]
        code, output = _run(*args)
        assert code == 1, output
        assert f"error (not_a_recording): {tmp_path} is not a recording directory" in output
        assert "manifest.json" in output and "Errno" not in output
    code, output = _run("replay", "info", str(tmp_path / "nosuch"))
    assert code == 1 and "no such recording directory" in output, output
    code, output = _run("replay", "info", str(tmp_path / "some-file"))
    assert code == 1 and "is not a recording directory (it is a file)" in output, output
