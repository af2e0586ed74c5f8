"""The host side of the guest control plane: requests to the guest helper, replies checked.

Each guest action (:mod:`agent_bridge.protocol.guest`) becomes one request to the in-guest
helper over its virtio-serial channel (:class:`~orchestrator.display.guest_helper.GuestHelper`:
acknowledged, then confirmed, then answered; never the network). The guest is untrusted:
every reply is checked here against the op's shape and caps before anything of it leaves
the host's memory (wrong types, sizes over the caps, invalid base64 or UTF-8, ids that were
not asked about, trees deeper or larger than asked are errors, code ``guest_reply_invalid``),
and every request has a host-side deadline (the channel's). Hashes and sizes are computed
here from the bytes received, not taken from the guest.

Wire requests (helper protocol 1, ops announced in the helper's ``hello``)::

    exec            {argv, stdin_b64, timeout_s, env, cap_bytes}
                 -> {exit_code, stdout_b64, stderr_b64, stdout_truncated, stderr_truncated,
                     timed_out}
    put_file        {path, data_b64}               -> {path}
    get_file        {path, max_bytes}              -> {path, data_b64}
    clipboard_get   {max_chars}                    -> {text}
    clipboard_set   {text}                         -> {}
    windows         {}                             -> {windows: [{id, title, class, x, y,
                                                                  width, height, focused}]}
    window_activate {window_id} / window_close {window_id}  -> {}
    a11y_tree       {window_id, max_nodes}         -> {tree, truncated}
    set_resolution  {width, height}                -> {width, height}

A refusal is ``{"ok": false, "error": text, "code": c}``; ``c`` of ``path_not_allowed``
keeps that code, any other becomes ``guest_refused`` (the text is the guest's word, cut to
500 characters).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Any

from agent_bridge.protocol.guest import (
    CLIPBOARD_MAX_CHARS,
    EXEC_OUTPUT_CAP_BYTES,
    GET_FILE_MAX_BYTES,
    A11yTree,
    ClipboardGet,
    ClipboardSet,
    Exec,
    GetFile,
    GuestAction,
    ListWindows,
    PutFile,
    SetResolution,
    WindowActivate,
    WindowClose,
    guest_action_name,
    sha256_hex,
)
from agent_bridge.protocol.results import GuestResult
from orchestrator.display.guest_helper import GuestHelper
from orchestrator.errors import ActionError, GuestHelperError

__all__ = [
    "A11Y_MAX_DEPTH",
    "MAX_WINDOWS",
    "REPLY_MARGIN_S",
    "check_reply",
    "guest_request",
    "run_guest_action",
]

REPLY_MARGIN_S = 10.0
"""Host deadline of an ``exec`` beyond its ``timeout_s`` (the guest kills it at
``timeout_s``), and the deadline of every other guest request, seconds."""
MAX_WINDOWS = 512
"""Most windows a ``windows`` reply may list."""
MAX_TITLE_CHARS = 1024
A11Y_MAX_DEPTH = 64
"""Deepest accessibility tree accepted (the root is depth 0)."""
_A11Y_FIELDS = ("role", "name", "states", "x", "y", "width", "height", "children")
_MAX_STATES = 64
_COORD_LIMIT = 1 << 20


class GuestReplyError(GuestHelperError):
    """The guest's reply broke the protocol (wrong shape, over a cap): nothing of it is used."""

    code = "guest_reply_invalid"


def guest_request(action: GuestAction) -> tuple[str, dict[str, Any], float]:
    """The helper request for ``action``: ``(op, args, host deadline in seconds)``."""
    op = guest_action_name(action)
    match action:
        case Exec(argv=argv, stdin=stdin, timeout_s=timeout_s, env=env):
            stdin_b64 = (
                None
                if stdin is None
                else base64.b64encode(stdin.encode("utf-8", "surrogatepass")).decode()
            )
            args = {"argv": list(argv), "stdin_b64": stdin_b64, "timeout_s": timeout_s,
                    "env": dict(env), "cap_bytes": EXEC_OUTPUT_CAP_BYTES}  # fmt: skip
            return op, args, timeout_s + REPLY_MARGIN_S
        case PutFile(path=path, data=data):
            return op, {"path": path, "data_b64": base64.b64encode(data).decode()}, 30.0
        case GetFile(path=path):
            return op, {"path": path, "max_bytes": GET_FILE_MAX_BYTES}, 30.0
        case ClipboardGet():
            return op, {"max_chars": CLIPBOARD_MAX_CHARS}, REPLY_MARGIN_S
        case ClipboardSet(text=text):
            return op, {"text": text}, REPLY_MARGIN_S
        case ListWindows():
            return op, {}, REPLY_MARGIN_S
        case WindowActivate(id=wid) | WindowClose(id=wid):
            # Not "id": on the channel that is the request's own id.
            return op, {"window_id": wid}, REPLY_MARGIN_S
        case A11yTree(window_id=wid, max_nodes=n):
            return op, {"window_id": wid, "max_nodes": n}, 60.0
        case SetResolution(width=w, height=h):
            return op, {"width": w, "height": h}, 30.0
    raise ActionError(f"not a guest action: {action!r}")


