"""The full desktop image (``debian12-full``, issue 12) on a real VM: one session for the module.

One boot of the full image with an egress policy (``allowed.test`` of the egress test
world, ``tests/egress/egress_world.py``), the guest control plane and 3 GiB of memory
serves every test here, in file order:

1. the ready frame shows the XFCE panel across the top (not only the background);
2. Firefox opens ``http://allowed.test/colour/RRGGBB``: the world's server logs the request
   and the screenshot shows the page's colour block (Chromium is started beside it);
3. CJK and emoji typed into Mousepad render as glyphs: the same line of characters that no
   installed font has is drawn as boxes (the control), the CJK line is not, the emoji in
   colour;
4. with both browsers started and left idle for the rest of the module, the session's
   ``/network`` decisions and the world's server show only what the tests asked for.

Apps are started through the guest control plane (``exec``); typing and keys go through
the host's input path. Each step prints how long it took (``pytest -s``).
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from agent_bridge.client import Client, Session
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "egress"))
from egress_world import World, leftovers

pytestmark = pytest.mark.netns

IMAGE = "debian12-full"
MEMORY_MIB = 3072
BOOT_TIMEOUT_S = 240.0
ALLOW = ["allowed.test"]
ALLOWED_ADDR = "203.0.113.10"  # what the world's DNS answers for allowed.test
BACKGROUND_RGB = (0x2F, 0x4F, 0x6F)  # vm_images/recipes/debian12-full.toml
PANEL_HEIGHT_PX = 28
# The browsers stay idle (no request from the test) at least this long before the check.
IDLE_S = 60.0

# Characters Noto CJK and Noto Color Emoji draw, and characters no installed font has
# (Linear B, cuneiform, Ethiopic, Javanese): the test checks both claims with fc-list.
GLYPHS = "か な 永 字 한 😀 🎉"
EMOJI = "😀🎉"
LINE_BAND_MAX_PX = 80  # the tallest band of changed rows a typed line may make
CURSOR_PX_MAX = 100  # changed pixels a blinking text cursor accounts for
NO_GLYPHS = "\U00010000 \U00012000 \u1200 \ua984"  # 𐀀 𒀀 Ethiopic HA, Javanese A


@dataclass
class Full:
    world: World
    client: Client
    session: Session
    ready_frame: Image.Image
    boot_s: float
    started: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def until(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 1.0) -> Any:
    """``check()``'s first truthy value, polled every ``every_s`` for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(every_s)


def launch(session: Session, command: str) -> None:
    """Start a desktop program in the guest (as the desktop user) and return at once."""
    name = command.split()[0]
    r = session.exec(["sh", "-c", f"{command} >/tmp/{name}.log 2>&1 &"])
    assert r.exit_code == 0, r


def window(session: Session, title: str) -> dict[str, Any] | None:
    """The managed window whose title matches the regular expression ``title``."""
    for w in session.windows():
        if re.search(title, w["title"]):
            return w
    return None


def focus(session: Session, title: str, timeout_s: float) -> dict[str, Any]:
    """Wait for the window titled ``title``, raise and focus it; returns it."""
    w: dict[str, Any] = until(f"a window titled {title!r}", lambda: window(session, title),
                              timeout_s)  # fmt: skip

    def focused() -> bool:
        now = window(session, title)
        if now is not None and now["focused"]:
            return True
        session.window_activate(w["id"])
        return False

    until(f"{title!r} focused", focused, 30)
    return w


def settle(session: Session, still_ms: int = 2000, timeout_ms: int = 30_000) -> bool:
    """Wait until the screen has not changed for ``still_ms`` (an app done drawing);
    whether it did within ``timeout_ms``."""
    return session.act({"action": "wait", "ms": 1}, still_ms=still_ms,
                       timeout_ms=timeout_ms).screenshot.settled  # fmt: skip


