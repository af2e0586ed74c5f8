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

A writer holds an exclusive ``flock`` on ``events.jsonl`` while the bundle is open (the
kernel drops it when the process dies). A bundle left ``recording`` by a writer that died
is either *continued* (:meth:`FileRecorder.reopen`: the restarted bridge re-adopted the
session; a ``marker`` ``gap`` event says what was lost) or *sealed* (:func:`seal`: status
``truncated``, a ``lifecycle`` ``truncated`` event names the last intact event and the
reason). Both first cut a torn last line and chain a ``media`` event for the segment the
writer left unfinished (``truncated: true``, with how many of its frames still decode).
"""

from __future__ import annotations

import contextlib
import fcntl
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
from orchestrator.video import SegmentWriter, count_decodable_frames, file_sha256

__all__ = [
    "FORMAT_VERSION",
    "GENESIS_HASH",
    "Event",
    "EventKind",
    "FileRecorder",
    "MemoryRecorder",
    "Recorder",
    "SealReport",
    "Source",
    "chain_hash",
    "seal",
    "writer_alive",
]

FORMAT_VERSION = 2
GENESIS_HASH = "0" * 64

EventKind = Literal[
    "lifecycle",
    "input",
    "injected",
    "result",
    "error",
    "frame",
    "network",
    "marker",
    "media",
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

    def detach(self, *, reason: str) -> None:
        """Stop writing but leave the recording open for a later writer (idempotent).

        Appends a ``marker`` ``{"event": "detached", "reason"}``, finishes the open video
        segment and lets go of the bundle; its status stays ``recording`` until a
        restarted server continues it (``FileRecorder.reopen``) or seals it.
        """
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

    def detach(self, *, reason: str) -> None:
        if self.closed_status is None:
            self.append("marker", {"event": "detached", "reason": reason})
            self.closed_status = "detached"


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
            fcntl.flock(self._events.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
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

    resumed_after_seq: int | None = None
    """After :meth:`reopen`: the last event the previous writer completed."""
    resumed_after_t_ns: int | None = None
    torn_tail_bytes: int = 0
    """After :meth:`reopen`: bytes of a torn last line that were cut off."""
    closed_off: tuple[dict[str, Any], ...] = ()
    """After :meth:`reopen`: the segments the previous writer left open (see :func:`seal`)."""

    @classmethod
    def reopen(
        cls,
        path: Path,
        clock: Clock,
        *,
        reason: str,
        segment_s: float = 10.0,
        secret_key: bytes | None = None,
        mark_gap: bool = True,
    ) -> FileRecorder:
        """Continue a bundle whose writer died (status ``recording``, lock free).

        Verifies the chain, cuts a torn last line, chains a ``media`` event
        (``truncated: true``) for each segment the writer left unfinished, then (with
        ``mark_gap``) appends ``marker`` ``{"event": "gap", "reason", "after_seq",
        "after_t_ns", "gap_s", "torn_tail_bytes", "unfinished_video"}`` and records the
        resumption in the manifest (``resumed``). New events follow on the same clock
        (``CLOCK_MONOTONIC``: the same across processes of one boot). The secret-text
        HMAC key is new: equal secrets before and after the gap do not match.

        Args:
            path: the bundle.
            clock: time source of the new events.
            reason: why there is a gap (e.g. ``"bridge restarted"``).
            segment_s, secret_key: as for the constructor.
            mark_gap: append the ``gap`` marker (``False``: :func:`seal` writes its own).

        Raises:
            RecorderError: a live process still writes it, it is closed, it is not a
                bundle, or it does not verify.
        """
        self = cls.__new__(cls)
        _ChainedLog.__init__(self, clock, secret_key)
        self._path = path
        self._segment_ns = int(segment_s * 1e9)
        try:
            self._events = (path / "events.jsonl").open("a", encoding="utf-8")
        except OSError as exc:
            raise RecorderError(f"{path} is not a deskvm recording: {exc}") from exc
        try:
            try:
                fcntl.flock(self._events.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RecorderError(
                    f"{path} is still being written by a live process; not touched"
                ) from None
            except OSError as exc:
                raise RecorderError(f"cannot lock {path / 'events.jsonl'}: {exc}") from exc
            found = _recover(path)
            if found.torn:
                self._events.flush()
                os.ftruncate(self._events.fileno(), found.keep_bytes)
        except BaseException:
            self._events.close()
            raise
        self._manifest = found.manifest
        self.origin_ns = int(found.manifest.get("monotonic_origin_ns", self.origin_ns))
        self._closed = False
        self._stills = found.stills
        self._segment = None
        self._segments = found.next_segment
        self._seq, self._head, self.counts = found.events, found.head, found.counts
        self.resumed_after_seq = found.events - 1 if found.events else None
        self.resumed_after_t_ns = found.last_t_ns
        self.torn_tail_bytes = len(found.torn)
        closed_off = []
        for name, pts in sorted(found.unfinished.items()):
            closed_off.append(self._close_off(name, pts))
        self.closed_off = tuple(closed_off)
        if mark_gap:
            now_ns = clock.monotonic_ns()
            last = found.last_t_ns
            self.append(
                "marker",
                {
                    "event": "gap",
                    "reason": reason,
                    "after_seq": self.resumed_after_seq,
                    "after_t_ns": last,
                    "gap_s": round((now_ns - last) / 1e9, 3)
                    if last is not None and now_ns >= last
                    else None,
                    "torn_tail_bytes": self.torn_tail_bytes,
                    "unfinished_video": list(self.closed_off),
                },
            )
            self._manifest.setdefault("resumed", []).append(
                {"at": clock.wall().isoformat(), "after_seq": self.resumed_after_seq,
                 "reason": reason}
            )  # fmt: skip
            self._write_manifest()
        return self

    def _close_off(self, name: str, pts_ns: list[int]) -> dict[str, Any]:
        """Chain a ``media`` event for a segment a dead writer left open."""
        file = self._path / name
        frames = count_decodable_frames(file)
        try:
            sha, size = file_sha256(file), file.stat().st_size
        except (RecorderError, OSError):
            sha, size = "", 0
        playable = pts_ns[:frames]
        data = {
            "file": name, "sha256": sha, "bytes": size, "frames": frames,
            "first_pts_ns": playable[0] if playable else None,
            "last_pts_ns": playable[-1] if playable else None,
            "truncated": True, "frames_recorded": len(pts_ns), "playable": frames > 0,
        }  # fmt: skip
        with self._lock:
            self._write(self._next("media", data, "system"))
        return {
            "file": name, "frames": frames, "frames_recorded": len(pts_ns),
            "playable": frames > 0,
        }  # fmt: skip

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
            if segment is not None and (
                segment.size_px != image.size
                or (
                    segment.first_pts_ns is not None
                    and pts_ns - segment.first_pts_ns >= self._segment_ns
                )
            ):
                # A segment has one frame size: a resolution change (boot console -> desktop,
                # a guest's xrandr) starts a new one.
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

    def detach(self, *, reason: str) -> None:
        """See :meth:`Recorder.detach` (the writer's lock is released)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(RecorderError):
                self._finish_segment()
            with contextlib.suppress(RecorderError):
                self._write(self._next("marker", {"event": "detached", "reason": reason}, "system"))
            self._events.close()

    def close(self, *, status: str = "closed", **manifest: Any) -> None:
        """Finish the recording (idempotent): the open segment, then the manifest.

        Args:
            status: the manifest's final ``status``.
            manifest: more manifest fields to write (e.g. ``truncated_reason``).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(RecorderError):
                self._finish_segment()
            self._events.close()  # (drops the writer's lock)
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
                **manifest,
            )
            self._write_manifest()


# --- continuing and sealing a bundle whose writer died ----------------------------------


def writer_alive(bundle: Path) -> bool:
    """Whether a live process holds the bundle open for writing (its ``flock``)."""
    try:
        fd = os.open(bundle / "events.jsonl", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (also drops the probe's own lock)
    return False


@dataclass(slots=True)
class _Recovered:
    """What a dead writer left: the verified prefix and what to close off."""

    manifest: dict[str, Any]
    events: int
    head: str
    counts: dict[str, int]
    last_t_ns: int | None
    torn: bytes
    keep_bytes: int
    stills: dict[str, str]
    next_segment: int
    unfinished: dict[str, list[int]]  # video file -> pts_ns of the frames recorded in it


def _recover(path: Path) -> _Recovered:
    """Read and verify what a dead writer left in ``path`` (caller holds the lock).

    Raises:
        RecorderError: not a bundle, already closed, or changed (a line that does not
            verify before the last one: continuing would hide the damage).
    """
    try:
        manifest: dict[str, Any] = json.loads((path / "manifest.json").read_text())
        raw = (path / "events.jsonl").read_bytes()
    except (OSError, ValueError) as exc:
        raise RecorderError(f"{path} is not a readable deskvm recording: {exc}") from exc
    status = manifest.get("status")
    if status != "recording":
        raise RecorderError(f"{path} is already closed (status {status!r}); nothing to seal")
    lines = raw.split(b"\n")
    torn = lines.pop()
    head, last_t_ns = GENESIS_HASH, None
    counts: dict[str, int] = {}
    stills: dict[str, str] = {}
    referenced: dict[str, list[int]] = {}
    finished: set[str] = set()
    for index, line in enumerate(lines):
        try:
            event = json.loads(line.decode("utf-8"))
            body = {k: v for k, v in event.items() if k != "hash"}
            ok = event["seq"] == index and chain_hash(head, body) == event["hash"]
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise RecorderError(
                f"event {index} of {path} does not verify (the bundle was changed): "
                "not continued or sealed; `deskvm replay verify` shows the damage"
            )
        head = event["hash"]
        kind = str(event["kind"])
        counts[kind] = counts.get(kind, 0) + 1
        last_t_ns = int(event["t_ns"])
        data = event.get("data") or {}
        if kind == "frame" and "file" in data and "sha256" in data:
            stills.setdefault(str(data["sha256"]), str(data["file"]))
        elif kind == "frame" and "video" in data:
            referenced.setdefault(str(data["video"]), []).append(int(data.get("pts_ns", 0)))
        elif kind == "media":
            finished.add(str(data.get("file")))
    # The next segment's index comes after every segment on disk *and* every one the chain
    # names: a writer killed after chaining a segment's first frame but before its file
    # reached the disk leaves a name with no file, and reusing it would overwrite what the
    # seal's media event says of it (an absent file).
    names = [Path(name).stem for name in (*referenced, *finished)]
    names += [f.stem for f in (path / "video").glob("*.mp4")]
    indices = [int(stem) for stem in names if stem.isdigit()]
    return _Recovered(
        manifest=manifest,
        events=len(lines),
        head=head,
        counts=counts,
        last_t_ns=last_t_ns,
        torn=torn,
        keep_bytes=len(raw) - len(torn),
        stills=stills,
        next_segment=max(indices, default=-1) + 1,
        unfinished={k: v for k, v in referenced.items() if k not in finished},
    )


@dataclass(frozen=True, slots=True)
class SealReport:
    """What :func:`seal` did.

    Attributes:
        bundle: the bundle directory.
        last_intact_seq: the last event the dead writer completed (``None``: none).
        reason: why the recording ended (as written to the bundle).
        torn_tail_bytes: bytes of an incomplete last line that were cut off.
        unfinished_video: the segment(s) the writer left open, each
            ``{"file", "frames", "frames_recorded", "playable"}``.
    """

    bundle: Path
    last_intact_seq: int | None
    reason: str
    torn_tail_bytes: int
    unfinished_video: tuple[dict[str, Any], ...]


def seal(bundle: Path, clock: Clock, *, reason: str) -> SealReport:
    """Close a bundle whose writer died as ``truncated``.

    Cuts a torn last line, chains a ``media`` event for each segment left unfinished
    (``truncated: true``; its frames up to the last complete fragment still play), appends
    a ``lifecycle`` ``{"event": "truncated", "reason", "last_intact_seq", ...}`` event and
    writes the manifest with ``status: "truncated"`` and ``truncated_reason`` (the fields
    :func:`orchestrator.storage.truncated_manifest` gives a stored copy sealed without its
    media). ``deskvm replay verify`` then reports "intact up to event N, truncated" (exit
    code 3).

    Args:
        bundle: the recording directory.
        clock: time of the sealing events.
        reason: why the recording stopped, e.g. ``"the bridge server was killed"``.

    Raises:
        RecorderError: a live process still writes it, it is already closed, it is not a
            bundle, or it does not verify (it is left as it is).
    """
    recorder = FileRecorder.reopen(bundle, clock, reason=reason, mark_gap=False)
    last = recorder.resumed_after_seq
    data: dict[str, Any] = {
        "event": "truncated",
        "reason": reason,
        "last_intact_seq": last,
        "last_intact_t_ns": recorder.resumed_after_t_ns,
        "torn_tail_bytes": recorder.torn_tail_bytes,
        "unfinished_video": list(recorder.closed_off),
    }
    recorder.append("lifecycle", data)
    recorder.close(status="truncated", truncated_reason=reason)
    return SealReport(
        bundle=bundle,
        last_intact_seq=last,
        reason=reason,
        torn_tail_bytes=recorder.torn_tail_bytes,
        unfinished_video=tuple(recorder.closed_off),
    )
