"""Human approval: the session's approval policy, the actions held for a decision
(``/pending``), and the operator WebSocket that pushes them as they come.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time

import anyio
from fastapi import APIRouter, Depends, Response, WebSocket
from starlette.websockets import WebSocketDisconnect

from agent_bridge.protocol.actions import action_to_dict
from agent_bridge.server.deps import (
    AdminPrincipal,
    BaseUrl,
    Bridge,
    SessionDep,
    SessionGuard,
)
from agent_bridge.server.errors import ERROR_RESPONSES
from agent_bridge.server.models import ApprovalPolicyModel, DecisionRequest, PendingInfo
from agent_bridge.server.sockets import SUBPROTOCOL, offered_subprotocols, ws_principal
from orchestrator.approval import ApprovalDesk, ApprovalPolicy
from orchestrator.errors import DeskvmError

__all__ = ["router"]

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["approvals"],
                   responses=ERROR_RESPONSES)  # fmt: skip


@router.get(
    "/approval-policy",
    response_model=ApprovalPolicyModel,
    dependencies=[Depends(SessionGuard("admin"))],
)
async def get_policy(session: SessionDep, bridge: Bridge) -> ApprovalPolicyModel:
    """The session's approval policy (empty: nothing is held)."""
    return ApprovalPolicyModel.of(session.approval_policy or ApprovalPolicy())


@router.put("/approval-policy", response_model=ApprovalPolicyModel)
async def put_policy(
    session_id: str, body: ApprovalPolicyModel, principal: AdminPrincipal, bridge: Bridge
) -> ApprovalPolicyModel:
    """Replace the session's approval policy (recorded with who set it)."""
    session = bridge.manager.get(session_id)
    policy = body.to_policy()
    session.approval_policy = None if policy.empty else policy
    with contextlib.suppress(DeskvmError):
        session.recorder.append(
            "approval",
            {"event": "policy", "policy": body.model_dump(), "by": principal.who},
            source="human",
        )
    return ApprovalPolicyModel.of(policy)


@router.get(
    "/pending", response_model=list[PendingInfo], dependencies=[Depends(SessionGuard("admin"))]
)
async def list_pending(session_id: str, bridge: Bridge, base_url: BaseUrl) -> list[PendingInfo]:
    """Actions of this session waiting for a decision, oldest first."""
    return [PendingInfo.of(p, base_url) for p in bridge.desk.pending(session_id)]


@router.get(
    "/pending/{pending_id}/frame",
    response_class=Response,
    dependencies=[Depends(SessionGuard("admin"))],
    responses={200: {"content": {"image/png": {}}}},
)
async def pending_frame(session_id: str, pending_id: str, bridge: Bridge) -> Response:
    """The screen (PNG) when the action was held."""
    for item in bridge.desk.pending(session_id):
        if item.pending_id == pending_id:
            return Response(item.frame_png, media_type="image/png")
    raise DeskvmError(f"no pending action {pending_id!r}", code="pending_not_found")


@router.post("/pending/{pending_id}", response_model=PendingInfo)
async def decide(
    session_id: str,
    pending_id: str,
    body: DecisionRequest,
    principal: AdminPrincipal,
    bridge: Bridge,
    base_url: BaseUrl,
) -> PendingInfo:
    """Approve or deny a held action (404 ``pending_not_found`` once decided/expired)."""
    desk = bridge.desk
    if not any(p.pending_id == pending_id for p in desk.pending(session_id)):
        raise DeskvmError(f"no pending action {pending_id!r}", code="pending_not_found")
    item = desk.decide(pending_id, body.decision, by=principal.who)
    return PendingInfo.of(item, base_url)


@router.websocket("/operator")
async def operator_ws(websocket: WebSocket, session_id: str, bridge: Bridge) -> None:
    """Operators: pending actions pushed as they come; decisions sent back."""
    principal = await ws_principal(websocket, bridge, session_id, "admin")
    if principal is None:
        return
    # Browsers offer deskvm.v1 and refuse a handshake that names no subprotocol.
    offered = offered_subprotocols(websocket)
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    await _operate(websocket, bridge.desk, session_id, principal.who)


async def _operate(websocket: WebSocket, desk: ApprovalDesk, session_id: str, who: str) -> None:
    """The operator WebSocket: ``{"event": "pending", ...}`` with the frame (base64 PNG) for
    each new held action, ``{"event": "resolved", "pending_id"}`` when it leaves the queue;
    the operator sends ``{"pending_id", "decision": "approve"|"deny"}`` and gets
    ``{"event": "decided", ...}`` or ``{"event": "error", ...}`` back.
    """
    seen: set[str] = set()

    async def push() -> None:
        while True:
            current = {p.pending_id: p for p in desk.pending(session_id)}
            for pending_id, item in current.items():
                if pending_id not in seen:
                    seen.add(pending_id)
                    await websocket.send_json(
                        {
                            "event": "pending",
                            "pending_id": pending_id,
                            "action": action_to_dict(item.action),
                            "reason": item.reason,
                            "seconds_left": round(
                                max(0.0, (item.deadline_ns - time.monotonic_ns()) / 1e9), 3
                            ),
                            "frame_png_b64": base64.b64encode(item.frame_png).decode(),
                        }
                    )
            for pending_id in [p for p in seen if p not in current]:
                seen.discard(pending_id)
                await websocket.send_json({"event": "resolved", "pending_id": pending_id})
            await anyio.sleep(0.05)

    async def receive() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                body = json.loads(message.get("text") or "")
                pending_id = str(body["pending_id"])
                if not any(p.pending_id == pending_id for p in desk.pending(session_id)):
                    raise DeskvmError(
                        f"no pending action {pending_id!r} on this session",
                        code="pending_not_found",
                    )
                item = desk.decide(pending_id, body["decision"], by=who)
            except (ValueError, KeyError, TypeError) as exc:
                await websocket.send_json({"event": "error", "message": f"bad message: {exc}"})
                continue
            except DeskvmError as exc:
                await websocket.send_json(
                    {"event": "error", "code": exc.code, "message": exc.message}
                )
                continue
            await websocket.send_json(
                {"event": "decided", "pending_id": item.pending_id, "decision": item.decision}
            )

    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        async with anyio.create_task_group() as tg:

            async def pusher() -> None:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await push()

            tg.start_soon(pusher)
            await receive()
            tg.cancel_scope.cancel()
