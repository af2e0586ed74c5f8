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
``DESKVM_SERVER_NAME``, ``DESKVM_WARM_POOL`` (``IMAGE:N[,IMAGE:N...]``).

``deskvm serve`` also reads a TOML config file (:func:`read_serve_config`: ``--config
PATH``, else ``DESKVM_CONFIG``, else :data:`DEFAULT_CONFIG` when it exists). Precedence:
the file, then the environment, then command-line flags.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrator.errors import ConfigError

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_STATE_DIR",
    "MAX_POOL_SIZE",
    "PoolTarget",
    "ServeConfig",
    "Settings",
    "parse_warm_pool",
    "read_serve_config",
    "split_csv",
]

DEFAULT_STATE_DIR = Path("/var/lib/deskvm")
DEFAULT_CONFIG = Path("/etc/deskvm/serve.toml")
"""Where ``deskvm serve`` looks for its config file when neither ``--config`` nor
``DESKVM_CONFIG`` names one (a missing default file is no error)."""
MAX_POOL_SIZE = 64
"""The most desktops one warm pool target may keep ready."""


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """How many ready desktops of one kind the warm pool keeps (``orchestrator.pool``).

    Attributes:
        image: image name.
        size: desktops kept ready (1..:data:`MAX_POOL_SIZE`).
        width_px, height_px: their display, guest pixels (checked as a session's display
            when the pool is built).
        memory_mib: guest RAM, MiB (256..1048576).
        vcpus: guest CPUs (1..64).
        egress: for sessions with an egress policy: the pool keeps one *saved* desktop
            with a NIC (no restored ones: each claim restores it onto the session's own
            network, see ``orchestrator.pool``), so ``size`` must be 1.

    The defaults are those of ``POST /v1/sessions``: a session matches a pooled desktop
    when it asks for the same image, display, memory and vCPUs, and has an egress policy
    exactly when the target has ``egress``.

    Raises:
        ConfigError: a value is out of range (the message names the field).
    """

    image: str
    size: int
    width_px: int = 1280
    height_px: int = 800
    memory_mib: int = 2048
    vcpus: int = 2
    egress: bool = False

    def __post_init__(self) -> None:
        if not self.image:
            raise ConfigError("warm pool image: must not be empty")
        if self.egress and self.size != 1:
            raise ConfigError(
                f"warm pool size {self.size} of an egress target: must be 1 (it keeps one "
                "saved desktop, restored at each claim)"
            )
        if not 1 <= self.size <= MAX_POOL_SIZE:
            raise ConfigError(f"warm pool size {self.size} is outside 1..{MAX_POOL_SIZE}")
        if not 256 <= self.memory_mib <= 1 << 20:
            raise ConfigError(f"warm pool memory_mib {self.memory_mib} is outside 256..1048576")
        if not 1 <= self.vcpus <= 64:
            raise ConfigError(f"warm pool vcpus {self.vcpus} is outside 1..64")
        if self.width_px < 1 or self.height_px < 1:
            raise ConfigError("warm pool width_px and height_px must be positive")

    @property
    def shape(self) -> tuple[str, int, int, int, int, bool]:
        """What tells two targets apart: image, display, memory, vCPUs, egress or not."""
        return (
            self.image, self.width_px, self.height_px, self.memory_mib, self.vcpus, self.egress
        )  # fmt: skip


def parse_warm_pool(text: str) -> tuple[PoolTarget, ...]:
    """Parse ``IMAGE:N|IMAGE:egress[,...]`` (``deskvm serve --warm-pool``,
    ``DESKVM_WARM_POOL``): ``IMAGE:N`` keeps ``N`` desktops without network ready,
    ``IMAGE:egress`` keeps one saved desktop for sessions with an egress policy.

    Raises:
        ConfigError: an entry is neither ``IMAGE:N`` with ``N`` in 1..64 nor
            ``IMAGE:egress``, or an image repeats with the same kind.
    """
    targets: list[PoolTarget] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        image, sep, count = entry.rpartition(":")
        egress = count == "egress"
        if not sep or not image or not (count.isdigit() or egress):
            raise ConfigError(
                f"warm pool entry {entry!r} is not IMAGE:N or IMAGE:egress "
                "(e.g. debian12-desktop:2)"
            )
        if any(t.image == image and t.egress == egress for t in targets):
            raise ConfigError(f"warm pool names image {image!r} twice")
        targets.append(PoolTarget(image=image, size=1 if egress else int(count), egress=egress))
    return tuple(targets)


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
        warm_pool: desktops to keep restored and ready (see ``orchestrator.pool``);
            ``()``: none, every session boots cold. A string ``IMAGE:N[,IMAGE:N...]``
            (``deskvm serve --warm-pool``, ``DESKVM_WARM_POOL``) is parsed
            (:func:`parse_warm_pool`); the config file's ``[[warm_pool]]`` tables also
            give display, memory and vCPUs.
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
    warm_pool: tuple[PoolTarget, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.warm_pool, str):
            object.__setattr__(self, "warm_pool", parse_warm_pool(self.warm_pool))
        shapes = [t.shape for t in self.warm_pool]
        if len(set(shapes)) != len(shapes):
            raise ConfigError("the warm pool names the same image, display, memory and vCPUs twice")

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
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> Settings:
        """Settings from ``config`` (a config file's, :attr:`ServeConfig.settings`), then
        ``DESKVM_*`` variables, then ``overrides`` (not ``None`` ones).

        Raises:
            ConfigError: a variable has a malformed value.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = dict(config or {})
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


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What a ``deskvm serve`` config file says.

    Attributes:
        path: the file read (``None``: none was, the default file does not exist).
        settings: :class:`Settings` field -> value, checked and converted (for
            :meth:`Settings.from_env`'s ``config``).
        host, port: where to listen (``None``: not in the file).
    """

    path: Path | None = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    host: str | None = None
    port: int | None = None


