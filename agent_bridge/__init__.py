"""deskvm's agent side: the wire protocol, the bridge server and its Python clients.

The client names are loaded on first use (PEP 562), so ``import agent_bridge`` stays cheap
and never pulls in httpx, websockets, FastAPI or libvirt::

    from agent_bridge import Client          # synchronous
    from agent_bridge import AsyncClient     # asyncio
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "AsyncClient",
    "AsyncFrameStream",
    "AsyncSession",
    "BridgeConnectionError",
    "Client",
    "FrameStream",
    "RemoteError",
    "Screenshot",
    "Session",
    "SessionInfo",
    "StreamFrame",
]
_ASYNC = ("AsyncClient", "AsyncFrameStream", "AsyncSession")

if TYPE_CHECKING:
    from agent_bridge.async_client import AsyncClient, AsyncFrameStream, AsyncSession
    from agent_bridge.client import (
        BridgeConnectionError,
        Client,
        FrameStream,
        RemoteError,
        Screenshot,
        Session,
        SessionInfo,
        StreamFrame,
    )


def __getattr__(name: str) -> Any:
    if name in _ASYNC:
        from agent_bridge import async_client

        return getattr(async_client, name)
    if name in __all__:
        from agent_bridge import client

        return getattr(client, name)
    raise AttributeError(f"module 'agent_bridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
