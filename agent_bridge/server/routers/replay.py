"""The replay viewer's routes over this server's recordings (see :mod:`agent_bridge.viewer`).

The recording list needs the server's admin token (or its cookie); one recording may also
be read with a ``view`` credential of its session.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter

from agent_bridge.server.deps import recording_access, server_token
from agent_bridge.server.state import BridgeState
from agent_bridge.viewer import replay_router
from orchestrator.errors import DeskvmError

__all__ = ["router_for"]


def router_for(state: BridgeState) -> APIRouter:
    """The ``/replay`` routes over ``state.manager``'s recordings directory."""
    manager = state.manager

    def recordings() -> list[tuple[str, Path]]:
        root = manager.recordings_dir
        return sorted((p.name, p) for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def live_console(name: str) -> str | None:
        try:
            session = manager.get(name)
        except DeskvmError:
            return None
        return session.console_tail(64 * 1024) if session.state in ("starting", "ready") else None

    return replay_router(
        lambda name: manager.recordings_dir / name,
        recordings,
        data_dependencies=[server_token],
        recording_dependencies=[recording_access],
        live_console=live_console,
    )
