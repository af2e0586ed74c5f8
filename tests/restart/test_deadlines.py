"""Stored deadlines and PATCH ttl_s racing them (issue 10, section 2), with a fake clock.

The invariant: an extension either comes before the deadline and holds (the session is
not ended, not even by a sweeper that runs at that very moment), or it comes at/after the
deadline and fails with ``session_expired`` and the session is ended. Never both, never
neither: no expired session keeps running, no renewed one is reaped early.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agent_bridge.protocol import parse_deskvm_action
from agent_bridge.server import create_app
from orchestrator.clock import FakeClock
from orchestrator.errors import ConfigError, SessionClosed, StoreError
from orchestrator.manager import CLOSED_IDLE, CLOSED_TTL, SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import DisplaySpec
from orchestrator.store import MemorySessionStore, SessionRecord
from tests.restart.test_adopt import World, crash

NS = 1_000_000_000


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path, FakeClock())


def _session(manager: SessionManager, **kw: float) -> str:
    return manager.create(image="x", display=DisplaySpec(640, 400), **kw).id  # type: ignore[arg-type]


def test_extension_just_before_the_deadline_holds(world: World) -> None:
    manager = world.server()
    sid = _session(manager, ttl_s=10)
    session = manager.get(sid)
    world.clock.advance(10 - 1e-9)  # 1 ns before the deadline
    manager.extend_ttl(sid, 20, max_ttl_s=3600)
    world.clock.advance(1e-9)  # the old deadline: nothing happens
    assert manager.expire() == [] and session.state == "ready"
    assert world.store.load(sid).spec["ttl_s"] == 20  # type: ignore[union-attr]
    world.clock.advance(10)  # the new one
    assert manager.expire() == [sid] and session.closed_reason == CLOSED_TTL


def test_extension_at_the_deadline_fails_and_ends_the_session(world: World) -> None:
    manager = world.server()
    sid = _session(manager, ttl_s=10)
    world.clock.advance(10)  # exactly at the deadline, before any sweep
    with pytest.raises(SessionClosed) as info:
        manager.extend_ttl(sid, 20, max_ttl_s=3600)
    assert info.value.code == "session_expired"
    session = manager.get(sid)
    assert session.state == "closed" and session.closed_reason == CLOSED_TTL
    assert sid not in world.hypervisor.domains


def test_an_action_after_the_deadline_is_refused_before_the_sweep(world: World) -> None:
    manager = world.server()
    sid = _session(manager, ttl_s=10)
    world.clock.advance(10)
    with pytest.raises(SessionClosed, match="expired"):
        manager.get(sid).execute(parse_deskvm_action({"action": "move", "x": 1, "y": 1}))
    assert manager.expire() == [sid]


def test_a_sweep_during_an_extension_sees_the_new_deadline(world: World) -> None:
    """The extension holds the session's deadline lock while it stores the new deadline;
    a sweep at the old deadline waits for it and then finds the session renewed."""
    manager = world.server()
    sid = _session(manager, ttl_s=10)
    session = manager.get(sid)
    saving, release = threading.Event(), threading.Event()
    real_save = world.store.save

    def slow_save(record: SessionRecord) -> None:
        if record.spec["ttl_s"] == 20:
            saving.set()
            release.wait(5)
        real_save(record)

    world.store.save = slow_save  # type: ignore[method-assign]
    world.clock.advance(9)
    extender = threading.Thread(target=lambda: manager.extend_ttl(sid, 20, max_ttl_s=3600))
    extender.start()
    assert saving.wait(5)
    world.clock.advance(1)  # the old deadline arrives while the extension is storing
    swept: list[list[str]] = []
    sweeper = threading.Thread(target=lambda: swept.append(manager.expire()))
    sweeper.start()
    sweeper.join(0.3)
    assert sweeper.is_alive()  # waits for the extension
    release.set()
    extender.join(5)
    sweeper.join(5)
    assert swept == [[]] and session.state == "ready"


def test_a_failed_store_write_does_not_extend(world: World) -> None:
    store = MemorySessionStore()
    world.store = store  # type: ignore[assignment]
    manager = world.server()
    sid = _session(manager, ttl_s=10)
    store.fail_next_save = "disk full"
    with pytest.raises(StoreError):
        manager.extend_ttl(sid, 20, max_ttl_s=3600)
    assert manager.get(sid).spec.ttl_s == 10
    world.clock.advance(10)
    assert manager.expire() == [sid]


@pytest.mark.parametrize(
    ("ttl_s", "match"), [(7200, "above this server's maximum"), (5, "would end the session")]
)
def test_bad_extensions_are_refused(world: World, ttl_s: float, match: str) -> None:
    manager = world.server()
    sid = _session(manager, ttl_s=10)
    world.clock.advance(6)
    with pytest.raises(ConfigError, match=match):
        manager.extend_ttl(sid, ttl_s, max_ttl_s=3600)
    assert manager.get(sid).spec.ttl_s == 10


def test_the_renewed_deadline_survives_a_restart(world: World) -> None:
    first = world.server()
    sid = _session(first, ttl_s=10, idle_timeout_s=100)
    world.clock.advance(8)
    first.extend_ttl(sid, 30, max_ttl_s=3600)
    crash(first)
    world.clock.advance(5)
    second = world.server()
    assert second.adopt().adopted == [sid]
    world.clock.advance(16)  # 29 s since creation: the renewed deadline is 30
    assert second.expire() == []
    world.clock.advance(1)
    assert second.expire() == [sid] and second.get(sid).closed_reason == CLOSED_TTL


def test_the_idle_deadline_is_stored_with_every_action(world: World) -> None:
    first = world.server()
    sid = _session(first, idle_timeout_s=20)
    world.clock.advance(15)
    first.get(sid).execute(parse_deskvm_action({"action": "move", "x": 2, "y": 2}))
    crash(first)
    world.clock.advance(10)  # 25 s since ready, 10 since the last action
    second = world.server()
    assert second.adopt().adopted == [sid]
    assert second.expire() == []
    world.clock.advance(10)
    assert second.expire() == [sid] and second.get(sid).closed_reason == CLOSED_IDLE


# --- PATCH /v1/sessions/{id} -----------------------------------------------------------


def test_patch_ttl(world: World) -> None:
    manager = world.server()
    settings = Settings(default_image="x", session_max_ttl_s=3600, session_ttl_s=60)
    with TestClient(
        create_app(manager, token="t" * 16, settings=settings),
        headers={"Authorization": "Bearer " + "t" * 16},
    ) as client:
        info = client.post("/v1/sessions", json={"ttl_s": 10}).json()
        sid = info["id"]
        assert info["expires_at"] is not None
        world.clock.advance(5)
        response = client.patch(f"/v1/sessions/{sid}", json={"ttl_s": 120})
        assert response.status_code == 200, response.text
        assert response.json()["limits"]["ttl_s"] == 120
        too_long = client.patch(f"/v1/sessions/{sid}", json={"ttl_s": 7200})
        assert too_long.status_code == 422 and "maximum" in too_long.json()["error"]["message"]
        assert client.patch(f"/v1/sessions/{sid}", json={"ttl": 5}).status_code == 422
        assert client.post("/v1/sessions", json={"ttl_s": 7200}).status_code == 422
        world.clock.advance(120)
        late = client.patch(f"/v1/sessions/{sid}", json={"ttl_s": 300})
        assert late.status_code == 409 and late.json()["error"]["code"] == "session_expired"
        ended = client.get(f"/v1/sessions/{sid}").json()
        assert ended["state"] == "closed" and ended["closed_reason"] == CLOSED_TTL
        assert client.patch(f"/v1/sessions/{sid}", json={"ttl_s": 300}).status_code == 409


def test_an_action_record_built_before_an_extension_never_overwrites_it(world: World) -> None:
    """An action's record write racing an extension: the stored ttl is the extended one."""
    manager = world.server()
    sid = _session(manager, ttl_s=10)
    session = manager.get(sid)
    entered, release = threading.Event(), threading.Event()
    real_save = world.store.save

    def slow_first_save(record: SessionRecord) -> None:
        if not entered.is_set():
            entered.set()
            release.wait(5)
        real_save(record)

    world.store.save = slow_first_save  # type: ignore[method-assign]
    mover = threading.Thread(
        target=lambda: session.execute(parse_deskvm_action({"action": "move", "x": 3, "y": 3}))
    )
    mover.start()
    assert entered.wait(5)  # the action's record write is under way (old ttl)
    extender = threading.Thread(target=lambda: manager.extend_ttl(sid, 60, max_ttl_s=3600))
    extender.start()
    extender.join(0.3)
    assert extender.is_alive()  # waits for the action's write, then writes its own
    release.set()
    mover.join(5)
    extender.join(5)
    assert world.store.load(sid).spec["ttl_s"] == 60  # type: ignore[union-attr]
