"""Host-side display of a libvirt domain: ``virDomainScreenshot`` and QMP input.

Frames come from libvirt's screenshot API (which runs QMP ``screendump`` inside QEMU and
streams the file back); input goes in as QMP ``input-send-event`` through
``libvirt_qemu.qemuMonitorCommand`` (QEMU QMP reference, ``InputEvent``). Both work before
any login and on any guest OS, and the guest cannot forge what they show.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Sequence
from typing import Any

import libvirt
import libvirt_qemu
from PIL import Image

from orchestrator.display.base import (
    AbsMove,
    ButtonEvent,
    InputEvent,
    KeyEvent,
    WheelEvent,
    pixel_to_abs,
)
from orchestrator.errors import DisplayError

__all__ = ["HORIZONTAL_WHEEL_SINCE", "QmpDisplay", "qmp_event"]

HORIZONTAL_WHEEL_SINCE = (8, 1)
"""First QEMU (major, minor) whose virtio tablet delivers horizontal wheel events."""


def qmp_event(event: InputEvent, *, width_px: int, height_px: int) -> list[dict[str, Any]]:
    """The QMP ``InputEvent`` objects for one of our events.

    Args:
        event: the event.
        width_px, height_px: screen size that ``AbsMove`` pixels refer to.

    Returns:
        One or two QMP event objects (a wheel notch is a press and a release).
    """
    match event:
        case AbsMove(x=x, y=y):
            return [
                {"type": "abs", "data": {"axis": "x", "value": pixel_to_abs(x, width_px)}},
                {"type": "abs", "data": {"axis": "y", "value": pixel_to_abs(y, height_px)}},
            ]
        case ButtonEvent(button=button, down=down):
            return [{"type": "btn", "data": {"down": down, "button": button}}]
        case WheelEvent(direction=direction):
            name = f"wheel-{direction}"
            return [
                {"type": "btn", "data": {"down": True, "button": name}},
                {"type": "btn", "data": {"down": False, "button": name}},
            ]
        case KeyEvent(qcode=qcode, down=down):
            return [
                {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": qcode}}}
            ]


class QmpDisplay:
    """:class:`~orchestrator.display.base.DisplayBackend` for one libvirt domain."""

    def __init__(self, conn: libvirt.virConnect, dom: libvirt.virDomain) -> None:
        self._conn = conn
        self._dom = dom
        self._lock = threading.Lock()
        self._hwheel: bool | None = None

    def screendump(self) -> Image.Image:
        chunks: list[bytes] = []
        with self._lock:
            try:
                stream = self._conn.newStream(0)
                try:
                    self._dom.screenshot(stream, 0, 0)
                    stream.recvAll(lambda _st, data, buf: buf.append(data), chunks)
                    stream.finish()
                except BaseException:
                    stream.abort()
                    raise
            except libvirt.libvirtError as exc:
                raise DisplayError(f"screendump failed: {exc.get_error_message()}") from exc
        try:
            image = Image.open(io.BytesIO(b"".join(chunks)))
            return image.convert("RGB")
        except OSError as exc:
            raise DisplayError(f"screendump returned an unreadable image: {exc}") from exc

    def horizontal_wheel(self) -> bool:
        """Whether this QEMU delivers ``wheel-left``/``wheel-right`` to the guest (asked once).

        The ``InputButton`` enum has had them since QEMU 7.1 (for QEMU's own UIs), but the
        virtio tablet passes them on only from QEMU 8.1 (REL_HWHEEL): on this project's
        QEMU 7.2 ``input-send-event`` accepts them and the guest sees nothing (measured with
        the input probe). So the answer is the QEMU version, not the schema.
        """
        if self._hwheel is None:
            version = self._command("query-version").get("qemu", {})
            major, minor = int(version.get("major", 0)), int(version.get("minor", 0))
            self._hwheel = (major, minor) >= HORIZONTAL_WHEEL_SINCE
        return self._hwheel

    def _command(self, execute: str) -> Any:
        command = json.dumps({"execute": execute})
        with self._lock:
            try:
                reply = libvirt_qemu.qemuMonitorCommand(self._dom, command, 0)
            except libvirt.libvirtError as exc:
                raise DisplayError(f"{execute} failed: {exc.get_error_message()}") from exc
        try:
            return json.loads(reply)["return"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DisplayError(f"{execute} gave an unexpected reply: {reply[:200]}") from exc

    def send(self, events: Sequence[InputEvent], *, width_px: int, height_px: int) -> None:
        qmp: list[dict[str, Any]] = []
        for event in events:
            qmp.extend(qmp_event(event, width_px=width_px, height_px=height_px))
        if not qmp:
            return
        command = json.dumps({"execute": "input-send-event", "arguments": {"events": qmp}})
        with self._lock:
            try:
                reply = libvirt_qemu.qemuMonitorCommand(self._dom, command, 0)
            except libvirt.libvirtError as exc:
                raise DisplayError(f"input-send-event failed: {exc.get_error_message()}") from exc
        if '"error"' in reply:
            raise DisplayError(f"input-send-event refused: {reply}")
