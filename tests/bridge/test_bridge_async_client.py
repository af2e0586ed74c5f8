"""The asyncio client against a real uvicorn server (thread, free port, fake backend)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import IMAGE, TOKEN

from agent_bridge import AsyncClient, AsyncSession, RemoteError, StreamFrame
from agent_bridge.client import BridgeConnectionError
from orchestrator.errors import SessionClosed
from orchestrator.hypervisor.fake import FakeHypervisor


def run(server_url: str, body: Callable[[AsyncClient], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with AsyncClient(server_url, TOKEN, timeout_s=10) as client:
            return await body(client)

    return asyncio.run(main())


def test_async_client_drives_a_session(server_url: str, hypervisor: FakeHypervisor) -> None:
    async def body(client: AsyncClient) -> str:
        assert (await client.health()).ok
        session = await client.create_session(width=800, height=600, memory_mib=1024, vcpus=1)
        async with session:
            assert isinstance(session, AsyncSession)
            assert [s.id for s in await client.list_sessions()] == [session.id]
            info = await session.info()
            assert (info.state, info.image, info.width, info.height) == ("ready", IMAGE, 800, 600)
            shot = await session.screenshot()
            assert (shot.width, shot.height, shot.mime) == (800, 600, "image/png")
            assert (await session.zoom((10, 10, 110, 60))).image().size == (100, 50)
            await session.move(10, 20)
            assert await session.cursor_position() == (10, 20)
            await session.click(30, 40)
            await session.click(30, 40, button="right", count=2, hold="shift")
            await session.double_click(50, 50)
            await session.triple_click(60, 60)
            await session.mouse_down(x=70, y=70)
            await session.mouse_up(x=80, y=80)
            await session.drag([(1, 1), (5, 5), (9, 9)])
            await session.scroll(100, 100, dy=-2)
            await session.key("ctrl+shift+t")
            await session.hold_key("shift", 5)
            await session.wait(5)
            await session.type("hello\n")
            assert (await session.guest_log()).splitlines()[-1] == "hello"
            # Several tasks may share the session: their requests go one at a time.
            positions = await asyncio.gather(*(session.cursor_position() for _ in range(5)))
            assert positions == [(100, 100)] * 5
            with pytest.raises(RemoteError) as error:
                await session.click(5000, 5)
            assert error.value.code == "out_of_screen"
            assert await session.request({"action": "cursor_position"}) == {"x": 100, "y": 100}
            acted = await session.act({"action": "move", "x": 5, "y": 6}, still_ms=100)
            assert acted.result == {} and acted.screenshot.settled
            assert acted.screenshot.image().size == (800, 600)
            token = await client.mint_token(session.id, "view")
            assert token["scope"] == "view"
            await client.revoke_token(session.id, token["token_id"])
            assert await session.network() == []
            return session.id

    session_id = run(server_url, body)
    assert hypervisor.domains == {}  # leaving `async with` deleted it
    assert session_id


def test_async_errors_and_stream(server_url: str) -> None:
    async def body(client: AsyncClient) -> None:
        with pytest.raises(RemoteError) as error:
            await client.create_session(image="no-such-image")
        assert (error.value.code, error.value.status) == ("image_not_found", 404)
        with pytest.raises(RemoteError):
            await client.attach("nope")
        async with AsyncClient(client.url, "wrong") as wrong:
            with pytest.raises(RemoteError) as error:
                await wrong.list_sessions()
            assert error.value.status == 401
        session = await client.create_session(width=640, height=400)
        async with session.stream(codec="webp", max_fps=20) as frames:
            assert frames.hello["codec"] == "webp"
            first = await anext(frames)
            assert isinstance(first, StreamFrame) and first.first
            assert first.image is not None and first.image.size == (640, 400)
            with pytest.raises(TimeoutError):
                await frames.next(timeout_s=0.5)
            await session.move(320, 200)
            moved = await frames.next(timeout_s=10)
            assert moved is not None and moved.frame > first.frame
        with pytest.raises(RemoteError) as error:
            await session.stream(codec="gif").open()  # type: ignore[arg-type]
        assert error.value.code == "invalid_query"
        async with session.stream(decode=False) as frames:
            await frames.next(timeout_s=10)
            await client.delete_session(session.id)
            assert [f async for f in frames] == []  # the session ended: iteration stops
        with pytest.raises(SessionClosed):
            await session.cursor_position()
        async with AsyncClient(client.url, "wrong") as wrong:
            other = await client.create_session()
            with pytest.raises(BridgeConnectionError, match="403"):
                await AsyncSession(wrong, await other.info()).screenshot()
            await other.delete()

    run(server_url, body)
