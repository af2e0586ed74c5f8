"""Recording storage: ship a recording bundle to a storage URL and fetch it back.

A *storage URL* names where recordings go; each session's bundle lands under
``<url>/<session id>/`` with the same relative paths as on disk (``manifest.json``,
``events.jsonl``, ``frames/...``, ``video/...``, ``guest.log``, ``console.log``; see
``docs/recording.md``). Two kinds:

* a local directory: ``/srv/recordings`` or ``file:///srv/recordings``;
* S3-compatible object storage: ``s3://bucket/prefix``, through boto3 (the endpoint and
  credentials come from the usual AWS settings: ``AWS_ENDPOINT_URL``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, profiles).

:class:`BundleShipper` copies a bundle that is still being written, in pieces: stills and
finished video segments once, ``events.jsonl`` cut at its last complete line, and the
manifest last, so a reader that finds a closed manifest finds the whole bundle.
:func:`fetch_bundle` downloads a stored bundle into a local directory, where
:mod:`orchestrator.replay` reads it. :func:`seal_truncated` marks the stored copy of a
recording whose writer died (its node was lost) as ``truncated``.

Errors: everything the storage refuses or fails at is a
:class:`~orchestrator.errors.StorageError` (boto3/botocore and ``OSError`` are translated
here); a malformed URL is a :class:`~orchestrator.errors.ConfigError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from orchestrator.errors import ConfigError, StorageError
from orchestrator.recorder import GENESIS_HASH, chain_hash

__all__ = [
    "BundleShipper",
    "LocalStore",
    "S3Store",
    "ShipReport",
    "Store",
    "fetch_bundle",
    "is_storage_url",
    "open_store",
    "recording_url",
    "seal_truncated",
    "split_recording_url",
    "truncated_manifest",
]


class Store(Protocol):
    """Flat key -> bytes storage under one root (keys are ``/``-separated, relative)."""

    @property
    def url(self) -> str:
        """The storage URL of the root (``s3://bucket/prefix`` or a directory)."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` (replacing it). Raises: StorageError."""
        ...

    def put_file(self, key: str, path: Path) -> None:
        """Store a local file's bytes at ``key``. Raises: StorageError."""
        ...

    def get(self, key: str) -> bytes:
        """The bytes at ``key``. Raises: StorageError (code ``storage_not_found`` if absent)."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Keys that start with ``prefix``, sorted. Raises: StorageError."""
        ...


def _check_key(key: str) -> str:
    parts = PurePosixPath(key).parts
    if not key or key.startswith("/") or ".." in parts or "\\" in key:
        raise StorageError(f"refusing the storage key {key!r}")
    return key


class LocalStore:
    """A :class:`Store` in a local directory (created on first write).

    Writes go to a temporary file first and are renamed into place, so a reader never sees
    half a file.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def url(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StorageError(f"cannot write {path}: {exc}") from exc

    def put_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StorageError(f"cannot copy {path} to {target}: {exc}") from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise StorageError(f"{path} does not exist", code="storage_not_found") from None
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}") from exc

    def list(self, prefix: str) -> list[str]:
        if not self.root.is_dir():
            return []
        keys = []
        try:
            for path in self.root.rglob("*"):
                if path.is_file() and not path.name.endswith(".tmp"):
                    key = path.relative_to(self.root).as_posix()
                    if key.startswith(prefix):
                        keys.append(key)
        except OSError as exc:
            raise StorageError(f"cannot list {self.root}: {exc}") from exc
        return sorted(keys)


class S3Store:
    """A :class:`Store` in an S3-compatible bucket under ``prefix`` (boto3).

    Args:
        bucket: the bucket (must exist).
        prefix: key prefix without leading or trailing ``/`` (may be empty).
        client: a boto3 S3 client; default ``boto3.client("s3", endpoint_url=...)`` with
            the standard AWS configuration (environment, profiles).
        endpoint_url: the S3 endpoint (default: the AWS configuration's, e.g.
            ``AWS_ENDPOINT_URL``).

    Raises:
        StorageError: boto3 is not installed (``pip install 'deskvm[cluster]'``).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        endpoint_url: str | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if client is None:
            try:
                import boto3
            except ImportError as exc:
                raise StorageError(
                    "s3:// storage needs boto3: pip install 'deskvm[cluster]'"
                ) from exc
            client = boto3.client("s3", endpoint_url=endpoint_url)
        self._client = client

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, what: str, exc: Exception) -> StorageError:
        code = "storage_error"
        error = getattr(exc, "response", {}).get("Error", {}) if hasattr(exc, "response") else {}
        if error.get("Code") in ("NoSuchKey", "404", "NotFound"):
            code = "storage_not_found"
        return StorageError(f"{what} ({self.url}): {exc}", code=code)

    def put(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as exc:  # botocore's ClientError / BotoCoreError, translated here
            raise self._fail(f"cannot store {key}", exc) from exc

    def put_file(self, key: str, path: Path) -> None:
        try:
            self._client.upload_file(str(path), self.bucket, self._key(key))
        except Exception as exc:
            raise self._fail(f"cannot upload {path} as {key}", exc) from exc

    def get(self, key: str) -> bytes:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            data: bytes = response["Body"].read()
        except Exception as exc:
            raise self._fail(f"cannot read {key}", exc) from exc
        return data

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                keys += [obj["Key"].removeprefix(strip) for obj in page.get("Contents", [])]
        except Exception as exc:
            raise self._fail(f"cannot list {prefix!r}", exc) from exc
        return sorted(keys)


def is_storage_url(text: str) -> bool:
    """Whether ``text`` is an ``s3://`` or ``file://`` URL (not a plain path)."""
    return text.startswith(("s3://", "file://"))


def open_store(url: str, *, endpoint_url: str | None = None) -> Store:
    """The store a storage URL names.

    Args:
        url: ``s3://bucket[/prefix]``, ``file:///dir`` or a directory path.
        endpoint_url: S3 endpoint override (default: the AWS configuration's).

    Raises:
        ConfigError: a malformed URL or an unknown scheme.
        StorageError: ``s3://`` without boto3 installed.
    """
    if url.startswith("s3://"):
        parsed = urlparse(url)
        if not parsed.netloc:
            raise ConfigError(f"storage URL {url!r} names no bucket (s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path, endpoint_url=endpoint_url)
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"storage URL {url!r}: file URLs must be local (file:///dir)")
        return LocalStore(Path(unquote(parsed.path)))
    if "://" in url:
        raise ConfigError(
            f"storage URL {url!r}: use a directory, file:///dir or s3://bucket/prefix"
        )
    if not url:
        raise ConfigError("empty storage URL")
    return LocalStore(Path(url))


def recording_url(store: Store, session_id: str) -> str:
    """Where ``session_id``'s bundle lives in ``store`` (what ``deskvm replay`` takes)."""
    return f"{store.url.rstrip('/')}/{session_id}"


def split_recording_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix/<id>`` -> ``("s3://bucket/prefix", "<id>")``.

    Raises:
        ConfigError: the URL has no last path segment.
    """
    base, _, name = url.rstrip("/").rpartition("/")
    if not name or base in ("s3:", "s3:/", "file:", "file:/", ""):
        raise ConfigError(f"{url!r} does not name a recording (…/<session id>)")
    if base == "s3://" or base.endswith("://"):
        raise ConfigError(f"{url!r} does not name a recording (s3://bucket/prefix/<id>)")
    return base, name


def fetch_bundle(url: str, dest: Path, *, endpoint_url: str | None = None) -> Path:
    """Download the recording at ``url`` into ``dest`` (replaced if it exists).

    Args:
        url: ``s3://bucket/prefix/<id>``, ``file:///dir/<id>``.
        dest: the local directory to create; it becomes a bundle directory.
        endpoint_url: S3 endpoint override.

    Returns:
        ``dest``.

    Raises:
        StorageError: nothing stored there (code ``storage_not_found``) or a download failed.
        ConfigError: malformed URL.
    """
    base, name = split_recording_url(url)
    store = open_store(base, endpoint_url=endpoint_url)
    keys = store.list(name + "/")
    if not any(k == f"{name}/manifest.json" for k in keys):
        raise StorageError(f"no recording at {url} (no manifest.json)", code="storage_not_found")
    if dest.exists():
        shutil.rmtree(dest)
    try:
        dest.mkdir(parents=True)
        for key in keys:
            relative = key.removeprefix(name + "/")
            target = dest / _check_key(relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(store.get(key))
        for sub in ("frames", "video"):
            (dest / sub).mkdir(exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot write the downloaded recording to {dest}: {exc}") from exc
    return dest


@dataclass(frozen=True, slots=True)
class ShipReport:
    """What one :meth:`BundleShipper.ship` did.

    Attributes:
        files: objects written (media, events, manifest, logs).
        bytes: bytes written.
        events: complete event lines in the shipped ``events.jsonl``.
        manifest_status: the shipped manifest's ``status`` (``None`` before there is one).
    """

    files: int
    bytes: int
    events: int
    manifest_status: str | None


class BundleShipper:
    """Copies one recording bundle to ``store`` under ``name/``, in pieces, as it grows.

    Call :meth:`ship` periodically while the session runs and once with ``final=True``
    after the recording is closed. Thread-safe (one ship at a time).

    Args:
        bundle: the bundle directory being written.
        store: where to copy it.
        name: the key prefix (the session id).
    """

    def __init__(self, bundle: Path, store: Store, name: str) -> None:
        self.bundle = bundle
        self.store = store
        self.name = name
        self._sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns)
        self._parsed = 0  # bytes of events.jsonl already scanned for media events
        self._events = 0
        self._finished_video: set[str] = set()
        self._manifest = b""
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return recording_url(self.store, self.name)

    def _put_file(self, relative: str, path: Path) -> int:
        stat = path.stat()
        mark = (stat.st_size, stat.st_mtime_ns)
        if self._sent.get(relative) == mark:
            return 0
        self.store.put_file(f"{self.name}/{relative}", path)
        self._sent[relative] = mark
        return stat.st_size

    def ship(self, *, final: bool = False) -> ShipReport:
        """Copy what is new since the last call.

        Order: stills and finished video segments, ``events.jsonl`` (complete lines only),
        with ``final`` also ``guest.log``/``console.log`` and every video segment, then
        ``manifest.json`` last.

        Raises:
            StorageError: a write failed (the next call retries what is missing).
        """
        with self._lock:
            return self._ship(final)

    def _ship(self, final: bool) -> ShipReport:
        files = written = 0
        try:
            raw = (self.bundle / "events.jsonl").read_bytes()
        except FileNotFoundError:
            raw = b""
        except OSError as exc:
            raise StorageError(f"cannot read {self.bundle / 'events.jsonl'}: {exc}") from exc
        complete = raw[: raw.rfind(b"\n") + 1]
        for line in complete[self._parsed :].splitlines():
            self._events += 1
            if b'"kind":"media"' not in line:
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self._finished_video.add(str(json.loads(line)["data"]["file"]))
        self._parsed = len(complete)
        media: list[tuple[str, Path]] = []
        for sub in ("frames", "video"):
            folder = self.bundle / sub
            if folder.is_dir():
                media += [(f"{sub}/{p.name}", p) for p in sorted(folder.iterdir()) if p.is_file()]
        try:
            for relative, path in media:
                if relative.startswith("video/") and not (
                    final or relative in self._finished_video
                ):
                    continue  # still being encoded: its media event has not been written
                size = self._put_file(relative, path)
                if size or relative not in self._sent:
                    files += 1 if size else 0
                    written += size
            if self._sent.get("events.jsonl", (-1, 0))[0] != len(complete):
                self.store.put(f"{self.name}/events.jsonl", complete)
                self._sent["events.jsonl"] = (len(complete), 0)
                files += 1
                written += len(complete)
            if final:
                for log_name in ("guest.log", "console.log"):
                    path = self.bundle / log_name
                    if path.is_file():
                        size = self._put_file(log_name, path)
                        files += 1 if size else 0
                        written += size
            try:
                manifest = (self.bundle / "manifest.json").read_bytes()
            except FileNotFoundError:
                manifest = b""
            status = None
            if manifest:
                with contextlib.suppress(ValueError, AttributeError):
                    status = json.loads(manifest).get("status")
                if manifest != self._manifest:
                    self.store.put(f"{self.name}/manifest.json", manifest)
                    self._manifest = manifest
                    files += 1
                    written += len(manifest)
        except OSError as exc:
            raise StorageError(f"cannot read {self.bundle} to ship it: {exc}") from exc
        return ShipReport(files=files, bytes=written, events=self._events, manifest_status=status)


def truncated_manifest(
    manifest: Mapping[str, Any], events: bytes, *, reason: str, ended_at: str
) -> dict[str, Any]:
    """The manifest that seals a recording whose writer died as ``truncated``.

    Only the verified prefix of ``events`` counts: complete lines whose ``seq`` and chain
    hash check out, up to the first that does not. ``media`` lists the stills and finished
    video segments that prefix references, with the sha256 the chain itself carries (so
    sealing needs no media download).

    Args:
        manifest: the recording's manifest as last written (``status: recording``).
        events: the bytes of ``events.jsonl`` as far as they were kept.
        reason: why the writer stopped (e.g. ``session_lost: node n2 died``).
        ended_at: ISO 8601 UTC time of the seal.

    Returns:
        The new manifest: ``status`` ``truncated``, ``truncated_reason``, ``ended_at``,
        ``event_count``, ``counts``, ``chain_head``, ``media``.
    """
    head = GENESIS_HASH
    count = 0
    counts: dict[str, int] = {}
    media: dict[str, str] = {}
    for index, line in enumerate(events.split(b"\n")[:-1]):
        try:
            event = json.loads(line)
            body = {k: v for k, v in event.items() if k != "hash"}
            if event["seq"] != index or chain_hash(head, body) != event["hash"]:
                break
        except (ValueError, KeyError, TypeError):
            break
        head = event["hash"]
        count = index + 1
        kind = str(event.get("kind"))
        counts[kind] = counts.get(kind, 0) + 1
        data = event.get("data") or {}
        if kind in ("frame", "media") and "file" in data and "sha256" in data:
            media[str(data["file"])] = str(data["sha256"])
    return {
        **dict(manifest),
        "status": "truncated",
        "truncated_reason": reason,
        "ended_at": ended_at,
        "event_count": count,
        "counts": counts,
        "chain_head": head,
        "media": dict(sorted(media.items())),
    }


def seal_truncated(store: Store, name: str, *, reason: str, ended_at: str) -> dict[str, Any]:
    """Seal the stored copy of recording ``name`` as ``truncated`` (its writer is gone).

    Rewrites ``events.jsonl`` to its verified prefix and the manifest per
    :func:`truncated_manifest`. A recording already closed (or sealed) is left alone.

    Returns:
        The manifest now stored.

    Raises:
        StorageError: nothing stored under ``name`` or a read/write failed.
    """
    try:
        manifest = json.loads(store.get(f"{name}/manifest.json"))
    except ValueError as exc:
        raise StorageError(f"the stored manifest of {name} is not JSON: {exc}") from exc
    if manifest.get("status") != "recording":
        return dict(manifest)
    try:
        events = store.get(f"{name}/events.jsonl")
    except StorageError as exc:
        if exc.code != "storage_not_found":
            raise
        events = b""
    sealed = truncated_manifest(manifest, events, reason=reason, ended_at=ended_at)
    lines = events.split(b"\n")[: sealed["event_count"]]
    kept = b"".join(line + b"\n" for line in lines)
    if kept != events:
        store.put(f"{name}/events.jsonl", kept)
    text = json.dumps(sealed, indent=2, sort_keys=True) + "\n"
    store.put(f"{name}/manifest.json", text.encode())
    return sealed
