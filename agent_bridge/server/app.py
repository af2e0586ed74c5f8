"""The bridge application, assembled: state, error handlers, lifespan, routers.

Everything a route needs lives on ``app.state.bridge`` (a
:class:`~agent_bridge.server.state.BridgeState`) and reaches it through
:mod:`agent_bridge.server.deps`; the routers are in :mod:`agent_bridge.server.routers`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from types import FrameType

import anyio.to_thread
import uvicorn
from fastapi import FastAPI

from agent_bridge.server.deps import known_query_only
from agent_bridge.server.errors import JsonErrorsMiddleware, install_error_handlers
from agent_bridge.server.ratelimit import RateLimits
from agent_bridge.server.routers import (
    actions,
    approvals,
    auth,
    control,
    guest,
    health,
    network,
    pages,
    replay,
    sessions,
    stream,
    tokens,
)
from agent_bridge.server.sockets import MAX_MESSAGE_BYTES
from agent_bridge.server.state import BridgeState
from agent_bridge.tokens import TokenAuthority
from agent_bridge.viewer import assets_router
from orchestrator.approval import ApprovalDesk
from orchestrator.errors import ConfigError, DeskvmError
from orchestrator.interrupt import STOP_SIGNALS
from orchestrator.manager import SessionManager
from orchestrator.settings import Settings

__all__ = ["create_app", "listen", "make_server", "run_server"]

log = logging.getLogger("deskvm.bridge")


def create_app(
    manager: SessionManager,
    *,
    token: str,
    settings: Settings | None = None,
    authority: TokenAuthority | None = None,
    desk: ApprovalDesk | None = None,
) -> FastAPI:
    """The bridge's ASGI application.

    Args:
        manager: creates, finds and deletes sessions (its hypervisor decides real or fake).
        token: the server's admin bearer token: every REST call (except ``/healthz`` and
            the OpenAPI pages) and every WebSocket must present it or a session token it
            minted. Compared in constant time; never logged.
        settings: supplies ``default_image``, ``boot_timeout_s``, default limits, token
            lifetimes, the Origin allowlist, rate limits and the sweep interval (default:
            :class:`~orchestrator.settings.Settings` defaults).
        authority: mints and verifies session tokens (default: a fresh random secret).
        desk: where actions held for approval wait (default: a new one).

    Returns:
        A FastAPI app. Its lifespan first takes back the sessions an earlier run of this
        server left running (``manager.adopt``: their tokens and approval policies come
        back too), runs ``manager.sweep`` (TTL, idle timeout, reaper) at start and every
        ``settings.sweep_interval_s`` in a background thread (with the server instance's
        heartbeat), and on shutdown closes every live session (``manager.close_all``), or
        with ``settings.on_exit == "keep"`` leaves them running for a restart
        (``manager.detach_all``).

    Raises:
        ConfigError: ``token`` is empty.
    """
    if not token:
        raise ConfigError("the bridge needs a non-empty bearer token")
    settings = settings or Settings()
    state = BridgeState(
        manager=manager,
        settings=settings,
        admin_token=token,
        authority=authority
        or TokenAuthority(default_ttl_s=settings.token_ttl_s, max_ttl_s=settings.token_max_ttl_s),
        desk=desk or ApprovalDesk(),
        limits=RateLimits(settings.max_actions_per_s, settings.max_typed_chars_per_s),
    )
    app = FastAPI(
        title="deskvm bridge",
        version="1",
        summary="Disposable desktop VMs for computer-use agents.",
        description="REST for sessions; actions over the WebSocket "
        "`/v1/sessions/{id}/ws` (see docs/protocol.md).",
        lifespan=_lifespan,
        dependencies=[known_query_only],
    )
    if state.authority.on_change is None:
        state.authority.on_change = state.store_tokens
    app.state.bridge = state
    install_error_handlers(app)
    app.add_middleware(JsonErrorsMiddleware)

    app.include_router(replay.router_for(state))
    app.include_router(assets_router())
    app.include_router(pages.router)
    for module in (
        health, auth, sessions, tokens, approvals, control, network, actions, stream, guest,
    ):  # fmt: skip
        app.include_router(module.router)
    return app


def _sweep_once(manager: SessionManager) -> None:
    try:
        expired, reaped = manager.sweep()
    except Exception:
        log.exception("session sweep failed")
        return
    for session_id in expired:
        with contextlib.suppress(DeskvmError):
            log.info("session %s ended: %s", session_id, manager.get(session_id).closed_reason)
    if reaped:
        log.warning("reaped leftovers of unknown sessions: %s", ", ".join(reaped))


def _adopt(state: BridgeState) -> None:
    """Take back what an earlier run of this server left running (see
    ``SessionManager.adopt``), with each session's tokens."""
    manager = state.manager
    report = manager.adopt()
    for session_id in report.adopted:
        with contextlib.suppress(DeskvmError):
            session = manager.get(session_id)
            tokens = session.extras.get("tokens")
            if tokens:
                state.authority.import_session(session_id, tokens)
        log.warning("re-adopted session %s after a restart", session_id)
    for session_id, why in report.failed.items():
        log.error("could not re-adopt session %s (it was ended): %s", session_id, why)
    for session_id, why in report.reaped.items():
        log.warning("reaped session %s: %s", session_id, why)
    if report.waiting:
        log.info(
            "left running for their own server to restart (grace %g s): %s",
            manager.adopt_grace_s,
            ", ".join(report.waiting),
        )
    if report.sealed:
        log.warning("sealed as truncated the recordings of: %s", ", ".join(report.sealed))


