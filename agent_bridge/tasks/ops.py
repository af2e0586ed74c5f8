"""Setup steps and getters, carried out through a session's guest control plane.

Everything reaches the guest through :class:`~agent_bridge.tasks.guest.TaskSession`
(``exec``, files, clipboard, windows, accessibility tree over the guest helper's
virtio-serial channel), never the network. Commands run as the desktop user; ``~/`` at
the start of an argument is the user's home (as OSWorld's guest server expands it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agent_bridge.client import RemoteError
from agent_bridge.protocol.guest import PUT_FILE_MAX_BYTES, check_guest_path
from agent_bridge.tasks.guest import ExecOutcome, TaskSession
from agent_bridge.tasks.model import (
    A11yParams,
    CommandGetterParams,
    DownloadParams,
    ExecuteParams,
    GetterConfig,
    LaunchParams,
    LocalFileParams,
    OpenParams,
    RuleParams,
    SetupStep,
    SleepParams,
    TaskConfig,
    TaskConfigError,
    TaskSetupError,
    UploadParams,
    VmFileParams,
    WindowListParams,
    WindowParams,
)
from orchestrator.errors import DeskvmError

__all__ = ["GETTERS", "SETUP_STEPS", "TaskOps", "egress_allows"]

UNTIL_TRIES = 100
"""Most runs of an ``execute`` step with ``until`` (0.3 s apart) before it fails."""
DOWNLOAD_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 120.0
"""Deadline of the guest command joining an upload's parts, seconds."""
# Joins the parts ($1/part.*) of an upload, checks the SHA-256 ($3), moves it to $2; the
# parts directory goes whatever happens.
_JOIN = (
    'trap \'rm -rf "$1" "$2.deskvm-upload"\' EXIT; '
    'cat "$1"/part.* > "$2.deskvm-upload" || exit 1; '
    'got=$(sha256sum < "$2.deskvm-upload" | cut -d" " -f1); '
    'if [ "$got" != "$3" ]; then '
    'echo "the joined parts\' SHA-256 is $got, not $3" >&2; exit 1; fi; '
    'mv -f "$2.deskvm-upload" "$2"'
)
_STDERR_TAIL_CHARS = 400


def egress_allows(allow: Sequence[str], url: str) -> bool:
    """Whether an egress allowlist (``docs/protocol.md`` entries: domains, ``*.domain``,
    CIDR, each with an optional ``:port``) lets the guest reach ``url``'s host and port.

    A first, friendly check before a task starts; the host's nftables rules decide.
    """
    import ipaddress

    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for entry in allow:
        name, _, entry_port = entry.strip().lower().rpartition(":")
        if not name or not entry_port.isdigit() or "/" in entry_port:
            name, entry_port = entry.strip().lower(), ""
        if entry_port and int(entry_port) != port:
            continue
        try:
            if ipaddress.ip_address(host) in ipaddress.ip_network(name, strict=False):
                return True
            continue
        except ValueError:
            pass
        if name.startswith("*."):
            if host.endswith(name[1:]):
                return True
        elif host == name.rstrip("."):
            return True
    return False


