"""The live stream ``/v1/sessions/{id}/stream`` against a real uvicorn server (fake backend)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import AUTH, TOKEN
from PIL import Image
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from agent_bridge.protocol.stream import FrameHeader, decode_frame
from orchestrator.display.fake import FakeDisplay
from orchestrator.hypervisor.fake import FakeHypervisor


def _ws(url: str) -> str:
    return url.replace("http://", "ws://", 1)


@pytest.fixture
def session_id(server_url: str) -> Iterator[str]:
    body = {"display": {"width": 640, "height": 400}}
    response = httpx.post(f"{server_url}/v1/sessions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 201, response.text
    sid: str = response.json()["id"]
    yield sid
    httpx.delete(f"{server_url}/v1/sessions/{sid}", headers=AUTH, timeout=30)


def _open(server_url: str, sid: str, query: str = "", token: str = TOKEN) -> ClientConnection:
    return connect(
        f"{_ws(server_url)}/v1/sessions/{sid}/stream{query}",
        additional_headers={"Authorization": f"Bearer {token}"},
        open_timeout=10,
    )


def _hello(ws: ClientConnection) -> dict[str, Any]:
    hello = json.loads(ws.recv(timeout=10))
    assert hello["event"] == "hello"
    return hello  # type: ignore[no-any-return]


def _next_frame(ws: ClientConnection, timeout_s: float = 10) -> tuple[FrameHeader, bytes]:
    """The next binary message (status events skipped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        message = ws.recv(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(message, bytes):
            return decode_frame(message)


def _act(server_url: str, sid: str, *messages: dict[str, Any]) -> None:
    with connect(
        f"{_ws(server_url)}/v1/sessions/{sid}/ws",
        additional_headers={"Authorization": f"Bearer {TOKEN}"},
    ) as ws:
        for i, message in enumerate(messages):
            ws.send(json.dumps({"id": i, **message}))
            assert json.loads(ws.recv(timeout=10))["ok"]


def _display(hypervisor: FakeHypervisor, sid: str) -> FakeDisplay:
    display = hypervisor.domains[sid].display
    assert isinstance(display, FakeDisplay)
    return display


def test_first_frame_then_only_changes(
    server_url: str, session_id: str, hypervisor: FakeHypervisor
) -> None:
    with _open(server_url, session_id, "?max_fps=30") as ws:
        hello = _hello(ws)
        assert hello["codec"] == "jpeg" and hello["header_bytes"] == 24
        assert hello["display"] == {"width": 640, "height": 400}
        header, data = _next_frame(ws)
        assert header.first and header.codec == "jpeg" and header.mime == "image/jpeg"
        assert (header.width_px, header.height_px) == (640, 400)
        with Image.open(io.BytesIO(data)) as image:
            assert (image.format, image.size) == ("JPEG", (640, 400))
        # A still screen sends nothing (status events are text and may come).
        with pytest.raises(TimeoutError):
            _next_frame(ws, timeout_s=0.6)
        _act(server_url, session_id, {"action": "move", "x": 300, "y": 200})
        moved, data = _next_frame(ws)
        assert moved.frame > header.frame and not moved.first
        assert moved.pts_ns > header.pts_ns
        with Image.open(io.BytesIO(data)) as image:
            red, green, _ = image.convert("RGB").getpixel((301, 201))
        assert red > 200 and green < 80  # the fake pointer, drawn where the move went


def test_codec_quality_and_size_are_the_viewers(server_url: str, session_id: str) -> None:
    for query, fmt, size in (
        ("?codec=png", "PNG", (640, 400)),
        ("?codec=webp&quality=50", "WEBP", (640, 400)),
        ("?codec=jpeg&quality=30&max_long_edge=320", "JPEG", (320, 200)),
    ):
        with _open(server_url, session_id, query) as ws:
            _hello(ws)
            header, data = _next_frame(ws)
            assert (header.width_px, header.height_px) == size
            with Image.open(io.BytesIO(data)) as image:
                assert (image.format, image.size) == (fmt, size)


def test_lossless_png_stream_is_the_screen(
    server_url: str, session_id: str, hypervisor: FakeHypervisor
) -> None:
    with _open(server_url, session_id, "?codec=png") as ws:
        _hello(ws)
        _, data = _next_frame(ws)
    with Image.open(io.BytesIO(data)) as image:
        shown = image.convert("RGB").tobytes()
    assert shown == _display(hypervisor, session_id).screendump().tobytes()


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("?codec=jpeg&fps=5", "'fps'"),
        ("?codec=gif", "codec must be one of jpeg, webp, png"),
        ("?max_fps=60", "max_fps"),
        ("?quality=0", "quality"),
        ("?quality=5&quality=6", "more than once"),
        ("?token=abc", "'token'"),
    ],
)
def test_bad_query_is_refused_naming_it(
    server_url: str, session_id: str, query: str, needle: str
) -> None:
    with _open(server_url, session_id, query) as ws:
        reply = json.loads(ws.recv(timeout=10))
        assert reply["ok"] is False and reply["error"]["code"] == "invalid_query"
        assert needle in reply["error"]["message"]
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def test_view_token_streams_and_no_token_is_refused(server_url: str, session_id: str) -> None:
    minted = httpx.post(
        f"{server_url}/v1/sessions/{session_id}/tokens", json={"scope": "view"}, headers=AUTH
    ).json()
    with _open(server_url, session_id, token=minted["token"]) as ws:
        _hello(ws)
        assert _next_frame(ws)[0].first
    with pytest.raises(InvalidStatus) as refused:
        _open(server_url, session_id, token="wrong")
    assert refused.value.response.status_code == 403


