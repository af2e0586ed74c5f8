"""Frozen value types that describe what a session is made of.

These cross layers (server -> session -> seams); they hold no I/O and validate
themselves on construction, raising :class:`~orchestrator.errors.ConfigError`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from agent_bridge.protocol.keys import KEYBOARD_LAYOUTS, KeyboardLayout
from orchestrator.errors import ConfigError

__all__ = [
    "AUTOSTARTS",
    "MAX_DISPLAY_PX",
    "MAX_EGRESS_ENTRIES",
    "MIN_DISPLAY_MEMORY_KIB",
    "MIN_DISPLAY_PX",
    "Autostart",
    "BootImage",
    "BootMode",
    "CidrAllow",
    "DisplaySpec",
    "DomainAllow",
    "EgressPolicy",
    "ReadyCheck",
    "ReadyRegion",
    "SessionSpec",
    "check_display_size",
    "display_memory_kib",
    "new_session_id",
    "parse_egress_entry",
    "validate_session_id",
]

MIN_DISPLAY_PX = 320

Autostart = Literal["input-probe"]
"""What the guest starts instead of the xterm (kernel ``deskvm.autostart=NAME``, see the
image recipe): ``input-probe`` is the full-screen input probe that reports every input as
JSON lines on the guest log."""

AUTOSTARTS: tuple[str, ...] = get_args(Autostart)
"""The closed set of :data:`Autostart` names."""
MAX_DISPLAY_PX = 4096
MIN_DISPLAY_MEMORY_KIB = 16 * 1024
"""QEMU's default stdvga memory (``vgamem_mb=16``): the least a session gets."""

_SESSION_ID_RE = re.compile(r"^[a-z0-9]{12}$")


def new_session_id() -> str:
    """A fresh random session id: 12 lowercase base32-ish characters (60 bits).

    Short enough to fit in a Linux interface name (``dvm-<id>`` is 16 bytes with NUL).
    """
    import secrets

    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(12))


def validate_session_id(session_id: str) -> str:
    """Return ``session_id`` if it has the shape :func:`new_session_id` makes.

    Raises:
        ConfigError: otherwise (ids end up in file names, domain names, nft tables).
    """
    if not _SESSION_ID_RE.match(session_id):
        raise ConfigError(f"invalid session id {session_id!r}: expected 12 of [a-z0-9]")
    return session_id


def display_memory_kib(width_px: int, height_px: int) -> int:
    """Video memory a stdvga display of ``width_px`` x ``height_px`` needs, KiB.

    Room for *two* 32-bit framebuffers: the guest's bochs DRM driver refuses any mode for
    which two do not fit (it keeps one for page flipping), so with QEMU's default 16 MiB a
    3840x2160 request came up as 1920x1440, the largest mode that fitted. Rounded up to a
    power of two (QEMU's ``vgamem_mb`` is one), at least :data:`MIN_DISPLAY_MEMORY_KIB`;
    4096x4096 needs 128 MiB.
    """
    need_kib = 2 * width_px * height_px * 4 // 1024
    kib = MIN_DISPLAY_MEMORY_KIB
    while kib < need_kib:
        kib *= 2
    return kib


def check_display_size(width_px: int, height_px: int, *, memory_kib: int | None = None) -> None:
    """Refuse a display size that would not work, before anything starts.

    The one place that says which sizes work: at session creation (:class:`DisplaySpec`)
    and for a running guest's resolution change, whose video memory was sized at boot.

    Args:
        width_px, height_px: the size (integers, pixels).
        memory_kib: the display device's memory when it is already fixed (a running
            session's), else ``None`` (it is sized from the request: :func:`display_memory_kib`).

    Raises:
        ConfigError: not an integer; outside ``MIN_DISPLAY_PX..MAX_DISPLAY_PX``; width not a
            multiple of 8; or two framebuffers of that size do not fit ``memory_kib``.
    """
    for name, value in (("width", width_px), ("height", height_px)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"display {name} must be an integer, got {value!r}")
        if not MIN_DISPLAY_PX <= value <= MAX_DISPLAY_PX:
            raise ConfigError(
                f"display {name} {value}px is outside {MIN_DISPLAY_PX}..{MAX_DISPLAY_PX}"
            )
    if width_px % 8:
        raise ConfigError(f"display width {width_px}px must be a multiple of 8")
    need_kib = display_memory_kib(width_px, height_px)
    if memory_kib is not None and need_kib > memory_kib:
        raise ConfigError(
            f"display {width_px}x{height_px} needs {need_kib // 1024} MiB of video memory; "
            f"this session's display has {memory_kib // 1024} MiB (sized for the display it "
            "was created with): create a session with the larger display instead"
        )


