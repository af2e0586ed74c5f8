"""Value types and the seam of the egress subsystem.

The session composes an :class:`Egress` (constructor-injected): :class:`NftEgress` on a
real host, :class:`FakeEgress` in in-process tests. Errors of the tools behind the seam
(``nft``, ``ip``, ``dnsmasq``, ``ulogd``) are translated to
:class:`~orchestrator.errors.EgressError` where they enter.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from orchestrator.errors import ConfigError
from orchestrator.spec import EgressPolicy

__all__ = [
    "BRIDGE_PREFIX",
    "GUEST_PORT_PREFIX",
    "RETRY_WINDOW_S",
    "DecisionKind",
    "Egress",
    "EgressAttachment",
    "EgressSettings",
    "NetworkDecision",
    "bridge_name",
    "check_guest_mac",
    "guest_port_name",
    "is_link_chatter",
    "merge_retries",
    "summarise_link_chatter",
]

GUEST_PORT_PREFIX = "dvg"
"""The guest's bridge port (tap) is ``dvg<session_id>``; libvirt names it from
``<target dev='dvg<id>'/>``."""

BRIDGE_PREFIX = "dvm"
"""Bridge names are ``dvm<session_id>``: 15 bytes, the Linux maximum (IFNAMSIZ - 1).

``dvm-<id>`` would be 16 bytes and is refused by the kernel."""

_IFACE_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,15}$")
_MAC_RE = re.compile(r"^[0-9a-f]{2}(?::[0-9a-f]{2}){5}$")

DecisionKind = Literal["dns_answered", "dns_refused", "conn_allowed", "conn_dropped"]


def bridge_name(session_id: str) -> str:
    """The session's bridge name, ``dvm<session_id>`` (15 bytes)."""
    return f"{BRIDGE_PREFIX}{session_id}"


def guest_port_name(session_id: str) -> str:
    """The guest's tap / bridge port name, ``dvg<session_id>`` (15 bytes)."""
    return f"{GUEST_PORT_PREFIX}{session_id}"


def check_guest_mac(mac: str) -> str:
    """``mac`` if it is a lower-case, colon-separated unicast MAC (a guest NIC's).

    Raises:
        ConfigError: anything else (a group address would let one guest speak for many).
    """
    if not _MAC_RE.match(mac) or int(mac[:2], 16) & 1:
        raise ConfigError(f"invalid guest MAC {mac!r} (want a unicast aa:bb:cc:dd:ee:ff)")
    return mac


