"""Read a recording bundle back: summary and hash-chain verification.

See :mod:`orchestrator.recorder` for the format.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.errors import RecorderError
from orchestrator.recorder import GENESIS_HASH, chain_hash

__all__ = ["RecordingSummary", "read_events", "summarize"]


def read_events(bundle: Path) -> list[dict[str, Any]]:
    """Every complete event line of ``bundle/events.jsonl`` (a torn last line is skipped).

    Raises:
        RecorderError: not a recording bundle.
    """
    path = bundle / "events.jsonl"
    if not path.is_file():
        raise RecorderError(f"{bundle} is not a deskvm recording (no events.jsonl)")
    events = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            events.append(json.loads(line))
    return events


@dataclass(slots=True)
class RecordingSummary:
    """What ``deskvm replay info`` prints.

    Attributes:
        duration_s: from the first to the last event (monotonic).
        first_bad_seq: first event whose chain hash does not verify, ``None`` if all do.
    """

    manifest: dict[str, Any]
    events: int
    duration_s: float
    kinds: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    frames: int = 0
    frame_bytes: int = 0
    first_bad_seq: int | None = None


def summarize(bundle: Path) -> RecordingSummary:
    """Summarize a recording and verify its hash chain.

    Raises:
        RecorderError: not a recording bundle, or a line is not JSON.
    """
    try:
        manifest = json.loads((bundle / "manifest.json").read_text())
        events = read_events(bundle)
    except (OSError, ValueError) as exc:
        raise RecorderError(f"cannot read recording {bundle}: {exc}") from exc
    times = [e["t_ns"] for e in events]
    summary = RecordingSummary(
        manifest=manifest,
        events=len(events),
        duration_s=(max(times) - min(times)) / 1e9 if times else 0.0,
    )
    head = GENESIS_HASH
    for index, event in enumerate(events):
        body = {k: v for k, v in event.items() if k != "hash"}
        expected = chain_hash(head, body)
        if summary.first_bad_seq is None and (
            event.get("seq") != index or event["hash"] != expected
        ):
            summary.first_bad_seq = index
        head = event["hash"]
        summary.kinds[event["kind"]] += 1
        data = event.get("data", {})
        if event["kind"] == "input":
            summary.actions[data.get("action", {}).get("action", "?")] += 1
        elif event["kind"] == "error":
            summary.errors[data.get("code", "?")] += 1
        elif event["kind"] == "frame":
            summary.frames += 1
            summary.frame_bytes += int(data.get("bytes", 0))
    return summary
