"""``GET /healthz``: liveness, no token needed."""

from __future__ import annotations

from fastapi import APIRouter

from agent_bridge.server.deps import Bridge
from agent_bridge.server.models import HealthResponse, WarmPoolStatus

__all__ = ["router"]

router = APIRouter(tags=["server"])


@router.get("/healthz", response_model=HealthResponse)
async def healthz(bridge: Bridge) -> HealthResponse:
    """Liveness and the warm pool's state; no token needed."""
    pool = bridge.manager.pool
    return HealthResponse(
        ok=True,
        sessions=len(bridge.manager.live()),
        warm_pool=[WarmPoolStatus(**t) for t in pool.status()] if pool is not None else [],
    )