@dataclass(frozen=True, slots=True)
class DisplaySpec:
    """The guest's screen size in pixels (origin top-left); see :func:`check_display_size`."""

    width_px: int = 1280
    height_px: int = 800

    def __post_init__(self) -> None:
        check_display_size(self.width_px, self.height_px)

    @property
    def memory_kib(self) -> int:
        """The display device's memory for this size, KiB (:func:`display_memory_kib`)."""
        return display_memory_kib(self.width_px, self.height_px)


BootMode = Literal["direct", "bios", "uefi"]
"""How an image boots: ``direct`` (the host passes kernel, initrd and command line; deskvm's
own builds), ``bios`` or ``uefi`` (the image's own boot loader; imported images)."""


@dataclass(frozen=True, slots=True)
class ReadyRegion:
    """A full-width band of the screen that must be drawn before the desktop counts as ready.

    Attributes:
        name: what the band shows, e.g. ``"panel"`` (named in "not ready" reasons).
        top_px: first row of the band, guest pixels from the top; negative counts from the
            bottom edge (``-28``: the last 28 rows start there).
        height_px: rows in the band.
        min_foreground_share: share (0..1) of the band's pixels that must differ from the
            desktop background.
        min_colours: distinct colours the band must show (a panel draws items, a blank
            strip does not).
    """

    name: str
    top_px: int
    height_px: int
    min_foreground_share: float = 0.9
    min_colours: int = 3


@dataclass(frozen=True, slots=True)
class ReadyCheck:
    """The host's frame check once the guest reported ``DESKVM_READY`` (per image).

    Attributes:
        min_background_share: share (0..1) of the screen that must be the background colour.
        min_window_share: share (0..1) that must not be (windows are drawn).
        regions: bands that must be drawn as well (e.g. the panel).
    """

    min_background_share: float = 0.10
    min_window_share: float = 0.01
    regions: tuple[ReadyRegion, ...] = ()


@dataclass(frozen=True, slots=True)
class BootImage:
    """A built, read-only base image and what is needed to boot it directly.

    Attributes:
        name: recipe name, e.g. ``"debian12-desktop"``.
        content_hash: sha256 hex of the recipe (and builder) the image was built from.
        base_path: qcow2 base disk; sessions put an overlay on it and never write to it.
        kernel_path: kernel for direct boot (``vmlinuz``); ``None`` unless ``boot`` is
            ``"direct"``.
        initrd_path: initial ramdisk for direct boot; ``None`` unless ``boot`` is ``"direct"``.
        kernel_cmdline: base kernel command line; the session appends its own parameters
            (``deskvm.display=WxH``). Images that boot themselves get those parameters as
            SMBIOS OEM strings instead.
        background_rgb: the desktop's root-window colour, used by the readiness frame check.
        helper_port: the virtio-serial port name the image's guest helper serves (text with
            no key on the US layout, horizontal wheel), or ``None`` for an image without one.
        ready: the rest of the readiness frame check (shares, bands such as a panel).
        boot: ``direct``, ``bios`` or ``uefi`` (:data:`BootMode`).
        keyboard_layout: the XKB layout the image's X server starts with (its recipe's
            ``desktop.keyboard_layout``); a session may ask for another.
    """

    name: str
    content_hash: str
    base_path: Path
    kernel_path: Path | None
    initrd_path: Path | None
    kernel_cmdline: str = "root=/dev/vda rw console=ttyS0,115200"
    background_rgb: tuple[int, int, int] = (0x2E, 0x4A, 0x62)
    helper_port: str | None = None
    ready: ReadyCheck = field(default_factory=ReadyCheck)
    boot: BootMode = "direct"
    keyboard_layout: str = "us"

    def __post_init__(self) -> None:
        if self.boot == "direct" and (self.kernel_path is None or self.initrd_path is None):
            raise ConfigError(f"image {self.name!r} boots directly but has no kernel/initrd")


