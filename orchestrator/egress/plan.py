"""Pure planning: addresses, the nftables ruleset, dnsmasq and ulogd configuration.

Nothing here does I/O; :class:`~orchestrator.egress.nftables.NftEgress` applies the text
these functions return (``nft -f -``) and the argv they build. Golden-file tests pin the
output (``tests/egress/golden/``).

Names. Each deskvm *installation* (its egress state directory) has its own table,
``inet deskvm_<tag>`` (:func:`installation_table`, ``tag`` from :func:`installation_tag`),
holding the per-session chains ``fwd_<id>``, ``back_<id>``, ``in_<id>``, ``post_<id>``,
``nat_<id>``, sets ``d4_<id>_<port>`` / ``d6_<id>_<port>`` and counters ``out_up_<id>`` /
``out_other_<id>``; each session also has its own ``bridge deskvm_<tag>_<id>`` table.
NFLOG prefixes are ``dvm:<id>:<A|D>:<reason>``.

One table is shared by every installation on the host: the *guard*, ``inet deskvm_guard``
(:func:`render_guard_ruleset`). IP forwarding is a host-wide switch; while any deskvm
session has a network, the guard's forward hook drops every forwarded packet that neither
comes from nor goes to a registered session bridge (set ``bridges``), so switching
forwarding on never makes the host a router for anything else. An installation's own
forward hook judges only its own bridges (verdict maps) and lets other traffic through to
the guard; nftables runs every base chain of a hook and any drop is final, so a packet of
a session must be accepted by its installation's chains *and* by the guard. A bridge joins
the guard's set only after its session's chains exist and leaves it before they go.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.spec import CidrAllow, DomainAllow, EgressPolicy

__all__ = [
    "BASE_TABLE",
    "GUARD_TABLE",
    "NEVER_V4",
    "NEVER_V6",
    "PRIVATE_V4",
    "PRIVATE_V6",
    "SessionPlan",
    "dnsmasq_argv",
    "evaluate_connection",
    "guest_mac",
    "installation_table",
    "installation_tag",
    "refused_answer_ranges",
    "render_base_ruleset",
    "render_guard_join",
    "render_guard_leave",
    "render_guard_ruleset",
    "render_session_ruleset",
    "render_session_teardown",
    "session_bridge_table",
    "slot_addresses",
    "ulogd_config",
]

BASE_TABLE = "deskvm"
"""Prefix of every deskvm nftables table."""
GUARD_TABLE = f"{BASE_TABLE}_guard"
"""The host-wide guard table (``inet``), shared by every installation."""


def installation_tag(state_dir: str) -> str:
    """A short, stable tag of one installation: 8 hex digits of SHA-256 of its egress
    state directory (an absolute path)."""
    return hashlib.sha256(state_dir.encode()).hexdigest()[:8]


def installation_table(tag: str) -> str:
    """The ``inet`` table of the installation with ``tag``: ``deskvm_<tag>``."""
    return f"{BASE_TABLE}_{tag}"


def session_bridge_table(tag: str, session_id: str) -> str:
    """The session's ``bridge`` table: ``deskvm_<tag>_<session_id>``."""
    return f"{BASE_TABLE}_{tag}_{session_id}"


Net = ipaddress.IPv4Network | ipaddress.IPv6Network

NEVER_V4: tuple[str, ...] = (
    "0.0.0.0/8",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
)
"""Always denied IPv4: unspecified, loopback, link-local (cloud metadata), multicast, reserved."""
NEVER_V6: tuple[str, ...] = ("::/127", "::ffff:0:0/96", "fe80::/10", "ff00::/8")
"""Always denied IPv6: unspecified + loopback, v4-mapped, link-local, multicast."""
PRIVATE_V4: tuple[str, ...] = (
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "198.18.0.0/15",
)
"""Private (RFC 1918), shared (RFC 6598) and benchmarking ranges: open only to a CIDR entry
inside them."""
PRIVATE_V6: tuple[str, ...] = ("fc00::/7", "64:ff9b::/96")
"""Unique-local and NAT64 (may embed a private IPv4)."""


def _nets(texts: Iterable[str]) -> list[Net]:
    return [ipaddress.ip_network(t) for t in texts]


def _inside(net: Net, ranges: Iterable[str]) -> bool:
    return any(
        net.version == r.version and net.subnet_of(r)  # type: ignore[arg-type]
        for r in _nets(ranges)
    )


