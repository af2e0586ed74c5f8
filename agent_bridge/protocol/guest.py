"""The guest control plane's requests: exec, files, clipboard, windows, a11y, resolution. Pure.

These are actions like the input ones (same WebSocket, same envelope, same approval and
recording path) but far more powerful: they need the ``exec`` token scope and a session
created with ``"guest_control": true``. They are carried out by the in-guest helper over
its virtio-serial channel (:mod:`orchestrator.guest_control` on the host), never over the
network.

Wire parameters (``schema=deskvm`` and ``POST /v1/sessions/{id}/guest/<op>``):

================  ===========================================================================
``exec``          ``argv`` ([str], 1..256 items), ``stdin``? (str), ``timeout_s``? (0 < t <=
                  600, default 30), ``env``? ({str: str}), ``secret``? (bool)
``put_file``      ``path``, ``data_b64`` (at most :data:`PUT_FILE_MAX_BYTES` once decoded),
                  ``secret``?
``get_file``      ``path``
``clipboard_get`` —
``clipboard_set`` ``text`` (at most :data:`CLIPBOARD_MAX_CHARS`), ``secret``?
``windows``       —
``window_activate`` / ``window_close``  ``window_id`` (X11 window id, integer; over REST
                  ``id`` works too: on the WebSocket ``id`` is the request's own id)
``a11y_tree``     ``window_id``? (integer), ``max_nodes``? (1..:data:`A11Y_MAX_NODES`)
``set_resolution`` ``width``, ``height`` (display pixels)
================  ===========================================================================

Paths are checked here *lexically* (absolute, normalised, no ``..``, under ``/tmp/`` or a
home directory ``/home/<user>/``); the guest helper checks them again after resolving
symlinks (the desktop user's home or ``/tmp``).

What the recording keeps (:func:`guest_record`): argv, the timeout, the environment's
names, and the size and SHA-256 of stdin, file contents and clipboard text, never the
contents. With ``secret: true`` the argv and environment are left out too and every hash is
the recording's keyed HMAC (:meth:`orchestrator.recorder.Recorder.secret_digest` style, done
by the session).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from orchestrator.errors import ActionError

__all__ = [
    "A11Y_DEFAULT_NODES",
    "A11Y_MAX_NODES",
    "CLIPBOARD_MAX_CHARS",
    "EXEC_DEFAULT_TIMEOUT_S",
    "EXEC_MAX_TIMEOUT_S",
    "EXEC_OUTPUT_CAP_BYTES",
    "GET_FILE_MAX_BYTES",
    "GUEST_ACTIONS",
    "GUEST_ACTION_NAMES",
    "GUEST_PARAMETERS",
    "PUT_FILE_MAX_BYTES",
    "A11yTree",
    "ClipboardGet",
    "ClipboardSet",
    "Exec",
    "GetFile",
    "GuestAction",
    "ListWindows",
    "PutFile",
    "SetResolution",
    "WindowActivate",
    "WindowClose",
    "check_guest_path",
    "guest_action_name",
    "guest_record",
    "parse_guest_action",
    "sha256_hex",
]

EXEC_DEFAULT_TIMEOUT_S = 30.0
EXEC_MAX_TIMEOUT_S = 600.0
EXEC_OUTPUT_CAP_BYTES = 1 << 20
"""Most bytes of stdout, and of stderr, an ``exec`` returns; more is cut and flagged."""
EXEC_MAX_ARGS = 256
EXEC_MAX_ARGV_BYTES = 64 * 1024
EXEC_MAX_STDIN_BYTES = 512 * 1024
EXEC_MAX_ENV = 64
EXEC_MAX_ENV_BYTES = 32 * 1024
PUT_FILE_MAX_BYTES = 720 * 1024
"""Largest file ``put_file`` writes (its base64 fits one 1 MiB WebSocket message)."""
GET_FILE_MAX_BYTES = 8 << 20
"""Largest file ``get_file`` reads; a larger one is refused (nothing partial)."""
CLIPBOARD_MAX_CHARS = 256 * 1024
"""Longest clipboard text ``clipboard_set`` takes, and ``clipboard_get`` returns (cut)."""
A11Y_DEFAULT_NODES = 2000
A11Y_MAX_NODES = 10_000
MAX_PATH_BYTES = 4096

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HOME = re.compile(r"/home/[a-z_][a-z0-9_.-]*/")
_WINDOW_ID_MAX = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class Exec:
    """Run ``argv`` as the desktop user (no shell), with ``stdin``, for at most ``timeout_s``.

    Result: ``{exit_code, stdout, stderr, stdout_truncated, stderr_truncated, cap_bytes,
    timed_out}`` (``exit_code`` is ``-N`` for a process killed by signal ``N``).
    """

    argv: tuple[str, ...]
    stdin: str | None = None
    timeout_s: float = EXEC_DEFAULT_TIMEOUT_S
    env: tuple[tuple[str, str], ...] = ()
    secret: bool = False


@dataclass(frozen=True, slots=True)
class PutFile:
    """Write ``data`` to ``path`` in the guest (parents must exist). Result: path, size, hash."""

    path: str
    data: bytes
    secret: bool = False


@dataclass(frozen=True, slots=True)
class GetFile:
    """Read the file at ``path`` in the guest. Result: path, ``data_b64``, size, hash."""

    path: str


@dataclass(frozen=True, slots=True)
class ClipboardGet:
    """The text of the guest's CLIPBOARD selection. Result: ``{text}``."""