def _heartbeat(manager: SessionManager) -> None:
    if manager.instance is not None:
        manager.instance.heartbeat()


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Take back sessions, sweep them (TTL, idle, leftovers) while serving; at shutdown
    close them all, or leave them running for a restart (``settings.on_exit``)."""
    state: BridgeState = app.state.bridge
    manager = state.manager
    stop = threading.Event()

    def sweeper() -> None:
        while not stop.wait(state.settings.sweep_interval_s):
            _heartbeat(manager)
            _sweep_once(manager)

    await anyio.to_thread.run_sync(lambda: _adopt(state))
    await anyio.to_thread.run_sync(lambda: _sweep_once(manager))
    thread = threading.Thread(target=sweeper, name="deskvm-sweeper", daemon=True)
    thread.start()
    manager.start_pool()
    try:
        yield
    finally:
        stop.set()
        await anyio.to_thread.run_sync(lambda: thread.join(timeout=30))
        await anyio.to_thread.run_sync(manager.close_pool)
        if state.settings.on_exit == "keep":
            kept = await anyio.to_thread.run_sync(manager.detach_all)
            if manager.instance is not None:
                manager.instance.heartbeat(stopped=True)
            if kept:
                log.warning(
                    "left %d session(s) running for a restart within %g s: %s",
                    len(kept),
                    manager.adopt_grace_s,
                    ", ".join(kept),
                )
        else:
            errors = await anyio.to_thread.run_sync(
                lambda: manager.close_all(reason="server shutdown")
            )
            for error in errors:
                log.error("teardown at shutdown failed: %s", error)


def listen(host: str, port: int) -> socket.socket:
    """Bind the server's listening socket (before anything is started or printed).

    Args:
        host: interface address (IPv4 or IPv6 literal, or a name).
        port: TCP port; 0 picks a free one (``sock.getsockname()[1]``).

    Returns:
        A listening TCP socket (``SO_REUSEADDR``, as uvicorn binds), for
        :func:`run_server`'s ``sock``.

    Raises:
        ConfigError: code ``address_in_use``: another process listens there (the message
            says which address); ``invalid_config``: the address cannot be bound.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"{host}:{port} is already in use (another deskvm serve?); stop it or "
                "choose another --port",
                code="address_in_use",
            ) from None
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


class _Server(uvicorn.Server):
    """uvicorn's server that tells the bridge when it begins to shut down.

    uvicorn lets in-flight requests finish before the app's lifespan ends; a session
    create still booting would otherwise wait out the graceful timeout and be cancelled
    (a plain-text 500). Setting ``BridgeState.shutting_down`` first lets it end its
    session and answer 503 ``server_shutting_down``.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.exit_signals: list[int] = []

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.exit_signals.append(sig)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, for SIGHUP too (a closed terminal stops the server as SIGTERM does).

        After the shutdown the first signal caught is raised again with the previous
        handlers in place, as uvicorn does.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.exit_signals:
            signal.raise_signal(self.exit_signals[0])

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        app = self.config.app
        bridge = getattr(getattr(app, "state", None), "bridge", None)
        if isinstance(bridge, BridgeState):
            bridge.shutting_down.set()
        await super().shutdown(sockets)


def make_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    log_level: str = "info",
    graceful_timeout_s: float = 10.0,
) -> uvicorn.Server:
    """The uvicorn server :func:`run_server` runs (for callers that run it themselves,
    e.g. in a thread: set ``server.should_exit`` to stop it)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        ws_max_size=MAX_MESSAGE_BYTES,
        timeout_graceful_shutdown=int(graceful_timeout_s),
    )
    return _Server(config)


def run_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    log_level: str = "info",
    graceful_timeout_s: float = 10.0,
    sock: socket.socket | None = None,
) -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM, then shut down gracefully.

    At the signal, sessions still booting are ended (their creates answer 503
    ``server_shutting_down``), open WebSockets are closed by uvicorn, in-flight requests
    get ``graceful_timeout_s`` seconds (then answer 503 ``server_shutting_down``), then
    the app's lifespan closes every live session (domains destroyed, overlays deleted;
    recordings kept).

    Args:
        app: from :func:`create_app`.
        host: interface to bind (default loopback only).
        port: TCP port; 0 picks a free one.
        log_level: uvicorn's log level.
        graceful_timeout_s: seconds in-flight requests may take at shutdown.
        sock: a socket from :func:`listen` to serve on (then ``host``/``port`` only
            label the log); ``None``: uvicorn binds ``host``/``port`` itself.
    """
    server = make_server(
        app, host, port, log_level=log_level, graceful_timeout_s=graceful_timeout_s
    )
    server.run(sockets=None if sock is None else [sock])
    # uvicorn raises a captured SIGINT again once it has shut down, but from inside
    # asyncio.run, whose own SIGINT handler may then find its main task already done and
    # return normally (seen once under load: Ctrl-C exited 0). Ctrl-C ends as Ctrl-C.
    if isinstance(server, _Server) and signal.SIGINT in server.exit_signals:
        raise KeyboardInterrupt
