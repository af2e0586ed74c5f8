"""A session with an egress policy, against the in-package fakes (no host networking).

Attach happens before the domain starts and gives the NIC; decisions end up in the
recording as ``network`` events; teardown always detaches, also when a step fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.clock import FakeClock
from orchestrator.egress import FakeEgress, bridge_name, guest_port_name
from orchestrator.errors import ConfigError, EgressError, HypervisorError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.recorder import MemoryRecorder
from orchestrator.session import Session
from orchestrator.spec import BootImage, DisplaySpec, EgressPolicy, SessionSpec

IMAGE = BootImage("debian12-desktop", "cd" * 32, Path("/b"), Path("/k"), Path("/i"))
SID = "abcdef012345"
POLICY = EgressPolicy(allow=("allowed.test", "198.51.100.7/32:443"))
ZONE = {"allowed.test": ("203.0.113.10",), "deny.test": ("198.51.100.8",)}


def make(
    egress: FakeEgress | None,
    *,
    hv: FakeHypervisor | None = None,
    policy: EgressPolicy | None = POLICY,
    recorder: MemoryRecorder | None = None,
    clock: FakeClock | None = None,
) -> tuple[Session, FakeHypervisor, MemoryRecorder]:
    clock = clock or FakeClock()
    hv = hv or FakeHypervisor()
    recorder = recorder or MemoryRecorder(clock)
    spec = SessionSpec(SID, IMAGE, DisplaySpec(1024, 768), boot_timeout_s=5, egress=policy)
    session = Session(
        spec,
        hypervisor=hv,
        recorder=recorder,
        clock=clock,
        pacing=Pacing(0, 0, 0, 0, 0),
        egress=egress,
        network_poll_s=0.01,
    )
    return session, hv, recorder


def network_events(recorder: MemoryRecorder) -> list[dict[str, object]]:
    return [dict(e.data) for e in recorder.events if e.kind == "network"]


def test_attach_before_start_gives_the_nic_and_decisions_are_recorded() -> None:
    egress = FakeEgress(ZONE)
    session, hv, recorder = make(egress)
    with session:
        domain = hv.domains[SID]
        attachment = session.egress_attachment
        assert attachment is not None
        assert domain.nic is not None
        assert domain.nic.bridge == bridge_name(SID) == attachment.bridge
        assert domain.nic.tap == guest_port_name(SID) == attachment.guest_port
        assert domain.nic.mac == attachment.guest_mac
        # attached (and recorded) before the domain was started
        kinds = [(e.kind, e.data.get("event")) for e in recorder.events]
        assert kinds.index(("network", "attached")) < kinds.index(("frame", None))

        assert egress.resolve(SID, "allowed.test") == ("203.0.113.10",)
        assert egress.connect(SID, "203.0.113.10", 80)
        assert not egress.connect(SID, "198.51.100.8", 80)
        assert egress.resolve(SID, "deny.test") == ()
        decisions = session.network_decisions()
        assert [d.kind for d in decisions] == [
            "dns_answered",
            "conn_allowed",
            "conn_dropped",
            "dns_refused",
        ]
        # draining again records nothing twice
        assert session.drain_network() == []
        assert not egress.connect(SID, "198.51.100.7", 80)
    assert egress.detached == [SID]
    events = network_events(recorder)
    assert events[0]["event"] == "attached" and events[0]["allow"] == list(POLICY.allow)
    assert events[-1] == {"event": "detached"}
    recorded = [e for e in events if "kind" in e]
    assert [(e["kind"], e["dst"], e["dst_port"]) for e in recorded if e["dst"]] == [
        ("conn_allowed", "203.0.113.10", 80),
        ("conn_dropped", "198.51.100.8", 80),
        ("conn_dropped", "198.51.100.7", 80),  # drained at teardown
    ]
    ts = [e["ts_ns"] for e in recorded]
    assert ts == sorted(ts)
    network_seq = [e.t_ns for e in recorder.events if e.kind == "network"]
    assert network_seq == sorted(network_seq)
    # kept after close
    assert len(session.network_decisions()) == 5


def test_no_policy_means_no_nic_and_no_egress_call() -> None:
    egress = FakeEgress(ZONE)
    session, hv, recorder = make(egress, policy=None)
    with session:
        assert hv.domains[SID].nic is None
        assert session.egress_attachment is None
        assert session.network_decisions() == []
    assert egress.detached == []
    assert network_events(recorder) == []


def test_policy_without_egress_seam_is_refused() -> None:
    with pytest.raises(ConfigError, match="no egress"):
        make(None)


def test_failed_domain_start_detaches() -> None:
    egress = FakeEgress(ZONE)
    hv = FakeHypervisor()
    hv.fail_on.add("start")
    session, _, _ = make(egress, hv=hv)
    with pytest.raises(HypervisorError, match="injected"):
        session.start()
    assert session.state == "failed"
    assert egress.detached == [SID]
    with pytest.raises(EgressError):
        egress.decisions(SID)  # nothing of the session is left
    assert hv.domains == {}


def test_failed_attach_starts_no_domain_and_still_detaches() -> None:
    egress = FakeEgress(ZONE, fail_on=frozenset({"attach"}))
    session, hv, _ = make(egress)
    with pytest.raises(EgressError, match="injected"):
        session.start()
    assert hv.started == []
    assert egress.detached == [SID]
    assert session.state == "failed"


def test_failed_detach_still_destroys_and_reports() -> None:
    egress = FakeEgress(ZONE, fail_on=frozenset({"detach"}))
    session, hv, recorder = make(egress)
    session.start()
    with pytest.raises(EgressError, match="injected"):
        session.close()
    assert hv.destroyed == [SID] and hv.domains == {}
    closed = [e for e in recorder.events if e.kind == "lifecycle" and e.data["event"] == "closed"]
    assert closed and "injected" in str(closed[0].data["errors"])


def test_both_teardown_steps_fail_every_step_runs() -> None:
    egress = FakeEgress(ZONE, fail_on=frozenset({"detach"}))
    session, hv, _ = make(egress)
    session.start()
    hv.fail_on.add("destroy")
    with pytest.raises(HypervisorError) as info:
        session.close()
    assert "destroying" in info.value.message and "detach" in info.value.message
    assert egress.detached == [SID]
