"""Asyncio Python client of the bridge: the synchronous client's methods, awaitable.

::

    from agent_bridge import AsyncClient

    async with AsyncClient("http://127.0.0.1:8765", token) as client:
        async with await client.create_session(width=1280, height=800) as session:
            await session.click(200, 150)
            await session.type("echo hi\\n")
            shot = await session.screenshot()        # Screenshot(width, height, mime, png)
            async with session.stream(max_fps=10) as frames:
                async for frame in frames:           # StreamFrame, .image decoded (PIL)
                    ...
    # leaving the inner block deleted the session; the outer one closed the HTTP client

:class:`AsyncClient` mirrors :class:`agent_bridge.client.Client` and
:class:`AsyncSession` mirrors :class:`agent_bridge.client.Session`: same method names,
parameters, units (display pixels, origin top-left; milliseconds; wheel notches), results
and errors (:class:`~agent_bridge.client.RemoteError`,
:class:`~agent_bridge.client.BridgeConnectionError`,
:class:`~orchestrator.errors.SessionClosed`). REST goes through one ``httpx.AsyncClient``;
actions over one WebSocket per session (``websockets.asyncio``), opened on first use.
Requests of one session are sent one at a time (the server runs them one at a time
anyway), so several tasks may share a session.

The live stream is an async iterator of decoded frames (:meth:`AsyncSession.stream`);
decoding runs in a worker thread so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from agent_bridge.client import (
    ActReply,
    BridgeConnectionError,
    ButtonName,
    ExecResult,
    Health,
    RemoteError,
    Screenshot,
    SessionInfo,
    StreamFrame,
    _BridgeClient,
    _closed,
    _http_errors,
    _raise_for_error,
    _ws_errors,
    a11y_message,
    act_reply,
    create_body,
    ended_reason,
    exec_message,
    file_bytes,
    image_of,
    parse_reply,
    put_file_message,
    reply_result,
    socket_url,
    stream_url,
)
from agent_bridge.qa.checks import AsyncVisualChecks
from agent_bridge.qa.model import DEFAULT_TIMEOUT_S, Frame, Match, Point
from orchestrator.errors import DeskvmError, SessionClosed

if TYPE_CHECKING:
    from agent_bridge.qa.match import Reference

__all__ = ["AsyncClient", "AsyncFrameStream", "AsyncSession"]


class AsyncClient(_BridgeClient):
    """Asyncio REST client of one bridge server (see :class:`agent_bridge.client.Client`).

    Args:
        url: the server's base URL, e.g. ``"http://127.0.0.1:8765"``.
        token: the server's bearer token or a session token (sent as
            ``Authorization: Bearer``, never in URLs).
        timeout_s: timeout of each REST call and each WebSocket reply, seconds (a ``wait``
            or ``hold_key`` action gets its own duration on top).
        transport: an ``httpx`` async transport, for tests.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(url, token, timeout_s=timeout_s)
        self._http = httpx.AsyncClient(**self._http_options(), transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP connection pool (sessions stay on the server)."""
        await self._http.aclose()

    async def _request(
        self, method: str, path: str, *, timeout_s: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        with _http_errors(method, path):
            response = await self._http.request(
                method, path, timeout=self._call_timeout_s(timeout_s), **kwargs
            )
        _raise_for_error(response)
        return response

    # --- sessions -----------------------------------------------------------------------

    async def create_session(
        self,
        image: str | None = None,
        width: int = 1280,
        height: int = 800,
        memory_mib: int = 2048,
        vcpus: int = 2,
        boot_timeout_s: float | None = None,
        *,
        cpu_quota_pct: int | None = None,
        disk_mib: int | None = None,
        ttl_s: float | None = None,
        idle_timeout_s: float | None = None,
        approval: Mapping[str, Any] | None = None,
        egress_allow: Sequence[str] | None = None,
        autostart: str | None = None,
        takeover: Mapping[str, Any] | None = None,
        guest_control: bool = False,
        keyboard_layout: str | None = None,
    ) -> AsyncSession:
        """Create a session and wait until its desktop is drawn.

        Parameters as :meth:`agent_bridge.client.Client.create_session`.

        Returns:
            The ready session (its WebSocket opens on the first action).

        Raises:
            RemoteError: ``image_not_found`` (404), ``invalid_request`` (422),
                ``over_capacity`` (503), ``boot_timeout`` (504, ``body["console_tail"]``)...
            BridgeConnectionError: the server is unreachable.
        """
        body, wait_s = create_body(
            image, width, height, memory_mib, vcpus, boot_timeout_s,
            cpu_quota_pct=cpu_quota_pct, disk_mib=disk_mib, ttl_s=ttl_s,
            idle_timeout_s=idle_timeout_s, approval=approval, egress_allow=egress_allow,
            autostart=autostart, takeover=takeover, guest_control=guest_control,
            keyboard_layout=keyboard_layout,
        )  # fmt: skip
        response = await self._request("POST", "/v1/sessions", json=body, timeout_s=wait_s)
        return AsyncSession(self, SessionInfo.from_json(response.json()))

    async def attach(
        self, session_id: str, *, schema: str = "deskvm", query: Mapping[str, str] | None = None
    ) -> AsyncSession:
        """A handle on an existing session (see :meth:`agent_bridge.client.Client.attach`).

        Raises:
            RemoteError: ``session_not_found``.
        """
        info = await self.get_session(session_id)
        return AsyncSession(self, info, schema=schema, query=query)

    async def mint_token(
        self,
        session_id: str,
        scope: Literal["view", "control", "exec", "admin"],
        *,
        ttl_s: float | None = None,
        single_use: bool = False,
    ) -> dict[str, Any]:
        """Mint a token bound to one session.

        Returns:
            ``{"token", "token_id", "session_id", "scope", "expires_at", "single_use"}``.

        Raises:
            RemoteError: ``forbidden`` (403), ``invalid_config`` (422).
        """
        body: dict[str, Any] = {"scope": scope, "single_use": single_use}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        response = await self._request("POST", f"/v1/sessions/{session_id}/tokens", json=body)
        return dict(response.json())

    async def revoke_token(self, session_id: str, token_id: str) -> None:
        """Revoke a minted token (idempotent)."""
        await self._request("DELETE", f"/v1/sessions/{session_id}/tokens/{token_id}")

    async def list_sessions(self) -> list[SessionInfo]:
        """Live sessions, then recently ended ones."""
        response = await self._request("GET", "/v1/sessions")
        return [SessionInfo.from_json(o) for o in response.json()]

    async def get_session(self, session_id: str) -> SessionInfo:
        """One session.

        Raises:
            RemoteError: ``session_not_found`` (404).
        """
        response = await self._request("GET", f"/v1/sessions/{session_id}")
        return SessionInfo.from_json(response.json())

    async def delete_session(self, session_id: str) -> SessionInfo:
        """End a session (fine for an ended one); returns its final description.

        Raises:
            RemoteError: ``session_not_found`` (404), ``hypervisor_error`` (502).
        """
        response = await self._request("DELETE", f"/v1/sessions/{session_id}")
        return SessionInfo.from_json(response.json())

    async def guest_log(self, session_id: str, *, offset: int = 0) -> str:
        """What the guest wrote to ``/dev/ttyS1`` from byte ``offset`` on."""
        path = f"/v1/sessions/{session_id}/guest-log"
        return (await self._request("GET", path, params={"offset": offset})).text

    async def reset_session(self, session_id: str) -> SessionInfo:
        """Return a session to its start state (see :meth:`Client.reset_session`).

        Raises:
            RemoteError: ``reset_unavailable`` (409), ``session_closed`` (409),
                ``hypervisor_error`` (502).
        """
        response = await self._request("POST", f"/v1/sessions/{session_id}/reset")
        return SessionInfo.from_json(response.json())

    async def network(self, session_id: str) -> list[dict[str, Any]]:
        """The session's egress decisions so far (see :meth:`Client.network`)."""
        response = await self._request("GET", f"/v1/sessions/{session_id}/network")
        decisions: list[dict[str, Any]] = response.json()
        return decisions

    async def health(self) -> Health:
        """``GET /healthz``."""
        obj = (await self._request("GET", "/healthz")).json()
        return Health(ok=bool(obj.get("ok")), sessions=int(obj.get("sessions", 0)))

    async def _open_ws(self, url: str, stack: AsyncExitStack) -> ClientConnection:
        """Open a WebSocket whose lifetime ``stack`` manages."""
        with _ws_errors(url):
            return await stack.enter_async_context(connect(url, **self._ws_options()))


class AsyncSession(AsyncVisualChecks):
    """One session, driven over its WebSocket; ``async with`` deletes it on exit.

    The methods are those of :class:`agent_bridge.client.Session`, awaitable. Every action
    raises :class:`RemoteError` for an error reply (the session stays usable),
    :class:`~orchestrator.errors.SessionClosed` if the session ended and
    :class:`BridgeConnectionError` for transport failures.

    Visual checks, awaitable (:class:`~agent_bridge.qa.checks.AsyncVisualChecks`, see
    docs/qa.md): ``await wait_for(ref)``, ``wait_gone``, ``exists``, ``click(ref)``,
    ``async with expect_change()``, ``wait_still``, ``find_text``, ``read_text``;
    matching and OCR run in worker threads.

    Args:
        client: the REST client it belongs to.
        info: the session's description.
        schema: the WebSocket ``schema``; the typed methods need ``deskvm``.
        query: more WebSocket query parameters (``scale_to``, ``max_long_edge``).
    """

    def __init__(
        self,
        client: AsyncClient,
        info: SessionInfo,
        *,
        schema: str = "deskvm",
        query: Mapping[str, str] | None = None,
    ) -> None:
        self.client = client
        self.info_at_start = info
        self.id = info.id
        self.schema = schema
        self.query = dict(query or {})
        self._ws: ClientConnection | None = None
        self._stack = AsyncExitStack()
        self._ids: Iterator[int] = itertools.count(1)
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.delete()

    # --- plumbing -----------------------------------------------------------------------

    async def _socket(self) -> ClientConnection:
        if self._ws is None:
            self._stack = AsyncExitStack()
            url = socket_url(self.info_at_start.ws_url, self.schema, self.query)
            self._ws = await self.client._open_ws(url, self._stack)
        return self._ws

    async def close(self) -> None:
        """Close the WebSocket (the session stays on the server)."""
        self._ws = None
        with contextlib.suppress(ConnectionClosed, OSError):
            await self._stack.aclose()

    async def delete(self) -> SessionInfo | None:
        """Close the WebSocket and delete the session; ``None`` if it was already gone."""
        await self.close()
        try:
            return await self.client.delete_session(self.id)
        except RemoteError as exc:
            if exc.code == "session_not_found":
                return None
            raise

    async def _closed_error(self, exc: ConnectionClosed) -> DeskvmError:
        await self.close()
        error = _closed(exc, f"WebSocket of session {self.id}")
        if isinstance(error, SessionClosed):
            return SessionClosed(f"session {self.id} ended: {ended_reason(error.message)}")
        return error

    async def request(self, message: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """Send one request and return the ``result`` of its reply.

        Args:
            message: ``{"action": ..., ...params}``; an ``id`` is added if missing.
            timeout_s: how long to wait for the reply (default: the client's timeout).

        Returns:
            The reply's ``result`` (as :meth:`agent_bridge.client.Session.request`).

        Raises:
            RemoteError: the reply is an error (``code`` from the server).
            SessionClosed: the session ended (the WebSocket closed with 1001, or the reply
                is ``session_closed``).
            BridgeConnectionError: transport failure or no reply within ``timeout_s``.
        """
        return reply_result(await self._exchange(message, timeout_s))

    async def act(
        self,
        message: Mapping[str, Any],
        *,
        still_ms: int,
        timeout_ms: int = 10_000,
        timeout_s: float | None = None,
    ) -> ActReply:
        """Run one request, then wait for a still screen and screenshot it.

        See :meth:`agent_bridge.client.Session.act`.
        """
        payload = {**message, "screenshot_after": {"still_ms": still_ms, "timeout_ms": timeout_ms}}
        wait_s = timeout_s if timeout_s is not None else self.client.timeout_s + timeout_ms / 1000
        return act_reply(await self._exchange(payload, wait_s))

    async def _exchange(
        self, message: Mapping[str, Any], timeout_s: float | None
    ) -> dict[str, Any]:
        payload = dict(message)
        request_id = payload.setdefault("id", next(self._ids))
        deadline_s = timeout_s if timeout_s is not None else self.client.timeout_s
        async with self._lock:
            ws = await self._socket()
            try:
                await ws.send(json.dumps(payload))
                while True:
                    try:
                        received = await asyncio.wait_for(ws.recv(), deadline_s)
                    except TimeoutError as exc:
                        raise BridgeConnectionError(
                            f"no reply to {payload.get('action')!r} within {deadline_s:.0f} s"
                        ) from exc
                    reply = parse_reply(received)
                    if reply.get("id") == request_id or (
                        reply.get("id") is None and not reply.get("ok", True)
                    ):
                        break
            except ConnectionClosed as exc:
                raise await self._closed_error(exc) from exc
            except (ValueError, AttributeError) as exc:
                raise BridgeConnectionError(f"malformed reply from the server: {exc}") from exc
        return reply

    async def _do(self, action: str, *, extra_wait_ms: int = 0, **params: Any) -> dict[str, Any]:
        message = {"action": action, **{k: v for k, v in params.items() if v is not None}}
        timeout_s = self.client.timeout_s + extra_wait_ms / 1000
        result: dict[str, Any] = await self.request(message, timeout_s=timeout_s)
        return result

    # --- actions ------------------------------------------------------------------------

    async def screenshot(self) -> Screenshot:
        """The whole screen as PNG."""
        return image_of(await self._do("screenshot"))

    async def zoom(self, region: Sequence[int]) -> Screenshot:
        """A full-resolution crop of ``region`` = ``(x0, y0, x1, y1)``, x1/y1 exclusive."""
        return image_of(await self._do("zoom", region=list(region)))

    async def move(self, x: int, y: int) -> None:
        """Move the pointer to ``(x, y)``."""
        await self._do("move", x=x, y=y)

    @overload
    async def click(
        self,
        x: int | None = None,
        y: int | None = None,
        button: ButtonName = "left",
        count: int = 1,
        *,
        hold: str | None = None,
    ) -> None: ...

    @overload
    async def click(
        self,
        x: str | Reference | Match,
        *,
        button: ButtonName = "left",
        count: int = 1,
        hold: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Match: ...

    async def click(
        self,
        x: int | str | Reference | Match | None = None,
        y: int | None = None,
        button: ButtonName = "left",
        count: int = 1,
        *,
        hold: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Match | None:
        """Click ``count`` (1..3) times at ``(x, y)`` (or where the pointer is), or on a
        reference (see :meth:`agent_bridge.client.Session.click`)."""
        if x is not None and not isinstance(x, int | float):  # a reference or a match
            if y is not None:
                raise TypeError("click(ref) takes no y coordinate")
            return await self.click_ref(
                x, timeout_s=timeout_s, button=button, count=count, hold=hold
            )
        await self._do("click", x=x, y=y, button=button, count=count, hold=hold)
        return None

    async def _qa_frame(self) -> Frame:
        """The whole screen at full resolution with its place in the recording and the
        pointer (see :meth:`agent_bridge.client.Session._qa_frame`); decoded in a thread."""
        from agent_bridge.qa.refs import decode_png

        mono_s = time.monotonic()
        pointer = Point(*await self.cursor_position())
        if self.query.get("scale_to") or self.query.get("max_long_edge"):
            info = self.info_at_start
            shot = await self.zoom((0, 0, info.width, info.height))
        else:
            shot = await self.screenshot()
        pixels = await asyncio.to_thread(decode_png, shot.png, where="screenshot")
        return Frame(pixels, shot.frame_seq, shot.t_s, shot.png, mono_s, pointer)

    async def _qa_click_at(
        self, point: Point, *, button: str, count: int, hold: str | None
    ) -> None:
        await self._do("click", x=point.x, y=point.y, button=button, count=count, hold=hold)

    async def double_click(
        self, x: int | None = None, y: int | None = None, button: ButtonName = "left"
    ) -> None:
        """Two clicks at ``(x, y)``."""
        await self._do("double_click", x=x, y=y, button=button)

    async def triple_click(
        self, x: int | None = None, y: int | None = None, button: ButtonName = "left"
    ) -> None:
        """Three clicks at ``(x, y)``."""
        await self._do("triple_click", x=x, y=y, button=button)

    async def mouse_down(
        self, button: ButtonName = "left", x: int | None = None, y: int | None = None
    ) -> None:
        """Press ``button`` (at ``(x, y)`` if given) and keep it pressed."""
        await self._do("mouse_down", button=button, x=x, y=y)

    async def mouse_up(
        self, button: ButtonName = "left", x: int | None = None, y: int | None = None
    ) -> None:
        """Release ``button`` (at ``(x, y)`` if given)."""
        await self._do("mouse_up", button=button, x=x, y=y)

    async def type(self, text: str, secret: bool = False) -> None:
        """Type ``text`` (``\\n`` is Return, ``\\t`` Tab); ``secret`` is not recorded in clear."""
        await self._do("type", text=text, secret=secret, extra_wait_ms=len(text) * 50)

    async def key(self, keys: str) -> None:
        """Press key combos in order, e.g. ``"ctrl+shift+t"`` or ``"ctrl+a ctrl+c"``."""
        await self._do("key", keys=keys)

    async def hold_key(self, keys: str, duration_ms: int) -> None:
        """Hold ``keys`` down for ``duration_ms`` milliseconds."""
        await self._do("hold_key", keys=keys, duration_ms=duration_ms, extra_wait_ms=duration_ms)

    async def scroll(
        self,
        x: int | None = None,
        y: int | None = None,
        dx: int = 0,
        dy: int = 0,
        hold: str | None = None,
    ) -> None:
        """Turn the wheel ``dy`` notches down (negative: up) and ``dx`` right at ``(x, y)``."""
        await self._do("scroll", x=x, y=y, dx=dx, dy=dy, hold=hold)

    async def drag(self, path: Sequence[Sequence[int]], button: ButtonName = "left") -> None:
        """Press at ``path[0]``, move through every point, release at ``path[-1]``."""
        await self._do("drag", path=[list(p) for p in path], button=button)

    async def wait(self, ms: int) -> None:
        """Let the server wait ``ms`` milliseconds (recorded; the reply comes after)."""
        await self._do("wait", ms=ms, extra_wait_ms=ms)

    async def cursor_position(self) -> tuple[int, int]:
        """Where the host last put the pointer, display pixels."""
        result = await self._do("cursor_position")
        return int(result["x"]), int(result["y"])

    # --- guest control (sessions created with guest_control=True; token scope exec) ------

    async def exec(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        *,
        secret: bool = False,
    ) -> ExecResult:
        """Run ``argv`` in the guest; as :meth:`agent_bridge.client.Session.exec`."""
        message, wait_s = exec_message(argv, stdin, timeout_s, env, secret)
        result = await self.request(message, timeout_s=max(wait_s, self.client.timeout_s))
        return ExecResult.from_result(result)

    async def put_file(self, path: str, data: bytes, *, secret: bool = False) -> dict[str, Any]:
        """Write ``data`` to ``path`` in the guest; ``{path, size_bytes, sha256}``."""
        result: dict[str, Any] = await self.request(put_file_message(path, data, secret))
        return result

    async def get_file(self, path: str) -> bytes:
        """The content of the guest file at ``path`` (checked against its sha256)."""
        return file_bytes(await self.request({"action": "get_file", "path": path}))

    async def clipboard_get(self) -> str:
        """The text of the guest's CLIPBOARD selection."""
        return str((await self._do("clipboard_get"))["text"])

    async def clipboard_set(self, text: str, *, secret: bool = False) -> None:
        """Make ``text`` the guest's CLIPBOARD (and PRIMARY) selection."""
        await self._do("clipboard_set", text=text, secret=secret or None)

    async def windows(self) -> list[dict[str, Any]]:
        """The guest's top-level windows (see :meth:`agent_bridge.client.Session.windows`)."""
        return list((await self._do("windows"))["windows"])

    async def window_activate(self, id: int) -> None:
        """Raise and focus window ``id``."""
        await self._do("window_activate", window_id=id)

    async def window_close(self, id: int) -> None:
        """Ask window ``id`` to close."""
        await self._do("window_close", window_id=id)

    async def a11y_tree(
        self, window_id: int | None = None, max_nodes: int | None = None
    ) -> dict[str, Any]:
        """The AT-SPI tree of the desktop or of one window (``{tree, truncated, nodes}``)."""
        result: dict[str, Any] = await self.request(
            a11y_message(window_id, max_nodes), timeout_s=max(self.client.timeout_s, 70.0)
        )
        return result

    async def set_resolution(self, width: int, height: int) -> tuple[int, int]:
        """Change the display size while the session runs; returns the new size."""
        result = await self._do("set_resolution", width=width, height=height,
                                extra_wait_ms=30_000)  # fmt: skip
        return int(result["width"]), int(result["height"])

    # --- live stream --------------------------------------------------------------------

    def stream(
        self,
        codec: Literal["jpeg", "webp", "png"] = "jpeg",
        quality: int = 80,
        max_fps: float = 15.0,
        max_long_edge: int | None = None,
        *,
        decode: bool = True,
    ) -> AsyncFrameStream:
        """The session's live stream (``/v1/sessions/{id}/stream``, view scope).

        Use it as ``async with session.stream(...) as frames: async for frame in frames``
        (the socket opens on entry). Arguments as :meth:`agent_bridge.client.Session.stream`.
        """
        url = stream_url(self.info_at_start.ws_url, codec, quality, max_fps, max_long_edge)
        return AsyncFrameStream(self.client, url, decode=decode)

    # --- REST shortcuts -----------------------------------------------------------------

    async def guest_log(self) -> str:
        """What the guest wrote to ``/dev/ttyS1`` so far."""
        return await self.client.guest_log(self.id)

    async def reset(self) -> SessionInfo:
        """Return the desktop to its start state (see :meth:`Client.reset_session`)."""
        return await self.client.reset_session(self.id)

    async def info(self) -> SessionInfo:
        """The session's current description (state, recording, cursor...)."""
        return await self.client.get_session(self.id)

    async def network(self) -> list[dict[str, Any]]:
        """The session's egress decisions so far."""
        return await self.client.network(self.id)


class AsyncFrameStream:
    """A live stream: ``async with`` opens it, ``async for`` yields :class:`StreamFrame`
    objects (decoded unless ``decode=False``) until the session ends.

    Only changed screens are sent, so waiting blocks while the screen is still;
    :meth:`next` takes a timeout.

    Attributes:
        hello: the server's ``hello`` event, once open.
        status: the newest ``status`` event (``state``, ``pending``...), if any came.

    Raises (on entry):
        RemoteError: ``invalid_query``, ``session_not_found``...
        BridgeConnectionError: the handshake failed (e.g. HTTP 403: bad token).
    """

    def __init__(self, client: AsyncClient, url: str, *, decode: bool) -> None:
        self._client = client
        self._url = url
        self._decode = decode
        self._stack = AsyncExitStack()
        self._ws: ClientConnection | None = None
        self.hello: dict[str, Any] = {}
        self.status: dict[str, Any] | None = None

    async def open(self) -> AsyncFrameStream:
        """Open the socket and read the ``hello`` (``async with`` does this)."""
        if self._ws is not None:
            return self
        self._ws = await self._client._open_ws(self._url, self._stack)
        try:
            event = json.loads(await asyncio.wait_for(self._ws.recv(), 30))
        except ConnectionClosed as exc:
            await self.close()
            raise _closed(exc, "the stream's WebSocket") from exc
        except (TimeoutError, ValueError) as exc:
            await self.close()
            raise BridgeConnectionError(f"the stream sent no hello: {exc}") from exc
        if event.get("event") != "hello":
            await self.close()
            reply_result(event)  # raises RemoteError for a refusal
            raise BridgeConnectionError(f"unexpected first stream message: {event!r}")
        self.hello = dict(event)
        return self

    async def __aenter__(self) -> AsyncFrameStream:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[StreamFrame]:
        return self

    async def __anext__(self) -> StreamFrame:
        frame = await self.next()
        if frame is None:
            raise StopAsyncIteration
        return frame

    async def next(self, timeout_s: float | None = None) -> StreamFrame | None:
        """The next frame; ``None`` once the session has ended.

        Raises:
            TimeoutError: no frame within ``timeout_s`` (the screen was still).
            BridgeConnectionError: the connection failed or closed otherwise.
        """
        ws = self._ws if self._ws is not None else (await self.open())._ws
        assert ws is not None
        while True:
            try:
                message = await asyncio.wait_for(ws.recv(), timeout_s)
            except ConnectionClosed as exc:
                await self.close()
                error = _closed(exc, "the stream's WebSocket")
                if isinstance(error, SessionClosed):
                    return None
                raise error from exc
            if isinstance(message, bytes):
                if not self._decode:
                    return StreamFrame.from_message(message, decode=False)
                return await asyncio.to_thread(StreamFrame.from_message, message, decode=True)
            with contextlib.suppress(ValueError):
                event = json.loads(message)
                if event.get("event") == "status":
                    self.status = dict(event)

    async def close(self) -> None:
        """Close the socket (idempotent)."""
        self._ws = None
        with contextlib.suppress(ConnectionClosed, OSError):
            await self._stack.aclose()
