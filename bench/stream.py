#!/usr/bin/env python3
"""Live stream and screenshot figures on a real VM, through the real bridge.

Prints, for one 1280x800 session (the default image):

  * screenshot round trip: the raw QMP screendump (PPM into a memfd, what the bridge uses),
    libvirt's virDomainScreenshot (QEMU encodes a PNG), and a screenshot through the bridge
    (binary reply, and base64 JSON), interleaved so they share the host's load;
  * stream fps and server CPU while the guest animates (an xterm printing continuously),
    with 1 and 4 viewers (JPEG q80, max_fps 30), each viewer a separate process; the
    server's CPU is this process's (viewers and their decoding are elsewhere);
  * latency from an action (typing one character) to the first streamed frame showing it;
  * screenshot_after: an action then a screenshot once the screen is still (still_ms 300)
    against the fixed 2 s sleep agents commonly use;
  * the server's own capacity, without the guest's limits: the same stream runs against a
    fake display whose 1280x800 screen changes on every grab (a scrolling terminal,
    pre-rendered), so fps and CPU are the server's (capture compare, JPEG, send).

Run as root on a host set up by `deskvm doctor --fix` with the default image built, under
the VM lock:
    flock /run/deskvm-vm.lock .venv/bin/python bench/stream.py [--shots 30] [--seconds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent_bridge.client import Client, Session
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.interrupt import run_main
from orchestrator.settings import Settings

W, H = 1280, 800
ANIMATION = "while :; do date +%s.%N; done\n"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


def cpu_s(pid: int | str = "self") -> float:
    """utime + stime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def qemu_pid(session_id: str) -> int | None:
    try:
        return int(Path(f"/run/libvirt/qemu/deskvm-{session_id}.pid").read_text())
    except (OSError, ValueError):
        return None


def viewer_main(url: str, session_id: str, seconds: float, max_fps: float) -> None:
    """A viewer process: count frames and bytes for ``seconds``; print JSON."""
    token = os.environ["DESKVM_BENCH_TOKEN"]
    with Client(url, token) as client:
        session = client.attach(session_id)
        frames = bytes_ = 0
        with session.stream(codec="jpeg", quality=80, max_fps=max_fps, decode=False) as stream:
            next(stream)  # the first frame: the screen as it was
            t0 = time.monotonic()
            while (left := seconds - (time.monotonic() - t0)) > 0:
                try:
                    frame = stream.next(timeout_s=left)
                except TimeoutError:
                    break
                if frame is None:
                    break
                frames += 1
                bytes_ += len(frame.data)
        print(json.dumps({"frames": frames, "bytes": bytes_, "seconds": seconds}))


def libvirt_screendump(display: Any) -> Any:
    with display._lock:
        return display._screendump_libvirt()


def screenshots(session: Session, binary: Session, base64: Session, shots: int) -> None:
    domain = MANAGER.get(session.id)._domain  # the raw display, for the baselines
    assert domain is not None
    display = domain.display
    raw: dict[str, list[float]] = {"fdset": [], "libvirt": [], "binary": [], "base64": []}
    kinds: list[tuple[str, Any]] = [
        ("fdset", display.screendump),
        ("libvirt", lambda: libvirt_screendump(display)),
        ("binary", binary.screenshot),
        ("base64", base64.screenshot),
    ]
    rng = random.Random(13)
    for _ in range(shots):
        rng.shuffle(kinds)  # no kind always follows the same other one
        for name, fn in kinds:
            time.sleep(0.02)
            t0 = time.perf_counter()
            fn()
            raw[name].append((time.perf_counter() - t0) * 1000)
    print(f"\nscreenshot round trip, {W}x{H}, {shots} each, interleaved ({load()}):")
    labels = {
        "fdset": "raw QMP screendump (PPM into memfd, read, decode)",
        "libvirt": "libvirt virDomainScreenshot (QEMU PNG, stream)",
        "binary": "bridge screenshot, binary reply (PNG)",
        "base64": "bridge screenshot, base64 JSON reply",
    }
    for name, values in raw.items():
        print(
            f"  {labels[name]:52s} p50 {pct(values, 0.5):6.1f} ms   p90 {pct(values, 0.9):6.1f} ms"
        )
    ratio = pct(raw["binary"], 0.5) / pct(raw["fdset"], 0.5)
    print(f"  bridge (binary) / raw QMP screendump, p50: {ratio:.2f}x")


