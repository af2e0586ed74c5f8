"""The cluster bridge (``deskvm serve --ray ADDRESS``): places sessions with Ray, proxies
every call about a session to the node that owns it.

Bridges keep no session state: ownership is in the registry actor
(:mod:`agent_bridge.cluster.registry`), sessions live in NodeAgents
(:mod:`agent_bridge.cluster.node`), so any number of bridges serve any session and a client
of a bridge that died reconnects to another with the same token.

* ``POST /v1/sessions`` — validated as on one machine (same model); the session gets an id
  and a placement group (one bundle: a desktop slot and its memory, label selector for its
  image, egress, acceleration). If Ray places it within ``placement_timeout_s`` the create
  is forwarded to that node's bridge app; otherwise **503** ``cluster_full`` with the
  reason, before anything starts.
* ``GET /v1/sessions`` — every live node's sessions plus the ones the registry knows were
  lost.
* ``/v1/sessions/{id}[/...]`` (REST and WebSocket: actions, stream, operator) — credentials
  pre-checked here (signature, expiry, session; 401/403 as on one machine), then proxied to
  the owning node, which authorises in full. A session whose node died answers its last
  state (``closed``, ``closed_reason`` ``session_lost: ...``), ``session_lost`` (410) for
  anything else, and WebSockets close with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import httpx
import ray
from fastapi import Depends, FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from agent_bridge.cluster.capacity import (
    LABEL_ACCEL,
    LABEL_EGRESS,
    RESOURCE_DESKTOP,
    RESOURCE_MEMORY,
    image_label,
    placement_request,
)
from agent_bridge.cluster.node import PLACED_ID_HEADER
from agent_bridge.cluster.registry import LOST, PLACEMENT_PREFIX
from agent_bridge.server.deps import token_ok
from agent_bridge.server.errors import ERROR_RESPONSES, error_response, install_error_handlers
from agent_bridge.server.models import CreateSessionRequest, HealthResponse, SessionInfo
from agent_bridge.server.sockets import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY_VIOLATION,
    SUBPROTOCOL_BEARER_PREFIX,
    bearer_from_header,
    close_reason,
    offered_subprotocols,
)
from agent_bridge.tokens import TokenAuthority, TokenError
from orchestrator.errors import (
    CapacityError,
    ConfigError,
    DeskvmError,
    ImageNotFound,
    SessionClosed,
    SessionLost,
    SessionNotFound,
)
from orchestrator.settings import Settings
from orchestrator.spec import new_session_id

__all__ = ["ClusterBridge", "create_cluster_app"]

log = logging.getLogger("deskvm.cluster")

_BEARER = HTTPBearer(auto_error=False, description="the cluster's admin token or a session token")
_FORWARD = ("authorization", "content-type", "accept", "host", "user-agent")
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length"}
_NODES_TTL_S = 2.0
_LIVE = ("new", "starting", "ready")


class ClusterBridge:
    """State of one cluster bridge: the registry handle, credentials, caches.

    Args:
        registry: the registry actor's handle.
        credentials: the cluster's ``{"admin_token", "token_secret"}``.
        settings: defaults for new sessions (image, boot timeout, TTL, idle timeout,
            memory overhead) and the WebSocket Origin allowlist.
        placement_timeout_s: how long Ray may take to place a session before the create
            answers 503 ``cluster_full``.
        require_accel: place sessions only on nodes with this acceleration (``kvm``).
    """

    def __init__(
        self,
        registry: Any,
        credentials: dict[str, str],
        settings: Settings,
        *,
        placement_timeout_s: float = 2.0,
        require_accel: str | None = None,
    ) -> None:
        self.registry = registry
        self.admin_token = credentials["admin_token"]
        self.authority = TokenAuthority(
            secret=bytes.fromhex(credentials["token_secret"]),
            default_ttl_s=settings.token_ttl_s,
            max_ttl_s=settings.token_max_ttl_s,
        )
        self.settings = settings
        self.placement_timeout_s = placement_timeout_s
        self.require_accel = require_accel
        self.routes: dict[str, str] = {}  # session id -> node URL
        self._nodes: list[dict[str, Any]] = []
        self._nodes_at = 0.0
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))

    async def nodes(self, *, fresh: bool = False) -> list[dict[str, Any]]:
        """The registered nodes (cached for a couple of seconds)."""
        if fresh or time.monotonic() - self._nodes_at > _NODES_TTL_S:
            self._nodes = await self.registry.nodes.remote()
            self._nodes_at = time.monotonic()
        return self._nodes

    def precheck(self, offered: str | None, session_id: str) -> None:
        """The admin token, or a genuine session token for ``session_id`` (any scope).

        The owning node checks the scope the call needs, revocation and single use.

        Raises:
            TokenError: 401 ``unauthorized``.
        """
        if offered is None:
            raise TokenError("missing bearer token: send 'Authorization: Bearer <token>'")
        if token_ok(offered, self.admin_token):
            return
        self.authority.verify(offered, session_id=session_id, need="view")

    async def lookup(self, session_id: str) -> dict[str, Any] | None:
        record: dict[str, Any] | None = await self.registry.lookup.remote(session_id)
        if record is not None and record.get("url") and not record["ended"]:
            self.routes[session_id] = record["url"]
        return record


def _lost_error(record: dict[str, Any]) -> SessionLost:
    return SessionLost(
        f"session {record['session_id']} ended: {record.get('closed_reason') or LOST}"
    )


def _is_lost(record: dict[str, Any]) -> bool:
    return bool(record["ended"]) and str(record.get("closed_reason") or "").startswith(LOST)


def _gone(record: dict[str, Any]) -> bool:
    """Ended, and its node can no longer answer for it (lost, or the node left)."""
    return _is_lost(record) or (bool(record["ended"]) and not record.get("node_alive"))


def create_cluster_app(bridge: ClusterBridge) -> FastAPI:
    """The cluster bridge's ASGI application (see the module docstring).

    Returns:
        A FastAPI app; errors answer ``{"error": {"code", "message"}}`` as on one machine.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await bridge.http.aclose()

    app = FastAPI(
        lifespan=lifespan,
        title="deskvm cluster bridge",
        version="1",
        summary="Disposable desktop VMs across a Ray cluster (docs/scale-out.md).",
        description="Places sessions with Ray and proxies REST and WebSockets to the node "
        "that owns each session; the protocol is docs/protocol.md.",
    )
    app.state.cluster = bridge
    install_error_handlers(app)

    async def admin_only(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        offered = None if credentials is None else credentials.credentials
        if token_ok(offered, bridge.admin_token):
            return
        raise StarletteHTTPException(
            401,
            detail="missing or wrong bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def forward_headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD}

    def reply(response: httpx.Response) -> Response:
        headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP}
        return Response(response.content, status_code=response.status_code, headers=headers)

    @app.get("/healthz", response_model=HealthResponse, tags=["server"])
    async def healthz() -> HealthResponse:
        """Liveness; no token needed. ``sessions``: live sessions of the whole cluster."""
        counts = await bridge.registry.counts.remote()
        return HealthResponse(ok=True, sessions=counts["live"])

    @app.post(
        "/v1/sessions",
        status_code=201,
        response_model=SessionInfo,
        dependencies=[Depends(admin_only)],
        responses=ERROR_RESPONSES,
        tags=["sessions"],
    )
    async def create_session(request: Request, body: CreateSessionRequest) -> Response:
        """Place a session with Ray and start it on the chosen node (201 once drawn).

        Besides the one-machine errors: 503 ``cluster_full`` (no node can take it now,
        with ``Retry-After``), 503 ``no_matching_node`` (no node has the required
        acceleration), 502 ``node_unreachable``.
        """
        settings = bridge.settings
        image = body.image or settings.default_image
        nodes = await bridge.nodes(fresh=True)
        label = image_label(image)
        matching = [n for n in nodes if n["labels"].get(label) == "yes"]
        if not matching:
            offered = sorted({i for n in nodes for i in n.get("images", [])})
            raise ImageNotFound(
                f"no node of this cluster has the image {image!r} built"
                f" (offered: {', '.join(offered) or 'none'}; {len(nodes)} nodes)"
            )
        if body.egress is not None:
            matching = [n for n in matching if n["labels"].get(LABEL_EGRESS) == "yes"]
            if not matching:
                raise ConfigError(
                    f"no node with image {image!r} has an egress upstream configured, so"
                    " sessions with an egress policy cannot be placed (deskvm node"
                    " --egress-upstream-iface IFACE --egress-upstream-dns IP)",
                    code="egress_not_configured",
                )
        if bridge.require_accel is not None:
            matching = [n for n in matching if n["labels"].get(LABEL_ACCEL) == bridge.require_accel]
            if not matching:
                raise DeskvmError(
                    f"no node with image {image!r} runs {bridge.require_accel}"
                    " (this bridge requires it)",
                    code="no_matching_node",
                )
        placement = placement_request(
            image=image,
            memory_mib=body.memory_mib,
            memory_overhead_mib=settings.memory_overhead_mib,
            accel=bridge.require_accel,
            egress=body.egress is not None,
        )
        session_id = new_session_id()
        name = PLACEMENT_PREFIX + session_id
        group = await asyncio.to_thread(
            placement_group,
            [placement.bundle],
            strategy="STRICT_PACK",
            name=name,
            lifetime="detached",
            bundle_label_selector=[placement.label_selector],
        )
        # wait() asks the GCS; ready() would schedule a task into the bundle (a worker).
        if not await asyncio.to_thread(group.wait, bridge.placement_timeout_s):
            await asyncio.to_thread(remove_placement_group, group)
            raise CapacityError(
                await asyncio.to_thread(_full_reason, matching, placement.bundle, image),
                code="cluster_full",
            )
        table = await asyncio.to_thread(placement_group_table, group)
        node_id = table["bundles_to_node_id"][0]
        reserved = await bridge.registry.reserve.remote(session_id, node_id, name)
        if not reserved["ok"]:
            await asyncio.to_thread(remove_placement_group, group)
            raise DeskvmError(
                f"Ray placed the session on a node without a deskvm agent: {reserved['message']}",
                code="no_matching_node",
            )
        payload = body.model_dump(mode="json")
        payload.update(
            image=image,
            boot_timeout_s=body.boot_timeout_s or settings.boot_timeout_s,
            ttl_s=body.ttl_s or settings.session_ttl_s,
            idle_timeout_s=body.idle_timeout_s or settings.idle_timeout_s,
        )
        headers = {**forward_headers(request), PLACED_ID_HEADER: session_id}
        url = reserved["url"]
        try:
            response = await _unless_disconnected(
                request,
                bridge.http.post(
                    f"{url}/v1/sessions",
                    json=payload,
                    headers=headers,
                    timeout=httpx.Timeout(payload["boot_timeout_s"] + 60, connect=5.0),
                ),
            )
        except (httpx.HTTPError, asyncio.CancelledError) as exc:
            await bridge.registry.release.remote(session_id)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise DeskvmError(
                f"the node at {url} did not answer the create: {exc!r}", code="node_unreachable"
            ) from exc
        if response.status_code == 201:
            await bridge.registry.bind.remote(session_id, response.json())
            bridge.routes[session_id] = url
        else:
            await bridge.registry.release.remote(session_id)
        return reply(response)

    @app.get(
        "/v1/sessions",
        response_model=list[SessionInfo],
        dependencies=[Depends(admin_only)],
        responses=ERROR_RESPONSES,
        tags=["sessions"],
    )
    async def list_sessions(request: Request) -> JSONResponse:
        """Live sessions of every node first, then ended ones (lost ones included)."""
        nodes = await bridge.nodes(fresh=True)
        headers = forward_headers(request)

        async def one(node: dict[str, Any]) -> list[dict[str, Any]]:
            try:
                response = await bridge.http.get(
                    f"{node['url']}/v1/sessions", headers=headers, timeout=10.0
                )
            except httpx.HTTPError as exc:
                log.warning("listing the sessions of node %s failed: %r", node["name"], exc)
                return []
            return response.json() if response.status_code == 200 else []

        found: dict[str, dict[str, Any]] = {}
        for listing in await asyncio.gather(*(one(n) for n in nodes)):
            for item in listing:
                found[item["id"]] = item
        for record in await bridge.registry.sessions.remote():
            if _is_lost(record) and record["snapshot"] and record["session_id"] not in found:
                found[record["session_id"]] = record["snapshot"]
        items = list(found.values())
        items.sort(key=lambda s: s.get("state") not in _LIVE)
        return JSONResponse(items)

    async def session_call(request: Request, session_id: str, path: str) -> Response:
        credentials = await _BEARER(request)
        bridge.precheck(None if credentials is None else credentials.credentials, session_id)
        url = bridge.routes.get(session_id)
        record: dict[str, Any] | None = None
        if url is None:
            record = await bridge.lookup(session_id)
            if record is None:
                raise SessionNotFound(f"no session {session_id!r}")
            if _gone(record):
                return lost_reply(request, record, path)
            url = record.get("url")
            if url is None:
                raise SessionNotFound(f"session {session_id!r} has no live node")
        target = f"{url}{path}"
        try:
            response = await bridge.http.request(
                request.method,
                target,
                params=request.query_params,
                headers=forward_headers(request),
                content=await request.body(),
            )
        except httpx.HTTPError as exc:
            bridge.routes.pop(session_id, None)
            record = await bridge.lookup(session_id)
            if record is not None and _gone(record):
                return lost_reply(request, record, path)
            raise DeskvmError(
                f"the node owning session {session_id} did not answer: {exc!r}",
                code="node_unreachable",
            ) from exc
        return reply(response)

    def lost_reply(request: Request, record: dict[str, Any], path: str) -> Response:
        simple = path == f"/v1/sessions/{record['session_id']}"
        if simple and request.method in ("GET", "DELETE") and record.get("snapshot"):
            return JSONResponse(record["snapshot"])
        if not _is_lost(record):
            return error_response(
                SessionClosed(f"session {record['session_id']} has ended and its node left")
            )
        return error_response(_lost_error(record), status=410)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]

    @app.api_route("/v1/sessions/{session_id}", methods=methods, include_in_schema=False)
    async def session_root(request: Request, session_id: str) -> Response:
        return await session_call(request, session_id, f"/v1/sessions/{session_id}")

    @app.api_route(
        "/v1/sessions/{session_id}/{rest:path}", methods=methods, include_in_schema=False
    )
    async def session_sub(request: Request, session_id: str, rest: str) -> Response:
        return await session_call(request, session_id, f"/v1/sessions/{session_id}/{rest}")

    @app.websocket("/v1/sessions/{session_id}/{rest:path}")
    async def session_socket(websocket: WebSocket, session_id: str, rest: str) -> None:
        await _proxy_socket(bridge, websocket, session_id, rest)

    return app


