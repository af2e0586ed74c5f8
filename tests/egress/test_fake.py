"""In-process ring: FakeEgress honours the seam and the policy."""

from __future__ import annotations

import pytest

import orchestrator.egress as egress
from orchestrator.egress import Egress, EgressSettings, FakeEgress, NftEgress
from orchestrator.errors import ConfigError, EgressError
from orchestrator.spec import EgressPolicy

SID = "abcdefgh2345"
POLICY = EgressPolicy(allow=("allowed.test", "*.wild.test", "198.51.100.7/32:443", "*.r.test"))


def test_public_api() -> None:
    assert sorted(egress.__all__) == [
        "BRIDGE_PREFIX",
        "DecisionKind",
        "Egress",
        "EgressAttachment",
        "EgressSettings",
        "FakeEgress",
        "GUEST_PORT_PREFIX",
        "NetworkDecision",
        "NftEgress",
        "bridge_name",
        "guest_port_name",
    ]


def test_both_implementations_fit_the_seam() -> None:
    assert isinstance(FakeEgress(), Egress)
    settings = EgressSettings(upstream_iface="eth9", upstream_dns=("198.51.100.53",))
    assert isinstance(NftEgress(settings), Egress)


def test_attachment_and_libvirt_xml() -> None:
    a = FakeEgress().attach(SID, POLICY)
    assert a.bridge == f"dvm{SID}" and len(a.bridge) == 15
    assert a.guest_port == f"dvg{SID}"
    assert a.resolver_ip == a.gateway_ip == "10.213.0.1" and a.guest_ip == "10.213.0.2"
    assert a.libvirt_interface_xml() == (
        f"<interface type='bridge'><source bridge='dvm{SID}'/><target dev='dvg{SID}'/>"
        f"<mac address='{a.guest_mac}'/><model type='virtio'/></interface>"
    )


def test_fake_decisions_follow_the_policy() -> None:
    ticks = iter(range(1000))
    fake = FakeEgress(
        {
            "allowed.test": ("203.0.113.10",),
            "x.wild.test": ("203.0.113.11",),
            "m.r.test": ("169.254.169.254",),
        },
        clock_ns=lambda: next(ticks),
    )
    a = fake.attach(SID, POLICY)
    assert not fake.connect(SID, "203.0.113.10", 80)
    assert fake.resolve(SID, "allowed.test") == ("203.0.113.10",)
    assert fake.connect(SID, "203.0.113.10", 80)
    assert fake.resolve(SID, "sub.allowed.test") == ()
    assert fake.resolve(SID, "m.r.test") == ()
    assert fake.connect(SID, "198.51.100.7", 443)
    assert not fake.connect(SID, "198.51.100.7", 80)
    assert not fake.connect(SID, "198.51.100.7", 443, "udp")
    assert not fake.connect(SID, a.gateway_ip, 22)
    assert fake.connect(SID, a.gateway_ip, 53, "udp")
    assert not fake.connect(SID, "2001:db8::1", 443)
    kinds = [(d.kind, d.reason) for d in fake.decisions(SID)]
    assert kinds == [
        ("conn_dropped", "default"),
        ("dns_answered", "allowlisted"),
        ("conn_allowed", "dns:any"),
        ("dns_refused", "not-allowlisted"),
        ("dns_refused", "refused-answer"),
        ("conn_allowed", "cidr:0"),
        ("conn_dropped", "default"),
        ("conn_dropped", "not-tcp"),
        ("conn_dropped", "host"),
        ("conn_dropped", "ipv6"),
    ]


def test_detach_is_idempotent_and_reap_finds_the_dead() -> None:
    fake = FakeEgress()
    fake.attach(SID, POLICY)
    fake.attach("zzzzzzzzzzzz", POLICY)
    assert fake.reap(frozenset({SID})) == ["zzzzzzzzzzzz"]
    fake.detach(SID)
    fake.detach(SID)
    with pytest.raises(EgressError):
        fake.decisions(SID)


def test_errors() -> None:
    with pytest.raises(ConfigError):
        FakeEgress().attach("Bad-Id", POLICY)
    with pytest.raises(EgressError):
        FakeEgress(fail_on=frozenset({"attach"})).attach(SID, POLICY)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"upstream_iface": "eth 0", "upstream_dns": ("198.51.100.53",)},
        {"upstream_iface": "dvmabc", "upstream_dns": ("198.51.100.53",)},
        {"upstream_iface": "eth0", "upstream_dns": ()},
        {"upstream_iface": "eth0", "upstream_dns": ("resolver.example",)},
        {
            "upstream_iface": "eth0",
            "upstream_dns": ("198.51.100.53",),
            "subnet_pool": "10.0.0.1/16",
        },
        {
            "upstream_iface": "eth0",
            "upstream_dns": ("198.51.100.53",),
            "subnet_pool": "10.0.0.0/31",
        },
    ],
)
def test_settings_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        EgressSettings(**kwargs)  # type: ignore[arg-type]


def test_settings_from_cli() -> None:
    s = EgressSettings.from_cli("eth0", "198.51.100.53, 2001:db8::53")
    assert s.upstream_dns == ("198.51.100.53", "2001:db8::53")
    assert s.slot_count == 16384
