"""deskvm's agent side: the wire protocol, the bridge server and its Python client.

The client names are loaded on first use (PEP 562), so ``import agent_bridge`` stays cheap
and never pulls in httpx, websockets, FastAPI or libvirt::

    from agent_bridge import Client
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["BridgeConnectionError", "Client", "RemoteError", "Screenshot", "Session", "SessionInfo"]

if TYPE_CHECKING:
    from agent_bridge.client import (
        BridgeConnectionError,
        Client,
        RemoteError,
        Screenshot,
        Session,
        SessionInfo,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        from agent_bridge import client

        return getattr(client, name)
    raise AttributeError(f"module 'agent_bridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
