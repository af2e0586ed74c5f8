"""Take-over: ``GET /v1/sessions/{id}/control`` and the control WebSocket (control scope).

On ``/v1/sessions/{id}/control`` a person sends ``{"id", "op": "take_over"}``: from then on
the agent's input actions are held as the session's take-over policy says (refused with
``human_in_control``, or waiting), and the person's own deskvm actions (``{"id", "action":
...}``, as on the action socket) go to the guest, recorded with ``source: human`` and
``by`` (``admin`` or ``token:<id>``). ``{"id", "op": "hand_back"}`` gives the session back;
so does closing the socket. Replies use the action socket's envelope.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, WebSocket
from pydantic import BaseModel, Field
from starlette.websockets import WebSocketDisconnect

from agent_bridge.protocol.messages import ClientId, decode_envelope, encode_error, encode_result
from agent_bridge.protocol.results import to_deskvm_result
from agent_bridge.server.deps import (
    Bridge,
    Principal,
    SessionDep,
    SessionGuard,
    unknown_query,
)
from agent_bridge.server.errors import ERROR_RESPONSES
from agent_bridge.server.gate import check_scope
from agent_bridge.server.models import ControlInfo, TakeoverPolicyModel
from agent_bridge.server.sockets import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY_VIOLATION,
    MAX_MESSAGE_BYTES,
    SUBPROTOCOL,
    close_reason,
    offered_subprotocols,
    ready_session,
    refuse,
    revoked_error,
    ws_principal,
)
from agent_bridge.server.state import BridgeState
from agent_bridge.server.vocabulary import Vocabulary, load_vocabulary
from orchestrator.errors import ActionError, DeskvmError, ProtocolError
from orchestrator.session import Session

__all__ = ["router"]

log = logging.getLogger("deskvm.bridge")

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["control"])


class ControlStatus(BaseModel):
    """``GET /v1/sessions/{id}/control``."""

    holder: ControlInfo | None = Field(description="null: the agent drives")
    policy: TakeoverPolicyModel


@router.get(
    "/control",
    response_model=ControlStatus,
    dependencies=[Depends(SessionGuard("view"))],
    responses=ERROR_RESPONSES,
)
async def get_control(session: SessionDep, bridge: Bridge) -> ControlStatus:
    """Who has taken the session over, and what the agent's actions get meanwhile."""
    return ControlStatus(
        holder=ControlInfo.of(bridge.controls.holder(session.id)),
        policy=TakeoverPolicyModel.of(bridge.takeover_policy(session.id)),
    )


@router.websocket("/control")
async def control_ws(websocket: WebSocket, session_id: str, bridge: Bridge) -> None:
    """A person's take-over: see the module docstring."""
    principal = await ws_principal(websocket, bridge, session_id, "control")
    if principal is None:
        return
    offered = offered_subprotocols(websocket)
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    error = unknown_query(websocket.query_params.keys(), ())
    if error is not None:
        await refuse(websocket, error, CLOSE_POLICY_VIOLATION)
        return
    session = await ready_session(websocket, bridge, session_id)
    if session is None:
        return
    handle = secrets.token_hex(8)
    try:
        holder = ControlInfo.of(bridge.controls.holder(session.id))
        await websocket.send_json(
            {"event": "hello", "holder": None if holder is None else holder.model_dump(mode="json")}
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_end, websocket, bridge, session, principal, tg.cancel_scope)
            await _serve(websocket, bridge, session, principal, handle)
            tg.cancel_scope.cancel()
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        with anyio.CancelScope(shield=True):
            _hand_back(bridge, session, handle, reason="disconnected")
            with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
                await websocket.close(1000, reason="bye")


async def _watch_end(
    websocket: WebSocket,
    bridge: BridgeState,
    session: Session,
    principal: Principal,
    scope: anyio.CancelScope,
) -> None:
    while session.state == "ready":
        revoked = revoked_error(bridge, principal)
        if revoked is not None:
            await refuse(websocket, revoked, CLOSE_POLICY_VIOLATION)
            scope.cancel()
            return
        await anyio.sleep(0.25)
    with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
        reason = session.closed_reason or session.state
        await websocket.close(CLOSE_GOING_AWAY, reason=close_reason(f"session ended: {reason}"))
    scope.cancel()


def _hand_back(bridge: BridgeState, session: Session, handle: str, *, reason: str) -> bool:
    control = bridge.controls.hand_back(session.id, handle)
    if control is None:
        return False
    with contextlib.suppress(DeskvmError):
        session.recorder.append(
            "marker", {"event": "hand_back", "by": control.holder, "reason": reason},
            source="human",
        )  # fmt: skip
    log.info("session %s handed back by %s (%s)", session.id, control.holder, reason)
    return True


async def _serve(
    websocket: WebSocket, bridge: BridgeState, session: Session, principal: Principal, handle: str
) -> None:
    vocabulary = load_vocabulary("deskvm")
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        text = message.get("text")
        if text is None or len(text) > MAX_MESSAGE_BYTES:
            await websocket.send_text(
                encode_error(None, ProtocolError("send JSON text messages", code="invalid_message"))
            )
            continue
        revoked = revoked_error(bridge, principal)
        if revoked is not None:
            await refuse(websocket, revoked, CLOSE_POLICY_VIOLATION)
            return
        client_id: ClientId = None
        try:
            envelope = decode_envelope(text)
            client_id = envelope.id
            body = dict(envelope.body)
            op = body.pop("op", None)
            if op is not None:
                if body:
                    raise ProtocolError(
                        f"op {op!r} takes no other members, got {', '.join(sorted(body))}",
                        code="invalid_message",
                    )
                reply = _op(bridge, session, principal, handle, op)
            else:
                reply = await _human_action(bridge, session, principal, handle, vocabulary, body)
            await websocket.send_text(encode_result(client_id, reply))
        except DeskvmError as exc:
            await websocket.send_text(encode_error(client_id, exc))


def _op(
    bridge: BridgeState, session: Session, principal: Principal, handle: str, op: object
) -> dict[str, Any]:
    if op == "take_over":
        before = bridge.controls.holder(session.id)
        control = bridge.controls.take(session.id, principal.who, handle)
        if before is None:
            with contextlib.suppress(DeskvmError):
                session.recorder.append(
                    "marker", {"event": "take_over", "by": principal.who}, source="human"
                )
            log.info("session %s taken over by %s", session.id, principal.who)
        info = ControlInfo.of(control)
        assert info is not None
        return {"holder": info.model_dump(mode="json")}
    if op == "hand_back":
        if not _hand_back(bridge, session, handle, reason="handed back"):
            raise ActionError("this connection does not hold the session", code="not_in_control")
        return {"holder": None}
    raise ProtocolError(
        f"unknown op {op!r}; the control socket takes take_over, hand_back or a deskvm action",
        code="unknown_action",
    )


async def _human_action(
    bridge: BridgeState,
    session: Session,
    principal: Principal,
    handle: str,
    vocabulary: Vocabulary,
    body: dict[str, Any],
) -> dict[str, Any]:
    control = bridge.controls.holder(session.id)
    if control is None or control.handle != handle:
        raise ActionError(
            'take the session over first ({"op": "take_over"})', code="not_in_control"
        )
    actions = vocabulary.parse(body)
    check_scope(principal.scope, actions)
    bridge.limits.check(session.id, actions)

    def run() -> dict[str, Any]:
        result = None
        for action in actions:
            result = session.execute(action, source="human", by=principal.who)
        return to_deskvm_result(result) if result is not None else {}

    reply: dict[str, Any] = await anyio.to_thread.run_sync(run)
    return reply
