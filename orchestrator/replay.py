"""Read a recording bundle back: summary, verification, frames at a time, exports.

See ``docs/recording.md`` (and :mod:`orchestrator.recorder`) for the format. Times on the
command line and in the viewer are seconds since the manifest's ``monotonic_origin_ns``
(the moment the recording was created).

Errors: a bundle that cannot be read raises :class:`~orchestrator.errors.RecorderError`;
a bundle that reads but does not verify is *reported* (:class:`VerifyReport`), not raised.
"""

from __future__ import annotations

import bisect
import io
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from orchestrator.errors import DeskvmError, RecorderError
from orchestrator.recorder import GENESIS_HASH, chain_hash
from orchestrator.video import SegmentWriter, decode_segment, file_sha256

__all__ = [
    "OSWORLD_TIMESTAMP",
    "Recording",
    "RecordingSummary",
    "Step",
    "VerifyReport",
    "export_jsonl",
    "export_mp4",
    "export_osworld",
    "osworld_action",
    "read_events",
    "replayable_action",
    "summarize",
    "verify",
]

# Stills that show the screen at an input's moment: taken before injecting (``input``) or,
# for actions that inject nothing, the screenshot the client received.
_STEP_STILLS = ("input", "screenshot")


def read_events(bundle: Path) -> list[dict[str, Any]]:
    """Every complete event line of ``bundle/events.jsonl`` (a torn last line is skipped).

    Raises:
        RecorderError: not a recording bundle, or a complete line is not JSON.
    """
    path = bundle / "events.jsonl"
    if not path.is_file():
        _check_bundle(bundle)
        raise RecorderError(f"{bundle} is not a deskvm recording (no events.jsonl)")
    events = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f):
            if not line.endswith("\n"):
                break
            try:
                events.append(json.loads(line))
            except ValueError as exc:
                raise RecorderError(f"line {number} of {path} is not JSON: {exc}") from exc
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


def _check_bundle(bundle: Path) -> None:
    """Raise ``not_a_recording`` unless ``bundle`` is a directory holding a recording."""
    if not bundle.exists():
        raise RecorderError(f"{bundle}: no such recording directory", code="not_a_recording")
    if not bundle.is_dir():
        raise RecorderError(f"{bundle} is not a recording directory (it is a file)",
                            code="not_a_recording")  # fmt: skip
    if not (bundle / "manifest.json").exists() and not (bundle / "events.jsonl").exists():
        raise RecorderError(
            f"{bundle} is not a recording directory (a recording holds manifest.json and "
            "events.jsonl; sessions write theirs under <state-dir>/recordings/<session id>)",
            code="not_a_recording",
        )


