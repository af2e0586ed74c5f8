"""The asyncio twins of the visual checks on AsyncSession, against the fake backend over
real HTTP/WebSocket (an in-process server on a free port)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent_bridge.async_client import AsyncClient
from agent_bridge.pytest_plugin import _fake_manager
from agent_bridge.qa.errors import MatchTimeout
from agent_bridge.qa.match import Reference
from agent_bridge.qa.refs import RefStore
from agent_bridge.qa.waits import QaOptions
from agent_bridge.runtime import BackgroundServer
from agent_bridge.server import create_app
from orchestrator.display.fake import FakeDisplay

TOKEN = "async-qa-token-0123456789"


@pytest.fixture
def server_url(tmp_path: Path) -> Iterator[str]:
    manager, settings = _fake_manager(tmp_path, capture_off=False)
    with BackgroundServer(create_app(manager, token=TOKEN, settings=settings)) as server:
        yield server.url


def _line(typed: str) -> Reference:
    display = FakeDisplay(1280, 800)
    display.type_text(typed)
    pixels = np.asarray(display.screendump().convert("RGB"), dtype=np.uint8)
    return Reference(f"line:{typed}", np.ascontiguousarray(pixels[100:120, 160:400]))


def test_async_session_waits_clicks_and_reads(server_url: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            AsyncClient(server_url, TOKEN) as client,
            await client.create_session() as session,
        ):
            session.qa = QaOptions(refs=RefStore(tmp_path), poll_s=0.05)
            assert await session.exists(_line("hello")) is None
            async with session.expect_change(region=(160, 100, 640, 130)) as watch:
                await session.type("hello")
            assert watch.change is not None
            match = await session.wait_for(_line("hello"), timeout_s=5)
            assert (match.box.x, match.box.y) == (160, 100) and match.t_s is not None
            clicked = await session.click(match)
            assert await session.cursor_position() == (
                clicked.click_point.x,
                clicked.click_point.y,
            )
            await session.click(12, 34)
            assert await session.cursor_position() == (12, 34)
            still = await session.wait_still(for_s=0.2, timeout_s=5)
            assert still.still_s >= 0.2
            text = await session.find_text(re.compile(r"hel+o"), timeout_s=5)
            assert text.text == "hello"
            with pytest.raises(MatchTimeout):
                await session.wait_for(_line("goodbye"), timeout_s=0.3)

    asyncio.run(main())
