"""Real ring: network namespaces, a bridge, nftables, dnsmasq, ulogd (needs root).

Traffic goes only to the namespaces the world creates (see :mod:`egress_world`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from egress_world import POLICY, World, leftovers, print_table, run_bypass_table

from orchestrator.clock import SystemClock
from orchestrator.egress import EgressAttachment, NftEgress
from orchestrator.errors import EgressError, HypervisorError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.recorder import MemoryRecorder
from orchestrator.session import Session
from orchestrator.spec import BootImage, EgressPolicy, SessionSpec, new_session_id

pytestmark = pytest.mark.netns


def deskvm_leftovers() -> list[str]:
    """Leftovers of deskvm itself (not the world's own namespaces and servers)."""
    return leftovers(world=False)


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
        ["nft", "list", "set", "inet", world.egress.table, f"d4_{world.session_id}_any"],
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


def _nft_tables() -> set[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if "deskvm" in line}


def _works(w: World, ns: str, attachment: EgressAttachment) -> None:
    """The stand-in guest in ``ns`` leases its address, resolves and reaches what its
    policy allows and nothing else."""
    assert w.dhcp(ns) == attachment.guest_ip
    gw = attachment.gateway_ip
    assert w.probe("dns", gw, "allowed.test", ns=ns).get("answers") == ["203.0.113.10"]
    assert w.probe("tcp", "203.0.113.10", "80", ns=ns)["ok"]
    assert not w.probe("tcp", "198.51.100.8", "80", ns=ns)["ok"]


@pytest.mark.parametrize("first", ["a", "b"])
def test_two_installations_run_and_stop_in_either_order(bare_world: World, first: str) -> None:
    """Two installations (own state directories, so own tables, state and processes) on
    one host: each session works beside the other, each installation lists and reaps only
    its own, and either may stop first: the other keeps working, IP forwarding stays on
    until the last session of the host is gone and is then restored."""
    w = bare_world
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    other = NftEgress(dataclasses.replace(w.settings, state_dir=w.tmp / "state-b"))
    egress = {"a": w.egress, "b": other}
    assert egress["a"].table != egress["b"].table
    sids = {"a": new_session_id(), "b": new_session_id()}
    attached: dict[str, EgressAttachment] = {}
    try:
        for name in ("a", "b"):
            attached[name] = egress[name].attach(sids[name], POLICY)
        assert attached["a"].guest_ip != attached["b"].guest_ip
        assert attached["a"].nflog_group != attached["b"].nflog_group
        guests = {name: w.add_guest(attached[name]) for name in ("a", "b")}
        for name in ("a", "b"):
            _works(w, guests[name], attached[name])
        # A session of one installation cannot reach the other's guest.
        reach_b = w.probe("tcp", attached["b"].guest_ip, "80", ns=guests["a"])
        assert not reach_b["ok"], reach_b
        # Each installation sees and reaps only its own sessions.
        assert egress["a"].labelled_session_ids() == {sids["a"]}
        assert egress["b"].labelled_session_ids() == {sids["b"]}
        assert egress["b"].reap(frozenset({sids["b"]})) == []
        assert NftEgress(other.settings).reap(frozenset({sids["b"]})) == []  # restarted b

        second = "b" if first == "a" else "a"
        egress[first].detach(sids[first])
        assert forward.read_text().strip() == "1"
        tables = _nft_tables()
        assert egress[first].table not in tables
        assert {egress[second].table, "deskvm_guard"} <= tables
        assert egress[second].labelled_session_ids() == {sids[second]}
        reach = w.probe("tcp", "203.0.113.10", "80", ns=guests[second])
        assert reach["ok"], reach
        assert not w.probe("tcp", "198.51.100.8", "80", ns=guests[second])["ok"]

        egress[second].detach(sids[second])
        assert forward.read_text().strip() == w.forward_before
        assert not _nft_tables() & {egress["a"].table, egress["b"].table, "deskvm_guard"}
    finally:
        for name in ("a", "b"):
            egress[name].detach(sids[name])
    assert not deskvm_leftovers()


def test_the_guard_forwards_nothing_but_session_traffic(bare_world: World) -> None:
    """While forwarding is on for a session, the host still routes nothing else: traffic
    between two non-deskvm interfaces is dropped by the guard."""
    w = bare_world
    w.attach()
    guard = subprocess.run(
        ["nft", "list", "table", "inet", "deskvm_guard"], capture_output=True, text=True
    ).stdout
    assert "policy drop" in guard and f'"{w.attachment.bridge}"' in guard  # type: ignore[union-attr]
    # The stand-in guest's namespace, addressed by hand on a plain veth (no deskvm bridge):
    # the internet namespace cannot be reached through the host from it.
    sh_ns = ("ip", "-n", w.guest_ns)
    subprocess.run(["ip", "link", "add", "dvtplain0", "type", "veth", "peer", "name", "p0",
                    "netns", w.guest_ns], check=True)  # fmt: skip
    try:
        subprocess.run(["ip", "addr", "add", "192.0.2.201/30", "dev", "dvtplain0"], check=True)
        subprocess.run(["ip", "link", "set", "dvtplain0", "up"], check=True)
        subprocess.run([*sh_ns, "addr", "add", "192.0.2.202/30", "dev", "p0"], check=True)
        subprocess.run([*sh_ns, "link", "set", "p0", "up"], check=True)
        subprocess.run([*sh_ns, "route", "add", "203.0.113.10/32", "via", "192.0.2.201"],
                       check=True)  # fmt: skip
        # The internet answers 192.0.2.202 back through the host: only the guard stops it.
        subprocess.run(["ip", "-n", w.inet_ns, "route", "add", "192.0.2.202/32",
                        "via", "203.0.113.1"], check=True)  # fmt: skip
        result = w.probe("tcp", "203.0.113.10", "80")
        assert not result["ok"], result
    finally:
        subprocess.run(["ip", "link", "del", "dvtplain0"], check=False)


def test_a_restarted_server_adopts_the_egress_and_restarts_what_died(world: World) -> None:
    """A bridge restart (issue 10, section 2): a new NftEgress of the same installation
    takes the session back; a resolver killed with the old server's service is started
    again; decisions read again from the logs equal the ones read before (so the
    session records none twice), and DNS and filtering work as before."""
    w = world
    assert w.attachment is not None
    sid, gateway = w.session_id, w.attachment.gateway_ip
    w.dhcp()
    assert w.probe("dns", gateway, "allowed.test")["ok"]
    assert not w.probe("dns", gateway, "deny.test")["ok"]
    deadline = time.monotonic() + 5
    while len([d for d in w.egress.decisions(sid) if d.query]) < 2:
        assert time.monotonic() < deadline, w.egress.decisions(sid)
        time.sleep(0.2)
    before = w.egress.decisions(sid)
    # The old server's service is killed with it: its dnsmasq too (ulogd survives).
    state = w.settings.state_dir / sid
    os.kill(int((state / "dnsmasq.pid").read_text()), signal.SIGKILL)
    time.sleep(0.2)
    fresh = NftEgress(w.settings, owner=w.egress.owner)
    assert fresh.adopt(sid, POLICY) == w.attachment
    assert fresh.decisions(sid)[: len(before)] == before
    assert w.probe("dns", gateway, "allowed.test")["ok"]  # the resolver is back
    assert w.probe("tcp", "203.0.113.10", "80")["ok"]
    assert not w.probe("tcp", "198.51.100.8", "80")["ok"]
    with pytest.raises(EgressError, match="another installation"):
        NftEgress(w.settings, owner="/elsewhere").adopt(sid, POLICY)
    w.egress = fresh  # (the world detaches with it)


LEGACY_SID = "zzlegacy0001"
LEGACY_RULES = f"""
table inet deskvm {{
    chain fwd_{LEGACY_SID} {{ accept; }}
    chain forward {{ type filter hook forward priority filter; policy drop; }}
    chain input {{ type filter hook input priority filter; policy drop; }}
}}
table bridge deskvm_{LEGACY_SID} {{
    chain prerouting {{ type filter hook prerouting priority -200; policy accept; }}
}}
"""


def _add_legacy_leftovers() -> None:
    """What a server of a deskvm version before per-installation names leaves when it is
    killed: the shared ``inet deskvm`` table (policy-drop hooks), a session's bridge table
    and its bridge with the old ``deskvm:<id>`` alias."""
    subprocess.run(["nft", "-f", "-"], input=LEGACY_RULES, text=True, check=True)
    br = f"dvm{LEGACY_SID}"
    subprocess.run(["ip", "link", "add", br, "type", "bridge"], check=True)
    subprocess.run(["ip", "link", "set", br, "alias", f"deskvm:{LEGACY_SID}"], check=True)


def _remove_legacy_leftovers() -> None:
    for argv in (
        ["nft", "delete", "table", "inet", "deskvm"],
        ["nft", "delete", "table", "bridge", f"deskvm_{LEGACY_SID}"],
        ["ip", "link", "del", f"dvm{LEGACY_SID}"],
    ):
        subprocess.run(argv, capture_output=True)
    # The orphan dnsmasq's pid file (it drops root, so it cannot remove the file itself).
    Path(f"/tmp/{LEGACY_SID}.pid").unlink(missing_ok=True)


def test_an_older_versions_dead_leftovers_are_cleared_at_attach(bare_world: World) -> None:
    """A killed server of an older version left its policy-drop table: before this was
    handled, every later session's DNS and allowed connections timed out. The next attach
    clears the dead version's objects and the session works."""
    w = bare_world
    _add_legacy_leftovers()
    # Its dnsmasq outlived the killed server (a daemon): an orphan, stopped with the rest.
    orphan = subprocess.Popen(
        ["dnsmasq", "--keep-in-foreground", "--port=0", f"--pid-file=/tmp/{LEGACY_SID}.pid"]
    )
    try:
        attachment = w.attach()
        assert orphan.wait(timeout=5) is not None
        assert "deskvm" not in _nft_tables()
        assert f"deskvm_{LEGACY_SID}" not in _nft_tables()
        assert not Path(f"/sys/class/net/dvm{LEGACY_SID}").exists()
        _works(w, w.guest_ns, attachment)
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        _remove_legacy_leftovers()


def test_an_older_versions_live_session_is_named_not_broken(bare_world: World) -> None:
    """While a process still names a legacy session (an older server is running), attach
    refuses with the reason and touches nothing of it."""
    w = bare_world
    _add_legacy_leftovers()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", LEGACY_SID]
    )  # its QEMU
    try:
        with pytest.raises(EgressError, match=f"older deskvm.*{LEGACY_SID}.*stop that server"):
            w.egress.attach(new_session_id(), POLICY)
        assert "deskvm" in _nft_tables()
        assert Path(f"/sys/class/net/dvm{LEGACY_SID}").exists()
    finally:
        holder.kill()
        holder.wait()
        _remove_legacy_leftovers()


