"""The browser pages and the replay viewer's JSON/PNG API over recordings.

Pages (static HTML/JS from ``agent_bridge/static``, hold no data, need no credentials;
one stylesheet and one script for all of them, ``GET /static/{style.css,common.js}``):
the session list (``/replay/``; ``deskvm serve`` also serves it at ``/ui/``), the live view
(``/view/{id}``, served by ``deskvm serve``) and the replay viewer (``/replay/{rec}/``).
A page signs in without a token in its URL: a token in the URL *fragment* (``#token=``,
never sent by the browser) or typed into its sign-in form is exchanged once for a short
``HttpOnly`` cookie (:mod:`agent_bridge.cookies`); every data request then rides on it.

Data routes (mounted by ``deskvm serve`` and by ``deskvm replay view PATH``):

- ``GET /replay/index.json``: the recordings available, newest first (``[{"id",
  "session_id", "status", "started_at", "ended_at", "duration_s", "events", "frames",
  "image", "display"}]``; ``events`` is counted for an unfinished recording).
- ``GET /replay/{rec}/timeline.json``: manifest, duration and every event with its time
  (``t_s``, seconds since the recording's origin), the frame shown at it (``frame_seq``)
  and the pointer position (``cursor``, display pixels, or ``null``); ``frames`` lists
  ``[pts_s, seq]`` of every frame in time order.
- ``GET /replay/{rec}/frames/{seq}.png``: the picture of frame event ``seq`` (a still as
  stored, or a video frame decoded and PNG-encoded), full resolution.
- ``GET /replay/{rec}/thumbnail.jpg``: the recording's last frame, 320 pixels wide.
- ``GET /replay/{rec}/console.txt``: the guest's console (kernel and boot messages): the
  bundle's ``console.log`` once the session ended, the live console tail before.

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
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from PIL import Image
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_bridge.cookies import SERVER_COOKIE, CookieSigner
from agent_bridge.tokens import TokenError
from orchestrator.errors import RecorderError
from orchestrator.imaging import encode_image
from orchestrator.replay import Recording

__all__ = ["PAGES", "TokenCheck", "assets_router", "page", "replay_router", "viewer_app"]

PAGES = ("index.html", "view.html", "viewer.html")
"""The pages in ``agent_bridge/static``."""
_ASSETS = {"style.css": "text/css", "common.js": "text/javascript"}
_THUMB_WIDTH_PX = 320

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BEARER = HTTPBearer(auto_error=False)


class TokenCheck:
    """FastAPI dependency: ``Authorization: Bearer <token>`` (constant-time compare), or
    the server sign-in cookie of ``cookies`` when no header is sent."""

    def __init__(self, token: str, cookies: CookieSigner | None = None) -> None:
        self._token = token.encode("utf-8")
        self._cookies = cookies

    async def __call__(
        self,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        """Raises: ``HTTPException`` 401."""
        if credentials is None and self._cookies is not None and SERVER_COOKIE in request.cookies:
            try:
                self._cookies.verify(request.cookies[SERVER_COOKIE], "*")
                return
            except TokenError:
                pass  # a 401 below
        offered = b"" if credentials is None else credentials.credentials.encode("utf-8")
        if not hmac.compare_digest(offered, self._token):
            raise StarletteHTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )


def page(name: str) -> str:
    """The HTML of one of :data:`PAGES`."""
    return resources.files("agent_bridge").joinpath(f"static/{name}").read_text("utf-8")


def _page() -> str:
    return page("viewer.html")


def assets_router() -> APIRouter:
    """``GET /static/{name}``: the pages' stylesheet and script (no credentials needed)."""
    router = APIRouter()

    @router.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        media = _ASSETS.get(name)
        if media is None:
            raise StarletteHTTPException(404, f"no asset {name!r}")
        body = resources.files("agent_bridge").joinpath(f"static/{name}").read_bytes()
        return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})

    return router


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
            events, frames = manifest.get("event_count"), None
            counts = manifest.get("counts") or {}
            if isinstance(counts, dict) and "frame" in counts:
                frames = counts["frame"]
            if events is None or frames is None:  # unfinished: count the lines
                events, frames = _count_events(path / "events.jsonl")
            started, ended = manifest.get("started_at"), manifest.get("ended_at")
            if ended is None:
                try:
                    ended = datetime.fromtimestamp(
                        (path / "events.jsonl").stat().st_mtime, UTC
                    ).isoformat()
                except OSError:
                    ended = None
            image = manifest.get("image")
            out.append(
                {
                    "id": name,
                    "session_id": manifest.get("session_id"),
                    "status": manifest.get("status"),
                    "started_at": started,
                    "ended_at": ended,
                    "duration_s": _seconds_between(started, ended),
                    "events": events,
                    "frames": frames,
                    "image": image.get("name") if isinstance(image, dict) else image,
                    "display": manifest.get("display"),
                }
            )
        out.sort(key=lambda r: str(r["started_at"] or ""), reverse=True)
        return out