def slot_addresses(
    pool: ipaddress.IPv4Network, slot: int
) -> tuple[ipaddress.IPv4Network, ipaddress.IPv4Address, ipaddress.IPv4Address]:
    """The /30 of pool slot ``slot``: (subnet, gateway ``.1``, guest ``.2``)."""
    subnet = ipaddress.IPv4Network((int(pool.network_address) + 4 * slot, 30))
    if not subnet.subnet_of(pool):
        raise ValueError(f"slot {slot} is outside pool {pool}")
    return subnet, subnet.network_address + 1, subnet.network_address + 2


def guest_mac(session_id: str) -> str:
    """A stable MAC for the session's guest NIC, in QEMU's ``52:54:00`` OUI."""
    digest = hashlib.sha256(session_id.encode()).digest()
    return "52:54:00:" + ":".join(f"{b:02x}" for b in digest[:3])


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """Everything the renderers need for one session (all plain values).

    Attributes:
        session_id: labels every object.
        installation: the installation's tag (:func:`installation_tag`): names its tables.
        bridge: bridge name.
        guest_port: name of the guest's bridge port (the tap libvirt creates, named by
            ``<target dev=.../>``); frames are filtered by ingress port because this
            kernel lacks ``meta ibrname`` (CONFIG_NFT_BRIDGE_META).
        subnet: the session's /30.
        gateway_ip: host side of the bridge (DHCP + DNS).
        guest_ip: the guest's only allowed source address.
        guest_mac: the guest's only allowed source MAC.
        upstream_iface: the only interface allowed traffic may leave by.
        upstream_dns: resolvers allowlisted names are forwarded to.
        masquerade: source-NAT to the upstream interface's address.
        policy: the allowlist.
        host_addresses: the host's own addresses at attach time (refused as DNS answers;
            packets to them are handled by the input chain anyway).
        nflog_group: the session's NFLOG group.
        drop_log_rate_per_s: log rate limit of drop rules.
    """

    session_id: str
    installation: str
    bridge: str
    guest_port: str
    subnet: ipaddress.IPv4Network
    gateway_ip: ipaddress.IPv4Address
    guest_ip: ipaddress.IPv4Address
    guest_mac: str
    upstream_iface: str
    upstream_dns: tuple[str, ...]
    masquerade: bool
    policy: EgressPolicy
    host_addresses: tuple[str, ...]
    nflog_group: int
    drop_log_rate_per_s: int = 100

    @property
    def domain_ports(self) -> tuple[str, ...]:
        """Port buckets of domain entries: ``"any"`` and/or decimal ports, sorted."""
        keys = {"any" if d.port is None else str(d.port) for d in self.policy.domains}
        return tuple(sorted(keys, key=lambda k: (k != "any", k.zfill(5))))

    @property
    def table(self) -> str:
        """The installation's ``inet`` table."""
        return installation_table(self.installation)

    @property
    def bridge_table(self) -> str:
        """The session's ``bridge`` table."""
        return session_bridge_table(self.installation, self.session_id)

    @property
    def has_ipv6(self) -> bool:
        """Whether the policy names any IPv6 network (else IPv6 is dropped at the bridge)."""
        return any(c.network.version == 6 for c in self.policy.cidrs)


def _set_name(session_id: str, version: int, port_key: str) -> str:
    return f"d{version}_{session_id}_{port_key}"


class _Rules:
    def __init__(self, plan: SessionPlan) -> None:
        self.plan = plan
        self.lines: list[str] = []

    def prefix(self, verdict: str, reason: str) -> str:
        return f'"dvm:{self.plan.session_id}:{verdict}:{reason}"'

    def accept(self, match: str, reason: str) -> None:
        group = self.plan.nflog_group
        self.lines.append(f"{match} log prefix {self.prefix('A', reason)} group {group} accept")

    def drop(self, match: str, reason: str) -> None:
        rate = self.plan.drop_log_rate_per_s
        head = f"{match} " if match else ""
        self.lines.append(
            f"{head}limit rate {rate}/second burst {2 * rate} packets"
            f" log prefix {self.prefix('D', reason)} group {self.plan.nflog_group}"
        )
        self.lines.append(f"{head}counter drop")


def _elements(nets: Iterable[Net | str]) -> str:
    return "{ " + ", ".join(str(n) for n in nets) + " }"