def test_two_sessions_sharing_one_mac_never_meet(bare_world: World) -> None:
    """Warm starts with egress: clones of one template keep its MAC, each session's
    network accepts it (``guest_mac``), and the two stay apart: each stand-in guest leases
    its own session's address, ARP answers only its own gateway (not the other session's,
    which is a local address of the host too), and a packet to the other is dropped."""
    w = bare_world
    mac = "52:54:00:12:34:56"
    a = w.egress.attach(new_session_id(), EgressPolicy(allow=("allowed.test",)), guest_mac=mac)
    b = w.egress.attach(new_session_id(), EgressPolicy(), guest_mac=mac)
    try:
        assert a.guest_mac == b.guest_mac == mac and a.bridge != b.bridge
        ns_a, ns_b = w.add_guest(a), w.add_guest(b)
        assert w.egress.leased_ip(a.session_id) is None
        assert w.dhcp(ns_a) == a.guest_ip and w.dhcp(ns_b) == b.guest_ip
        assert w.egress.leased_ip(a.session_id) == a.guest_ip
        assert w.egress.leased_ip(b.session_id) == b.guest_ip

        def arp(ns: str, ip: str) -> bool:
            argv = ("ip", "netns", "exec", ns, "busybox", "arping", "-c", "1", "-w", "2")
            return subprocess.run([*argv, "-I", "eth0", ip], capture_output=True).returncode == 0

        assert arp(ns_a, a.gateway_ip) and arp(ns_b, b.gateway_ip)
        assert not arp(ns_a, b.gateway_ip) and not arp(ns_b, a.gateway_ip)
        for dst in (b.guest_ip, b.gateway_ip):
            assert not w.probe("tcp", dst, "80", ns=ns_a)["ok"]
        r = w.probe("dns", a.gateway_ip, "allowed.test", ns=ns_a)
        assert r["ok"], r
        r = w.probe("dns", b.gateway_ip, "allowed.test", ns=ns_b)
        assert not r.get("answers"), r  # b's resolver allows nothing
        time.sleep(1.5)  # dnsmasq stamps whole seconds
        assert not [d for d in w.egress.decisions(b.session_id) if d.query == "allowed.test"
                    and d.kind == "dns_answered"]  # fmt: skip
    finally:
        w.egress.detach(a.session_id)
        w.egress.detach(b.session_id)
    assert not deskvm_leftovers()


