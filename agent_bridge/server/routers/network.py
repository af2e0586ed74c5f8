"""``GET /v1/sessions/{id}/network``: the session's egress decisions."""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Depends

from agent_bridge.server.deps import SessionDep, SessionGuard
from agent_bridge.server.errors import ERROR_RESPONSES
from agent_bridge.server.models import NetworkDecisionModel
from orchestrator.session import decision_to_json

__all__ = ["router"]

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["sessions"],
                   responses=ERROR_RESPONSES)  # fmt: skip


@router.get(
    "/network",
    response_model=list[NetworkDecisionModel],
    dependencies=[Depends(SessionGuard("view"))],
)
async def network(session: SessionDep) -> list[NetworkDecisionModel]:
    """Every egress decision of the session so far, in recording order.

    DNS answered/refused and connections allowed/dropped (with the 5-tuple); the same
    entries are in the recording as ``network`` events. Kept after the session ends;
    ``[]`` for a session without an egress policy. 502 ``egress_error`` if the
    decision logs of a live session cannot be read.
    """
    decisions = await anyio.to_thread.run_sync(session.network_decisions)
    return [NetworkDecisionModel(**decision_to_json(d)) for d in decisions]
