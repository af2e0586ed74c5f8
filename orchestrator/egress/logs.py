"""Pure parsers turning dnsmasq's query log and ulogd's JSON lines into decisions.

Sources:
    * dnsmasq ``--log-queries=extra`` lines (``<serial> <client>/<port> query[A] NAME from
      IP``, ``forwarded``, ``reply NAME is ADDR``, ``cached``, ``config NAME is NXDOMAIN``);
      wall-clock time with 1 s resolution.
    * ulogd2 JSON output (one object per NFLOG packet, ``oob.prefix`` =
      ``dvm:<id>:<A|D>:<reason>``, ``oob.time.sec``/``oob.time.usec`` wall clock).

Wall-clock times are moved onto the monotonic clock with an offset the caller measures
(``time.time_ns() - time.monotonic_ns()``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from orchestrator.egress.base import NetworkDecision

__all__ = ["DnsLogParser", "parse_ulogd_line"]

_DNSMASQ_RE = re.compile(
    r"^(?P<stamp>\w{3} [ \d]\d \d\d:\d\d:\d\d) dnsmasq\[\d+\]: "
    r"(?P<serial>\d+) (?P<client>[0-9a-fA-F.:]+)/(?P<port>\d+) (?P<msg>.*)$"
)
_QUERY_RE = re.compile(r"^query\[(?P<qtype>[A-Za-z0-9]+)\] (?P<name>\S+) from (?P<src>\S+)$")
_RESULT_RE = re.compile(r"^(?P<what>reply|cached|config) (?P<name>\S+) is (?P<value>.+)$")
_FORWARD_RE = re.compile(r"^forwarded (?P<name>\S+) to (?P<server>\S+)$")

_PROTOCOLS = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp"}
_ETHERTYPES = {0x0800: "ip", 0x0806: "arp", 0x86DD: "ipv6"}


def _wall_to_mono_ns(stamp: str, offset_ns: int, now_wall_s: float) -> int:
    year = time.localtime(now_wall_s).tm_year
    parsed = time.strptime(f"{year} {stamp}", "%Y %b %d %H:%M:%S")
    wall_s = time.mktime(parsed)
    if wall_s > now_wall_s + 86400:  # the log line is from last December
        wall_s = time.mktime(time.strptime(f"{year - 1} {stamp}", "%Y %b %d %H:%M:%S"))
    return int(wall_s * 1_000_000_000) - offset_ns


@dataclass
class _Query:
    ts_ns: int
    name: str
    qtype: str
    src: str
    src_port: int
    forwarded: bool = False
    answers: list[str] = field(default_factory=list)
    outcome: str | None = None


class DnsLogParser:
    """Incremental parser of one session's dnsmasq log (feed lines, collect decisions).

    A query becomes a decision when its outcome line arrives: ``reply``/``cached`` lines
    make ``dns_answered`` (``reason="allowlisted"``; an upstream NXDOMAIN is answered too,
    with no addresses), ``config ... is NXDOMAIN`` makes ``dns_refused`` with reason
    ``"not-allowlisted"`` (never forwarded) or ``"refused-answer"`` (forwarded, but the
    answer fell in a denied range).
    """

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._pending: dict[str, _Query] = {}

    def feed(self, line: str, offset_ns: int, now_wall_s: float) -> list[NetworkDecision]:
        """Parse one log line.

        Args:
            line: one line of ``dnsmasq.log`` (without the newline).
            offset_ns: ``time.time_ns() - time.monotonic_ns()`` measured by the caller.
            now_wall_s: ``time.time()``, to find the year of the stamp.

        Returns:
            Decisions completed by this line (zero or one; the last ``reply`` line of a
            query is only known when the next query starts, so answers are collected
            until then).
        """
        match = _DNSMASQ_RE.match(line.rstrip("\n"))
        if not match:
            return []
        serial, msg = match["serial"], match["msg"]
        done: list[NetworkDecision] = []
        query = _QUERY_RE.match(msg)
        if query:
            done += self.flush(keep=None)
            self._pending[serial] = _Query(
                ts_ns=_wall_to_mono_ns(match["stamp"], offset_ns, now_wall_s),
                name=query["name"].lower(),
                qtype=query["qtype"],
                src=match["client"],
                src_port=int(match["port"]),
            )
            return done
        pending = self._pending.get(serial)
        if pending is None:
            return []
        if _FORWARD_RE.match(msg):
            pending.forwarded = True
            return []
        result = _RESULT_RE.match(msg)
        if result:
            value = result["value"]
            if result["what"] == "config" and value == "NXDOMAIN":
                pending.outcome = "refused-answer" if pending.forwarded else "not-allowlisted"
            else:
                pending.outcome = pending.outcome or "allowlisted"
                if value not in ("NXDOMAIN", "NODATA") and not value.startswith("NODATA"):
                    pending.answers.append(value)
        return done

    def flush(self, keep: str | None = None) -> list[NetworkDecision]:
        """Emit every pending query that has an outcome (call at end of input)."""
        out = []
        for serial in sorted(self._pending, key=int):
            q = self._pending[serial]
            if q.outcome is None or serial == keep:
                continue
            del self._pending[serial]
            out.append(
                NetworkDecision(
                    ts_ns=q.ts_ns,
                    kind="dns_answered" if q.outcome == "allowlisted" else "dns_refused",
                    session_id=self.session_id,
                    reason=q.outcome,
                    protocol="dns",
                    src=q.src,
                    src_port=q.src_port,
                    query=q.name,
                    qtype=q.qtype,
                    answers=tuple(q.answers),
                )
            )
        return out


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_ulogd_line(line: str, session_id: str, offset_ns: int) -> NetworkDecision | None:
    """Turn one ulogd JSON line into a decision (``None`` if it is not this session's).

    Args:
        line: one JSON object as written by ulogd's JSON output plugin.
        session_id: only prefixes ``dvm:<session_id>:...`` are accepted.
        offset_ns: ``time.time_ns() - time.monotonic_ns()`` measured by the caller.

    Returns:
        A ``conn_allowed`` / ``conn_dropped`` decision, or ``None``.
    """
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    parts = str(event.get("oob.prefix", "")).split(":", 3)
    if len(parts) != 4 or parts[0] != "dvm" or parts[1] != session_id:
        return None
    verdict, reason = parts[2], parts[3]
    sec = _int_or_none(event.get("oob.time.sec")) or 0
    usec = _int_or_none(event.get("oob.time.usec")) or 0
    ts_ns = sec * 1_000_000_000 + usec * 1000 - offset_ns
    proto_num = _int_or_none(event.get("ip.protocol"))
    if proto_num is None:
        proto_num = _int_or_none(event.get("ip6.nexthdr"))
    ethertype = _int_or_none(event.get("oob.protocol"))
    if proto_num is not None:
        protocol = _PROTOCOLS.get(proto_num, f"ip:{proto_num}")
    elif ethertype is not None:
        protocol = _ETHERTYPES.get(ethertype, f"ether:0x{ethertype:04x}")
    else:
        protocol = "unknown"
    if reason == "ipv6" and protocol in _PROTOCOLS.values():
        protocol = f"ipv6/{protocol}"
    src = event.get("src_ip") or event.get("mac.saddr.str")
    dst = event.get("dest_ip") or event.get("mac.daddr.str")
    return NetworkDecision(
        ts_ns=ts_ns,
        kind="conn_allowed" if verdict == "A" else "conn_dropped",
        session_id=session_id,
        reason=reason,
        protocol=protocol,
        src=str(src) if src else None,
        src_port=_int_or_none(event.get("src_port")),
        dst=str(dst) if dst else None,
        dst_port=_int_or_none(event.get("dest_port")),
    )
