"""A test world of network namespaces for the real egress tests and the bypass table.

    guest ns (dvt<r>g)          host (init ns)                      internet ns (dvt<r>i)
    eth0 --veth-- dvg<sid> ⊂ bridge dvm<sid> .1   [nft]   dvt<r>u --veth-- eth0 203.0.113.2
                                                  203.0.113.1/30        lo: 198.51.100.{7,8,9,53}
                                                                            203.0.113.{10,11}
                                                                            2001:db8:1::80

The host routes only the world's own addresses (host routes, /32) to the internet
namespace. The real uplink of these machines sits in 192.0.2.0/24, which the world never
touches, and the package mirror answers at an address inside 203.0.113.0/24: routing the
whole range would cut the host off from apt and PyPI while a test runs.
Everything created is removed by :meth:`World.close`, also after a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.egress import EgressAttachment, EgressSettings, NftEgress
from orchestrator.spec import EgressPolicy, new_session_id

HERE = Path(__file__).resolve().parent
# The "internet" namespace's addresses; the host routes exactly these to it.
INTERNET_ADDRS = (
    "198.51.100.7",
    "198.51.100.8",
    "198.51.100.9",
    "198.51.100.53",
    "203.0.113.10",
    "203.0.113.11",
)
POLICY = EgressPolicy(allow=("allowed.test", "*.wild.test", "198.51.100.7/32:443", "*.rebind.test"))
ZONE_A = {
    "allowed.test": "203.0.113.10",
    "sub.allowed.test": "203.0.113.10",
    "x.wild.test": "203.0.113.11",
    "deny.test": "198.51.100.8",
}
ZONE_AAAA = {"allowed.test": "2001:db8:1::80"}
HOST_SERVICE_PORT = 18080


def sh(*argv: str, check: bool = True, timeout_s: float = 20) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Row:
    attempt: str
    expected: str
    observed: str
    passed: bool


class World:
    """Namespaces, the internet server, an egress attached with :data:`POLICY`."""

    def __init__(self) -> None:
        r = secrets.token_hex(2)
        self.inet_ns, self.guest_ns, self.up = f"dvt{r}i", f"dvt{r}g", f"dvt{r}u"
        self.tmp = Path(tempfile.mkdtemp(prefix="deskvm-egress-"))
        self.settings = EgressSettings(
            upstream_iface=self.up,
            upstream_dns=("198.51.100.53",),
            masquerade=True,
            state_dir=self.tmp / "state",
        )
        self.egress = NftEgress(self.settings)
        self.session_id = new_session_id()
        self.attachment: EgressAttachment | None = None
        self.server: subprocess.Popen[bytes] | None = None
        self.internet_log = self.tmp / "internet.log"
        self.host_service: socket.socket | None = None
        self.forward_before = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        self.extra_ns: list[str] = []
        self.closed_events: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------- building

    def open(self) -> World:
        sh("ip", "netns", "add", self.inet_ns)
        sh("ip", "netns", "add", self.guest_ns)
        sh(
            "ip",
            "link",
            "add",
            self.up,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            self.inet_ns,
        )
        sh("ip", "addr", "add", "203.0.113.1/30", "dev", self.up)
        sh("ip", "link", "set", self.up, "up")
        ns = ("ip", "-n", self.inet_ns)
        sh(*ns, "addr", "add", "203.0.113.2/30", "dev", "eth0")
        sh(*ns, "link", "set", "eth0", "up")
        sh(*ns, "link", "set", "lo", "up")
        for addr in INTERNET_ADDRS:
            sh(*ns, "addr", "add", f"{addr}/32", "dev", "lo")
        sh(*ns, "-6", "addr", "add", "2001:db8:1::80/128", "dev", "lo", "nodad")
        for addr in INTERNET_ADDRS:
            sh("ip", "route", "add", f"{addr}/32", "via", "203.0.113.2", "dev", self.up)
        config = {
            "log": str(self.internet_log),
            "dns": ["198.51.100.53"],
            "tcp": [
                ["198.51.100.7", 443],
                ["198.51.100.7", 80],
                ["198.51.100.8", 80],
                ["203.0.113.10", 80],
                ["203.0.113.11", 80],
                ["2001:db8:1::80", 80],
            ],
            "udp": [["198.51.100.9", 9999]],
            "a": ZONE_A,
            "aaaa": ZONE_AAAA,
        }
        (self.tmp / "internet.json").write_text(json.dumps(config))
        self.internet_log.touch()
        self.server = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.inet_ns,
                sys.executable,
                str(HERE / "internet_server.py"),
                str(self.tmp / "internet.json"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait(lambda: "ready" in self.internet_log.read_text(), "internet server")
        return self

    def attach(self) -> EgressAttachment:
        self.attachment = a = self.egress.attach(self.session_id, POLICY)
        self.plug_guest(a, self.guest_ns)
        return a

    def add_guest(self, attachment: EgressAttachment) -> str:
        """A further stand-in guest (its own namespace) plugged into ``attachment``'s
        bridge, e.g. for a session of a second installation; removed by :meth:`close`."""
        ns = f"{self.guest_ns}{len(self.extra_ns) + 2}"
        sh("ip", "netns", "add", ns)
        self.extra_ns.append(ns)
        self.plug_guest(attachment, ns)
        return ns

    def plug_guest(self, a: EgressAttachment, ns: str) -> None:
        # Stand-in guest: a veth whose host end is the port the VM's tap would be.
        sh("ip", "link", "add", a.guest_port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", a.guest_port, "master", a.bridge)
        sh("ip", "link", "set", a.guest_port, "up")
        g = ("ip", "-n", ns)
        sh(*g, "link", "set", "eth0", "address", a.guest_mac)
        sh(*g, "link", "set", "eth0", "up")
        sh(*g, "link", "set", "lo", "up")

    def dhcp(self, ns: str | None = None) -> str:
        """Lease an address in the stand-in guest ``ns`` (default: the world's guest)."""
        ns = ns or self.guest_ns
        lease = self.tmp / f"lease-{ns}"
        script = self.tmp / f"udhcpc-{ns}.sh"
        script.write_text(
            "#!/bin/sh\n"
            'if [ "$1" = bound ]; then ip addr add "$ip/$mask" dev "$interface";'
            f' ip route add default via "$router"; echo "$ip" > {lease}; fi\n'
        )
        script.chmod(0o755)
        udhcpc = ("busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-t", "5", "-T", "1")
        sh("ip", "netns", "exec", ns, *udhcpc, "-s", str(script), timeout_s=30)
        return lease.read_text().strip()

    def probe(self, *args: str, ns: str | None = None) -> dict[str, Any]:
        """Run ``probe.py args`` in the stand-in guest ``ns`` (default: the world's guest)."""
        probe = (sys.executable, str(HERE / "probe.py"), *args)
        out = sh("ip", "netns", "exec", ns or self.guest_ns, *probe, timeout_s=30)
        result: dict[str, Any] = json.loads(out)
        return result

    def internet_events(self) -> list[dict[str, Any]]:
        """What the world's internet server logged (kept in memory once the world closed)."""
        if self.closed_events is not None:
            return list(self.closed_events)
        return [json.loads(line) for line in self.internet_log.read_text().splitlines()]

    def _wait(self, cond: Any, what: str, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}")

    # ------------------------------------------------------------- teardown

    def close(self) -> list[str]:
        """Remove everything; returns what failed (empty when clean)."""
        errors: list[str] = []

        def step(fn: Any) -> None:
            try:
                fn()
            except Exception as exc:
                errors.append(repr(exc))

        if self.host_service is not None:
            step(self.host_service.close)
        step(lambda: self.egress.detach(self.session_id))
        if self.server is not None:
            step(self.server.kill)
            step(self.server.wait)
        for addr in INTERNET_ADDRS:
            step(lambda addr=addr: sh("ip", "route", "del", f"{addr}/32", check=False))
        for link in (self.up,):
            if Path(f"/sys/class/net/{link}").exists():
                step(lambda link=link: sh("ip", "link", "del", link))
        for ns in (self.guest_ns, *self.extra_ns, self.inet_ns):
            if Path(f"/run/netns/{ns}").exists():
                step(lambda ns=ns: sh("ip", "netns", "del", ns))
        forward = Path("/proc/sys/net/ipv4/ip_forward")
        if forward.read_text().strip() != self.forward_before:
            errors.append("ip_forward was not restored")
            # Switch it off if deskvm left it on, never on: a value read while another run's
            # session had it on is no value to restore (written back, it left the host
            # forwarding after both runs ended).
            if self.forward_before == "0":
                forward.write_text("0\n")
        # The server's log outlives the world (tests read it after close); the directory not.
        if self.closed_events is None:
            try:
                self.closed_events = [
                    json.loads(line) for line in self.internet_log.read_text().splitlines()
                ]
            except (OSError, ValueError):
                self.closed_events = []
        shutil.rmtree(self.tmp, ignore_errors=True)
        return errors

    def __enter__(self) -> World:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        errors = self.close()
        if errors and exc[0] is None:
            raise RuntimeError(f"world teardown failed: {errors}")


@contextlib.contextmanager
def checked_world(*, attach: bool = False, before: Iterable[str] = ()) -> Iterator[World]:
    """A world opened for the block (with an attached session if ``attach``), closed after
    it even when it fails, then checked: the close had no errors and nothing deskvm- or
    test-labelled is left on the host but what ``before`` names (what was there before the
    test: an earlier run's, not this one's).

    Raises:
        AssertionError: the close had errors, or something was left behind.
    """
    known = set(before)
    w = World()
    try:
        w.open()
        if attach:
            w.attach()
        yield w
    finally:
        errors = w.close()
        left = [x for x in leftovers() if x not in known]
        assert not errors, errors
        assert not left, f"left behind: {left}"


def purge_test_worlds() -> list[str]:
    """Delete every test world on the host (``dvt*`` links and namespaces, the internet
    servers running in them); returns what was removed. Only these tests create such names."""
    removed = []
    for path in Path("/sys/class/net").iterdir():
        if path.name.startswith("dvt"):
            sh("ip", "link", "del", path.name, check=False)
            removed.append(f"link {path.name}")
    netns = Path("/run/netns")
    for ns in sorted(netns.iterdir()) if netns.is_dir() else []:
        if ns.name.startswith("dvt"):
            pids = sh("ip", "netns", "pids", ns.name, check=False).split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", ns.name, check=False)
            removed.append(f"netns {ns.name}")
    return removed


def leftovers(*, world: bool = True) -> list[str]:
    """Anything deskvm- or test-labelled still on the host (``world=False``: not the test
    worlds' own namespaces, links and internet servers)."""
    found = []
    for path in Path("/sys/class/net").iterdir():
        if path.name.startswith(("dvm", "dvg", "dvt")):
            found.append(f"link {path.name}")
    netns = Path("/run/netns")
    if netns.is_dir():
        found += [f"netns {p.name}" for p in netns.iterdir() if p.name.startswith("dvt")]
    tables = sh("nft", "list", "tables")
    found += [f"nft {t}" for t in tables.splitlines() if "deskvm" in t]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # a process may end between any two of these reads
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # A world's server is told apart by its whole command line: shown cut, a long
            # checkout path hid its name.
            mine = world or "internet_server" not in cmd
            if "deskvm-egress-" in cmd and ") Z" not in stat and mine:
                found.append(f"process {entry.name}: {cmd[:80]}")
    if not world:
        found = [x for x in found if "dvt" not in x]
    return found


def run_bypass_table(world: World) -> list[Row]:
    """Run every attempt of the bypass table from the stand-in guest."""
    assert world.attachment is not None
    a = world.attachment
    rows: list[Row] = []

    def row(attempt: str, expected: str, observed: str, passed: bool) -> None:
        rows.append(Row(attempt, expected, observed, passed))

    def reach(result: dict[str, Any]) -> str:
        return f"reached ({result['detail']})" if result["ok"] else f"blocked ({result['detail']})"

    lease = world.dhcp()
    row(
        "DHCP from the session's dnsmasq",
        f"lease {a.guest_ip}",
        f"lease {lease}",
        lease == a.guest_ip,
    )
    gw = a.gateway_ip

    r = world.probe("tcp", "203.0.113.10", "80")
    row("TCP 203.0.113.10:80 before resolving allowed.test", "blocked", reach(r), not r["ok"])
    r = world.probe("dns", gw, "allowed.test")
    row(
        "DNS allowed.test via resolver",
        "answered 203.0.113.10",
        f"{r['detail']} {r.get('answers')}",
        r.get("answers") == ["203.0.113.10"],
    )
    r = world.probe("tcp", "203.0.113.10", "80")
    row("HTTP allowed.test (203.0.113.10:80)", "reached", reach(r), r["ok"])
    r = world.probe("dns", gw, "x.wild.test")
    r2 = world.probe("tcp", "203.0.113.11", "80")
    row(
        "DNS x.wild.test (*.wild.test) + HTTP",
        "answered, reached",
        f"{r['detail']} {r.get('answers')}, {reach(r2)}",
        r["ok"] and r2["ok"],
    )
    r = world.probe("dns", gw, "sub.allowed.test")
    row(
        "DNS sub.allowed.test (exact entry only)",
        "NXDOMAIN",
        r["detail"],
        r["detail"] == "NXDOMAIN",
    )
    r = world.probe("tcp", "198.51.100.7", "443")
    row("TCP 198.51.100.7:443 (CIDR:port entry)", "reached", reach(r), r["ok"])
    r = world.probe("tcp", "198.51.100.7", "80")
    row("TCP 198.51.100.7:80 (port not in entry)", "blocked", reach(r), not r["ok"])
    r = world.probe("tcp", "198.51.100.8", "80")
    row("TCP 198.51.100.8:80 (direct IP, not allowed)", "blocked", reach(r), not r["ok"])
    sh("ip", "-n", world.guest_ns, "-6", "addr", "add", "2001:db8:dd::2/64", "dev", "eth0", "nodad")
    sh("ip", "-n", world.guest_ns, "-6", "route", "add", "default", "dev", "eth0")
    r = world.probe("tcp", "2001:db8:1::80", "80")
    row("TCP [2001:db8:1::80]:80 (IPv6)", "blocked", reach(r), not r["ok"])
    r = world.probe("icmp", "203.0.113.10")
    row("ICMP echo 203.0.113.10 (allowed host)", "blocked", reach(r), not r["ok"])
    r = world.probe("udp", "198.51.100.9", "9999")
    row("UDP 198.51.100.9:9999", "blocked", reach(r), not r["ok"])
    r = world.probe("udp", "203.0.113.10", "443")
    row("UDP 203.0.113.10:443 (allowed host, QUIC port)", "blocked", reach(r), not r["ok"])
    r = world.probe("dns", "198.51.100.53", "allowed.test")
    row("DNS/UDP to outside resolver 198.51.100.53", "blocked", reach(r), not r["ok"])
    r = world.probe("dns", "198.51.100.53", "allowed.test", "tcp")
    row("DNS/TCP to outside resolver 198.51.100.53", "blocked", reach(r), not r["ok"])
    before = {e["name"] for e in world.internet_events() if e["kind"] == "dns"}
    names = [f"{secrets.token_hex(6)}.deny.test" for _ in range(5)]
    codes = [world.probe("dns", gw, n)["detail"] for n in names]
    time.sleep(0.3)
    seen = {e["name"] for e in world.internet_events() if e["kind"] == "dns"} - before
    leaked = [n for n in names if n in seen or any("deny.test" in s for s in seen)]
    row(
        "5 random subdomains of deny.test",
        "NXDOMAIN, 0 upstream queries",
        f"{sorted(set(codes))}, {len(leaked)} upstream queries",
        set(codes) == {"NXDOMAIN"} and not leaked,
    )
    r = world.probe("dns", gw, "ip-169-254-169-254.rebind.test")
    row("allowlisted name -> 169.254.169.254", "refused", r["detail"], not r["ok"])
    r = world.probe("dns", gw, f"ip-{gw.replace('.', '-')}.rebind.test")
    row(f"allowlisted name -> bridge address {gw}", "refused", r["detail"], not r["ok"])
    r = world.probe("dns", gw, "ip-10-1-2-3.rebind.test")
    row("allowlisted name -> 10.1.2.3 (private)", "refused", r["detail"], not r["ok"])
    world.host_service = socket.create_server((gw, HOST_SERVICE_PORT))
    world.host_service.settimeout(0.1)
    threading.Thread(target=_accept_loop, args=(world.host_service,), daemon=True).start()
    r = world.probe("tcp", gw, str(HOST_SERVICE_PORT))
    row(f"host service {gw}:{HOST_SERVICE_PORT} via bridge", "blocked", reach(r), not r["ok"])
    r = world.probe("icmp", gw)
    row(f"ICMP echo to bridge address {gw}", "blocked", reach(r), not r["ok"])
    r = world.probe("dns", gw, "allowed.test", "tcp")
    row(
        f"DNS/TCP to session resolver {gw}",
        "answered",
        f"{r['detail']} {r.get('answers')}",
        r["ok"],
    )
    seen_frames = _sniff_nonip(world, a.bridge)
    row(
        "non-IP frame (ethertype 0x88b5)",
        "dropped at bridge",
        "seen on bridge" if seen_frames else "dropped at bridge",
        not seen_frames,
    )
    counters = world.egress.counters(world.session_id)
    row(
        "packets out by an interface other than upstream",
        "0 (upstream > 0)",
        f"{counters['other']} (upstream {counters['upstream']})",
        counters["other"] == 0 and counters["upstream"] > 0,
    )
    return rows


def _accept_loop(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
            conn.close()
        except TimeoutError:
            continue
        except OSError:
            return


def _sniff_nonip(world: World, bridge: str) -> bool:
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x88B5)) as s:
        s.bind((bridge, 0))
        s.settimeout(1.0)
        world.probe("ether", "88b5", "eth0")
        try:
            while True:
                data = s.recv(2048)
                if b"deskvm-nonip" in data:
                    return True
        except TimeoutError:
            return False


def print_table(rows: list[Row]) -> str:
    width = max(len(r.attempt) for r in rows)
    ew = max(len(r.expected) for r in rows)
    lines = [f"{'attempt'.ljust(width)} | {'expected'.ljust(ew)} | observed"]
    lines.append("-" * len(lines[0]) + "-" * 20)
    for r in rows:
        mark = "" if r.passed else "   <-- MISMATCH"
        lines.append(f"{r.attempt.ljust(width)} | {r.expected.ljust(ew)} | {r.observed}{mark}")
    return "\n".join(lines)
