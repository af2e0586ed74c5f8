"""Format v2 of the recording bundle: golden bytes, the chain, secrets, tamper detection."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from orchestrator.clock import FakeClock
from orchestrator.recorder import FORMAT_VERSION, GENESIS_HASH, chain_hash
from orchestrator.replay import verify
from tests.recording.conftest import IMAGE, record

GOLDEN = Path(__file__).parent.parent / "golden" / "recording-v2"
KEY = b"k" * 32


def _normalized(bundle: Path) -> dict[str, Any]:
    """Events and manifest with what depends on zlib/Pillow versions blanked out.

    PNG and H.264 bytes (and so sha256s, sizes, and every chain hash after the first
    frame) differ between zlib/x264 builds; the structure, order, times and values must
    not.
    """
    events = []
    for line in (bundle / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        event.pop("hash")
        data = event["data"]
        if event["kind"] in ("frame", "media", "result"):
            for key in ("sha256", "bytes", "pixels"):
                if key in data:
                    data[key] = f"<{key}>"
        events.append(event)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["chain_head"] = "<head>"
    manifest["media"] = {name: "<sha256>" for name in manifest["media"]}
    return {"manifest": manifest, "events": events}


def test_golden_bundle(tmp_path: Path) -> None:
    # capture_fps so low that the loop never fires: the stills at input moments and at
    # close (which also feed the video) are in, deterministically.
    bundle = record(tmp_path / "rec", clock=FakeClock(), secret_key=KEY, capture_fps=0.001)
    got = _normalized(bundle)
    golden = GOLDEN / "normalized.json"
    if os.environ.get("DESKVM_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(golden.read_text())
    assert got["manifest"]["format_version"] == FORMAT_VERSION == 2
    assert verify(bundle).ok


def test_manifest_fields(tmp_path: Path) -> None:
    bundle = record(tmp_path / "rec")
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["format"] == "deskvm-recording"
    assert m["image"] == {"name": IMAGE.name, "content_hash": IMAGE.content_hash}
    assert m["display"] == {"width": 640, "height": 400}
    assert m["status"] == "closed"
    assert isinstance(m["monotonic_origin_ns"], int) and m["started_at"].endswith("+00:00")
    lines = (bundle / "events.jsonl").read_text().splitlines()
    assert m["event_count"] == len(lines) == sum(m["counts"].values())
    assert m["chain_head"] == json.loads(lines[-1])["hash"]
    assert set(m["media"]) == {f"frames/{p.name}" for p in (bundle / "frames").iterdir()}


def test_chain_hash_golden() -> None:
    # sha256("0"*64 + canonical JSON), the canonical form: sorted keys, no spaces, UTF-8.
    body = {"seq": 0, "t_ns": 5, "kind": "marker", "source": "qa", "data": {"b": 1, "a": "é"}}
    # = sha256('0'*64 + '{"data":{"a":"é","b":1},"kind":"marker","seq":0,"source":"qa","t_ns":5}')
    assert chain_hash(GENESIS_HASH, body) == (
        "916a4ef53554dc3ae1bfd952102309baa06737e4ff55cfac96c5e808163af462"
    )


def test_secret_text_is_only_a_length_and_keyed_hash(tmp_path: Path) -> None:
    a = record(tmp_path / "a")
    b = record(tmp_path / "b")
    for bundle in (a, b):
        blob = b"".join(p.read_bytes() for p in bundle.rglob("*") if p.is_file())
        assert b"hunter2" not in blob.replace(b"echo hunter2", b"")
        log = (bundle / "guest.log").read_bytes()
        assert b"hunter2" not in log and b"[secret length=7 hmac_sha256=" in log

    def secret_of(bundle: Path) -> dict[str, Any]:
        for line in (bundle / "events.jsonl").read_text().splitlines():
            event = json.loads(line)
            action = event["data"].get("action") or {}
            if event["kind"] == "input" and action.get("secret"):
                return dict(action)
        raise AssertionError("no secret input")

    sa, sb = secret_of(a), secret_of(b)
    assert sa["text"] is None and sa["length"] == 7
    # The key is per recording and not stored: the same secret hashes differently.
    assert sa["hmac_sha256"] != sb["hmac_sha256"]
    injected = [
        json.loads(line)
        for line in (a / "events.jsonl").read_text().splitlines()
        if '"injected"' in line and '"secret":true' in line
    ]
    assert injected and injected[0]["data"]["events"] is None


# --- tampering -----------------------------------------------------------------------


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return record(tmp_path / "rec")


def _lines(bundle: Path) -> list[bytes]:
    return (bundle / "events.jsonl").read_bytes().splitlines(keepends=True)


def _write(bundle: Path, lines: list[bytes]) -> None:
    (bundle / "events.jsonl").write_bytes(b"".join(lines))


def test_untouched_bundle_verifies(bundle: Path) -> None:
    report = verify(bundle)
    assert report.ok and report.first_bad_seq is None and report.events == len(_lines(bundle))


@pytest.mark.parametrize("line", [0, 3, 9])
def test_flipped_byte_is_found_at_its_event(bundle: Path, line: int) -> None:
    lines = _lines(bundle)
    raw = bytearray(lines[line])
    i = raw.index(b'"t_ns":') + 8
    raw[i] = ord("7") if raw[i] != ord("7") else ord("8")
    lines[line] = bytes(raw)
    _write(bundle, lines)
    report = verify(bundle)
    assert not report.ok and report.first_bad_seq == line, report


def test_every_single_byte_flip_is_found(bundle: Path) -> None:
    original = (bundle / "events.jsonl").read_bytes()
    first_line_end = original.index(b"\n")
    for offset in range(0, len(original), 97):
        raw = bytearray(original)
        raw[offset] ^= 0x01
        (bundle / "events.jsonl").write_bytes(bytes(raw))
        report = verify(bundle)
        assert not report.ok, f"flip at byte {offset} went unnoticed"
        expected_line = original.count(b"\n", 0, offset)
        if offset > first_line_end or raw[offset] != ord("\n"):
            assert report.first_bad_seq in (expected_line, expected_line + 1), (offset, report)


def test_dropped_line(bundle: Path) -> None:
    lines = _lines(bundle)
    del lines[5]
    _write(bundle, lines)
    report = verify(bundle)
    assert report.first_bad_seq == 5 and "seq" in report.problem


def test_swapped_lines(bundle: Path) -> None:
    lines = _lines(bundle)
    lines[4], lines[6] = lines[6], lines[4]
    _write(bundle, lines)
    assert verify(bundle).first_bad_seq == 4


def test_truncated_mid_line(bundle: Path) -> None:
    raw = (bundle / "events.jsonl").read_bytes()
    (bundle / "events.jsonl").write_bytes(raw[: len(raw) - 30])
    n = raw.count(b"\n") - 1
    report = verify(bundle)
    assert not report.ok and report.first_bad_seq == n and report.torn_tail_bytes > 0


def test_truncated_at_a_line_boundary(bundle: Path) -> None:
    lines = _lines(bundle)
    _write(bundle, lines[:-3])
    report = verify(bundle)
    assert not report.ok and report.first_bad_seq == len(lines) - 3
    assert "truncated" in report.problem


def test_last_line_changed_and_rehashed_is_caught_by_the_manifest(bundle: Path) -> None:
    lines = _lines(bundle)
    prev = json.loads(lines[-2])["hash"]
    last = json.loads(lines[-1])
    last["data"]["reason"] = "forged"
    body = {k: v for k, v in last.items() if k != "hash"}
    last["hash"] = chain_hash(prev, body)
    lines[-1] = (json.dumps(last, sort_keys=True, separators=(",", ":")) + "\n").encode()
    _write(bundle, lines)
    report = verify(bundle)
    assert not report.ok and report.first_bad_seq == len(lines) - 1


def test_changed_still_is_found_at_the_first_event_using_it(bundle: Path) -> None:
    still = sorted((bundle / "frames").iterdir())[1]
    raw = bytearray(still.read_bytes())
    raw[-20] ^= 0xFF
    still.write_bytes(bytes(raw))
    report = verify(bundle)
    first_use = next(
        i
        for i, line in enumerate(_lines(bundle))
        if f'"file":"frames/{still.name}"'.encode() in line
    )
    assert report.first_bad_seq == first_use and still.name in report.problem


def test_manifest_image_hash_cannot_be_swapped(bundle: Path) -> None:
    m = json.loads((bundle / "manifest.json").read_text())
    m["image"]["content_hash"] = "ff" * 32
    (bundle / "manifest.json").write_text(json.dumps(m))
    report = verify(bundle)
    assert not report.ok and "image hash" in report.problem
