"""The replay viewer in headless Chromium (Debian's chromium, driven by Playwright).

Seeking to an event (clicking it in the list, stepping, scrubbing the timeline) must show
exactly the frame recorded at that event: the canvas pixels are compared with the
recording's own frame.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, sync_playwright

from agent_bridge.runtime import BackgroundServer
from agent_bridge.viewer import viewer_app
from orchestrator.clock import SystemClock
from orchestrator.replay import Recording
from tests.recording.conftest import record

TOKEN = "browser-token-0123"
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run",
]  # fmt: skip

_PIXELS = """() => {
  const c = document.getElementById("frame");
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let s = ""; const chunk = 0x8000;
  for (let i = 0; i < d.length; i += chunk)
    s += String.fromCharCode.apply(null, d.subarray(i, i + chunk));
  return [c.width, c.height, Number(c.dataset.seq), btoa(s)];
}"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record(
        tmp_path_factory.mktemp("rec") / "abcdefgh2345", clock=SystemClock(), capture_fps=5
    )


@pytest.fixture(scope="module")
def page(bundle: Path) -> Iterator[Page]:
    with BackgroundServer(viewer_app(bundle, token=TOKEN)) as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            page.goto(f"{server.url}/replay/local/#token={TOKEN}")
            page.wait_for_selector("body[data-ready='1']", timeout=20_000)
            yield page
        finally:
            browser.close()


def _shown(page: Page, expected_seq: int) -> tuple[int, int, int, bytes]:
    page.wait_for_function(
        f"document.getElementById('frame').dataset.seq === '{expected_seq}' "
        "&& document.body.dataset.loading === '0'",
        timeout=10_000,
    )
    width, height, seq, data = page.evaluate(_PIXELS)
    return width, height, seq, base64.b64decode(data)


def _rgba(recording: Recording, seq: int) -> bytes:
    return recording.frame_image(seq).convert("RGBA").tobytes()


def test_clicking_an_event_shows_its_exact_frame(page: Page, bundle: Path) -> None:
    recording = Recording(bundle)
    events: list[dict[str, Any]] = recording.events
    inputs = [e for e in events if e["kind"] == "input"]
    for event in (inputs[1], inputs[4], inputs[-1]):
        page.click(f"#events div[data-seq='{event['seq']}']")
        expected = recording.frame_seq_for_event(event["seq"])
        assert expected is not None
        width, height, seq, pixels = _shown(page, expected)
        assert (width, height, seq) == (640, 400, expected)
        assert pixels == _rgba(recording, expected)
        assert f'"seq": {event["seq"]}' in page.inner_text("#event")


def test_click_overlay_is_drawn_at_the_click(page: Page, bundle: Path) -> None:
    recording = Recording(bundle)
    click = next(
        e
        for e in recording.events
        if e["kind"] == "input" and e["data"]["action"]["action"] == "click"
    )
    page.click(f"#events div[data-seq='{click['seq']}']")
    rgba = page.evaluate(
        "() => Array.from(document.getElementById('overlay').getContext('2d')"
        ".getImageData(200 + 9, 150, 1, 1).data)"
    )
    assert rgba[0] > 200 and rgba[3] > 0  # the red ring at radius 9 around (200, 150)


def test_step_and_seek(page: Page, bundle: Path) -> None:
    recording = Recording(bundle)
    page.click("#events div[data-seq='3']")
    page.click("#next")
    assert page.evaluate("document.body.dataset.event") == "4"
    expected = recording.frame_seq_for_event(4)
    assert expected is not None
    assert _shown(page, expected)[3] == _rgba(recording, expected)
    # Scrub the timeline to the time of a late capture frame.
    late = [e for e in recording.events if e["kind"] == "frame" and "video" in e["data"]][-1]
    t_s = (late["data"]["pts_ns"] - recording.origin_ns) / 1e9 + 0.0005
    page.evaluate(
        f"() => {{ const s = document.getElementById('scrub'); s.value = '{t_s}';"
        " s.dispatchEvent(new Event('input')); }"
    )
    expected = recording.frame_seq_at(t_s)
    assert expected is not None
    assert _shown(page, expected)[3] == _rgba(recording, expected)


def test_play_advances_time(page: Page, bundle: Path) -> None:
    duration_s = Recording(bundle).duration_s
    page.click("#events div[data-seq='0']")
    page.select_option("#speed", "8")
    page.click("#play")
    page.wait_for_timeout(400)
    t = float(page.inner_text("#clock").split()[0])
    page.click("#play")
    assert t > 0 and t >= min(0.5, round(duration_s, 3) - 0.001)
