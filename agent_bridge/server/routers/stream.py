"""The live stream ``/v1/sessions/{id}/stream`` (view scope): changed frames as they come.

Query: ``codec`` (``jpeg``, ``webp``, ``png``; default ``jpeg``), ``quality`` (1..100,
default 80), ``max_fps`` (0 < fps <= 30, default 15), ``max_long_edge`` (16..4096, frames
shrunk to fit; default full size). Anything else is refused (``invalid_query`` naming it).

The socket first sends a text ``{"event": "hello", ...}``, then one binary message per
frame (header + image, :mod:`agent_bridge.protocol.stream`) and text ``{"event":
"status", ...}`` whenever the session's status changes. Nothing is sent while the screen
is still. Each viewer holds one frame slot: a slow viewer skips to the newest frame and
never makes the server queue. All viewers of a session share its capture loop
(:class:`orchestrator.capture.FrameCapture`) and each frame's encodings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from agent_bridge.protocol.stream import (
    FLAG_FIRST,
    HEADER_BYTES,
    STREAM_VERSION,
    FrameHeader,
    StreamParams,
    encode_frame,
    parse_stream_query,
)
from agent_bridge.server.deps import Bridge, Principal
from agent_bridge.server.models import ControlInfo
from agent_bridge.server.sockets import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY_VIOLATION,
    SUBPROTOCOL,
    close_reason,
    offered_subprotocols,
    ready_session,
    refuse,
    revoked_error,
    ws_principal,
)
from agent_bridge.server.state import BridgeState
from orchestrator.capture import Viewer
from orchestrator.errors import ProtocolError, SessionClosed
from orchestrator.session import Session

__all__ = ["router", "status_of"]

log = logging.getLogger("deskvm.bridge")

router = APIRouter(tags=["stream"])

_STATUS_POLL_S = 0.25
_ENDED = ("closing", "closed", "failed")


def status_of(bridge: BridgeState, session: Session) -> dict[str, Any]:
    """The ``status`` event of a session: ``{"event", "state", "closed_reason",
    "pending", "control"}`` (``pending``: actions waiting for an operator; ``control``:
    ``{"holder", "since"}`` while a person has taken over, else null)."""
    control = ControlInfo.of(bridge.controls.holder(session.id))
    return {
        "event": "status",
        "state": session.state,
        "closed_reason": session.closed_reason,
        "pending": len(bridge.desk.pending(session.id)),
        "control": None if control is None else control.model_dump(mode="json"),
    }


@router.websocket("/v1/sessions/{session_id}/stream")
async def stream(websocket: WebSocket, session_id: str, bridge: Bridge) -> None:
    """Changed frames of the session's screen, pushed as they come (see the module doc)."""
    principal = await ws_principal(websocket, bridge, session_id, "view")
    if principal is None:
        return
    offered = offered_subprotocols(websocket)
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    try:
        params = parse_stream_query(websocket.query_params.multi_items())
    except ProtocolError as exc:
        await refuse(websocket, exc, CLOSE_POLICY_VIOLATION)
        return
    session = await ready_session(websocket, bridge, session_id)
    if session is None:
        return
    capture = session.frames
    if capture is None:
        await refuse(websocket, SessionClosed(f"session {session.id} has ended"),
                     CLOSE_GOING_AWAY)  # fmt: skip
        return
    loop = asyncio.get_running_loop()
    arrived = asyncio.Event()

    def wake() -> None:  # called from the capture thread
        loop.call_soon_threadsafe(arrived.set)

    viewer = capture.subscribe(params.max_fps, wake)
    sender = _Sender(websocket)
    try:
        display = session.spec.display
        await sender.text(
            {
                "event": "hello",
                "session_id": session.id,
                "version": STREAM_VERSION,
                "header_bytes": HEADER_BYTES,
                "codec": params.codec,
                "quality": params.quality,
                "max_fps": params.max_fps,
                "max_long_edge": params.max_long_edge,
                "display": {"width": display.width_px, "height": display.height_px},
            }
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch, bridge, session, principal, sender, tg.cancel_scope.cancel)
            tg.start_soon(_send_frames, viewer, arrived, params, sender)
            await _drain(websocket)
            tg.cancel_scope.cancel()
    except Exception:
        log.exception("stream of session %s failed", session.id)
        await sender.close(1011, "internal_error")
    finally:
        viewer.close()
        with anyio.CancelScope(shield=True):
            await sender.close(1000, "bye")


class _Sender:
    """Serializes sends on one socket; remembers when it is gone."""

    def __init__(self, websocket: WebSocket) -> None:
        self.ws = websocket
        self.lock = anyio.Lock()
        self.gone = False

    async def text(self, event: dict[str, Any]) -> None:
        async with self.lock:
            if not self.gone:
                try:
                    await self.ws.send_json(event)
                except (WebSocketDisconnect, RuntimeError, OSError):
                    self.gone = True

    async def binary(self, data: bytes) -> None:
        async with self.lock:
            if not self.gone:
                try:
                    await self.ws.send_bytes(data)
                except (WebSocketDisconnect, RuntimeError, OSError):
                    self.gone = True

    async def close(self, code: int, reason: str) -> None:
        async with self.lock:
            if self.gone:
                return
            self.gone = True
            if self.ws.application_state != WebSocketState.DISCONNECTED:
                with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
                    await self.ws.close(code, reason=close_reason(reason))


async def _drain(websocket: WebSocket) -> None:
    """Read (and ignore) what the viewer sends until it disconnects."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return


async def _send_frames(
    viewer: Viewer, arrived: asyncio.Event, params: StreamParams, sender: _Sender
) -> None:
    period_s = 1.0 / params.max_fps
    last_sent = float("-inf")
    flags = FLAG_FIRST
    while not sender.gone:
        await arrived.wait()
        arrived.clear()
        wait_s = last_sent + period_s - time.monotonic()
        if wait_s > 0:
            await anyio.sleep(wait_s)  # frames arriving meanwhile replace the slot's
        frame = viewer.take()
        if frame is None:
            continue
        encoded = frame.cached(params.codec, params.quality, params.max_long_edge)
        if encoded is None:  # the first viewer to want it encodes it (once)
            encoded = await anyio.to_thread.run_sync(
                frame.encoded, params.codec, params.quality, params.max_long_edge
            )
        header = FrameHeader(
            frame.number, frame.pts_ns, encoded.width_px, encoded.height_px, params.codec, flags
        )
        last_sent = time.monotonic()
        await sender.binary(encode_frame(header, encoded.data))
        flags = 0


async def _watch(
    bridge: BridgeState,
    session: Session,
    principal: Principal,
    sender: _Sender,
    stop: Callable[[], None],
) -> None:
    """Push ``status`` events when they change; close (1001) when the session ends, or
    (1008, after an ``unauthorized`` error) when the viewer's token is revoked."""
    last: dict[str, Any] | None = None
    while not sender.gone:
        revoked = revoked_error(bridge, principal)
        if revoked is not None:
            error = {"code": revoked.code, "message": revoked.message}
            await sender.text({"id": None, "ok": False, "error": error})
            await sender.close(
                CLOSE_POLICY_VIOLATION, close_reason(f"{revoked.code}: {revoked.message}")
            )
            stop()
            return
        status = status_of(bridge, session)
        if status != last:
            last = status
            await sender.text(status)
        if session.state in _ENDED:
            reason = session.closed_reason or session.state
            await sender.close(CLOSE_GOING_AWAY, f"session ended: {reason}")
            stop()
            return
        await anyio.sleep(_STATUS_POLL_S)