def _cidr_match(entry: CidrAllow) -> str:
    family = "ip" if entry.network.version == 4 else "ip6"
    net = entry.network
    dst = str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)
    port = f"tcp dport {entry.port}" if entry.port is not None else "meta l4proto tcp"
    return f"{family} daddr {dst} {port}"


def _chain(name: str, lines: list[str]) -> list[str]:
    return [f"\tchain {name} {{", *[f"\t\t{line}" for line in lines], "\t}"]


def render_guard_ruleset() -> str:
    """The host-wide guard table ``inet deskvm_guard``: forward policy drop, but for
    traffic from or to a registered session bridge (set ``bridges``).

    Created before any installation switches IP forwarding on; deleted after the last
    session on the host is gone and forwarding was restored (see the module docstring).
    """
    lines = [
        f"table inet {GUARD_TABLE} {{",
        "\tset bridges { type ifname; }",
        *_chain(
            "forward",
            [
                "type filter hook forward priority filter; policy drop;",
                "iifname @bridges accept",
                "oifname @bridges accept",
            ],
        ),
        "}",
    ]
    return "\n".join(lines) + "\n"


def render_guard_join(bridge: str) -> str:
    """nft script registering ``bridge`` with the guard (its chains must exist already)."""
    return f'add element inet {GUARD_TABLE} bridges {{ "{bridge}" }}\n'


def render_guard_leave(bridge: str) -> str:
    """nft script removing ``bridge`` from the guard (before its chains go)."""
    return f'delete element inet {GUARD_TABLE} bridges {{ "{bridge}" }}\n'


def render_base_ruleset(table: str) -> str:
    """An installation's ``inet`` table: hooks with verdict maps keyed by its bridges.

    Applied before the installation's first session's objects, deleted after its last.
    Its forward hook judges the traffic of its own bridges only (each session chain ends
    in a verdict) and lets everything else through to the guard (:func:`render_guard_ruleset`).

    Args:
        table: the table's name (:func:`installation_table`).
    """
    lines = [
        f"table inet {table} {{",
        "\tmap fwd_from { type ifname : verdict; }",
        "\tmap fwd_to { type ifname : verdict; }",
        "\tmap in_from { type ifname : verdict; }",
        "\tmap post_src { type ipv4_addr : verdict; }",
        "\tmap nat_src { type ipv4_addr : verdict; }",
        *_chain(
            "forward",
            [
                "type filter hook forward priority filter; policy accept;",
                "iifname vmap @fwd_from",
                "oifname vmap @fwd_to",
            ],
        ),
        *_chain(
            "input",
            ["type filter hook input priority filter; policy accept;", "iifname vmap @in_from"],
        ),
        *_chain(
            "postrouting",
            [
                "type filter hook postrouting priority filter; policy accept;",
                "ip saddr vmap @post_src",
            ],
        ),
        *_chain(
            "nat_postrouting",
            [
                "type nat hook postrouting priority srcnat; policy accept;",
                "ip saddr vmap @nat_src",
            ],
        ),
        "}",
    ]
    return "\n".join(lines) + "\n"