def _count_events(path: Path) -> tuple[int, int]:
    """(events, frame events) of an events file, counting complete lines."""
    events = frames = 0
    try:
        with path.open("rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    events += 1
                    frames += b'"kind":"frame"' in line
    except OSError:
        pass
    return events, frames


def _seconds_between(start: str | None, end: str | None) -> float | None:
    try:
        if start is None or end is None:
            return None
        elapsed = datetime.fromisoformat(end) - datetime.fromisoformat(start)
        return round(elapsed.total_seconds(), 3)
    except ValueError:
        return None


def _thumbnail(recording: Recording) -> bytes:
    """The last frame, :data:`_THUMB_WIDTH_PX` wide, as JPEG.

    Raises:
        HTTPException: 404 when the recording has no readable frame.
    """
    seq = recording.frame_seq_at(recording.duration_s + 3600)
    if seq is None:
        raise StarletteHTTPException(404, "no frame recorded yet")
    try:
        image = recording.frame_image(seq).convert("RGB")
    except RecorderError as exc:
        raise StarletteHTTPException(404, exc.message) from exc
    height = max(1, round(image.height * _THUMB_WIDTH_PX / image.width))
    image.thumbnail((_THUMB_WIDTH_PX, height), Image.Resampling.BILINEAR)
    return encode_image(image, "jpeg", 75)


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
    recording_dependencies: Sequence[Any] | None = None,
    live_console: Callable[[str], str | None] | None = None,
) -> APIRouter:
    """The ``/replay`` routes.

    Args:
        resolve: recording name -> bundle directory (the name is already checked).
        listing: ``(name, bundle)`` pairs to list on ``/replay/index.json``.
        data_dependencies: FastAPI dependencies guarding the data routes (the token).
        recording_dependencies: guards of one recording's routes (default: the same).
        live_console: recording name -> the live session's console tail (``None`` if the
            session is not live): ``console.txt`` before ``console.log`` is written.
    """
    router = APIRouter(prefix="/replay", tags=["replay"])
    recordings = _Recordings(resolve, listing)
    deps = list(data_dependencies)
    one = list(recording_dependencies) if recording_dependencies is not None else deps

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index_page() -> HTMLResponse:
        return HTMLResponse(page("index.html"))

    @router.get("/index.json", dependencies=deps)
    async def index_json() -> JSONResponse:
        return JSONResponse(await anyio.to_thread.run_sync(recordings.index))

    @router.get("/{name}/", response_class=HTMLResponse, include_in_schema=False)
    async def viewer_page(name: str) -> HTMLResponse:
        return HTMLResponse(_page())

    @router.get("/{name}/thumbnail.jpg", dependencies=one)
    async def thumbnail(name: str) -> Response:
        def build() -> bytes:
            return _thumbnail(recordings.get(name))

        jpeg = await anyio.to_thread.run_sync(build)
        return Response(jpeg, media_type="image/jpeg", headers={"Cache-Control": "no-cache"})

    @router.get("/{name}/console.txt", dependencies=one)
    async def console(name: str) -> PlainTextResponse:
        def read() -> str:
            if not _NAME.match(name):
                raise StarletteHTTPException(404, f"no recording {name!r}")
            live = live_console(name) if live_console is not None else None
            if live is not None:
                return live
            try:
                return (resolve(name) / "console.log").read_text("utf-8", errors="replace")
            except OSError:
                return ""

        return PlainTextResponse(await anyio.to_thread.run_sync(read))

    @router.get("/{name}/timeline.json", dependencies=one)
    async def timeline_json(name: str) -> JSONResponse:
        def build() -> dict[str, Any]:
            return timeline(recordings.get(name))

        return JSONResponse(await anyio.to_thread.run_sync(build))

    @router.get("/{name}/frames/{seq}.png", dependencies=one)
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


def _signed_in(expires_at: float) -> dict[str, Any]:
    when = datetime.fromtimestamp(expires_at, UTC).isoformat()
    return {"session_id": "*", "scope": "admin", "who": "admin", "expires_at": when}


def viewer_app(bundle: Path, *, token: str) -> FastAPI:
    """A stand-alone app that serves one recording as ``/replay/local/``.

    Args:
        bundle: the recording directory.
        token: bearer token the page must present (put it in the URL fragment: the page
            exchanges it for a cookie, ``POST /v1/cookie``).
    """
    app = FastAPI(title="deskvm replay viewer", docs_url=None, redoc_url=None)
    cookies = CookieSigner(ttl_s=3600)
    check = TokenCheck(token, cookies)

    def resolve(name: str) -> Path:
        if name != "local":
            raise StarletteHTTPException(404, f"no recording {name!r}")
        return bundle

    app.include_router(
        replay_router(resolve, lambda: [("local", bundle)], data_dependencies=[Depends(check)])
    )
    app.include_router(assets_router())

    @app.post("/v1/cookie", include_in_schema=False)
    async def sign_in(request: Request) -> Response:
        await check(request, await _BEARER(request))
        value, claims = cookies.sign("*", "admin", "admin", None)
        response = JSONResponse(_signed_in(claims.expires_at))
        response.set_cookie(SERVER_COOKIE, value, max_age=int(cookies.seconds_left(claims)),
                            path="/", httponly=True, samesite="strict")  # fmt: skip
        return response

    @app.get("/v1/cookie", include_in_schema=False)
    async def whoami(request: Request) -> Response:
        value = request.cookies.get(SERVER_COOKIE)
        try:
            claims = cookies.verify(value or "", "*")
        except TokenError:
            raise StarletteHTTPException(401, "not signed in") from None
        return JSONResponse(_signed_in(claims.expires_at))

    @app.get("/", include_in_schema=False)
    async def root(request: Request) -> Response:
        return Response(status_code=307, headers={"Location": "/replay/local/"})

    return app
