"""The guest control plane over REST: ``POST /v1/sessions/{id}/guest/<op>`` (scope ``exec``).

``<op>`` is one of the guest control actions (:data:`~agent_bridge.protocol.guest.GUEST_ACTIONS`:
``exec``, ``put_file``, ``get_file``, ``clipboard_get``, ``clipboard_set``, ``windows``,
``window_activate``, ``window_close``, ``a11y_tree``, ``set_resolution``); the JSON body holds
its parameters, exactly as the action WebSocket takes them (without ``action``), and the
reply is the action's ``result`` object. The request takes the same path as on the
WebSocket: rate limits, take-over, approval rules, the recording. A session created
without ``"guest_control": true`` answers ``guest_control_disabled`` (409).
"""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request

from agent_bridge.protocol.guest import GUEST_ACTIONS, parse_guest_action
from agent_bridge.protocol.results import to_deskvm_result
from agent_bridge.server.deps import Bridge, ExecPrincipal
from agent_bridge.server.errors import ERROR_RESPONSES
from agent_bridge.server.gate import control_gate, gate
from orchestrator.errors import ProtocolError

__all__ = ["MAX_BODY_BYTES", "router"]

router = APIRouter(prefix="/v1/sessions/{session_id}/guest", tags=["guest"],
                   responses=ERROR_RESPONSES)  # fmt: skip

MAX_BODY_BYTES = 1024 * 1024
"""Largest request body (as the WebSocket's message limit)."""


@router.post("/{op}")
async def guest_op(
    session_id: str, op: str, request: Request, principal: ExecPrincipal, bridge: Bridge
) -> dict[str, Any]:
    """Run one guest control action; the reply is its result object (docs/protocol.md)."""
    if op not in GUEST_ACTIONS:
        raise ProtocolError(
            f"unknown guest operation {op!r}; supported: {', '.join(sorted(GUEST_ACTIONS))}",
            code="unknown_action",
        )
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ProtocolError(f"request body over {MAX_BODY_BYTES} bytes", code="message_too_big")
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProtocolError("body must be a JSON object", code="invalid_message")
    session = bridge.manager.get(session_id)
    action = parse_guest_action(op, body)
    bridge.limits.check(session.id, [action])
    held = gate(session, bridge.desk)
    policy = bridge.takeover_policy(session.id)

    def run() -> dict[str, Any]:
        control_gate(session, action, bridge.controls, policy)
        result = session.execute(action, source="agent", gate=held, by=principal.who)
        return to_deskvm_result(result)

    reply: dict[str, Any] = await anyio.to_thread.run_sync(run)
    return reply