def render_session_ruleset(plan: SessionPlan) -> str:
    """The session's nft objects, as one ``nft -f`` transaction.

    Args:
        plan: the session's plan.

    Returns:
        nft script text adding the bridge table, chains, sets, counters and map elements.
    """
    sid, br, up, table = plan.session_id, plan.bridge, plan.upstream_iface, plan.table
    out: list[str] = []

    guard = _Rules(plan)
    guard.drop(f"ether saddr != {plan.guest_mac}", "mac")
    guard.lines.append("ether type { arp, ip } accept")
    if plan.has_ipv6:
        guard.lines.append("ether type ip6 accept")
    else:
        guard.drop("ether type ip6", "ipv6")
    guard.drop("", "nonip")
    out += [
        f"table bridge {plan.bridge_table} {{",
        *_chain(
            "prerouting",
            [
                "type filter hook prerouting priority -200; policy accept;",
                f'iifname "{plan.guest_port}" jump guest',
            ],
        ),
        *_chain("guest", guard.lines),
        "}",
    ]

    fwd = _Rules(plan)
    # Source and way out first, before conntrack: a guest holding another session's address
    # (say, a clone that kept its template's lease) cannot ride that session's connections.
    fwd.drop(f'oifname != "{up}"', "oif")
    fwd.drop(f"meta nfproto ipv4 ip saddr != {plan.guest_ip}", "spoof")
    fwd.lines.append("ct state established,related accept")
    fwd.drop("ct state invalid", "invalid")
    if not plan.has_ipv6:
        fwd.drop("meta nfproto ipv6", "ipv6")
    fwd.drop(f"ip daddr {_elements(NEVER_V4)}", "always-denied")
    fwd.drop(f"ip6 daddr {_elements(NEVER_V6)}", "always-denied")
    fwd.drop("fib daddr type { local, broadcast, multicast, anycast }", "host")
    fwd.drop("meta l4proto != tcp", "not-tcp")
    cidrs = list(enumerate(plan.policy.cidrs))
    for index, entry in cidrs:
        if _inside(entry.network, PRIVATE_V4 + PRIVATE_V6):
            fwd.accept(_cidr_match(entry), f"cidr:{index}")
    fwd.drop(f"ip daddr {_elements(PRIVATE_V4)}", "private")
    fwd.drop(f"ip6 daddr {_elements(PRIVATE_V6)}", "private")
    for index, entry in cidrs:
        if not _inside(entry.network, PRIVATE_V4 + PRIVATE_V6):
            fwd.accept(_cidr_match(entry), f"cidr:{index}")
    for key in plan.domain_ports:
        port = "meta l4proto tcp" if key == "any" else f"tcp dport {key}"
        fwd.accept(f"ip daddr @{_set_name(sid, 4, key)} {port}", f"dns:{key}")
        fwd.accept(f"ip6 daddr @{_set_name(sid, 6, key)} {port}", f"dns:{key}")
    fwd.drop("", "default")

    back = _Rules(plan)
    back.lines.append("ct state established,related accept")
    back.drop("", "inbound")

    host = _Rules(plan)
    # From the guest's own address only (DHCP also from 0.0.0.0, before its lease): the
    # resolver answers whatever source a query carries, so a forged one would send the
    # answer out another interface, to a host on the uplink's network or to another session.
    host.lines.append(f"ip saddr {{ 0.0.0.0, {plan.guest_ip} }} udp sport 68 udp dport 67 accept")
    host.lines.append(f"ip saddr {plan.guest_ip} ip daddr {plan.gateway_ip} udp dport 53 accept")
    host.lines.append(f"ip saddr {plan.guest_ip} ip daddr {plan.gateway_ip} tcp dport 53 accept")
    host.drop("", "host")

    post = [
        f'oifname "{br}" return',
        f'oifname "{up}" counter name "out_up_{sid}" return',
        f'counter name "out_other_{sid}"',
    ]

    out += [f"table inet {table} {{"]
    out += [f"\tcounter out_up_{sid} {{ }}", f"\tcounter out_other_{sid} {{ }}"]
    for key in plan.domain_ports:
        out.append(f"\tset {_set_name(sid, 4, key)} {{ type ipv4_addr; }}")
        out.append(f"\tset {_set_name(sid, 6, key)} {{ type ipv6_addr; }}")
    out += _chain(f"fwd_{sid}", fwd.lines)
    out += _chain(f"back_{sid}", back.lines)
    out += _chain(f"in_{sid}", host.lines)
    out += _chain(f"post_{sid}", post)
    if plan.masquerade:
        out += _chain(f"nat_{sid}", [f'oifname "{up}" masquerade'])
    out.append("}")
    out += [
        f'add element inet {table} fwd_from {{ "{br}" : jump fwd_{sid} }}',
        f'add element inet {table} fwd_to {{ "{br}" : jump back_{sid} }}',
        f'add element inet {table} in_from {{ "{br}" : jump in_{sid} }}',
        f"add element inet {table} post_src {{ {plan.guest_ip} : jump post_{sid} }}",
    ]
    if plan.masquerade:
        out.append(f"add element inet {table} nat_src {{ {plan.guest_ip} : jump nat_{sid} }}")
    return "\n".join(out) + "\n"


