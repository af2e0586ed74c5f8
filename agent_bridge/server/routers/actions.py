"""The action WebSocket ``/v1/sessions/{id}/ws``: one request in, one reply out, in order.

Query parameters: ``schema`` (action vocabulary, default ``deskvm``), ``on_disconnect``
(``keep`` or ``delete``), ``scale_to=WxH`` or ``max_long_edge=N`` (screenshot scaling; the
client's coordinates are then in that space), ``images`` (``base64``, default, or
``binary``: replies with images are binary messages, see
:mod:`agent_bridge.protocol.replies`). Any request may carry ``screenshot_after``.
Requests are parsed by the pure :mod:`agent_bridge.protocol` layer, checked against the
token's scope, the session's rate limits and approval policy, and executed by
:meth:`orchestrator.session.Session.execute` in a worker thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, WebSocket
from PIL import Image
from starlette.websockets import WebSocketDisconnect, WebSocketState

from agent_bridge.protocol.actions import Action, Screenshot, Type
from agent_bridge.protocol.messages import ClientId, decode_envelope, encode_error, encode_result
from agent_bridge.protocol.replies import (
    ScreenshotAfter,
    encode_binary_reply,
    split_screenshot_after,
)
from agent_bridge.protocol.results import CursorResult, ImageResult, Result, to_deskvm_result
from agent_bridge.protocol.scaling import Scaler, scale_action
from agent_bridge.server.deps import ADMIN, Bridge, Principal, unknown_query
from agent_bridge.server.gate import OBSERVATIONS, check_scope, control_gate, gate
from agent_bridge.server.ratelimit import RateLimits
from agent_bridge.server.sockets import (
    CLOSE_GOING_AWAY,
    CLOSE_MESSAGE_TOO_BIG,
    CLOSE_POLICY_VIOLATION,
    CLOSE_SESSION_NOT_FOUND,
    CLOSE_TRY_AGAIN_LATER,
    MAX_MESSAGE_BYTES,
    SUBPROTOCOL,
    close_reason,
    offered_subprotocols,
    revoked_error,
    ws_principal,
)
from agent_bridge.server.state import BridgeState
from agent_bridge.server.vocabulary import Vocabulary, load_vocabulary
from orchestrator.errors import (
    ActionError,
    DeskvmError,
    ProtocolError,
    SessionClosed,
    SessionNotFound,
)
from orchestrator.session import Session, SessionState, encode_png
from orchestrator.spec import MAX_DISPLAY_PX

__all__ = ["WS_QUERY_PARAMS", "router"]

log = logging.getLogger("deskvm.bridge")

router = APIRouter(tags=["actions"])

WS_QUERY_PARAMS = frozenset({"schema", "on_disconnect", "scale_to", "max_long_edge", "images"})
"""The action WebSocket's query parameters; any other is refused (``invalid_query``), so a
typo such as ``?schem=openai`` never silently gives the deskvm vocabulary."""
_STATE_POLL_S = 0.2
_ENDED: frozenset[SessionState] = frozenset({"closing", "closed", "failed"})
_OBSERVATIONS = OBSERVATIONS
_FLOOD_STRIKES = 10
"""Rate-limited messages in a row after which a WebSocket is closed (1008)."""


@router.websocket("/v1/sessions/{session_id}/ws")
async def session_ws(websocket: WebSocket, session_id: str, bridge: Bridge) -> None:
    """Actions in, results out (see docs/protocol.md); view scope may only observe."""
    principal = await ws_principal(websocket, bridge, session_id, "view")
    if principal is None:
        return
    offered = offered_subprotocols(websocket)
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    desk, controls = bridge.desk, bridge.controls
    connection = _Connection(websocket, bridge, session_id)
    connection.principal = principal
    connection.limits = bridge.limits
    connection.gate = lambda session: gate(session, desk, controls)

    def control(session: Session, action: Action) -> None:
        control_gate(session, action, controls, bridge.takeover_policy(session.id))

    connection.control = control
    await connection.run()


class _Connection:
    """One WebSocket connection to one session: read a request, run it, reply; in order."""

    def __init__(self, websocket: WebSocket, bridge: BridgeState, session_id: str) -> None:
        self.ws = websocket
        self.bridge = bridge
        self.manager = bridge.manager
        self.session_id = session_id
        self._send_lock = anyio.Lock()
        self._closed = False
        self.principal: Principal = ADMIN
        self.limits: RateLimits | None = None
        self.gate: Callable[[Session], Callable[[Action, str], None]] | None = None
        self.control: Callable[[Session, Action], None] | None = None
        self.scaler: Scaler | None = None
        self._scale_query: tuple[str | None, str | None] = (None, None)
        self._scaled_for: tuple[int, int] = (0, 0)
        self.binary = False
        self._strikes = 0

    async def _send(self, message: str | bytes) -> bool:
        """Send one text (or binary) message; ``False`` if the connection is gone."""
        async with self._send_lock:
            if self._closed:
                return False
            try:
                if isinstance(message, bytes):
                    await self.ws.send_bytes(message)
                else:
                    await self.ws.send_text(message)
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._closed = True
                return False
            return True

    async def _close(self, code: int, reason: str) -> None:
        async with self._send_lock:
            if self._closed:
                return
            self._closed = True
            if self.ws.application_state != WebSocketState.DISCONNECTED:
                with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
                    await self.ws.close(code, reason=close_reason(reason))

    async def _refuse(self, error: DeskvmError, close_code: int) -> None:
        """Send one error reply (``id`` null) explaining why, then close."""
        await self._send(encode_error(None, error))
        await self._close(close_code, f"{error.code}: {error.message}")

    async def run(self) -> None:
        query = self.ws.query_params
        unknown = unknown_query(query.keys(), WS_QUERY_PARAMS)
        if unknown is not None:
            await self._refuse(unknown, CLOSE_POLICY_VIOLATION)
            return
        on_disconnect = query.get("on_disconnect", "keep")
        if on_disconnect not in ("keep", "delete"):
            await self._refuse(
                ProtocolError(
                    f"on_disconnect must be 'keep' or 'delete', not {on_disconnect!r}",
                    code="invalid_query",
                ),
                CLOSE_POLICY_VIOLATION,
            )
            return
        try:
            vocabulary = load_vocabulary(query.get("schema", "deskvm"))
            images = query.get("images", "base64")
            if images not in ("base64", "binary"):
                raise ProtocolError(
                    f"images must be 'base64' or 'binary', not {images!r}", code="invalid_query"
                )
            if images == "binary" and getattr(vocabulary, "name", "deskvm") != "deskvm":
                raise ProtocolError(
                    "images=binary is for schema=deskvm (vendor schemas keep their own result"
                    " shapes)",
                    code="invalid_query",
                )
            self.binary = images == "binary"
            session = self.manager.get(self.session_id)
            self._scale_query = (query.get("scale_to"), query.get("max_long_edge"))
            self._rescale(session)
        except ProtocolError as exc:
            await self._refuse(exc, CLOSE_POLICY_VIOLATION)
            return
        except SessionNotFound as exc:
            await self._refuse(exc, CLOSE_SESSION_NOT_FOUND)
            return
        if session.state != "ready":
            if session.state in ("new", "starting"):
                await self._refuse(
                    SessionClosed(
                        f"session {session.id} is {session.state}; retry when ready",
                        code="session_not_ready",
                    ),
                    CLOSE_TRY_AGAIN_LATER,
                )
            else:
                # Ended: said as the watcher says it to an open connection, so a client
                # reports the same "session X ended: <reason>" either way.
                reason = session.closed_reason or session.state
                await self._send(
                    encode_error(None, SessionClosed(f"session {session.id} ended: {reason}"))
                )
                await self._close(CLOSE_GOING_AWAY, f"session ended: {reason}")
            return
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_session, session, tg.cancel_scope)
                try:
                    await self._serve(session, vocabulary)
                except Exception:
                    log.exception("WebSocket of session %s failed", session.id)
                    await self._close(1011, "internal_error")
                finally:
                    tg.cancel_scope.cancel()
        finally:
            # Shielded: a cancelled connection (server shutdown, test client exit) must still
            # honour on_disconnect=delete.
            with anyio.CancelScope(shield=True):
                await self._close(1000, "bye")
                if on_disconnect == "delete":
                    await self.bridge.delete_quietly(session.id, "client disconnected")

    async def _watch_session(self, session: Session, scope: anyio.CancelScope) -> None:
        while session.state not in _ENDED:
            revoked = revoked_error(self.bridge, self.principal)
            if revoked is not None:
                await self._refuse(revoked, CLOSE_POLICY_VIOLATION)
                scope.cancel()
                return
            await anyio.sleep(_STATE_POLL_S)
        reason = session.closed_reason or session.state
        await self._close(CLOSE_GOING_AWAY, f"session ended: {reason}")
        scope.cancel()

    async def _serve(self, session: Session, vocabulary: Vocabulary) -> None:
        while True:
            message = await self.ws.receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                self._closed = True
                return
            if kind != "websocket.receive":
                continue
            text: str | None = message.get("text")
            if text is None:
                size = len(message.get("bytes") or b"")
                if size > MAX_MESSAGE_BYTES:
                    await self._close(CLOSE_MESSAGE_TOO_BIG, "message_too_big")
                    return
                error = ProtocolError(
                    "binary frames are not supported; send JSON text messages",
                    code="binary_not_supported",
                )
                if not await self._send(encode_error(None, error)):
                    return
                continue
            if len(text) > MAX_MESSAGE_BYTES // 4 and len(text.encode()) > MAX_MESSAGE_BYTES:
                await self._close(
                    CLOSE_MESSAGE_TOO_BIG, f"message_too_big: limit {MAX_MESSAGE_BYTES} bytes"
                )
                return
            revoked = revoked_error(self.bridge, self.principal)
            if revoked is not None:
                await self._refuse(revoked, CLOSE_POLICY_VIOLATION)
                return
            if not await self._send(await self._handle(session, vocabulary, text)):
                return
            if self._strikes >= _FLOOD_STRIKES:
                log.warning("closing a flooding WebSocket of session %s", session.id)
                await self._close(
                    CLOSE_POLICY_VIOLATION, f"rate_limited: {_FLOOD_STRIKES} messages over limit"
                )
                return
            if session.state in _ENDED:
                reason = session.closed_reason or session.state
                await self._close(CLOSE_GOING_AWAY, f"session ended: {reason}")
                return

    def _rescale(self, session: Session) -> None:
        """The connection's scaling for the session's display as it is now (a resolution
        change while connected moves the mapping with it).

        Raises:
            ProtocolError: ``invalid_query`` (the connection's scaling parameters).
        """
        size = (session.spec.display.width_px, session.spec.display.height_px)
        if size != self._scaled_for:
            self.scaler = _scaler_from_query(*self._scale_query, *size)
            self._scaled_for = size

    async def _handle(self, session: Session, vocabulary: Vocabulary, text: str) -> str | bytes:
        """One request in, one reply out (never raises for a bad request)."""
        client_id: ClientId = None
        try:
            self._rescale(session)
            envelope = decode_envelope(text)
            client_id = envelope.id
            body, after = split_screenshot_after(envelope.body)
            actions = vocabulary.parse(body)
            check_scope(self.principal.scope, actions)
            if self.limits is not None:
                try:
                    self.limits.check(session.id, actions)
                except DeskvmError:
                    self._strikes += 1
                    raise
            self._strikes = 0
            # The recording keeps vendor-shaped requests as received; deskvm ones are the
            # action itself.
            raw = None if getattr(vocabulary, "name", "deskvm") == "deskvm" else body
            gate_fn, control, scaler = self.gate, self.control, self.scaler
            limits = self.limits
            refund = None if limits is None else (lambda n: limits.refund(session.id, n))
            results = await anyio.to_thread.run_sync(
                lambda: _execute_all(
                    session, actions, raw, gate_fn, scaler, refund=refund, control=control
                )
            )
            settled = None
            if after is not None:
                settled = await anyio.to_thread.run_sync(
                    lambda: _screenshot_after(session, after, scaler)
                )
            return self._reply(client_id, vocabulary, body, results, settled)
        except DeskvmError as exc:
            if client_id is None:
                client_id = getattr(exc, "client_id", None)
            return encode_error(client_id, exc)
        except Exception:
            log.exception("unexpected error handling a message for session %s", session.id)
            return json.dumps(
                {
                    "id": client_id,
                    "ok": False,
                    "error": {"code": "internal_error", "message": "internal server error"},
                }
            )

    def _reply(
        self,
        client_id: ClientId,
        vocabulary: Vocabulary,
        body: Mapping[str, Any],
        results: Sequence[Result],
        settled: tuple[ImageResult, bool, int] | None,
    ) -> str | bytes:
        """The success reply: JSON text, or one binary message when images go as blobs."""
        blobs: list[bytes] = []

        def image(result: ImageResult) -> dict[str, Any]:
            if not self.binary:
                return to_deskvm_result(result)
            blobs.append(result.data)
            out: dict[str, Any] = {"width": result.width_px, "height": result.height_px,
                                   "mime": result.mime, "blob": len(blobs) - 1}  # fmt: skip
            if result.frame_seq is not None:
                out["frame_seq"] = result.frame_seq
            if result.t_s is not None:
                out["t_s"] = result.t_s
            return out

        last = results[-1] if results else None
        if self.binary and isinstance(last, ImageResult):
            result = image(last)
        else:
            result = vocabulary.format_result(body, results)
        if settled is None and not blobs:
            return encode_result(client_id, result)
        reply: dict[str, Any] = {"id": client_id, "ok": True, "result": result}
        if settled is not None:
            shot, ok, waited_ms = settled
            reply["screenshot_after"] = {
                **image(shot), "settled": ok, "waited_ms": waited_ms, "frame_seq": shot.frame_seq,
            }  # fmt: skip
        if blobs:
            return encode_binary_reply(reply, blobs)
        return json.dumps(reply)


def _screenshot_after(
    session: Session, after: ScreenshotAfter, scaler: Scaler | None
) -> tuple[ImageResult, bool, int]:
    shot, settled, waited_ms = session.screenshot_after(after.still_ms, after.timeout_ms)
    if scaler is not None:
        scaled = _scale_result(Screenshot(), shot, scaler)
        assert isinstance(scaled, ImageResult)
        shot = scaled
    return shot, settled, waited_ms


def _execute_all(
    session: Session,
    actions: Sequence[Action],
    raw: Mapping[str, Any] | None,
    gate_fn: Callable[[Session], Callable[[Action, str], None]] | None = None,
    scaler: Scaler | None = None,
    refund: Callable[[int], None] | None = None,
    control: Callable[[Session, Action], None] | None = None,
) -> list[Result]:
    if scaler is not None:
        # Client pixels -> display pixels, all before the first action runs, so a batch
        # with a point outside the scaled screenshot runs nothing.
        actions = [scale_action(a, scaler) for a in actions]
    results = []
    # The session checks its policy (with its recent typed text) and holds the action
    # under its action lock; the gate raises ApprovalDenied / ApprovalTimeout.
    held = gate_fn(session) if gate_fn is not None else None
    for i, action in enumerate(actions):
        try:
            if control is not None:
                control(session, action)  # a person's take-over: raises or waits
            result = session.execute(action, source="agent", raw=raw, gate=held)
        except DeskvmError as exc:
            if refund is not None:
                # Refused actions (ActionError: nothing injected) and those never reached
                # give their typed characters back to the rate limit.
                unrun = actions[i:] if isinstance(exc, ActionError) else actions[i + 1 :]
                refund(sum(len(a.text) for a in unrun if isinstance(a, Type)))
            raise
        results.append(result if scaler is None else _scale_result(action, result, scaler))
    return results


def _scaler_from_query(
    scale_to: str | None, max_long_edge: str | None, width_px: int, height_px: int
) -> Scaler | None:
    """The connection's screenshot scaling from its URL query (``None``: no scaling).

    ``scale_to=WxH`` sends screenshots of exactly ``W``x``H`` pixels; ``max_long_edge=N``
    shrinks them (keeping the aspect ratio, never enlarging) so the long edge is at most
    ``N`` pixels. Coordinates the client sends are then in that space.

    Raises:
        ProtocolError: code ``invalid_query`` (both given, malformed, out of range).
    """
    if scale_to is None and max_long_edge is None:
        return None
    if scale_to is not None and max_long_edge is not None:
        raise ProtocolError("give scale_to=WxH or max_long_edge=N, not both", code="invalid_query")
    lo, hi = 16, MAX_DISPLAY_PX
    try:
        if scale_to is not None:
            w_text, sep, h_text = scale_to.partition("x")
            if not sep or not w_text.isdigit() or not h_text.isdigit():
                raise ValueError(scale_to)
            size = (int(w_text), int(h_text))
            if not all(lo <= v <= hi for v in size):
                raise ValueError(scale_to)
            return Scaler(width_px, height_px, *size)
        assert max_long_edge is not None
        if not max_long_edge.isdigit() or not lo <= int(max_long_edge) <= hi:
            raise ValueError(max_long_edge)
        return Scaler.for_max_long_edge(width_px, height_px, int(max_long_edge))
    except ValueError:
        given = f"scale_to={scale_to}" if scale_to is not None else f"max_long_edge={max_long_edge}"
        raise ProtocolError(
            f"scale_to must be WxH and max_long_edge N, each {lo}..{hi} pixels; got {given}",
            code="invalid_query",
        ) from None


def _scale_result(action: Action, result: Result, scaler: Scaler) -> Result:
    """A result in the client's space: screenshots resized, the pointer position mapped.

    ``zoom`` crops stay at full display resolution (that is what zoom is for).
    """
    if scaler.is_identity:
        return result
    match result:
        case ImageResult() if isinstance(action, Screenshot):
            size = (scaler.client_width_px, scaler.client_height_px)
            with Image.open(io.BytesIO(result.data)) as image:
                scaled = image.convert("RGB").resize(size, Image.Resampling.LANCZOS)
            return dataclasses.replace(
                result, width_px=size[0], height_px=size[1], data=encode_png(scaled)
            )  # same frame_seq and t_s: the scaled image shows the same recorded frame
        case CursorResult(x=x, y=y):
            return CursorResult(*scaler.to_client(x, y))
        case _:
            return result
