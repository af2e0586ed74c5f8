"""Helpers of the recording tests: sessions on the fake hypervisor recorded to disk."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agent_bridge.protocol import parse_deskvm_action
from orchestrator.clock import Clock, FakeClock
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.recorder import FileRecorder
from orchestrator.session import Session
from orchestrator.spec import BootImage, DisplaySpec, SessionSpec

IMAGE = BootImage("test-desktop", "ab" * 32, Path("/b"), Path("/k"), Path("/i"))
SESSION_ID = "abcdefgh2345"

ACTIONS: list[dict[str, Any]] = [
    {"action": "screenshot"},
    {"action": "click", "x": 200, "y": 150},
    {"action": "type", "text": "hunter2", "secret": True},
    {"action": "type", "text": "echo hunter2\n"},
    {"action": "key", "keys": "ctrl+l"},
    {"action": "move", "x": 600, "y": 300},
    {"action": "screenshot"},
]


def record(
    path: Path,
    *,
    clock: Clock | None = None,
    actions: Iterable[Mapping[str, Any]] = ACTIONS,
    capture_fps: float | None = None,
    secret_key: bytes | None = None,
    segment_s: float = 10.0,
    hypervisor: FakeHypervisor | None = None,
    between: Any = None,
    ready_poll_s: float = 0.5,
) -> Path:
    """Run a fake session with ``actions`` into a bundle at ``path``; returns ``path``."""
    clock = clock or FakeClock()
    spec = SessionSpec(SESSION_ID, IMAGE, DisplaySpec(640, 400), boot_timeout_s=5)
    recorder = FileRecorder(
        path,
        clock,
        {
            "session_id": SESSION_ID,
            "image": {"name": IMAGE.name, "content_hash": IMAGE.content_hash},
            "display": {"width": 640, "height": 400},
        },
        secret_key=secret_key,
        segment_s=segment_s,
    )
    with Session(
        spec,
        hypervisor=hypervisor or FakeHypervisor(),
        recorder=recorder,
        clock=clock,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=ready_poll_s,
        capture_fps=capture_fps,
    ) as session:
        for body in actions:
            session.execute(parse_deskvm_action(dict(body)))
            if between is not None:
                between()
    return path