def _bad(op: str, why: str) -> GuestReplyError:
    return GuestReplyError(f"the guest helper's reply to {op} is invalid: {why}; nothing of it "
                           "was used")  # fmt: skip


def _field(reply: Mapping[str, Any], op: str, name: str, kind: type) -> Any:
    """``reply[name]`` if it is a ``kind`` (JSON ``true`` is no integer here)."""
    value = reply.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _bad(op, f"{name!r} is missing or has the wrong type")
    return value


def _b64(reply: Mapping[str, Any], op: str, name: str, cap: int) -> bytes:
    text = _field(reply, op, name, str)
    if len(text) > (cap + 2) // 3 * 4:
        raise _bad(op, f"{name!r} is over its cap of {cap} bytes")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(op, f"{name!r} is not base64") from None
    if len(data) > cap:
        raise _bad(op, f"{name!r} is over its cap of {cap} bytes")
    return data


def _int(reply: Mapping[str, Any], op: str, name: str, lo: int, hi: int) -> int:
    value = _field(reply, op, name, int)
    if not lo <= value <= hi:
        raise _bad(op, f"{name!r} is outside {lo}..{hi}")
    return int(value)


def _text(value: Any, op: str, what: str, cap: int) -> str:
    if not isinstance(value, str):
        raise _bad(op, f"{what} is not a string")
    if len(value) > cap:
        raise _bad(op, f"{what} is longer than {cap} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(op, f"{what} holds an unpaired surrogate") from None
    return value


def _tree(node: Any, op: str, depth: int, budget: list[int]) -> dict[str, Any]:
    if not isinstance(node, dict) or set(node) - set(_A11Y_FIELDS):
        raise _bad(op, "a tree node is not an object of role, name, states, bounds, children")
    if depth > A11Y_MAX_DEPTH:
        raise _bad(op, f"the tree is deeper than {A11Y_MAX_DEPTH}")
    budget[0] -= 1
    if budget[0] < 0:
        raise _bad(op, "the tree has more nodes than asked for")
    states = node.get("states", [])
    if not isinstance(states, list) or len(states) > _MAX_STATES:
        raise _bad(op, "a node's states are not a short list")
    out: dict[str, Any] = {
        "role": _text(node.get("role", ""), op, "a role", 64),
        "name": _text(node.get("name", ""), op, "a name", MAX_TITLE_CHARS),
        "states": [_text(s, op, "a state", 64) for s in states],
    }
    for key in ("x", "y", "width", "height"):
        value = node.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or abs(value) > _COORD_LIMIT
        ):
            raise _bad(op, f"a node's {key!r} is not an integer")
        out[key] = value
    children = node.get("children", [])
    if not isinstance(children, list):
        raise _bad(op, "a node's children are not a list")
    out["children"] = [_tree(child, op, depth + 1, budget) for child in children]
    return out


