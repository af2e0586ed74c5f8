"""Pure ring: EgressPolicy parsing and validation."""

from __future__ import annotations

import ipaddress

import pytest

from orchestrator.errors import ConfigError
from orchestrator.spec import CidrAllow, DomainAllow, EgressPolicy, parse_egress_entry


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            "198.51.100.7/32:443",
            CidrAllow("198.51.100.7/32:443", ipaddress.ip_network("198.51.100.7/32"), 443),
        ),
        (
            "198.51.100.0/24",
            CidrAllow("198.51.100.0/24", ipaddress.ip_network("198.51.100.0/24"), None),
        ),
        ("203.0.113.9", CidrAllow("203.0.113.9", ipaddress.ip_network("203.0.113.9/32"), None)),
        ("203.0.113.9:80", CidrAllow("203.0.113.9:80", ipaddress.ip_network("203.0.113.9/32"), 80)),
        (
            "[2001:db8::/32]:443",
            CidrAllow("[2001:db8::/32]:443", ipaddress.ip_network("2001:db8::/32"), 443),
        ),
        ("2001:db8::/32", CidrAllow("2001:db8::/32", ipaddress.ip_network("2001:db8::/32"), None)),
        ("10.0.0.0/8", CidrAllow("10.0.0.0/8", ipaddress.ip_network("10.0.0.0/8"), None)),
        ("example.org", DomainAllow("example.org", "example.org", False, None)),
        ("Example.ORG.", DomainAllow("Example.ORG.", "example.org", False, None)),
        ("*.example.org", DomainAllow("*.example.org", "example.org", True, None)),
        (
            "api.example.org:8443",
            DomainAllow("api.example.org:8443", "api.example.org", False, 8443),
        ),
        (
            "xn--bcher-kva.example",
            DomainAllow("xn--bcher-kva.example", "xn--bcher-kva.example", False, None),
        ),
    ],
)
def test_good_entries(entry: str, expected: object) -> None:
    assert parse_egress_entry(entry) == expected


@pytest.mark.parametrize(
    "entry",
    [
        "",
        " ",
        "198.51.100.7/24",  # host bits set
        "198.51.100.7/33",
        "198.51.100.7:0",
        "198.51.100.7:65536",
        "198.51.100.7:http",
        "[198.51.100.7]:80",  # brackets are for IPv6
        "[2001:db8::/32:443",
        "[2001:db8::/32]443",
        "127.0.0.1",
        "169.254.169.254/32:80",  # cloud metadata
        "[::1]:80",
        "fe80::/64",
        "224.0.0.1",
        "localhost",
        "*.org.",  # single label after the wildcard
        "*",
        "*.",
        "a..example.org",
        "-bad.example.org",
        "bad-.example.org",
        "ex ample.org",
        "exa_mple.org",
        "1.2.3.4.5",
        "bücher.example",
        "example.org:99999",
        "x" * 64 + ".org",
    ],
)
def test_bad_entries_name_the_entry(entry: str) -> None:
    with pytest.raises(ConfigError) as info:
        EgressPolicy(allow=("example.org", entry))
    assert repr(entry.strip()) in str(info.value) or repr(entry) in str(info.value)


def test_policy_shape_and_helpers() -> None:
    policy = EgressPolicy(allow=("example.org", "198.51.100.7/32:443", "*.example.net"))
    assert policy.allow == ("example.org", "198.51.100.7/32:443", "*.example.net")
    assert [d.name for d in policy.domains] == ["example.org", "example.net"]
    assert [str(c.network) for c in policy.cidrs] == ["198.51.100.7/32"]
    assert EgressPolicy().allow == ()


def test_policy_rejects_a_bare_string_and_non_strings() -> None:
    with pytest.raises(ConfigError):
        EgressPolicy(allow="example.org")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a string"):
        EgressPolicy(allow=(42,))  # type: ignore[arg-type]


def test_policy_list_is_frozen_to_a_tuple() -> None:
    assert EgressPolicy(allow=["example.org"]).allow == ("example.org",)  # type: ignore[arg-type]


def test_too_many_entries() -> None:
    with pytest.raises(ConfigError, match="more than"):
        EgressPolicy(allow=tuple(f"h{i}.example.org" for i in range(257)))