@dataclass(frozen=True, slots=True)
class ClipboardSet:
    """Make ``text`` the guest's CLIPBOARD (and PRIMARY) selection."""

    text: str
    secret: bool = False


@dataclass(frozen=True, slots=True)
class ListWindows:
    """The managed top-level windows. Result: ``{windows: [{id, title, class, x, y, width,
    height, focused}]}`` (display pixels, frame excluded)."""


@dataclass(frozen=True, slots=True)
class WindowActivate:
    """Raise and focus window ``id`` (through the window manager)."""

    id: int


@dataclass(frozen=True, slots=True)
class WindowClose:
    """Ask window ``id`` to close (``_NET_CLOSE_WINDOW``: the application may ask first)."""

    id: int


@dataclass(frozen=True, slots=True)
class A11yTree:
    """The AT-SPI tree of the desktop, or of one window. Result: ``{tree, truncated, nodes}``."""

    window_id: int | None = None
    max_nodes: int = A11Y_DEFAULT_NODES


@dataclass(frozen=True, slots=True)
class SetResolution:
    """Change the running display to ``width`` x ``height`` pixels. Result: the new size."""

    width: int
    height: int


GuestAction: TypeAlias = (
    Exec
    | PutFile
    | GetFile
    | ClipboardGet
    | ClipboardSet
    | ListWindows
    | WindowActivate
    | WindowClose
    | A11yTree
    | SetResolution
)

_NAMES: dict[type, str] = {
    Exec: "exec",
    PutFile: "put_file",
    GetFile: "get_file",
    ClipboardGet: "clipboard_get",
    ClipboardSet: "clipboard_set",
    ListWindows: "windows",
    WindowActivate: "window_activate",
    WindowClose: "window_close",
    A11yTree: "a11y_tree",
    SetResolution: "set_resolution",
}
GUEST_ACTION_NAMES: Mapping[type, str] = _NAMES
"""Each guest action type's wire name."""
GUEST_ACTIONS: frozenset[str] = frozenset(_NAMES.values())
"""The guest control actions' names (they need scope ``exec`` and ``guest_control``)."""

GUEST_PARAMETERS: dict[str, frozenset[str]] = {
    "exec": frozenset({"argv", "stdin", "timeout_s", "env", "secret"}),
    "put_file": frozenset({"path", "data_b64", "secret"}),
    "get_file": frozenset({"path"}),
    "clipboard_get": frozenset(),
    "clipboard_set": frozenset({"text", "secret"}),
    "windows": frozenset(),
    "window_activate": frozenset({"window_id", "id"}),
    "window_close": frozenset({"window_id", "id"}),
    "a11y_tree": frozenset({"window_id", "max_nodes"}),
    "set_resolution": frozenset({"width", "height"}),
}
"""The parameters each guest action takes (anything else is ``unknown_parameter``)."""


def guest_action_name(action: GuestAction) -> str:
    """The wire name of a guest action (``"exec"``, ``"put_file"``...)."""
    return _NAMES[type(action)]


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _str(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise ActionError(f"missing parameter {name!r}", code="missing_parameter")
    if not isinstance(value, str):
        raise ActionError(f"{name!r} must be a string, got {_type_name(value)}")
    return value


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ActionError(f"{name!r} must be true or false, got {_type_name(value)}")
    return value


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int, default: int | None = None) -> int:
    value = body.get(name, default)
    if value is None:
        raise ActionError(f"missing parameter {name!r}", code="missing_parameter")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ActionError(f"{name!r} must be an integer, got {_type_name(value)}")
    if not lo <= value <= hi:
        raise ActionError(f"{name!r} must be within {lo}..{hi}, got {value}")
    return value


