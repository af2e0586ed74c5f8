"""Session lifecycle: ``/v1/sessions`` (create, list) and ``/v1/sessions/{id}`` (get,
delete), plus the guest's log.

Blocking orchestrator calls (booting, tearing down, reading logs) run in worker threads so
the event loop stays responsive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse

from agent_bridge.server.deps import BaseUrl, Bridge, SessionDep, SessionGuard, server_token
from agent_bridge.server.errors import ERROR_RESPONSES
from agent_bridge.server.models import CreateSessionRequest, ExtendRequest, SessionInfo
from agent_bridge.server.state import BridgeState
from orchestrator.errors import ConfigError, SessionClosed
from orchestrator.session import Session
from orchestrator.spec import DisplaySpec, EgressPolicy

__all__ = ["router"]

log = logging.getLogger("deskvm.bridge")

_WATCH_S = 0.2
"""How often a booting create looks for a gone client or a server shutdown, seconds."""

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERROR_RESPONSES)


@router.post("", status_code=201, response_model=SessionInfo, dependencies=[server_token])
async def create_session(
    request: Request, body: CreateSessionRequest, bridge: Bridge, base_url: BaseUrl
) -> SessionInfo:
    """Start a session; answers 201 once its desktop is drawn.

    On failure nothing is left behind: 404 ``image_not_found``, 422 ``invalid_config``,
    503 ``over_capacity`` / ``over_memory`` / ``insufficient_disk`` (with
    ``Retry-After``), 504 ``boot_timeout`` (with ``console_tail``), 502
    ``hypervisor_error`` / ``egress_error``, 422 ``invalid_egress`` (the message names
    the malformed entry) or ``egress_not_configured`` (a policy on a server without an
    egress upstream). If the client disconnects while the session boots, the session
    is deleted; if the server begins to shut down (Ctrl-C, SIGTERM) meanwhile, the session
    is ended and the answer is 503 ``server_shutting_down``.
    """
    settings = bridge.settings
    if body.ttl_s is not None and body.ttl_s > settings.session_max_ttl_s:
        raise ConfigError(
            f"ttl_s {body.ttl_s:g} is above this server's maximum of "
            f"{settings.session_max_ttl_s:g} s"
        )
    display = DisplaySpec(width_px=body.display.width, height_px=body.display.height)
    policy = body.approval.to_policy() if body.approval is not None else None
    takeover = body.takeover.to_policy() if body.takeover is not None else None
    egress_policy: EgressPolicy | None = None
    if body.egress is not None:
        try:
            egress_policy = EgressPolicy(allow=tuple(body.egress.allow))
        except ConfigError as exc:
            raise ConfigError(exc.message, code="invalid_egress") from None
    started: list[Session] = []

    def on_started(session: Session) -> None:
        bridge.book.created_at[session.id] = session.created_at
        if policy is not None and not policy.empty:
            session.approval_policy = policy
        if takeover is not None:
            bridge.takeover[session.id] = takeover
        started.append(session)

    def create() -> Session:
        return bridge.manager.create(
            image=body.image or settings.default_image,
            display=display,
            memory_mib=body.memory_mib,
            vcpus=body.vcpus,
            boot_timeout_s=body.boot_timeout_s or settings.boot_timeout_s,
            on_started=on_started,
            cpu_quota_pct=body.cpu_quota_pct,
            disk_mib=body.disk_mib,
            ttl_s=body.ttl_s or settings.session_ttl_s,
            idle_timeout_s=body.idle_timeout_s or settings.idle_timeout_s,
            autostart=body.autostart,
            egress=egress_policy,
            guest_control=body.guest_control,
            keyboard_layout=body.keyboard_layout,
        )

    session = await _run_unless_disconnected(request, create, started, bridge)
    bridge.book.ready_at[session.id] = session.ready_at or datetime.now(UTC)
    bridge.forget_unknown()
    log.info("session %s ready in %.1f s", session.id, session.boot_s or 0.0)
    return bridge.session_info(session, base_url)


@router.get("", response_model=list[SessionInfo], dependencies=[server_token])
async def list_sessions(bridge: Bridge, base_url: BaseUrl) -> list[SessionInfo]:
    """Live sessions first, then recently ended ones (bounded history)."""
    return [bridge.session_info(s, base_url) for s in bridge.manager.all()]


@router.get(
    "/{session_id}", response_model=SessionInfo, dependencies=[Depends(SessionGuard("view"))]
)
async def get_session(session: SessionDep, bridge: Bridge, base_url: BaseUrl) -> SessionInfo:
    """One live or recently ended session (404 ``session_not_found``)."""
    return bridge.session_info(session, base_url)


@router.patch(
    "/{session_id}", response_model=SessionInfo, dependencies=[Depends(SessionGuard("admin"))]
)
async def extend_session(
    session_id: str, body: ExtendRequest, bridge: Bridge, base_url: BaseUrl
) -> SessionInfo:
    """Give a session a new lifetime: ``{"ttl_s": N}`` seconds from its creation.

    The new deadline is stored before the answer (a restarted server keeps it). An
    extension that comes before the deadline holds; at or after it the session has expired:
    409 ``session_expired`` and the session is ended now. 422 ``invalid_config`` if
    ``ttl_s`` is above the server's maximum (``deskvm serve --max-ttl-s``) or not more than
    the session has already run; 409 ``session_closed`` for an ended session.
    """
    manager, max_ttl_s = bridge.manager, bridge.settings.session_max_ttl_s
    session = await anyio.to_thread.run_sync(
        lambda: manager.extend_ttl(session_id, body.ttl_s, max_ttl_s=max_ttl_s)
    )
    log.info("session %s: ttl_s set to %g", session_id, body.ttl_s)
    return bridge.session_info(session, base_url)


@router.delete(
    "/{session_id}", response_model=SessionInfo, dependencies=[Depends(SessionGuard("admin"))]
)
async def delete_session(session_id: str, bridge: Bridge, base_url: BaseUrl) -> SessionInfo:
    """End a session: domain destroyed, overlay deleted; the recording stays.

    Deleting an ended session answers 200 again with its final state. 502
    ``hypervisor_error`` if a teardown step failed (the session is retired anyway).
    """
    bridge.desk.deny_all(session_id, by="session deleted")
    manager = bridge.manager
    try:
        session = await anyio.to_thread.run_sync(
            lambda: manager.delete(session_id, reason="deleted by client")
        )
    finally:
        # After the teardown: an agent action held by a take-over must not run meanwhile.
        bridge.controls.forget(session_id)
    return bridge.session_info(session, base_url)


@router.post(
    "/{session_id}/reset",
    response_model=SessionInfo,
    dependencies=[Depends(SessionGuard("control"))],
)
async def reset_session(session_id: str, bridge: Bridge, base_url: BaseUrl) -> SessionInfo:
    """Return the session to its start state (the saved state its warm desktop was
    restored from) in about a second: the domain is restored again onto a fresh overlay,
    its wall clock set; ``resets`` and ``last_reset_s`` say how often and how long. The
    recording stays one bundle with a ``reset`` marker.

    409 ``reset_unavailable`` for a session that booted cold (``"start": "cold"``: no
    saved start state), 409 ``session_closed`` if it is not ready; 502
    ``hypervisor_error`` if the restore failed (the session has then been ended).
    """
    manager = bridge.manager
    session = await anyio.to_thread.run_sync(lambda: manager.reset(session_id))
    log.info("session %s reset in %.2f s", session_id, session.last_reset_s or 0.0)
    return bridge.session_info(session, base_url)


@router.get(
    "/{session_id}/guest-log",
    response_class=PlainTextResponse,
    dependencies=[Depends(SessionGuard("view"))],
    responses={200: {"content": {"text/plain": {}}}},
)
async def guest_log(
    session: SessionDep,
    offset: Annotated[int, Query(ge=0, description="skip this many bytes")] = 0,
) -> PlainTextResponse:
    """What the guest wrote to its ``/dev/ttyS1`` (UTF-8, undecodable bytes replaced)."""
    data = await anyio.to_thread.run_sync(session.guest_log)
    return PlainTextResponse(data[offset:].decode("utf-8", errors="replace"))


async def _run_unless_disconnected(
    request: Request,
    create: Callable[[], Session],
    started: list[Session],
    bridge: BridgeState,
) -> Session:
    """Run the blocking ``create`` in a worker thread; delete the session if the client
    leaves or the server begins to shut down while it boots.

    Raises:
        SessionClosed: code ``server_shutting_down`` (503): the server began to shut down
            (Ctrl-C, SIGTERM) while the session booted; it was ended.
        Whatever ``create`` raises.
    """
    outcome: list[Session] = []
    failure: list[Exception] = []
    shut_down: list[str] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while True:
                await anyio.sleep(_WATCH_S)
                if bridge.shutting_down.is_set() and started:
                    session_id = started[0].id
                    log.info("session %s: server shutting down while it booted; ending it",
                             session_id)  # fmt: skip
                    shut_down.append(session_id)
                    await bridge.delete_quietly(session_id, "server shutdown")
                    return
                if await request.is_disconnected():
                    if started:
                        log.info("session %s: client disconnected while it booted; deleting",
                                 started[0].id)  # fmt: skip
                        await bridge.delete_quietly(started[0].id, "client disconnected")
                    return

        tg.start_soon(watch)
        try:
            outcome.append(await anyio.to_thread.run_sync(create))
        except Exception as exc:  # re-raised below, outside the task group's ExceptionGroup
            failure.append(exc)
        finally:
            tg.cancel_scope.cancel()
    if shut_down:
        raise SessionClosed(
            f"the server is shutting down; session {shut_down[0]} was ended while it "
            "booted (create it again once the server is back)",
            code="server_shutting_down",
        )
    if failure:
        raise failure[0]
    return outcome[0]
