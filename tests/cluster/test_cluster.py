"""Scale-out on a real multi-node Ray cluster started by the tests (fake backend).

One cluster per module (Ray start-up is the slow part): a head node and three deskvm nodes
with different slots, images, acceleration and egress, each a real raylet with its own
NodeAgent; bridges are the real cluster app under uvicorn. Every Ray process is stopped
at the end, also on failure (``LocalCluster.__exit__``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from typer.testing import CliRunner
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from agent_bridge.cli import app as cli_app
from agent_bridge.client import Client
from agent_bridge.cluster.bridge import create_cluster_app
from agent_bridge.cluster.capacity import RESOURCE_DESKTOP, node_capacity
from agent_bridge.cluster.local import LocalCluster
from agent_bridge.runtime import BackgroundServer
from orchestrator.settings import Settings

IMAGE = "test-desktop"
SLOTS = {"n1": 25, "n2": 20, "n3": 10}
TOTAL_SLOTS = sum(SLOTS.values())


def _capacity(name: str, slots: int, *, accel: str = "tcg", images: tuple[str, ...] = (IMAGE,),
              egress: bool = False) -> Any:  # fmt: skip
    return node_capacity(
        name=name,
        host_memory_mib=64 * 1024,
        host_cpus=2,
        accel=accel,
        backend="fake",
        images=images,
        egress=egress,
        slots=slots,
    )


@pytest.fixture(scope="module")
def s3_bucket(s3_endpoint: str) -> str:
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="cluster-recordings")
    return "cluster-recordings"


@pytest.fixture(scope="module")
def cluster(s3_bucket: str) -> Iterator[LocalCluster]:
    with LocalCluster(reserve_timeout_s=8.0) as local:
        url = f"s3://{s3_bucket}/rec"
        local.add_node(
            _capacity("n1", SLOTS["n1"], images=(IMAGE, "other-image")),
            fake_images=(IMAGE, "other-image"),
            recordings_url=url,
            ship_interval_s=0.5,
        )
        local.add_node(_capacity("n2", SLOTS["n2"], accel="kvm"), fake_images=(IMAGE,))
        local.add_node(
            _capacity("n3", SLOTS["n3"], egress=True), fake_images=(IMAGE,), recordings_url=url
        )
        yield local


SETTINGS = Settings(default_image=IMAGE, capture_fps=0)


@pytest.fixture(scope="module")
def bridge(cluster: LocalCluster) -> Iterator[str]:
    app = create_cluster_app(cluster.bridge(SETTINGS, placement_timeout_s=1.0))
    with BackgroundServer(app, host=cluster.ip) as server:
        yield server.url


@pytest.fixture(scope="module")
def admin(cluster: LocalCluster, bridge: str) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {cluster.credentials['admin_token']}"}
    with httpx.Client(base_url=bridge, headers=headers, timeout=60) as client:
        yield client


def _create(admin: httpx.Client, **body: Any) -> dict[str, Any]:
    body = {"display": {"width": 640, "height": 400}, "memory_mib": 1024, **body}
    response = admin.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def _owner(cluster: LocalCluster, session_id: str) -> str:
    record = ray.get(cluster.registry.lookup.remote(session_id))
    return str(record["node_name"])


def _wait(predicate: Any, timeout_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _free_slots() -> float:
    return float(ray.available_resources().get(RESOURCE_DESKTOP, 0))


def test_nodes_declare_capacity_and_labels(cluster: LocalCluster) -> None:
    by_name = {
        n["Labels"].get("deskvm.io/node"): n for n in ray.nodes() if n["Alive"] and n["Labels"]
    }
    assert by_name["n1"]["Resources"][RESOURCE_DESKTOP] == 25
    assert by_name["n2"]["Labels"]["deskvm.io/accel"] == "kvm"
    assert by_name["n3"]["Labels"]["deskvm.io/egress"] == "yes"
    assert by_name["n1"]["Labels"]["image.deskvm.io/other-image"] == "yes"
    assert "image.deskvm.io/other-image" not in by_name["n2"]["Labels"]
    nodes = ray.get(cluster.registry.nodes.remote())
    assert {n["name"] for n in nodes} == {"n1", "n2", "n3"}
    assert all(n["url"].startswith(f"http://{cluster.ip}:") for n in nodes)


def test_labels_steer_placement(cluster: LocalCluster, admin: httpx.Client) -> None:
    made = [
        (_create(admin, image="other-image"), "n1"),
        (_create(admin, egress={"allow": ["198.51.100.7:443"]}), "n3"),
    ]
    kvm_app = create_cluster_app(cluster.bridge(SETTINGS, require_accel="kvm"))
    with BackgroundServer(kvm_app, host=cluster.ip) as kvm_bridge:
        response = admin.post(f"{kvm_bridge.url}/v1/sessions", json={"memory_mib": 1024})
        assert response.status_code == 201, response.text
        made.append((response.json(), "n2"))
    for info, node in made:
        assert _owner(cluster, info["id"]) == node
        assert info["ws_url"].startswith(f"ws://{admin.base_url.host}:")  # the bridge's URL
    missing = admin.post("/v1/sessions", json={"image": "nobody-has-it"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "image_not_found"
    for info, _ in made:
        assert admin.delete(f"/v1/sessions/{info['id']}").json()["state"] == "closed"


def test_fifty_sessions_place_within_capacity_and_clean_up(
    cluster: LocalCluster, admin: httpx.Client
) -> None:
    """50 sessions over three nodes, then the rest of the slots, then 503 before anything
    starts; deleting them all frees every slot and every reservation."""
    _wait(lambda: _free_slots() == TOTAL_SLOTS, what="all slots free")
    with ThreadPoolExecutor(max_workers=8) as pool:
        infos = list(pool.map(lambda _: _create(admin), range(50)))
    infos += [_create(admin) for _ in range(TOTAL_SLOTS - 50)]
    owners = Counter(_owner(cluster, info["id"]) for info in infos)
    assert sum(owners.values()) == TOTAL_SLOTS
    assert owners == Counter(SLOTS)  # every node full, none over
    assert _free_slots() == 0
    t0 = time.monotonic()
    full = admin.post("/v1/sessions", json={"memory_mib": 1024})
    assert full.status_code == 503, full.text
    assert full.json()["error"]["code"] == "cluster_full"
    assert "slot" in full.json()["error"]["message"]
    assert full.headers["retry-after"] == "5"
    assert time.monotonic() - t0 < 5
    listed = admin.get("/v1/sessions").json()
    assert sum(s["state"] == "ready" for s in listed) == TOTAL_SLOTS
    assert ray.get(cluster.registry.counts.remote())["live"] == TOTAL_SLOTS
    with ThreadPoolExecutor(max_workers=8) as pool:
        states = list(pool.map(lambda i: admin.delete(f"/v1/sessions/{i['id']}").json(), infos))
    assert {s["state"] for s in states} == {"closed"}
    _wait(lambda: _free_slots() == TOTAL_SLOTS, what="slots freed")
    _wait(lambda: ray.get(cluster.registry.counts.remote())["live"] == 0, what="registry empty")
    named = [
        pg for pg in ray.util.placement_group_table().values()
        if pg["name"].startswith("deskvm-session-") and pg["state"] != "REMOVED"
    ]  # fmt: skip
    assert named == []
    for node in cluster.nodes.values():
        health = httpx.get(f"{node.url}/healthz").json()
        assert health["sessions"] == 0


def test_memory_is_a_capacity_too(admin: httpx.Client) -> None:
    response = admin.post("/v1/sessions", json={"memory_mib": 65536})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "cluster_full"
    assert "MiB" in response.json()["error"]["message"]


def test_tokens_work_on_every_bridge_and_sessions_survive_a_bridge(
    cluster: LocalCluster, admin: httpx.Client, bridge: str, tmp_path: Path
) -> None:
    """A second bridge (its own process and Ray driver) creates a session and mints a
    token; it is killed; the client keeps its session through the first bridge."""
    port = _free_port(cluster.ip)
    env = {**os.environ, "DESKVM_STATE_DIR": str(tmp_path / "b2"), "DESKVM_DEFAULT_IMAGE": IMAGE}
    log = (tmp_path / "bridge2.log").open("wb")
    second = subprocess.Popen(
        [sys.executable, "-m", "agent_bridge.cli", "serve", "--ray", cluster.address,
         "--host", cluster.ip, "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url2 = f"http://{cluster.ip}:{port}"
        _wait(lambda: _healthy(url2), timeout_s=60, what="the second bridge")
        token = cluster.credentials["admin_token"]
        with Client(url2, token) as client:
            session = client.create_session(width=640, height=400, memory_mib=1024)
            minted = client.mint_token(session.id, "control")
            session.click(10, 10)
            session.close()
        second.send_signal(signal.SIGKILL)
        second.wait(timeout=30)
        with Client(bridge, minted["token"]) as client:  # reconnect elsewhere
            again = client.attach(session.id)
            again.type("hi\n")
            assert again.cursor_position() == (10, 10)
            assert again.info()["state"] == "ready"
            again.close()
        assert admin.delete(f"/v1/sessions/{session.id}").json()["state"] == "closed"
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(timeout=30)
        log.close()


def test_token_checks_happen_before_routing(
    cluster: LocalCluster, admin: httpx.Client, bridge: str
) -> None:
    info = _create(admin)
    sid = info["id"]
    view = admin.post(f"/v1/sessions/{sid}/tokens", json={"scope": "view"}).json()["token"]
    other = _create(admin)["id"]
    with httpx.Client(base_url=bridge) as anon:
        assert anon.get(f"/v1/sessions/{sid}").status_code == 401
        assert anon.get("/v1/sessions/zzzzzzzzzzzz").status_code == 401  # 401 before 404
        headers = {"Authorization": f"Bearer {view}"}
        assert anon.get(f"/v1/sessions/{sid}", headers=headers).status_code == 200
        assert anon.get(f"/v1/sessions/{other}", headers=headers).status_code == 401
        assert anon.delete(f"/v1/sessions/{sid}", headers=headers).status_code == 403  # node
    ws = bridge.replace("http", "ws") + f"/v1/sessions/{sid}/ws"
    with ws_connect(ws, additional_headers={"Authorization": f"Bearer {view}"}) as sock:
        sock.send(json.dumps({"id": 1, "action": "click", "x": 1, "y": 1}))
        assert json.loads(sock.recv())["error"]["code"] == "forbidden"
        sock.send(json.dumps({"id": 2, "action": "cursor_position"}))
        assert json.loads(sock.recv())["ok"]
    with pytest.raises(InvalidStatus):
        ws_connect(ws, additional_headers={"Authorization": "Bearer nope"})
    admin.delete(f"/v1/sessions/{sid}")
    admin.delete(f"/v1/sessions/{other}")


def test_recordings_land_in_s3_and_verify(
    cluster: LocalCluster, admin: httpx.Client, s3_bucket: str
) -> None:
    info = _create(admin, image="other-image")  # only n1 has it; n1 ships to S3
    with Client(str(admin.base_url), cluster.credentials["admin_token"]) as client:
        session = client.attach(info["id"])
        session.screenshot()
        session.click(20, 30)
        session.type("echo hi\n")
        session.close()
    url = f"s3://{s3_bucket}/rec/{info['id']}"
    # Shipped while running: the manifest is there before the session ends.
    _wait(lambda: _stored_status(s3_bucket, info["id"]) == "recording", what="a running shipment")
    admin.delete(f"/v1/sessions/{info['id']}")
    _wait(lambda: _stored_status(s3_bucket, info["id"]) == "closed", what="the final shipment")
    result = CliRunner().invoke(cli_app, ["replay", "verify", url])
    assert result.exit_code == 0, result.output
    assert "intact and closed" in result.output
    result = CliRunner().invoke(cli_app, ["replay", "info", url])
    assert "click" in result.output and "type" in result.output


def test_node_death(cluster: LocalCluster, admin: httpx.Client, s3_bucket: str) -> None:
    """A node dies: its sessions end with session_lost, their stored recordings are sealed
    truncated, its reservations are freed, survivors keep running, new sessions go to
    the live nodes."""
    cluster.add_node(
        _capacity("doomed", 3, images=(IMAGE, "doomed-image")),
        fake_images=(IMAGE, "doomed-image"),
        recordings_url=f"s3://{s3_bucket}/rec",
        ship_interval_s=0.3,
    )
    survivor = _create(admin)
    doomed = [_create(admin, image="doomed-image") for _ in range(2)]
    assert {_owner(cluster, d["id"]) for d in doomed} == {"doomed"}
    token = cluster.credentials["admin_token"]
    ws = str(admin.base_url).replace("http", "ws") + f"/v1/sessions/{doomed[0]['id']}/ws"
    with ws_connect(ws, additional_headers={"Authorization": f"Bearer {token}"}) as live_socket:
        live_socket.send(json.dumps({"id": 1, "action": "click", "x": 5, "y": 5}))
        assert json.loads(live_socket.recv())["ok"]
        for d in doomed:
            _wait(lambda d=d: _stored_status(s3_bucket, d["id"]) == "recording", what="shipment")
        cluster.kill_node("doomed")
        with pytest.raises(ConnectionClosed):  # the open socket is closed, not left hanging
            live_socket.recv(timeout=30)
    lost = _wait(
        lambda: (
            (i := admin.get(f"/v1/sessions/{doomed[0]['id']}").json()).get("state") == "closed"
            and i
        ),
        what="the session reported lost",
    )
    assert lost["closed_reason"] == "session_lost: node doomed died"
    listed = {s["id"]: s for s in admin.get("/v1/sessions").json()}
    assert listed[doomed[1]["id"]]["closed_reason"].startswith("session_lost")
    guest_log = admin.get(f"/v1/sessions/{doomed[0]['id']}/guest-log")
    assert guest_log.status_code == 410
    assert guest_log.json()["error"]["code"] == "session_lost"
    with ws_connect(ws, additional_headers={"Authorization": f"Bearer {token}"}) as sock:
        assert json.loads(sock.recv())["error"]["code"] == "session_lost"
        with pytest.raises(ConnectionClosed) as closed:
            sock.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    for d in doomed:
        _wait(lambda d=d: _stored_status(s3_bucket, d["id"]) == "truncated", what="the seal")
        result = CliRunner().invoke(
            cli_app, ["replay", "verify", f"s3://{s3_bucket}/rec/{d['id']}"]
        )
        assert result.exit_code == 3, result.output  # intact up to event N, truncated
        assert "session_lost: node doomed died" in result.output
    # Nothing held for the dead sessions; the survivor is untouched; new sessions place.
    _wait(lambda: _free_slots() == TOTAL_SLOTS - 1, what="the dead node's slots gone")
    assert admin.get(f"/v1/sessions/{survivor['id']}").json()["state"] == "ready"
    again = _create(admin)
    assert _owner(cluster, again["id"]) in SLOTS
    assert admin.post("/v1/sessions", json={"image": "doomed-image"}).status_code == 404
    for info in (survivor, again):
        assert admin.delete(f"/v1/sessions/{info['id']}").json()["state"] == "closed"
    _wait(lambda: ray.get(cluster.registry.counts.remote())["live"] == 0, what="no live session")


def test_unowned_placement_groups_are_freed(cluster: LocalCluster) -> None:
    """A bridge that died between placing a session and reserving it leaves a placement
    group no session owns: the registry removes it."""
    from ray.util.placement_group import placement_group, placement_group_table

    group = placement_group(
        [{RESOURCE_DESKTOP: 1.0}], name="deskvm-session-orphan000001", lifetime="detached"
    )
    assert group.wait(10)
    _wait(
        lambda: placement_group_table(group)["state"] == "REMOVED",
        timeout_s=30,
        what="the orphaned placement group to be removed",
    )


def test_deskvm_node_joins_and_drains(cluster: LocalCluster, admin: httpx.Client,
                                     tmp_path: Path) -> None:  # fmt: skip
    """``deskvm node`` (its own raylet via ``ray start --block``) joins, serves, and on
    SIGTERM closes its sessions, leaves the registry and stops its raylet."""
    env = {**os.environ, "DESKVM_STATE_DIR": str(tmp_path / "cli-node")}
    node = subprocess.Popen(
        [sys.executable, "-m", "agent_bridge.cli", "node", "--ray", cluster.address,
         "--name", "clinode", "--backend", "fake", "--fake-image", "cli-image", "--slots", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait(
            lambda: any(n["name"] == "clinode" for n in ray.get(cluster.registry.nodes.remote())),
            timeout_s=90,
            what="deskvm node to join",
        )
        info = _create(admin, image="cli-image")
        assert _owner(cluster, info["id"]) == "clinode"
        node.send_signal(signal.SIGTERM)
        output, _ = node.communicate(timeout=120)
        assert node.returncode == 0, output.decode()
        assert b"draining" in output
        state = admin.get(f"/v1/sessions/{info['id']}").json()
        assert state["state"] == "closed"
        assert not any(n["name"] == "clinode" for n in ray.get(cluster.registry.nodes.remote()))
        _wait(
            lambda: (
                not any(
                    n["Alive"] and n["Labels"].get("deskvm.io/node") == "clinode"
                    for n in ray.nodes()
                )
            ),
            what="the raylet to stop",
        )
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(timeout=30)


def _stored_status(bucket: str, session_id: str) -> str | None:
    import boto3

    try:
        body = boto3.client("s3").get_object(Bucket=bucket, Key=f"rec/{session_id}/manifest.json")
    except Exception:
        return None
    return str(json.loads(body["Body"].read()).get("status"))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
