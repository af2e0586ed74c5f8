"""``rerun`` against the fake hypervisor: same image, same inputs, identical frames."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agent_bridge.protocol import parse_deskvm_action
from orchestrator.errors import ConfigError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.replay import verify
from orchestrator.rerun import replayable_action, rerun
from orchestrator.spec import DisplaySpec
from tests.recording.conftest import ACTIONS, IMAGE


def _manager(tmp_path: Path, image=IMAGE) -> SessionManager:  # type: ignore[no-untyped-def]
    return SessionManager(
        hypervisor=FakeHypervisor(),
        resolve_image=lambda name: image,
        recordings_dir=tmp_path / "recordings",
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
        capture_fps=5,
    )


def _original(manager: SessionManager) -> Path:
    session = manager.create(image=IMAGE.name, display=DisplaySpec(640, 400))
    for body in ACTIONS:
        session.execute(parse_deskvm_action(body))
    manager.delete(session.id)
    assert session.recorder.path is not None
    return session.recorder.path


def test_rerun_reproduces_every_step(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    original = _original(manager)
    report = rerun(original, manager, settle_s=0.1)
    assert report.rerun is not None and report.rerun != original
    assert verify(report.rerun).ok
    rows = {r.index: r for r in report.steps}
    assert rows[2].ssim is None and "secret" in rows[2].note
    # The fake desktop shows the typed line; the secret was not retyped, so from step 3
    # on the rerun's line lacks it: the report shows where the runs diverge.
    assert rows[0].ssim == rows[1].ssim == 1.0
    assert rows[3].ssim is not None and rows[3].ssim < 1.0
    assert len(report.steps) == len(ACTIONS) + 1  # plus the final frame


def test_rerun_without_secrets_is_identical(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    session = manager.create(image=IMAGE.name, display=DisplaySpec(640, 400))
    for body in ACTIONS:
        if not body.get("secret"):
            session.execute(parse_deskvm_action(body))
    manager.delete(session.id)
    assert session.recorder.path is not None
    report = rerun(session.recorder.path, manager, settle_s=0.1)
    assert report.min_ssim == 1.0 and all(r.ssim is not None for r in report.steps)


def test_rerun_refuses_another_image(tmp_path: Path) -> None:
    original = _original(_manager(tmp_path))
    other = dataclasses.replace(IMAGE, content_hash="ee" * 32)
    with pytest.raises(ConfigError, match="different image"):
        rerun(original, _manager(tmp_path / "b", other))


def test_replayable_action() -> None:
    assert replayable_action({"action": "key", "combos": ["ctrl+l", "a"]}) == {
        "action": "key",
        "keys": "ctrl+l a",
    }
    assert replayable_action({"action": "type", "text": None, "secret": True, "length": 3}) is None
    assert replayable_action({"action": "click", "x": 1, "y": 2, "hold": None}) == {
        "action": "click",
        "x": 1,
        "y": 2,
    }


@pytest.mark.parametrize(
    "body",
    [
        {"action": "screenshot"},
        {"action": "zoom", "region": [0, 0, 10, 20]},
        {"action": "move", "x": 1, "y": 2},
        {"action": "move", "x": 1, "y": 2, "hold": "shift"},
        {"action": "click", "x": 0, "y": 0, "button": "right", "count": 2, "hold": "ctrl"},
        {"action": "mouse_down", "button": "middle", "x": 3, "y": 4},
        {"action": "mouse_up", "button": "left"},
        {"action": "drag", "path": [[0, 0], [5, 5]], "button": "left"},
        {"action": "scroll", "x": 1, "y": 1, "dx": -3, "dy": 5},
        {"action": "type", "text": "hi\tthere\n"},
        {"action": "key", "keys": "ctrl+a ctrl+c"},
        {"action": "hold_key", "keys": "shift+a", "duration_ms": 300},
        {"action": "wait", "ms": 10},
        {"action": "cursor_position"},
    ],
)
def test_every_recorded_action_replays_as_itself(body: dict[str, object]) -> None:
    from agent_bridge.protocol import action_to_dict

    action = parse_deskvm_action(body)
    again = replayable_action(action_to_dict(action))
    assert again is not None
    assert parse_deskvm_action(again) == action
