"""Re-execute a recording: same image, same inputs, same timing; compare the frames.

:func:`rerun` boots a fresh session through a :class:`~orchestrator.manager.SessionManager`
(so the new run is itself recorded as a new bundle), replays every recorded ``input`` at
its recorded offset from the ``ready`` event, and scores, per step, how far the screen at
the step's input moment differs from the original's (SSIM, scikit-image's
``structural_similarity`` on grey levels: 1.0 is identical). The last row compares the
final frames (the ``closing`` still or the last frame).

Secret text cannot be replayed (only its digest was recorded): such steps are reported
and skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from skimage.metrics import structural_similarity

from agent_bridge.protocol.messages import parse_deskvm_action
from orchestrator.errors import ConfigError, DeskvmError, RecorderError
from orchestrator.manager import SessionManager
from orchestrator.replay import Recording, replayable_action
from orchestrator.spec import DisplaySpec

__all__ = ["RerunReport", "StepDiff", "frame_similarity", "replayable_action", "rerun"]


def frame_similarity(a: Image.Image, b: Image.Image) -> float:
    """SSIM of two frames on grey levels (1.0: identical; different sizes: 0.0)."""
    if a.size != b.size:
        return 0.0
    ga = np.asarray(a.convert("L"), dtype=np.uint8)
    gb = np.asarray(b.convert("L"), dtype=np.uint8)
    return float(structural_similarity(ga, gb, data_range=255))  # type: ignore[no-untyped-call]


@dataclass(frozen=True, slots=True)
class StepDiff:
    """One row of the rerun report.

    Attributes:
        index: step number (``-1`` for the final frame).
        action: the recorded action name.
        t_s: offset of the input from the ``ready`` event in the original, seconds.
        ssim: similarity of the screen at this step's input moment (original vs rerun),
            ``None`` when a side has no frame.
        note: why a step was skipped or failed (empty when it ran).
    """

    index: int
    action: str
    t_s: float
    ssim: float | None
    note: str = ""


@dataclass(slots=True)
class RerunReport:
    """Outcome of :func:`rerun`: ``steps`` plus the new recording's directory."""

    original: Path
    rerun: Path | None
    steps: list[StepDiff]

    @property
    def min_ssim(self) -> float | None:
        scores = [s.ssim for s in self.steps if s.ssim is not None]
        return min(scores) if scores else None


def _ready_t_ns(recording: Recording) -> int:
    for event in recording.events:
        if event.get("kind") == "lifecycle" and event["data"].get("event") == "ready":
            return int(event["t_ns"])
    raise RecorderError(f"{recording.path} never reached 'ready': nothing to rerun")


def _frame(recording: Recording, seq: int | None) -> Image.Image | None:
    if seq is None:
        return None
    try:
        return recording.frame_image(seq)
    except RecorderError:
        return None


def _final(recording: Recording) -> Image.Image | None:
    seq = recording.frame_seq_at(recording.duration_s)
    return _frame(recording, seq)


def rerun(
    bundle: Path,
    manager: SessionManager,
    *,
    boot_timeout_s: float = 180.0,
    settle_s: float = 1.0,
    on_step: Callable[[StepDiff], None] | None = None,
) -> RerunReport:
    """Boot a fresh session from the recording's image and replay its inputs.

    Args:
        bundle: the original recording.
        manager: starts the new session (its recording is the rerun's bundle).
        boot_timeout_s: boot deadline of the new session.
        settle_s: extra wait after the last input before the final frame, seconds.
        on_step: called with each step's row as soon as it is known.

    Returns:
        The per-step report.

    Raises:
        ConfigError: the image is missing or its content hash differs from the recorded
            one (a rerun on another image would compare nothing).
        RecorderError: the original cannot be read or never became ready.
        HypervisorError, BootTimeout: the new session did not start.
    """
    original = Recording(bundle)
    manifest = original.manifest
    image = manifest.get("image") or {}
    recorded_hash = image.get("content_hash")
    current = manager.resolve_image(str(image.get("name")))
    if current.content_hash != recorded_hash:
        raise ConfigError(
            f"image {current.name} is now {current.content_hash[:12]}, the recording was "
            f"made on {str(recorded_hash)[:12]}: refusing to rerun on a different image"
        )
    display = manifest.get("display") or {}
    ready_ns = _ready_t_ns(original)
    steps = list(original.steps())
    rows: list[StepDiff] = []

    def emit(row: StepDiff) -> None:
        rows.append(row)
        if on_step is not None:
            on_step(row)

    session = manager.create(
        image=current.name,
        display=DisplaySpec(int(display["width"]), int(display["height"])),
        boot_timeout_s=boot_timeout_s,
    )
    new_path = session.recorder.path
    try:
        start = time.monotonic()
        for step in steps:
            offset_s = (original.origin_ns + round(step.t_s * 1e9) - ready_ns) / 1e9
            delay = start + offset_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            name = str(step.action.get("action"))
            body = replayable_action(step.action)
            if body is None:
                emit(StepDiff(step.index, name, offset_s, None, "secret text: not replayable"))
                continue
            before_seq = _frame_count(session)
            note = ""
            try:
                session.execute(parse_deskvm_action(body), source="qa")
            except DeskvmError as exc:
                note = f"{exc.code}: {exc.message}"
            ours = _still_after(session, before_seq)
            ssim = None
            theirs = _frame(original, step.before_seq)
            if ours is not None and theirs is not None:
                ssim = frame_similarity(theirs, ours)
            emit(StepDiff(step.index, name, offset_s, ssim, note))
        time.sleep(settle_s)
    finally:
        manager.delete(session.id, reason="rerun finished")
    if new_path is not None:
        again = Recording(new_path)
        a, b = _final(original), _final(again)
        ssim = frame_similarity(a, b) if a is not None and b is not None else None
        emit(StepDiff(-1, "final", original.duration_s, ssim))
    return RerunReport(original=bundle, rerun=new_path, steps=rows)


def _frame_count(session: Any) -> int:
    path = session.recorder.path
    return len(Recording(path).events) if path is not None else 0


def _still_after(session: Any, from_seq: int) -> Image.Image | None:
    """The new run's still of the step that began at event ``from_seq``.

    The first ``input`` or ``screenshot`` still at or after ``from_seq``; for actions that
    record neither (``wait``), the frame shown when the step ended.
    """
    path = session.recorder.path
    if path is None:
        return None
    recording = Recording(path)
    for event in recording.events[from_seq:]:
        if event.get("kind") == "frame" and event["data"].get("reason") in ("input", "screenshot"):
            return _frame(recording, int(event["seq"]))
    if not recording.events:
        return None
    return _frame(recording, recording.frame_seq_at(recording.t_s(recording.events[-1])))
