"""A bridge restart loses no session (issue 10, section 2), on the fake backend.

A "crash" here is what the kernel does to a process killed with SIGKILL: its threads stop
and its file descriptors close (the recorder's and the instance's locks are dropped); the
domains (here: the fake hypervisor's) and the egress stay, as libvirt and the daemons keep
them. A second manager of the same server name then re-adopts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent_bridge.protocol import parse_deskvm_action
from orchestrator.approval import ApprovalPolicy
from orchestrator.clock import FakeClock
from orchestrator.egress.fake import FakeEgress
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.instance import Instance
from orchestrator.manager import CLOSED_TTL, GAP_REASON, SessionManager
from orchestrator.replay import Recording, verify
from orchestrator.session import Session
from orchestrator.spec import BootImage, DisplaySpec, EgressPolicy
from orchestrator.store import FileSessionStore

IMAGE = BootImage("test-desktop", "ab" * 32, Path("/b"), Path("/k"), Path("/i"))
ZONE = {"allowed.test": ("203.0.113.10",)}


class World:
    """One installation: a fake host whose domains and egress outlive the servers."""

    def __init__(self, root: Path, clock: FakeClock) -> None:
        self.root = root
        self.clock = clock
        self.hypervisor = FakeHypervisor()
        self.egress = FakeEgress(ZONE, clock_ns=clock.monotonic_ns)
        self.store = FileSessionStore(root / "session-state")

    def server(self, name: str | None = "serve-8765", *, grace_s: float = 300) -> SessionManager:
        return SessionManager(
            hypervisor=self.hypervisor,
            resolve_image=lambda _name: IMAGE,
            recordings_dir=self.root / "recordings",
            clock=self.clock,
            pacing=Pacing(0, 0, 0, 0, 0),
            ready_poll_s=0.01,
            egress=self.egress,
            store=self.store,
            instance=Instance(self.root / "instances", name, clock=self.clock),
            adopt_grace_s=grace_s,
        )


def crash(manager: SessionManager) -> None:
    """What SIGKILL does: threads gone, file descriptors (and their flocks) closed."""
    for session in manager.live():
        if session._frames is not None:
            session._frames.stop()
        session._poller_stop.set()
        session.recorder._events.close()  # type: ignore[attr-defined]
    instance = manager.instance
    assert instance is not None and instance._fd is not None
    os.close(instance._fd)
    instance._fd = None


def act(session: Session, body: dict[str, Any]) -> Any:
    return session.execute(parse_deskvm_action(body))


def events(session_or_path: Session | Path) -> list[dict[str, Any]]:
    path = session_or_path if isinstance(session_or_path, Path) else session_or_path.recorder.path
    assert path is not None
    return [json.loads(x) for x in (path / "events.jsonl").read_text().splitlines()]


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path, FakeClock())


def test_a_killed_server_restarts_and_carries_on(world: World) -> None:
    first = world.server()
    session = first.create(
        image="x", display=DisplaySpec(640, 400), ttl_s=100, idle_timeout_s=50,
        egress=EgressPolicy(allow=("allowed.test",)),
    )  # fmt: skip
    sid = session.id
    session.approval_policy = ApprovalPolicy(text_patterns=(r"rm\s+-rf",))
    session.set_extra("tokens", {"issued": [], "revoked": {"abc": 1e12}, "used": {}})
    act(session, {"action": "click", "x": 100, "y": 120})
    act(session, {"action": "type", "text": "rm -"})
    assert world.egress.resolve(sid, "nope.test") == ()  # a decision before the crash
    world.clock.advance(10)
    session.drain_network()  # (the poller would have)
    crash(first)

    world.clock.advance(7)  # the restart takes a while
    second = world.server()
    report = second.adopt()
    assert report.adopted == [sid] and not report.reaped and not report.failed
    again = second.get(sid)
    assert again.state == "ready" and again is not session
    assert world.hypervisor.adopted == [sid]
    # Deadlines count from the original creation and last action, not from the restart.
    ttl_left, idle_left = again.seconds_left()
    assert ttl_left == pytest.approx(100 - 17) and idle_left == pytest.approx(50 - 17)
    assert again.cursor == (100, 120)
    assert again.approval_policy is not None and again.approval_reason(
        parse_deskvm_action({"action": "type", "text": "rf"})
    )  # the recent typed text came back: "rm -" + "rf" is still held
    assert again.extras["tokens"]["revoked"] == {"abc": 1e12}
    act(again, {"action": "move", "x": 5, "y": 6})
    assert world.egress.resolve(sid, "nope.test") == ()  # a decision after the restart
    second.delete(sid)

    recording = events(again)
    kinds = [(e["kind"], e["data"].get("event")) for e in recording]
    gap = kinds.index(("marker", "gap"))
    assert kinds.index(("lifecycle", "adopted")) > gap
    assert recording[gap]["data"]["reason"] == GAP_REASON
    assert recording[gap]["data"]["gap_s"] == pytest.approx(7, abs=0.5)
    assert kinds[-1] == ("lifecycle", "closed")
    # Every key and button was released after adoption (the old server may have died
    # mid-action).
    released = recording[kinds.index(("lifecycle", "adopted")) + 1]["data"]
    assert released["why"] == "released after adoption" and "btn up left" in released["events"]
    # Network decisions: the first one recorded once, the second after the gap.
    decisions = [e["data"] for e in recording if e["kind"] == "network" and "kind" in e["data"]]
    assert [(d["query"], d["attempts"]) for d in decisions] == [("nope.test", 1), ("nope.test", 1)]
    report = verify(again.recorder.path)  # type: ignore[arg-type]
    assert report.ok and report.closed and len(report.gaps) == 1, report
    assert world.store.records() == []
    assert Recording(again.recorder.path).steps  # type: ignore[arg-type]


def test_a_graceful_exit_can_keep_sessions_for_a_restart(world: World) -> None:
    first = world.server()
    sid = first.create(image="x", display=DisplaySpec(640, 400)).id
    assert first.detach_all() == [sid]
    assert first.live() == [] and sid in world.hypervisor.domains
    first.instance.close(keep_sessions=True)  # type: ignore[union-attr]
    second = world.server()
    assert second.adopt().adopted == [sid]
    path = second.get(sid).recorder.path
    second.delete(sid)
    kinds = [(e["kind"], e["data"].get("event")) for e in events(path)]  # type: ignore[arg-type]
    assert ("marker", "detached") in kinds and ("marker", "gap") in kinds
    assert verify(path).ok  # type: ignore[arg-type]


def test_a_gone_server_gets_a_grace_period_then_its_sessions_are_reaped(world: World) -> None:
    first = world.server("serve-1")
    sid = first.create(image="x", display=DisplaySpec(640, 400)).id
    crash(first)
    other = world.server("serve-2", grace_s=60)  # another server of the installation
    report = other.adopt()
    assert report.waiting == [sid] and not report.reaped
    other.reap()
    assert sid in world.hypervisor.domains  # serve-1 may still come back
    world.clock.advance(61)
    assert other.reap() == [sid]
    assert sid not in world.hypervisor.domains and world.store.records() == []
    bundle = world.root / "recordings" / sid
    report = verify(bundle)
    assert report.ok and report.truncated is not None
    assert "grace period" in report.truncated["reason"]


def test_what_cannot_come_back_is_reaped_at_once(world: World) -> None:
    # An unnamed (ephemeral) server: nobody will ever take its name again.
    tmp = world.server(None)
    sid = tmp.create(image="x", display=DisplaySpec(640, 400)).id
    crash(tmp)
    report = world.server("serve-2").adopt()
    assert sid in report.reaped and "cannot come back" in report.reaped[sid]
    assert sid not in world.hypervisor.domains
    assert verify(world.root / "recordings" / sid).truncated is not None


def test_a_session_still_starting_is_not_adopted(world: World) -> None:
    first = world.server()
    sid = first.create(image="x", display=DisplaySpec(640, 400)).id
    record = world.store.load(sid)
    assert record is not None
    record.state = "starting"  # as if the server died during the boot wait
    world.store.save(record)
    crash(first)
    report = world.server().adopt()
    assert report.adopted == [] and "starting" in report.reaped[sid]
    assert sid not in world.hypervisor.domains


def test_a_domain_gone_while_the_server_was_away_is_ended_with_the_reason(world: World) -> None:
    first = world.server()
    sid = first.create(image="x", display=DisplaySpec(640, 400)).id
    crash(first)
    world.hypervisor.domains[sid].running = False  # e.g. the guest powered off
    report = world.server().adopt()
    assert sid in report.failed and report.adopted == []
    recording = events(world.root / "recordings" / sid)
    closed = recording[-1]["data"]
    assert closed["event"] == "closed" and "could not be re-adopted" in closed["reason"]
    assert world.store.records() == []


def test_a_second_live_server_cannot_take_the_same_name(world: World) -> None:
    world.server("serve-1")
    with pytest.raises(Exception, match="another live server"):
        world.server("serve-1")


def test_a_restart_enforces_an_expired_ttl_at_once(world: World) -> None:
    first = world.server()
    sid = first.create(image="x", display=DisplaySpec(640, 400), ttl_s=30).id
    crash(first)
    world.clock.advance(40)  # the ttl ran out while no server was running
    second = world.server()
    assert second.adopt().adopted == [sid]
    assert second.expire() == [sid]
    assert second.get(sid).closed_reason == CLOSED_TTL


def test_adopt_failure_of_the_hypervisor_is_reported(world: World) -> None:
    first = world.server()
    sid = first.create(image="x", display=DisplaySpec(640, 400)).id
    crash(first)
    world.hypervisor.fail_on.add("adopt")
    report = world.server().adopt()
    assert sid in report.failed and "no running domain" in report.failed[sid]
    assert sid not in world.hypervisor.domains  # torn down, not leaked


def test_a_server_start_seals_recordings_a_dead_writer_left_open(world: World) -> None:
    """A bundle still ``recording`` whose writer died and whose session nobody runs (no
    record: e.g. left by an older version) is sealed truncated when a server starts; one a
    live writer holds, or a waiting session's, is not touched."""
    from orchestrator.recorder import FileRecorder

    root = world.root / "recordings"
    dead = FileRecorder(root / "deadbeef0001", world.clock, {"session_id": "deadbeef0001"})
    dead.append("marker", {"event": "x"})
    dead._events.close()  # the writer died (its lock went with it)
    live = FileRecorder(root / "livewriter01", world.clock, {"session_id": "livewriter01"})
    report = world.server().adopt()
    assert report.sealed == ["deadbeef0001"]
    assert verify(root / "deadbeef0001").truncated is not None
    assert json.loads((root / "livewriter01" / "manifest.json").read_text())["status"] == (
        "recording"
    )
    live.close()
