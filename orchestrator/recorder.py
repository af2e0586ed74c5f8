"""The recorder seam: every input, result, frame and decision, appended before it acts.

A recording is a directory (the *bundle*, format version 2, specified in
``docs/recording.md``)::

    manifest.json   session, image, display, wall-clock start, monotonic origin, status;
                    on close: counts, chain head, sha256 of every media file
    events.jsonl    one event per line (see :class:`Event`), hash-chained
    frames/         PNG stills referenced by ``frame`` events (``frames/000017.png``);
                    a still identical to an earlier one is referenced, not stored again
    video/          continuous capture as H.264 MP4 segments (:mod:`orchestrator.video`)

Each event line is canonical JSON with ``seq`` (0, 1, 2...), ``t_ns`` (``CLOCK_MONOTONIC``
nanoseconds), ``kind``, ``source``, ``data`` and ``hash`` =
``sha256(previous hash + canonical JSON of the event without "hash")`` (hex; the first
event chains from 64 zeros). Lines are flushed as written, so a crash leaves a readable
prefix. The recording stays after the session ends.

Secret text is never written: :meth:`Recorder.secret_digest` gives its length and an
HMAC-SHA256 under a random per-recording key that lives only in memory (so equal secrets
within one recording can be matched, but nothing in the bundle can confirm a guess).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from PIL import Image

from orchestrator.clock import Clock
from orchestrator.errors import RecorderError
from orchestrator.video import SegmentWriter, file_sha256

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

FORMAT_VERSION = 2
GENESIS_HASH = "0" * 64

EventKind = Literal[
    "lifecycle", "input", "injected", "result", "error", "frame", "network", "marker", "media",
    "approval",
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
    """Append-only record of one session.

    Attributes:
        origin_ns: the monotonic clock at creation; times "in the recording" (``t_s``)
            are seconds from it (the manifest's ``monotonic_origin_ns``).
    """

    origin_ns: int

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

        A still byte-identical to an earlier one is referenced, not written again.

        Raises:
            RecorderError: the frame could not be written.
        """
        ...

    def add_capture(self, image: Image.Image, *, pts_ns: int, pixels: str) -> Event:
        """Add one continuously captured frame to the video and append its ``frame`` event.

        Args:
            image: the frame as captured (display pixels).
            pts_ns: monotonic capture time, ns.
            pixels: :func:`orchestrator.video.pixel_hash` of ``image`` (the caller has
                already skipped unchanged frames with it).

        Raises:
            RecorderError: the frame could not be encoded or the event not written.
        """
        ...

    def secret_digest(self, text: str) -> dict[str, Any]:
        """``{"length": n, "hmac_sha256": hex}`` of a secret under this recording's key.

        The key is random per recording and never written anywhere.
        """
        ...

    def tick(self, now_ns: int) -> None:
        """Finish the open video segment if it began ``segment_s`` or more before
        ``now_ns`` (so that an idle screen's last frames reach a finished file too).

        Raises:
            RecorderError: the segment could not be finished.
        """
        ...

    def close(self, *, status: str = "closed") -> None:
        """Finish the recording (idempotent)."""
        ...


class _ChainedLog:
    """Shared sequencing, hashing and secret keying of both recorders."""

    def __init__(self, clock: Clock, secret_key: bytes | None = None) -> None:
        self._clock = clock
        self.origin_ns = clock.monotonic_ns()
        self._seq = 0
        self._head = GENESIS_HASH
        self._lock = threading.Lock()
        self._secret_key = secret_key if secret_key is not None else os.urandom(32)
        self.counts: dict[str, int] = {}

    def secret_digest(self, text: str) -> dict[str, Any]:
        mac = hmac.new(self._secret_key, text.encode("utf-8"), hashlib.sha256).hexdigest()
        return {"length": len(text), "hmac_sha256": mac}

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
    """In-package fake recorder: keeps events, stills and captured frames in memory."""

    def __init__(self, clock: Clock, *, secret_key: bytes | None = None) -> None:
        super().__init__(clock, secret_key)
        self.events: list[Event] = []
        self.frames: dict[int, bytes] = {}
        self.captures: dict[int, Image.Image] = {}
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

    def add_capture(self, image: Image.Image, *, pts_ns: int, pixels: str) -> Event:
        with self._lock:
            data = {"pts_ns": pts_ns, "reason": "capture", "pixels": pixels}
            event = self._next("frame", data, "system")
            self.events.append(event)
            self.captures[event.seq] = image.copy()
            self._commit(event)
            return event

    def tick(self, now_ns: int) -> None:
        return None

    def close(self, *, status: str = "closed") -> None:
        self.closed_status = status


class FileRecorder(_ChainedLog):
    """Writes a recording bundle to ``path`` (created; must not exist yet).

    Args:
        path: the bundle directory.
        clock: source of ``t_ns`` and the wall-clock start.
        manifest: session facts for ``manifest.json`` (session id, image, display...).
        segment_s: length of a video segment in seconds of capture (a crash loses at most
            the segment being written).
        secret_key: HMAC key for secret text (default: 32 random bytes; pass one only in
            tests that need reproducible bytes, it must never be stored).

    Raises:
        RecorderError: the directory exists or cannot be created.
    """

    def __init__(
        self,
        path: Path,
        clock: Clock,
        manifest: Mapping[str, Any],
        *,
        segment_s: float = 10.0,
        secret_key: bytes | None = None,
    ) -> None:
        super().__init__(clock, secret_key)
        self._path = path
        self._segment_ns = int(segment_s * 1e9)
        try:
            path.mkdir(parents=True, exist_ok=False)
            (path / "frames").mkdir()
            (path / "video").mkdir()
            self._events = (path / "events.jsonl").open("a", encoding="utf-8")
        except OSError as exc:
            raise RecorderError(f"cannot create recording at {path}: {exc}") from exc
        self._manifest: dict[str, Any] = {
            "format": "deskvm-recording",
            "format_version": FORMAT_VERSION,
            **dict(manifest),
            "started_at": clock.wall().isoformat(),
            "monotonic_origin_ns": self.origin_ns,
            "status": "recording",
        }
        self._closed = False
        self._stills: dict[str, str] = {}  # sha256 of PNG bytes -> file
        self._segment: SegmentWriter | None = None
        self._segments = 0
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
            sha = hashlib.sha256(png).hexdigest()
            name = self._stills.get(sha)
            if name is None:
                name = f"frames/{self._seq:06d}.png"
                try:
                    with (self._path / name).open("wb") as f:
                        f.write(png)
                except OSError as exc:
                    raise RecorderError(f"cannot write frame {name}: {exc}") from exc
                self._stills[sha] = name
            data = {
                "file": name, "pts_ns": pts_ns, "reason": reason, "bytes": len(png),
                "sha256": sha,
            }  # fmt: skip
            event = self._next("frame", data, source)
            self._write(event)
            return event

    def add_capture(self, image: Image.Image, *, pts_ns: int, pixels: str) -> Event:
        with self._lock:
            if self._closed:
                raise RecorderError("the recording is closed")
            segment = self._segment
            if (
                segment is not None
                and segment.first_pts_ns is not None
                and pts_ns - segment.first_pts_ns >= self._segment_ns
            ):
                self._finish_segment()
                segment = None
            if segment is None:
                name = f"video/{self._segments:06d}.mp4"
                self._segments += 1
                segment = SegmentWriter(
                    self._path / name, width_px=image.width, height_px=image.height
                )
                self._segment = segment
            index = segment.add(image, pts_ns=pts_ns)
            data = {
                "video": f"video/{segment.path.name}", "index": index, "pts_ns": pts_ns,
                "reason": "capture", "pixels": pixels,
            }  # fmt: skip
            event = self._next("frame", data, "system")
            self._write(event)
            return event

    def tick(self, now_ns: int) -> None:
        with self._lock:
            segment = self._segment
            if (
                not self._closed
                and segment is not None
                and segment.first_pts_ns is not None
                and now_ns - segment.first_pts_ns >= self._segment_ns
            ):
                self._finish_segment()

    def _finish_segment(self) -> None:
        # Called with the lock held: close the segment, then chain its hash.
        segment, self._segment = self._segment, None
        if segment is None:
            return
        segment.close()
        name = f"video/{segment.path.name}"
        data = {
            "file": name, "sha256": file_sha256(segment.path),
            "bytes": segment.path.stat().st_size, "frames": segment.frames,
            "first_pts_ns": segment.first_pts_ns, "last_pts_ns": segment.last_pts_ns,
        }  # fmt: skip
        self._write(self._next("media", data, "system"))

    def close(self, *, status: str = "closed") -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(RecorderError):
                self._finish_segment()
            self._events.close()
            media: dict[str, str] = {}
            for sub in ("frames", "video"):
                for file in sorted((self._path / sub).iterdir()):
                    with contextlib.suppress(RecorderError):
                        media[f"{sub}/{file.name}"] = file_sha256(file)
            self._manifest.update(
                status=status,
                ended_at=self._clock.wall().isoformat(),
                event_count=self._seq,
                counts=dict(self.counts),
                chain_head=self._head,
                media=media,
            )
            self._write_manifest()
