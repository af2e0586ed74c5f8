"""The browser pages: ``/`` and ``/ui/`` (session list), ``/view/{id}`` (live view).

Pages are static HTML/JS that hold no data and need no credentials; they sign in with a
short cookie and read everything through the API (see :mod:`agent_bridge.viewer` and
:mod:`agent_bridge.cookies`). The replay viewer is at ``/replay/{id}/``.
"""

from __future__ import annotations

import re

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_bridge.viewer import page

__all__ = ["router"]

router = APIRouter(include_in_schema=False)

_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEADERS = {"Cache-Control": "no-cache", "X-Frame-Options": "DENY",
            "Content-Security-Policy": "frame-ancestors 'none'"}  # fmt: skip


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/", response_class=HTMLResponse)
async def sessions_page() -> HTMLResponse:
    return HTMLResponse(page("index.html"), headers=_HEADERS)


@router.get("/view/{session_id}", response_class=HTMLResponse)
async def live_page(session_id: str) -> HTMLResponse:
    if not _ID.match(session_id):
        raise StarletteHTTPException(404, f"no session {session_id!r}")
    return HTMLResponse(page("view.html"), headers=_HEADERS)
