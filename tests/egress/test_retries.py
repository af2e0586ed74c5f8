"""One request is one decision, however often the guest repeats it (issue 10, section 3).

Root cause of "each refused DNS query appears as two identical dns_refused events (same
time, same source port)": the guest's resolver, systemd-resolved (Debian 12), asks every
name that gets NXDOMAIN a second time from the same port at a lower EDNS feature level
(its DVE-2018-0001 mitigation). dnsmasq logs both queries; each became a decision with
identical fields. The lines below are from a real session (egress world, one VM, the xterm
ran ``getent ahostsv4 deny.test; curl http://deny.test/``). The same kind: TCP SYN
retransmissions and repeated pings gave identical packet decisions.
"""

from __future__ import annotations

import time

from orchestrator.clock import FakeClock
from orchestrator.egress.base import NetworkDecision, merge_retries
from orchestrator.egress.logs import DnsLogParser
from orchestrator.session import DECISION_LOG_LAG_S, decision_from_json, decision_to_json

SID = "abcdefgh2345"
# dnsmasq.log of the real session (serials 1-12), DHCP lines left out.
REAL_LOG = """\
Dec  1 03:12:01 dnsmasq[26100]: 1 10.213.0.2/48612 query[A] deny.test from 10.213.0.2
Dec  1 03:12:01 dnsmasq[26100]: 1 10.213.0.2/48612 config deny.test is NXDOMAIN
Dec  1 03:12:01 dnsmasq[26100]: 2 10.213.0.2/48612 query[A] deny.test from 10.213.0.2
Dec  1 03:12:01 dnsmasq[26100]: 2 10.213.0.2/48612 config deny.test is NXDOMAIN
Dec  1 03:12:01 dnsmasq[26100]: 3 10.213.0.2/52984 query[A] deny.test from 10.213.0.2
Dec  1 03:12:01 dnsmasq[26100]: 3 10.213.0.2/52984 config deny.test is NXDOMAIN
Dec  1 03:12:01 dnsmasq[26100]: 4 10.213.0.2/52984 query[A] deny.test from 10.213.0.2
Dec  1 03:12:01 dnsmasq[26100]: 4 10.213.0.2/52984 config deny.test is NXDOMAIN
Dec  1 03:12:02 dnsmasq[26100]: 5 10.213.0.2/35622 query[A] deny.test from 10.213.0.2
Dec  1 03:12:02 dnsmasq[26100]: 5 10.213.0.2/35622 config deny.test is NXDOMAIN
Dec  1 03:12:02 dnsmasq[26100]: 6 10.213.0.2/37752 query[AAAA] deny.test from 10.213.0.2
Dec  1 03:12:02 dnsmasq[26100]: 6 10.213.0.2/37752 config deny.test is NXDOMAIN
Dec  1 03:12:02 dnsmasq[26100]: 7 10.213.0.2/35622 query[A] deny.test from 10.213.0.2
Dec  1 03:12:02 dnsmasq[26100]: 7 10.213.0.2/35622 config deny.test is NXDOMAIN
Dec  1 03:12:02 dnsmasq[26100]: 8 10.213.0.2/37752 query[AAAA] deny.test from 10.213.0.2
Dec  1 03:12:02 dnsmasq[26100]: 8 10.213.0.2/37752 config deny.test is NXDOMAIN
"""


def _parse(text: str) -> list[NetworkDecision]:
    parser = DnsLogParser(SID)
    out: list[NetworkDecision] = []
    for line in text.splitlines():
        out += parser.feed(line, offset_ns=0, now_wall_s=time.time())
    return out + parser.flush()


def test_each_question_is_one_decision_with_its_attempts() -> None:
    raw = _parse(REAL_LOG)
    assert len(raw) == 8  # what was recorded before: every question twice
    merged = merge_retries(raw)
    assert [(d.src_port, d.qtype, d.attempts) for d in merged] == [
        (48612, "A", 2), (52984, "A", 2), (35622, "A", 2), (37752, "AAAA", 2),
    ]  # fmt: skip
    assert len({d.retry_key for d in merged}) == len(merged)  # no two alike any more


def _drop(ts_s: float, dst_port: int = 80, src_port: int = 40000) -> NetworkDecision:
    return NetworkDecision(
        ts_ns=int(ts_s * 1e9), kind="conn_dropped", session_id=SID, reason="default",
        protocol="tcp", src="10.213.0.2", src_port=src_port, dst="198.51.100.8",
        dst_port=dst_port,
    )  # fmt: skip