def stamp(full: Full, name: str, t0: float) -> None:
    full.timings[name] = round(time.monotonic() - t0, 1)
    print(f"\n{name}: {full.timings[name]} s")


@pytest.fixture(scope="module")
def full(settings: Settings) -> Iterator[Full]:
    world = World()
    try:
        world.open()
        manager = build_manager(settings, egress=world.egress)
        token = secrets.token_urlsafe(16)
        app = create_app(manager, token=token, settings=settings)
        with BackgroundServer(app) as server, Client(server.url, token) as client:
            t0 = time.monotonic()
            session = client.create_session(
                image=IMAGE, memory_mib=MEMORY_MIB, egress_allow=ALLOW, guest_control=True,
                boot_timeout_s=BOOT_TIMEOUT_S,
            )  # fmt: skip
            boot_s = time.monotonic() - t0
            print(f"\n{IMAGE} session with egress ready in {boot_s:.1f} s")
            try:
                frame = session.screenshot().image()
                state = Full(world, client, session, frame, boot_s)
                yield state
                print(f"\n{IMAGE} timings (s): boot {boot_s:.1f}, {state.timings}")
            finally:
                session.delete()
    finally:
        errors = world.close()
        left = leftovers()
    assert not errors, errors
    assert not left, f"left behind: {left}"


@pytest.fixture(autouse=True)
def _artifacts_on_failure(request: pytest.FixtureRequest, full: Full) -> Iterator[None]:
    """A failed test leaves the last frame, the guest log and the network log."""
    yield
    call = getattr(request.node, "deskvm_rep_call", None)
    if call is None or not call.failed:
        return
    root = Path(os.environ.get("DESKVM_TEST_ARTIFACTS") or "artifacts")
    where = root / re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    where.mkdir(parents=True, exist_ok=True)
    try:
        full.session.screenshot().save(str(where / "last_frame.png"))
        (where / "guest.log").write_text(full.session.guest_log())
        (where / "network.txt").write_text("\n".join(map(str, full.session.network())))
        (where / "internet.log").write_text(full.world.internet_log.read_text())
        print(f"\nartifacts in {where}")
    except Exception as exc:  # never hide the failure itself
        print(f"\ncould not write artifacts to {where}: {exc!r}")


def _is_background(pixels: np.ndarray) -> np.ndarray:
    return np.all(np.abs(pixels - np.array(BACKGROUND_RGB, dtype=np.int16)) <= 6, axis=2)


def test_ready_frame_shows_the_panel(full: Full) -> None:
    pixels = np.asarray(full.ready_frame.convert("RGB"), dtype=np.int16)
    assert pixels.shape == (800, 1280, 3)
    background = _is_background(pixels)
    assert background.mean() > 0.10, "the desktop background is not painted"
    panel = pixels[:PANEL_HEIGHT_PX]
    drawn = 1 - background[:PANEL_HEIGHT_PX].mean()
    colours = len(np.unique(panel.reshape(-1, 3) @ np.array([65536, 256, 1])))
    assert drawn > 0.95 and colours >= 8, f"panel band: {drawn:.0%} drawn, {colours} colours"
    # ...and that band is the XFCE panel's window, across the whole top of the screen.
    r = full.session.exec(["sh", "-c", "for w in $(xdotool search --onlyvisible --class "
                           "xfce4-panel); do xdotool getwindowgeometry $w; done"])  # fmt: skip
    assert "Position: 0,0" in r.stdout and "Geometry: 1280x" in r.stdout, r.stdout


