"""Pure ring: nft ruleset, dnsmasq argv and ulogd config against golden files.

Regenerate with ``DESKVM_UPDATE_GOLDEN=1 pytest tests/egress/test_golden.py`` and review
the diff.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from orchestrator.egress.plan import (
    SessionPlan,
    dnsmasq_argv,
    guest_mac,
    installation_table,
    installation_tag,
    render_base_ruleset,
    render_guard_join,
    render_guard_leave,
    render_guard_ruleset,
    render_session_ruleset,
    render_session_teardown,
    slot_addresses,
    ulogd_config,
)
from orchestrator.spec import EgressPolicy

GOLDEN = Path(__file__).resolve().parent / "golden"
SID = "abcdefgh2345"
TAG = installation_tag("/var/lib/deskvm/sessions")


def plan(allow: tuple[str, ...], *, masquerade: bool = True, slot: int = 3) -> SessionPlan:
    subnet, gateway, guest = slot_addresses(ipaddress.IPv4Network("10.213.0.0/16"), slot)
    return SessionPlan(
        session_id=SID,
        installation=TAG,
        bridge=f"dvm{SID}",
        guest_port=f"dvg{SID}",
        subnet=subnet,
        gateway_ip=gateway,
        guest_ip=guest,
        guest_mac=guest_mac(SID),
        upstream_iface="uplink0",
        upstream_dns=("198.51.100.53", "2001:db8::53"),
        masquerade=masquerade,
        policy=EgressPolicy(allow=allow),
        host_addresses=("192.0.2.2", "fd00::2"),
        nflog_group=32768 + slot,
    )


FULL = plan(
    (
        "example.org",
        "*.example.net",
        "api.example.com:443",
        "198.51.100.7/32:443",
        "203.0.113.0/24",
        "10.20.0.0/16:5432",
        "[2001:db8::/32]:443",
    )
)
EMPTY = plan((), masquerade=False, slot=0)


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DESKVM_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with DESKVM_UPDATE_GOLDEN=1"
    assert text == path.read_text()


def test_base_ruleset() -> None:
    check("base.nft", render_base_ruleset(installation_table(TAG)))


def test_guard_ruleset() -> None:
    check("guard.nft", render_guard_ruleset())
    assert render_guard_join("dvmabc") == 'add element inet deskvm_guard bridges { "dvmabc" }\n'
    assert render_guard_leave("dvmabc").startswith("delete element inet deskvm_guard bridges")


def test_installation_names() -> None:
    """Each installation's tables carry its own tag; the tag is stable per path."""
    assert installation_tag("/var/lib/deskvm/sessions") == TAG and len(TAG) == 8
    assert installation_tag("/var/lib/deskvm-other/sessions") != TAG
    assert FULL.table == f"deskvm_{TAG}"
    assert FULL.bridge_table == f"deskvm_{TAG}_{SID}"
    assert f"table inet deskvm_{TAG} {{" in render_session_ruleset(FULL)
    assert f"#inet#deskvm_{TAG}#d4_{SID}_any" in " ".join(dnsmasq_argv(FULL, "dnsmasq", "/st"))
    # Interface names stay within Linux's 15 bytes (IFNAMSIZ - 1).
    assert max(len(FULL.bridge), len(FULL.guest_port)) <= 15


@pytest.mark.parametrize(("name", "p"), [("full", FULL), ("empty", EMPTY)])
def test_session_ruleset(name: str, p: SessionPlan) -> None:
    check(f"session_{name}.nft", render_session_ruleset(p))


@pytest.mark.parametrize(("name", "p"), [("full", FULL), ("empty", EMPTY)])
def test_dnsmasq_argv(name: str, p: SessionPlan) -> None:
    check(f"dnsmasq_{name}.txt", "\n".join(dnsmasq_argv(p, "/usr/sbin/dnsmasq", "/st")) + "\n")


def test_ulogd_config() -> None:
    check("ulogd.conf", ulogd_config(FULL, "/usr/lib/x86_64-linux-gnu/ulogd", "/st"))


def test_teardown() -> None:
    text = render_session_teardown(
        FULL.table,
        map_elements=[("fwd_from", f'"dvm{SID}"'), ("post_src", "10.213.0.14")],
        chains=[f"fwd_{SID}", f"in_{SID}"],
        sets=[f"d4_{SID}_any"],
        counters=[f"out_up_{SID}"],
        bridge_table=FULL.bridge_table,
    )
    check("teardown.nft", text)
    assert (
        render_session_teardown(
            FULL.table, map_elements=[], chains=[], sets=[], counters=[], bridge_table=None
        )
        == ""
    )


def test_invariants_of_the_full_ruleset() -> None:
    text = render_session_ruleset(FULL)
    fwd = text.split(f"chain fwd_{SID} {{")[1].split("\n\t}")[0]
    lines = [line.strip() for line in fwd.strip().splitlines()]
    # the way out and the source are checked before conntrack lets anything through (a
    # guest holding another session's address cannot ride its connections), default drop
    # last, always-denied before any accept
    ct = lines.index("ct state established,related accept")
    assert ct == lines.index(f"meta nfproto ipv4 ip saddr != {FULL.guest_ip} counter drop") + 1
    assert lines.index('oifname != "uplink0" counter drop') < ct
    assert not any(line.endswith(" accept") for line in lines[:ct])
    assert lines[-1] == "counter drop"
    first_accept = next(i for i, line in enumerate(lines) if line.endswith(" accept") and i > ct)
    always = max(i for i, line in enumerate(lines) if "always-denied" in line)
    assert always < first_accept
    # the private CIDR entry is accepted before the private drop, the public ones after
    private_accept = next(i for i, line in enumerate(lines) if "10.20.0.0/16" in line)
    private_drop = next(i for i, line in enumerate(lines) if ":D:private" in line)
    public_accept = next(i for i, line in enumerate(lines) if "203.0.113.0/24" in line)
    assert private_accept < private_drop < public_accept
    assert 'oifname != "uplink0"' in fwd
    # with an IPv6 entry, IPv6 passes the bridge and is filtered in inet
    assert "ether type ip6 accept" in text
    # the host (DHCP and the resolver) takes packets from the guest's own address only
    host = text.split(f"chain in_{SID} {{")[1].split("\n\t}")[0]
    accepts = [line.strip() for line in host.splitlines() if line.strip().endswith(" accept")]
    assert len(accepts) == 3, accepts
    assert accepts[0].startswith(f"ip saddr {{ 0.0.0.0, {FULL.guest_ip} }} udp sport 68 ")
    assert all(a.startswith(f"ip saddr {FULL.guest_ip} ") for a in accepts[1:]), accepts


def test_refused_answers_exclude_named_private_ranges() -> None:
    argv = dnsmasq_argv(FULL, "dnsmasq", "/st")
    bogus = [a.split("=", 1)[1] for a in argv if a.startswith("--bogus-nxdomain=")]
    nets = [ipaddress.ip_network(b) for b in bogus]
    assert not any(ipaddress.ip_address("10.20.1.1") in n for n in nets)
    assert any(ipaddress.ip_address("10.21.1.1") in n for n in nets)
    assert any(ipaddress.ip_address("169.254.169.254") in n for n in nets)
    assert any(ipaddress.ip_address(str(FULL.gateway_ip)) in n for n in nets)
    assert "--address=/#/" in argv
    assert "--address=/*.example.org/" in argv  # exact entry: subdomains NXDOMAIN