def _manifest(bundle: Path) -> dict[str, Any]:
    _check_bundle(bundle)
    try:
        manifest: dict[str, Any] = json.loads((bundle / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise RecorderError(f"cannot read {bundle / 'manifest.json'}: {exc}") from exc
    return manifest


def summarize(bundle: Path) -> RecordingSummary:
    """Summarize a recording and verify its hash chain.

    Raises:
        RecorderError: not a recording bundle, or a line is not JSON.
    """
    manifest = _manifest(bundle)
    events = read_events(bundle)
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
        elif event["kind"] == "frame" and "file" in data:
            summary.frames += 1
            summary.frame_bytes += int(data.get("bytes", 0))
        elif event["kind"] == "frame":
            summary.frames += 1
    return summary


# --- verification ------------------------------------------------------------------


@dataclass(slots=True)
class VerifyReport:
    """Outcome of :func:`verify`.

    Attributes:
        ok: everything checked out (chain, media, and a closed manifest that matches).
        events: complete, parseable event lines read.
        first_bad_seq: the first event (line number, 0-based) that is changed, missing,
            reordered or references changed media; ``None`` if none is.
        problem: what is wrong at ``first_bad_seq`` (or with the bundle as a whole).
        closed: the manifest's status is not ``recording`` (``False``: the writer crashed
            or is still writing; the chain is then verified up to its last complete line).
        torn_tail_bytes: bytes of an incomplete last line (a crash mid-write).
        unfinished_video: video segments without a ``media`` event (not finished when the
            recording stopped); frames in them fall back to stills.
        media_checked: media files whose sha256 was recomputed.
        truncated: for a bundle sealed as truncated (``deskvm replay seal``, a server
            start after a crash, or the scale-out shipper for a lost node):
            ``{"last_intact_seq", "reason"}``; ``ok`` is then ``True`` when the seal and
            everything before it verify (``deskvm replay verify`` exits 3).
        gaps: ``marker`` ``gap`` events (a bridge restart the session survived), each
            ``{"seq", "reason", "after_seq", "gap_s"}``.
        truncated_video: segments a dead writer left open, closed off afterwards, each
            ``{"file", "frames", "frames_recorded", "playable"}``.
    """

    ok: bool
    events: int
    first_bad_seq: int | None = None
    problem: str = ""
    closed: bool = False
    torn_tail_bytes: int = 0
    unfinished_video: list[str] = field(default_factory=list)
    media_checked: int = 0
    last_t_s: float = 0.0
    truncated: dict[str, Any] | None = None
    gaps: list[dict[str, Any]] = field(default_factory=list)
    truncated_video: list[dict[str, Any]] = field(default_factory=list)


def verify(bundle: Path) -> VerifyReport:
    """Recompute the hash chain and the media hashes of a recording.

    Finds any changed, removed, inserted or reordered byte of ``events.jsonl`` (the chain),
    any changed still or video segment (each ``frame`` event carries its still's sha256,
    each ``media`` event its segment's), and, for a closed recording, truncation (the
    manifest's ``event_count`` and ``chain_head``) and changed media (``media``).

    Raises:
        RecorderError: ``bundle`` is not a recording (no manifest or no events file).
    """
    manifest = _manifest(bundle)
    path = bundle / "events.jsonl"
    if not path.is_file():
        _check_bundle(bundle)
        raise RecorderError(f"{bundle} is not a deskvm recording (no events.jsonl)")
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    origin = int(manifest.get("monotonic_origin_ns", 0))
    status = manifest.get("status")
    # A truncated seal (the writer died; see docs/recording.md) is checked like a closed
    # recording, then reported as not closed.
    report = VerifyReport(ok=False, events=0, closed=status != "recording")
    report.torn_tail_bytes = len(tail)

    def bad(seq: int, problem: str) -> VerifyReport:
        report.first_bad_seq = seq
        report.problem = problem
        return report

    head = GENESIS_HASH
    checked_files: dict[str, str] = {}
    finished: set[str] = set()
    referenced: set[str] = set()
    starting: dict[str, Any] | None = None
    for index, line in enumerate(lines):
        try:
            event = json.loads(line.decode("utf-8"))
            body = {k: v for k, v in event.items() if k != "hash"}
            seq, claimed = event["seq"], event["hash"]
        except (ValueError, KeyError, TypeError, AttributeError):
            return bad(index, f"line {index} is not a well-formed event (changed bytes)")
        if seq != index:
            return bad(index, f"line {index} carries seq {seq}: events removed, added or moved")
        if chain_hash(head, body) != claimed:
            return bad(index, f"event {index} does not match its chain hash (changed bytes)")
        head = claimed
        report.events = index + 1
        report.last_t_s = (int(event.get("t_ns", origin)) - origin) / 1e9
        data = event.get("data") or {}
        kind = event.get("kind")
        if kind == "lifecycle" and data.get("event") == "starting" and starting is None:
            starting = data
        if kind == "frame" and "file" in data and "sha256" in data:
            name = str(data["file"])
            if name not in checked_files:
                checked_files[name] = _sha_or_empty(bundle / name)
                report.media_checked += 1
            if checked_files[name] != data["sha256"]:
                return bad(index, f"still {name} of event {index} was changed or removed")
        elif kind == "frame" and "video" in data:
            referenced.add(str(data["video"]))
        elif kind == "media":
            name = str(data.get("file"))
            report.media_checked += 1
            if _sha_or_empty(bundle / name) != data.get("sha256"):
                return bad(index, f"video segment {name} of event {index} was changed")
            finished.add(name)
            if data.get("truncated"):
                report.truncated_video.append(
                    {k: data.get(k) for k in ("file", "frames", "frames_recorded", "playable")}
                )
        elif kind == "marker" and data.get("event") == "gap":
            report.gaps.append(
                {"seq": index, "reason": data.get("reason"), "after_seq": data.get("after_seq"),
                 "gap_s": data.get("gap_s")}
            )  # fmt: skip
    report.unfinished_video = sorted(referenced - finished)
    if tail:
        report.problem = (
            f"the last line is incomplete ({len(tail)} bytes): the writer stopped mid-event"
        )
    image = manifest.get("image") or {}
    if starting is not None and image.get("content_hash") != starting.get("image_hash"):
        report.problem = "manifest image hash differs from the recorded start event"
        return report
    if not report.closed:
        if not report.problem:
            report.problem = (
                f"not closed (status {manifest.get('status')!r}): a crash or a live "
                f"session; verified up to event {report.events - 1}"
            )
        return report
    if tail:
        return bad(report.events, report.problem)
    count = manifest.get("event_count")
    if count != report.events:
        return bad(
            report.events,
            f"the manifest says {count} events, the file has {report.events} (truncated)",
        )
    if manifest.get("chain_head") != head:
        return bad(report.events - 1, "the chain head differs from the manifest's")
    for name, sha in sorted((manifest.get("media") or {}).items()):
        if _sha_or_empty(bundle / name) != sha:
            report.problem = f"media file {name} differs from the manifest's hash"
            return report
    if status == "truncated":
        # Sealed after its writer died: by `deskvm replay seal` / a server start (the last
        # event is the chained `truncated` lifecycle event naming the last intact one), or
        # as a stored copy by the scale-out shipper (no event: its last event is it).
        last_event = json.loads(lines[-1].decode("utf-8")) if lines else {}
        sealed = last_event.get("data") or {}
        if last_event.get("kind") == "lifecycle" and sealed.get("event") == "truncated":
            last_intact = sealed.get("last_intact_seq")
        else:
            last_intact = report.events - 1 if report.events else None
        report.truncated = {
            "last_intact_seq": last_intact,
            "reason": manifest.get("truncated_reason") or sealed.get("reason") or "",
        }
    report.ok = True
    report.problem = ""
    return report


def _sha_or_empty(path: Path) -> str:
    try:
        return file_sha256(path)
    except RecorderError:
        return ""


# --- frames and steps --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One input and what surrounded it (an export row).

    Attributes:
        index: 0-based step number.
        input_seq: seq of the ``input`` event.
        t_s: time of the input, seconds since the recording's origin.
        action: the action as recorded (secret text absent).
        source: who acted.
        result: the ``result`` (or ``error``) event's data, ``None`` if there was none.
        before_seq: seq of the frame shown when the input arrived.
        after_seq: seq of the frame shown just before the next input (or at the end).
    """

    index: int
    input_seq: int
    t_s: float
    action: dict[str, Any]
    source: str
    result: dict[str, Any] | None
    before_seq: int | None
    after_seq: int | None


class Recording:
    """A recording opened for reading: events, frame lookup by time or event.

    Args:
        bundle: the bundle directory.

    Raises:
        RecorderError: not a readable recording.
    """

    def __init__(self, bundle: Path) -> None:
        self.path = bundle
        self.manifest = _manifest(bundle)
        self.events = read_events(bundle)
        self.origin_ns = int(
            self.manifest.get("monotonic_origin_ns", self.events[0]["t_ns"] if self.events else 0)
        )
        # Segments with a media event, and how many of their frames decode (all of them,
        # but a segment a dead writer left open was closed off with what still plays).
        finished = {
            str(e["data"].get("file")): int(e["data"].get("frames", 0))
            for e in self.events
            if e.get("kind") == "media"
        }
        # Frames sorted by pts: (pts_ns, seq). Captures of an unfinished segment (a crash,
        # or the segment a live session is writing) are left out unless it decodes.
        self._frames: list[tuple[int, int]] = []
        self._input_still: dict[int, int] = {}  # input seq -> its input-moment still
        readable: dict[str, int] = {}
        last_input: int | None = None
        for e in self.events:
            kind, data, seq = e.get("kind"), e.get("data") or {}, int(e["seq"])
            if kind == "input":
                last_input = seq
            elif kind == "result" or kind == "error":
                last_input = None
            if kind != "frame":
                continue
            if data.get("reason") in _STEP_STILLS and last_input is not None:
                self._input_still.setdefault(last_input, seq)
            video = data.get("video")
            if video is not None and video in finished:
                if int(data.get("index", 0)) >= finished[video]:
                    continue
            elif video is not None:
                if video not in readable:
                    try:
                        readable[video] = len(decode_segment(bundle / video))
                    except RecorderError:
                        readable[video] = 0
                if int(data.get("index", 0)) >= readable[video]:
                    continue
            self._frames.append((int(data.get("pts_ns", e["t_ns"])), seq))
        self._frames.sort()
        self._indexed = {seq for _, seq in self._frames}
        self._pts = [p for p, _ in self._frames]

    @property
    def duration_s(self) -> float:
        """Seconds from the origin to the last event."""
        return (self.events[-1]["t_ns"] - self.origin_ns) / 1e9 if self.events else 0.0

    def t_s(self, event: dict[str, Any]) -> float:
        """An event's time in seconds since the origin."""
        return (int(event["t_ns"]) - self.origin_ns) / 1e9

    def frame_seq_at(self, t_s: float) -> int | None:
        """The seq of the frame shown at ``t_s`` (the latest with ``pts <= t``), if any."""
        t_ns = self.origin_ns + round(t_s * 1e9)
        i = bisect.bisect_right(self._pts, t_ns)
        return self._frames[i - 1][1] if i else None

    def frame_seq_for_event(self, seq: int) -> int | None:
        """The frame shown when event ``seq`` happened.

        A readable frame event is its own; an ``input`` event's is the still taken at its
        input moment (after it was recorded, before it was injected) when there is one;
        otherwise the latest frame at or before the event's time.
        """
        event = self.events[seq]
        if event.get("kind") == "frame" and seq in self._indexed:
            return seq
        if seq in self._input_still:
            return self._input_still[seq]
        return self.frame_seq_at(self.t_s(event))

    def frame_image(self, seq: int) -> Image.Image:
        """The picture of ``frame`` event ``seq`` (a still, or decoded from the video).

        Raises:
            RecorderError: not a frame event, or its media is missing or unreadable.
        """
        event = self.events[seq]
        data = event.get("data", {})
        if event.get("kind") != "frame":
            raise RecorderError(f"event {seq} is not a frame")
        if "file" in data:
            try:
                with Image.open(self.path / data["file"]) as image:
                    return image.convert("RGB")
            except OSError as exc:
                raise RecorderError(f"cannot read still {data['file']}: {exc}") from exc
        frames = decode_segment(self.path / data["video"])
        index = int(data["index"])
        if index >= len(frames):
            raise RecorderError(f"{data['video']} has no frame {index} (unfinished segment)")
        return frames[index]

    def frame_png(self, seq: int) -> bytes:
        """PNG bytes of :meth:`frame_image` (a still's file as stored)."""
        data = self.events[seq].get("data", {})
        if self.events[seq].get("kind") == "frame" and "file" in data:
            try:
                png: bytes = (self.path / data["file"]).read_bytes()
                return png
            except OSError as exc:
                raise RecorderError(f"cannot read still {data['file']}: {exc}") from exc
        buf = io.BytesIO()
        self.frame_image(seq).save(buf, format="PNG", compress_level=1)
        return buf.getvalue()

    def frame_at(self, t_s: float) -> tuple[int, Image.Image]:
        """``(seq, image)`` of the frame shown at ``t_s``; frames of an unreadable
        (crash-interrupted) segment fall back to the latest earlier readable frame.

        Raises:
            RecorderError: code ``no_frame``: ``t_s`` is before the first frame (the
                message says when that is) or the recording has no frame; otherwise no
                readable frame at or before ``t_s``.
        """
        t_ns = self.origin_ns + round(t_s * 1e9)
        i = bisect.bisect_right(self._pts, t_ns)
        if not self._frames:
            raise RecorderError(f"{self.path} has no frames", code="no_frame")
        if i == 0:
            first_s = (self._pts[0] - self.origin_ns) / 1e9
            raise RecorderError(
                f"no frame yet at {t_s:.3f} s: the first frame is at {first_s:.3f} s "
                f"(event {self._frames[0][1]}); the recording lasts {self.duration_s:.3f} s",
                code="no_frame",
            )
        last_error: RecorderError | None = None
        while i > 0:
            seq = self._frames[i - 1][1]
            try:
                return seq, self.frame_image(seq)
            except RecorderError as exc:
                last_error = exc
                i -= 1
        raise RecorderError(f"no readable frame at or before {t_s:.3f} s") from last_error

    def cursor_at(self, seq: int) -> tuple[int, int] | None:
        """Where the last pointer input at or before event ``seq`` put the pointer."""
        for event in reversed(self.events[: seq + 1]):
            if event.get("kind") == "input":
                point = _point(event["data"].get("action", {}))
                if point is not None:
                    return point
        return None

    def steps(self) -> Iterator[Step]:
        """Every ``input`` event with its result and before/after frames."""
        inputs = [e for e in self.events if e.get("kind") == "input"]
        for index, event in enumerate(inputs):
            seq = int(event["seq"])
            nxt = inputs[index + 1] if index + 1 < len(inputs) else None
            end = int(nxt["seq"]) if nxt is not None else len(self.events)
            result = None
            before = None
            for later in self.events[seq + 1 : end]:
                data = later.get("data", {})
                is_still = later["kind"] == "frame" and data.get("reason") in _STEP_STILLS
                if is_still and before is None:
                    before = int(later["seq"])
                if later["kind"] in ("result", "error") and result is None:
                    result = dict(data)
            if before is None:
                before = self.frame_seq_at(self.t_s(event))
            if nxt is not None:
                after = self.frame_seq_at(self.t_s(nxt))
            else:
                after = self._frames[-1][1] if self._frames else None
            yield Step(
                index=index, input_seq=seq, t_s=self.t_s(event),
                action=dict(event["data"].get("action", {})), source=str(event["source"]),
                result=result, before_seq=before, after_seq=after,
            )  # fmt: skip


def _point(action: dict[str, Any]) -> tuple[int, int] | None:
    x, y = action.get("x"), action.get("y")
    if x is not None and y is not None:
        return int(x), int(y)
    path = action.get("path")
    if path:
        return int(path[-1][0]), int(path[-1][1])
    return None


# --- exports -----------------------------------------------------------------------


def _write_png(recording: Recording, seq: int | None, path: Path) -> str | None:
    if seq is None:
        return None
    path.write_bytes(recording.frame_png(seq))
    return path.name


def export_jsonl(bundle: Path, out: Path) -> int:
    """Write ``out/steps.jsonl`` with one (screenshot before, action, screenshot after)
    row per input, and the PNGs beside it.

    Row: ``{"step", "t_s", "source", "action", "result", "screenshot_before",
    "screenshot_after", "frame_seq_before", "frame_seq_after"}`` (file names relative to
    ``out``).

    Returns:
        The number of steps.

    Raises:
        RecorderError: unreadable recording, or ``out`` cannot be written.
    """
    recording = Recording(bundle)
    try:
        out.mkdir(parents=True, exist_ok=True)
        count = 0
        with (out / "steps.jsonl").open("w", encoding="utf-8") as f:
            for step in recording.steps():
                row = {
                    "step": step.index, "t_s": round(step.t_s, 6), "source": step.source,
                    "action": step.action, "result": step.result,
                    "screenshot_before": _write_png(
                        recording, step.before_seq, out / f"{step.index:06d}_before.png"
                    ),
                    "screenshot_after": _write_png(
                        recording, step.after_seq, out / f"{step.index:06d}_after.png"
                    ),
                    "frame_seq_before": step.before_seq, "frame_seq_after": step.after_seq,
                }  # fmt: skip
                f.write(json.dumps(row, sort_keys=True) + "\n")
                count += 1
    except OSError as exc:
        raise RecorderError(f"cannot write the export to {out}: {exc}") from exc
    return count


def replayable_action(action: dict[str, Any]) -> dict[str, Any] | None:
    """The ``deskvm`` request body that repeats a recorded action (``None``: secret text).

    Recordings store actions as :func:`~agent_bridge.protocol.actions.action_to_dict`
    writes them; the request schema differs for key actions (``combos`` -> ``keys``).
    """
    body = {k: v for k, v in action.items() if v is not None}
    name = body.get("action")
    if name == "type" and body.get("secret"):
        return None
    if name == "key" and "combos" in body:
        body["keys"] = " ".join(body.pop("combos"))
    if name == "hold_key" and "combo" in body:
        body["keys"] = body.pop("combo")
    if name == "zoom" and "x0" in body:
        body["region"] = [body.pop(k) for k in ("x0", "y0", "x1", "y1")]
    return body


OSWORLD_TIMESTAMP = "%Y%m%d@%H%M%S%f"
"""``action_timestamp`` of OSWorld trajectories (``lib_run_single``)."""


def osworld_action(action: dict[str, Any]) -> str | None:
    """A recorded action as OSWorld's ``pyautogui`` action string (``None``: not an
    OSWorld step: screenshots, zooms and cursor queries only observe).

    Secret text becomes a Python comment naming its length (the text itself is never in a
    recording); an action pyautogui cannot express (the back/forward buttons) becomes a
    comment naming it, so that steps stay aligned with the screenshots.
    """
    from agent_bridge.protocol.messages import parse_deskvm_action
    from agent_bridge.protocol.vocab.pyautogui_export import OBSERVATIONS, to_pyautogui

    name = action.get("action")
    if name == "type" and action.get("secret"):
        return f"# deskvm: secret text ({action.get('length')} characters) is not exported"
    body = replayable_action(action)
    try:
        parsed = parse_deskvm_action(body or {})
    except DeskvmError:
        return f"# deskvm: {name} could not be read back from the recording"
    if isinstance(parsed, OBSERVATIONS):
        return None
    code = to_pyautogui(parsed)
    return code if code is not None else f"# deskvm: {name} {body} has no pyautogui form"


def export_osworld(bundle: Path, out: Path) -> int:
    """Write an OSWorld trajectory: ``out/traj.jsonl`` plus one screenshot per step.

    OSWorld's own format (``lib_run_single.run_single_example`` with the ``pyautogui``
    action space): one JSON line per executed action with ``step_num`` (1-based),
    ``action_timestamp`` (:data:`OSWORLD_TIMESTAMP` of the wall time just before the
    action), ``action`` (the pyautogui code string, see :func:`osworld_action`, or
    ``"WAIT"``), ``response`` (the model's text: ``""``, deskvm does not see it),
    ``reward`` (0), ``done`` (``false``: only OSWorld's ``DONE``/``FAIL`` end an episode,
    and they inject nothing), ``info`` (``{}``, or ``{"error": {"code", "message"}}`` when
    deskvm refused or failed the action) and ``screenshot_file`` (the screen after the
    action, ``step_{n}_{timestamp}.png``). Observation-only actions (screenshot, zoom,
    cursor position) are not steps: OSWorld observes after every step anyway. Also writes
    ``initial_state.png`` (the screen before step 1).

    Returns:
        The number of steps.

    Raises:
        RecorderError: unreadable recording, or ``out`` cannot be written.
    """
    from datetime import datetime, timedelta

    recording = Recording(bundle)
    started = datetime.fromisoformat(str(recording.manifest.get("started_at")))
    steps = [(step, code) for step in recording.steps() if (code := osworld_action(step.action))]
    try:
        out.mkdir(parents=True, exist_ok=True)
        if steps:
            _write_png(recording, steps[0][0].before_seq, out / "initial_state.png")
        with (out / "traj.jsonl").open("w", encoding="utf-8") as f:
            for number, (step, code) in enumerate(steps, start=1):
                stamp = (started + timedelta(seconds=step.t_s)).strftime(OSWORLD_TIMESTAMP)
                name = f"step_{number}_{stamp}.png"
                _write_png(recording, step.after_seq, out / name)
                info: dict[str, Any] = {}
                if step.result is not None and "code" in step.result and "message" in step.result:
                    info = {
                        "error": {"code": step.result["code"], "message": step.result["message"]}
                    }
                row = {
                    "step_num": number, "action_timestamp": stamp, "action": code,
                    "response": "", "reward": 0, "done": False, "info": info,
                    "screenshot_file": name,
                }  # fmt: skip
                f.write(json.dumps(row) + "\n")
    except OSError as exc:
        raise RecorderError(f"cannot write the export to {out}: {exc}") from exc
    return len(steps)


def export_mp4(bundle: Path, out: Path, *, fps: float = 5.0) -> int:
    """Render the recording as one MP4 at a constant ``fps`` with the pointer drawn as a
    red ring and clicks as a filled disc for 0.5 s.

    Returns:
        The number of frames written.

    Raises:
        RecorderError: unreadable recording, no frames, or ``out`` cannot be written.
    """
    recording = Recording(bundle)
    clicks = [
        (recording.t_s(e), _point(e["data"].get("action", {})))
        for e in recording.events
        if e.get("kind") == "input"
        and e["data"].get("action", {}).get("action") in ("click", "mouse_down", "drag")
    ]
    pointer: list[tuple[float, tuple[int, int]]] = []
    for e in recording.events:
        point = _point(e["data"].get("action", {})) if e.get("kind") == "input" else None
        if point is not None:
            pointer.append((recording.t_s(e), point))
    pointer_times = [t for t, _ in pointer]
    seq0 = recording.frame_seq_at(recording.duration_s)
    if seq0 is None:
        raise RecorderError(f"{bundle} has no frames to export")
    first = min(p for p, _ in recording._frames)
    t = (first - recording.origin_ns) / 1e9
    writer: SegmentWriter | None = None
    count = 0
    display = recording.manifest.get("display") or {}
    canvas = (int(display.get("width", 0)), int(display.get("height", 0)))
    if not all(canvas):
        canvas = recording.frame_image(seq0).size
    try:
        while t <= recording.duration_s + 1e-9:
            _, image = recording.frame_at(t)
            # Frames of another size (the boot console before the desktop's mode is set)
            # are scaled into the display's size, centred.
            image = _fit(image, canvas) if image.size != canvas else image.copy()
            draw = ImageDraw.Draw(image)
            i = bisect.bisect_right(pointer_times, t)
            cursor = pointer[i - 1][1] if i else None
            if cursor is not None:
                x, y = cursor
                draw.ellipse((x - 9, y - 9, x + 9, y + 9), outline=(255, 0, 0), width=3)
            for when, point in clicks:
                if point is not None and 0 <= t - when <= 0.5:
                    x, y = point
                    draw.ellipse((x - 14, y - 14, x + 14, y + 14), fill=(255, 200, 0))
            if writer is None:
                writer = SegmentWriter(
                    out, width_px=image.width, height_px=image.height, preset="veryfast"
                )
            writer.add(image, pts_ns=round(t * 1e9))
            count += 1
            t += 1.0 / fps
    finally:
        if writer is not None:
            writer.close()
    return count


def _fit(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """``image`` scaled to fit ``size`` (aspect kept), centred on black."""
    scale = min(size[0] / image.width, size[1] / image.height)
    inner = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    out = Image.new("RGB", size, (0, 0, 0))
    resized = image.convert("RGB").resize(inner, Image.Resampling.BILINEAR)
    out.paste(resized, ((size[0] - inner[0]) // 2, (size[1] - inner[1]) // 2))
    return out