def stream_fps(
    url: str, session: Session, seconds: float, viewers: int, manager: Any = None
) -> dict[str, Any]:
    capture = (manager or MANAGER).get(session.id).frames
    assert capture is not None
    env = {**os.environ, "DESKVM_BENCH_TOKEN": TOKEN}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--viewer", url, session.id, str(seconds), "30"],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(viewers)
    ]
    time.sleep(1.5)  # connected, first frame in
    qemu = qemu_pid(session.id)

    def sample() -> tuple[float, float, int, int, float]:
        number = capture.latest.number if capture.latest else 0
        qemu_s = cpu_s(qemu) if qemu else 0.0
        return cpu_s(), qemu_s, capture.grabs, number, time.monotonic()

    c0, q0, g0, n0, t0 = sample()
    time.sleep(seconds - 2.0)
    c1, q1, g1, n1, t1 = sample()
    results = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    span = t1 - t0
    fps = [r["frames"] / r["seconds"] for r in results]
    out = {
        "viewers": viewers,
        "fps_per_viewer": round(statistics.mean(fps), 1),
        "kib_per_frame": round(
            sum(r["bytes"] for r in results) / max(1, sum(r["frames"] for r in results)) / 1024, 1
        ),
        "grabs_per_s": round((g1 - g0) / span, 1),
        "changes_per_s": round((n1 - n0) / span, 1),
        "server_cpu_pct": round(100 * (c1 - c0) / span, 1),
        "qemu_cpu_pct": round(100 * (q1 - q0) / span, 1) if qemu else None,
        "load": load(),
    }
    print(f"  {viewers} viewer(s): {out['fps_per_viewer']} fps each, "
          f"{out['kib_per_frame']} KiB/frame; capture {out['grabs_per_s']} grabs/s, "
          f"{out['changes_per_s']} changes/s; server CPU {out['server_cpu_pct']} % of a core, "
          f"QEMU {out['qemu_cpu_pct']} %; {out['load']}")  # fmt: skip
    return out


def latency(session: Session, samples: int) -> None:
    values = []
    with session.stream(codec="jpeg", max_fps=30, decode=False) as stream:
        next(stream)
        for i in range(samples):
            time.sleep(0.5)
            while True:  # drain: the screen must be still before the action
                try:
                    stream.next(timeout_s=0.3)
                except TimeoutError:
                    break
            t0 = time.perf_counter()
            if i % 2 == 0:
                session.type("x")
            else:
                session.key("backspace")
            frame = stream.next(timeout_s=10)
            assert frame is not None
            values.append((time.perf_counter() - t0) * 1000)
    print(f"\naction (type a character / backspace) -> first streamed frame showing it, "
          f"{samples} samples ({load()}): p50 {pct(values, .5):.0f} ms, "
          f"p90 {pct(values, .9):.0f} ms, min {min(values):.0f} ms")  # fmt: skip


def settle(session: Session, samples: int) -> None:
    """The same typed command, once with screenshot_after and once with a 2 s sleep."""
    after, fixed, waited, settled = [], [], [], 0
    for i in range(samples):
        command = "ls -la /usr/bin | head -30\n" if i % 2 == 0 else "clear\n"
        t0 = time.perf_counter()
        acted = session.act({"action": "type", "text": command}, still_ms=300, timeout_ms=10_000)
        after.append(time.perf_counter() - t0)
        waited.append(acted.screenshot.waited_ms)
        settled += acted.screenshot.settled
        t0 = time.perf_counter()
        session.type(command)
        time.sleep(2.0)
        session.screenshot()
        fixed.append(time.perf_counter() - t0)
    mean_after, mean_fixed = statistics.mean(after), statistics.mean(fixed)
    print(f"\nscreenshot_after (still_ms 300) vs a fixed 2 s sleep, {samples} typed commands "
          f"({load()}):\n  type + settled screenshot {mean_after:.2f} s mean (waited p50 "
          f"{pct(waited, .5):.0f} ms, settled {settled}/{samples}); type + 2 s + screenshot "
          f"{mean_fixed:.2f} s mean; saved {mean_fixed - mean_after:.2f} s per action "
          f"({100 * (1 - mean_after / mean_fixed):.0f} %)")  # fmt: skip


