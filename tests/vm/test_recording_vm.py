"""Recording on a real VM: record a short session, verify it, rerun it, same frames.

One VM at a time: the original session, then the rerun's session (about 2 x 20-60 s of
TCG boot plus ~15 s of inputs).
"""

from __future__ import annotations

import io
import json

from PIL import Image

from agent_bridge.protocol import parse_deskvm_action
from agent_bridge.protocol.results import ImageResult
from agent_bridge.runtime import build_manager
from orchestrator.replay import Recording, verify
from orchestrator.rerun import rerun
from orchestrator.settings import Settings
from orchestrator.spec import DisplaySpec
from tests.vm.conftest import window_box

SSIM_MIN = 0.97


def test_record_verify_and_rerun_reproduces_each_step(settings: Settings) -> None:
    settings = settings.replace(capture_fps=2.0)
    manager = build_manager(settings)
    session = manager.create(
        image=settings.default_image,
        display=DisplaySpec(1024, 768),
        boot_timeout_s=settings.boot_timeout_s,
    )
    path = session.recorder.path
    assert path is not None
    try:
        first = session.execute(parse_deskvm_action({"action": "screenshot"}))
        assert isinstance(first, ImageResult)
        x0, y0, x1, y1 = window_box(Image.open(io.BytesIO(first.data)))
        bodies = [
            {"action": "wait", "ms": 1500},
            {"action": "click", "x": (x0 + x1) // 2, "y": (y0 + y1) // 2},
            {"action": "wait", "ms": 2500},
            {"action": "type", "text": "echo deskvm-rerun-check\n"},
            {"action": "wait", "ms": 4000},
            {"action": "screenshot"},
        ]
        for body in bodies:
            session.execute(parse_deskvm_action(body))
    finally:
        manager.delete(session.id)

    report = verify(path)
    assert report.ok, f"{report}; recording at {path}"
    recording = Recording(path)
    captures = [e for e in recording.events if e["kind"] == "frame" and "video" in e["data"]]
    assert captures, f"no continuous capture in {path}"
    assert any(e["kind"] == "media" for e in recording.events)

    result = rerun(path, manager, boot_timeout_s=settings.boot_timeout_s, settle_s=2.0)
    rows = [(r.index, r.action, r.ssim, r.note) for r in result.steps]
    print(json.dumps(rows))
    assert result.rerun is not None and verify(result.rerun).ok
    for index, action, ssim, note in rows:
        assert not note, rows
        assert ssim is not None and ssim >= SSIM_MIN, (
            f"step {index} ({action}) differs: SSIM {ssim}; original {path}, "
            f"rerun {result.rerun}; all: {rows}"
        )