def render_session_teardown(
    table: str,
    *,
    map_elements: Iterable[tuple[str, str]],
    chains: Iterable[str],
    sets: Iterable[str],
    counters: Iterable[str],
    bridge_table: str | None,
) -> str:
    """nft script deleting the given (existing) objects of one session.

    The caller lists what exists (so the script never names a missing object and stays
    idempotent); element keys are rendered as found.

    Args:
        table: the installation's ``inet`` table.
        map_elements: ``(map name, key)`` pairs to delete (``key`` as nft prints it).
        chains: chain names in ``table``.
        sets: set names in ``table``.
        counters: counter names in ``table``.
        bridge_table: the session's ``bridge`` table when it exists, else ``None``.

    Returns:
        nft script text (may be empty).
    """
    lines = [f"delete element inet {table} {m} {{ {k} }}" for m, k in map_elements]
    chain_list = sorted(chains)
    lines += [f"flush chain inet {table} {c}" for c in chain_list]
    lines += [f"delete chain inet {table} {c}" for c in chain_list]
    lines += [f"delete set inet {table} {s}" for s in sorted(sets)]
    lines += [f"delete counter inet {table} {c}" for c in sorted(counters)]
    if bridge_table is not None:
        lines.append(f"delete table bridge {bridge_table}")
    return "\n".join(lines) + ("\n" if lines else "")


def refused_answer_ranges(plan: SessionPlan) -> list[Net]:
    """Address ranges a DNS answer must not fall in (the answer becomes NXDOMAIN).

    Always-denied ranges, the host's addresses (including the gateway) and private ranges
    minus the parts a CIDR entry names.
    """
    named = [c.network for c in plan.policy.cidrs]
    ranges: list[Net] = _nets(NEVER_V4 + NEVER_V6)
    ranges += [ipaddress.ip_network(a) for a in plan.host_addresses]
    ranges.append(ipaddress.ip_network(plan.gateway_ip))
    for private in _nets(PRIVATE_V4 + PRIVATE_V6):
        pieces: list[Net] = [private]
        for n in named:
            if n.version != private.version or not n.subnet_of(private):  # type: ignore[arg-type]
                continue
            nxt: list[Net] = []
            for piece in pieces:
                if n.subnet_of(piece):  # type: ignore[arg-type]
                    nxt += list(piece.address_exclude(n))  # type: ignore[arg-type]
                elif not piece.subnet_of(n):  # type: ignore[arg-type]
                    nxt.append(piece)
            pieces = nxt
        ranges += pieces
    seen: set[str] = set()
    unique = []
    for r in ranges:
        if str(r) not in seen:
            seen.add(str(r))
            unique.append(r)
    return unique


def dnsmasq_argv(plan: SessionPlan, dnsmasq: str, state_dir: str) -> list[str]:
    """dnsmasq command line: DHCP for the guest MAC, an allowlisting resolver.

    Only allowlisted names are forwarded (to ``upstream_dns`` through the upstream
    interface); every other name is answered NXDOMAIN locally (``--address=/#/``).
    Answers falling in :func:`refused_answer_ranges` become NXDOMAIN
    (``--bogus-nxdomain``), before any address reaches the nft set (``--nftset``).

    Args:
        plan: the session's plan.
        dnsmasq: path of the binary.
        state_dir: the session's state directory (pid, log, leases).

    Returns:
        argv (dnsmasq daemonizes once its sockets are bound).
    """
    sid = plan.session_id
    argv = [
        dnsmasq,
        "--conf-file=/dev/null",
        f"--pid-file={state_dir}/dnsmasq.pid",
        f"--log-facility={state_dir}/dnsmasq.log",
        "--log-queries=extra",
        f"--interface={plan.bridge}",
        "--except-interface=lo",
        "--bind-interfaces",
        f"--listen-address={plan.gateway_ip}",
        "--no-resolv",
        "--no-hosts",
        "--no-poll",
        "--address=/#/",
        f"--dhcp-range={plan.guest_ip},{plan.guest_ip},{plan.subnet.netmask},12h",
        f"--dhcp-host={plan.guest_mac},{plan.guest_ip}",
        f"--dhcp-leasefile={state_dir}/dnsmasq.leases",
        "--dhcp-authoritative",
        "--dhcp-rapid-commit",
        "--no-ping",
        f"--dhcp-option=option:router,{plan.gateway_ip}",
        f"--dhcp-option=option:dns-server,{plan.gateway_ip}",
    ]
    domains = plan.policy.domains
    wild = {d.name for d in domains if d.wildcard}
    by_pattern: dict[str, set[str]] = {}
    exact_names: set[str] = set()
    for d in domains:
        pattern = f"*.{d.name}" if d.wildcard else d.name
        if not d.wildcard:
            exact_names.add(d.name)
        by_pattern.setdefault(pattern, set()).add("any" if d.port is None else str(d.port))
    # dnsmasq's --nftset does not take "*." patterns: sets are keyed by the bare name
    # (its subdomains included); names the resolver does not forward never get answers.
    # An exact and a wildcard entry of the same name share their ports.
    by_name: dict[str, set[str]] = {}
    for pattern in sorted(by_pattern):
        for server in plan.upstream_dns:
            argv.append(f"--server=/{pattern}/{server}@{plan.upstream_iface}")
        by_name.setdefault(pattern.removeprefix("*."), set()).update(by_pattern[pattern])
    for name in sorted(by_name):
        targets = ",".join(
            f"{v}#inet#{plan.table}#{_set_name(sid, v, key)}"
            for key in sorted(by_name[name])
            for v in (4, 6)
        )
        argv.append(f"--nftset=/{name}/{targets}")
    for name in sorted(exact_names):
        covered = any(name == w or name.endswith("." + w) for w in wild)
        if not covered:
            argv.append(f"--address=/*.{name}/")
    argv += [f"--bogus-nxdomain={r}" for r in refused_answer_ranges(plan)]
    return argv