@dataclass(frozen=True, slots=True)
class EgressSettings:
    """Host-wide egress configuration (read once by the CLI / server, passed in).

    Attributes:
        upstream_iface: the only interface allowed traffic may leave by
            (``--egress-upstream-iface``).
        upstream_dns: resolvers the per-session dnsmasq forwards allowlisted names to,
            reached through ``upstream_iface`` (``--egress-upstream-dns IP[,IP]``).
        masquerade: source-NAT session traffic to the upstream interface's address.
        subnet_pool: IPv4 pool carved into one /30 per session (gateway ``.1``, guest ``.2``).
        state_dir: this installation's directory: per-session files (dnsmasq/ulogd pid,
            lease, log, config) live in ``state_dir/<session_id>/``. Its path also names the
            installation's nft tables when no owner is given (see ``NftEgress``).
        host_dir: the host-wide directory every installation on the host shares (slots,
            the saved IP forwarding value, the lock; see :mod:`orchestrator.egress.host`).
            Keep the default: installations with different ``host_dir`` could collide.
        nflog_group_base: NFLOG group of slot 0; slot ``n`` logs to ``base + n``.
        drop_log_rate_per_s: drops logged per second per rule (bursts twice that); the
            drop itself is never rate limited.
        dnsmasq_path: dnsmasq binary (Debian ``dnsmasq-base``).
        ulogd_path: ulogd binary (Debian ``ulogd2`` + ``ulogd2-json``).
        ulogd_plugin_dir: where ulogd's ``ulogd_*.so`` plugins are.
    """

    upstream_iface: str
    upstream_dns: tuple[str, ...]
    masquerade: bool = True
    subnet_pool: str = "10.213.0.0/16"
    state_dir: Path = Path("/run/deskvm/egress")
    host_dir: Path = Path("/run/deskvm/net")
    nflog_group_base: int = 32768
    drop_log_rate_per_s: int = 100
    dnsmasq_path: str = "/usr/sbin/dnsmasq"
    ulogd_path: str = "/usr/sbin/ulogd"
    ulogd_plugin_dir: Path = Path("/usr/lib/x86_64-linux-gnu/ulogd")

    def __post_init__(self) -> None:
        if not _IFACE_RE.match(self.upstream_iface) or self.upstream_iface.startswith(
            BRIDGE_PREFIX
        ):
            raise ConfigError(f"invalid egress upstream interface {self.upstream_iface!r}")
        if isinstance(self.upstream_dns, str):
            raise ConfigError("egress upstream_dns must be a tuple of addresses")
        object.__setattr__(self, "upstream_dns", tuple(self.upstream_dns))
        if not self.upstream_dns:
            raise ConfigError("egress needs at least one upstream DNS server")
        for server in self.upstream_dns:
            try:
                ipaddress.ip_address(server)
            except ValueError as exc:
                raise ConfigError(f"egress upstream DNS {server!r} is not an address") from exc
        try:
            pool = ipaddress.IPv4Network(self.subnet_pool, strict=True)
        except ValueError as exc:
            raise ConfigError(f"egress subnet pool {self.subnet_pool!r}: {exc}") from exc
        if pool.prefixlen > 30:
            raise ConfigError("egress subnet pool must hold at least one /30")
        if not 1 <= self.nflog_group_base <= 65535 - self.slot_count + 1:
            raise ConfigError("egress nflog_group_base leaves no room for the pool's slots")
        if self.drop_log_rate_per_s < 1:
            raise ConfigError("egress drop_log_rate_per_s must be positive")

    @classmethod
    def from_cli(
        cls, upstream_iface: str, upstream_dns_csv: str, **overrides: object
    ) -> EgressSettings:
        """Build from ``--egress-upstream-iface IFACE --egress-upstream-dns IP[,IP]``.

        Raises:
            ConfigError: a value is malformed.
        """
        servers = tuple(s.strip() for s in upstream_dns_csv.split(",") if s.strip())
        return cls(upstream_iface=upstream_iface, upstream_dns=servers, **overrides)  # type: ignore[arg-type]

    @property
    def pool(self) -> ipaddress.IPv4Network:
        """The subnet pool as a network."""
        return ipaddress.IPv4Network(self.subnet_pool)

    @property
    def slot_count(self) -> int:
        """How many /30 session subnets the pool holds."""
        return int(2 ** (30 - ipaddress.IPv4Network(self.subnet_pool).prefixlen))


@dataclass(frozen=True, slots=True)
class EgressAttachment:
    """What the hypervisor needs to plug a guest into its session's filtered network.

    Attributes:
        session_id: the session this belongs to.
        bridge: Linux bridge name, ``dvm<session_id>``.
        guest_port: the name the guest's tap must have (``dvg<session_id>``): the bridge
            filter matches frames by this ingress port, so a NIC with another name gets
            no filtering of non-IP frames (the inet rules still apply).
        guest_mac: the MAC the guest NIC must use (frames from any other MAC are dropped).
        guest_ip: the address DHCP hands to ``guest_mac`` (IPv4, dotted quad).
        gateway_ip: the host's address on the bridge: default route, DHCP server and
            DNS resolver of the guest.
        prefix_len: the session subnet's prefix length (30).
        nflog_group: NFLOG group the session's nft log rules write to.
    """

    session_id: str
    bridge: str
    guest_port: str
    guest_mac: str
    guest_ip: str
    gateway_ip: str
    prefix_len: int
    nflog_group: int

    @property
    def resolver_ip(self) -> str:
        """The guest's only DNS resolver (the gateway)."""
        return self.gateway_ip

    def libvirt_interface_xml(self) -> str:
        """The libvirt domain ``<interface>`` element for this attachment (virtio NIC)."""
        return (
            "<interface type='bridge'>"
            f"<source bridge='{self.bridge}'/>"
            f"<target dev='{self.guest_port}'/>"
            f"<mac address='{self.guest_mac}'/>"
            "<model type='virtio'/>"
            "</interface>"
        )


