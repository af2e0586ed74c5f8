"""The session store seam: what a restarted bridge needs to take a running session back.

Every live session keeps a :class:`SessionRecord` in a :class:`SessionStore`, written
whenever something in it changes (start, ready, every action, a new deadline, a new
approval policy or token) and deleted when the session ends. A server that restarts reads
the records it owns and re-adopts their running domains (``SessionManager.adopt``); a
record whose server stays gone past the grace period tells the reaper what to tear down.

:class:`FileSessionStore` keeps one JSON file per session (``<dir>/<id>.json``, mode 0600,
written to a temporary file and renamed, so a crash leaves the old or the new record,
never half of one). :class:`MemorySessionStore` is the in-package fake. Another store (a
cluster registry) only has to implement the four methods of :class:`SessionStore`.

What is *not* in a record: secret text (the approval window keeps only its length, as
U+FFFD), the recording's secret-text HMAC key (a new one is made after a restart), tokens
(only their ids, scopes and expiries; a token is checked with the installation's signing
key, see ``agent_bridge.runtime.ensure_signing_key``).

Times: ``*_ns`` are ``CLOCK_MONOTONIC`` ns (one clock for every process of a boot, the
recording's clock); ``boot_id`` names the boot they belong to. ``*_at`` are UTC wall
clock, ISO 8601, for people.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from orchestrator.errors import ConfigError, StoreError
from orchestrator.spec import BootImage, DisplaySpec, EgressPolicy, SessionSpec

__all__ = [
    "RECORD_VERSION",
    "FileSessionStore",
    "MemorySessionStore",
    "RecordState",
    "SessionRecord",
    "SessionStore",
    "StoreError",
    "spec_from_json",
    "spec_to_json",
]

RECORD_VERSION = 1
RecordState = Literal["starting", "ready"]
_FILE_RE = re.compile(r"^([a-z0-9]{12})\.json$")


def spec_to_json(spec: SessionSpec) -> dict[str, Any]:
    """A :class:`SessionSpec` as JSON-ready data (paths as strings)."""
    image = spec.image
    return {
        "session_id": spec.session_id,
        "image": {
            "name": image.name,
            "content_hash": image.content_hash,
            "base_path": str(image.base_path),
            "kernel_path": str(image.kernel_path),
            "initrd_path": str(image.initrd_path),
            "kernel_cmdline": image.kernel_cmdline,
            "background_rgb": list(image.background_rgb),
            "helper_port": image.helper_port,
            "keyboard_layout": image.keyboard_layout,
        },
        "display": [spec.display.width_px, spec.display.height_px],
        "memory_mib": spec.memory_mib,
        "vcpus": spec.vcpus,
        "boot_timeout_s": spec.boot_timeout_s,
        "egress": None if spec.egress is None else list(spec.egress.allow),
        "cpu_quota_pct": spec.cpu_quota_pct,
        "memory_overhead_mib": spec.memory_overhead_mib,
        "disk_mib": spec.disk_mib,
        "ttl_s": spec.ttl_s,
        "idle_timeout_s": spec.idle_timeout_s,
        "autostart": spec.autostart,
        "guest_control": spec.guest_control,
        "keyboard_layout": spec.keyboard_layout,
    }


def spec_from_json(data: dict[str, Any]) -> SessionSpec:
    """The inverse of :func:`spec_to_json`.

    Raises:
        ConfigError: the data does not describe a valid spec.
    """
    try:
        image = data["image"]
        width, height = data["display"]
        egress = data.get("egress")
        return SessionSpec(
            session_id=str(data["session_id"]),
            image=BootImage(
                name=str(image["name"]),
                content_hash=str(image["content_hash"]),
                base_path=Path(image["base_path"]),
                kernel_path=Path(image["kernel_path"]),
                initrd_path=Path(image["initrd_path"]),
                kernel_cmdline=str(image["kernel_cmdline"]),
                background_rgb=tuple(int(v) for v in image["background_rgb"]),  # type: ignore[arg-type]
                helper_port=image.get("helper_port"),
                keyboard_layout=str(image.get("keyboard_layout", "us")),
            ),
            display=DisplaySpec(int(width), int(height)),
            memory_mib=int(data["memory_mib"]),
            vcpus=int(data["vcpus"]),
            boot_timeout_s=float(data["boot_timeout_s"]),
            egress=None if egress is None else EgressPolicy(allow=tuple(egress)),
            cpu_quota_pct=data.get("cpu_quota_pct"),
            memory_overhead_mib=int(data["memory_overhead_mib"]),
            disk_mib=data.get("disk_mib"),
            ttl_s=data.get("ttl_s"),
            idle_timeout_s=data.get("idle_timeout_s"),
            autostart=data.get("autostart"),
            guest_control=bool(data.get("guest_control", False)),
            keyboard_layout=data.get("keyboard_layout"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"not a session spec: {exc!r}") from exc


@dataclass(slots=True)
class SessionRecord:
    """Everything a restarted server needs to carry on with one running session.

    Attributes:
        session_id: the session.
        owner: name of the server that runs it (``orchestrator.instance.Instance``).
        boot_id: the host boot it runs in (a record of another boot is stale).
        state: ``starting`` (cannot be adopted: torn down) or ``ready``.
        spec: :func:`spec_to_json` of its spec (``ttl_s`` as last extended).
        created_ns: when it was registered (``CLOCK_MONOTONIC``); ``ttl_s`` counts from it.
        last_action_ns: its last action (or ready); ``idle_timeout_s`` counts from it.
        ready_ns, boot_s: when it became ready, how long the boot took.
        created_at, ready_at: the same in UTC (ISO 8601).
        recording: its recording bundle's directory.
        cursor: where the host last put the pointer (display pixels).
        approval_policy: ``ApprovalPolicy`` fields, or ``None``.
        typed_text: the approval window's recent typed text (secret characters as U+FFFD).
        egress: the egress attachment (``attachment_to_json``), or ``None``.
        extras: state of the layers above (the bridge keeps its tokens here), by key.
        version: :data:`RECORD_VERSION`.
    """

    session_id: str
    owner: str
    boot_id: str
    state: RecordState
    spec: dict[str, Any]
    created_ns: int
    last_action_ns: int
    ready_ns: int | None = None
    boot_s: float | None = None
    created_at: str | None = None
    ready_at: str | None = None
    recording: str | None = None
    cursor: tuple[int, int] | None = None
    approval_policy: dict[str, Any] | None = None
    typed_text: str = ""
    egress: dict[str, Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    version: int = RECORD_VERSION

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready data."""
        data = asdict(self)
        data["cursor"] = None if self.cursor is None else list(self.cursor)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionRecord:
        """The inverse of :meth:`to_json`.

        Raises:
            StoreError: not a record of this version.
        """
        if data.get("version") != RECORD_VERSION:
            raise StoreError(f"session record version {data.get('version')!r} is not supported")
        try:
            cursor = data.get("cursor")
            return cls(**{**data, "cursor": None if cursor is None else tuple(cursor)})
        except TypeError as exc:
            raise StoreError(f"malformed session record: {exc}") from exc

    @property
    def session_spec(self) -> SessionSpec:
        """:attr:`spec` as a :class:`SessionSpec`.

        Raises:
            ConfigError: the stored spec is not valid.
        """
        return spec_from_json(self.spec)


