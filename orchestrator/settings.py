"""Server and CLI settings: one frozen value, read from the environment in one place.

Only :meth:`Settings.from_env` reads ``os.environ``; it is called by the CLI and the
server at start-up, never at import time. Variables: ``DESKVM_STATE_DIR``,
``DESKVM_IMAGES_DIR``, ``DESKVM_LIBVIRT_URI``, ``DESKVM_TOKEN``, ``DESKVM_ACCEL`` (auto|kvm|tcg),
``DESKVM_MAX_SESSIONS``, ``DESKVM_BOOT_TIMEOUT_S``, ``DESKVM_DEFAULT_IMAGE``,
``DESKVM_CAPTURE_FPS`` (0 turns continuous capture off), ``DESKVM_MAX_TOTAL_MEMORY_MIB``,
``DESKVM_MEMORY_OVERHEAD_MIB``, ``DESKVM_SESSION_TTL_S``, ``DESKVM_IDLE_TIMEOUT_S``,
``DESKVM_TOKEN_MAX_TTL_S``, ``DESKVM_ALLOWED_ORIGINS`` (comma-separated),
``DESKVM_EGRESS_UPSTREAM_IFACE``, ``DESKVM_EGRESS_UPSTREAM_DNS`` (``IP[,IP]``),
``DESKVM_SESSION_MAX_TTL_S``, ``DESKVM_ADOPT_GRACE_S``, ``DESKVM_ON_EXIT`` (close|keep),
``DESKVM_SERVER_NAME``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrator.errors import ConfigError

__all__ = ["DEFAULT_STATE_DIR", "Settings", "split_csv"]

DEFAULT_STATE_DIR = Path("/var/lib/deskvm")


def split_csv(text: str) -> tuple[str, ...]:
    """``"a, b,,c"`` -> ``("a", "b", "c")`` (for ``IP[,IP]`` options)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


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
        max_total_memory_mib: sum of live sessions' memory hard limits (guest RAM + QEMU
            overhead + video memory), MiB; ``None``: derived from the host's RAM by the
            server (all but 2 GiB or a tenth, see ``orchestrator.host``).
        memory_overhead_mib: QEMU overhead above guest RAM in each hard limit, MiB.
        session_ttl_s: default maximum lifetime of a session, seconds (``None``: unlimited).
        idle_timeout_s: default idle timeout, seconds (``None``: never).
        sweep_interval_s: how often the server expires sessions and reaps leftovers.
        token_ttl_s: default lifetime of a minted session token, seconds.
        token_max_ttl_s: the longest lifetime a minted token may ask for, seconds.
        allowed_origins: WebSocket ``Origin`` values accepted (browsers); a handshake
            without ``Origin`` (non-browser clients) is accepted.
        max_actions_per_s: per-session action rate (token bucket refill; burst 2x).
        max_typed_chars_per_s: per-session typed-character rate (burst 2x).
        egress_upstream_iface: the only interface allowed session traffic may leave by;
            ``None``: no egress on this host (sessions with a policy are refused).
        egress_upstream_dns: resolvers the per-session DNS forwards allowlisted names to
            (addresses, reached through ``egress_upstream_iface``); required with it.
        session_max_ttl_s: the longest lifetime a session may be given, at create or by
            ``PATCH /v1/sessions/{id}``, seconds.
        adopt_grace_s: how long the sessions of a named server that went away (crash,
            kill -9, ``--on-exit keep``) keep running for it to restart and re-adopt them;
            then any server of the installation reaps them, seconds.
        on_exit: what a graceful shutdown does with running sessions: ``close`` them, or
            ``keep`` them running for a restart (``deskvm serve --on-exit``).
        server_name: this server's name in the installation (its sessions' owner; a
            restart under the same name re-adopts them); ``None``: the CLI's default
            (``serve-<port>``), or an ephemeral name for in-process servers.
        warm_pool: desktops to keep restored and ready, ``IMAGE:N[,IMAGE:N...]``
            (``deskvm serve --warm-pool``, ``DESKVM_WARM_POOL``; see
            ``orchestrator.pool``); ``""``: none, every session boots cold.
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
    max_total_memory_mib: int | None = None
    memory_overhead_mib: int = 768
    session_ttl_s: float | None = 4 * 3600.0
    idle_timeout_s: float | None = 1800.0
    sweep_interval_s: float = 5.0
    token_ttl_s: float = 900.0
    token_max_ttl_s: float = 4 * 3600.0
    allowed_origins: tuple[str, ...] = ()
    max_actions_per_s: float = 50.0
    max_typed_chars_per_s: float = 200.0
    egress_upstream_iface: str | None = None
    egress_upstream_dns: tuple[str, ...] = ()
    session_max_ttl_s: float = 7 * 86400.0
    adopt_grace_s: float = 300.0
    on_exit: Literal["close", "keep"] = "close"
    server_name: str | None = None
    warm_pool: str = ""

    @property
    def session_state_dir(self) -> Path:
        """Session records for bridge restarts (``orchestrator.store``)."""
        return self.state_dir / "session-state"

    @property
    def instances_dir(self) -> Path:
        """Lock and heartbeat files of the installation's servers (``orchestrator.instance``)."""
        return self.sessions_dir / ".instances"

    @property
    def pool_dir(self) -> Path:
        """Saved states of the servers' warm pools (``<pool_dir>/<server name>``)."""
        return self.state_dir / "pool"

    @property
    def token_key_file(self) -> Path:
        """The installation's token signing key (0600): minted tokens outlive a restart."""
        return self.state_dir / "token-signing.key"

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
            if env.get("DESKVM_MAX_TOTAL_MEMORY_MIB"):
                values["max_total_memory_mib"] = int(env["DESKVM_MAX_TOTAL_MEMORY_MIB"])
            if "DESKVM_MEMORY_OVERHEAD_MIB" in env:
                values["memory_overhead_mib"] = int(env["DESKVM_MEMORY_OVERHEAD_MIB"])
            for key, name in (
                ("DESKVM_SESSION_TTL_S", "session_ttl_s"),
                ("DESKVM_IDLE_TIMEOUT_S", "idle_timeout_s"),
            ):
                if key in env:  # "0" or "" means no limit
                    values[name] = float(env[key] or 0) or None
            if "DESKVM_TOKEN_MAX_TTL_S" in env:
                values["token_max_ttl_s"] = float(env["DESKVM_TOKEN_MAX_TTL_S"])
            if "DESKVM_ALLOWED_ORIGINS" in env:
                values["allowed_origins"] = tuple(
                    o.strip() for o in env["DESKVM_ALLOWED_ORIGINS"].split(",") if o.strip()
                )
            if env.get("DESKVM_EGRESS_UPSTREAM_IFACE"):
                values["egress_upstream_iface"] = env["DESKVM_EGRESS_UPSTREAM_IFACE"]
            if env.get("DESKVM_EGRESS_UPSTREAM_DNS"):
                values["egress_upstream_dns"] = split_csv(env["DESKVM_EGRESS_UPSTREAM_DNS"])
            if env.get("DESKVM_SESSION_MAX_TTL_S"):
                values["session_max_ttl_s"] = float(env["DESKVM_SESSION_MAX_TTL_S"])
            if env.get("DESKVM_ADOPT_GRACE_S"):
                values["adopt_grace_s"] = float(env["DESKVM_ADOPT_GRACE_S"])
            if env.get("DESKVM_ON_EXIT"):
                values["on_exit"] = env["DESKVM_ON_EXIT"]
            if env.get("DESKVM_SERVER_NAME"):
                values["server_name"] = env["DESKVM_SERVER_NAME"]
            if env.get("DESKVM_WARM_POOL"):
                values["warm_pool"] = env["DESKVM_WARM_POOL"]
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
        if not 0 < settings.token_ttl_s <= settings.token_max_ttl_s:
            raise ConfigError("token_ttl_s must be positive and at most token_max_ttl_s")
        if isinstance(settings.egress_upstream_dns, str):
            settings = settings.replace(egress_upstream_dns=split_csv(settings.egress_upstream_dns))
        if settings.on_exit not in ("close", "keep"):
            raise ConfigError(f"on_exit must be close or keep, not {settings.on_exit!r}")
        if not settings.session_max_ttl_s > 0 or settings.adopt_grace_s < 0:
            raise ConfigError("session_max_ttl_s must be positive and adopt_grace_s >= 0")
        if (
            settings.session_ttl_s is not None
            and settings.session_ttl_s > settings.session_max_ttl_s
        ):
            raise ConfigError(
                f"the default session ttl ({settings.session_ttl_s:g} s) is above the maximum "
                f"({settings.session_max_ttl_s:g} s)"
            )
        if bool(settings.egress_upstream_iface) != bool(settings.egress_upstream_dns):
            raise ConfigError(
                "egress needs both an upstream interface and upstream DNS servers "
                "(--egress-upstream-iface IFACE --egress-upstream-dns IP[,IP])"
            )
        return settings

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)
