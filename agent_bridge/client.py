"""Synchronous Python client of the bridge, for QA scripts, notebooks and pytest.

::

    from agent_bridge import Client

    with Client("http://127.0.0.1:8765", token) as client:
        with client.create_session(width=1280, height=800) as session:
            session.click(200, 150)
            session.type("echo hi\\n")
            shot = session.screenshot()          # Screenshot(width, height, mime, png)
    # leaving the inner block deleted the session; the outer one closed the HTTP client

REST calls go through one ``httpx.Client``; actions go over one WebSocket per
:class:`Session` (``websockets.sync.client``), opened on first use. Errors::

    DeskvmError (orchestrator.errors)
    ├── RemoteError            the server answered an error (REST body or WS error reply);
    │                          ``code`` is the server's code (``out_of_screen``...)
    ├── BridgeConnectionError  transport failure: refused, reset, timed out, handshake denied,
    │                          WebSocket closed (``close_code``, ``close_reason``)
    └── SessionClosed          the session ended: the server closed the WebSocket (1001) or
                               answered a request ``session_closed``

``httpx`` and ``websockets`` exceptions never escape: they are translated here, with the
original as ``__cause__``. See ``docs/protocol.md`` for the wire protocol.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload
from urllib.parse import urlencode

import httpx
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.protocol import State
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from agent_bridge.qa.checks import VisualChecks
from agent_bridge.qa.model import DEFAULT_TIMEOUT_S, Frame, Match, Point
from orchestrator.errors import DeskvmError, SessionClosed

if TYPE_CHECKING:
    from PIL import Image

    from agent_bridge.qa.match import Reference

__all__ = [
    "ActReply",
    "BridgeConnectionError",
    "Client",
    "ExecResult",
    "FrameStream",
    "Health",
    "RemoteError",
    "Screenshot",
    "Session",
    "SessionInfo",
    "SettledScreenshot",
    "StreamFrame",
    "ended_reason",
]

_CLOSE_GOING_AWAY = 1001
_MAX_REPLY_BYTES = 96 * 1024 * 1024
"""Largest reply taken: a 4096x4096 screenshot of pure noise is a ~50 MB PNG, ~67 MB in
base64 (the JSON reply's encoding), so the whole documented display range fits."""
_BOOT_MARGIN_S = 30.0
_GUEST_MARGIN_S = 15.0
"""Time a guest exec reply may take beyond its timeout_s (the host's own margin is 10 s)."""

ButtonName = Literal["left", "middle", "right", "back", "forward"]


class RemoteError(DeskvmError):
    """The server answered with an error.

    Attributes:
        code: the server's error code (``"out_of_screen"``, ``"image_not_found"``...).
        status: HTTP status for REST errors, ``None`` for WebSocket error replies.
        body: the server's ``error`` object as received (may hold ``console_tail``,
            ``details``).
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.body: dict[str, Any] = dict(body or {})

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BridgeConnectionError(DeskvmError):
    """The server could not be reached, or the connection failed or closed.

    Attributes:
        close_code: the WebSocket close code, when a WebSocket closed (RFC 6455 7.4).
        close_reason: the close frame's reason text.
    """

    code = "connection_error"

    def __init__(
        self, message: str, *, close_code: int | None = None, close_reason: str = ""
    ) -> None:
        super().__init__(message)
        self.close_code = close_code
        self.close_reason = close_reason


@dataclass(frozen=True, slots=True)
class Screenshot:
    """A PNG of the screen (or of a zoomed region).

    Attributes:
        width: image width, pixels.
        height: image height, pixels.
        mime: ``"image/png"``.
        png: the encoded image.
        frame_seq: the recording's frame event it was cut from (``None`` if the server
            did not say).
        t_s: that frame's time in the recording, seconds (``deskvm replay frames --at``).
    """

    width: int
    height: int
    mime: str
    png: bytes = field(repr=False)
    frame_seq: int | None = None
    t_s: float | None = None

    def image(self) -> Image.Image:
        """The decoded image (needs Pillow)."""
        import io

        from PIL import Image

        return Image.open(io.BytesIO(self.png))

    def save(self, path: str) -> None:
        """Write the PNG bytes to ``path``."""
        with open(path, "wb") as f:
            f.write(self.png)


@dataclass(frozen=True, slots=True)
class SessionInfo(Mapping[str, Any]):
    """A session as ``GET /v1/sessions/{id}`` describes it.

    Typed attributes for the common fields; it is also a read-only mapping over the whole
    JSON object (``info["created_at"]``, ``info.get("recording")``, ``dict(info)``).

    Attributes:
        id: session id.
        state: ``starting``, ``ready``, ``closing``, ``closed`` or ``failed``.
        ws_url: WebSocket URL for actions.
        image: image name.
        width: display width, pixels.
        height: display height, pixels.
        recording: recording bundle directory on the server host.
        boot_s: seconds from domain start to ready, if it became ready.
        cursor: last pointer position set by the host, display pixels.
        raw: the whole JSON object (created_at, ready_at, memory_mib, vcpus...).
    """

    id: str
    state: str
    ws_url: str
    image: str
    width: int
    height: int
    recording: str | None
    boot_s: float | None
    cursor: tuple[int, int]
    raw: Mapping[str, Any] = field(repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SessionInfo:
        """Parse the server's JSON object.

        Raises:
            BridgeConnectionError: the object is not a session description.
        """
        try:
            return cls(
                id=str(obj["id"]),
                state=str(obj["state"]),
                ws_url=str(obj["ws_url"]),
                image=str(obj["image"]),
                width=int(obj["display"]["width"]),
                height=int(obj["display"]["height"]),
                recording=obj.get("recording"),
                boot_s=obj.get("boot_s"),
                cursor=(int(obj["cursor"]["x"]), int(obj["cursor"]["y"])),
                raw=dict(obj),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BridgeConnectionError(f"unexpected session description: {obj!r}") from exc


@dataclass(frozen=True, slots=True)
class Health:
    """``GET /healthz``: ``ok`` and the number of live sessions."""

    ok: bool
    sessions: int


@dataclass(frozen=True, slots=True)
class ExecResult:
    """What a guest ``exec`` returned (see ``docs/protocol.md``, guest control).

    Attributes:
        exit_code: the process's exit status; ``-N`` when signal ``N`` killed it (``-9``
            after ``timeout_s``); 127: no such program.
        stdout, stderr: the outputs, UTF-8 decoded (invalid bytes replaced), each cut at
            ``cap_bytes`` bytes.
        stdout_truncated, stderr_truncated: whether output was cut.
        cap_bytes: the cap on each output, bytes.
        timed_out: the process ran past ``timeout_s`` and was killed.
    """

    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    cap_bytes: int = 0
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Exit code 0."""
        return self.exit_code == 0

    @classmethod
    def from_result(cls, result: Mapping[str, Any]) -> ExecResult:
        return cls(
            exit_code=int(result["exit_code"]),
            stdout=str(result["stdout"]),
            stderr=str(result["stderr"]),
            stdout_truncated=bool(result.get("stdout_truncated", False)),
            stderr_truncated=bool(result.get("stderr_truncated", False)),
            cap_bytes=int(result.get("cap_bytes", 0)),
            timed_out=bool(result.get("timed_out", False)),
        )


