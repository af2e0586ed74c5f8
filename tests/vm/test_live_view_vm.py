"""The live view page in headless Chromium (Debian's chromium via Playwright) on a real VM.

One probe VM (``autostart="input-probe"``, take-over policy ``wait``) serves every case:
the canvas shows the guest's pixels; a click on the canvas reaches the guest at the right
display pixel (the probe reports it); approve/deny on the page decide held actions; taking
over holds the agent's input and handing back releases it.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from playwright.sync_api import Page, sync_playwright

from agent_bridge.client import Client, RemoteError, Session
from agent_bridge.input_check import ProbeReader, presses
from orchestrator.replay import Recording

W, H = 1280, 800
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]  # fmt: skip
EVENT_TIMEOUT_S = 20.0

_CANVAS = """() => {
  const c = document.getElementById("screen");
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let s = ""; const chunk = 0x8000;
  for (let i = 0; i < d.length; i += chunk)
    s += String.fromCharCode.apply(null, d.subarray(i, i + chunk));
  return [c.width, c.height, btoa(s)];
}"""


@pytest.fixture(scope="module")
def session(deskvm_client: Client) -> Iterator[Session]:
    session = deskvm_client.create_session(
        width=W, height=H, boot_timeout_s=240, autostart="input-probe",
        takeover={"agent": "wait", "wait_timeout_s": 120},
    )  # fmt: skip
    try:
        yield session
    finally:
        print("\n--- probe guest log tail ---\n" + session.guest_log()[-2000:])
        session.delete()


@pytest.fixture(scope="module")
def page(deskvm_server: tuple[str, str], session: Session) -> Iterator[Page]:
    url, token = deskvm_server
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{url}/view/{session.id}#token={token}")
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            first_frame = "document.getElementById('screen').dataset.frame"
            page.wait_for_function(first_frame, timeout=30_000)
            assert token not in page.url  # the fragment was taken out of the address bar
            yield page
        finally:
            browser.close()


def _canvas(page: Page) -> np.ndarray:
    width, height, data = page.evaluate(_CANVAS)
    assert (width, height) == (W, H)
    rgba = np.frombuffer(base64.b64decode(data), np.uint8).reshape(H, W, 4)
    return rgba[:, :, :3].astype(np.int16)


def _click_canvas(page: Page, x: int, y: int) -> tuple[int, int]:
    """Click the canvas where it shows display pixel (x, y).

    Returns:
        The display pixel the page sent (the one under the clicked CSS pixel's centre: the
        canvas is scaled to the window, so a CSS pixel may cover more than one); it is
        checked to be within a CSS pixel of (x, y).
    """
    box = page.locator("#screen").bounding_box()
    assert box is not None
    kx, ky = box["width"] / W, box["height"] / H
    page.mouse.click(box["x"] + (x + 0.5) * kx, box["y"] + (y + 0.5) * ky)
    page.wait_for_function("document.body.dataset.lastPoint", timeout=5_000)
    sent_x, sent_y = (int(v) for v in page.evaluate("document.body.dataset.lastPoint").split(","))
    page.evaluate("delete document.body.dataset.lastPoint")
    assert abs(sent_x - x) <= 1 / kx + 1 and abs(sent_y - y) <= 1 / ky + 1, (sent_x, sent_y)
    return sent_x, sent_y


def _press_at(events: list[dict[str, Any]], x: int, y: int) -> bool:
    return any(e["x"] == x and e["y"] == y for e in presses(events))


def test_the_canvas_shows_the_guests_pixels(page: Page, session: Session) -> None:
    shot = np.asarray(session.screenshot().image().convert("RGB"), np.int16)
    deadline = time.monotonic() + 20
    while True:
        diff = float(np.abs(_canvas(page) - shot).mean())
        if diff < 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert diff < 4, f"canvas differs from the guest's screen by {diff:.1f} per channel (JPEG)"


def test_a_click_on_the_canvas_reaches_the_guest_at_that_point(
    page: Page, session: Session
) -> None:
    probe = ProbeReader(session)
    page.click("#takeover")
    page.wait_for_function("document.body.dataset.control === 'mine'", timeout=10_000)
    try:
        for x, y in ((321, 123), (W - 1, H - 1), (0, 0), (640, 400)):
            since = probe.mark()
            want = _click_canvas(page, x, y)
            events = probe.wait(since, lambda ev, w=want: _press_at(ev, *w), EVENT_TIMEOUT_S)
            assert _press_at(events, *want), (want, presses(events))
    finally:
        page.click("#handback")
        page.wait_for_function("document.body.dataset.control === 'agent'", timeout=10_000)
    path = session.info().recording
    assert path is not None
    recording = Recording(Path(path))
    human = [e for e in recording.events if e["kind"] == "input" and e["source"] == "human"]
    assert {e["data"]["action"]["action"] for e in human} >= {"mouse_down", "mouse_up"}
    assert all(e["data"]["by"] == "admin" for e in human)


def test_approve_and_deny_on_the_page(page: Page, session: Session) -> None:
    client = session.client
    client._request("PUT", f"/v1/sessions/{session.id}/approval-policy",
                    json={"kinds": ["click"], "timeout_s": 60})  # fmt: skip
    probe = ProbeReader(session)
    try:
        for decision, (x, y) in (("approve", (200, 300)), ("deny", (250, 350))):
            since = probe.mark()
            outcome: list[Any] = []
            agent = threading.Thread(target=_agent_click, args=(session, x, y, outcome))
            agent.start()
            page.wait_for_selector("#pending .pending img", timeout=30_000)
            page.click(f"#pending .pending button.{'ok' if decision == 'approve' else 'danger'}")
            agent.join(timeout=60)
            page.wait_for_selector("#pending .pending", state="detached", timeout=10_000)
            if decision == "approve":
                assert outcome == ["ok"]
                assert _press_at(probe.wait(since, lambda ev: _press_at(ev, 200, 300)), 200, 300)
            else:
                assert outcome == ["approval_denied"]
                time.sleep(1)
                assert not _press_at(probe.events(since), 250, 350)
    finally:
        client._request("PUT", f"/v1/sessions/{session.id}/approval-policy", json={})


def _agent_click(session: Session, x: int, y: int, outcome: list[Any]) -> None:
    agent = session.client.attach(session.id)
    try:
        agent.click(x, y)
        outcome.append("ok")
    except RemoteError as exc:
        outcome.append(exc.code)
    finally:
        agent.close()


def test_take_over_holds_the_agent_and_hand_back_releases_it(page: Page, session: Session) -> None:
    probe = ProbeReader(session)
    since = probe.mark()
    page.click("#takeover")
    page.wait_for_function("document.body.dataset.control === 'mine'", timeout=10_000)
    outcome: list[Any] = []
    agent = threading.Thread(target=_agent_click, args=(session, 600, 400, outcome))
    agent.start()
    try:
        time.sleep(2)
        assert outcome == [] and agent.is_alive()  # held (policy: wait)
        human = _click_canvas(page, 100, 100)  # the person's click goes through meanwhile
        probe.wait(since, lambda ev: _press_at(ev, *human))
        assert not _press_at(probe.events(since), 600, 400)
    finally:
        page.click("#handback")
    agent.join(timeout=60)
    assert outcome == ["ok"]
    events = probe.wait(since, lambda ev: _press_at(ev, 600, 400))
    order = [(e["x"], e["y"]) for e in presses(events)]
    assert order.index(human) < order.index((600, 400))  # the agent's ran after
