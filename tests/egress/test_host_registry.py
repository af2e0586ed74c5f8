"""The host-wide slots and IP forwarding bookkeeping two installations share (no root).

The ``ip_forward`` file is a stand-in in a temporary directory; the real one is exercised
by the namespace tests (``test_real.py``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from orchestrator.egress.host import HostRegistry
from orchestrator.errors import EgressError

A, B = "aaaaaaaa", "bbbbbbbb"  # two installations' tags


@pytest.fixture()
def host(tmp_path: Path) -> HostRegistry:
    sysctl = tmp_path / "ip_forward"
    sysctl.write_text("0\n")
    return HostRegistry(tmp_path / "net", forward_sysctl=sysctl)


def attach(host: HostRegistry, tag: str, sid: str) -> int:
    with host.locked():
        slot = host.claim(tag, sid, slot_count=8)
        host.forwarding_on()
        return slot


def detach(host: HostRegistry, tag: str, sid: str) -> None:
    with host.locked():
        host.release(tag, sid)
        if not host.sessions():
            host.forwarding_restore()


def forwarding(host: HostRegistry) -> str:
    return host.forward_sysctl.read_text().strip()


@pytest.mark.parametrize("order", list(itertools.permutations(["a1", "b1", "a2"])))
def test_forwarding_stays_on_until_the_last_session_of_any_installation(
    host: HostRegistry, order: tuple[str, ...]
) -> None:
    sessions = {"a1": (A, "a1aaaaaaaaaa"), "b1": (B, "b1bbbbbbbbbb"), "a2": (A, "a2aaaaaaaaaa")}
    slots = {attach(host, *sessions[name]) for name in ("a1", "b1", "a2")}
    assert slots == {0, 1, 2}  # subnets and NFLOG groups never shared
    assert forwarding(host) == "1"
    for i, name in enumerate(order):
        detach(host, *sessions[name])
        assert forwarding(host) == ("0" if i == len(order) - 1 else "1"), (order, name)
    assert host.claims() == []


def test_the_value_found_first_is_restored_even_when_it_was_on(host: HostRegistry) -> None:
    host.forward_sysctl.write_text("1\n")
    attach(host, A, "a1aaaaaaaaaa")
    attach(host, B, "b1bbbbbbbbbb")
    detach(host, A, "a1aaaaaaaaaa")
    detach(host, B, "b1bbbbbbbbbb")
    assert forwarding(host) == "1"
    assert not (host.host_dir / "ip_forward.saved").exists()


def test_a_session_id_is_claimed_once_on_the_host(host: HostRegistry) -> None:
    """Interface names derive from the session id: a second claim by any installation is
    refused before anything is created."""
    attach(host, A, "samesameid12")
    with host.locked(), pytest.raises(EgressError, match="another deskvm installation"):
        host.claim(B, "samesameid12", slot_count=8)
    with host.locked(), pytest.raises(EgressError, match="this deskvm installation"):
        host.claim(A, "samesameid12", slot_count=8)


def test_an_installation_releases_only_its_own_claim(host: HostRegistry) -> None:
    attach(host, A, "a1aaaaaaaaaa")
    with host.locked():
        host.release(B, "a1aaaaaaaaaa")  # B never held it
    assert host.sessions(A) == {"a1aaaaaaaaaa"} and host.sessions(B) == set()
    assert host.slot_of(A, "a1aaaaaaaaaa") == 0 and host.slot_of(B, "a1aaaaaaaaaa") is None


def test_the_pool_is_shared_and_exhaustion_is_an_error(host: HostRegistry) -> None:
    with host.locked():
        assert host.claim(A, "a1aaaaaaaaaa", slot_count=2) == 0
        assert host.claim(B, "b1bbbbbbbbbb", slot_count=2) == 1
        with pytest.raises(EgressError, match="exhausted"):
            host.claim(A, "a2aaaaaaaaaa", slot_count=2)
        host.release(A, "a1aaaaaaaaaa")
        assert host.claim(B, "b2bbbbbbbbbb", slot_count=2) == 0


def test_foreign_files_in_the_slots_directory_are_ignored(host: HostRegistry) -> None:
    (host.host_dir / "slots").mkdir(parents=True)
    (host.host_dir / "slots" / "0").write_text("not a claim")
    with host.locked():
        assert host.claim(A, "a1aaaaaaaaaa", slot_count=4) == 1
    assert [c.session_id for c in host.claims()] == ["a1aaaaaaaaaa"]


def test_claims_without_a_bridge_are_pruned(host: HostRegistry) -> None:
    """A claim whose session has no bridge is a killed attach's: pruned, so it neither holds
    a slot nor keeps IP forwarding on; claims with a bridge stay."""
    host.claim("aaaaaaaa", "s00000000001", 4)
    host.claim("bbbbbbbb", "s00000000002", 4)
    pruned = host.prune(lambda sid: sid == "s00000000002")
    assert [(c.installation, c.session_id) for c in pruned] == [("aaaaaaaa", "s00000000001")]
    assert host.sessions() == {"s00000000002"}
    assert host.claim("aaaaaaaa", "s00000000003", 4) == 0