def terminal_frames(count: int) -> list[Any]:
    """``count`` different 1280x800 screens: a terminal window scrolling text."""
    from PIL import Image, ImageDraw

    rng = random.Random(7)
    lines = [" ".join(rng.choice(["ls", "-la", "/usr/bin", "date", "1733027", ".431",
                                  "deskvm", "frame", "x" * rng.randint(1, 9)])
                      for _ in range(rng.randint(3, 12))) for _ in range(count + 60)]  # fmt: skip
    frames = []
    for i in range(count):
        image = Image.new("RGB", (W, H), (0x2E, 0x4A, 0x62))
        draw = ImageDraw.Draw(image)
        draw.rectangle((60, 40, 900, 700), fill=(255, 255, 255))
        for row, text in enumerate(lines[i : i + 55]):
            draw.text((66, 44 + 12 * row), text, fill=(0, 0, 0))
        frames.append(image)
    return frames


def synthetic(seconds: float) -> list[dict[str, Any]]:
    """The stream against a fake display whose screen changes on every grab."""
    import itertools
    import tempfile

    from orchestrator.hypervisor.fake import FakeHypervisor
    from orchestrator.manager import SessionManager
    from orchestrator.spec import BootImage

    root = Path(tempfile.mkdtemp(prefix="deskvm-bench-"))
    image = BootImage("fake", "0" * 64, root / "b", root / "k", root / "i")
    manager = SessionManager(hypervisor=FakeHypervisor(), resolve_image=lambda _n: image,
                             recordings_dir=root / "rec", capture_fps=2)  # fmt: skip
    settings = Settings(default_image="fake")
    frames = itertools.cycle(terminal_frames(30))
    print(f"\nserver capacity: fake 1280x800 screen changing on every grab ({seconds:g} s "
          "windows, JPEG q80, max_fps 30):")  # fmt: skip
    with (
        BackgroundServer(create_app(manager, token=TOKEN, settings=settings)) as server,
        Client(server.url, TOKEN, timeout_s=60) as client,
        client.create_session(width=W, height=H) as session,
    ):
        domain = manager.get(session.id)._domain
        assert domain is not None
        domain.display.screendump = lambda: next(frames)
        runs = [stream_fps(server.url, session, seconds, n, manager) for n in (1, 4)]
    one, four = runs
    added = (four["server_cpu_pct"] - one["server_cpu_pct"]) / 3
    print(f"  server CPU per added viewer: {added:.1f} % of a core")
    return runs


MANAGER: Any = None
TOKEN = ""


def main() -> None:
    global MANAGER, TOKEN
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shots", type=int, default=30, help="screenshots of each kind")
    parser.add_argument("--seconds", type=float, default=15.0, help="stream window per run")
    parser.add_argument("--samples", type=int, default=10, help="latency/settle samples")
    parser.add_argument("--synthetic-only", action="store_true",
                        help="only the server-capacity run (no VM)")  # fmt: skip
    parser.add_argument("--viewer", nargs=4, metavar=("URL", "SESSION", "SECONDS", "FPS"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.viewer:
        url, sid, seconds, fps = args.viewer
        viewer_main(url, sid, float(seconds), float(fps))
        return

    TOKEN = secrets.token_urlsafe(16)
    if args.synthetic_only:
        print(f"host: {os.cpu_count()} cores; {load()}")
        print(json.dumps({"synthetic": synthetic(args.seconds)}))
        return
    settings = Settings.from_env()
    MANAGER = build_manager(settings)
    print(f"host: {os.cpu_count()} cores, acceleration {MANAGER.hypervisor.accel}; {load()}")
    with (
        BackgroundServer(create_app(MANAGER, token=TOKEN, settings=settings)) as server,
        Client(server.url, TOKEN, timeout_s=60) as client,
    ):
        t0 = time.perf_counter()
        with client.create_session(width=W, height=H) as session:
            print(f"session {session.id} ready in {time.perf_counter() - t0:.1f} s")
            binary = client.attach(session.id)
            base64 = client.attach(session.id, query={"images": "base64"})
            binary.screenshot(), base64.screenshot()
            screenshots(session, binary, base64, args.shots)
            latency(session, args.samples)
            settle(session, args.samples)
            session.click(300, 200)
            session.type(ANIMATION)
            time.sleep(2)
            print(f"\nstream while the xterm prints continuously ({args.seconds:g} s windows):")
            runs = [stream_fps(server.url, session, args.seconds, n) for n in (1, 4)]
            session.key("ctrl+c")
            one, four = runs
            per_viewer = (four["server_cpu_pct"] - one["server_cpu_pct"]) / 3
            print(f"  server CPU per added viewer: {per_viewer:.1f} % of a core")
            print(json.dumps({"stream": runs}))
    print(json.dumps({"synthetic": synthetic(args.seconds)}))


if __name__ == "__main__":
    run_main(main)
