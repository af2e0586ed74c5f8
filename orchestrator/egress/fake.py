"""In-process :class:`~orchestrator.egress.base.Egress` for tests of the session and server.

It creates nothing on the host. It allocates addresses like the real one and evaluates
the policy with the same pure rules (:func:`~orchestrator.egress.plan.evaluate_connection`),
so tests can script guest traffic with :meth:`FakeEgress.resolve` and
:meth:`FakeEgress.connect` and read the resulting decisions.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable

from orchestrator.egress.base import (
    EgressAttachment,
    NetworkDecision,
    bridge_name,
    check_guest_mac,
    guest_port_name,
)
from orchestrator.egress.plan import (
    NEVER_V4,
    NEVER_V6,
    PRIVATE_V4,
    PRIVATE_V6,
    dns_allowed,
    evaluate_connection,
    slot_addresses,
)
from orchestrator.egress.plan import guest_mac as plan_guest_mac
from orchestrator.errors import EgressError
from orchestrator.spec import EgressPolicy, validate_session_id

__all__ = ["FakeEgress"]


class FakeEgress:
    """A fake egress: same API, decisions from scripted traffic.

    Args:
        zone: what the fake "internet" resolves (name -> addresses); names not in it
            are NXDOMAIN upstream.
        clock_ns: monotonic clock (inject a fake clock for deterministic timestamps).
        fail_on: step names (``"attach"``, ``"adopt"``, ``"detach"``) that raise
            ``EgressError``, to test error paths.
        auto_lease: whether every attached guest holds its DHCP lease at once
            (:meth:`leased_ip`); ``False``: only after :meth:`lease`.
    """

    def __init__(
        self,
        zone: dict[str, tuple[str, ...]] | None = None,
        *,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        fail_on: frozenset[str] = frozenset(),
        auto_lease: bool = True,
    ) -> None:
        self.auto_lease = auto_lease
        self.zone = dict(zone or {})
        self.clock_ns = clock_ns
        self.fail_on = fail_on
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[EgressAttachment, EgressPolicy]] = {}
        self._resolved: dict[str, dict[str, tuple[int | None, ...]]] = {}
        self._decisions: dict[str, list[NetworkDecision]] = {}
        self.detached: list[str] = []
        self.leases: dict[str, str] = {}
        """Leased guest addresses by session id; :meth:`lease` puts one (a guest's DHCP)."""

    def attach(
        self, session_id: str, policy: EgressPolicy, *, guest_mac: str | None = None
    ) -> EgressAttachment:
        """See :meth:`orchestrator.egress.base.Egress.attach`."""
        validate_session_id(session_id)
        if guest_mac is not None:
            check_guest_mac(guest_mac)
        if "attach" in self.fail_on:
            raise EgressError(f"attach {session_id}: injected failure")
        with self._lock:
            if session_id in self._sessions:
                raise EgressError(f"session {session_id} is already attached")
            used = {int(ipaddress.ip_address(a.guest_ip)) for a, _ in self._sessions.values()}
            pool = ipaddress.IPv4Network("10.213.0.0/16")
            slot = next(s for s in range(16384) if int(slot_addresses(pool, s)[2]) not in used)
            subnet, gateway, guest = slot_addresses(pool, slot)
            attachment = EgressAttachment(
                session_id=session_id,
                bridge=bridge_name(session_id),
                guest_port=guest_port_name(session_id),
                guest_mac=guest_mac or plan_guest_mac(session_id),
                guest_ip=str(guest),
                gateway_ip=str(gateway),
                prefix_len=subnet.prefixlen,
                nflog_group=32768 + slot,
            )
            self._sessions[session_id] = (attachment, policy)
            self._resolved[session_id] = {}
            self._decisions[session_id] = []
            return attachment

    def adopt(self, session_id: str, policy: EgressPolicy) -> EgressAttachment:
        """See :meth:`orchestrator.egress.base.Egress.adopt` (in-process: the attachment
        must still be in this fake)."""
        validate_session_id(session_id)
        if "adopt" in self.fail_on:
            raise EgressError(f"adopt {session_id}: injected failure")
        with self._lock:
            if session_id not in self._sessions:
                raise EgressError(f"session {session_id} is not attached")
            attachment, _ = self._sessions[session_id]
            self._sessions[session_id] = (attachment, policy)
            return attachment

    def lease(self, session_id: str) -> str:
        """The guest takes its DHCP lease (its attachment's ``guest_ip``); returns it."""
        with self._lock:
            attachment, _ = self._session(session_id)
            self.leases[session_id] = attachment.guest_ip
            return attachment.guest_ip

    def leased_ip(self, session_id: str) -> str | None:
        """See :meth:`orchestrator.egress.base.Egress.leased_ip` (what :meth:`lease` gave,
        or with ``auto_lease`` the attachment's address)."""
        with self._lock:
            attachment, _ = self._session(session_id)
            if self.auto_lease:
                return attachment.guest_ip
            return self.leases.get(session_id)

    def detach(self, session_id: str) -> None:
        """See :meth:`orchestrator.egress.base.Egress.detach`."""
        validate_session_id(session_id)
        with self._lock:
            self.leases.pop(session_id, None)
            self._sessions.pop(session_id, None)
            self._resolved.pop(session_id, None)
            self._decisions.pop(session_id, None)
            self.detached.append(session_id)
        if "detach" in self.fail_on:
            raise EgressError(f"detach {session_id}: injected failure")

    def decisions(self, session_id: str) -> list[NetworkDecision]:
        """See :meth:`orchestrator.egress.base.Egress.decisions`."""
        with self._lock:
            if session_id not in self._decisions:
                raise EgressError(f"session {session_id} is not attached")
            return list(self._decisions[session_id])

    def reap(self, live_session_ids: frozenset[str]) -> list[str]:
        """See :meth:`orchestrator.egress.base.Egress.reap`."""
        dead = sorted(set(self._sessions) - set(live_session_ids))
        for session_id in dead:
            self.detach(session_id)
        return dead

    # ------------------------------------------------------- scripted traffic

    def _session(self, session_id: str) -> tuple[EgressAttachment, EgressPolicy]:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise EgressError(f"session {session_id} is not attached") from None

    def resolve(self, session_id: str, name: str, qtype: str = "A") -> tuple[str, ...]:
        """The guest asks its resolver for ``name``; returns the answers (empty = NXDOMAIN).

        Raises:
            EgressError: the session is not attached.
        """
        with self._lock:
            attachment, policy = self._session(session_id)
            allowed, ports = dns_allowed(policy, name)
            answers: tuple[str, ...] = ()
            reason = "not-allowlisted"
            if allowed:
                version = 6 if qtype == "AAAA" else 4
                answers = tuple(
                    a
                    for a in self.zone.get(name.lower(), ())
                    if ipaddress.ip_address(a).version == version
                )
                named = [c.network for c in policy.cidrs]
                bad = [a for a in answers if _refused(a, attachment.gateway_ip, named)]
                if bad:
                    answers, reason = (), "refused-answer"
                else:
                    reason = "allowlisted"
                    for a in answers:
                        self._resolved[session_id][a] = ports
            self._decisions[session_id].append(
                NetworkDecision(
                    ts_ns=self.clock_ns(),
                    kind="dns_answered" if reason == "allowlisted" else "dns_refused",
                    session_id=session_id,
                    reason=reason,
                    protocol="dns",
                    src=attachment.guest_ip,
                    query=name.lower(),
                    qtype=qtype,
                    answers=answers,
                )
            )
            return answers

    def connect(
        self, session_id: str, dst: str, dst_port: int | None, protocol: str = "tcp"
    ) -> bool:
        """The guest opens a connection; returns whether it is let through.

        Raises:
            EgressError: the session is not attached.
        """
        with self._lock:
            attachment, policy = self._session(session_id)
            if dst == attachment.gateway_ip:
                allowed = dst_port == 53 and protocol in ("tcp", "udp")
                reason = "resolver" if allowed else "host"
                if allowed:  # the resolver itself is not a forwarded connection
                    return True
            else:
                allowed, reason = evaluate_connection(
                    policy, dst, dst_port, protocol, resolved=self._resolved[session_id]
                )
            self._decisions[session_id].append(
                NetworkDecision(
                    ts_ns=self.clock_ns(),
                    kind="conn_allowed" if allowed else "conn_dropped",
                    session_id=session_id,
                    reason=reason,
                    protocol=protocol,
                    src=attachment.guest_ip,
                    dst=dst,
                    dst_port=dst_port,
                )
            )
            return allowed


def _refused(
    address: str,
    gateway: str,
    named: list[ipaddress.IPv4Network | ipaddress.IPv6Network],
) -> bool:
    addr = ipaddress.ip_address(address)
    if address == gateway:
        return True
    for text in NEVER_V4 + NEVER_V6:
        if addr in ipaddress.ip_network(text):
            return True
    for text in PRIVATE_V4 + PRIVATE_V6:
        if addr in ipaddress.ip_network(text) and not any(addr in n for n in named):
            return True
    return False
