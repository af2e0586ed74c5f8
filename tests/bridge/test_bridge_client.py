"""The synchronous client against a real uvicorn server (thread, free port, fake backend)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from conftest import IMAGE, TOKEN

import agent_bridge
from agent_bridge.client import BridgeConnectionError, Client, RemoteError, Session, reply_result
from orchestrator.errors import DeskvmError, SessionClosed
from orchestrator.hypervisor.fake import FakeHypervisor


@pytest.fixture
def bridge(server_url: str) -> Iterator[Client]:
    with Client(server_url, TOKEN, timeout_s=10) as client:
        yield client


def test_public_names() -> None:
    assert sorted(agent_bridge.__all__) == [
        "AsyncClient", "AsyncFrameStream", "AsyncSession", "BridgeConnectionError", "Client",
        "FrameStream", "RemoteError", "Screenshot", "Session", "SessionInfo", "StreamFrame",
    ]  # fmt: skip
    assert agent_bridge.Client is Client
    assert issubclass(RemoteError, DeskvmError)
    assert issubclass(BridgeConnectionError, DeskvmError)


def test_client_drives_a_session(bridge: Client, hypervisor: FakeHypervisor) -> None:
    assert bridge.health().ok
    with bridge.create_session(width=800, height=600, memory_mib=1024, vcpus=1) as session:
        assert isinstance(session, Session)
        assert [s.id for s in bridge.list_sessions()] == [session.id]
        info = session.info()
        assert (info.state, info.image, info.width, info.height) == ("ready", IMAGE, 800, 600)
        assert info.get("recording") == info.recording

        shot = session.screenshot()
        assert (shot.width, shot.height, shot.mime) == (800, 600, "image/png")
        assert shot.image().size == (800, 600)
        assert session.zoom((10, 10, 110, 60)).image().size == (100, 50)

        session.move(10, 20)
        assert session.cursor_position() == (10, 20)
        session.click(30, 40)
        session.click(30, 40, button="right", count=2, hold="shift")
        session.double_click(50, 50)
        session.triple_click(60, 60)
        session.mouse_down(x=70, y=70)
        session.mouse_up(x=80, y=80)
        session.drag([(1, 1), (5, 5), (9, 9)])
        session.scroll(100, 100, dy=-2)
        session.key("ctrl+shift+t")
        session.hold_key("shift", 5)
        session.wait(5)
        session.type("hunter2", secret=True)
        session.type("\n")  # the fake shell ends the (secret) line
        session.type("hello\n")
        assert session.guest_log().splitlines()[-1] == "hello"
        assert session.cursor_position() == (100, 100)
        display = hypervisor.domains[session.id].display
        assert display.pressed_keys == set() and display.pressed_buttons == set()

        with pytest.raises(RemoteError) as info_err:
            session.click(5000, 5)
        assert info_err.value.code == "out_of_screen" and info_err.value.status is None
        with pytest.raises(RemoteError) as info_err:
            session.request({"action": "teleport"})
        assert info_err.value.code == "unknown_action"
        assert session.request({"action": "cursor_position"}) == {"x": 100, "y": 100}
        # Binary images by default: request() gives the PNG bytes.
        assert session.request({"action": "screenshot"})["data"].startswith(b"\x89PNG")
        acted = session.act({"action": "move", "x": 5, "y": 6}, still_ms=100, timeout_ms=3000)
        assert acted.result == {} and acted.screenshot.settled
        assert acted.screenshot.waited_ms >= 100 and acted.screenshot.image().size == (800, 600)
        session_id = session.id
    # Leaving the block deleted it.
    assert bridge.get_session(session_id).state == "closed"
    assert hypervisor.domains == {}


def test_client_errors(bridge: Client, server_url: str, hypervisor: FakeHypervisor) -> None:
    with pytest.raises(RemoteError) as info:
        bridge.create_session(image="no-such-image")
    assert (info.value.code, info.value.status) == ("image_not_found", 404)
    with pytest.raises(RemoteError) as info:
        bridge.get_session("nope")
    assert info.value.code == "session_not_found"
    with pytest.raises(RemoteError) as info:
        bridge.create_session(width=100)
    assert (info.value.code, info.value.status) == ("invalid_request", 422)

    with Client(server_url, "wrong-token") as wrong:
        with pytest.raises(RemoteError) as info:
            wrong.list_sessions()
        assert (info.value.code, info.value.status) == ("unauthorized", 401)
        assert wrong.health().ok  # no token needed
        session = bridge.create_session()
        # The WebSocket handshake is refused (HTTP 403) before anything runs.
        with pytest.raises(BridgeConnectionError, match="403"):
            Session(wrong, session.info()).screenshot()
        session.delete()


def test_session_ended_raises_session_closed(bridge: Client) -> None:
    session = bridge.create_session()
    session.cursor_position()  # opens the WebSocket
    bridge.delete_session(session.id)
    time.sleep(0.5)  # the server notices within its poll interval and closes with 1001
    with pytest.raises(SessionClosed) as info:
        session.cursor_position()
    # Said once, with the reason (it read "ended: session ended: deleted by client").
    assert str(info.value) == f"session {session.id} ended: deleted by client"
    assert session.delete() is not None  # deleting an ended session is fine


def test_a_session_closed_reply_is_session_closed_like_the_close_itself(bridge: Client) -> None:
    # Deleted while the WebSocket is open: the next request either gets the close (1001)
    # or, if it was sent first, an error reply; both are SessionClosed, never RemoteError.
    session = bridge.create_session()
    session.cursor_position()
    bridge.delete_session(session.id)
    with pytest.raises(SessionClosed):
        session.cursor_position()
    reply = {"ok": False, "error": {"code": "session_closed", "message": "session x ended"}}
    with pytest.raises(SessionClosed, match=r"^session x ended$"):
        reply_result(reply)
    with pytest.raises(RemoteError) as info:
        reply_result({"ok": False, "error": {"code": "busy", "message": "later"}})
    assert info.value.code == "busy"


def test_unreachable_server_is_a_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (
        Client(f"http://127.0.0.1:{port}", TOKEN, timeout_s=2) as client,
        pytest.raises(BridgeConnectionError),
    ):
        client.health()


def test_client_limits_and_scoped_tokens(
    bridge: Client, server_url: str, hypervisor: FakeHypervisor
) -> None:
    session = bridge.create_session(
        width=640, height=480, cpu_quota_pct=50, ttl_s=300, idle_timeout_s=60
    )
    assert session.info()["limits"]["cpu_quota_pct"] == 50
    view = bridge.mint_token(session.id, "view", ttl_s=60)
    with Client(server_url, view["token"], timeout_s=10) as viewer:
        watched = viewer.attach(session.id)
        assert watched.screenshot().width == 640
        with pytest.raises(RemoteError) as info:
            watched.click(10, 10)
        assert info.value.code == "forbidden"
        watched.close()
        bridge.revoke_token(session.id, view["token_id"])
        with pytest.raises(RemoteError) as info:
            viewer.get_session(session.id)
        assert info.value.code == "unauthorized"
    assert hypervisor.domains[session.id].display.events == []
    session.delete()


def test_sync_client_reads_the_stream(bridge: Client) -> None:
    with bridge.create_session(width=640, height=400) as session:
        with session.stream(codec="png", max_fps=20) as frames:
            assert frames.hello["codec"] == "png"
            first = next(frames)
            assert first.first and (first.width, first.height, first.codec) == (640, 400, "png")
            assert first.image is not None and first.image.size == (640, 400)
            with pytest.raises(TimeoutError):
                frames.next(timeout_s=0.5)  # a still screen sends nothing
            session.move(320, 200)
            moved = frames.next(timeout_s=10)
            assert moved is not None and moved.frame > first.frame and not moved.first
            assert moved.image is not None and moved.image.getpixel((321, 201))[0] > 200
        with pytest.raises(RemoteError) as refused:
            session.stream(max_fps=99)
        assert refused.value.code == "invalid_query"
        frames = session.stream(max_long_edge=320, decode=False)
        frame = next(frames)
        assert (frame.width, frame.height, frame.image) == (320, 200, None)
        bridge.delete_session(session.id)
        assert list(frames) == []  # the session ended: iteration stops