def _dns_query(name: str) -> bytes:
    """A minimal DNS query for ``name``'s A record (RFC 1035 4.1), id 0x1234."""
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return bytes.fromhex("123401000001000000000000") + labels + b"\x00\x00\x01\x00\x01"


def test_a_guest_cannot_make_the_resolver_answer_a_forged_source(bare_world: World) -> None:
    """A guest that takes another address (here the other session's guest address, as a
    warm clone keeping its template's lease could) and asks its own gateway's resolver
    from it: the host drops the query, so no answer is sent out another interface (before,
    dnsmasq answered the forged source and the other session's guest received it)."""
    w = bare_world
    a = w.egress.attach(new_session_id(), EgressPolicy(allow=("allowed.test",)))
    b = w.egress.attach(new_session_id(), EgressPolicy(allow=("allowed.test",)))
    try:
        ns_a, ns_b = w.add_guest(a), w.add_guest(b)
        assert w.dhcp(ns_a) == a.guest_ip and w.dhcp(ns_b) == b.guest_ip
        port = 40053
        listen = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"s.bind(({b.guest_ip!r}, {port}))\n"
            "s.settimeout(float(sys.argv[1]))\n"
            "if len(sys.argv) > 2:  # the control: ask from this very socket\n"
            "    s.sendto(bytes.fromhex(sys.argv[3]), (sys.argv[2], 53))\n"
            "print('listening', flush=True)\n"
            "try:\n"
            "    data, src = s.recvfrom(4096)\n"
            "    print('got', src[0], len(data), flush=True)\n"
            "except TimeoutError:\n"
            "    print('nothing', flush=True)\n"
        )
        send = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "s.bind((sys.argv[1], int(sys.argv[2])))\n"
            "s.sendto(bytes.fromhex(sys.argv[3]), (sys.argv[4], 53))\n"
        )
        query = _dns_query("allowed.test").hex()

        def listened(*control: str, forged: tuple[str, str] | None = None) -> str:
            """What b's listener got: after asking ``control`` (its gateway, the query)
            itself, or after a's guest asked a's gateway from ``forged`` (address, port)."""
            argv = ["ip", "netns", "exec", ns_b, sys.executable, "-c", listen, "3", *control]
            listener = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            try:
                assert listener.stdout is not None
                assert listener.stdout.readline().strip() == "listening"
                if forged is not None:
                    subprocess.run(
                        ["ip", "netns", "exec", ns_a, sys.executable, "-c", send, *forged,
                         query, a.gateway_ip],
                        check=True, timeout=10,
                    )  # fmt: skip
                out, _ = listener.communicate(timeout=10)
            finally:
                listener.kill()
                listener.wait()
            return out.strip()

        # The control: b's listener asking b's gateway gets the answer.
        assert listened(b.gateway_ip, query) == f"got {b.gateway_ip} 46", "control"
        # a, holding b's address too, asks a's gateway from it: nothing reaches b.
        subprocess.run(["ip", "-n", ns_a, "addr", "add", f"{b.guest_ip}/32", "dev", "eth0"],
                       check=True)  # fmt: skip
        assert listened(forged=(b.guest_ip, str(port))) == "nothing"
        time.sleep(1.5)  # the drop's log record comes through ulogd
        drops = [d for d in w.egress.decisions(a.session_id) if d.kind != "dns_answered"]
        assert any(str(d.src) == b.guest_ip for d in drops), drops
    finally:
        w.egress.detach(a.session_id)
        w.egress.detach(b.session_id)
    assert not deskvm_leftovers()


