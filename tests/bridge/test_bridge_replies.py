"""Binary image replies (``?images=binary``) and ``screenshot_after`` on the action socket."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from typing import Any

import numpy as np
from conftest import create_session
from fastapi.testclient import TestClient
from PIL import Image

from agent_bridge.protocol.replies import decode_binary_reply
from orchestrator.display.fake import FakeDisplay
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.replay import Recording


def _send(ws: Any, message: dict[str, Any]) -> Any:
    ws.send_text(json.dumps(message))
    return ws.receive()


def test_binary_images_skip_base64(client: TestClient, hypervisor: FakeHypervisor) -> None:
    sid = create_session(client, display={"width": 640, "height": 400})["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws?images=binary") as ws:
        message = _send(ws, {"id": 1, "action": "screenshot"})
        reply, blobs = decode_binary_reply(message["bytes"])
        assert reply["id"] == 1 and reply["ok"] is True and reply["blobs"] == [len(blobs[0])]
        result = reply["result"]
        assert {k: result[k] for k in ("width", "height", "mime", "blob")} == {
            "width": 640, "height": 400, "mime": "image/png", "blob": 0,
        }  # fmt: skip
        assert isinstance(result["frame_seq"], int) and result["t_s"] >= 0
        with Image.open(io.BytesIO(blobs[0])) as image:
            assert image.size == (640, 400)
        # Replies without images stay JSON text.
        message = _send(ws, {"id": 2, "action": "cursor_position"})
        assert json.loads(message["text"]) == {"id": 2, "ok": True, "result": {"x": 320, "y": 200}}
        message = _send(ws, {"id": 3, "action": "zoom", "region": [0, 0, 10, 10]})
        reply, blobs = decode_binary_reply(message["bytes"])
        assert reply["result"]["blob"] == 0 and reply["result"]["width"] == 10
    # The same screen by default (base64 in JSON).
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        reply = json.loads(_send(ws, {"id": 1, "action": "screenshot"})["text"])
        assert base64.b64decode(reply["result"]["data"]).startswith(b"\x89PNG")


def test_images_query_is_checked(client: TestClient) -> None:
    sid = create_session(client)["id"]
    for query, needle in (("images=hex", "images must be"), ("images=binary&schema=openai",
                                                             "schema=deskvm")):  # fmt: skip
        with client.websocket_connect(f"/v1/sessions/{sid}/ws?{query}") as ws:
            reply = ws.receive_json()
            assert reply["error"]["code"] == "invalid_query" and needle in reply["error"]["message"]


def test_screenshot_after_waits_for_a_still_screen(
    client: TestClient, hypervisor: FakeHypervisor
) -> None:
    sid = create_session(client, display={"width": 640, "height": 400})["id"]
    display = hypervisor.domains[sid].display
    assert isinstance(display, FakeDisplay)
    # The pointer keeps moving for 0.4 s after the click, then the screen is still.
    stop_at = time.monotonic() + 0.4

    def animate() -> None:
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            display.pointer = (100 + i % 50, 100)
            time.sleep(0.02)

    with client.websocket_connect(f"/v1/sessions/{sid}/ws?images=binary") as ws:
        threading.Thread(target=animate).start()
        message = _send(
            ws,
            {"id": 7, "action": "click", "x": 5, "y": 5,
             "screenshot_after": {"still_ms": 300, "timeout_ms": 5000}},
        )  # fmt: skip
        replied = time.monotonic()
    reply, blobs = decode_binary_reply(message["bytes"])
    assert reply["result"] == {} and reply["ok"] is True
    after = reply["screenshot_after"]
    assert after["settled"] is True and after["blob"] == 0
    # The last change came at most 20 ms before stop_at; then 300 ms of stillness.
    assert replied >= stop_at - 0.02 + 0.3 and after["waited_ms"] >= 300
    with Image.open(io.BytesIO(blobs[0])) as image:
        shown = np.asarray(image.convert("RGB"))
    assert np.array_equal(shown, np.asarray(display.screendump()))  # the final, still screen
    recording = Recording(
        next(p for p in (client.app.state.bridge.manager.recordings_dir).iterdir())  # type: ignore[attr-defined]
    )
    frame = recording.events[after["frame_seq"]]
    assert frame["kind"] == "frame" and frame["data"]["reason"] == "settled"
    result = recording.events[after["frame_seq"] + 1]
    assert result["data"] == {
        "action": "screenshot_after",
        "settled": True,
        "waited_ms": after["waited_ms"],
        "frame_seq": after["frame_seq"],
    }


def test_screenshot_after_times_out_flagged(client: TestClient, hypervisor: FakeHypervisor) -> None:
    sid = create_session(client, display={"width": 320, "height": 320})["id"]
    display = hypervisor.domains[sid].display
    rng = np.random.default_rng(1)
    display.screendump = lambda: Image.fromarray(  # type: ignore[method-assign]
        rng.integers(0, 255, (320, 320, 3), dtype=np.uint8)
    )
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        start = time.monotonic()
        after_spec = {"still_ms": 500, "timeout_ms": 400}
        message = {"id": 1, "action": "wait", "ms": 0, "screenshot_after": after_spec}
        reply = json.loads(_send(ws, message)["text"])
        elapsed_s = time.monotonic() - start
    after = reply["screenshot_after"]
    assert after["settled"] is False and 400 <= after["waited_ms"] < 1500
    assert elapsed_s < 5
    assert base64.b64decode(after["data"]).startswith(b"\x89PNG")


def test_screenshot_after_errors_and_vendor_schemas(client: TestClient) -> None:
    sid = create_session(client)["id"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws") as ws:
        message = {"id": 1, "action": "move", "x": 1, "y": 1, "screenshot_after": {"still_ms": "x"}}
        error = json.loads(_send(ws, message)["text"])["error"]
        assert error["code"] == "invalid_action" and "still_ms" in error["message"]
    with client.websocket_connect(f"/v1/sessions/{sid}/ws?schema=computer_20250124") as ws:
        reply = json.loads(
            _send(ws, {"id": 2, "action": "mouse_move", "coordinate": [10, 10],
                       "screenshot_after": {"still_ms": 50, "timeout_ms": 2000}})["text"]
        )  # fmt: skip
        assert reply["ok"] is True and reply["screenshot_after"]["settled"] is True
        assert base64.b64decode(reply["screenshot_after"]["data"]).startswith(b"\x89PNG")
