"""Recording storage: directories and S3 (moto on loopback), shipping while recording,
fetching back, sealing a recording whose writer died, ``deskvm replay`` on a URL."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent_bridge.cli import app as cli_app
from orchestrator.clock import FakeClock
from orchestrator.errors import ConfigError, StorageError
from orchestrator.replay import verify
from orchestrator.storage import (
    BundleShipper,
    LocalStore,
    S3Store,
    fetch_bundle,
    open_store,
    seal_truncated,
    split_recording_url,
)
from tests.recording.conftest import ACTIONS, SESSION_ID, record


def _stores(tmp_path: Path, bucket: str) -> list[object]:
    return [LocalStore(tmp_path / "store"), open_store(f"s3://{bucket}/runs/a")]


def test_urls() -> None:
    assert isinstance(open_store("/srv/rec"), LocalStore)
    assert open_store("file:///srv/rec").url == "/srv/rec"  # type: ignore[attr-defined]
    assert split_recording_url("s3://b/p/q/abc") == ("s3://b/p/q", "abc")
    assert split_recording_url("/srv/rec/abc/") == ("/srv/rec", "abc")
    for bad in ("http://x/y", "s3:///p", "ftp://a/b"):
        with pytest.raises(ConfigError):
            open_store(bad)
    for bad in ("s3://", "s3://bucket"):
        with pytest.raises(ConfigError):
            split_recording_url(bad)


def test_store_roundtrip(tmp_path: Path, bucket: str) -> None:
    for store in _stores(tmp_path, bucket):
        store.put("s1/a.txt", b"one")  # type: ignore[attr-defined]
        (tmp_path / "f.bin").write_bytes(b"\x00" * 10)
        store.put_file("s1/frames/f.bin", tmp_path / "f.bin")  # type: ignore[attr-defined]
        assert store.get("s1/a.txt") == b"one"  # type: ignore[attr-defined]
        assert store.list("s1/") == ["s1/a.txt", "s1/frames/f.bin"]  # type: ignore[attr-defined]
        with pytest.raises(StorageError) as info:
            store.get("s1/missing")  # type: ignore[attr-defined]
        assert info.value.code == "storage_not_found"
        with pytest.raises(StorageError):
            store.put("../escape", b"x")  # type: ignore[attr-defined]


def test_s3_errors_are_translated(s3_endpoint: str) -> None:
    store = S3Store("no-such-bucket-i15", "p")
    with pytest.raises(StorageError) as info:
        store.put("k", b"x")
    assert "no-such-bucket-i15" in info.value.message


def _bundle_files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_ship_while_recording_then_close(tmp_path: Path, bucket: str) -> None:
    """Pieces while running (finished segments only, complete lines only), the closed
    bundle at the end: the stored copy is byte-identical and verifies."""
    store = open_store(f"s3://{bucket}/deskvm")
    bundle = tmp_path / "rec"
    shipper = BundleShipper(bundle, store, SESSION_ID)
    seen: list[tuple[int, str | None]] = []
    held_back: list[str] = []
    clock = FakeClock()

    def open_segment() -> bool:
        finished = (bundle / "events.jsonl").read_text().count('"kind":"media"')
        return len(list((bundle / "video").glob("*.mp4"))) > finished

    def between() -> None:
        clock.advance(4.0)  # past the 5 s segment length every other action
        # Stills reach the video on the capture loop's next turn (real time, 1/capture_fps).
        deadline = time.monotonic() + 5
        while not open_segment() and time.monotonic() < deadline:
            time.sleep(0.02)
        report = shipper.ship()
        seen.append((report.events, report.manifest_status))
        stored = store.list(SESSION_ID + "/video/")
        events = store.get(f"{SESSION_ID}/events.jsonl")
        finished = {
            json.loads(line)["data"]["file"]
            for line in events.splitlines()
            if b'"kind":"media"' in line
        }
        # Only finished segments (hash-chained by a media event) are shipped while running.
        shipped = {k.removeprefix(SESSION_ID + "/") for k in stored}
        assert shipped <= finished
        on_disk = {f"video/{p.name}" for p in (bundle / "video").iterdir()}
        held_back.extend(on_disk - shipped)
        assert events.endswith(b"\n")

    record(bundle, clock=clock, capture_fps=2, segment_s=5.0, between=between)
    assert all(status == "recording" for _, status in seen)
    assert held_back, "no segment was ever being written during a ship"
    assert store.list(SESSION_ID + "/video/"), "no finished segment was shipped while running"
    assert seen[-1][0] > seen[0][0]
    final = shipper.ship(final=True)
    assert final.manifest_status == "closed"
    assert shipper.url == f"s3://{bucket}/deskvm/{SESSION_ID}"
    fetched = fetch_bundle(shipper.url, tmp_path / "fetched")
    assert _bundle_files(fetched) == _bundle_files(bundle)
    assert verify(fetched).ok
    # Nothing new: nothing re-sent.
    assert shipper.ship(final=True).files == 0


def test_fetch_missing(tmp_path: Path, bucket: str) -> None:
    with pytest.raises(StorageError) as info:
        fetch_bundle(f"s3://{bucket}/deskvm/nothing", tmp_path / "x")
    assert info.value.code == "storage_not_found"


def test_seal_truncated(tmp_path: Path, bucket: str) -> None:
    """A writer that died: the stored prefix is sealed 'truncated' and verifies as far
    as it goes (exit 3 from deskvm replay verify: "intact up to event N, truncated"); a
    torn last line is dropped."""
    store = open_store(f"s3://{bucket}/deskvm")
    bundle = tmp_path / "rec"
    shipper = BundleShipper(bundle, store, SESSION_ID)
    shipped: list[int] = []

    def between() -> None:
        if len(shipped) < 3:
            shipped.append(shipper.ship().events)

    record(bundle, between=between)
    # The node died after the third ship: the stored copy is a prefix, status recording.
    events = store.get(f"{SESSION_ID}/events.jsonl")
    store.put(f"{SESSION_ID}/events.jsonl", events + b'{"seq": 99, "torn')
    sealed = seal_truncated(
        store, SESSION_ID, reason="session_lost: node n2 died", ended_at="2026-01-01T00:00:00"
    )
    assert sealed["status"] == "truncated"
    assert sealed["event_count"] == shipped[-1]
    assert sealed["truncated_reason"] == "session_lost: node n2 died"
    fetched = fetch_bundle(f"s3://{bucket}/deskvm/{SESSION_ID}", tmp_path / "fetched")
    report = verify(fetched)
    assert report.ok and report.closed and report.first_bad_seq is None
    assert report.events == shipped[-1]
    assert report.truncated == {
        "last_intact_seq": shipped[-1] - 1,
        "reason": "session_lost: node n2 died",
    }
    # Sealing again changes nothing.
    assert seal_truncated(store, SESSION_ID, reason="again", ended_at="x")["truncated_reason"] == (
        "session_lost: node n2 died"
    )
    result = CliRunner().invoke(cli_app, ["replay", "verify", f"s3://{bucket}/deskvm/{SESSION_ID}"])
    assert result.exit_code == 3, result.output
    assert f"intact up to event {shipped[-1] - 1}, truncated" in result.output


def test_replay_cli_reads_s3_and_directories(tmp_path: Path, bucket: str) -> None:
    bundle = record(tmp_path / "rec")
    local = LocalStore(tmp_path / "store")
    BundleShipper(bundle, local, SESSION_ID).ship(final=True)
    BundleShipper(bundle, open_store(f"s3://{bucket}/p"), SESSION_ID).ship(final=True)
    runner = CliRunner()
    for url in (
        f"s3://{bucket}/p/{SESSION_ID}",
        f"file://{tmp_path}/store/{SESSION_ID}",
        str(tmp_path / "store" / SESSION_ID),
    ):
        result = runner.invoke(cli_app, ["replay", "info", url])
        assert result.exit_code == 0, result.output
        assert SESSION_ID in result.output and "intact" in result.output
        assert "click" in result.output
        result = runner.invoke(cli_app, ["replay", "verify", url])
        assert result.exit_code == 0, result.output
    out = tmp_path / "steps"
    result = runner.invoke(
        cli_app, ["replay", "export", f"s3://{bucket}/p/{SESSION_ID}", "--jsonl", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert len((out / "steps.jsonl").read_text().splitlines()) == len(ACTIONS)
    result = runner.invoke(cli_app, ["replay", "info", f"s3://{bucket}/p/nothing"])
    assert result.exit_code == 1 and "storage_not_found" in result.output
