"""Warm starts with egress on real VMs: two sessions restored from one template's state,
each onto its own network.

One template boot with a NIC on a deny-all attachment of its own (20-60 s of TCG), one
save, then two sessions with different policies claim it: each restores the state onto
its own bridge and /30 (the template's MAC kept, accepted by that bridge only), its
guest's link is taken down and up, and the guest leases the session's address. Then,
from inside each guest: its allowed page is fetched from the egress test world's server,
the other session's allowed target is refused, and 32 bytes of ``/dev/urandom`` differ
between the two. ``GET /v1/sessions/{id}/network`` of each shows its own decisions only.
The pool's files are removed (as when its template is rebuilt) once both sessions run:
each overlay's backing chain names the session's own copy of the saved state, and the
guests work on. Nothing of the sessions or the pool is left at the end.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest

from agent_bridge.client import Client
from agent_bridge.runtime import BackgroundServer, build_manager
from agent_bridge.server import create_app
from orchestrator.hypervisor.base import SessionPaths
from orchestrator.settings import Settings
from orchestrator.spec import EgressPolicy, new_session_id
from tests.vm.conftest import window_box

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "egress"))
from egress_world import World, checked_world

pytestmark = pytest.mark.netns

POOL_FILL_TIMEOUT_S = 400.0
# Session A may reach allowed.test (HTTP on 203.0.113.10:80), session B 198.51.100.7:443.
ALLOW_A = ["allowed.test"]
ALLOW_B = ["198.51.100.7/32:443"]


def _script(tag: str) -> str:
    """What is typed into the xterm: the guest's address and MAC, both fetches, urandom."""
    lines = [
        "N=$(ls /sys/class/net | grep -v lo | head -1); L=/dev/ttyS1",
        f'echo "{tag} net $(ip -4 -o a s scope global | cut -d" " -f7)" > $L',
        f'echo "{tag} mac $(cat /sys/class/net/$N/address)" > $L',
        f'echo "{tag} rnd $(head -c32 /dev/urandom | od -An -tx1 | tr -d " \\n")" > $L',
        f't(){{ n=$1; shift; o=$(sh -c "$*" 2>/dev/null); echo "{tag} $n $? $o" > $L; }}',
        "t name 'curl -sf -m6 http://allowed.test/'",
        "t cidr 'curl -sf -m6 http://198.51.100.7:443/'",
        f"echo {tag} done > $L",
    ]
    return "\n".join(lines) + "\n"


