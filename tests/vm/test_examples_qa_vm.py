"""The example QA suite (examples/qa/) on real VMs, and the failure report it produces.

Runs ``pytest examples/qa --runxfail`` in a subprocess (its own in-process bridge on the
libvirt backend, two sessions): the passing test drives xmessage by reference and OCR;
the test that fails on purpose must fail with a MatchTimeout whose report (report.html,
PNGs, JUnit properties and attachments, the recording kept with the frame it points at)
is checked here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "examples" / "qa"
FAILING = "test_the_wrong_dialog_fails"
PASSING = "test_save_changes_yes"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    where = tmp_path_factory.mktemp("examples-qa")
    env = {**os.environ, "CI": "1"}  # OCR is required: a missing tesseract fails the run
    env.pop("DESKVM_TEST_ARTIFACTS", None)
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", str(SUITE), "--runxfail",
            "-p", "no:cacheprovider", "-p", "no:randomly",
            f"--rootdir={ROOT}", f"--deskvm-artifacts={where / 'artifacts'}",
            "--deskvm-record=retain-on-failure",
            f"--junitxml={where / 'junit.xml'}", "-o", "junit_logging=system-out",
            "-o", "junit_family=xunit2",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    return result, where


def cases(path: Path) -> dict[str, ET.Element]:
    return {case.get("name", ""): case for case in ET.parse(path).getroot().iter("testcase")}


def properties(case: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def test_the_example_suite_passes_but_the_failure_on_purpose(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, where = run
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert re.search(r"\b1 failed, 1 passed\b", result.stdout), output
    assert f"FAILED examples/qa/test_save_dialog.py::{FAILING}" in result.stdout, output
    junit = cases(where / "junit.xml")
    assert junit[PASSING].find("failure") is None and junit[PASSING].find("error") is None
    failure = junit[FAILING].find("failure")
    assert failure is not None
    assert "MatchTimeout" in (failure.get("message") or "") + (failure.text or "")
    # a passing test's recording is not kept (retain-on-failure) and it has no report
    assert not (where / "artifacts" / PASSING).exists()
    assert "deskvm_recording" not in properties(junit[PASSING])


def test_the_failure_report_shows_expected_actual_and_where(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, where = run
    case = cases(where / "junit.xml")[FAILING]
    props = properties(case)
    report_dir = where / "artifacts" / FAILING
    assert props["deskvm_report"] == str(report_dir / "report.html"), result.stdout
    assert props["deskvm_check"] == "reference"
    # the best candidate is the other dialog, in the same place, a little wider
    assert 0.3 < float(props["deskvm_best_score"]) < 0.95
    x0, y0, x1, y1 = (int(v) for v in props["deskvm_best_box"].split(","))
    assert 500 <= x0 < 640 < x1 <= 780 and 340 <= y0 < 420 < y1 <= 480, props
    for role in ("expected", "actual", "diff", "side_by_side", "last_frame"):
        assert Path(props[f"deskvm_{role}"]).is_file(), role
    attachments = re.findall(r"\[\[ATTACHMENT\|(.+?)\]\]", case.findtext("system-out") or "")
    assert str(report_dir / "report.html") in attachments
    assert str(report_dir / "side-by-side.png") in attachments

    # the frame number and time point at a frame of the kept recording
    recording = Path(props["deskvm_recording"])
    seq, t_s = int(props["deskvm_frame_seq"]), float(props["deskvm_t_s"])
    manifest = json.loads((recording / "manifest.json").read_text())
    events = [json.loads(line) for line in (recording / "events.jsonl").read_text().splitlines()]
    assert events[seq]["kind"] == "frame"
    pts_s = (events[seq]["data"]["pts_ns"] - manifest["monotonic_origin_ns"]) / 1e9
    assert pts_s == pytest.approx(t_s, abs=1e-3)
    assert (report_dir / "console.log").is_file() and (report_dir / "guest.log").is_file()

    # the page is self-contained and says it all
    html = (report_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4
    for text in ("best score", "threshold 0.95", "refs/save_dialog.png", str(recording),
                 f"frame {seq} at", "deskvm replay frames", "difference"):  # fmt: skip
        assert text in html, text
    # what the test saw when it failed: the other dialog ("Quit without saving?"), wider
    with Image.open(props["deskvm_last_frame"]) as last:
        assert last.size == (1280, 800)
        dialog = np.asarray(last.convert("RGB").crop((x0, y0, x1, y1)))
        assert len(np.unique(dialog.reshape(-1, 3), axis=0)) > 2
    with Image.open(report_dir / "side-by-side.png") as image:
        assert image.width > 2 * image.height
