"""The host side of the guest clock (``set_guest_clock``) against a stand-in guest on a
Unix socket, as QEMU's virtio-serial channel presents it to the host."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from orchestrator.hypervisor.libvirt import set_guest_clock


def serve_once(path: Path, answer: Callable[[int], list[bytes]]) -> threading.Thread:
    """Accept one connection on ``path``; reply to its request with ``answer(sent_ns)``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def run() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                buf = b""
                while b"\n" not in buf:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buf += chunk
                sent_ns = json.loads(buf.split(b"\n", 1)[0])["realtime_ns"]
                for line in answer(sent_ns):
                    conn.sendall(line)
                conn.recv(1)  # until the host closes

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def reply(ok: bool, realtime_ns: int) -> bytes:
    return json.dumps({"ok": ok, "realtime_ns": realtime_ns}).encode() + b"\n"


def test_a_confirmation_gives_the_guests_offset(tmp_path: Path) -> None:
    path = tmp_path / "clock.sock"
    serve_once(path, lambda sent: [reply(True, sent + 250_000_000)])
    offset_s = set_guest_clock(path, timeout_s=2.0)
    assert offset_s is not None and 0.0 < offset_s <= 0.25


def test_a_reply_left_from_an_earlier_request_is_skipped(tmp_path: Path) -> None:
    """A reply the guest wrote after an earlier host gave up comes first (a saved template
    can hold one): it confirms an older setting and must not be taken for this one."""
    path = tmp_path / "clock.sock"
    stale_ns = 1_700_000_000 * 10**9  # the template's save, long ago
    serve_once(path, lambda sent: [reply(True, stale_ns), reply(True, sent + 1_000)])
    offset_s = set_guest_clock(path, timeout_s=2.0)
    assert offset_s is not None and abs(offset_s) < 0.5


def test_only_stale_or_refused_replies_confirm_nothing(tmp_path: Path) -> None:
    path = tmp_path / "clock.sock"
    serve_once(
        path,
        lambda sent: [reply(True, sent - 5 * 10**9), b"{not json\n", reply(False, sent + 1)],
    )
    assert set_guest_clock(path, timeout_s=0.5) is None


def test_no_guest_program_confirms_nothing(tmp_path: Path) -> None:
    assert set_guest_clock(tmp_path / "absent.sock", timeout_s=0.2) is None