def test_firefox_opens_a_page_the_policy_allows(full: Full) -> None:
    s = full.session
    red, green, blue = (0xB0 + secrets.randbelow(0x40), 0x20 + secrets.randbelow(0x30),
                        0x80 + secrets.randbelow(0x40))  # fmt: skip
    colour = f"{red:02X}{green:02X}{blue:02X}"
    path = f"/colour/{colour}"
    t0 = time.monotonic()
    launch(s, f"firefox-esr http://allowed.test{path}")
    full.started["firefox-esr"] = t0
    # Chromium starts beside it and stays idle (test_no_background_network_traffic).
    launch(s, "chromium")
    full.started["chromium"] = t0

    def requested() -> bool:
        return any(e.get("kind") == "http" and e.get("path") == path
                   for e in full.world.internet_events())  # fmt: skip

    until(f"the world's server to see GET {path}", requested, 240)
    stamp(full, "firefox request", t0)
    focus(s, f"deskvm colour {colour}", 120)
    want = np.array([int(colour[i : i + 2], 16) for i in (0, 2, 4)], dtype=np.int16)

    def colour_block() -> tuple[int, int] | None:
        pixels = np.asarray(s.screenshot().image().convert("RGB"), dtype=np.int16)
        mask = np.all(np.abs(pixels - want) <= 3, axis=2)
        ys, xs = np.nonzero(mask)
        if xs.size == 0:
            return None
        w, h = int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)
        filled = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].mean()
        return (w, h) if w >= 400 and h >= 300 and filled > 0.98 else None

    w, h = until(f"a {colour} block of at least 400x300 px on the screen", colour_block, 120)
    stamp(full, "firefox page drawn", t0)
    print(f"colour block {w}x{h} px")
    # Chromium's window up too: no window of it maps (and takes the focus) later on.
    until("a Chromium window", lambda: window(s, "Chromium"), 120)
    stamp(full, "chromium window", t0)
    http = [e for e in full.world.internet_events() if e["kind"] == "http"]
    assert [e["addr"] for e in http] == [ALLOWED_ADDR] * len(http), http


def _bands(mask: np.ndarray) -> list[tuple[int, int]]:
    """Runs (top, bottom) of rows of ``mask`` with any pixel set (gaps up to 2 rows joined)."""
    rows = np.nonzero(mask.any(axis=1))[0]
    runs: list[tuple[int, int]] = []
    for y in rows:
        if runs and y - runs[-1][1] <= 3:
            runs[-1] = (runs[-1][0], int(y) + 1)
        else:
            runs.append((int(y), int(y) + 1))
    return runs


def _segments(
    mask: np.ndarray, min_gap_px: int = 4, min_width_px: int = 4
) -> list[tuple[int, np.ndarray]]:
    """The characters of a one-line ``mask``: column runs of ink split at gaps of at least
    ``min_gap_px`` (the typed spaces), as (left column, the run cropped to its ink); thin
    runs (the text cursor) dropped."""
    cols = np.nonzero(mask.any(axis=0))[0]
    runs: list[list[int]] = []
    for x in cols:
        if runs and x - runs[-1][1] < min_gap_px:
            runs[-1][1] = int(x)
        else:
            runs.append([int(x), int(x)])
    out = []
    for x0, x1 in runs:
        if x1 - x0 + 1 < min_width_px:
            continue
        part = mask[:, x0 : x1 + 1]
        ys = np.nonzero(part.any(axis=1))[0]
        out.append((x0, part[ys.min() : ys.max() + 1]))
    return out


def _box_score(glyph: np.ndarray) -> float:
    """How much of the ink's bounding frame is drawn (each edge 2 px thick, and its four
    3x3 corners): a missing-glyph box (a rectangle, hex digits inside) scores 1; CJK
    glyphs at most about 0.2 (measured); a round emoji about 0.6."""
    edges = [
        glyph[:, :2].any(axis=1).mean(),
        glyph[:, -2:].any(axis=1).mean(),
        glyph[:2].any(axis=0).mean(),
        glyph[-2:].any(axis=0).mean(),
    ]
    corners = [glyph[:3, :3], glyph[:3, -3:], glyph[-3:, :3], glyph[-3:, -3:]]
    return float(min(*edges, np.mean([c.any() for c in corners])))