@dataclass(frozen=True, slots=True)
class NetworkDecision:
    """One egress decision, for the session's recording and ``GET .../network``.

    Attributes:
        ts_ns: ``time.monotonic_ns()`` clock of this host. DNS decisions come from
            dnsmasq's log (1 s resolution), packet decisions from NFLOG (1 us).
        kind: what was decided.
        session_id: the session.
        reason: short machine-friendly reason (``"not-allowlisted"``, ``"cidr:0"``,
            ``"private"``, ``"nonip"``...).
        protocol: ``"tcp"``, ``"udp"``, ``"icmp"``, ``"ipv6"``, ``"arp"``, ``"ether:0x88b5"``...
            (``"dns"`` for DNS decisions).
        src / src_port / dst / dst_port: the packet's 5-tuple (ports ``None`` when the
            protocol has none).
        query: DNS name asked (DNS decisions only).
        qtype: DNS record type asked (``"A"``, ``"AAAA"``...).
        answers: addresses (or CNAME targets) given to the guest.
        attempts: how many times the guest sent this same request in a row (see
            :func:`merge_retries`); 1 for a decision as the logs give it.
        last_ts_ns: time of the last attempt (``None``: the same as ``ts_ns``).
    """

    ts_ns: int
    kind: DecisionKind
    session_id: str
    reason: str
    protocol: str
    src: str | None = None
    src_port: int | None = None
    dst: str | None = None
    dst_port: int | None = None
    query: str | None = None
    qtype: str | None = None
    answers: tuple[str, ...] = ()
    attempts: int = 1
    last_ts_ns: int | None = None

    @property
    def retry_key(self) -> tuple[object, ...]:
        """What a retransmission of the same request has in common with it."""
        return (
            self.kind, self.reason, self.protocol, self.src, self.src_port, self.dst,
            self.dst_port, self.query, self.qtype, self.answers,
        )  # fmt: skip


RETRY_WINDOW_S = 2.0
"""Requests repeated within this many seconds of the previous attempt are one decision."""


def merge_retries(
    decisions: list[NetworkDecision], *, window_s: float = RETRY_WINDOW_S
) -> list[NetworkDecision]:
    """One decision per request, however often the guest sent it.

    Guests repeat requests: systemd-resolved (Debian 12) asks every name that gets
    NXDOMAIN a second time, from the same port, at a lower EDNS feature level (its
    DVE-2018-0001 mitigation); TCP retransmits a SYN that is dropped; ``ping`` sends one
    echo per second. The logs show each datagram, so the same decision appeared several
    times with identical fields. Here a decision equal to an earlier one in everything but
    time (:attr:`NetworkDecision.retry_key`) that comes at most ``window_s`` after that
    one's last attempt is merged into it: ``attempts`` counts them, ``last_ts_ns`` is the
    last one's time. Nothing is dropped: the count says how often it was tried.

    Args:
        decisions: as the egress logs give them (any order).
        window_s: the longest pause between attempts of one request, seconds.

    Returns:
        The merged decisions, ordered by their first attempt.
    """
    window_ns = int(window_s * 1e9)
    out: list[NetworkDecision] = []
    open_by_key: dict[tuple[object, ...], int] = {}
    for decision in sorted(decisions, key=lambda d: d.ts_ns):
        key = decision.retry_key
        index = open_by_key.get(key)
        if index is not None:
            merged = out[index]
            last = merged.last_ts_ns if merged.last_ts_ns is not None else merged.ts_ns
            if decision.ts_ns - last <= window_ns:
                out[index] = dataclasses.replace(
                    merged,
                    attempts=merged.attempts + decision.attempts,
                    last_ts_ns=decision.last_ts_ns or decision.ts_ns,
                )
                continue
        open_by_key[key] = len(out)
        out.append(dataclasses.replace(decision, last_ts_ns=decision.last_ts_ns or decision.ts_ns))
    return out


LINK_SCOPE_MULTICAST_V6 = ipaddress.IPv6Network("ff02::/16")
"""IPv6 link-scope multicast (RFC 4291 scope 2): never routed past the guest's link."""


def is_link_chatter(decision: NetworkDecision) -> bool:
    """Whether ``decision`` is a dropped packet to an IPv6 link-scope multicast group.

    A guest's IPv6 stack sends these on its own whenever its NIC is up: router
    solicitations (``ff02::2``), duplicate address detection (neighbour solicitations to
    ``ff02::1:ffXX:XXXX`` from ``::``), MLD reports (``ff02::16``), and mDNS/LLMNR
    (``ff02::fb``, ``ff02::1:3``) where enabled. They can never leave the link; the
    bridge drops every one (IPv6 is dropped unless the policy names an IPv6 network, and
    multicast always).
    """
    if decision.kind != "conn_dropped" or decision.dst is None:
        return False
    try:
        address = ipaddress.ip_address(decision.dst)
    except ValueError:
        return False
    return address.version == 6 and address in LINK_SCOPE_MULTICAST_V6