def exec_message(
    argv: Sequence[str],
    stdin: str | None,
    timeout_s: float,
    env: Mapping[str, str] | None,
    secret: bool,
) -> tuple[dict[str, Any], float]:
    """The ``exec`` request and how long to wait for its reply (seconds).

    Raises:
        TypeError: ``argv`` is a string (give a list: no shell is involved).
    """
    if isinstance(argv, str):
        raise TypeError("argv must be a list of strings, not a string (no shell is involved)")
    message: dict[str, Any] = {"action": "exec", "argv": list(argv), "timeout_s": timeout_s}
    if stdin is not None:
        message["stdin"] = stdin
    if env:
        message["env"] = dict(env)
    if secret:
        message["secret"] = True
    return message, timeout_s + _GUEST_MARGIN_S


def put_file_message(path: str, data: bytes, secret: bool) -> dict[str, Any]:
    """The ``put_file`` request for ``data`` (bytes) at ``path``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError("data must be bytes (encode text first)")
    encoded = base64.b64encode(bytes(data)).decode("ascii")
    message: dict[str, Any] = {"action": "put_file", "path": path, "data_b64": encoded}
    if secret:
        message["secret"] = True
    return message


def a11y_message(window_id: int | None, max_nodes: int | None) -> dict[str, Any]:
    """The ``a11y_tree`` request."""
    message: dict[str, Any] = {"action": "a11y_tree"}
    if window_id is not None:
        message["window_id"] = window_id
    if max_nodes is not None:
        message["max_nodes"] = max_nodes
    return message


def file_bytes(result: Mapping[str, Any]) -> bytes:
    """The content of a ``get_file`` result, checked against its ``sha256``.

    Raises:
        BridgeConnectionError: the content does not match its hash (corrupted in transit).
    """
    data = base64.b64decode(result["data_b64"])
    if hashlib.sha256(data).hexdigest() != result.get("sha256"):
        raise BridgeConnectionError("get_file: the content does not match its sha256")
    return data


def create_body(
    image: str | None,
    width: int,
    height: int,
    memory_mib: int,
    vcpus: int,
    boot_timeout_s: float | None,
    *,
    cpu_quota_pct: int | None,
    disk_mib: int | None,
    ttl_s: float | None,
    idle_timeout_s: float | None,
    approval: Mapping[str, Any] | None,
    egress_allow: Sequence[str] | None,
    autostart: str | None,
    takeover: Mapping[str, Any] | None = None,
    guest_control: bool = False,
    keyboard_layout: str | None = None,
) -> tuple[dict[str, Any], float]:
    """The ``POST /v1/sessions`` body and how long to wait for its answer (seconds).

    Raises:
        TypeError: ``egress_allow`` is a string.
    """
    body: dict[str, Any] = {
        "display": {"width": width, "height": height},
        "memory_mib": memory_mib,
        "vcpus": vcpus,
    }
    if image is not None:
        body["image"] = image
    if boot_timeout_s is not None:
        body["boot_timeout_s"] = boot_timeout_s
    for key, value in (
        ("cpu_quota_pct", cpu_quota_pct),
        ("disk_mib", disk_mib),
        ("ttl_s", ttl_s),
        ("idle_timeout_s", idle_timeout_s),
        ("approval", dict(approval) if approval is not None else None),
        ("autostart", autostart),
        ("takeover", dict(takeover) if takeover is not None else None),
        ("keyboard_layout", keyboard_layout),
    ):
        if value is not None:
            body[key] = value
    if guest_control:
        body["guest_control"] = True
    if egress_allow is not None:
        if isinstance(egress_allow, str):
            raise TypeError("egress_allow must be a list of entries, not a string")
        body["egress"] = {"allow": list(egress_allow)}
    wait_s = (boot_timeout_s + _BOOT_MARGIN_S) if boot_timeout_s is not None else 900.0
    return body, wait_s


def socket_url(ws_url: str, schema: str = "deskvm", query: Mapping[str, str] | None = None) -> str:
    """The action WebSocket URL with its query (``schema`` only when not ``deskvm``).

    ``schema=deskvm`` asks for binary images (``images=binary``) unless ``query`` says
    otherwise.
    """
    params = {**({"images": "binary"} if schema == "deskvm" else {"schema": schema}),
              **(query or {})}  # fmt: skip
    return f"{ws_url}?{urlencode(params)}" if params else ws_url


def stream_url(
    ws_url: str, codec: str, quality: int, max_fps: float, max_long_edge: int | None
) -> str:
    """The stream URL of the session whose action WebSocket is ``ws_url``."""
    params: dict[str, str] = {"codec": codec, "quality": str(quality), "max_fps": f"{max_fps:g}"}
    if max_long_edge is not None:
        params["max_long_edge"] = str(max_long_edge)
    base = ws_url.split("?", 1)[0].removesuffix("/ws")
    return f"{base}/stream?{urlencode(params)}"


def reply_result(reply: Mapping[str, Any]) -> Any:
    """The ``result`` of a reply, or the error it carries raised.

    Raises:
        SessionClosed: an error reply ``session_closed`` (the session ended while the
            WebSocket was still open: the same as the server closing it with 1001, which
            of the two a client sees depends only on timing).
        RemoteError: any other error reply.
    """
    if reply.get("ok"):
        return reply.get("result", {})
    error = reply.get("error") or {}
    code, message = str(error.get("code", "unknown_error")), str(error.get("message", ""))
    if code == SessionClosed.code:
        raise SessionClosed(message or "the session ended")
    raise RemoteError(code, message, body=error)


def image_of(result: Mapping[str, Any]) -> Screenshot:
    """The :class:`Screenshot` in a ``screenshot``/``zoom`` result (base64 or bytes data)."""
    data = result["data"]
    frame_seq, t_s = result.get("frame_seq"), result.get("t_s")
    return Screenshot(
        width=int(result["width"]),
        height=int(result["height"]),
        mime=str(result["mime"]),
        png=data if isinstance(data, bytes) else base64.b64decode(data),
        frame_seq=int(frame_seq) if frame_seq is not None else None,
        t_s=float(t_s) if t_s is not None else None,
    )


def parse_reply(message: str | bytes) -> dict[str, Any]:
    """A reply message as a dict; a binary reply's images go into ``data`` as ``bytes``.

    Raises:
        ValueError: not a reply.
    """
    if isinstance(message, str):
        reply = json.loads(message)
        if not isinstance(reply, dict):
            raise ValueError("the reply is not a JSON object")
        return reply
    from agent_bridge.protocol.replies import decode_binary_reply

    try:
        reply, blobs = decode_binary_reply(message)
    except DeskvmError as exc:
        raise ValueError(exc.message) from None
    for part in (reply.get("result"), reply.get("screenshot_after")):
        if isinstance(part, dict) and isinstance(part.get("blob"), int):
            part["data"] = blobs[part.pop("blob")]
    return reply


@dataclass(frozen=True, slots=True)
class SettledScreenshot(Screenshot):
    """The screen once it was still (``screenshot_after``).

    Attributes:
        settled: ``False`` if the screen kept changing until the timeout.
        waited_ms: how long the server waited, milliseconds.
    """

    settled: bool = True
    waited_ms: int = 0


@dataclass(frozen=True, slots=True)
class ActReply:
    """What :meth:`Session.act` returns.

    Attributes:
        result: the request's ``result`` (as :meth:`Session.request` returns it).
        screenshot: the screen once still.
    """

    result: Any
    screenshot: SettledScreenshot


def act_reply(reply: Mapping[str, Any]) -> ActReply:
    """The :class:`ActReply` of a reply to a request with ``screenshot_after``.

    Raises:
        RemoteError: an error reply.
        BridgeConnectionError: the reply has no ``screenshot_after``.
    """
    result = reply_result(reply)
    after = reply.get("screenshot_after")
    if not isinstance(after, Mapping):
        raise BridgeConnectionError("the server's reply has no screenshot_after (too old?)")
    shot = image_of(after)
    settled = SettledScreenshot(
        shot.width, shot.height, shot.mime, shot.png, shot.frame_seq, shot.t_s,
        settled=bool(after.get("settled")), waited_ms=int(after.get("waited_ms", 0)),
    )  # fmt: skip
    return ActReply(result, settled)


@dataclass(frozen=True, slots=True)
class StreamFrame:
    """One frame of the live stream (see ``docs/protocol.md``, "Live stream").

    Attributes:
        frame: the session's frame number (gaps: frames this viewer skipped).
        pts_ns: capture time, ``CLOCK_MONOTONIC`` ns of the server host.
        width: image width, pixels.
        height: image height, pixels.
        codec: ``"jpeg"``, ``"webp"`` or ``"png"``.
        data: the encoded image file.
        first: the connection's first frame (the screen as it was when it opened).
        image: the decoded image (RGB) when the stream decodes, else ``None``.
    """

    frame: int
    pts_ns: int
    width: int
    height: int
    codec: str
    data: bytes = field(repr=False)
    first: bool
    image: Image.Image | None = field(default=None, repr=False)

    @classmethod
    def from_message(cls, message: bytes, *, decode: bool) -> StreamFrame:
        """Parse (and optionally decode) one binary stream message.

        Raises:
            BridgeConnectionError: not a stream frame (``invalid_frame``).
        """
        from agent_bridge.protocol.stream import decode_frame

        try:
            header, data = decode_frame(message)
        except DeskvmError as exc:
            raise BridgeConnectionError(f"malformed stream frame: {exc.message}") from exc
        image = None
        if decode:
            import io

            from PIL import Image

            with Image.open(io.BytesIO(data)) as opened:
                image = opened.convert("RGB")
        return cls(
            header.frame, header.pts_ns, header.width_px, header.height_px, header.codec, data,
            header.first, image,
        )  # fmt: skip


def _raise_for_error(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        error, code, message = {}, "http_error", response.text[:500]
    raise RemoteError(code, message, status=response.status_code, body=error)


@contextlib.contextmanager
def _http_errors(method: str, path: str) -> Iterator[None]:
    """Translate httpx's transport errors of one REST call into :class:`BridgeConnectionError`."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise BridgeConnectionError(f"{method} {path}: timed out ({exc})") from exc
    except httpx.HTTPError as exc:
        raise BridgeConnectionError(f"{method} {path}: {exc}") from exc


