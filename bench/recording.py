"""Recording costs: bytes per minute, CPU per frame, seek time in a long recording.

Prints three tables:

1. Bytes per minute of an idle and a busy synthetic 1280x800 desktop at the capture rate,
   as recorded (events + H.264 segments + PNG stills at inputs) against storing a PNG per
   captured frame (zlib level 1, as the session encodes, and level 6).
2. Recording CPU per frame (process CPU time, this process only: pixel hash, H.264
   encode, event write; an unchanged frame costs the hash only) and what that is as a
   share of one core at 2 and 5 fps. The QMP screendump itself (QEMU's side plus PPM
   parsing, ~9 ms at 1280x800 per ARCHITECTURE.md) comes on top.
3. Seek time to a random event of a synthetic one-hour recording (open, then the frame
   shown at that event, cold and warm decode cache).

``--bundle PATH`` adds the same bytes-per-minute figures for a real recording.

Usage: ``python bench/recording.py [--minutes 60] [--fps 1] [--bundle PATH]``
"""

from __future__ import annotations

import argparse
import io
import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw

from agent_bridge.viewer import timeline
from orchestrator.clock import FakeClock
from orchestrator.interrupt import run_main
from orchestrator.recorder import FileRecorder
from orchestrator.replay import Recording
from orchestrator.video import _CACHE, pixel_hash

W, H = 1280, 800
BACKGROUND = (0x2E, 0x4A, 0x62)


