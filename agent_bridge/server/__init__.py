"""The bridge server: REST for session lifecycle, one WebSocket per agent for actions.

:func:`create_app` wraps a :class:`~orchestrator.manager.SessionManager` in a FastAPI
application; :func:`run_server` serves it with uvicorn. The wire protocol is documented in
``docs/protocol.md``; the OpenAPI schema of the REST part is served at ``/openapi.json``
(and ``/docs``).

The package has the shape of a larger FastAPI application:

- :mod:`~agent_bridge.server.app` — assembles the app (state, error handlers, lifespan,
  routers) and serves it;
- :mod:`~agent_bridge.server.routers` — one router module per resource: ``sessions``,
  ``tokens``, ``approvals`` (policy, pending actions, operator socket), ``network``,
  ``actions`` (the action WebSocket), ``stream`` (the live frame stream), ``health``;
- :mod:`~agent_bridge.server.deps` — shared dependencies: the app's state, who is asking
  (admin token or scoped session token), the session named in the path;
- :mod:`~agent_bridge.server.models` — the pydantic wire models;
- :mod:`~agent_bridge.server.errors`, :mod:`~agent_bridge.server.sockets`,
  :mod:`~agent_bridge.server.ratelimit`, :mod:`~agent_bridge.server.gate`,
  :mod:`~agent_bridge.server.vocabulary` — error replies, WebSocket handshake and close
  codes, rate limits, the approval gate, action vocabularies.

Layering: this package translates between HTTP/WebSocket and the orchestrator. Parsing of
action messages is the pure :mod:`agent_bridge.protocol` layer's job; executing them is
:meth:`orchestrator.session.Session.execute`'s. Blocking calls into the orchestrator
(booting, acting, tearing down) run in worker threads so the event loop stays responsive.

Errors: every :class:`~orchestrator.errors.DeskvmError` becomes a JSON body
``{"error": {"code", "message"}}`` with the status of :data:`STATUS_BY_CODE` (REST) or an
error reply ``{"id", "ok": false, "error": {...}}`` (WebSocket). The bearer token is never
logged, never echoed and never read from the URL.
"""

from __future__ import annotations

from agent_bridge.server.app import create_app, listen, make_server, run_server
from agent_bridge.server.errors import STATUS_BY_CODE
from agent_bridge.server.models import (
    CreateSessionRequest,
    DisplayModel,
    EgressInfo,
    EgressRequest,
    ErrorBody,
    HealthResponse,
    NetworkDecisionModel,
    SessionInfo,
)
from agent_bridge.server.sockets import (
    CLOSE_GOING_AWAY,
    CLOSE_MESSAGE_TOO_BIG,
    CLOSE_POLICY_VIOLATION,
    CLOSE_SESSION_NOT_FOUND,
    CLOSE_TRY_AGAIN_LATER,
    MAX_MESSAGE_BYTES,
    SUBPROTOCOL,
    SUBPROTOCOL_BEARER_PREFIX,
)

__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_SESSION_NOT_FOUND",
    "CLOSE_TRY_AGAIN_LATER",
    "MAX_MESSAGE_BYTES",
    "STATUS_BY_CODE",
    "SUBPROTOCOL",
    "SUBPROTOCOL_BEARER_PREFIX",
    "CreateSessionRequest",
    "DisplayModel",
    "EgressInfo",
    "EgressRequest",
    "ErrorBody",
    "HealthResponse",
    "NetworkDecisionModel",
    "SessionInfo",
    "create_app",
    "listen",
    "make_server",
    "run_server",
]