def summarise_link_chatter(decisions: list[NetworkDecision]) -> list[NetworkDecision]:
    """The decisions with IPv6 link-scope multicast chatter summarised.

    Each dropped chatter packet kind (same kind, reason, protocol, source, group and port;
    :func:`is_link_chatter`) becomes one decision over the whole list: ``ts_ns`` is its
    first attempt, ``last_ts_ns`` its last, ``attempts`` the sum (nothing is lost, only
    folded: a guest re-soliciting a router every few minutes no longer adds an entry
    each time). Every other decision is kept as it is.

    Args:
        decisions: as :func:`merge_retries` gives them (any order).

    Returns:
        The summarised decisions, ordered by their first attempt.
    """
    out: list[NetworkDecision] = []
    by_key: dict[tuple[object, ...], int] = {}
    for decision in sorted(decisions, key=lambda d: d.ts_ns):
        if not is_link_chatter(decision):
            out.append(decision)
            continue
        key = decision.retry_key
        index = by_key.get(key)
        if index is None:
            by_key[key] = len(out)
            out.append(decision)
            continue
        first = out[index]
        last_ns = max(
            first.last_ts_ns if first.last_ts_ns is not None else first.ts_ns,
            decision.last_ts_ns if decision.last_ts_ns is not None else decision.ts_ns,
        )
        out[index] = dataclasses.replace(
            first, attempts=first.attempts + decision.attempts, last_ts_ns=last_ns
        )
    return out


@runtime_checkable
class Egress(Protocol):
    """Per-session filtered network: one bridge, one resolver, nft rules, a decision log."""

    def attach(
        self, session_id: str, policy: EgressPolicy, *, guest_mac: str | None = None
    ) -> EgressAttachment:
        """Create the session's bridge, rules, DHCP/DNS service and decision log.

        Cleans up what it created if any step fails.

        Args:
            session_id: from :func:`orchestrator.spec.new_session_id`.
            policy: the validated allowlist.
            guest_mac: the one MAC the bridge accepts and DHCP answers (``None``: the
                session's own, :func:`~orchestrator.egress.plan.guest_mac`). A warm start
                passes the MAC baked into the saved state it restores (a restore keeps
                the saved NIC's MAC); the bridge is the session's own, so two clones with
                one MAC never share a link.

        Returns:
            Where and how to plug the guest NIC.

        Raises:
            ConfigError: invalid session id or ``guest_mac``.
            EgressError: the host refused a step (nothing of the session is left).
        """
        ...

    def adopt(self, session_id: str, policy: EgressPolicy) -> EgressAttachment:
        """Take back the attached session of a server that restarted.

        The bridge, rules and logs stay as they are; a resolver or packet logger that did
        not survive the old server (e.g. its service's processes were killed with it) is
        started again with the same configuration. Decisions are read again from the
        start of the session's logs.

        Raises:
            EgressError: the session is not attached here (or by another installation),
                or its resolver/logger cannot be started.
        """
        ...

    def leased_ip(self, session_id: str) -> str | None:
        """The session's guest address once the session's DHCP server has leased it to
        the guest MAC, else ``None`` (no lease yet; a lease of anything else is none).
        The guest's word that it took it is not asked for: the rules only pass the
        session's guest address anyway.

        Raises:
            EgressError: the session is not attached.
        """
        ...

    def detach(self, session_id: str) -> None:
        """Remove everything of the session; idempotent, runs every step.

        Raises:
            EgressError: after running every step, naming the steps that failed.
        """
        ...

    def decisions(self, session_id: str) -> list[NetworkDecision]:
        """All decisions of the attached session so far, oldest first.

        Raises:
            EgressError: the session is not attached or its logs cannot be read.
        """
        ...

    def reap(self, live_session_ids: frozenset[str]) -> list[str]:
        """Remove leftovers labelled with session ids not in ``live_session_ids``.

        Returns:
            The session ids that were reaped, sorted.

        Raises:
            EgressError: some leftover could not be removed.
        """
        ...
