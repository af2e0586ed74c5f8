"""Egress over the REST API, in process: ``egress`` on create, ``GET .../network``, reaper."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agent_bridge.server import create_app
from orchestrator.egress import FakeEgress
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings
from orchestrator.spec import EgressPolicy, new_session_id
from tests.bridge.conftest import IMAGE, TOKEN, _resolver

ZONE = {"allowed.test": ("203.0.113.10",)}


@pytest.fixture
def egress() -> FakeEgress:
    return FakeEgress(ZONE)


@pytest.fixture
def egress_manager(
    tmp_path: Path, hypervisor: FakeHypervisor, egress: FakeEgress
) -> SessionManager:
    return SessionManager(
        hypervisor=hypervisor,
        resolve_image=_resolver(tmp_path),
        recordings_dir=tmp_path / "recordings",
        max_sessions=2,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
        egress=egress,
    )


@pytest.fixture
def eclient(egress_manager: SessionManager) -> Iterator[TestClient]:
    app = create_app(egress_manager, token=TOKEN, settings=Settings(default_image=IMAGE))
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def test_create_with_policy_and_read_decisions(
    eclient: TestClient, egress: FakeEgress, hypervisor: FakeHypervisor, tmp_path: Path
) -> None:
    r = eclient.post("/v1/sessions", json={"egress": {"allow": ["allowed.test", "10.9.0.0/16:22"]}})
    assert r.status_code == 201, r.text
    info = r.json()
    sid = info["id"]
    assert info["egress"]["allow"] == ["allowed.test", "10.9.0.0/16:22"]
    assert info["egress"]["bridge"] == f"dvm{sid}"
    assert info["egress"]["guest_ip"] and info["egress"]["gateway_ip"]
    nic = hypervisor.domains[sid].nic
    assert nic is not None and nic.tap == f"dvg{sid}"

    assert eclient.get(f"/v1/sessions/{sid}/network").json() == []
    egress.resolve(sid, "allowed.test")
    egress.connect(sid, "203.0.113.10", 443)
    egress.connect(sid, "198.51.100.8", 80)
    decisions = eclient.get(f"/v1/sessions/{sid}/network").json()
    assert [(d["kind"], d["dst"], d["dst_port"]) for d in decisions] == [
        ("dns_answered", None, None),
        ("conn_allowed", "203.0.113.10", 443),
        ("conn_dropped", "198.51.100.8", 80),
    ]
    assert decisions[0]["query"] == "allowed.test"
    assert decisions[0]["answers"] == ["203.0.113.10"]
    assert all(isinstance(d["ts_ns"], int) for d in decisions)
    assert eclient.delete(f"/v1/sessions/{sid}").status_code == 200
    assert egress.detached == [sid]
    # kept after the session ended, and in the recording
    assert len(eclient.get(f"/v1/sessions/{sid}/network").json()) == 3
    events = (tmp_path / "recordings" / sid / "events.jsonl").read_text()
    assert events.count('"kind":"network"') >= 5  # attached, 3 decisions, detached
    assert '"dst":"198.51.100.8"' in events


def test_network_needs_the_token(eclient: TestClient) -> None:
    sid = eclient.post("/v1/sessions", json={"egress": {"allow": []}}).json()["id"]
    r = eclient.get(f"/v1/sessions/{sid}/network", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"
    assert eclient.get("/v1/sessions/zzzzzzzzzzzz/network").status_code == 404


def test_session_without_policy_has_no_nic_and_empty_network(
    eclient: TestClient, hypervisor: FakeHypervisor, egress: FakeEgress
) -> None:
    info = eclient.post("/v1/sessions", json={}).json()
    assert info["egress"] is None
    assert hypervisor.domains[info["id"]].nic is None
    assert eclient.get(f"/v1/sessions/{info['id']}/network").json() == []
    eclient.delete(f"/v1/sessions/{info['id']}")
    assert egress.detached == []


@pytest.mark.parametrize(
    "entry",
    ["not a domain", "10.0.0.0/33", "198.51.100.7/32:99999", "-bad-.example", "*.", ""],
)
def test_malformed_entry_is_422_naming_it_and_nothing_is_created(
    eclient: TestClient,
    entry: str,
    hypervisor: FakeHypervisor,
    egress: FakeEgress,
    tmp_path: Path,
) -> None:
    r = eclient.post("/v1/sessions", json={"egress": {"allow": ["allowed.test", entry]}})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_egress"
    assert repr(entry) in error["message"]
    assert hypervisor.started == []
    assert egress.detached == []
    assert not (tmp_path / "recordings").exists() or not any((tmp_path / "recordings").iterdir())
    assert eclient.get("/v1/sessions").json() == []


def test_egress_shape_errors_are_422(eclient: TestClient) -> None:
    for body in (
        {"egress": {"allow": "allowed.test"}},
        {"egress": {"allowed": ["x.test"]}},
        {"egress": {"allow": [1]}},
    ):
        r = eclient.post("/v1/sessions", json=body)
        assert r.status_code == 422, body
        assert r.json()["error"]["code"] == "invalid_request"


def test_policy_on_a_server_without_egress_is_refused(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    r = client.post("/v1/sessions", json={"egress": {"allow": ["allowed.test"]}})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "egress_not_configured"
    assert "--egress-upstream-iface" in r.json()["error"]["message"]
    assert hypervisor.started == []


def test_reap_removes_egress_of_unknown_sessions(
    egress_manager: SessionManager, egress: FakeEgress
) -> None:
    dead = new_session_id()
    egress.attach(dead, EgressPolicy())
    live = egress_manager.create(image=IMAGE, display=_display(), egress=EgressPolicy())
    assert egress_manager.reap() == [dead]
    assert egress.detached == [dead]
    egress_manager.delete(live.id)


def _display():  # type: ignore[no-untyped-def]
    from orchestrator.spec import DisplaySpec

    return DisplaySpec(1024, 768)


def test_settings_read_the_egress_upstream() -> None:
    s = Settings.from_env(
        {
            "DESKVM_EGRESS_UPSTREAM_IFACE": "up0",
            "DESKVM_EGRESS_UPSTREAM_DNS": "198.51.100.53, 2001:db8::53",
        }
    )
    assert s.egress_upstream_iface == "up0"
    assert s.egress_upstream_dns == ("198.51.100.53", "2001:db8::53")
    assert Settings.from_env({}).egress_upstream_iface is None
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError, match="both"):
        Settings.from_env({"DESKVM_EGRESS_UPSTREAM_IFACE": "up0"})
    with pytest.raises(ConfigError, match="both"):
        Settings.from_env({}, egress_upstream_dns=("198.51.100.53",))


def test_runtime_builds_the_real_egress_only_with_an_upstream(tmp_path: Path) -> None:
    from agent_bridge.runtime import build_egress
    from orchestrator.egress import NftEgress

    assert build_egress(Settings(state_dir=tmp_path)) is None
    egress = build_egress(
        Settings(
            state_dir=tmp_path, egress_upstream_iface="up0", egress_upstream_dns=("198.51.100.53",)
        )
    )
    assert isinstance(egress, NftEgress)
    assert egress.owner == str(tmp_path / "sessions")
    assert egress.settings.upstream_iface == "up0"


def test_serve_has_the_egress_upstream_options() -> None:
    from typer.testing import CliRunner

    from agent_bridge.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--egress-upstream-iface" in result.output
    assert "--egress-upstream-dns" in result.output