def _typed_line(
    s: Session, text: str, area: tuple[int, int, int, int], below_y: int, timeout_s: float = 30.0
) -> tuple[np.ndarray, np.ndarray, int]:
    """Type ``text``; the pixels it changed in the first band of rows at or under screen
    row ``below_y`` inside ``area`` (the line just typed): (changed mask, RGB pixels of
    that band, the band's bottom screen row).

    The line is taken once it has one shape per word of ``text`` and two frames 0.5 s apart
    agree, or after ``timeout_s`` as it is then (the checks that follow say what is wrong):
    a guest busy with two browsers drew nothing within 1 s of the last key once, and the
    first use of the CJK and emoji fonts loads them."""
    x0, y0, x1, y1 = area

    def grab() -> np.ndarray:
        return np.asarray(s.screenshot().image().convert("RGB"), dtype=np.int16)[y0:y1, x0:x1]

    before = grab()
    s.type(text)
    t0 = time.monotonic()
    seen: tuple[int, int, int] | None = None
    while True:
        time.sleep(0.5)
        after = grab()
        changed = np.abs(after - before).max(axis=2) > 40
        changed[: max(0, below_y - y0)] = False
        bands = _bands(changed)
        waited_s = time.monotonic() - t0
        if bands:
            top, bottom = bands[0]
            now = (top, bottom, len(_segments(changed[top:bottom])))
            if now == seen and now[2] == len(text.split()):
                break
            seen = now
        if waited_s > timeout_s:
            break
    print(f"\n{text!r} drawn and settled {waited_s:.1f} s after the type action returned")
    windows = [(w["title"], w["x"], w["y"], w["width"], w["height"]) for w in s.windows()]
    assert bands, (
        f"nothing drawn under row {below_y} {waited_s:.1f} s after typing {text!r} into "
        f"{area}; windows now: {windows}"
    )
    top, bottom = bands[0]
    # One line of text is some 20-40 px tall: a taller band is the window changing under
    # the line (moved, resized or covered), not the line.
    assert bottom - top < LINE_BAND_MAX_PX, (
        f"the change under row {below_y} spans rows {y0 + top}-{y0 + bottom} of {area} "
        f"after typing {text!r}; windows now: {windows}"
    )
    return changed[top:bottom], after[top:bottom], y0 + bottom


def _still_window(s: Session, title: str, timeout_s: float = 30.0) -> tuple[int, int, int, int]:
    """The area (x0, y0, x1, y1) of the window titled ``title`` once its place and size
    and its pixels stay the same for 1 s (but for the blinking text cursor): a window
    still being placed or sized when a line is typed changes pixels far from the line."""
    deadline = time.monotonic() + timeout_s
    last: tuple[tuple[int, int, int, int], np.ndarray] | None = None
    steady = 0
    while True:
        w = window(s, title)
        assert w is not None, f"the window titled {title!r} is gone"
        area = (w["x"], w["y"], w["x"] + w["width"], w["y"] + w["height"])
        x0, y0, x1, y1 = area
        pixels = np.asarray(s.screenshot().image().convert("RGB"), dtype=np.int16)[y0:y1, x0:x1]
        if last is not None and last[0] == area:
            moved = int((np.abs(pixels - last[1]).max(axis=2) > 40).sum())
            steady = steady + 1 if moved < CURSOR_PX_MAX else 0
        else:
            steady = 0
        if steady >= 2:
            return area
        assert time.monotonic() < deadline, f"{title!r} still changing after {timeout_s:.0f} s"
        last = (area, pixels)
        time.sleep(0.5)


