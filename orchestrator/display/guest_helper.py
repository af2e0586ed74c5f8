"""The host end of the in-guest helper: a virtio-serial port, JSON lines each way.

Some input has no path through QEMU's ``input-send-event``: characters with no key on the
guest's US layout (``Ñandú``, ``美国降息新闻``) and, before QEMU 8.1, the horizontal wheel
(``InputButton`` has no ``wheel-left``/``wheel-right``). Images that carry the guest helper
(``vm_images/guest/base/usr/local/bin/deskvm-helper``, recipe key ``boot.helper_port``)
get a libvirt ``<channel type='unix'>`` whose guest end is
``/dev/virtio-ports/<helper_port>``; the helper injects those events through the guest X
server's XTEST extension. The channel is a serial port between QEMU and this process: the
guest has no network path to the host through it.

Protocol (version 1; the helper's docstring is the reference): each side writes one UTF-8
JSON object per line. The helper announces itself with
``{"hello": "deskvm-helper", "protocol": 1, "ops": [...], "spare_keycodes": N}``. A
request ``{"id": N, "op": ..., ...}`` is answered ``{"id": N, "ready": true}`` (or refused,
``{"id": N, "ok": false, "error": ...}``); only then does the host send
``{"id": N, "op": "go"}`` and the helper act and answer ``{"id": N, "ok": true, ...}``. A
request the host gave up on before ``ready`` (no helper was reading, say) is never
confirmed, so a helper that reads it later drops it: what the host reported as not done
is never done.

Key acknowledgements: a helper that can count the X server's key events (XInput2 raw
events) puts ``"key_events": N`` in its hello and sends ``{"key_events": N}`` whenever N
changes: the key presses and releases the X server has processed from the keyboard QEMU
drives, since the helper started. :meth:`GuestHelper.key_events` and
:meth:`GuestHelper.wait_key_events` give it to :class:`orchestrator.display.key_pacing.KeyPacer`,
which keeps QEMU's keys only a few ahead of it.

The guest is untrusted: lines are bounded (:data:`MAX_LINE_BYTES`), anything that is not a
JSON object, not the hello or not an answer to the pending request is dropped, writes
and every phase of a request have deadlines, and a helper that does not acknowledge a
request is taken as gone until it announces itself again.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from orchestrator.errors import GuestHelperError

__all__ = [
    "ACK_TIMEOUT_S",
    "GUEST_ERROR_CODES",
    "HELPER_PROTOCOL",
    "MAX_ERROR_CHARS",
    "MAX_LINE_BYTES",
    "SEND_TIMEOUT_S",
    "GuestHelper",
    "HelperChannel",
]

HELPER_PROTOCOL = 1
MAX_LINE_BYTES = 12 << 20
"""Longest line accepted from the guest, bytes; longer lines are dropped whole (the largest
reply, a ``get_file`` of 8 MiB, is about 11 MiB of base64)."""
MAX_ERROR_CHARS = 500
"""The guest's own words in an error are cut to this many characters."""
GUEST_ERROR_CODES = {"path_not_allowed": "path_not_allowed"}
"""Refusal codes the guest may set that keep their code; any other is ``guest_refused``."""
ACK_TIMEOUT_S = 5.0
"""How long the helper has to answer a request ``ready`` (or refuse it), seconds."""
SEND_TIMEOUT_S = 5.0
"""How long a write to the channel may block (the guest is not reading), seconds."""