def test_an_adopted_bridge_answers_arp_for_its_own_gateway_only(bare_world: World) -> None:
    """A session bridge made before ``arp_ignore=1`` was set at attach (an older version's,
    taken back by a restarted server) gets it at adopt: before, its guest could still probe
    which other sessions' gateways exist."""
    w = bare_world
    a = w.egress.attach(new_session_id(), POLICY)
    b = w.egress.attach(new_session_id(), EgressPolicy())
    try:
        ns_a = w.add_guest(a)
        assert w.dhcp(ns_a) == a.guest_ip

        def arp(ip: str) -> bool:
            argv = ("ip", "netns", "exec", ns_a, "busybox", "arping", "-c", "1", "-w", "2")
            return subprocess.run([*argv, "-I", "eth0", ip], capture_output=True).returncode == 0

        sysctl = Path(f"/proc/sys/net/ipv4/conf/{a.bridge}/arp_ignore")
        sysctl.write_text("0\n")  # as an older version left it
        assert arp(a.gateway_ip) and arp(b.gateway_ip)  # the control: b's gateway answers
        fresh = NftEgress(w.settings, owner=w.egress.owner)
        assert fresh.adopt(a.session_id, POLICY) == a
        assert sysctl.read_text().strip() == "1"
        assert arp(a.gateway_ip) and not arp(b.gateway_ip)
    finally:
        w.egress.detach(a.session_id)
        w.egress.detach(b.session_id)
    assert not deskvm_leftovers()
