"""Pure ring: dnsmasq and ulogd log lines become decisions."""

from __future__ import annotations

import json
import time

from orchestrator.egress.logs import DnsLogParser, parse_ulogd_line

SID = "abcdefgh2345"
LINES = """\
Nov 29 08:41:55 dnsmasq[6903]: started, version 2.90 cachesize 150
Nov 29 08:41:55 dnsmasq[6903]: 1 10.213.0.2/49593 query[A] allowed.test from 10.213.0.2
Nov 29 08:41:55 dnsmasq[6903]: 1 10.213.0.2/49593 forwarded allowed.test to 198.51.100.53
Nov 29 08:41:55 dnsmasq[6903]: 1 10.213.0.2/49593 reply allowed.test is 203.0.113.10
Nov 29 08:41:55 dnsmasq[6903]: 1 10.213.0.2/49593 reply allowed.test is 203.0.113.12
Nov 29 08:41:56 dnsmasq[6903]: 2 10.213.0.2/45242 query[A] x.deny.test from 10.213.0.2
Nov 29 08:41:56 dnsmasq[6903]: 2 10.213.0.2/45242 config x.deny.test is NXDOMAIN
Nov 29 08:41:56 dnsmasq[6903]: 3 10.213.0.2/36004 query[A] ip-169-254-1-1.r.test from 10.213.0.2
Nov 29 08:41:56 dnsmasq[6903]: 3 10.213.0.2/36004 forwarded ip-169-254-1-1.r.test to 198.51.100.53
Nov 29 08:41:56 dnsmasq[6903]: 3 10.213.0.2/36004 config ip-169-254-1-1.r.test is NXDOMAIN
Nov 29 08:41:57 dnsmasq[6903]: 4 10.213.0.2/36005 query[AAAA] allowed.test from 10.213.0.2
Nov 29 08:41:57 dnsmasq[6903]: 4 10.213.0.2/36005 cached allowed.test is NODATA-IPv6
"""


def test_dnsmasq_lines() -> None:
    parser = DnsLogParser(SID)
    out = []
    for line in LINES.splitlines():
        out += parser.feed(line, offset_ns=0, now_wall_s=time.time())
    out += parser.flush()
    assert [(d.kind, d.query, d.reason, d.answers) for d in out] == [
        ("dns_answered", "allowed.test", "allowlisted", ("203.0.113.10", "203.0.113.12")),
        ("dns_refused", "x.deny.test", "not-allowlisted", ()),
        ("dns_refused", "ip-169-254-1-1.r.test", "refused-answer", ()),
        ("dns_answered", "allowed.test", "allowlisted", ()),
    ]
    assert out[0].src == "10.213.0.2" and out[0].src_port == 49593
    assert out[0].ts_ns < out[1].ts_ns


def test_ulogd_line() -> None:
    event = {
        "oob.prefix": f"dvm:{SID}:D:default",
        "oob.time.sec": 100,
        "oob.time.usec": 5,
        "ip.protocol": 6,
        "src_ip": "10.213.0.2",
        "dest_ip": "198.51.100.8",
        "src_port": 40000,
        "dest_port": 80,
    }
    d = parse_ulogd_line(json.dumps(event), SID, offset_ns=1_000)
    assert d is not None
    assert (d.kind, d.reason, d.protocol, d.dst, d.dst_port) == (
        "conn_dropped",
        "default",
        "tcp",
        "198.51.100.8",
        80,
    )
    assert d.ts_ns == 100_000_005_000 - 1_000
    event["oob.prefix"] = f"dvm:{SID}:A:cidr:0"
    allowed = parse_ulogd_line(json.dumps(event), SID, offset_ns=0)
    assert allowed is not None and allowed.kind == "conn_allowed" and allowed.reason == "cidr:0"


def test_ulogd_line_of_another_session_or_garbage() -> None:
    assert parse_ulogd_line('{"oob.prefix": "dvm:zzzzzzzzzzzz:D:x"}', SID, 0) is None
    assert parse_ulogd_line("not json", SID, 0) is None
    frame = {"oob.prefix": f"dvm:{SID}:D:nonip", "oob.protocol": 0x88B5}
    d = parse_ulogd_line(json.dumps(frame), SID, 0)
    assert d is not None and d.protocol == "ether:0x88b5"
