"""``GET /healthz``: liveness, no token needed."""

from __future__ import annotations

from fastapi import APIRouter

from agent_bridge.server.deps import Bridge
from agent_bridge.server.models import HealthResponse

__all__ = ["router"]

router = APIRouter(tags=["server"])


@router.get("/healthz", response_model=HealthResponse)
async def healthz(bridge: Bridge) -> HealthResponse:
    """Liveness; no token needed."""
    return HealthResponse(ok=True, sessions=len(bridge.manager.live()))
