"""Egress filtered at the host bridge, every decision recorded (issue 4).

The seam is :class:`Egress`; :class:`NftEgress` enforces it on a Linux host (bridge,
nftables, dnsmasq, ulogd2) and :class:`FakeEgress` evaluates the same policy in process.
Every error is an :class:`orchestrator.errors.EgressError` (or ``ConfigError`` for bad
input).
"""

from orchestrator.egress.base import (
    BRIDGE_PREFIX,
    GUEST_PORT_PREFIX,
    DecisionKind,
    Egress,
    EgressAttachment,
    EgressSettings,
    NetworkDecision,
    bridge_name,
    guest_port_name,
)
from orchestrator.egress.fake import FakeEgress
from orchestrator.egress.nftables import NftEgress

__all__ = [
    "BRIDGE_PREFIX",
    "GUEST_PORT_PREFIX",
    "DecisionKind",
    "Egress",
    "EgressAttachment",
    "EgressSettings",
    "FakeEgress",
    "NetworkDecision",
    "NftEgress",
    "bridge_name",
    "guest_port_name",
]
