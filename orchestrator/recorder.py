"""The recorder seam: every input, result, frame and decision, appended before it acts.

A recording is a directory (the *bundle*)::

    manifest.json   session, image, display, wall-clock start, monotonic origin, status
    events.jsonl    one event per line (see :class:`Event`), hash-chained
    frames/         PNG stills referenced by ``frame`` events (``frames/000017.png``)

Each event line is canonical JSON with ``seq`` (0, 1, 2...), ``t_ns`` (``CLOCK_MONOTONIC``
nanoseconds), ``kind``, ``source``, ``data`` and ``hash`` =
``sha256(previous hash + canonical JSON of the event without "hash")`` (hex; the first
event chains from 64 zeros). Lines are flushed as written, so a crash leaves a readable
prefix. The recording stays after the session ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from orchestrator.clock import Clock
from orchestrator.errors import RecorderError

__all__ = [
    "FORMAT_VERSION",
    "GENESIS_HASH",
    "Event",
    "EventKind",
    "FileRecorder",
    "MemoryRecorder",
    "Recorder",
    "Source",
    "chain_hash",
]

FORMAT_VERSION = 1
GENESIS_HASH = "0" * 64

EventKind = Literal[
    "lifecycle", "input", "injected", "result", "error", "frame", "network", "marker"
]
Source = Literal["agent", "human", "qa", "system"]


def _canonical(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def chain_hash(previous: str, event_without_hash: Mapping[str, Any]) -> str:
    """``sha256(previous + canonical JSON)`` as hex: the recording's hash chain link."""
    digest = hashlib.sha256(previous.encode("ascii"))
    digest.update(_canonical(event_without_hash).encode("utf-8"))
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Event:
    """One recorded event.

    Attributes:
        seq: 0-based sequence number within the recording.
        t_ns: monotonic time of the event, ns.
        kind: what happened (see :data:`EventKind`).
        source: who caused it.
        data: kind-specific JSON object.
        hash: chain hash (hex).
    """

    seq: int
    t_ns: int
    kind: EventKind
    source: Source
    data: Mapping[str, Any]
    hash: str

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "t_ns": self.t_ns,
            "kind": self.kind,
            "source": self.source,
            "data": dict(self.data),
            "hash": self.hash,
        }


class Recorder(Protocol):
    """Append-only record of one session."""

    @property
    def path(self) -> Path | None:
        """The bundle directory, or ``None`` for recorders that keep nothing on disk."""
        ...

    def append(
        self, kind: EventKind, data: Mapping[str, Any], *, source: Source = "system"
    ) -> Event:
        """Append one event and flush it.

        Raises:
            RecorderError: the event could not be written (the action must not proceed).
        """
        ...

    def add_frame(
        self, png: bytes, *, pts_ns: int, reason: str, source: Source = "system"
    ) -> Event:
        """Store a PNG still and append the ``frame`` event that references it.

        Raises:
            RecorderError: the frame could not be written.
        """
        ...

    def close(self, *, status: str = "closed") -> None:
        """Finish the recording (idempotent)."""
        ...


class _ChainedLog:
    """Shared sequencing and hashing of both recorders."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._seq = 0
        self._head = GENESIS_HASH
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def _next(self, kind: EventKind, data: Mapping[str, Any], source: Source) -> Event:
        t_ns = self._clock.monotonic_ns()
        payload = dict(data)
        body = {"seq": self._seq, "t_ns": t_ns, "kind": kind, "source": source, "data": payload}
        return Event(self._seq, t_ns, kind, source, payload, chain_hash(self._head, body))

    def _commit(self, event: Event) -> None:
        self._seq += 1
        self._head = event.hash
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1


class MemoryRecorder(_ChainedLog):
    """In-package fake recorder: keeps events and frames in memory."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.events: list[Event] = []
        self.frames: dict[int, bytes] = {}
        self.closed_status: str | None = None

    @property
    def path(self) -> Path | None:
        return None

    def append(
        self, kind: EventKind, data: Mapping[str, Any], *, source: Source = "system"
    ) -> Event:
        with self._lock:
            event = self._next(kind, data, source)
            self.events.append(event)
            self._commit(event)
            return event

    def add_frame(
        self, png: bytes, *, pts_ns: int, reason: str, source: Source = "system"
    ) -> Event:
        with self._lock:
            event = self._next("frame", {"pts_ns": pts_ns, "reason": reason}, source)
            self.events.append(event)
            self.frames[event.seq] = png
            self._commit(event)
            return event

    def close(self, *, status: str = "closed") -> None:
        self.closed_status = status


class FileRecorder(_ChainedLog):
    """Writes a recording bundle to ``path`` (created; must not exist yet).

    Args:
        path: the bundle directory.
        clock: source of ``t_ns`` and the wall-clock start.
        manifest: session facts for ``manifest.json`` (session id, image, display...).

    Raises:
        RecorderError: the directory exists or cannot be created.
    """

    def __init__(self, path: Path, clock: Clock, manifest: Mapping[str, Any]) -> None:
        super().__init__(clock)
        self._path = path
        try:
            path.mkdir(parents=True, exist_ok=False)
            (path / "frames").mkdir()
            self._events = (path / "events.jsonl").open("a", encoding="utf-8")
        except OSError as exc:
            raise RecorderError(f"cannot create recording at {path}: {exc}") from exc
        self._manifest: dict[str, Any] = {
            "format": "deskvm-recording",
            "format_version": FORMAT_VERSION,
            **dict(manifest),
            "started_at": clock.wall().isoformat(),
            "monotonic_origin_ns": clock.monotonic_ns(),
            "status": "recording",
        }
        self._closed = False
        self._write_manifest()

    @property
    def path(self) -> Path:
        return self._path

    def _write_manifest(self) -> None:
        tmp = self._path / "manifest.json.tmp"
        tmp.write_text(json.dumps(self._manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self._path / "manifest.json")

    def _write(self, event: Event) -> None:
        try:
            self._events.write(_canonical(event.to_json()) + "\n")
            self._events.flush()
        except (OSError, ValueError) as exc:
            raise RecorderError(f"cannot append to {self._path / 'events.jsonl'}: {exc}") from exc
        self._commit(event)

    def append(
        self, kind: EventKind, data: Mapping[str, Any], *, source: Source = "system"
    ) -> Event:
        with self._lock:
            if self._closed:
                raise RecorderError("the recording is closed")
            event = self._next(kind, data, source)
            self._write(event)
            return event

    def add_frame(
        self, png: bytes, *, pts_ns: int, reason: str, source: Source = "system"
    ) -> Event:
        with self._lock:
            if self._closed:
                raise RecorderError("the recording is closed")
            name = f"frames/{self._seq:06d}.png"
            try:
                (self._path / name).write_bytes(png)
            except OSError as exc:
                raise RecorderError(f"cannot write frame {name}: {exc}") from exc
            data = {"file": name, "pts_ns": pts_ns, "reason": reason, "bytes": len(png)}
            event = self._next("frame", data, source)
            self._write(event)
            return event

    def close(self, *, status: str = "closed") -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._events.close()
            self._manifest.update(
                status=status,
                ended_at=self._clock.wall().isoformat(),
                event_count=self._seq,
                counts=dict(self.counts),
                chain_head=self._head,
            )
            self._write_manifest()
