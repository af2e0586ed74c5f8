"""Real ring: network namespaces, a bridge, nftables, dnsmasq, ulogd (needs root).

Traffic goes only to the namespaces the world creates (see :mod:`egress_world`).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from egress_world import POLICY, World, leftovers, print_table, run_bypass_table

from orchestrator.clock import SystemClock
from orchestrator.egress import NftEgress
from orchestrator.errors import EgressError, HypervisorError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.recorder import MemoryRecorder
from orchestrator.session import Session
from orchestrator.spec import BootImage, EgressPolicy, SessionSpec, new_session_id

pytestmark = pytest.mark.netns


def deskvm_leftovers() -> list[str]:
    """Leftovers of deskvm itself (not the world's own namespaces and servers)."""
    return [x for x in leftovers() if "dvt" not in x and "internet_server" not in x]


def test_bypass_table(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_bypass_table(world)
    table = print_table(rows)
    with capsys.disabled():
        print("\n" + table)
    assert all(r.passed for r in rows), table

    # every attempt shows up in decisions()
    want = [
        ("conn_allowed", "203.0.113.10", 80),
        ("conn_allowed", "203.0.113.11", 80),
        ("conn_allowed", "198.51.100.7", 443),
        ("conn_dropped", "198.51.100.7", 80),
        ("conn_dropped", "198.51.100.8", 80),
        ("conn_dropped", "198.51.100.9", 9999),
        ("conn_dropped", "203.0.113.10", 443),
        ("conn_dropped", "198.51.100.53", 53),
        ("conn_dropped", world.attachment.gateway_ip if world.attachment else "", 18080),
    ]
    deadline = time.monotonic() + 5
    while True:
        decisions = world.egress.decisions(world.session_id)
        seen = {(d.kind, d.dst, d.dst_port) for d in decisions}
        reasons = {d.reason for d in decisions}
        queries = {(d.kind, d.query) for d in decisions}
        missing = [w for w in want if w not in seen]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, missing
    assert {"nonip", "ipv6", "not-tcp", "host"} <= reasons
    assert ("dns_answered", "allowed.test") in queries
    assert ("dns_refused", "ip-169-254-169-254.rebind.test") in queries
    assert ("dns_refused", "sub.allowed.test") in queries
    assert sum(1 for k, q in queries if k == "dns_refused" and q and q.endswith(".deny.test")) == 5
    assert decisions == sorted(decisions, key=lambda d: d.ts_ns)
    # refused answers never reached the allow set
    sets = subprocess.run(
        ["nft", "list", "set", "inet", "deskvm", f"d4_{world.session_id}_any"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "203.0.113.10" in sets and "169.254" not in sets and "10.213" not in sets


def test_detach_is_idempotent_and_leaves_nothing(bare_world: World) -> None:
    w = bare_world
    w.egress.attach(w.session_id, POLICY)
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "1"
    w.egress.detach(w.session_id)
    w.egress.detach(w.session_id)
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == w.forward_before
    assert not deskvm_leftovers()


def test_reap_removes_sessions_of_a_dead_server(bare_world: World) -> None:
    w = bare_world
    dead, live = new_session_id(), new_session_id()
    w.egress.attach(dead, EgressPolicy(allow=("allowed.test",)))
    w.egress.attach(live, EgressPolicy())
    # a new server process starts with no memory of the sessions
    fresh = NftEgress(w.settings)
    assert fresh.reap(frozenset({live})) == [dead]
    assert dead not in fresh.labelled_session_ids()
    assert live in fresh.labelled_session_ids()
    fresh.detach(live)
    assert fresh.labelled_session_ids() == set()


def test_failed_attach_cleans_up(bare_world: World) -> None:
    w = bare_world
    broken = NftEgress(
        type(w.settings)(
            upstream_iface=w.settings.upstream_iface,
            upstream_dns=w.settings.upstream_dns,
            state_dir=w.settings.state_dir,
            dnsmasq_path="/nonexistent/dnsmasq",
        )
    )
    sid = new_session_id()
    with pytest.raises(EgressError, match="attach"):
        broken.attach(sid, POLICY)
    assert broken.labelled_session_ids() == set()
    assert not deskvm_leftovers()


def test_reap_leaves_sessions_of_another_owner(bare_world: World) -> None:
    w = bare_world
    mine, theirs = new_session_id(), new_session_id()
    NftEgress(w.settings, owner="/other/sessions").attach(theirs, EgressPolicy())
    me = NftEgress(w.settings, owner="/my/sessions")
    me.attach(mine, EgressPolicy())
    # my server restarts: it knows none of its sessions, and never touches theirs
    assert NftEgress(w.settings, owner="/my/sessions").reap(frozenset()) == [mine]
    assert NftEgress(w.settings, owner="/other/sessions").labelled_session_ids() == {theirs}
    NftEgress(w.settings, owner="/other/sessions").detach(theirs)
    assert not deskvm_leftovers()


def test_session_failing_to_start_leaves_no_network(bare_world: World) -> None:
    """A real egress under a session whose domain fails to start: nothing is left."""
    w = bare_world
    hv = FakeHypervisor()
    hv.fail_on.add("start")
    image = BootImage("debian12-desktop", "cd" * 32, Path("/b"), Path("/k"), Path("/i"))
    spec = SessionSpec(new_session_id(), image, egress=POLICY)
    recorder = MemoryRecorder(SystemClock())
    session = Session(spec, hypervisor=hv, recorder=recorder, egress=w.egress)
    with pytest.raises(HypervisorError, match="injected"):
        session.start()
    assert session.state == "failed"
    attached = [e.data for e in recorder.events if e.kind == "network"]
    assert attached[0]["event"] == "attached" and attached[-1] == {"event": "detached"}
    assert spec.session_id not in w.egress.labelled_session_ids()
    assert not deskvm_leftovers()
