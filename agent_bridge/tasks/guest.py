"""The seam between the task environment and a deskvm session, and its in-package fake.

:class:`TaskSession` is what :class:`~agent_bridge.tasks.env.DesktopEnv` needs of a
session: the guest control plane (``exec``, files, clipboard, windows, accessibility tree;
a session created with ``guest_control=True``), screenshots, and a way to send actions in
a vendor vocabulary (:meth:`TaskSession.channel`). :class:`ClientTaskSession` adapts the
synchronous :class:`~agent_bridge.client.Session`; :class:`FakeTaskSession` is a scripted
stand-in for tests (an in-memory guest: files, clipboard, windows, commands you script).
"""

from __future__ import annotations

import base64
import io
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agent_bridge.client import RemoteError, Session
from agent_bridge.protocol.vocab import get_vocabulary

__all__ = [
    "ActionChannel",
    "ClientTaskSession",
    "ExecOutcome",
    "FakeChannel",
    "FakeTaskSession",
    "TaskSession",
]


@runtime_checkable
class ExecOutcome(Protocol):
    """What ``exec`` returns: ``exit_code`` (``-N``: killed by signal ``N``), text output."""

    exit_code: int
    stdout: str
    stderr: str


class ActionChannel(Protocol):
    """A WebSocket connection speaking one vocabulary (``schema``)."""

    def request(self, message: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """Send one request body; its reply's ``result`` (vendor-shaped).

        Raises:
            RemoteError: the action was refused (``refused_code``, ``out_of_screen``...).
        """
        ...


class TaskSession(Protocol):
    """The session a task runs in (see the module docstring). Paths are absolute guest
    paths under the desktop user's home or ``/tmp``."""

    id: str

    def exec(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        timeout_s: float = 30,
        env: Mapping[str, str] | None = None,
    ) -> ExecOutcome: ...

    def put_file(self, path: str, data: bytes) -> Any: ...

    def get_file(self, path: str) -> bytes: ...

    def clipboard_get(self) -> str: ...

    def clipboard_set(self, text: str) -> Any: ...

    def windows(self) -> list[dict[str, Any]]: ...

    def window_activate(self, id: int) -> Any: ...

    def window_close(self, id: int) -> Any: ...

    def a11y_tree(self, window_id: int | None = None) -> Any: ...

    def screenshot_png(self) -> bytes:
        """The whole screen as PNG bytes."""
        ...

    def channel(self, schema: str) -> ActionChannel:
        """A connection speaking ``schema`` (``deskvm``, ``pyautogui``, ``computer_13``...)."""
        ...

    def recording(self) -> str | None:
        """The session's recording directory (on the server host), if it has one."""
        ...

    def reset_desktop(self) -> bool:
        """Return the desktop to its start state (a warm session's saved state, in about a
        second: OSWorld's snapshot revert). ``False``: this session cannot (it booted cold).
        """
        ...

    def egress_allow(self) -> list[str] | None:
        """The session's egress allowlist; ``None``: no network device at all."""
        ...


class ClientTaskSession:
    """:class:`TaskSession` over a :class:`~agent_bridge.client.Session` (its typed methods
    for the control plane, and :meth:`Client.attach` for vendor vocabularies)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.id = session.id
        self._channels: dict[str, Session] = {}

    def exec(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        timeout_s: float = 30,
        env: Mapping[str, str] | None = None,
    ) -> ExecOutcome:
        result: ExecOutcome = self.session.exec(  # type: ignore[attr-defined]
            list(argv), stdin=stdin, timeout_s=timeout_s, env=dict(env) if env else None
        )
        return result

    def put_file(self, path: str, data: bytes) -> Any:
        return self.session.put_file(path, data)  # type: ignore[attr-defined]

    def get_file(self, path: str) -> bytes:
        data: bytes = self.session.get_file(path)  # type: ignore[attr-defined]
        return data

    def clipboard_get(self) -> str:
        return str(self.session.clipboard_get())  # type: ignore[attr-defined]

    def clipboard_set(self, text: str) -> Any:
        return self.session.clipboard_set(text)  # type: ignore[attr-defined]

    def windows(self) -> list[dict[str, Any]]:
        return list(self.session.windows())  # type: ignore[attr-defined]

    def window_activate(self, id: int) -> Any:
        return self.session.window_activate(id)  # type: ignore[attr-defined]

    def window_close(self, id: int) -> Any:
        return self.session.window_close(id)  # type: ignore[attr-defined]

    def a11y_tree(self, window_id: int | None = None) -> Any:
        return self.session.a11y_tree(window_id=window_id)  # type: ignore[attr-defined]

    def screenshot_png(self) -> bytes:
        return self.session.screenshot().png

    def channel(self, schema: str) -> ActionChannel:
        if schema == self.session.schema:
            return self.session
        if schema not in self._channels:
            self._channels[schema] = self.session.client.attach(self.id, schema=schema)
        return self._channels[schema]

    def recording(self) -> str | None:
        return self.session.info_at_start.recording

    def reset_desktop(self) -> bool:
        try:
            self.session.reset()
        except RemoteError as exc:
            if exc.code == "reset_unavailable":
                return False
            raise
        return True

    def egress_allow(self) -> list[str] | None:
        egress = self.session.info_at_start.raw.get("egress")
        return None if egress is None else list(egress.get("allow", []))

    def close(self) -> None:
        """Close the extra connections (the session itself stays)."""
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()


# --- the fake -----------------------------------------------------------------------------


@dataclass
class FakeExec:
    """A scripted ``exec`` outcome."""

    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""


def _tiny_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0x2E, 0x4A, 0x62)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class FakeChannel:
    """A fake connection: parses every body with the real vocabulary (so refusals are the
    real ones), records it, and answers as the vocabulary's result would for the episode's
    end (``done`` / ``info``) with a tiny screenshot."""

    schema: str
    log: list[tuple[str, dict[str, Any]]]
    on_action: Callable[[str, Mapping[str, Any]], None] | None = None

    def request(self, message: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        body = {k: v for k, v in message.items() if k != "id"}
        from agent_bridge.protocol.replies import split_screenshot_after
        from orchestrator.errors import ProtocolError

        try:
            # As the bridge: any request may carry screenshot_after (a still-screen wait).
            get_vocabulary(self.schema).parse(split_screenshot_after(body)[0])
        except ProtocolError as exc:
            raise RemoteError(exc.code, exc.message) from exc
        self.log.append((self.schema, body))
        if self.on_action is not None:
            self.on_action(self.schema, body)
        if self.schema == "deskvm":
            return {}
        code = body.get("code", body.get("action_type"))
        text = code.strip() if isinstance(code, str) else ""
        shot = base64.b64encode(_tiny_png()).decode()
        if text.endswith("DONE") or text.endswith("FAIL"):
            key = "done" if text.endswith("DONE") else "fail"
            return {"observation": {"screenshot": shot}, "done": True, "info": {key: True}}
        return {"observation": {"screenshot": shot}, "done": False, "info": {}}


@dataclass
class FakeTaskSession:
    """An in-memory guest for tests of setup steps, getters and the harness.

    ``files`` maps absolute guest paths to bytes; ``windows_list`` holds window dicts;
    ``exec_handler(argv, stdin)`` scripts commands (``pwd`` answers ``home``, as exec runs
    there; without a handler anything else exits 0 silently); every control call is
    appended to ``calls`` and every action to ``actions`` as ``(schema, body)``.
    ``on_action`` lets a test make an action change the guest (e.g. typing a command
    writes a file).
    """

    id: str = "fake0001"
    home: str = "/home/desk"
    files: dict[str, bytes] = field(default_factory=dict)
    clipboard: str = ""
    windows_list: list[dict[str, Any]] = field(default_factory=list)
    tree: dict[str, Any] = field(
        default_factory=lambda: {"role": "desktop frame", "name": "main", "states": [],
                                 "x": 0, "y": 0, "width": 8, "height": 8, "children": []}
    )  # fmt: skip
    exec_handler: Callable[[list[str], str | None], FakeExec] | None = None
    allow: list[str] | None = None
    recording_dir: str | None = "/var/lib/deskvm/recordings/fake0001"
    resettable: bool = False
    on_action: Callable[[str, Mapping[str, Any]], None] | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    actions: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def _path(self, path: str) -> str:
        if not posixpath.isabs(path) or ".." in path.split("/"):
            raise RemoteError("invalid_path", f"path {path!r} is not absolute and normalised")
        if not (path.startswith("/tmp/") or path.startswith(self.home + "/")):
            raise RemoteError("path_not_allowed", f"path {path!r} is outside home and /tmp")
        return path

    def exec(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        timeout_s: float = 30,
        env: Mapping[str, str] | None = None,
    ) -> FakeExec:
        self.calls.append(("exec", list(argv)))
        if list(argv) == ["pwd"]:  # exec runs in the home directory
            return FakeExec(0, self.home + "\n")
        if self.exec_handler is not None:
            return self.exec_handler(list(argv), stdin)
        return FakeExec()

    def put_file(self, path: str, data: bytes) -> dict[str, Any]:
        from agent_bridge.protocol.guest import PUT_FILE_MAX_BYTES

        self.calls.append(("put_file", path))
        if len(data) > PUT_FILE_MAX_BYTES:  # as the bridge refuses it
            raise RemoteError(
                "invalid_action", f"the file is larger than {PUT_FILE_MAX_BYTES} bytes"
            )
        self.files[self._path(path)] = bytes(data)
        return {"path": path, "size": len(data)}

    def get_file(self, path: str) -> bytes:
        self.calls.append(("get_file", path))
        try:
            return self.files[self._path(path)]
        except KeyError:
            raise RemoteError("file_not_found", f"no file {path}") from None

    def clipboard_get(self) -> str:
        self.calls.append(("clipboard_get", None))
        return self.clipboard

    def clipboard_set(self, text: str) -> None:
        self.calls.append(("clipboard_set", text))
        self.clipboard = text

    def windows(self) -> list[dict[str, Any]]:
        self.calls.append(("windows", None))
        return [dict(w) for w in self.windows_list]

    def window_activate(self, id: int) -> None:
        self.calls.append(("window_activate", id))
        for w in self.windows_list:
            w["focused"] = w["id"] == id

    def window_close(self, id: int) -> None:
        self.calls.append(("window_close", id))
        self.windows_list = [w for w in self.windows_list if w["id"] != id]

    def a11y_tree(self, window_id: int | None = None) -> dict[str, Any]:
        self.calls.append(("a11y_tree", window_id))
        return {"tree": self.tree, "truncated": False, "nodes": 1}

    def screenshot_png(self) -> bytes:
        return _tiny_png()

    def channel(self, schema: str) -> FakeChannel:
        return FakeChannel(schema, self.actions, self.on_action)

    def recording(self) -> str | None:
        return self.recording_dir

    def reset_desktop(self) -> bool:
        self.calls.append(("reset_desktop", self.resettable))
        return self.resettable

    def egress_allow(self) -> list[str] | None:
        return self.allow