@contextlib.contextmanager
def _ws_errors(url: str) -> Iterator[None]:
    """Translate a failed WebSocket opening handshake into :class:`BridgeConnectionError`."""
    ws_url = url.split("?", 1)[0]  # the query may carry a token: never in a message
    try:
        yield
    except InvalidStatus as exc:
        status = exc.response.status_code
        raise BridgeConnectionError(
            f"WebSocket handshake to {ws_url} refused with HTTP {status}"
            + (" (wrong token?)" if status in (401, 403) else "")
        ) from exc
    except (InvalidHandshake, OSError, TimeoutError) as exc:
        raise BridgeConnectionError(f"cannot open WebSocket {ws_url}: {exc}") from exc


class _BridgeClient:
    """What :class:`Client` and :class:`~agent_bridge.async_client.AsyncClient` share: the
    server, the token, the timeout and the options their HTTP and WebSocket calls take."""

    def __init__(self, url: str, token: str, *, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._token = token

    def __repr__(self) -> str:  # never show the token
        return f"{type(self).__name__}({self.url!r})"

    def _http_options(self) -> dict[str, Any]:
        """The httpx client's options: base URL, bearer token, default timeout."""
        return {
            "base_url": self.url,
            "headers": {"Authorization": f"Bearer {self._token}"},
            "timeout": self.timeout_s,
        }

    def _call_timeout_s(self, timeout_s: float | None) -> float:
        return timeout_s if timeout_s is not None else self.timeout_s

    def _ws_options(self) -> dict[str, Any]:
        """``websockets`` ``connect`` options: bearer token, subprotocol, timeout, size cap."""
        return {
            "additional_headers": {"Authorization": f"Bearer {self._token}"},
            "subprotocols": [Subprotocol("deskvm.v1")],
            "open_timeout": self.timeout_s,
            "max_size": _MAX_REPLY_BYTES,
        }


class Client(_BridgeClient):
    """REST client of one bridge server.

    Args:
        url: the server's base URL, e.g. ``"http://127.0.0.1:8765"``.
        token: the server's bearer token (sent as ``Authorization: Bearer``, never in URLs).
        timeout_s: timeout of each REST call and each WebSocket reply, seconds (a ``wait``
            or ``hold_key`` action gets its own duration on top).
        transport: an ``httpx`` transport, for tests (e.g. ``httpx.MockTransport``).
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, token, timeout_s=timeout_s)
        self._http = httpx.Client(**self._http_options(), transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP connection pool (sessions stay on the server)."""
        self._http.close()

    def _request(
        self, method: str, path: str, *, timeout_s: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        with _http_errors(method, path):
            response = self._http.request(
                method, path, timeout=self._call_timeout_s(timeout_s), **kwargs
            )
        _raise_for_error(response)
        return response

    # --- sessions -----------------------------------------------------------------------

    def create_session(
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
    ) -> Session:
        """Create a session and wait until its desktop is drawn.

        Args:
            image: built image name; ``None`` for the server's default.
            width: display width, pixels (multiple of 8, 320..4096).
            height: display height, pixels (320..4096).
            memory_mib: guest RAM, MiB.
            vcpus: virtual CPUs.
            boot_timeout_s: boot deadline, seconds; ``None`` for the server's default.
                The HTTP call waits this long plus a margin (or 15 minutes without one).
            cpu_quota_pct, disk_mib, ttl_s, idle_timeout_s: host-enforced limits (see
                ``docs/protocol.md``); ``None`` for the server's defaults.
            approval: the approval policy (``{"kinds": [...], "key_combos": [...],
                "text_patterns": [...], "every_action": bool, "timeout_s": s}``).
            egress_allow: the egress allowlist (``CIDR[:port]``, ``example.org``,
                ``*.example.org``, optionally ``:port``); ``None`` (default): the guest has
                no network device at all; ``[]``: a NIC that reaches nothing.
            autostart: ``"input-probe"`` starts the guest's input probe instead of the
                xterm (ready once the probe reports ``probe_ready``); ``None``: the xterm.
            takeover: what the agent's input gets while a person has taken over:
                ``{"agent": "refuse"}`` (default; error ``human_in_control``) or
                ``{"agent": "wait", "wait_timeout_s": 600}``.
            guest_control: allow the guest control plane on this session (:meth:`Session.exec`,
                files, clipboard, windows, accessibility tree, resolution; needs a token of
                scope ``exec``). Off by default.
            keyboard_layout: the guest's keyboard layout, ``"us"``, ``"de"`` or ``"fr"``
                (typing and key combos follow it); ``None``: the image's.

        Returns:
            The ready session (its WebSocket opens on the first action).

        Raises:
            RemoteError: ``image_not_found`` (404), ``invalid_request`` (422),
                ``invalid_egress`` (422, names the malformed entry),
                ``egress_not_configured`` (422), ``over_capacity`` (503), ``boot_timeout``
                (504, ``body["console_tail"]``), ``hypervisor_error`` / ``egress_error``
                (502).
            BridgeConnectionError: the server is unreachable.
        """
        body, wait_s = create_body(
            image, width, height, memory_mib, vcpus, boot_timeout_s,
            cpu_quota_pct=cpu_quota_pct, disk_mib=disk_mib, ttl_s=ttl_s,
            idle_timeout_s=idle_timeout_s, approval=approval, egress_allow=egress_allow,
            autostart=autostart, takeover=takeover, guest_control=guest_control,
            keyboard_layout=keyboard_layout,
        )  # fmt: skip
        response = self._request("POST", "/v1/sessions", json=body, timeout_s=wait_s)
        return Session(self, SessionInfo.from_json(response.json()))

    def attach(
        self, session_id: str, *, schema: str = "deskvm", query: Mapping[str, str] | None = None
    ) -> Session:
        """A client-side handle on an existing session (e.g. created by someone else).

        Args:
            session_id: the session.
            schema: the WebSocket vocabulary.
            query: more WebSocket query parameters, e.g. ``{"scale_to": "1024x640"}`` or
                ``{"max_long_edge": "1024"}`` (see ``docs/protocol.md``).

        Raises:
            RemoteError: ``session_not_found``.
        """
        return Session(self, self.get_session(session_id), schema=schema, query=query)

    def mint_token(
        self,
        session_id: str,
        scope: Literal["view", "control", "exec", "admin"],
        *,
        ttl_s: float | None = None,
        single_use: bool = False,
    ) -> dict[str, Any]:
        """Mint a token bound to one session (needs the admin token or a session admin token).

        Returns:
            ``{"token", "token_id", "session_id", "scope", "expires_at", "single_use"}``;
            pass ``token`` to ``Client(url, token)`` to act with that scope.

        Raises:
            RemoteError: ``forbidden`` (403), ``invalid_config`` (422: ``ttl_s`` too long).
        """
        body: dict[str, Any] = {"scope": scope, "single_use": single_use}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        response = self._request("POST", f"/v1/sessions/{session_id}/tokens", json=body)
        return dict(response.json())

    def revoke_token(self, session_id: str, token_id: str) -> None:
        """Revoke a minted token (idempotent)."""
        self._request("DELETE", f"/v1/sessions/{session_id}/tokens/{token_id}")

    def list_sessions(self) -> list[SessionInfo]:
        """Live sessions, then recently ended ones."""
        return [SessionInfo.from_json(o) for o in self._request("GET", "/v1/sessions").json()]

    def get_session(self, session_id: str) -> SessionInfo:
        """One session.

        Raises:
            RemoteError: ``session_not_found`` (404).
        """
        return SessionInfo.from_json(self._request("GET", f"/v1/sessions/{session_id}").json())

    def delete_session(self, session_id: str) -> SessionInfo:
        """End a session (fine for an ended one); returns its final description.

        Raises:
            RemoteError: ``session_not_found`` (404), ``hypervisor_error`` (502, teardown
                incomplete).
        """
        response = self._request("DELETE", f"/v1/sessions/{session_id}")
        return SessionInfo.from_json(response.json())

    def guest_log(self, session_id: str, *, offset: int = 0) -> str:
        """What the guest wrote to ``/dev/ttyS1`` from byte ``offset`` on."""
        path = f"/v1/sessions/{session_id}/guest-log"
        return self._request("GET", path, params={"offset": offset}).text

    def reset_session(self, session_id: str) -> SessionInfo:
        """Return a session to its start state (``POST /v1/sessions/{id}/reset``).

        Returns:
            Its description; ``info["resets"]`` counts resets, ``info["last_reset_s"]``
            is how long this one took, seconds.

        Raises:
            RemoteError: ``reset_unavailable`` (409: it booted cold, no saved start
                state), ``session_closed`` (409), ``hypervisor_error`` (502: the restore
                failed and the session was ended).
        """
        response = self._request("POST", f"/v1/sessions/{session_id}/reset")
        return SessionInfo.from_json(response.json())

    def network(self, session_id: str) -> list[dict[str, Any]]:
        """The session's egress decisions so far (``GET /v1/sessions/{id}/network``).

        Returns:
            Oldest first, each ``{"ts_ns", "kind", "reason", "protocol", "src",
            "src_port", "dst", "dst_port", "query", "qtype", "answers"}`` (see
            docs/protocol.md); ``[]`` for a session without an egress policy.

        Raises:
            RemoteError: ``session_not_found`` (404), ``egress_error`` (502).
        """
        decisions: list[dict[str, Any]] = self._request(
            "GET", f"/v1/sessions/{session_id}/network"
        ).json()
        return decisions

    def health(self) -> Health:
        """``GET /healthz``."""
        obj = self._request("GET", "/healthz").json()
        return Health(ok=bool(obj.get("ok")), sessions=int(obj.get("sessions", 0)))

    def _connect_ws(
        self,
        ws_url: str,
        schema: str,
        stack: ExitStack,
        query: Mapping[str, str] | None = None,
    ) -> ClientConnection:
        """Open a WebSocket whose lifetime ``stack`` manages (websockets wants a ``with``)."""
        return self._open_ws(socket_url(ws_url, schema, query), stack)

    def _open_ws(self, url: str, stack: ExitStack) -> ClientConnection:
        with _ws_errors(url):
            ws: ClientConnection = stack.enter_context(connect(url, **self._ws_options()))
        return ws


class FrameStream:
    """An open live stream of one session (:meth:`Session.stream`).

    Iterate for :class:`StreamFrame` objects; iteration ends when the session ends. Use it
    as a context manager (or call :meth:`close`). Only changed screens are sent, so
    waiting for the next frame blocks while the screen is still: :meth:`next` takes a
    timeout.

    Attributes:
        hello: the server's ``hello`` event (codec, quality, max_fps, display size...).
        status: the newest ``status`` event (``state``, ``pending``...), if any came.
    """

    def __init__(self, ws: ClientConnection, stack: ExitStack, *, decode: bool) -> None:
        self._ws = ws
        self._stack = stack
        self._decode = decode
        self.status: dict[str, Any] | None = None
        self.hello: dict[str, Any] = self._first_event()

    def _first_event(self) -> dict[str, Any]:
        try:
            event = json.loads(self._ws.recv(timeout=30))
        except ConnectionClosed as exc:
            self.close()
            raise _closed(exc, "the stream's WebSocket") from exc
        except (TimeoutError, ValueError) as exc:
            self.close()
            raise BridgeConnectionError(f"the stream sent no hello: {exc}") from exc
        if event.get("event") != "hello":
            self.close()
            reply_result(event)  # raises RemoteError for a refusal
            raise BridgeConnectionError(f"unexpected first stream message: {event!r}")
        return dict(event)

    def __enter__(self) -> FrameStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[StreamFrame]:
        return self

    def __next__(self) -> StreamFrame:
        frame = self.next()
        if frame is None:
            raise StopIteration
        return frame

    def next(self, timeout_s: float | None = None) -> StreamFrame | None:
        """The next frame; ``None`` once the session has ended.

        Raises:
            TimeoutError: no frame within ``timeout_s`` (the screen was still).
            BridgeConnectionError: the connection failed or closed otherwise.
        """
        while True:
            try:
                message = self._ws.recv(timeout=timeout_s)
            except ConnectionClosed as exc:
                self.close()
                error = _closed(exc, "the stream's WebSocket")
                if isinstance(error, SessionClosed):
                    return None
                raise error from exc
            if isinstance(message, bytes):
                return StreamFrame.from_message(message, decode=self._decode)
            with contextlib.suppress(ValueError):
                event = json.loads(message)
                if event.get("event") == "status":
                    self.status = dict(event)

    def close(self) -> None:
        """Close the stream's WebSocket (idempotent)."""
        with contextlib.suppress(ConnectionClosed, OSError):
            self._stack.close()


def ended_reason(close_reason: str) -> str:
    """Why a session ended, from the server's close reason (``"session ended: <why>"``)."""
    return close_reason.removeprefix("session ended: ") or "the session ended"


def _closed(exc: ConnectionClosed, what: str) -> DeskvmError:
    """A closed WebSocket as the error it means (1001: the session ended)."""
    close = exc.rcvd
    code, reason = (close.code, close.reason) if close is not None else (None, "")
    if code == _CLOSE_GOING_AWAY:
        return SessionClosed(f"{reason or 'the session ended'}")
    return BridgeConnectionError(
        f"{what} closed ({code} {reason})".rstrip(),
        close_code=code,
        close_reason=reason,
    )


class Session(VisualChecks):
    """One session, driven over its WebSocket. A context manager deleting it on exit.

    Coordinates are display pixels, origin top-left; scroll amounts are wheel notches;
    durations are milliseconds. Every action method raises :class:`RemoteError` for an
    error reply (``out_of_screen``, ``invalid_action``...; the session stays usable),
    :class:`~orchestrator.errors.SessionClosed` if the session ended, and
    :class:`BridgeConnectionError` for transport failures. The WebSocket is opened on
    the first request and again on the first request after it went away (a bridge
    restart: the restarted server re-adopts the session, see docs/protocol.md); a
    request whose connection broke after it was sent is not repeated (it may have run).

    Visual checks (:class:`~agent_bridge.qa.checks.VisualChecks`): ``wait_for(ref)``,
    ``wait_gone``, ``exists``, ``click(ref)``, ``expect_change()``, ``wait_still``,
    ``find_text``, ``read_text``; references are looked up in ``session.qa.refs``
    (default ``./refs``; the pytest plugin points it at ``refs/`` beside the test file).

    Args:
        client: the REST client it belongs to.
        info: the session's description.
        schema: the WebSocket ``schema``; the typed methods need ``deskvm``, :meth:`request`
            works with any.
        query: more WebSocket query parameters (``scale_to``, ``max_long_edge``).
    """

    def __init__(
        self,
        client: Client,
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
        self._stack = ExitStack()
        self._ids: Iterator[int] = itertools.count(1)

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.delete()

    # --- plumbing -----------------------------------------------------------------------

    def _socket(self) -> ClientConnection:
        if self._ws is not None and self._ws.protocol.state is not State.OPEN:
            ended = self._ws.protocol.close_rcvd
            if ended is not None and ended.code == _CLOSE_GOING_AWAY:
                # The server said the session ended: no new connection can change that.
                self.close()
                raise SessionClosed(f"session {self.id} ended: {ended_reason(ended.reason)}")
            # The connection went away between requests (e.g. the bridge restarted): the
            # next request opens a new one (nothing was sent on the old one, so nothing
            # can run twice).
            self.close()
        if self._ws is None:
            self._stack = ExitStack()
            self._ws = self.client._connect_ws(
                self.info_at_start.ws_url, self.schema, self._stack, self.query
            )
        return self._ws

    def close(self) -> None:
        """Close the WebSocket (the session stays on the server)."""
        self._ws = None
        with contextlib.suppress(ConnectionClosed, OSError):
            self._stack.close()

    def delete(self) -> SessionInfo | None:
        """Close the WebSocket and delete the session; ``None`` if it was already gone."""
        self.close()
        try:
            return self.client.delete_session(self.id)
        except RemoteError as exc:
            if exc.code == "session_not_found":
                return None
            raise

    def _closed_error(self, exc: ConnectionClosed) -> DeskvmError:
        self.close()
        close = exc.rcvd
        code, reason = (close.code, close.reason) if close is not None else (None, "")
        if code == _CLOSE_GOING_AWAY:
            return SessionClosed(f"session {self.id} ended: {ended_reason(reason)}")
        return _closed(exc, f"WebSocket of session {self.id}")

    def request(self, message: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """Send one request and return the ``result`` of its reply.

        Args:
            message: ``{"action": ..., ...params}``; an ``id`` is added if missing.
            timeout_s: how long to wait for the reply (default: the client's timeout).

        Returns:
            The reply's ``result`` object (a dict for deskvm; vendor schemas may differ).
            With binary images (the default for ``schema=deskvm``, see ``images`` in
            ``docs/protocol.md``) an image's ``data`` is the PNG ``bytes``, not base64.

        Raises:
            RemoteError: the reply is an error (``code`` from the server).
            SessionClosed: the session ended (the WebSocket closed with 1001, or the reply
                is ``session_closed``).
            BridgeConnectionError: transport failure or no reply within ``timeout_s``.
        """
        return reply_result(self._exchange(message, timeout_s))

    def act(
        self,
        message: Mapping[str, Any],
        *,
        still_ms: int,
        timeout_ms: int = 10_000,
        timeout_s: float | None = None,
    ) -> ActReply:
        """Run one request, then wait for a still screen and screenshot it.

        Sends ``message`` with ``"screenshot_after": {"still_ms", "timeout_ms"}``: after
        the action, the server waits until the screen has been unchanged for ``still_ms``
        (at most ``timeout_ms``) and returns that screen with the result.

        Args:
            message: ``{"action": ..., ...params}`` (any schema).
            still_ms: how long the screen must stay unchanged, milliseconds.
            timeout_ms: the longest wait for that, milliseconds.
            timeout_s: how long to wait for the reply (default: the client's timeout plus
                ``timeout_ms``).

        Returns:
            The result and the settled screenshot (``settled`` false: timed out).

        Raises:
            Same as :meth:`request`.
        """
        payload = {**message, "screenshot_after": {"still_ms": still_ms, "timeout_ms": timeout_ms}}
        wait_s = timeout_s if timeout_s is not None else self.client.timeout_s + timeout_ms / 1000
        return act_reply(self._exchange(payload, wait_s))

    def _exchange(self, message: Mapping[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """Send one request; the whole reply (binary images as ``bytes`` in ``data``)."""
        payload = dict(message)
        request_id = payload.setdefault("id", next(self._ids))
        ws = self._socket()
        deadline_s = timeout_s if timeout_s is not None else self.client.timeout_s
        try:
            ws.send(json.dumps(payload))
            while True:
                try:
                    message_in = ws.recv(timeout=deadline_s)
                except TimeoutError as exc:
                    raise BridgeConnectionError(
                        f"no reply to {payload.get('action')!r} within {deadline_s:.0f} s"
                    ) from exc
                reply = parse_reply(message_in)
                # Replies to requests that timed out earlier, or refusals with id null
                # (sent just before a close), may precede ours.
                if reply.get("id") == request_id or (
                    reply.get("id") is None and not reply.get("ok", True)
                ):
                    break
        except ConnectionClosed as exc:
            raise self._closed_error(exc) from exc
        except (ValueError, AttributeError) as exc:
            raise BridgeConnectionError(f"malformed reply from the server: {exc}") from exc
        return reply

    def _do(self, action: str, *, extra_wait_ms: int = 0, **params: Any) -> dict[str, Any]:
        message = {"action": action, **{k: v for k, v in params.items() if v is not None}}
        timeout_s = self.client.timeout_s + extra_wait_ms / 1000
        result: dict[str, Any] = self.request(message, timeout_s=timeout_s)
        return result

    @staticmethod
    def _image(result: Mapping[str, Any]) -> Screenshot:
        return image_of(result)

    # --- actions ------------------------------------------------------------------------

    def screenshot(self) -> Screenshot:
        """The whole screen as PNG."""
        return self._image(self._do("screenshot"))

    def zoom(self, region: Sequence[int]) -> Screenshot:
        """A full-resolution crop of ``region`` = ``(x0, y0, x1, y1)``, x1/y1 exclusive."""
        return self._image(self._do("zoom", region=list(region)))

    def move(self, x: int, y: int) -> None:
        """Move the pointer to ``(x, y)``."""
        self._do("move", x=x, y=y)

    @overload
    def click(
        self,
        x: int | None = None,
        y: int | None = None,
        button: ButtonName = "left",
        count: int = 1,
        *,
        hold: str | None = None,
    ) -> None: ...

    @overload
    def click(
        self,
        x: str | Reference | Match,
        *,
        button: ButtonName = "left",
        count: int = 1,
        hold: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Match: ...

    def click(
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
        reference.

        Args:
            x: pixels from the left; ``None`` with ``y`` ``None``: the current position.
                A reference name (``refs/<name>.png``), a ``Reference`` or a ``Match``:
                wait for it (up to ``timeout_s`` seconds) and click its click point, else
                the centre of the match (see :meth:`click_ref`).
            y: pixels from the top.
            button: which button.
            count: 1, 2 (double) or 3 (triple).
            hold: keys held during the click, e.g. ``"shift"``.
            timeout_s: for a reference: how long to wait for it, seconds.

        Returns:
            ``None`` for coordinates; the :class:`Match` clicked for a reference.

        Raises:
            MatchTimeout: the reference did not appear (nothing is clicked).
        """
        if x is not None and not isinstance(x, int | float):  # a reference or a match
            if y is not None:
                raise TypeError("click(ref) takes no y coordinate")
            return self.click_ref(x, timeout_s=timeout_s, button=button, count=count, hold=hold)
        self._do("click", x=x, y=y, button=button, count=count, hold=hold)
        return None

    # --- visual checks: the session's primitives (see agent_bridge.qa.checks) -----------

    def _qa_frame(self) -> Frame:
        """The whole screen at full resolution, with its place in the recording and the
        pointer (a scaled connection takes a full-screen ``zoom`` instead)."""
        from agent_bridge.qa.refs import decode_png

        mono_s = time.monotonic()
        pointer = Point(*self.cursor_position())
        if self.query.get("scale_to") or self.query.get("max_long_edge"):
            info = self.info_at_start
            shot = self.zoom((0, 0, info.width, info.height))
        else:
            shot = self.screenshot()
        return Frame(
            decode_png(shot.png, where="screenshot"),
            shot.frame_seq,
            shot.t_s,
            shot.png,
            mono_s,
            pointer,
        )

    def _qa_click_at(self, point: Point, *, button: str, count: int, hold: str | None) -> None:
        self._do("click", x=point.x, y=point.y, button=button, count=count, hold=hold)

    def double_click(
        self, x: int | None = None, y: int | None = None, button: ButtonName = "left"
    ) -> None:
        """Two clicks at ``(x, y)``."""
        self._do("double_click", x=x, y=y, button=button)

    def triple_click(
        self, x: int | None = None, y: int | None = None, button: ButtonName = "left"
    ) -> None:
        """Three clicks at ``(x, y)`` (selects a line in most toolkits)."""
        self._do("triple_click", x=x, y=y, button=button)

    def mouse_down(
        self, button: ButtonName = "left", x: int | None = None, y: int | None = None
    ) -> None:
        """Press ``button`` (at ``(x, y)`` if given) and keep it pressed."""
        self._do("mouse_down", button=button, x=x, y=y)

    def mouse_up(
        self, button: ButtonName = "left", x: int | None = None, y: int | None = None
    ) -> None:
        """Release ``button`` (at ``(x, y)`` if given)."""
        self._do("mouse_up", button=button, x=x, y=y)

    def type(self, text: str, secret: bool = False) -> None:
        """Type ``text`` (``\\n`` is Return, ``\\t`` Tab); ``secret`` is not recorded in clear."""
        self._do("type", text=text, secret=secret, extra_wait_ms=len(text) * 50)

    def key(self, keys: str) -> None:
        """Press key combos in order, e.g. ``"ctrl+shift+t"`` or ``"ctrl+a ctrl+c"``."""
        self._do("key", keys=keys)

    def hold_key(self, keys: str, duration_ms: int) -> None:
        """Hold ``keys`` down for ``duration_ms`` milliseconds."""
        self._do("hold_key", keys=keys, duration_ms=duration_ms, extra_wait_ms=duration_ms)

    def scroll(
        self,
        x: int | None = None,
        y: int | None = None,
        dx: int = 0,
        dy: int = 0,
        hold: str | None = None,
    ) -> None:
        """Turn the wheel ``dy`` notches down (negative: up) and ``dx`` right at ``(x, y)``.

        ``hold``: keys held during the scroll, e.g. ``"shift"`` or ``"ctrl+alt"``.
        """
        self._do("scroll", x=x, y=y, dx=dx, dy=dy, hold=hold)

    def drag(self, path: Sequence[Sequence[int]], button: ButtonName = "left") -> None:
        """Press at ``path[0]``, move through every point, release at ``path[-1]``."""
        self._do("drag", path=[list(p) for p in path], button=button)

    def wait(self, ms: int) -> None:
        """Let the server wait ``ms`` milliseconds (recorded; the reply comes after)."""
        self._do("wait", ms=ms, extra_wait_ms=ms)

    def cursor_position(self) -> tuple[int, int]:
        """Where the host last put the pointer, display pixels."""
        result = self._do("cursor_position")
        return int(result["x"]), int(result["y"])

    # --- guest control (sessions created with guest_control=True; token scope exec) ------

    def exec(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        *,
        secret: bool = False,
    ) -> ExecResult:
        """Run ``argv`` in the guest as the desktop user (no shell) and wait for it.

        Args:
            argv: program and arguments, e.g. ``["ls", "-l", "/tmp"]``.
            stdin: text fed to its standard input (closed after).
            timeout_s: the guest kills it (its whole process group) after this, seconds.
            env: variables added to the desktop session's environment.
            secret: keep argv, environment and outputs out of the recording (keyed digests).

        Returns:
            Its exit code and outputs (each capped, truncation flagged). A non-zero exit
            is a result, not an error.

        Raises:
            RemoteError: ``guest_control_disabled``, ``forbidden`` (scope), ``invalid_action``,
                ``guest_helper_error`` (the guest did not answer in time),
                ``guest_reply_invalid``, ``approval_denied``...
        """
        message, wait_s = exec_message(argv, stdin, timeout_s, env, secret)
        return ExecResult.from_result(
            self.request(message, timeout_s=max(wait_s, self.client.timeout_s))
        )

    def put_file(self, path: str, data: bytes, *, secret: bool = False) -> dict[str, Any]:
        """Write ``data`` to ``path`` in the guest (home directory or /tmp; parents must
        exist). Returns ``{path, size_bytes, sha256}``."""
        result: dict[str, Any] = self.request(put_file_message(path, data, secret))
        return result

    def get_file(self, path: str) -> bytes:
        """The content of the guest file at ``path`` (home directory or /tmp, at most
        8 MiB), checked against the hash the server computed."""
        return file_bytes(self.request({"action": "get_file", "path": path}))

    def clipboard_get(self) -> str:
        """The text of the guest's CLIPBOARD selection (``""`` when it holds none)."""
        return str(self._do("clipboard_get")["text"])

    def clipboard_set(self, text: str, *, secret: bool = False) -> None:
        """Make ``text`` the guest's CLIPBOARD (and PRIMARY) selection: ``ctrl+v`` in an
        app then pastes exactly it."""
        self._do("clipboard_set", text=text, secret=secret or None)

    def windows(self) -> list[dict[str, Any]]:
        """The guest's top-level windows: ``[{id, title, class, x, y, width, height,
        focused}]`` (display pixels of the client area)."""
        return list(self._do("windows")["windows"])

    def window_activate(self, id: int) -> None:
        """Raise and focus window ``id`` (from :meth:`windows`)."""
        self._do("window_activate", window_id=id)

    def window_close(self, id: int) -> None:
        """Ask window ``id`` to close (its application may ask first)."""
        self._do("window_close", window_id=id)

    def a11y_tree(
        self, window_id: int | None = None, max_nodes: int | None = None
    ) -> dict[str, Any]:
        """The AT-SPI tree of the desktop or of one window: ``{tree: {role, name, states, x,
        y, width, height, children}, truncated, nodes}``."""
        result: dict[str, Any] = self.request(
            a11y_message(window_id, max_nodes), timeout_s=max(self.client.timeout_s, 70.0)
        )
        return result

    def set_resolution(self, width: int, height: int) -> tuple[int, int]:
        """Change the display to ``width`` x ``height`` while the session runs; screenshots,
        the stream and coordinates follow. Returns the new size.

        Raises:
            RemoteError: ``unsupported_resolution`` naming the sizes the display can do.
        """
        result = self._do("set_resolution", width=width, height=height, extra_wait_ms=30_000)
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
    ) -> FrameStream:
        """Open the session's live stream (``/v1/sessions/{id}/stream``, view scope).

        Args:
            codec: image format of the frames.
            quality: 1..100 for JPEG/WebP.
            max_fps: at most this many frames per second (<= 30).
            max_long_edge: frames shrunk so their long edge is at most this many pixels.
            decode: decode every frame into ``StreamFrame.image`` (needs Pillow).

        Returns:
            An open :class:`FrameStream`; iterate it, close it when done.

        Raises:
            RemoteError: ``invalid_query`` (bad parameter), ``session_not_found``...
            BridgeConnectionError: the handshake failed (e.g. HTTP 403: bad token).
        """
        url = stream_url(self.info_at_start.ws_url, codec, quality, max_fps, max_long_edge)
        stack = ExitStack()
        ws = self.client._open_ws(url, stack)
        return FrameStream(ws, stack, decode=decode)

    # --- REST shortcuts -----------------------------------------------------------------

    def guest_log(self) -> str:
        """What the guest wrote to ``/dev/ttyS1`` so far."""
        return self.client.guest_log(self.id)

    def reset(self) -> SessionInfo:
        """Return the desktop to its start state in about a second (see
        :meth:`Client.reset_session`); the WebSocket and the recording carry on."""
        return self.client.reset_session(self.id)

    def info(self) -> SessionInfo:
        """The session's current description (state, recording, cursor...)."""
        return self.client.get_session(self.id)

    def network(self) -> list[dict[str, Any]]:
        """The session's egress decisions so far (see :meth:`Client.network`)."""
        return self.client.network(self.id)