def _no_nul(name: str, text: str) -> None:
    if "\x00" in text:
        raise ActionError(f"{name} must not contain NUL characters")


def check_guest_path(path: str) -> str:
    """Check a guest path lexically: what the host can tell before asking the guest.

    Absolute, already normalised (no ``.``/``..`` components, no ``//``, no trailing
    ``/``), at most 4096 bytes, no NUL, and under ``/tmp/`` or ``/home/<user>/``. The helper
    resolves symlinks in the guest and checks again (the desktop user's home or ``/tmp``).

    Returns:
        ``path`` unchanged.

    Raises:
        ActionError: ``path_not_allowed`` saying which rule it breaks.
    """
    if not isinstance(path, str):
        raise ActionError(f"'path' must be a string, got {_type_name(path)}")
    if "\x00" in path or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise ActionError(
            f"path must be at most {MAX_PATH_BYTES} bytes without NUL", code="path_not_allowed"
        )
    if not path.startswith("/"):
        raise ActionError(f"path {path!r} is not absolute", code="path_not_allowed")
    if posixpath.normpath(path) != path or path.startswith("//"):
        raise ActionError(
            f"path {path!r} is not normalised (no '.', '..', '//' or trailing '/'); "
            f"give {posixpath.normpath(path)!r} if that is what you mean",
            code="path_not_allowed",
        )
    if not (path.startswith("/tmp/") or _HOME.match(path)):
        raise ActionError(
            f"path {path!r} is outside the places guest files may be: the desktop user's "
            "home (/home/<user>/...) and /tmp/...",
            code="path_not_allowed",
        )
    return path