_FILE_NAMES = {"images_dir": "images_dir_override"}
"""Config file keys spelled differently from their :class:`Settings` field."""
_NOT_IN_FILE = {
    "token": "keep the admin token out of config files (DESKVM_TOKEN, --token or the token file)",
    "images_dir_override": "spell it images_dir",
    "warm_pool": "give the pool as [[warm_pool]] tables (image, size, width_px, "
    "height_px, memory_mib, vcpus)",
}
_POOL_KEYS = {"image": str, "size": int, "width_px": int, "height_px": int,
              "memory_mib": int, "vcpus": int, "egress": bool}  # fmt: skip


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _convert(where: str, hint: Any, value: Any) -> Any:
    """``value`` (as TOML gave it) as a value of type ``hint``; ConfigError naming ``where``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        converted = _convert(where, inner, value)
        if inner is float and converted == 0:  # as the environment: 0 means no limit
            return None
        return converted
    if typing.get_origin(hint) is Literal:
        if value not in args:
            choices = ", ".join(map(str, args))
            raise ConfigError(f"{where}: must be one of {choices}, not {_describe(value)}")
        return value
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: must be a list of strings, not {_describe(value)}")
        return tuple(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: must be a boolean (true or false), not {_describe(value)}")
    name = {float: "a number", int: "an integer", str: "a string", Path: "a path (string)"}[hint]
    if isinstance(value, bool):
        raise ConfigError(f"{where}: must be {name}, not a boolean")
    if hint is float and isinstance(value, int | float):
        return float(value)
    if hint is Path and isinstance(value, str) and value:
        return Path(value)
    if hint in (int, str) and isinstance(value, hint):
        return value
    raise ConfigError(f"{where}: must be {name}, not {_describe(value)}")


def read_serve_config(
    path: Path | None = None, env: Mapping[str, str] | None = None
) -> ServeConfig:
    """Read ``deskvm serve``'s TOML config file.

    The file is ``path``, else ``DESKVM_CONFIG``, else :data:`DEFAULT_CONFIG` if it
    exists. It has a ``[serve]`` table (``host``, ``port`` and the :class:`Settings`
    fields by name, ``images_dir`` for the images directory; ``0`` for ``session_ttl_s``
    and ``idle_timeout_s`` means no limit; no ``token``) and any number of
    ``[[warm_pool]]`` tables (``image``, ``size``; optional ``width_px``, ``height_px``,
    ``memory_mib``, ``vcpus``, ``egress``). See docs/protocol.md for an example.

    Raises:
        ConfigError: the named file is missing or unreadable, is not TOML, or has an
            unknown key or a value of the wrong type or range (the message names the file
            and the field, e.g. ``warm_pool[1].size``).
    """
    env = os.environ if env is None else env
    if path is None and env.get("DESKVM_CONFIG"):
        path = Path(env["DESKVM_CONFIG"])
    if path is None:
        if not DEFAULT_CONFIG.is_file():
            return ServeConfig()
        path = DEFAULT_CONFIG
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    for table in data:
        if table not in ("serve", "warm_pool"):
            raise ConfigError(
                f"{path}: unknown table or key {table!r} at the top (known: [serve], [[warm_pool]])"
            )
    hints = typing.get_type_hints(Settings)
    serve = data.get("serve", {})
    if not isinstance(serve, dict):
        raise ConfigError(f"{path}: serve must be a table ([serve])")
    values: dict[str, Any] = {}
    host = port = None
    for key, value in serve.items():
        where = f"{path}: serve.{key}"
        field_name = _FILE_NAMES.get(key, key)
        if key == "host":
            host = _convert(where, str, value)
        elif key == "port":
            port = _convert(where, int, value)
            if not 0 < port < 65536:
                raise ConfigError(f"{where}: {port} is not a TCP port (1..65535)")
        elif key in _NOT_IN_FILE:
            raise ConfigError(f"{where}: not allowed here: {_NOT_IN_FILE[key]}")
        elif field_name in hints:
            values[field_name] = _convert(where, hints[field_name], value)
        else:
            known = sorted({"host", "port", "images_dir"} | set(hints) - set(_NOT_IN_FILE))
            raise ConfigError(f"{where}: unknown setting (known: {', '.join(known)})")
    pool = data.get("warm_pool", [])
    if not isinstance(pool, list):
        raise ConfigError(f"{path}: warm_pool must be an array of tables ([[warm_pool]])")
    targets: list[PoolTarget] = []
    for n, entry in enumerate(pool):
        where = f"{path}: warm_pool[{n}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be a table ([[warm_pool]])")
        kwargs: dict[str, Any] = {}
        for key, value in entry.items():
            if key not in _POOL_KEYS:
                raise ConfigError(
                    f"{where}.{key}: unknown setting (known: {', '.join(_POOL_KEYS)})"
                )
            kwargs[key] = _convert(f"{where}.{key}", _POOL_KEYS[key], value)
        for key in ("image", "size"):
            if key not in kwargs:
                raise ConfigError(f"{where}.{key}: missing")
        try:
            targets.append(PoolTarget(**kwargs))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc.message}") from exc
    if targets:
        values["warm_pool"] = tuple(targets)
    return ServeConfig(path=path, settings=values, host=host, port=port)