def check_reply(
    action: GuestAction,
    reply: Mapping[str, Any],
    *,
    digest: Callable[[str], dict[str, Any]] | None = None,
) -> GuestResult:
    """Check the helper's (``ok``) reply to ``action`` and build the result and its record.

    Args:
        action: what was asked.
        reply: the helper's reply object.
        digest: for secret actions, ``digest(text) -> dict`` (the recording's keyed HMAC)
            used instead of plain SHA-256 in the record.

    Raises:
        GuestReplyError: code ``guest_reply_invalid``: the reply breaks the protocol.
    """
    op = guest_action_name(action)
    match action:
        case Exec(secret=secret):
            code = _int(reply, op, "exit_code", -255, 255)
            out = _b64(reply, op, "stdout_b64", EXEC_OUTPUT_CAP_BYTES)
            err = _b64(reply, op, "stderr_b64", EXEC_OUTPUT_CAP_BYTES)
            out_cut = bool(_field(reply, op, "stdout_truncated", bool))
            err_cut = bool(_field(reply, op, "stderr_truncated", bool))
            timed_out = bool(reply.get("timed_out") is True)
            data = {"exit_code": code, "stdout": out.decode("utf-8", "replace"),
                    "stderr": err.decode("utf-8", "replace"), "stdout_truncated": out_cut,
                    "stderr_truncated": err_cut, "cap_bytes": EXEC_OUTPUT_CAP_BYTES,
                    "timed_out": timed_out}  # fmt: skip
            record: dict[str, Any] = {"action": op, "exit_code": code, "timed_out": timed_out,
                                      "stdout_bytes": len(out), "stderr_bytes": len(err),
                                      "stdout_truncated": out_cut,
                                      "stderr_truncated": err_cut}  # fmt: skip
            if secret and digest is not None:
                record["stdout_digest"] = digest(base64.b64encode(out).decode())
                record["stderr_digest"] = digest(base64.b64encode(err).decode())
            else:
                record.update(stdout_sha256=sha256_hex(out), stderr_sha256=sha256_hex(err))
            return GuestResult(data, record)
        case PutFile(data=content):
            path = _text(reply.get("path"), op, "'path'", 4096)
            h = sha256_hex(content)
            data = {"path": path, "size_bytes": len(content), "sha256": h}
            rec = {"action": op, "path": path, "size_bytes": len(content)}
            if not action.secret:
                rec["sha256"] = h
            return GuestResult(data, rec)
        case GetFile():
            path = _text(reply.get("path"), op, "'path'", 4096)
            content = _b64(reply, op, "data_b64", GET_FILE_MAX_BYTES)
            h = sha256_hex(content)
            data = {"path": path, "data_b64": base64.b64encode(content).decode(),
                    "size_bytes": len(content), "sha256": h}  # fmt: skip
            return GuestResult(data, {"action": op, "path": path, "size_bytes": len(content),
                                      "sha256": h})  # fmt: skip
        case ClipboardGet():
            text = _text(reply.get("text"), op, "'text'", CLIPBOARD_MAX_CHARS)
            raw = text.encode("utf-8")
            return GuestResult({"text": text}, {"action": op, "chars": len(text),
                                                "sha256": sha256_hex(raw)})  # fmt: skip
        case ClipboardSet() | WindowActivate() | WindowClose():
            return GuestResult({}, {"action": op})
        case ListWindows():
            windows = reply.get("windows")
            if not isinstance(windows, list) or len(windows) > MAX_WINDOWS:
                raise _bad(op, f"'windows' is not a list of at most {MAX_WINDOWS}")
            listed = [_window(w, op) for w in windows]
            return GuestResult({"windows": listed}, {"action": op, "count": len(listed),
                                                     "ids": [w["id"] for w in listed]})  # fmt: skip
        case A11yTree(max_nodes=n):
            budget = [n]
            tree = _tree(reply.get("tree"), op, 0, budget)
            truncated = bool(_field(reply, op, "truncated", bool))
            nodes = n - budget[0]
            return GuestResult({"tree": tree, "truncated": truncated, "nodes": nodes},
                               {"action": op, "nodes": nodes, "truncated": truncated})  # fmt: skip
        case SetResolution():
            width = _int(reply, op, "width", 1, 1 << 16)
            height = _int(reply, op, "height", 1, 1 << 16)
            size = {"width": width, "height": height}
            return GuestResult(size, {"action": op, **size})
    raise ActionError(f"not a guest action: {action!r}")


def _window(value: Any, op: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(op, "a window is not an object")
    out = {
        "id": _int(value, op, "id", 1, (1 << 32) - 1),
        "title": _text(value.get("title", ""), op, "a title", MAX_TITLE_CHARS),
        "class": _text(value.get("class", ""), op, "a class", MAX_TITLE_CHARS),
    }
    for key in ("x", "y"):
        out[key] = _int(value, op, key, -_COORD_LIMIT, _COORD_LIMIT)
    for key in ("width", "height"):
        out[key] = _int(value, op, key, 0, _COORD_LIMIT)
    out["focused"] = bool(_field(value, op, "focused", bool))
    return out


def run_guest_action(
    helper: GuestHelper,
    action: GuestAction,
    *,
    digest: Callable[[str], dict[str, Any]] | None = None,
) -> GuestResult:
    """Carry out ``action`` through ``helper`` and return its checked result.

    Raises:
        ActionError: code ``guest_control_unavailable``: the helper does not offer the op.
        GuestHelperError: the helper is gone, timed out (``guest_helper_error``), refused
            (``guest_refused``, ``path_not_allowed``) or broke the protocol
            (``guest_reply_invalid``).
    """
    op, args, timeout_s = guest_request(action)
    ops = helper.hello_info.get("ops")
    if not isinstance(ops, list) or op not in ops:
        raise ActionError(
            f"the guest helper of this image does not offer {op!r} (rebuild the image with "
            "this deskvm's helper)",
            code="guest_control_unavailable",
        )
    reply = helper.request(op, args, timeout_s=timeout_s)
    return check_reply(action, reply, digest=digest)
