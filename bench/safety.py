"""Costs of the safety layers and the leak counts, in process on the fake hypervisor.

    python3 bench/safety.py [--cycles 100]

Prints: token mint and verify time, the approval-policy check, the WebSocket round trip of
a screenshot through admin / scoped-token connections, and the host counts (threads, fds,
RSS, fake domains, files outside the kept recordings) before and after N create/delete
cycles of the full REST + WebSocket path. No VM, no network beyond the in-process client.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastapi.testclient import TestClient  # noqa: E402

from agent_bridge.protocol.actions import Click, Type  # noqa: E402
from agent_bridge.server import create_app  # noqa: E402
from agent_bridge.tokens import TokenAuthority  # noqa: E402
from orchestrator.approval import ApprovalPolicy  # noqa: E402
from orchestrator.hypervisor.fake import FakeHypervisor  # noqa: E402
from orchestrator.input_plan import Pacing  # noqa: E402
from orchestrator.interrupt import run_main  # noqa: E402
from orchestrator.manager import SessionManager  # noqa: E402
from orchestrator.settings import Settings  # noqa: E402
from orchestrator.spec import BootImage  # noqa: E402

TOKEN = "bench-token-0123456789abcdef"


def per_op_us(fn: object, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - t0) / n * 1e6


def counts(state: Path, hv: FakeHypervisor) -> dict[str, int]:
    gc.collect()
    rss = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    files = [p for p in state.rglob("*") if p.is_file()]
    return {
        "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": rss,
        "domains": len(hv.domains),
        "files_outside_recordings": sum(1 for p in files if "recordings" not in p.parts),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=100)
    args = parser.parse_args()

    authority = TokenAuthority()
    token, _ = authority.mint("abcdef012345", "control")
    print(
        f"token mint:   {per_op_us(lambda: authority.mint('abcdef012345', 'view'), 2000):7.1f} us"
    )
    verify = per_op_us(
        lambda: authority.verify(token, session_id="abcdef012345", need="control"), 2000
    )
    print(f"token verify: {verify:7.1f} us")
    policy = ApprovalPolicy(key_combos=("ctrl+alt+delete",), text_patterns=(r"rm\s+-rf",))
    typed = per_op_us(lambda: policy.reason(Type("ls -l /tmp")), 20000)
    click = per_op_us(lambda: policy.reason(Click(1, 2)), 20000)
    print(f"policy check: {typed:7.2f} us (type), {click:.2f} us (click)")

    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        hv = FakeHypervisor()
        image = BootImage("bench", "0" * 64, state / "b", state / "k", state / "i")
        manager = SessionManager(
            hypervisor=hv,
            resolve_image=lambda name: image,
            recordings_dir=state / "recordings",
            pacing=Pacing(0, 0, 0, 0, 0),
            ready_poll_s=0.01,
        )
        # Rate limits off: this measures the path, not the limiter.
        settings = Settings(default_image="bench", max_actions_per_s=1e6, max_typed_chars_per_s=1e6)
        app = create_app(manager, token=TOKEN, settings=settings)
        with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as client:

            def cycle() -> None:
                body = {"display": {"width": 640, "height": 480}}
                sid = client.post("/v1/sessions", json=body).json()["id"]
                minted = client.post(f"/v1/sessions/{sid}/tokens", json={"scope": "control"})
                headers = {"Authorization": f"Bearer {minted.json()['token']}"}
                with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=headers) as ws:
                    ws.send_text(json.dumps({"id": 1, "action": "type", "text": "x\n"}))
                    ws.receive_json()
                client.delete(f"/v1/sessions/{sid}")

            sid = client.post("/v1/sessions", json={}).json()["id"]
            minted = client.post(f"/v1/sessions/{sid}/tokens", json={"scope": "view"}).json()
            for label, headers in (
                ("admin token", {}),
                ("view token", {"Authorization": f"Bearer {minted['token']}"}),
            ):
                with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=headers) as ws:

                    def shot(ws: object = ws) -> None:
                        ws.send_text('{"id": 1, "action": "cursor_position"}')  # type: ignore[attr-defined]
                        ws.receive_json()  # type: ignore[attr-defined]

                    print(f"ws round trip ({label}): {per_op_us(shot, 200) / 1000:.2f} ms")
            client.delete(f"/v1/sessions/{sid}")
            for _ in range(5):
                cycle()
            before = counts(state, hv)
            t0 = time.perf_counter()
            for _ in range(args.cycles):
                cycle()
            elapsed = time.perf_counter() - t0
            after = counts(state, hv)
    print(f"\n{args.cycles} create/act/delete cycles in {elapsed:.1f} s")
    print(f"{'count':<26}{'before':>10}{'after':>10}")
    for key in before:
        print(f"{key:<26}{before[key]:>10}{after[key]:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