MAX_EGRESS_ENTRIES = 256

_LABEL_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_PORT_RE = re.compile(r"^[0-9]{1,5}$")


@dataclass(frozen=True, slots=True)
class CidrAllow:
    """A parsed ``CIDR[:port]`` allow entry.

    Attributes:
        entry: the entry as written by the client.
        network: the destination network (host bits must be zero).
        port: TCP destination port, or ``None`` for any port.
    """

    entry: str
    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None


@dataclass(frozen=True, slots=True)
class DomainAllow:
    """A parsed domain allow entry (``example.org`` or ``*.example.org``, optional ``:port``).

    Attributes:
        entry: the entry as written by the client.
        name: lower-case ASCII (punycode) name without the ``*.`` and without a trailing dot.
        wildcard: ``True`` for ``*.name``: any subdomain of ``name`` (not ``name`` itself).
        port: TCP destination port, or ``None`` for any port.
    """

    entry: str
    name: str
    wildcard: bool
    port: int | None


def _parse_port(entry: str, text: str) -> int:
    if not _PORT_RE.match(text) or not 1 <= int(text) <= 65535:
        raise ConfigError(f"egress entry {entry!r}: port {text!r} is not in 1..65535")
    return int(text)


# Never allowed, whatever the entry says (loopback, link-local incl. cloud metadata,
# multicast, unspecified/reserved). Private ranges are allowed when an entry names them.
_NEVER_ALLOWED: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::/128",
        "::1/128",
        "fe80::/10",
        "ff00::/8",
        "::ffff:0:0/96",
    )
)


def _parse_cidr(entry: str) -> CidrAllow:
    text, port_text = entry, None
    if entry.startswith("["):
        close = entry.find("]")
        if close < 0:
            raise ConfigError(f"egress entry {entry!r}: missing ']'")
        text, rest = entry[1:close], entry[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"egress entry {entry!r}: expected ':port' after ']'")
            port_text = rest[1:]
        if ":" not in text:
            raise ConfigError(f"egress entry {entry!r}: brackets are for IPv6 only")
    elif entry.count(":") == 1:
        text, port_text = entry.split(":")
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ConfigError(f"egress entry {entry!r}: not a valid CIDR ({exc})") from exc
    port = _parse_port(entry, port_text) if port_text is not None else None
    for never in _NEVER_ALLOWED:
        if network.version == never.version and network.subnet_of(never):  # type: ignore[arg-type]
            raise ConfigError(
                f"egress entry {entry!r}: {never} is always denied (loopback, link-local,"
                " multicast or reserved)"
            )
    return CidrAllow(entry=entry, network=network, port=port)


def _parse_domain(entry: str) -> DomainAllow:
    text, port = entry, None
    if ":" in entry:
        text, port_text = entry.rsplit(":", 1)
        port = _parse_port(entry, port_text)
    text = text.lower()
    wildcard = text.startswith("*.")
    name = text[2:] if wildcard else text
    name = name.removesuffix(".")
    labels = name.split(".")
    if len(name) > 253 or len(labels) < 2:
        raise ConfigError(f"egress entry {entry!r}: a domain needs at least two labels")
    for label in labels:
        if not _LABEL_RE.match(label):
            raise ConfigError(
                f"egress entry {entry!r}: label {label!r} is not a valid DNS label"
                " (ASCII letters, digits, '-'; use punycode for IDNs)"
            )
    if labels[-1].isdigit():
        raise ConfigError(f"egress entry {entry!r}: looks like an address, not a domain")
    return DomainAllow(entry=entry, name=name, wildcard=wildcard, port=port)