async def _unless_disconnected(request: Request, call: Any) -> httpx.Response:
    """Await ``call``; cancel it (closing the connection to the node, which then deletes
    the booting session as on one machine) if the client goes away."""
    task = asyncio.ensure_future(call)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            result: httpx.Response = task.result()
            return result
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
            raise asyncio.CancelledError


def _full_reason(matching: list[dict[str, Any]], bundle: dict[str, float], image: str) -> str:
    try:
        free = ray.available_resources()
    except Exception:  # the message is best effort; the 503 stands
        free = {}
    slots = sum(n["resources"].get(RESOURCE_DESKTOP, 0) for n in matching)
    return (
        f"no node can take this session now: it needs 1 desktop slot and"
        f" {bundle[RESOURCE_MEMORY]:g} MiB on a node with image {image!r}; the"
        f" {len(matching)} such node(s) have {slots:g} slots in all, and the cluster has"
        f" {free.get(RESOURCE_DESKTOP, 0):g} slots and {free.get(RESOURCE_MEMORY, 0):g} MiB"
        " free; retry later or add nodes"
    )


async def _proxy_socket(
    bridge: ClusterBridge, websocket: WebSocket, session_id: str, rest: str
) -> None:
    """Relay one client WebSocket to the owning node's (same path, query, subprotocols)."""
    origin = websocket.headers.get("origin")
    host = websocket.headers.get("host", "")
    same_origin = origin in (f"http://{host}", f"https://{host}")
    if origin is not None and not same_origin and origin not in bridge.settings.allowed_origins:
        await websocket.close(CLOSE_POLICY_VIOLATION, reason="origin not allowed")
        return
    offered = offered_subprotocols(websocket)
    header = websocket.headers.get("authorization")
    presented = bearer_from_header(header)
    if presented is None:
        presented = next(
            (
                p.removeprefix(SUBPROTOCOL_BEARER_PREFIX)
                for p in offered
                if p.startswith(SUBPROTOCOL_BEARER_PREFIX)
            ),
            None,
        )
    try:
        bridge.precheck(presented, session_id)
    except TokenError as exc:
        await websocket.close(CLOSE_POLICY_VIOLATION, reason=exc.code)
        return
    url = bridge.routes.get(session_id)
    if url is None:
        record = await bridge.lookup(session_id)
        if record is not None and _is_lost(record):
            await _refuse(websocket, _lost_error(record), CLOSE_GOING_AWAY)
            return
        url = None if record is None else record.get("url")
        if url is None:
            await _refuse(websocket, SessionNotFound(f"no session {session_id!r}"), 4404)
            return
    target = "ws" + url.removeprefix("http") + f"/v1/sessions/{session_id}/{rest}"
    if websocket.url.query:
        target += "?" + websocket.url.query
    headers = {"Authorization": header} if header else {}
    try:
        upstream = await connect(
            target,
            additional_headers=headers,
            subprotocols=offered or None,  # type: ignore[arg-type]
            max_size=None,
            ping_interval=None,
            open_timeout=10,
            compression=None,
        )
    except InvalidStatus as exc:
        await websocket.close(
            CLOSE_POLICY_VIOLATION, reason=f"refused ({exc.response.status_code})"
        )
        return
    except (OSError, InvalidHandshake, TimeoutError) as exc:
        bridge.routes.pop(session_id, None)
        record = await bridge.lookup(session_id)
        error: DeskvmError = (
            _lost_error(record)
            if record is not None and _is_lost(record)
            else DeskvmError(
                f"the node of session {session_id} is unreachable: {exc!r}", code="node_unreachable"
            )
        )
        await _refuse(websocket, error, CLOSE_GOING_AWAY)
        return
    await websocket.accept(subprotocol=upstream.subprotocol)
    await _relay(websocket, upstream)


async def _refuse(websocket: WebSocket, error: DeskvmError, code: int) -> None:
    import json

    await websocket.accept()
    with contextlib.suppress(Exception):
        await websocket.send_text(
            json.dumps(
                {"id": None, "ok": False, "error": {"code": error.code, "message": error.message}}
            )
        )
        await websocket.close(code, reason=close_reason(f"{error.code}: {error.message}"))


async def _relay(websocket: WebSocket, upstream: ClientConnection) -> None:
    async def down() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in upstream:
                if isinstance(message, str):
                    await websocket.send_text(message)
                else:
                    await websocket.send_bytes(message)
        code = upstream.close_code
        reason = upstream.close_reason or ""
        if code is None or code in (1005, 1006, 1015):
            code, reason = 1011, "upstream_lost: the connection to the session's node broke"
        with contextlib.suppress(Exception):
            await websocket.close(code, reason=close_reason(reason))

    async def up() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(message.get("code") or 1000)
                return
            if message.get("text") is not None:
                await upstream.send(message["text"])
            elif message.get("bytes") is not None:
                await upstream.send(message["bytes"])

    tasks = [asyncio.ensure_future(down()), asyncio.ensure_future(up())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(Exception):
            await upstream.close()