def test_retransmissions_merge_within_the_window_only() -> None:
    # A SYN retransmitted after 1 s and 2 s more is one attempt to connect; the same
    # 5-tuple 10 s later is a new one; another port is another decision.
    decisions = [_drop(0), _drop(1), _drop(3), _drop(13), _drop(3.5, dst_port=81)]
    merged = merge_retries(decisions)
    assert [(d.ts_ns // 10**8, d.attempts, d.dst_port) for d in merged] == [
        (0, 3, 80), (35, 1, 81), (130, 1, 80),
    ]  # fmt: skip
    assert merged[0].last_ts_ns == 3 * 10**9
    # Merging is stable: merging again, or in another order, changes nothing.
    assert merge_retries(merged) == merged
    assert merge_retries(list(reversed(decisions))) == merged


def test_json_round_trip() -> None:
    decision = merge_retries([_drop(1), _drop(1.5)])[0]
    assert decision_from_json(decision_to_json(decision), SID) == decision
    assert decision_to_json(decision)["attempts"] == 2


def test_a_session_records_a_repeated_question_once() -> None:
    """Through the session's drain: held until no repeat can come, then one event."""
    from orchestrator.egress.fake import FakeEgress
    from tests.test_session_egress import POLICY, ZONE, make
    from tests.test_session_egress import SID as SESSION

    clock = FakeClock()
    egress = FakeEgress(ZONE, clock_ns=clock.monotonic_ns)
    session, _hv, recorder = make(egress, policy=POLICY, clock=clock)
    with session:
        assert egress.resolve(SESSION, "deny.test") == ()
        assert egress.resolve(SESSION, "deny.test") == ()  # the resolver's retry
        assert session.drain_network() == []  # a third attempt may still come
        assert [d.attempts for d in session.network_decisions()] == [2]  # shown live
        clock.advance(2.0 + DECISION_LOG_LAG_S + 0.1)
        session.drain_network()  # (or the poller thread did)
        recorded = [e.data for e in recorder.events if e.kind == "network" and "kind" in e.data]
        assert [(e["kind"], e["attempts"]) for e in recorded] == [("dns_refused", 2)]
        assert egress.resolve(SESSION, "deny.test") == ()  # asked again later: a new one
    events = [e.data for e in recorder.events if e.kind == "network" and "kind" in e.data]
    assert [(e["query"], e["attempts"]) for e in events] == [("deny.test", 2), ("deny.test", 1)]


def _chatter(ts_s: float, dst: str, src: str = "fe80::5054:ff:fefa:e8df") -> NetworkDecision:
    return NetworkDecision(
        ts_ns=int(ts_s * 1e9), kind="conn_dropped", session_id=SID, reason="ipv6",
        protocol="ipv6/icmpv6", src=src, dst=dst,
    )  # fmt: skip


def test_ipv6_link_multicast_chatter_is_summarised() -> None:
    """The guest's IPv6 stack re-solicits a router (ff02::2) with growing pauses and sends
    MLD reports (ff02::16) and DAD (ff02::1:ff..) from ``::``: each was a new /network
    entry (a real session: 8 of its 22). Summarised: one per kind of packet, every
    attempt counted."""
    from orchestrator.egress.base import is_link_chatter, summarise_link_chatter

    decisions = [
        _chatter(1.0, "ff02::16", src="::"), _chatter(1.5, "ff02::1:fffa:e8df", src="::"),
        _chatter(2.0, "ff02::2"), _chatter(6.0, "ff02::2"), _chatter(14.0, "ff02::2"),
        _chatter(30.0, "ff02::16", src="::"), _chatter(300.0, "ff02::2"),
        _drop(5), _drop(40),  # not chatter: stays two decisions
    ]  # fmt: skip
    merged = merge_retries(decisions)
    assert len(merged) == 9  # the retry window (2 s) folds nothing here
    summary = summarise_link_chatter(merged)
    assert [(d.dst, d.src, d.attempts, d.ts_ns // 10**9, (d.last_ts_ns or 0) // 10**9)
            for d in summary] == [
        ("ff02::16", "::", 2, 1, 30),
        ("ff02::1:fffa:e8df", "::", 1, 1, 1),
        ("ff02::2", "fe80::5054:ff:fefa:e8df", 4, 2, 300),
        ("198.51.100.8", "10.213.0.2", 1, 5, 5),
        ("198.51.100.8", "10.213.0.2", 1, 40, 40),
    ]  # fmt: skip
    assert sum(d.attempts for d in summary if is_link_chatter(d)) == 7  # every packet
    # Allowed traffic, unicast IPv6 and site-scope multicast are not chatter.
    assert not is_link_chatter(_chatter(1, "2001:db8::1"))
    assert not is_link_chatter(_chatter(1, "ff05::2"))
    assert summarise_link_chatter(summary) == summary


def test_a_session_shows_chatter_once_and_records_every_decision() -> None:
    from orchestrator.egress.fake import FakeEgress
    from tests.test_session_egress import POLICY, ZONE, make
    from tests.test_session_egress import SID as SESSION

    clock = FakeClock()
    egress = FakeEgress(ZONE, clock_ns=clock.monotonic_ns)
    session, _hv, recorder = make(egress, policy=POLICY, clock=clock)
    with session:
        for _ in range(3):  # router solicitations, 4 s apart (past the retry window)
            assert not egress.connect(SESSION, "ff02::2", None, protocol="icmpv6")
            clock.advance(4.0)
        assert not egress.connect(SESSION, "198.51.100.8", 80)
        clock.advance(4.0)
        shown = session.network_decisions()
        assert [(d.dst, d.attempts) for d in shown] == [("ff02::2", 3), ("198.51.100.8", 1)]
    recorded = [e.data for e in recorder.events if e.kind == "network" and "kind" in e.data]
    assert [(e["dst"], e["attempts"]) for e in recorded] == [
        ("ff02::2", 1), ("ff02::2", 1), ("ff02::2", 1), ("198.51.100.8", 1),
    ]  # fmt: skip
