"""Which server of an installation is which, and whether it is still alive.

An *installation* is one state directory; several bridge servers may share it (``deskvm
serve`` beside a test server). Each server is an :class:`Instance` with a *name*:

* a named instance (``deskvm serve`` uses ``serve-<port>``, ``--name`` picks another) is
  the same server across restarts: a restarted server takes its name back and re-adopts
  the sessions it left running (``SessionManager.adopt``);
* an unnamed instance gets a random ``tmp-<hex>`` name nobody will take again, so its
  sessions are reaped as soon as it is gone.

Liveness is an exclusive ``flock`` on ``<dir>/<name>.lock`` held for the instance's
lifetime: the kernel drops it when the process dies, even by SIGKILL, so "alive" never
depends on a clean exit. Two live servers cannot share a name. A heartbeat file
``<dir>/<name>.json`` (``pid``, ``boot_id``, ``monotonic_ns``, ``wall``, ``ephemeral``)
says when the instance was last seen, so a grace period can be measured from it.

Times: ``CLOCK_MONOTONIC`` is one clock for every process of a boot (not per process), so
a restarted server compares its monotonic time with the heartbeat's; ``boot_id``
(``/proc/sys/kernel/random/boot_id``) tells a heartbeat of an earlier boot apart (its
domains are gone anyway).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

from orchestrator.clock import Clock, SystemClock
from orchestrator.errors import ConfigError, HostSetupError

__all__ = ["EPHEMERAL_PREFIX", "Heartbeat", "Instance", "boot_id", "validate_instance_name"]

EPHEMERAL_PREFIX = "tmp-"
"""Names of unnamed instances start with this (and are never taken again)."""

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``; ``""`` if unreadable)."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def validate_instance_name(name: str) -> str:
    """Return ``name`` if it is a valid instance name.

    Raises:
        ConfigError: not 1-63 of ``[a-z0-9._-]`` starting with a letter or digit.
    """
    if not _NAME_RE.match(name):
        raise ConfigError(
            f"invalid server name {name!r}: 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The last sign of life an instance wrote.

    Attributes:
        name: the instance.
        pid: its process.
        boot_id: the boot it ran in.
        monotonic_ns: ``CLOCK_MONOTONIC`` when written.
        wall: UTC wall clock when written (ISO 8601).
        ephemeral: an unnamed instance (its sessions cannot be re-adopted).
        stopped: it exited cleanly, leaving its sessions running for a restart.
    """

    name: str
    pid: int
    boot_id: str
    monotonic_ns: int
    wall: str
    ephemeral: bool
    stopped: bool = False


class Instance:
    """This server's identity in an installation (see the module docstring).

    Args:
        directory: where instances keep their lock and heartbeat files.
        name: the server's name; ``None``: an ephemeral ``tmp-<hex>`` name.
        clock: monotonic and wall time of the heartbeats.

    Raises:
        ConfigError: code ``instance_busy``: a live server already has this name.
        HostSetupError: the directory cannot be written.
    """

    def __init__(self, directory: Path, name: str | None = None, *, clock: Clock | None = None):
        self.directory = directory
        self.ephemeral = name is None
        self.name = validate_instance_name(name) if name is not None else (
            EPHEMERAL_PREFIX + secrets.token_hex(6)
        )  # fmt: skip
        self._clock = clock or SystemClock()
        self._fd: int | None = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path(self.name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise HostSetupError(f"cannot write {directory}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another live server of this installation is named {self.name!r}; stop it "
                "or give this one another name (deskvm serve --name)",
                code="instance_busy",
            ) from None
        self._fd = fd
        self.heartbeat()
        self._prune()

    def _prune(self) -> None:
        """Remove the files of dead instances nobody will come back as (ephemeral ones,
        and the random-id locks of earlier versions); named ones keep their heartbeat
        (a grace period is measured from it)."""
        for lock in self.directory.glob("*.lock"):
            name = lock.stem
            if name == self.name or self.alive(name):
                continue
            beat = self.last_seen(name)
            legacy = beat is None and re.fullmatch(r"[0-9a-f]{12}", name) is not None
            if legacy or (beat is not None and beat.ephemeral):
                for path in (lock, self._beat_path(name)):
                    with contextlib.suppress(OSError):
                        path.unlink(missing_ok=True)

    def _lock_path(self, name: str) -> Path:
        return self.directory / f"{name}.lock"

    def _beat_path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def heartbeat(self, *, stopped: bool = False) -> None:
        """Write this instance's heartbeat (now)."""
        data = {
            "name": self.name,
            "pid": os.getpid(),
            "boot_id": boot_id(),
            "monotonic_ns": self._clock.monotonic_ns(),
            "wall": self._clock.wall().astimezone(UTC).isoformat(),
            "ephemeral": self.ephemeral,
            "stopped": stopped,
        }
        tmp = self._beat_path(self.name).with_suffix(".json.tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
            os.replace(tmp, self._beat_path(self.name))

    def alive(self, name: str) -> bool:
        """Whether the instance ``name`` is running (holds its lock); ``True`` for this one."""
        if name == self.name and self._fd is not None:
            return True
        try:
            fd = os.open(self._lock_path(name), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
        return False

    def last_seen(self, name: str) -> Heartbeat | None:
        """The heartbeat ``name`` wrote last (``None``: none readable)."""
        try:
            data = json.loads(self._beat_path(name).read_text())
            return Heartbeat(
                name=str(data["name"]),
                pid=int(data["pid"]),
                boot_id=str(data["boot_id"]),
                monotonic_ns=int(data["monotonic_ns"]),
                wall=str(data["wall"]),
                ephemeral=bool(data["ephemeral"]),
                stopped=bool(data.get("stopped", False)),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def gone_for_s(self, name: str) -> float | None:
        """Seconds since the instance ``name`` was last seen, or ``None`` if it is alive.

        An instance with no heartbeat, one from another boot, or an ephemeral one counts
        as gone forever (``float("inf")``): nobody will come back for its sessions.
        """
        if self.alive(name):
            return None
        beat = self.last_seen(name)
        if beat is None or beat.ephemeral or beat.boot_id != boot_id():
            return float("inf")
        return max(0.0, (self._clock.monotonic_ns() - beat.monotonic_ns) / 1e9)

    def close(self, *, keep_sessions: bool = False) -> None:
        """Release the name (idempotent).

        Args:
            keep_sessions: the server leaves its sessions running for a restart: the
                heartbeat says so (``stopped``) and stays; otherwise it is removed.
        """
        if self._fd is None:
            return
        if keep_sessions:
            self.heartbeat(stopped=True)
        else:
            with contextlib.suppress(OSError):
                self._beat_path(self.name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._lock_path(self.name).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __repr__(self) -> str:
        return f"Instance({self.name!r})"