def desktop(step: int, *, busy: bool) -> Image.Image:
    """A synthetic desktop: an xterm-like window; busy ones scroll text and move a window."""
    image = Image.new("RGB", (W, H), BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.rectangle((40, 40, 680, 460), fill=(255, 255, 255), outline=(0, 0, 0))
    lines = 24
    first = step if busy else 0
    for row in range(lines):
        n = first + row
        draw.text(
            (48, 48 + row * 17), f"desk@deskvm:~$ ls -l /usr/lib/x86_64 | line {n:06d}", fill=0
        )
    if busy:
        x = 700 + (step * 23) % 400
        y = 120 + (step * 11) % 500
        draw.rectangle((x, y, x + 300, y + 200), fill=(230, 230, 210), outline=(0, 0, 0))
        draw.text((x + 10, y + 10), f"window {step}", fill=0)
    return image


def png_bytes(image: Image.Image, level: int) -> int:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=level)
    return len(buf.getvalue())


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def record_minute(root: Path, *, busy: bool, fps: float, input_every_s: float) -> dict[str, float]:
    """One minute of capture at ``fps`` with an input still every ``input_every_s``."""
    clock = FakeClock()
    bundle = root / ("busy" if busy else "idle")
    recorder = FileRecorder(bundle, clock, {"session_id": "bench"})
    frames = int(60 * fps)
    png1 = png6 = 0
    last = None
    encode_cpu = 0.0
    encoded = skipped = 0
    hash_cpu = 0.0
    next_input = 0.0
    for i in range(frames):
        image = desktop(i if busy else 0, busy=busy)
        t0 = cpu_s()
        pixels = pixel_hash(image)
        t1 = cpu_s()
        hash_cpu += t1 - t0
        if pixels != last:
            recorder.add_capture(image, pts_ns=clock.monotonic_ns(), pixels=pixels)
            encode_cpu += cpu_s() - t1
            encoded += 1
            last = pixels
        else:
            skipped += 1
        png1 += png_bytes(image, 1)
        if i < 20 or i % 10 == 0:  # level 6 is slow: sample and scale
            png6 += png_bytes(image, 6) * (1 if i < 20 else 10)
        if i / fps >= next_input:
            recorder.append("input", {"action": {"action": "click", "x": 10, "y": 10}})
            buf = io.BytesIO()
            image.save(buf, format="PNG", compress_level=1)
            recorder.add_frame(buf.getvalue(), pts_ns=clock.monotonic_ns(), reason="input")
            next_input += input_every_s
        clock.advance(1 / fps)
    recorder.close()
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    video = sum(p.stat().st_size for p in (bundle / "video").iterdir())
    stills = sum(p.stat().st_size for p in (bundle / "frames").iterdir())
    return {
        "total": total, "video": video, "stills": stills, "png1": png1,
        "png6": png6 * frames / max(1, min(frames, 20 + (frames - 20) // 10 * 10)),
        "frames": frames, "encoded": encoded, "skipped": skipped,
        "hash_ms": 1000 * hash_cpu / frames,
        "encode_ms": 1000 * encode_cpu / max(1, encoded),
    }  # fmt: skip


def real_bundle(path: Path, *, fps: float) -> None:
    """Bytes per minute of a real recording from ``ready`` to close, against a PNG for
    every capture tick (``fps``) over the same span."""
    recording = Recording(path)
    ready = next(
        e["t_ns"]
        for e in recording.events
        if e["kind"] == "lifecycle" and e["data"]["event"] == "ready"
    )
    span_s = max((recording.events[-1]["t_ns"] - ready) / 1e9, 1e-9)
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix != ".log")
    captures = [e for e in recording.events if e["kind"] == "frame" and "video" in e["data"]]
    sizes = [png_bytes(recording.frame_image(int(e["seq"])), 1) for e in captures]
    naive = statistics.mean(sizes) * span_s * fps if sizes else 0.0
    print(
        f"\nreal recording {path.name}: {span_s:.1f} s from ready to close, {len(captures)} "
        f"changed frames captured at {fps:g} fps"
    )
    print(f"  as recorded (no logs)  {total / span_s * 60 / 1e6:8.2f} MB/min")
    print(f"  PNG per capture tick   {naive / span_s * 60 / 1e6:8.2f} MB/min (level 1)")


def seek_bench(root: Path, *, minutes: float, fps: float) -> None:
    clock = FakeClock()
    bundle = root / "hour"
    recorder = FileRecorder(bundle, clock, {"session_id": "bench-hour"})
    frames = int(minutes * 60 * fps)
    t_build = time.perf_counter()
    for i in range(frames):
        image = desktop(i, busy=True)
        recorder.add_capture(image, pts_ns=clock.monotonic_ns(), pixels=pixel_hash(image))
        if i % max(1, int(5 * fps)) == 0:  # an input every 5 s
            recorder.append("input", {"action": {"action": "click", "x": 100, "y": 100}})
            recorder.append("injected", {"events": ["abs 100 100", "btn down left", "btn up left"]})
            recorder.append("result", {"action": "click"})
        clock.advance(1 / fps)
    recorder.close()
    build_s = time.perf_counter() - t_build
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    t0 = time.perf_counter()
    recording = Recording(bundle)
    open_s = time.perf_counter() - t0
    rng = random.Random(5)
    cold, warm = [], []
    for _ in range(30):
        seq = rng.randrange(len(recording.events))
        _CACHE.clear()
        t0 = time.perf_counter()
        frame = recording.frame_seq_for_event(seq)
        assert frame is not None
        recording.frame_png(frame)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        recording.frame_png(frame)
        warm.append(time.perf_counter() - t0)
    print(
        f"\nseek in a synthetic {minutes:g}-minute recording ({frames} busy frames at {fps:g} fps, "
        f"{len(recording.events)} events, {size / 1e6:.1f} MB, built in {build_s:.0f} s)"
    )
    print(f"  open (parse events, index frames)     {open_s * 1000:8.1f} ms")
    t0 = time.perf_counter()
    body = json.dumps(timeline(recording))
    print(
        f"  viewer timeline.json (build + encode) {(time.perf_counter() - t0) * 1000:8.1f} ms,"
        f" {len(body) / 1e6:.1f} MB"
    )
    print(
        f"  random event -> PNG, cold segment     median {statistics.median(cold) * 1000:6.1f} ms"
        f"   max {max(cold) * 1000:6.1f} ms"
    )
    print(
        f"  random event -> PNG, segment cached   median {statistics.median(warm) * 1000:6.1f} ms"
        f"   max {max(warm) * 1000:6.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="length of the seek test")
    parser.add_argument("--fps", type=float, default=1.0, help="capture rate of the seek test")
    parser.add_argument("--rate", type=float, default=2.0, help="capture rate, bytes test")
    parser.add_argument("--bundle", type=Path, help="a real recording to measure too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"bytes per minute at {args.rate:g} fps, 1280x800, an input still every 5 s")
        print(f"{'desktop':8} {'recorded':>12} {'(video':>10} {'stills)':>10} "
              f"{'PNG/frame L1':>13} {'PNG/frame L6':>13} {'ratio L1':>9}")  # fmt: skip
        results = {}
        for busy in (False, True):
            r = record_minute(root, busy=busy, fps=args.rate, input_every_s=5.0)
            results[busy] = r
            mb = {k: r[k] / 1e6 for k in ("total", "video", "stills", "png1", "png6")}
            print(
                f"{'busy' if busy else 'idle':8} {mb['total']:9.2f} MB {mb['video']:7.2f} MB"
                f" {mb['stills']:7.2f} MB {mb['png1']:10.2f} MB {mb['png6']:10.2f} MB"
                f" {r['png1'] / r['total']:8.1f}x"
            )
        print("\nrecording CPU per frame (this process; screendump not included)")
        for busy, r in results.items():
            total_ms = r["hash_ms"] * r["frames"] + r["encode_ms"] * r["encoded"]
            per_frame_ms = total_ms / r["frames"]
            share2, share5 = per_frame_ms * 2 / 10, per_frame_ms * 5 / 10
            print(
                f"  {'busy' if busy else 'idle':5} hash {r['hash_ms']:5.1f} ms/frame, encode "
                f"{r['encode_ms']:5.1f} ms/changed frame ({r['encoded']} of {r['frames']}); "
                f"at 2 fps {share2:4.1f}% of a core, at 5 fps {share5:4.1f}%"
            )
        if args.bundle is not None:
            real_bundle(args.bundle, fps=args.rate)
        seek_bench(root, minutes=args.minutes, fps=args.fps)


if __name__ == "__main__":
    run_main(main)