def parse_egress_entry(entry: str) -> CidrAllow | DomainAllow:
    """Parse one allow entry.

    Accepted forms: ``198.51.100.0/24``, ``198.51.100.7/32:443``, ``2001:db8::/32``,
    ``[2001:db8::/32]:443``, ``example.org``, ``*.example.org``, ``example.org:443``.
    A bare address counts as a host network (``/32`` or ``/128``). Ports are TCP ports
    (only TCP is ever forwarded).

    Args:
        entry: one entry as sent by the client.

    Returns:
        A :class:`CidrAllow` or a :class:`DomainAllow`.

    Raises:
        ConfigError: the entry is malformed or names an always-denied range; the message
            names the entry.
    """
    if not isinstance(entry, str):
        raise ConfigError(f"egress entry {entry!r}: must be a string")
    stripped = entry.strip()
    if not stripped or len(stripped) > 300 or any(c.isspace() for c in stripped):
        raise ConfigError(f"egress entry {entry!r}: empty, too long or contains spaces")
    body = stripped.rsplit(":", 1)[0] if stripped.count(":") == 1 else stripped
    if stripped.startswith("[") or stripped.count(":") > 1 or "/" in body:
        return _parse_cidr(stripped)
    head = body.removeprefix("*.")
    if all(c.isdigit() or c == "." for c in head):
        return _parse_cidr(stripped)
    return _parse_domain(stripped)