class SessionStore(Protocol):
    """Where session records live (one per live session)."""

    def save(self, record: SessionRecord) -> None:
        """Write ``record`` (replacing the session's earlier one) before returning.

        Raises:
            StoreError: it could not be written (the old record is still there).
        """
        ...

    def load(self, session_id: str) -> SessionRecord | None:
        """The record of ``session_id``, or ``None``."""
        ...

    def records(self) -> list[SessionRecord]:
        """Every readable record (unreadable ones are skipped)."""
        ...

    def delete(self, session_id: str) -> None:
        """Remove the record of ``session_id`` (idempotent)."""
        ...


class FileSessionStore:
    """:class:`SessionStore` as one JSON file per session in ``directory`` (0700/0600)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()

    def _path(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.json"

    def save(self, record: SessionRecord) -> None:
        text = json.dumps(record.to_json(), sort_keys=True, ensure_ascii=False)
        path = self._path(record.session_id)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            with self._lock:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write session record {path}: {exc}") from exc

    def load(self, session_id: str) -> SessionRecord | None:
        try:
            return SessionRecord.from_json(json.loads(self._path(session_id).read_text()))
        except (OSError, ValueError, StoreError):
            return None

    def records(self) -> list[SessionRecord]:
        if not self.directory.is_dir():
            return []
        out = []
        for path in sorted(self.directory.iterdir()):
            match = _FILE_RE.match(path.name)
            if match is not None:
                record = self.load(match.group(1))
                if record is not None:
                    out.append(record)
        return out

    def delete(self, session_id: str) -> None:
        with contextlib.suppress(OSError):
            self._path(session_id).unlink(missing_ok=True)


class MemorySessionStore:
    """In-package fake :class:`SessionStore` (records kept as JSON, as a file store would).

    Attributes:
        fail_next_save: a :class:`StoreError` message to raise on the next :meth:`save`.
        saves: how many records were written.
    """

    def __init__(self) -> None:
        self._records: dict[str, str] = {}
        self._lock = threading.Lock()
        self.fail_next_save: str | None = None
        self.saves = 0

    def save(self, record: SessionRecord) -> None:
        with self._lock:
            if self.fail_next_save is not None:
                message, self.fail_next_save = self.fail_next_save, None
                raise StoreError(message)
            self._records[record.session_id] = json.dumps(record.to_json())
            self.saves += 1

    def load(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            text = self._records.get(session_id)
        return None if text is None else SessionRecord.from_json(json.loads(text))

    def records(self) -> list[SessionRecord]:
        with self._lock:
            texts = list(self._records.values())
        return [SessionRecord.from_json(json.loads(t)) for t in texts]

    def delete(self, session_id: str) -> None:
        with self._lock:
            self._records.pop(session_id, None)