def _exec(body: Mapping[str, Any]) -> Exec:
    argv = body.get("argv")
    if argv is None:
        raise ActionError("missing parameter 'argv'", code="missing_parameter")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ActionError("'argv' must be a non-empty list of strings (no shell is involved)")
    if len(argv) > EXEC_MAX_ARGS:
        raise ActionError(f"'argv' has more than {EXEC_MAX_ARGS} items")
    if sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in argv) > EXEC_MAX_ARGV_BYTES:
        raise ActionError(f"'argv' is longer than {EXEC_MAX_ARGV_BYTES} bytes")
    for a in argv:
        _no_nul("'argv' items", a)
    if not argv[0]:
        raise ActionError("'argv[0]' is empty")
    stdin = body.get("stdin")
    if stdin is not None:
        if not isinstance(stdin, str):
            raise ActionError(f"'stdin' must be a string, got {_type_name(stdin)}")
        if len(stdin.encode("utf-8", "surrogatepass")) > EXEC_MAX_STDIN_BYTES:
            raise ActionError(f"'stdin' is longer than {EXEC_MAX_STDIN_BYTES} bytes")
    timeout = body.get("timeout_s", EXEC_DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ActionError(f"'timeout_s' must be a number, got {_type_name(timeout)}")
    if not 0 < timeout <= EXEC_MAX_TIMEOUT_S:
        raise ActionError(f"'timeout_s' must be within (0, {EXEC_MAX_TIMEOUT_S:g}], got {timeout}")
    env = body.get("env") or {}
    if not isinstance(env, dict):
        raise ActionError(f"'env' must be an object of strings, got {_type_name(env)}")
    if len(env) > EXEC_MAX_ENV:
        raise ActionError(f"'env' has more than {EXEC_MAX_ENV} entries")
    size = 0
    for key, value in env.items():
        if not _ENV_NAME.match(key):
            raise ActionError(f"'env' name {key!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if not isinstance(value, str):
            raise ActionError(f"'env' value of {key!r} must be a string, got {_type_name(value)}")
        _no_nul("'env' values", value)
        size += len(key) + len(value.encode("utf-8", "surrogatepass")) + 2
    if size > EXEC_MAX_ENV_BYTES:
        raise ActionError(f"'env' is larger than {EXEC_MAX_ENV_BYTES} bytes")
    return Exec(
        argv=tuple(argv),
        stdin=stdin,
        timeout_s=float(timeout),
        env=tuple(sorted(env.items())),
        secret=_bool(body, "secret"),
    )


def _put_file(body: Mapping[str, Any]) -> PutFile:
    path = check_guest_path(_str(body, "path"))
    text = _str(body, "data_b64")
    if len(text) > (PUT_FILE_MAX_BYTES + 2) // 3 * 4 + 4:
        raise ActionError(f"the file is larger than {PUT_FILE_MAX_BYTES} bytes (put_file's cap)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ActionError("'data_b64' is not base64 (RFC 4648)") from None
    if len(data) > PUT_FILE_MAX_BYTES:
        raise ActionError(f"the file is larger than {PUT_FILE_MAX_BYTES} bytes (put_file's cap)")
    return PutFile(path=path, data=data, secret=_bool(body, "secret"))


def _clipboard_set(body: Mapping[str, Any]) -> ClipboardSet:
    text = _str(body, "text")
    if len(text) > CLIPBOARD_MAX_CHARS:
        raise ActionError(f"'text' is longer than {CLIPBOARD_MAX_CHARS} characters")
    _no_nul("'text'", text)
    return ClipboardSet(text=text, secret=_bool(body, "secret"))


def _window_id(body: Mapping[str, Any]) -> int:
    if "window_id" in body and "id" in body:
        raise ActionError("give 'window_id' or 'id', not both")
    name = "id" if "id" in body else "window_id"
    return _int(body, name, 1, _WINDOW_ID_MAX)


def _a11y(body: Mapping[str, Any]) -> A11yTree:
    window = body.get("window_id")
    wid = None if window is None else _int(body, "window_id", 1, _WINDOW_ID_MAX)
    nodes = _int(body, "max_nodes", 1, A11Y_MAX_NODES, A11Y_DEFAULT_NODES)
    return A11yTree(window_id=wid, max_nodes=nodes)


def parse_guest_action(name: str, body: Mapping[str, Any]) -> GuestAction:
    """Parse the body of a guest control request named ``name`` (one of :data:`GUEST_ACTIONS`).

    ``body`` may carry ``action`` (ignored here). Unknown parameters are refused.

    Raises:
        ActionError: ``unknown_parameter``, ``missing_parameter``, ``invalid_action`` or
            ``path_not_allowed``.
    """
    unknown = sorted(set(body) - GUEST_PARAMETERS[name] - {"action"})
    if unknown:
        allowed = ", ".join(sorted(GUEST_PARAMETERS[name])) or "none"
        raise ActionError(
            f"{name} does not take {', '.join(map(repr, unknown))}; its parameters: {allowed}",
            code="unknown_parameter",
        )
    match name:
        case "exec":
            return _exec(body)
        case "put_file":
            return _put_file(body)
        case "get_file":
            return GetFile(path=check_guest_path(_str(body, "path")))
        case "clipboard_get":
            return ClipboardGet()
        case "clipboard_set":
            return _clipboard_set(body)
        case "windows":
            return ListWindows()
        case "window_activate":
            return WindowActivate(id=_window_id(body))
        case "window_close":
            return WindowClose(id=_window_id(body))
        case "a11y_tree":
            return _a11y(body)
        case "set_resolution":
            return SetResolution(
                width=_int(body, "width", 1, 1 << 16), height=_int(body, "height", 1, 1 << 16)
            )
    raise ActionError(f"unknown guest action {name!r}", code="unknown_action")


def sha256_hex(data: bytes) -> str:
    """SHA-256 of ``data``, lowercase hex."""
    return hashlib.sha256(data).hexdigest()


def guest_record(action: GuestAction) -> dict[str, Any]:
    """What the recording keeps of a guest action's request (no contents; see module doc).

    Hashes of secret actions are filled in by the session with the recording's keyed
    digest; here they are left out.
    """
    out: dict[str, Any] = {"action": guest_action_name(action)}
    match action:
        case Exec(argv=argv, stdin=stdin, timeout_s=timeout_s, env=env, secret=secret):
            out["timeout_s"] = timeout_s
            if secret:
                out.update(secret=True, argc=len(argv))
            else:
                out.update(argv=list(argv), env_names=[k for k, _ in env])
                if stdin is not None:
                    raw = stdin.encode("utf-8", "surrogatepass")
                    out.update(stdin_bytes=len(raw), stdin_sha256=sha256_hex(raw))
        case PutFile(path=path, data=data, secret=secret):
            out.update(path=path, size_bytes=len(data))
            if secret:
                out["secret"] = True
            else:
                out["sha256"] = sha256_hex(data)
        case GetFile(path=path):
            out["path"] = path
        case ClipboardSet(text=text, secret=secret):
            out["chars"] = len(text)
            if secret:
                out["secret"] = True
            else:
                out["sha256"] = sha256_hex(text.encode("utf-8", "surrogatepass"))
        case WindowActivate(id=wid) | WindowClose(id=wid):
            out["id"] = wid
        case A11yTree(window_id=wid, max_nodes=n):
            out.update(window_id=wid, max_nodes=n)
        case SetResolution(width=w, height=h):
            out.update(width=w, height=h)
    return out