def test_viewers_share_one_capture_loop(
    server_url: str, session_id: str, hypervisor: FakeHypervisor
) -> None:
    display = _display(hypervisor, session_id)
    calls = {"n": 0}
    original = display.screendump

    def counting() -> Image.Image:
        calls["n"] += 1
        return original()

    display.screendump = counting  # type: ignore[method-assign]
    with contextlib.ExitStack() as stack:
        viewers = [stack.enter_context(_open(server_url, session_id, "?max_fps=10"))
                   for _ in range(4)]  # fmt: skip
        for ws in viewers:
            _hello(ws)
            _next_frame(ws)
        start = calls["n"]
        time.sleep(1.0)
        grabs_per_s = calls["n"] - start
        # One loop at the fastest viewer's rate (10/s), not one per viewer (40/s).
        assert 5 <= grabs_per_s <= 14, grabs_per_s
        _act(server_url, session_id, {"action": "move", "x": 10, "y": 10})
        numbers = {_next_frame(ws)[0].frame for ws in viewers}
        assert len(numbers) == 1  # every viewer got the same frame


def test_after_a_burst_of_changes_a_viewer_gets_the_newest_frame(
    server_url: str, session_id: str
) -> None:
    with _open(server_url, session_id, "?max_fps=30&codec=png") as slow:
        _hello(slow)
        _next_frame(slow)
        # Many changes while the viewer reads nothing...
        _act(server_url, session_id, *({"action": "move", "x": 10 + i, "y": 10} for i in range(20)))
        time.sleep(0.3)
        # ...then it gets at most one older frame (in flight) before the newest.
        headers = []
        with pytest.raises(TimeoutError):
            while True:
                headers.append(_next_frame(slow, timeout_s=0.5))
        assert 1 <= len(headers) <= 2
        _, last = headers[-1]
    with Image.open(io.BytesIO(last)) as image:
        assert image.convert("RGB").getpixel((30, 11))[0] > 200  # pointer at (29, 10)


def test_stream_closes_when_the_session_ends(server_url: str, session_id: str) -> None:
    with _open(server_url, session_id) as ws:
        _hello(ws)
        httpx.delete(f"{server_url}/v1/sessions/{session_id}", headers=AUTH, timeout=30)
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001


def test_revoking_the_token_closes_its_open_stream(server_url: str, session_id: str) -> None:
    minted = httpx.post(
        f"{server_url}/v1/sessions/{session_id}/tokens", json={"scope": "view"}, headers=AUTH
    ).json()
    with _open(server_url, session_id, token=minted["token"]) as ws:
        _hello(ws)
        response = httpx.delete(
            f"{server_url}/v1/sessions/{session_id}/tokens/{minted['token_id']}", headers=AUTH
        )
        assert response.status_code == 204
        refusal = None
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                message = ws.recv(timeout=5)
                if isinstance(message, str) and not json.loads(message).get("ok", True):
                    refusal = json.loads(message)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert refusal is not None and refusal["error"]["code"] == "unauthorized"
    assert minted["token_id"] in refusal["error"]["message"]