def test_cjk_and_emoji_render_as_glyphs(full: Full) -> None:
    s = full.session
    # The premise, from the guest's fontconfig: fonts cover GLYPHS, none covers NO_GLYPHS.
    for ch in GLYPHS.replace(" ", ""):
        r = s.exec(["fc-list", f":charset={ord(ch):x}", "family"])
        assert r.stdout.strip(), f"no font has {ch!r} (U+{ord(ch):04X})"
    for ch in NO_GLYPHS.replace(" ", ""):
        r = s.exec(["fc-list", f":charset={ord(ch):x}", "family"])
        assert not r.stdout.strip(), f"{ch!r} (U+{ord(ch):04X}) has fonts: {r.stdout}"

    t0 = time.monotonic()
    launch(s, "mousepad")
    focus(s, r"Mousepad", 120)
    stamp(full, "mousepad window", t0)
    # Modify the document first, so typing a line changes nothing above it (title, toolbar).
    s.type("x")
    s.key("BackSpace")
    area = _still_window(s, r"Mousepad")
    glyphs, glyph_pixels, bottom = _typed_line(s, GLYPHS + " ", area, area[1])
    s.key("Return")
    boxes, _, _ = _typed_line(s, NO_GLYPHS + " ", area, bottom)
    s.key("ctrl+a")
    s.key("ctrl+c")
    typed = until("the clipboard", s.clipboard_get, 10)
    assert typed == f"{GLYPHS} \n{NO_GLYPHS} ", typed

    box_scores = [round(_box_score(g), 2) for _, g in _segments(boxes)]
    shapes = _segments(glyphs)
    glyph_scores = [round(_box_score(g), 2) for _, g in shapes]
    print(f"\nbox scores: missing glyphs {box_scores}, CJK and emoji {glyph_scores}")
    # The control: characters without a font are drawn as boxes, and the check sees them.
    assert len(box_scores) == len(NO_GLYPHS.split()), box_scores
    assert min(box_scores) >= 0.8, box_scores
    # The CJK and emoji line: one shape per character; the CJK ones are not boxes...
    n_emoji = len(EMOJI)
    assert len(glyph_scores) == len(GLYPHS.split()), glyph_scores
    assert max(glyph_scores[:-n_emoji]) < 0.5, glyph_scores
    # ...and the emoji (the line's last shapes) are drawn in colour (Noto Color Emoji),
    # which a box never is (boxes are drawn in the text's colour), the rest not.
    saturated = []
    for x0, g in shapes:
        part = glyph_pixels[:, x0 : x0 + g.shape[1]]
        saturated.append(int(((part.max(axis=2) - part.min(axis=2)) > 80).sum()))
    assert min(saturated[-n_emoji:]) >= 20, f"saturated pixels per shape: {saturated}"
    assert max(saturated[:-n_emoji]) < 5, f"saturated pixels per shape: {saturated}"


def test_no_background_network_traffic(full: Full) -> None:
    """Both browsers started and idle: every decision and every contact is the test's own."""
    s = full.session
    assert set(full.started) == {"firefox-esr", "chromium"}, "run the module in order"
    idle_s = time.monotonic() - max(full.started.values())
    if idle_s < IDLE_S:
        time.sleep(IDLE_S - idle_s)
    ps = s.exec(["ps", "-e", "-o", "comm="]).stdout.split()
    assert "firefox-esr" in ps and "chromium" in ps, ps
    decisions = s.network()
    ours = []
    others = []
    for d in decisions:
        asked = d["kind"].startswith("dns_") and d.get("query") == "allowed.test"
        fetched = (d["kind"], d["protocol"], d["dst"], d["dst_port"]) == (
            "conn_allowed", "tcp", ALLOWED_ADDR, 80,
        )  # fmt: skip
        (ours if asked or fetched else others).append(d)
    print(f"\n{len(ours)} decisions of the test's own requests; others: {others}")
    assert ours, decisions
    assert not others, others
    contacts = [e for e in full.world.internet_events() if e["kind"] != "ready"]
    strange = [
        e
        for e in contacts
        if not (e["kind"] == "dns" and e["name"] == "allowed.test")
        and not (e["kind"] in ("tcp", "http") and (e["addr"], e["port"]) == (ALLOWED_ADDR, 80))
    ]
    assert not strange, strange
