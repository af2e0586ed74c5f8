"""Server and CLI settings: one frozen value, read from the environment in one place.

Only :meth:`Settings.from_env` reads ``os.environ``; it is called by the CLI and the
server at start-up, never at import time. Variables: ``DESKVM_STATE_DIR``,
``DESKVM_IMAGES_DIR``, ``DESKVM_LIBVIRT_URI``, ``DESKVM_TOKEN``, ``DESKVM_ACCEL`` (auto|kvm|tcg),
``DESKVM_MAX_SESSIONS``, ``DESKVM_BOOT_TIMEOUT_S``, ``DESKVM_DEFAULT_IMAGE``,
``DESKVM_CAPTURE_FPS`` (0 turns continuous capture off).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrator.errors import ConfigError

__all__ = ["DEFAULT_STATE_DIR", "Settings"]

DEFAULT_STATE_DIR = Path("/var/lib/deskvm")


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything configurable about a deskvm host.

    Attributes:
        state_dir: root of images, session files, recordings, the token file.
        libvirt_uri: libvirt connection (``qemu:///system``).
        token: the admin bearer token; ``None`` means generate one (kept in ``token_file``).
        accel: ``auto`` (probe), ``kvm`` or ``tcg``.
        max_sessions: concurrent sessions the server accepts.
        boot_timeout_s: default boot deadline.
        default_image: image used when a request names none.
        capture_fps: continuous capture rate of every session, frames per second
            (``0``: off; stills of screenshots are kept either way).
    """

    state_dir: Path = DEFAULT_STATE_DIR
    libvirt_uri: str = "qemu:///system"
    token: str | None = None
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    max_sessions: int = 4
    boot_timeout_s: float = 180.0
    default_image: str = "debian12-desktop"
    images_dir_override: Path | None = None
    capture_fps: float = 2.0

    @property
    def images_dir(self) -> Path:
        """Built base images (``DESKVM_IMAGES_DIR``, default ``<state_dir>/images``)."""
        return self.images_dir_override or self.state_dir / "images"

    @property
    def sessions_dir(self) -> Path:
        return self.state_dir / "sessions"

    @property
    def recordings_dir(self) -> Path:
        return self.state_dir / "recordings"

    @property
    def token_file(self) -> Path:
        return self.state_dir / "token"

    @property
    def host_file(self) -> Path:
        """Where ``deskvm doctor`` stores the acceleration probe's verdict."""
        return self.state_dir / "host.json"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``DESKVM_*`` variables, then ``overrides`` (not ``None`` ones).

        Raises:
            ConfigError: a variable has a malformed value.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        try:
            if "DESKVM_STATE_DIR" in env:
                values["state_dir"] = Path(env["DESKVM_STATE_DIR"])
            if "DESKVM_IMAGES_DIR" in env:
                values["images_dir_override"] = Path(env["DESKVM_IMAGES_DIR"])
            if "DESKVM_LIBVIRT_URI" in env:
                values["libvirt_uri"] = env["DESKVM_LIBVIRT_URI"]
            if env.get("DESKVM_TOKEN"):
                values["token"] = env["DESKVM_TOKEN"]
            if "DESKVM_ACCEL" in env:
                values["accel"] = env["DESKVM_ACCEL"]
            if "DESKVM_MAX_SESSIONS" in env:
                values["max_sessions"] = int(env["DESKVM_MAX_SESSIONS"])
            if "DESKVM_BOOT_TIMEOUT_S" in env:
                values["boot_timeout_s"] = float(env["DESKVM_BOOT_TIMEOUT_S"])
            if "DESKVM_DEFAULT_IMAGE" in env:
                values["default_image"] = env["DESKVM_DEFAULT_IMAGE"]
            if "DESKVM_CAPTURE_FPS" in env:
                values["capture_fps"] = float(env["DESKVM_CAPTURE_FPS"])
        except ValueError as exc:
            raise ConfigError(f"malformed DESKVM_* environment variable: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        if settings.accel not in ("auto", "kvm", "tcg"):
            raise ConfigError(f"accel must be auto, kvm or tcg, not {settings.accel!r}")
        if settings.max_sessions < 1:
            raise ConfigError("max_sessions must be at least 1")
        if not 0 <= settings.capture_fps <= 30:
            raise ConfigError("capture_fps must be between 0 (off) and 30")
        return settings

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)