class GuestHelper(Protocol):
    """The in-guest helper of one running domain."""

    def unavailable_reason(self, wait_s: float = 0.0) -> str | None:
        """``None`` when the helper has announced itself, else why it cannot be used.

        Args:
            wait_s: how long to wait for the helper's announcement, seconds.
        """
        ...

    def request(self, op: str, args: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """Send one request and wait for its reply.

        Args:
            op: ``"type"`` (``text``) or ``"wheel"`` (``direction``, ``count``, ``x``, ``y``,
                ``mods``).
            args: the request's other members.
            timeout_s: deadline for the reply, seconds.

        Returns:
            The reply object (``ok`` is true).

        Raises:
            GuestHelperError: the helper is not connected, answered ``ok: false``, or did
                not answer before the deadline.
        """
        ...

    @property
    def hello_info(self) -> dict[str, Any]:
        """The helper's announcement (``ops``, ``spare_keycodes``...); empty before it."""
        ...

    def key_events(self) -> int | None:
        """The guest X server's count of processed key events (presses and releases from
        QEMU's keyboard since the helper started), as last reported; ``None`` when the
        helper reports none (not announced, or no XInput2 in the guest)."""
        ...

    def wait_key_events(self, at_least: int, timeout_s: float) -> int | None:
        """Wait until :meth:`key_events` is ``at_least`` (or lower than before: a restarted
        helper counts from 0 again) or ``timeout_s`` passed; the count then."""
        ...

    def close(self) -> None: ...


class _Pending:
    """One request in flight: its ``ready`` answer, then its final answer."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.done = threading.Event()
        self.reply: dict[str, Any] | None = None


class HelperChannel:
    """:class:`GuestHelper` over the unix socket of a libvirt ``<channel>`` (QEMU listens).

    Args:
        socket_path: the channel's host socket.
        connect_timeout_s: how long :meth:`connect` retries while QEMU sets the socket up.
    """

    def __init__(self, socket_path: Path, *, connect_timeout_s: float = 10.0) -> None:
        self._path = socket_path
        self._connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._hello = threading.Event()
        self._hello_info: dict[str, Any] = {}
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._closed_reason: str | None = None
        self._gone_reason: str | None = None
        self._dropped_lines = 0
        self._reader: threading.Thread | None = None
        self._keys = threading.Condition()
        self._key_events: int | None = None

    @property
    def socket_path(self) -> Path:
        return self._path

    @property
    def dropped_lines(self) -> int:
        """Lines from the guest that were dropped (too long, not JSON, unexpected)."""
        return self._dropped_lines

    @property
    def hello_info(self) -> dict[str, Any]:
        """The helper's announcement (empty until it arrives)."""
        return dict(self._hello_info)

    def key_events(self) -> int | None:
        return self._key_events

    def wait_key_events(self, at_least: int, timeout_s: float) -> int | None:
        with self._keys:
            start = self._key_events
            self._keys.wait_for(
                lambda: (
                    self._key_events is None
                    or self._key_events >= at_least
                    or (start is not None and self._key_events < start)
                ),
                timeout=timeout_s,
            )
            return self._key_events

    def _set_key_events(self, value: Any) -> None:
        # The guest is untrusted: only a plain non-negative integer counts.
        if type(value) is not int or not 0 <= value < 1 << 63:
            self._dropped_lines += 1
            return
        with self._keys:
            self._key_events = value
            self._keys.notify_all()

    def connect(self) -> None:
        """Connect to QEMU's end of the channel and start reading.

        Raises:
            GuestHelperError: the socket did not accept a connection in time.
        """
        deadline = time.monotonic() + self._connect_timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self._path))
                break
            except OSError as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise GuestHelperError(
                        f"cannot connect to the guest helper channel {self._path}: {exc}"
                    ) from exc
                time.sleep(0.05)
        sock.settimeout(None)
        # Bound writes (the guest may never read); reads block in the reader thread.
        seconds, fraction = divmod(SEND_TIMEOUT_S, 1.0)
        timeval = struct.pack("ll", int(seconds), int(fraction * 1_000_000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self._sock = sock
        self._reader = threading.Thread(
            target=self._read_loop, name=f"guest-helper {self._path.parent.name}", daemon=True
        )
        self._reader.start()
        # If the helper started before we connected, its announcement is gone: ask again.
        # (QEMU holds this until the guest opens its port.)
        with contextlib.suppress(GuestHelperError):
            self._send({"id": 0, "op": "hello"})

    def unavailable_reason(self, wait_s: float = 0.0) -> str | None:
        if self._hello.is_set():
            return None
        if wait_s > 0 and self._gone_reason is not None and self._closed_reason is None:
            # It stopped answering once (stopped, busy, restarted): ask it to announce
            # itself again rather than staying unavailable for good.
            with contextlib.suppress(GuestHelperError):
                self._send({"id": 0, "op": "hello"})
        if self._hello.wait(wait_s):
            return None
        if self._closed_reason is not None:
            return self._closed_reason
        if self._sock is None:
            return "the guest helper channel is not connected"
        if self._gone_reason is not None:
            return f"{self._gone_reason}, and has not announced itself since"
        return "the guest helper has not announced itself (is it running in the guest?)"

    def request(self, op: str, args: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
        reason = self.unavailable_reason()
        if reason is not None:
            raise GuestHelperError(reason)
        deadline = time.monotonic() + timeout_s
        request_id = next(self._ids)
        pending = _Pending()
        with self._state_lock:
            self._pending[request_id] = pending
        try:
            self._send({**args, "id": request_id, "op": op})
            ack_s = min(ACK_TIMEOUT_S, timeout_s)
            if not pending.ready.wait(ack_s):
                self._gone(f"the guest helper did not acknowledge {op!r} within {ack_s:.1f} s")
                raise GuestHelperError(
                    f"the guest helper did not acknowledge {op!r} within {ack_s:.1f} s "
                    "(is it running in the guest?); nothing was injected"
                )
            if pending.done.is_set():  # refused (or the channel closed) instead of ready
                return self._final(op, pending, injected=False)
            self._send({"id": request_id, "op": "go"})
            if not pending.done.wait(max(0.0, deadline - time.monotonic())):
                raise GuestHelperError(
                    f"the guest helper did not finish {op!r} within {timeout_s:.1f} s "
                    "(part of it may have reached the guest)"
                )
            return self._final(op, pending, injected=True)
        finally:
            with self._state_lock:
                self._pending.pop(request_id, None)

    def _final(self, op: str, pending: _Pending, *, injected: bool) -> dict[str, Any]:
        reply = pending.reply
        if reply is None:
            raise GuestHelperError(self._closed_reason or "the guest helper channel closed")
        if reply.get("ok") is not True:
            error = str(reply.get("error", "no reason given"))[:MAX_ERROR_CHARS]
            note = "" if injected else " (nothing was injected)"
            code = reply.get("code")
            if isinstance(code, str):
                raise GuestHelperError(
                    f"the guest refused {op}: {error}",
                    code=GUEST_ERROR_CODES.get(code, "guest_refused"),
                )
            raise GuestHelperError(f"the guest helper could not {op}: {error}{note}")
        return reply

    def _gone(self, reason: str) -> None:
        """The helper stopped answering: unavailable until it announces itself again."""
        self._hello.clear()
        self._gone_reason = reason
        with self._keys:  # a helper that does not answer reports no count either
            self._key_events = None
            self._keys.notify_all()

    def close(self) -> None:
        self._fail_all("the guest helper channel was closed")
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)

    # --- internals -----------------------------------------------------------------------

    def _send(self, obj: Mapping[str, Any]) -> None:
        data = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        sock = self._sock
        if sock is None:
            raise GuestHelperError(self._closed_reason or "the guest helper is not connected")
        with self._write_lock:
            try:
                sock.sendall(data)
            except OSError as exc:
                # A line may be half written: the stream is no longer in step. Give up on it.
                reason = f"writing to the guest helper failed ({exc}); its channel is closed"
                self._fail_all(reason)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                raise GuestHelperError(reason) from exc

    def _fail_all(self, reason: str) -> None:
        with self._state_lock:
            if self._closed_reason is None:
                self._closed_reason = reason
            pending = list(self._pending.values())
        self._hello.clear()
        for entry in pending:
            entry.ready.set()
            entry.done.set()
        with self._keys:
            self._key_events = None
            self._keys.notify_all()

    def _read_loop(self) -> None:
        buf = bytearray()
        skipping = False
        sock = self._sock
        assert sock is not None
        while True:
            try:
                chunk = sock.recv(1 << 18)
            except OSError:
                chunk = b""
            if not chunk:
                self._fail_all("the guest helper channel closed (the domain stopped?)")
                return
            # Only the new bytes can hold the next newline: no rescan of a long line.
            scanned = len(buf)
            buf += chunk
            while True:
                newline = buf.find(b"\n", scanned)
                scanned = 0
                if newline < 0:
                    if len(buf) > MAX_LINE_BYTES:
                        buf.clear()
                        skipping = True
                        self._dropped_lines += 1
                    break
                line = bytes(buf[:newline])
                del buf[: newline + 1]
                if skipping:
                    skipping = False
                    continue
                if len(line) > MAX_LINE_BYTES:
                    self._dropped_lines += 1
                    continue
                self._on_line(line)

    def _on_line(self, line: bytes) -> None:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # nested deeper than the parser recurses
            self._dropped_lines += 1
            return
        if not isinstance(obj, dict):
            self._dropped_lines += 1
            return
        if obj.get("hello") == "deskvm-helper":
            if obj.get("protocol") == HELPER_PROTOCOL:
                keep = ("hello", "protocol", "ops", "spare_keycodes")
                self._hello_info = {k: obj[k] for k in keep if k in obj}
                if "key_events" in obj:
                    self._set_key_events(obj["key_events"])
                else:
                    with self._keys:
                        self._key_events = None
                        self._keys.notify_all()
                self._gone_reason = None
                self._hello.set()
            else:
                self._hello.clear()
                self._gone_reason = (
                    f"the guest helper speaks protocol {obj.get('protocol')!r}, "
                    f"not {HELPER_PROTOCOL}"
                )
            return
        if "key_events" in obj and "id" not in obj:
            self._set_key_events(obj["key_events"])
            return
        request_id = obj.get("id")
        with self._state_lock:
            entry = self._pending.get(request_id) if isinstance(request_id, int) else None
        if entry is None:
            self._dropped_lines += 1
            return
        if obj.get("ready") is True and not entry.ready.is_set():
            entry.ready.set()
        elif "ok" in obj and not entry.done.is_set():
            entry.reply = obj
            entry.done.set()
            entry.ready.set()
        else:
            self._dropped_lines += 1
