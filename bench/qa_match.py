"""Costs of the visual checks on one 1280x800 frame: matching, stillness, change, OCR.

Input: the example suite's references (examples/qa/refs/), which are frames of the small
image (xterm + an xmessage dialog). Prints, per operation, the median and worst wall time
over ``--repeat`` runs, single-threaded Python in this process (OpenCV may use its own
threads), with the host's load average next to the figures.

A wait's poll costs a screenshot (about 65 ms over the WebSocket at 1280x800, measured
with the small image under TCG) plus the matching below; OCR polls are dominated by
tesseract.

Usage: ``python bench/qa_match.py [--repeat 20]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from agent_bridge.qa.match import Reference, changed, find, similarity
from agent_bridge.qa.model import Box
from agent_bridge.qa.ocr import read_words
from agent_bridge.qa.refs import RefStore
from orchestrator.interrupt import run_main

REFS = Path(__file__).resolve().parents[1] / "examples" / "qa" / "refs"


def measure(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000, max(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    store = RefStore(REFS)
    dialog_frame = store.load("save_dialog").pixels
    terminal_frame = store.load("terminal").pixels
    refs = {name: store.load(name) for name in ("terminal", "save_dialog", "yes_button")}
    noise = Reference(
        "noise", np.random.default_rng(0).integers(0, 255, (60, 200, 3), dtype=np.uint8)
    )
    d, t = dialog_frame, terminal_frame
    cases: list[tuple[str, Callable[[], object]]] = [
        ("find terminal title (769x17, margin 20 px)", lambda: find(d, refs["terminal"])),
        ("find save_dialog (125x77, whole screen)", lambda: find(d, refs["save_dialog"])),
        ("find yes_button crop (33x21, whole screen)", lambda: find(d, refs["yes_button"])),
        ("find 200x60 not on screen (whole screen)", lambda: find(d, noise)),
        ("changed (whole screen)", lambda: changed(t, d)),
        ("similarity / SSIM (whole screen, halved)", lambda: similarity(t, d)),
        ("OCR terminal region (770x460)", lambda: read_words(d, Box(40, 58, 770, 460))),
        ("OCR whole screen", lambda: read_words(d)),
    ]
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; cores: {os.cpu_count()}")
    print(f"{'operation':<46} {'median ms':>10} {'max ms':>10}")
    for name, fn in cases:
        repeat = max(3, args.repeat // 5) if name.startswith("OCR") else args.repeat
        median, worst = measure(fn, repeat)
        print(f"{name:<46} {median:>10.1f} {worst:>10.1f}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    run_main(main)
