"""REST errors: every failure answers ``{"error": {"code", "message"}}``.

A :class:`~orchestrator.errors.DeskvmError` gets the status of :data:`STATUS_BY_CODE`
(unlisted codes 500, unlisted :class:`~orchestrator.errors.ProtocolError` codes 400);
FastAPI's validation errors become 422 ``invalid_request`` with the field errors in
``details``; Starlette's 404/405/401 become ``not_found`` / ``method_not_allowed`` /
``unauthorized``; anything else is logged and answers 500 ``internal_error``. A request
cancelled before it answered (uvicorn's graceful shutdown timed out) answers 503
``server_shutting_down`` (:class:`JsonErrorsMiddleware`), so no path answers plain text.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_bridge.server.models import ErrorBody
from orchestrator.errors import BootTimeout, DeskvmError, ProtocolError

__all__ = [
    "ERROR_RESPONSES",
    "STATUS_BY_CODE",
    "JsonErrorsMiddleware",
    "error_response",
    "install_error_handlers",
    "plain_error",
]

log = logging.getLogger("deskvm.bridge")

STATUS_BY_CODE: dict[str, int] = {
    "session_expired": 409,
    "store_error": 500,
    "instance_busy": 409,
    "invalid_request": 422,
    "invalid_query": 422,
    "invalid_config": 422,
    "invalid_egress": 422,
    "egress_not_configured": 422,
    "image_not_found": 404,
    "session_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "unauthorized": 401,
    "forbidden": 403,
    "pending_not_found": 404,
    "token_not_found": 404,
    "session_closed": 409,
    "reset_unavailable": 409,
    "image_not_verified": 409,
    "rate_limited": 429,
    "over_capacity": 503,
    "over_memory": 503,
    "insufficient_disk": 503,
    "cluster_full": 503,
    "server_shutting_down": 503,
    "no_matching_node": 503,
    "node_unreachable": 502,
    "session_lost": 410,
    "boot_timeout": 504,
    "hypervisor_error": 502,
    "accel_failed": 502,
    "display_error": 502,
    "guest_helper_error": 502,
    "guest_reply_invalid": 502,
    "guest_refused": 422,
    "guest_control_disabled": 409,
    "guest_control_unavailable": 409,
    "unsupported_resolution": 422,
    "path_not_allowed": 403,
    "message_too_big": 413,
    "egress_error": 502,
    "recorder_error": 500,
    "no_frame": 404,
    "not_a_recording": 404,
    "internal_error": 500,
}
"""HTTP status of each error ``code`` on the REST side; unlisted codes answer 500, unlisted
:class:`~orchestrator.errors.ProtocolError` codes 400."""

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (401, 403, 404, 409, 422, 429, 502, 503, 504)
}
"""``responses=`` for route decorators: the error body in the OpenAPI schema."""


def error_response(
    exc: DeskvmError, *, status: int | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The JSON reply for ``exc`` (``WWW-Authenticate`` on 401, ``Retry-After`` on 429/503)."""
    detail: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if isinstance(exc, BootTimeout):
        detail["console_tail"] = exc.console_tail
    if status is None:
        default = 400 if isinstance(exc, ProtocolError) else 500
        status = STATUS_BY_CODE.get(exc.code, default)
    if exc.code == "unauthorized":
        headers = {"WWW-Authenticate": "Bearer", **(headers or {})}
    if exc.code in (
        "over_capacity", "over_memory", "insufficient_disk", "rate_limited", "cluster_full",
        "server_shutting_down",
    ):  # fmt: skip
        headers = {"Retry-After": "5", **(headers or {})}
    return JSONResponse({"error": detail}, status_code=status, headers=headers)


def plain_error(code: str, message: str, status: int, **extra: Any) -> JSONResponse:
    """``{"error": {"code", "message", **extra}}`` with ``status``."""
    return JSONResponse({"error": {"code": code, "message": message, **extra}}, status_code=status)


async def _deskvm_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DeskvmError)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where}: {first.get('msg', 'invalid')}" if where else "invalid request"
    kind = first.get("type")
    content_type = request.headers.get("content-type", "")
    if kind == "json_invalid":
        offset = first.get("ctx", {}).get("error") if isinstance(first.get("ctx"), dict) else None
        message = "the body is not valid JSON" + (f" ({offset})" if offset else "")
    elif kind == "model_attributes_type" and "json" not in content_type.lower():
        message = (
            "the body must be a JSON object sent with 'Content-Type: application/json' "
            f"(got {content_type or 'no content type'}; with curl: -H 'Content-Type: "
            "application/json')"
        )
    elif kind == "model_attributes_type":
        message = "the body must be a JSON object"
    details = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors
    ]
    return plain_error("invalid_request", message, 422, details=details)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}.get(
        exc.status_code, "http_error"
    )
    response = plain_error(code, str(exc.detail), exc.status_code)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return plain_error("internal_error", "internal server error (see the server log)", 500)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(DeskvmError, _deskvm_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


class JsonErrorsMiddleware:
    """ASGI middleware: an HTTP request cancelled before its answer started gets the JSON
    error shape instead of the server's plain-text 500.

    Exceptions are the error handlers' job (they run inside Starlette's own middleware);
    this catches what is not an ``Exception``: the cancellation uvicorn sends to requests
    still running when its graceful shutdown times out. The answer is 503
    ``server_shutting_down`` with ``Retry-After``; the cancellation then propagates.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except anyio.get_cancelled_exc_class():
            if not started:
                with anyio.CancelScope(shield=True):
                    await _send_json(send, 503, "server_shutting_down",
                                     "the server is shutting down; try again once it is back",
                                     {"retry-after": "5"})  # fmt: skip
            raise


async def _send_json(
    send: Send, status: int, code: str, message: str, headers: dict[str, str]
) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