class TaskOps:
    """One task's setup steps and getters in one session.

    Args:
        session: the session (guest control enabled).
        task: the validated task (local paths resolve against its file).
        cache_dir: this task's directory on this host for fetched files and outputs.
        sleep: the host's sleep, injectable for tests.
    """

    def __init__(
        self,
        session: TaskSession,
        task: TaskConfig,
        cache_dir: Path,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.session = session
        self.task = task
        self.cache_dir = cache_dir
        self.sleep = sleep
        self.notes: list[str] = []
        self._home: str | None = None

    # --- helpers ------------------------------------------------------------------------

    def home(self) -> str:
        """The desktop user's home directory in the guest (asked once: ``exec`` runs in it)."""
        if self._home is None:
            out = self._exec(["pwd"], "home directory", timeout_s=15)
            home = out.stdout.strip()
            if out.exit_code != 0 or not home.startswith("/"):
                raise TaskSetupError(f"cannot learn the guest user's home: {out.stderr.strip()}")
            self._home = home.rstrip("/")
        return self._home

    def guest_path(self, path: str) -> str:
        """``path`` with a leading ``~`` made the user's home."""
        if path == "~":
            return self.home()
        if path.startswith("~/"):
            return self.home() + path[1:]
        return path

    def argv(self, command: str | list[str], shell: bool) -> list[str]:
        """OSWorld's ``command`` / ``shell`` as an argv list."""
        if shell:
            text = command if isinstance(command, str) else shlex.join(command)
            return ["sh", "-c", text]
        args = shlex.split(command) if isinstance(command, str) else list(command)
        return [self.guest_path(a) if a.startswith("~") else a for a in args]

    def _exec(self, argv: list[str], what: str, *, timeout_s: float = 30.0) -> ExecOutcome:
        try:
            return self.session.exec(argv, timeout_s=timeout_s)
        except RemoteError as exc:
            raise TaskSetupError(f"{what}: exec refused ({exc.code}): {exc}") from exc

    def find_window(self, params: WindowParams | A11yParams, what: str) -> dict[str, Any]:
        """The first window matching ``params`` (see :class:`WindowParams`).

        Raises:
            TaskSetupError: no window matches (the message lists the titles there are).
        """
        wins = self.session.windows()
        name = params.window_name or ""
        strict = getattr(params, "strict", False)
        by_class = getattr(params, "by_class", False)
        for w in wins:
            value = str(w.get("class" if by_class else "title", ""))
            if (value == name) if strict else (name.lower() in value.lower()):
                return w
        titles = ", ".join(repr(w.get("title", "")) for w in wins) or "none"
        raise TaskSetupError(f"{what}: no window {'class' if by_class else 'title'} matching "
                             f"{name!r} (windows: {titles})")  # fmt: skip

    # --- setup --------------------------------------------------------------------------

    def check_before_start(self) -> None:
        """What can only be checked against the session, before any step runs: a
        ``download`` needs an egress policy that allows its URL.

        Raises:
            TaskConfigError: a download the session's network cannot make.
        """
        allow = self.session.egress_allow()
        for where, step in self.task.steps():
            if not isinstance(step.params, DownloadParams):
                continue
            for j, item in enumerate(step.params.files):
                if allow is None:
                    raise TaskConfigError(
                        f"{self.task.id}: {where} download files[{j}]: the session has no "
                        "network (create it with an egress policy allowing "
                        f"{urlsplit(item.url).hostname}, e.g. --egress-allow)"
                    )
                if not egress_allows(allow, item.url):
                    raise TaskConfigError(
                        f"{self.task.id}: {where} download files[{j}]: {item.url} is not "
                        f"allowed by the session's egress policy ({', '.join(allow) or 'empty'})"
                    )

    def run_step(self, where: str, step: SetupStep) -> None:
        """Run one setup step.

        Raises:
            TaskSetupError: the step failed (the message names ``where`` and the type).
        """
        what = f"{where} {step.type}"
        try:
            SETUP_STEPS[step.type](self, step.params, what)
        except TaskSetupError:
            raise
        except RemoteError as exc:
            raise TaskSetupError(f"{what}: {exc.code}: {exc}") from exc
        except DeskvmError as exc:
            raise TaskSetupError(f"{what}: {exc.message}") from exc

    def _launch(self, p: LaunchParams, what: str) -> None:
        argv = self.argv(p.command, p.shell)
        # Detached (own session, no pipes held open): exec returns at once.
        out = self._exec(
            ["sh", "-c", 'exec setsid -f "$@" </dev/null >/dev/null 2>&1', "launch", *argv], what
        )
        if out.exit_code != 0:
            raise TaskSetupError(f"{what}: {argv[0]!r} did not start (exit {out.exit_code})")

    def _open(self, p: OpenParams, what: str) -> None:
        path = self.guest_path(p.path)
        probe = self._exec(["sh", "-c", "command -v xdg-open"], what)
        if probe.exit_code != 0:
            raise TaskSetupError(f"{what}: the guest has no xdg-open to open {path}")
        self._launch(LaunchParams(command=["xdg-open", path]), what)

    def _execute(self, p: ExecuteParams, what: str) -> None:
        argv = self.argv(p.command, p.shell)
        tries = UNTIL_TRIES if p.until is not None else 1
        for attempt in range(tries):
            out = self._exec(argv, what, timeout_s=p.timeout_s)
            if p.stdout:
                (self.cache_dir / p.stdout).write_text(out.stdout, encoding="utf-8")
            if p.stderr:
                (self.cache_dir / p.stderr).write_text(out.stderr, encoding="utf-8")
            if out.exit_code != 0:
                self.notes.append(
                    f"{what}: exit {out.exit_code}: {out.stderr.strip()[-_STDERR_TAIL_CHARS:]}"
                )
            u = p.until
            if u is None or (
                (u.returncode is not None and out.exit_code == u.returncode)
                or (u.stdout is not None and u.stdout in out.stdout)
                or (u.stderr is not None and u.stderr in out.stderr)
            ):
                return
            if attempt + 1 < tries:
                self.sleep(0.3)
        raise TaskSetupError(f"{what}: 'until' not reached after {tries} runs")

    def _sleep(self, p: SleepParams, what: str) -> None:
        self.sleep(p.seconds)

    def _activate(self, p: WindowParams, what: str) -> None:
        self.session.window_activate(int(self.find_window(p, what)["id"]))

    def _close(self, p: WindowParams, what: str) -> None:
        self.session.window_close(int(self.find_window(p, what)["id"]))

    def _upload(self, p: UploadParams, what: str) -> None:
        for item in p.files:
            local = self.task.local(item.local_path)
            try:
                data = local.read_bytes()
            except OSError as exc:
                raise TaskSetupError(f"{what}: cannot read {local}: {exc.strerror}") from exc
            path = self.guest_path(item.path)
            if len(data) <= PUT_FILE_MAX_BYTES:
                self.session.put_file(path, data)
            else:
                self._upload_parts(path, data, what)

    def _upload_parts(self, path: str, data: bytes, what: str) -> None:
        """A file over ``put_file``'s cap: parts into a private directory under ``/tmp``,
        then one ``exec`` joins them, checks their SHA-256 and moves the file into place
        (a file already at ``path`` stays as it was if anything fails)."""
        check_guest_path(path)  # the host's lexical confinement, as put_file's own
        parts = f"/tmp/.deskvm-upload-{secrets.token_hex(8)}"
        made = self._exec(["mkdir", "-m", "700", parts], what)
        if made.exit_code != 0:
            raise TaskSetupError(f"{what}: cannot make {parts}: {made.stderr.strip()}")
        try:
            for n, start in enumerate(range(0, len(data), PUT_FILE_MAX_BYTES)):
                self.session.put_file(
                    f"{parts}/part.{n:05d}", data[start : start + PUT_FILE_MAX_BYTES]
                )
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to tell
                self._exec(["rm", "-rf", parts], what)
            raise
        want = hashlib.sha256(data).hexdigest()
        out = self._exec(
            ["sh", "-c", _JOIN, "deskvm-upload", parts, path, want], what,
            timeout_s=JOIN_TIMEOUT_S,
        )  # fmt: skip
        if out.exit_code != 0:
            raise TaskSetupError(
                f"{what}: {path}: {out.stderr.strip()[-_STDERR_TAIL_CHARS:] or 'join failed'}"
            )

    def _download(self, p: DownloadParams, what: str) -> None:
        for item in p.files:
            path = self.guest_path(item.path)
            argv = ["curl", "-fsSL", "--max-time", str(int(DOWNLOAD_TIMEOUT_S)), "-o", path,
                    item.url]  # fmt: skip
            out = self._exec(argv, what, timeout_s=DOWNLOAD_TIMEOUT_S + 30)
            if out.exit_code != 0:
                raise TaskSetupError(
                    f"{what}: {item.url} -> {path}: curl exit {out.exit_code}: "
                    f"{out.stderr.strip()[-_STDERR_TAIL_CHARS:]}"
                )

    # --- getters ------------------------------------------------------------------------

    def get(self, getter: GetterConfig) -> Any:
        """The state one getter describes (see :data:`GETTERS`).

        Raises:
            DeskvmError: the guest refused or failed a request the getter needs (a missing
                ``vm_file`` is not an error: it gives ``None``).
        """
        return GETTERS[getter.type](self, getter.params)

    def _vm_file(self, p: VmFileParams) -> Any:
        paths = p.path if isinstance(p.path, list) else [p.path]
        dests = p.dest if isinstance(p.dest, list) else [p.dest]
        got: list[str | None] = []
        for guest, dest in zip(paths, dests, strict=True):
            target = self.cache_dir / dest
            try:
                target.write_bytes(self.session.get_file(self.guest_path(guest)))
                got.append(str(target))
            except RemoteError as exc:
                self.notes.append(f"vm_file {guest}: {exc.code}: {exc}")
                got.append(None)
        given = [got[i] for i in p.gives]
        return given[0] if len(given) == 1 else given

    def _command(self, p: CommandGetterParams, stream: str) -> str:
        out = self.session.exec(self.argv(p.command, p.shell), timeout_s=p.timeout_s)
        return str(getattr(out, stream))

    def _a11y(self, p: A11yParams) -> str:
        window_id = None
        if p.window_name is not None:
            window_id = int(self.find_window(p, "accessibility_tree")["id"])
        tree = self.session.a11y_tree(window_id=window_id)
        if isinstance(tree, Mapping) and "tree" in tree:
            tree = tree["tree"]
        return json.dumps(tree, ensure_ascii=False)

    def _windows(self, p: WindowListParams) -> list[Any]:
        wins = [w for w in self.session.windows() if w.get("focused") or not p.focused_only]
        return wins if p.field is None else [w.get(p.field) for w in wins]

    def _local(self, p: LocalFileParams) -> str:
        return str(self.task.local(p.path))


SETUP_STEPS: Mapping[str, Callable[[TaskOps, Any, str], None]] = {
    "launch": TaskOps._launch,
    "open": TaskOps._open,
    "execute": TaskOps._execute,
    "command": TaskOps._execute,
    "sleep": TaskOps._sleep,
    "activate_window": TaskOps._activate,
    "close_window": TaskOps._close,
    "upload_file": TaskOps._upload,
    "download": TaskOps._download,
}
"""Every setup step type with its implementation (same names as ``SETUP_PARAMS``)."""

GETTERS: Mapping[str, Callable[[TaskOps, Any], Any]] = {
    "vm_file": TaskOps._vm_file,
    "vm_command_line": lambda ops, p: ops._command(p, "stdout"),
    "vm_command_error": lambda ops, p: ops._command(p, "stderr"),
    "accessibility_tree": TaskOps._a11y,
    "window_list": TaskOps._windows,
    "clipboard": lambda ops, p: ops.session.clipboard_get(),
    "rule": lambda ops, p: p.rules if isinstance(p, RuleParams) else None,
    "local_file": TaskOps._local,
}
"""Every getter type with its implementation (same names as ``GETTER_PARAMS``)."""
