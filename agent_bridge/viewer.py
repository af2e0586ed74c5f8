"""The browser replay viewer: a static page plus a small JSON/PNG API over a recording.

Routes (mounted by ``deskvm serve`` and by ``deskvm replay view PATH``):

- ``GET /replay/`` and ``GET /replay/{rec}/``: the viewer page (static HTML/JS, holds no
  data, no authentication). The page takes the bearer token from the URL *fragment*
  (``#token=...``, never sent to the server) and sends it as ``Authorization: Bearer`` on
  every data request: tokens in the URL are never accepted.
- ``GET /replay/index.json``: the recordings available (``[{"id", "status", ...}]``).
- ``GET /replay/{rec}/timeline.json``: manifest, duration and every event with its time
  (``t_s``, seconds since the recording's origin), the frame shown at it (``frame_seq``)
  and the pointer position (``cursor``, display pixels, or ``null``); ``frames`` lists
  ``[pts_s, seq]`` of every frame in time order.
- ``GET /replay/{rec}/frames/{seq}.png``: the picture of frame event ``seq`` (a still as
  stored, or a video frame decoded and PNG-encoded), full resolution.

``{rec}`` is a recording directory name (a session id) under the server's recordings
directory; names with anything but ``[A-Za-z0-9_-]`` are refused (no path traversal).
"""

from __future__ import annotations

import hmac
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.errors import RecorderError
from orchestrator.replay import Recording

__all__ = ["TokenCheck", "replay_router", "viewer_app"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BEARER = HTTPBearer(auto_error=False)


class TokenCheck:
    """FastAPI dependency: ``Authorization: Bearer <token>`` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode("utf-8")

    async def __call__(
        self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
    ) -> None:
        """Raises: ``HTTPException`` 401."""
        offered = b"" if credentials is None else credentials.credentials.encode("utf-8")
        if not hmac.compare_digest(offered, self._token):
            raise StarletteHTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )


def _page() -> str:
    return resources.files("agent_bridge").joinpath("static/viewer.html").read_text("utf-8")


class _Recordings:
    """Opened recordings, reopened when their events file grows (live sessions)."""

    def __init__(
        self, resolve: Callable[[str], Path], listing: Callable[[], list[tuple[str, Path]]]
    ) -> None:
        self._resolve = resolve
        self._listing = listing
        self._open: OrderedDict[str, tuple[int, Recording]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> Recording:
        if not _NAME.match(name):
            raise StarletteHTTPException(404, f"no recording {name!r}")
        path = self._resolve(name)
        try:
            size = (path / "events.jsonl").stat().st_size
        except OSError:
            raise StarletteHTTPException(404, f"no recording {name!r}") from None
        with self._lock:
            cached = self._open.get(name)
            if cached is not None and cached[0] == size:
                self._open.move_to_end(name)
                return cached[1]
        try:
            recording = Recording(path)
        except RecorderError as exc:
            raise StarletteHTTPException(404, exc.message) from exc
        with self._lock:
            self._open[name] = (size, recording)
            while len(self._open) > 8:
                self._open.popitem(last=False)
        return recording

    def index(self) -> list[dict[str, Any]]:
        out = []
        for name, path in self._listing():
            try:
                manifest = json.loads((path / "manifest.json").read_text())
            except (OSError, ValueError):
                continue
            out.append(
                {
                    "id": name,
                    "session_id": manifest.get("session_id"),
                    "status": manifest.get("status"),
                    "started_at": manifest.get("started_at"),
                    "events": manifest.get("event_count"),
                }
            )
        return out


def timeline(recording: Recording) -> dict[str, Any]:
    """The JSON the viewer page loads (see the module docstring)."""
    events = []
    cursor: tuple[int, int] | None = None
    for event in recording.events:
        seq = int(event["seq"])
        if event.get("kind") == "input":
            action = event["data"].get("action") or {}
            if action.get("x") is not None and action.get("y") is not None:
                cursor = (int(action["x"]), int(action["y"]))
            elif action.get("path"):
                cursor = (int(action["path"][-1][0]), int(action["path"][-1][1]))
        events.append(
            {
                **event,
                "t_s": round(recording.t_s(event), 6),
                "frame_seq": recording.frame_seq_for_event(seq),
                "cursor": list(cursor) if cursor is not None else None,
            }
        )
    frames = [
        [round(recording.t_s(e) if "pts_ns" not in e["data"] else
               (int(e["data"]["pts_ns"]) - recording.origin_ns) / 1e9, 6), int(e["seq"])]
        for e in recording.events
        if e.get("kind") == "frame"
    ]  # fmt: skip
    frames.sort()
    return {
        "manifest": recording.manifest,
        "duration_s": recording.duration_s,
        "events": events,
        "frames": frames,
    }


def replay_router(
    resolve: Callable[[str], Path],
    listing: Callable[[], list[tuple[str, Path]]],
    *,
    data_dependencies: Sequence[Any],
) -> APIRouter:
    """The ``/replay`` routes.

    Args:
        resolve: recording name -> bundle directory (the name is already checked).
        listing: ``(name, bundle)`` pairs to list on ``/replay/index.json``.
        data_dependencies: FastAPI dependencies guarding the data routes (the token).
    """
    router = APIRouter(prefix="/replay", tags=["replay"])
    recordings = _Recordings(resolve, listing)
    deps = list(data_dependencies)

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index_page() -> HTMLResponse:
        return HTMLResponse(_page())

    @router.get("/index.json", dependencies=deps)
    async def index_json() -> JSONResponse:
        return JSONResponse(await anyio.to_thread.run_sync(recordings.index))

    @router.get("/{name}/", response_class=HTMLResponse, include_in_schema=False)
    async def viewer_page(name: str) -> HTMLResponse:
        return HTMLResponse(_page())

    @router.get("/{name}/timeline.json", dependencies=deps)
    async def timeline_json(name: str) -> JSONResponse:
        def build() -> dict[str, Any]:
            return timeline(recordings.get(name))

        return JSONResponse(await anyio.to_thread.run_sync(build))

    @router.get("/{name}/frames/{seq}.png", dependencies=deps)
    async def frame_png(name: str, seq: int) -> Response:
        def load() -> bytes:
            recording = recordings.get(name)
            if not 0 <= seq < len(recording.events):
                raise StarletteHTTPException(404, f"no event {seq}")
            try:
                return recording.frame_png(seq)
            except RecorderError as exc:
                raise StarletteHTTPException(404, exc.message) from exc

        png = await anyio.to_thread.run_sync(load)
        return Response(png, media_type="image/png", headers={"Cache-Control": "max-age=3600"})

    return router


def viewer_app(bundle: Path, *, token: str) -> FastAPI:
    """A stand-alone app that serves one recording as ``/replay/local/``.

    Args:
        bundle: the recording directory.
        token: bearer token the page must present (put it in the URL fragment).
    """
    app = FastAPI(title="deskvm replay viewer", docs_url=None, redoc_url=None)

    def resolve(name: str) -> Path:
        if name != "local":
            raise StarletteHTTPException(404, f"no recording {name!r}")
        return bundle

    app.include_router(
        replay_router(
            resolve, lambda: [("local", bundle)], data_dependencies=[Depends(TokenCheck(token))]
        )
    )

    @app.get("/", include_in_schema=False)
    async def root(request: Request) -> Response:
        return Response(status_code=307, headers={"Location": "/replay/local/"})

    return app