@dataclass(frozen=True, slots=True)
class EgressPolicy:
    """Network egress a session is allowed (default: none, and then no NIC at all).

    Validated on construction: a malformed entry raises :class:`ConfigError` naming it.
    Whatever the entries say, loopback, link-local (169.254.0.0/16, cloud metadata) and the
    host's own addresses stay denied, and private/shared ranges (RFC 1918, RFC 6598) only
    open to a CIDR entry that lies inside them.

    Attributes:
        allow: allowlist entries, each ``CIDR[:port]`` or a domain (``example.org``,
            ``*.example.org``, optionally ``:port``); see :func:`parse_egress_entry`.
    """

    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.allow, str) or not isinstance(self.allow, tuple | list):
            raise ConfigError("egress allow must be a list of entries, not a single string")
        if len(self.allow) > MAX_EGRESS_ENTRIES:
            raise ConfigError(f"egress allow has more than {MAX_EGRESS_ENTRIES} entries")
        object.__setattr__(self, "allow", tuple(self.allow))
        for entry in self.allow:
            parse_egress_entry(entry)

    @property
    def entries(self) -> tuple[CidrAllow | DomainAllow, ...]:
        """All entries, parsed, in the order given."""
        return tuple(parse_egress_entry(entry) for entry in self.allow)

    @property
    def cidrs(self) -> tuple[CidrAllow, ...]:
        """The ``CIDR[:port]`` entries, parsed."""
        return tuple(e for e in self.entries if isinstance(e, CidrAllow))

    @property
    def domains(self) -> tuple[DomainAllow, ...]:
        """The domain entries, parsed."""
        return tuple(e for e in self.entries if isinstance(e, DomainAllow))


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """Everything needed to start one disposable session.

    Attributes:
        session_id: from :func:`new_session_id`; labels every host object of the session.
        image: the resolved base image.
        display: guest screen size.
        memory_mib: guest RAM in MiB (hard limit enforced by the host).
        vcpus: virtual CPUs.
        boot_timeout_s: deadline for the desktop to be drawn.
        egress: ``None`` means no network device at all.
        cpu_quota_pct: share of host CPU time the whole domain may use, in percent of one
            host core (``100`` = one core, ``vcpus * 100`` = no throttling); rendered as
            libvirt ``<cputune><global_period>``/``<global_quota>`` (CFS bandwidth).
            ``None``: no quota.
        memory_overhead_mib: QEMU's own memory on top of guest RAM (device models, the
            256 MiB TCG translation cache); the host hard limit is
            ``memory_mib + memory_overhead_mib``
            (libvirt ``<memtune><hard_limit>``, the cgroup's ``memory.limit_in_bytes``).
        disk_mib: the overlay's virtual size in MiB: the guest can never write more, and the
            host checks this much space is free before start. ``None``: the base image's
            virtual size. Never smaller than the base image.
        ttl_s: maximum lifetime in seconds from creation; ``None``: unlimited.
        idle_timeout_s: the session ends after this many seconds without an action;
            ``None``: never.
        autostart: what the guest starts instead of the xterm (one of
            :data:`AUTOSTARTS`); ``None``: the xterm. Decides the readiness criterion.
        guest_control: whether the guest control plane (exec, files, clipboard, windows,
            accessibility tree, resolution; :mod:`agent_bridge.protocol.guest`) may be used
            on this session. Off by default; fixed at creation.
        keyboard_layout: the guest's keyboard layout for this session (one of
            :data:`~agent_bridge.protocol.keys.KEYBOARD_LAYOUTS`), passed to the guest as
            ``deskvm.keyboard_layout=NAME``; ``None``: the image's. Typing and key combos
            follow it (:attr:`layout`).
    """

    session_id: str
    image: BootImage
    display: DisplaySpec = field(default_factory=DisplaySpec)
    memory_mib: int = 2048
    vcpus: int = 2
    boot_timeout_s: float = 180.0
    egress: EgressPolicy | None = None
    cpu_quota_pct: int | None = None
    memory_overhead_mib: int = 768
    disk_mib: int | None = None
    ttl_s: float | None = None
    idle_timeout_s: float | None = None
    autostart: Autostart | None = None
    guest_control: bool = False
    keyboard_layout: KeyboardLayout | None = None

    def __post_init__(self) -> None:
        validate_session_id(self.session_id)
        if self.keyboard_layout is not None and self.keyboard_layout not in KEYBOARD_LAYOUTS:
            raise ConfigError(
                f"keyboard_layout {self.keyboard_layout!r} is not one of: "
                f"{', '.join(KEYBOARD_LAYOUTS)}"
            )
        if self.layout not in KEYBOARD_LAYOUTS:
            raise ConfigError(
                f"image {self.image.name!r} has keyboard layout {self.layout!r}, which deskvm "
                f"has no key table for; ask for keyboard_layout one of: "
                f"{', '.join(KEYBOARD_LAYOUTS)}"
            )
        if self.autostart is not None and self.autostart not in AUTOSTARTS:
            raise ConfigError(
                f"autostart {self.autostart!r} is not one of: {', '.join(AUTOSTARTS)}"
            )
        if self.cpu_quota_pct is not None and not 1 <= self.cpu_quota_pct <= 100 * self.vcpus:
            raise ConfigError(
                f"cpu_quota_pct {self.cpu_quota_pct} is outside 1..{100 * self.vcpus}"
                f" (100 per vCPU)"
            )
        if not 64 <= self.memory_overhead_mib <= 8192:
            raise ConfigError(f"memory_overhead_mib {self.memory_overhead_mib} is outside 64..8192")
        if self.disk_mib is not None and not 256 <= self.disk_mib <= 1024 * 1024:
            raise ConfigError(f"disk_mib {self.disk_mib} is outside 256..1048576")
        for name, value in (("ttl_s", self.ttl_s), ("idle_timeout_s", self.idle_timeout_s)):
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive (or null for no limit)")
        if not 256 <= self.memory_mib <= 65536:
            raise ConfigError(f"memory_mib {self.memory_mib} is outside 256..65536")
        if not 1 <= self.vcpus <= 16:
            raise ConfigError(f"vcpus {self.vcpus} is outside 1..16")
        if self.boot_timeout_s <= 0:
            raise ConfigError("boot_timeout_s must be positive")

    @property
    def layout(self) -> str:
        """The guest's keyboard layout: :attr:`keyboard_layout`, else the image's."""
        return self.keyboard_layout or self.image.keyboard_layout