def ulogd_config(plan: SessionPlan, plugin_dir: str, state_dir: str) -> str:
    """ulogd2 configuration: NFLOG group of the session -> JSON lines file.

    Args:
        plan: the session's plan.
        plugin_dir: directory of ``ulogd_*.so``.
        state_dir: the session's state directory.

    Returns:
        Config file text (``ulogd -c FILE``).
    """
    plugins = (
        "inppkt_NFLOG",
        "raw2packet_BASE",
        "filter_IFINDEX",
        "filter_IP2STR",
        "filter_HWHDR",
        "output_JSON",
    )
    lines = ["[global]", f'logfile="{state_dir}/ulogd.log"', "loglevel=3"]
    lines += [f'plugin="{plugin_dir}/ulogd_{p}.so"' for p in plugins]
    lines += [
        "stack=log1:NFLOG,base1:BASE,ifi1:IFINDEX,ip2str1:IP2STR,mac2str1:HWHDR,json1:JSON",
        "[log1]",
        f"group={plan.nflog_group}",
        "unbind=0",
        "netlink_qthreshold=1",
        "[json1]",
        f'file="{state_dir}/ulogd.json"',
        "sync=1",
        "",
    ]
    return "\n".join(lines)


def _matches_domain(name: str, entry: DomainAllow) -> bool:
    if entry.wildcard:
        return name.endswith("." + entry.name)
    return name == entry.name


def evaluate_connection(
    policy: EgressPolicy,
    dst: str,
    dst_port: int | None,
    protocol: str,
    *,
    resolved: dict[str, tuple[int | None, ...]] | None = None,
) -> tuple[bool, str]:
    """Decide one new connection the way the nft ruleset does (for the fake and docs).

    Args:
        policy: the allowlist.
        dst: destination address.
        dst_port: destination port (``None`` for portless protocols).
        protocol: ``"tcp"``, ``"udp"``, ``"icmp"``...
        resolved: addresses the resolver has put in the session's sets, with the ports
            their domain entries allow (``None`` = any).

    Returns:
        ``(allowed, reason)`` with the same reasons as the NFLOG prefixes.
    """
    addr = ipaddress.ip_address(dst)
    host = ipaddress.ip_network(addr)
    if addr.version == 6 and not any(c.network.version == 6 for c in policy.cidrs):
        return False, "ipv6"
    if _inside(host, NEVER_V4 + NEVER_V6):
        return False, "always-denied"
    if protocol != "tcp":
        return False, "not-tcp"
    cidrs = list(enumerate(policy.cidrs))

    def cidr_hit(private: bool) -> str | None:
        for index, entry in cidrs:
            if _inside(entry.network, PRIVATE_V4 + PRIVATE_V6) != private:
                continue
            if addr in entry.network and entry.port in (None, dst_port):
                return f"cidr:{index}"
        return None

    hit = cidr_hit(True)
    if hit:
        return True, hit
    if _inside(host, PRIVATE_V4 + PRIVATE_V6):
        return False, "private"
    hit = cidr_hit(False)
    if hit:
        return True, hit
    for port in (resolved or {}).get(dst, ()):
        if port is None or port == dst_port:
            return True, f"dns:{'any' if port is None else port}"
    return False, "default"


def dns_allowed(policy: EgressPolicy, name: str) -> tuple[bool, tuple[int | None, ...]]:
    """Whether the resolver forwards ``name``, and the ports its entries allow."""
    name = name.lower().rstrip(".")
    ports = tuple(d.port for d in policy.domains if _matches_domain(name, d))
    return bool(ports), ports