def _results(session: Any, tag: str, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    results: dict[str, str] = {}
    while time.monotonic() < deadline:
        results = {}
        for line in session.guest_log().splitlines():
            parts = line.strip().split(" ", 2)
            if len(parts) >= 2 and parts[0] == tag:
                results[parts[1]] = parts[2] if len(parts) > 2 else ""
        if "done" in results:
            break
        time.sleep(1)
    return results


def _backing_chain(sessions_dir: Path, session_id: str) -> list[str]:
    """The files of the session overlay's backing chain, overlay first (``qemu-img``
    opens each by its name: one that is gone fails)."""
    overlay = SessionPaths.under(sessions_dir, session_id).overlay
    out = subprocess.run(
        ["qemu-img", "info", "-U", "--backing-chain", "--output=json", str(overlay)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, f"the backing chain of {overlay} is broken: {out.stderr}"
    return [image["filename"] for image in json.loads(out.stdout)]


def _domain_xml(session_id: str) -> str:
    conn = libvirt.open("qemu:///system")
    try:
        xml: str = conn.lookupByName(f"deskvm-{session_id}").XMLDesc(0)
        return xml
    finally:
        conn.close()


@pytest.fixture
def world() -> Iterator[World]:
    with checked_world() as w:
        yield w


def test_two_warm_egress_sessions_are_their_own(world: World) -> None:
    settings = Settings.from_env()
    settings = settings.replace(warm_pool=f"{settings.default_image}:egress", capture_fps=0)
    manager = build_manager(settings, egress=world.egress)
    assert manager.pool is not None
    token = secrets.token_urlsafe(16)
    infos: list[dict[str, Any]] = []
    results: list[dict[str, str]] = []
    decisions: list[list[dict[str, Any]]] = []
    xmls: list[str] = []
    chains: list[list[str]] = []
    placeholder = ""
    try:
        app = create_app(manager, token=token, settings=settings)
        with BackgroundServer(app) as server, Client(server.url, token) as client:
            # The server starts the pool.
            assert manager.pool.wait_full(POOL_FILL_TIMEOUT_S), manager.pool.status()
            (status,) = manager.pool.status()
            assert status["egress"] and status["ready"] == 1, status
            # The template's /30 (released after its save) goes to a placeholder when no
            # other installation took it meanwhile, so that neither session gets the
            # address the template leased. Either way the two sessions' addresses differ,
            # so at least one guest must have dropped its saved lease to hold its own.
            placeholder = new_session_id()
            world.egress.attach(placeholder, EgressPolicy())
            sessions = []
            for allow in (ALLOW_A, ALLOW_B):
                t0 = time.monotonic()
                session = client.create_session(egress_allow=allow, boot_timeout_s=180)
                sessions.append(session)
                info = session.info()
                print(
                    f"\nwarm egress start {time.monotonic() - t0:.2f} s: {info['start_phases_s']}"
                )
                infos.append(info)
                xmls.append(_domain_xml(session.id))
            # The pool's files go (as when its template is rebuilt) under the live clones:
            # each one's overlay backs onto its session's own links to the saved state.
            manager.close_pool()
            chains = [_backing_chain(settings.sessions_dir, s.id) for s in sessions]
            for n, session in enumerate(sessions):
                tag = f"W{n}" + secrets.token_hex(3)
                x0, y0, x1, y1 = window_box(session.screenshot().image())
                session.click((x0 + x1) // 2, (y0 + y1) // 2)
                for line in _script(tag).splitlines(keepends=True):
                    session.type(line)
                results.append(_results(session, tag, timeout_s=120))
            time.sleep(3)  # the last decisions reach their logs (dnsmasq stamps whole seconds)
            decisions = [client.network(s.id) for s in sessions]
            for session in sessions:
                session.delete()
    finally:
        print(f"\nguest results: {results}")
        for info in infos:
            with_id = str(info.get("id"))
            if with_id in {s.id for s in manager.live()}:
                manager.delete(with_id)
        manager.close_pool()
        if placeholder:
            world.egress.detach(placeholder)
        leftovers_hv = manager.hypervisor.list_sessions()
        manager.hypervisor.close()  # type: ignore[attr-defined]
    assert leftovers_hv == set()
    assert not (settings.pool_dir / manager.owner).exists()

    a, b = infos
    assert a["start"] == "warm" and b["start"] == "warm", (a, b)
    for info, chain in zip(infos, chains, strict=True):
        own = settings.sessions_dir / info["id"]
        assert chain[1] == str(own / "start" / "disk.qcow2"), chain
    for info in infos:
        assert {"claim_s", "egress_s", "restore_s", "link_s", "lease_s", "ready_s"} <= set(
            info["start_phases_s"]
        ), info["start_phases_s"]
    # One MAC (the template's, kept by the restore), two bridges, two subnets.
    assert a["egress"]["guest_mac"] == b["egress"]["guest_mac"]
    assert a["egress"]["bridge"] != b["egress"]["bridge"]
    assert a["egress"]["guest_ip"] != b["egress"]["guest_ip"]
    for info, xml in zip(infos, xmls, strict=True):
        assert f"<source bridge='dvm{info['id']}'/>" in xml
        assert f"<target dev='dvg{info['id']}'/>" in xml
        assert info["egress"]["guest_mac"] in xml
    ra, rb = results
    for info, r in zip(infos, results, strict=True):
        assert "done" in r, r
        # The guest holds the session's address (the template's lease was dropped).
        assert r["net"] == f"{info['egress']['guest_ip']}/30", (r, info["egress"])
        assert r["mac"] == info["egress"]["guest_mac"], r
    assert re.fullmatch(r"[0-9a-f]{64}", ra["rnd"]) and re.fullmatch(r"[0-9a-f]{64}", rb["rnd"])
    assert ra["rnd"] != rb["rnd"], "two clones read the same /dev/urandom bytes"
    # Each fetched its own allowed page; the other's allowed target was refused.
    assert ra["name"] == "0 hello from 203.0.113.10:80", ra
    assert ra["cidr"].split(" ")[0] != "0", ra
    assert rb["cidr"] == "0 hello from 198.51.100.7:443", rb
    assert rb["name"].split(" ")[0] != "0", rb

    # The decisions of each are its own.
    da, db = decisions
    queries_a = {(d["kind"], d["query"]) for d in da}
    queries_b = {(d["kind"], d["query"]) for d in db}
    conns_a = {(d["kind"], d["dst"], d["dst_port"]) for d in da}
    conns_b = {(d["kind"], d["dst"], d["dst_port"]) for d in db}
    assert ("dns_answered", "allowed.test") in queries_a, da
    assert ("conn_allowed", "203.0.113.10", 80) in conns_a, da
    assert ("conn_dropped", "198.51.100.7", 443) in conns_a, da
    assert ("dns_refused", "allowed.test") in queries_b, db
    assert ("conn_allowed", "198.51.100.7", 443) in conns_b, db
    assert ("dns_answered", "allowed.test") not in queries_b, db
    assert ("conn_allowed", "203.0.113.10", 80) not in conns_b, db
    assert ("conn_allowed", "198.51.100.7", 443) not in conns_a, da
    # What was let through came from the session's own address.
    for info, got in ((a, da), (b, db)):
        allowed_srcs = {d["src"] for d in got if d["kind"] == "conn_allowed"}
        assert allowed_srcs == {info["egress"]["guest_ip"]}, (allowed_srcs, info["egress"])
    contacts = {(e["addr"], e["port"]) for e in world.internet_events() if e["kind"] == "tcp"}
    assert ("203.0.113.10", 80) in contacts and ("198.51.100.7", 443) in contacts
    print(json.dumps({"a": a["start_phases_s"], "b": b["start_phases_s"]}))
