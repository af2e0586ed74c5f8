"""An in-package fake display: a drawn desktop that keeps every input event it receives.

Use it (through :class:`orchestrator.hypervisor.fake.FakeHypervisor`) to test clients
and servers without a VM. It models a US keyboard typing into a shell: printable keys
accumulate on a line and Return hands the line to ``on_line`` (the fake guest echoes it
to its guest log).
"""

from __future__ import annotations

import base64
import posixpath
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from PIL import Image, ImageDraw

from orchestrator.display.base import AbsMove, ButtonEvent, InputEvent, KeyEvent, WheelEvent
from orchestrator.errors import DisplayError, GuestHelperError

__all__ = ["FakeDisplay", "FakeGuestHelper"]

_GUEST_OPS = (
    "exec", "put_file", "get_file", "clipboard_get", "clipboard_set", "windows",
    "window_activate", "window_close", "a11y_tree", "set_resolution",
)  # fmt: skip

_PLAIN = {
    "spc": " ", "minus": "-", "equal": "=", "bracket_left": "[", "bracket_right": "]",
    "backslash": "\\", "semicolon": ";", "apostrophe": "'", "grave_accent": "`",
    "comma": ",", "dot": ".", "slash": "/", "tab": "\t",
}  # fmt: skip
_SHIFTED = {
    "1": "!", "2": "@", "3": "#", "4": "$", "5": "%", "6": "^", "7": "&", "8": "*",
    "9": "(", "0": ")", "minus": "_", "equal": "+", "bracket_left": "{",
    "bracket_right": "}", "backslash": "|", "semicolon": ":", "apostrophe": '"',
    "grave_accent": "~", "comma": "<", "dot": ">", "slash": "?", "spc": " ", "tab": "\t",
}  # fmt: skip


class FakeDisplay:
    """:class:`~orchestrator.display.base.DisplayBackend` that draws a fake desktop.

    Args:
        width_px, height_px: screen size.
        background_rgb: root window colour (matches the image's readiness check).
        on_line: called with each line "typed" (on Return).
        horizontal_wheel: whether it takes horizontal wheel events (a QEMU 8.1+ host);
            when not, the session scrolls sideways through the guest helper.
        boot_screens: how many screendumps show a boot console first (a text screen of
            ``boot_size_px``, as a real guest shows before X starts).
        boot_size_px: the boot console's size.
        key_flow_control: what :meth:`key_flow_control` answers (a virtio keyboard whose
            queue the host can read).
    """

    def __init__(
        self,
        width_px: int,
        height_px: int,
        *,
        background_rgb: tuple[int, int, int] = (0x2E, 0x4A, 0x62),
        on_line: Callable[[str], None] | None = None,
        horizontal_wheel: bool = True,
        boot_screens: int = 0,
        boot_size_px: tuple[int, int] = (720, 400),
        key_flow_control: bool = False,
    ) -> None:
        self.boot_screens = boot_screens
        self.boot_size_px = boot_size_px
        self.has_horizontal_wheel = horizontal_wheel
        self.has_key_flow_control = key_flow_control
        self.closed = False
        self.width_px = width_px
        self.height_px = height_px
        self.background_rgb = background_rgb
        self.events: list[InputEvent] = []
        self.batches: int = 0
        self.pointer: tuple[int, int] = (0, 0)
        self.pressed_keys: set[str] = set()
        self.pressed_buttons: set[str] = set()
        self.fail_next_screendump: Exception | None = None
        self._line = ""
        self.clipboard = ""
        """The CLIPBOARD selection (``ctrl+v`` types it on the line)."""
        self._on_line = on_line
        self._lock = threading.Lock()

    def screendump(self) -> Image.Image:
        with self._lock:
            if self.fail_next_screendump is not None:
                exc, self.fail_next_screendump = self.fail_next_screendump, None
                raise exc
            if self.boot_screens > 0:
                self.boot_screens -= 1
                console = Image.new("RGB", self.boot_size_px, (0, 0, 0))
                text = f"[    {self.boot_screens:2d}.000000] booting"
                ImageDraw.Draw(console).text((4, 4), text, fill=(170, 170, 170))
                return console
            image = Image.new("RGB", (self.width_px, self.height_px), self.background_rgb)
            draw = ImageDraw.Draw(image)
            w, h = self.width_px, self.height_px
            draw.rectangle((w // 8, h // 8, w // 2, h // 2), fill=(250, 250, 250))
            draw.text((w // 8 + 4, h // 8 + 4), "desk@deskvm:~$ " + self._line, fill=(0, 0, 0))
            x, y = self.pointer
            draw.rectangle((x, y, min(w - 1, x + 3), min(h - 1, y + 3)), fill=(255, 0, 0))
            return image

    def horizontal_wheel(self) -> bool:
        return self.has_horizontal_wheel

    def resize(self, width_px: int, height_px: int) -> None:
        """The guest changed its screen size (what ``xrandr`` does)."""
        with self._lock:
            self.width_px, self.height_px = width_px, height_px
            x, y = self.pointer
            self.pointer = (min(x, width_px - 1), min(y, height_px - 1))

    def close(self) -> None:
        """Nothing to release; :attr:`closed` says it was called."""
        self.closed = True

    def key_flow_control(self) -> bool:
        return self.has_key_flow_control

    def type_text(self, text: str) -> None:
        """Text as the guest helper types it (XTEST): any character, ``\n`` is Return."""
        with self._lock:
            for char in text:
                if char == "\n":
                    line, self._line = self._line, ""
                    if self._on_line is not None:
                        self._on_line(line)
                else:
                    self._line += char

    def send(self, events: Sequence[InputEvent], *, width_px: int, height_px: int) -> None:
        with self._lock:
            self.batches += 1
            for event in events:
                self.events.append(event)
                self._apply(event)

    def _apply(self, event: InputEvent) -> None:
        match event:
            case AbsMove(x=x, y=y):
                self.pointer = (x, y)
            case ButtonEvent(button=b, down=down):
                (self.pressed_buttons.add if down else self.pressed_buttons.discard)(b)
            case WheelEvent(direction=direction):
                if direction in ("left", "right") and not self.has_horizontal_wheel:
                    raise DisplayError("input-send-event refused: no horizontal wheel")
            case KeyEvent(qcode=q, down=True):
                self.pressed_keys.add(q)
                self._type(q)
            case KeyEvent(qcode=q, down=False):
                self.pressed_keys.discard(q)

    def _type(self, qcode: str) -> None:
        shift = bool(self.pressed_keys & {"shift", "shift_r"})
        if qcode == "v" and self.pressed_keys & {"ctrl", "ctrl_r"} and not shift:
            self._line += self.clipboard  # ctrl+v pastes the CLIPBOARD selection
            return
        if self.pressed_keys & {"ctrl", "ctrl_r", "alt", "alt_r", "meta_l", "meta_r"}:
            return
        if qcode in ("ret", "kp_enter"):
            line, self._line = self._line, ""
            if self._on_line is not None:
                self._on_line(line)
            return
        if qcode == "backspace":
            self._line = self._line[:-1]
            return
        if len(qcode) == 1:
            self._line += (
                qcode.upper()
                if shift and qcode.isalpha()
                else (_SHIFTED.get(qcode, qcode) if shift else qcode)
            )
            return
        table = _SHIFTED if shift else _PLAIN
        if qcode in table:
            self._line += table[qcode]

    def typed_text(self) -> str:
        """The current (unfinished) line."""
        with self._lock:
            return self._line


_FAKE_HOME = "/home/desk"
_FAKE_XTERM_ID = 0x1400001


class FakeGuestHelper:
    """:class:`~orchestrator.display.guest_helper.GuestHelper` acting on a :class:`FakeDisplay`.

    ``type`` requests type into the fake shell line (any character); ``wheel`` requests are
    kept in :attr:`wheels`. Every request is kept in :attr:`requests`.

    The guest control ops answer as the real helper does on the wire (base64 outputs,
    refusals with a ``code``), deterministically and in memory, so the host's reply checks
    run on them too:

    * files: :attr:`files` (path -> bytes) under ``/home/desk`` and ``/tmp`` only;
    * ``exec``: :attr:`exec_results` (argv tuple -> ``(exit_code, stdout, stderr)``) first,
      else a tiny whitelist: ``true``, ``false``, ``echo ARGS``, ``cat [PATH...]`` (stdin
      without paths), ``ls DIR``, ``pwd``, ``printenv NAME``, ``sleep S`` (past
      ``timeout_s``: killed, exit ``-9``, ``timed_out``); anything else exits 127;
    * clipboard: :attr:`FakeDisplay.clipboard` (``ctrl+v`` on the fake display types it);
    * windows: :attr:`windows` (one xterm at first); activate focuses, close removes;
    * ``a11y_tree``: a small canned tree of the windows;
    * ``set_resolution``: resizes the display (any size ``check_display_size`` allows).

    Key acknowledgements (:meth:`key_events`): ``None`` unless :attr:`key_acks` is set.
    Then the count is :attr:`keys_processed`, which moves only when the host waits
    (:meth:`wait_key_events`): the fake X server then takes the keys the display has
    received, up to what the host waits for, unless :attr:`keys_stalled` is set.

    Args:
        display: the display it acts on.
        available: ``False`` models a guest whose helper never announced itself.
    """

    def __init__(self, display: FakeDisplay, *, available: bool = True) -> None:
        self.display = display
        self.available = available
        self.key_acks = False
        self.keys_processed = 0
        self.keys_stalled = False
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.wheels: list[tuple[str, int, int, int, int]] = []
        self.fail_next: str | None = None
        self.spare_keycodes = 110
        self.files: dict[str, bytes] = {f"{_FAKE_HOME}/.bashrc": b"# fake\n"}
        self.exec_results: dict[tuple[str, ...], tuple[int, bytes, bytes]] = {}
        self.windows: list[dict[str, Any]] = [
            {"id": _FAKE_XTERM_ID, "title": "desk@deskvm", "class": "xterm.XTerm",
             "x": 40, "y": 40, "width": display.width_px * 6 // 10,
             "height": display.height_px * 6 // 10, "focused": True}
        ]  # fmt: skip
        self.ops = ["hello", "type", "wheel", *_GUEST_OPS]

    @property
    def hello_info(self) -> dict[str, Any]:
        if not self.available:
            return {}
        return {"hello": "deskvm-helper", "protocol": 1, "ops": list(self.ops),
                "spare_keycodes": self.spare_keycodes}  # fmt: skip

    def unavailable_reason(self, wait_s: float = 0.0) -> str | None:
        return None if self.available else "the guest helper has not announced itself"

    def key_events(self) -> int | None:
        return self.keys_processed if self.key_acks and self.available else None

    def wait_key_events(self, at_least: int, timeout_s: float) -> int | None:
        if self.key_acks and not self.keys_stalled:
            received = sum(isinstance(e, KeyEvent) for e in self.display.events)
            self.keys_processed = max(self.keys_processed, min(at_least, received))
        elif self.key_acks:
            time.sleep(min(timeout_s, 0.01))  # a count that stands still: no busy loop
        return self.key_events()

    def request(self, op: str, args: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
        if not self.available:
            raise GuestHelperError("the guest helper has not announced itself")
        if "id" in args or "op" in args:
            # As on the real channel, where they would be overwritten by the request's own.
            raise GuestHelperError(f"request arguments of {op!r} must not be named id or op")
        self.requests.append((op, dict(args)))
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise GuestHelperError(f"the guest helper could not {op}: {error}")
        if op == "type":
            self.display.type_text(str(args["text"]))
            return {"ok": True, "count": len(str(args["text"]))}
        if op == "wheel":
            self.wheels.append(
                (str(args["direction"]), int(args["count"]), int(args["x"]), int(args["y"]),
                 int(args.get("mods", 0)))
            )  # fmt: skip
            return {"ok": True, "count": int(args["count"])}
        if op in _GUEST_OPS and op in self.ops:
            reply = getattr(self, "_" + op)(args)
            if reply.get("ok") is False:
                code = reply.get("code")
                raise GuestHelperError(
                    f"the guest refused {op}: {reply['error']}",
                    code="path_not_allowed" if code == "path_not_allowed" else "guest_refused",
                )
            return {"ok": True, **reply}
        raise GuestHelperError(f"the guest helper could not {op}: unknown op {op!r}")

    # --- guest control ops (wire replies, see orchestrator.guest_control) -------------------

    @staticmethod
    def _path(path: str) -> str | None:
        norm = posixpath.normpath(path)
        if norm == _FAKE_HOME or norm.startswith(_FAKE_HOME + "/") or norm.startswith("/tmp/"):
            return norm
        return None

    def _refuse(self, error: str, code: str = "refused") -> dict[str, Any]:
        return {"ok": False, "error": error, "code": code}

    def _exec(self, args: Mapping[str, Any]) -> dict[str, Any]:
        argv = tuple(str(a) for a in args["argv"])
        stdin = base64.b64decode(args["stdin_b64"]) if args.get("stdin_b64") else b""
        env = dict(args.get("env") or {})
        timed_out = False
        if argv in self.exec_results:
            code, out, err = self.exec_results[argv]
        else:
            code, out, err = 127, b"", f"{argv[0]}: command not found (fake guest)\n".encode()
            name, rest = argv[0], argv[1:]
            if name == "true":
                code, err = 0, b""
            elif name == "false":
                code, err = 1, b""
            elif name == "echo":
                code, out, err = 0, (" ".join(rest) + "\n").encode(), b""
            elif name == "pwd":
                code, out, err = 0, (_FAKE_HOME + "\n").encode(), b""
            elif name == "printenv" and rest:
                value = env.get(rest[0])
                code, err = (1, b"") if value is None else (0, b"")
                out = b"" if value is None else (value + "\n").encode()
            elif name == "sleep" and rest:
                if float(rest[0]) > float(args["timeout_s"]):
                    code, err, timed_out = -9, b"", True
                else:
                    code, err = 0, b""
            elif name == "cat":
                code, out, err = 0, b"" if rest else stdin, b""
                for path in rest:
                    if path in self.files:
                        out += self.files[path]
                    else:
                        code, err = 1, f"cat: {path}: No such file or directory\n".encode()
            elif name == "ls" and rest:
                prefix = rest[0].rstrip("/") + "/"
                names = sorted({p[len(prefix):].split("/")[0] for p in self.files
                                if p.startswith(prefix)})  # fmt: skip
                code, out, err = 0, "".join(n + "\n" for n in names).encode(), b""
        cap = int(args["cap_bytes"])
        return {"exit_code": code, "stdout_b64": base64.b64encode(out[:cap]).decode(),
                "stderr_b64": base64.b64encode(err[:cap]).decode(),
                "stdout_truncated": len(out) > cap, "stderr_truncated": len(err) > cap,
                "timed_out": timed_out}  # fmt: skip

    def _put_file(self, args: Mapping[str, Any]) -> dict[str, Any]:
        path = self._path(str(args["path"]))
        if path is None:
            return self._refuse(f"{args['path']} is outside {_FAKE_HOME} and /tmp",
                                "path_not_allowed")  # fmt: skip
        self.files[path] = base64.b64decode(args["data_b64"])
        return {"path": path}

    def _get_file(self, args: Mapping[str, Any]) -> dict[str, Any]:
        path = self._path(str(args["path"]))
        if path is None:
            return self._refuse(f"{args['path']} is outside {_FAKE_HOME} and /tmp",
                                "path_not_allowed")  # fmt: skip
        if path not in self.files:
            return self._refuse(f"{path}: no such file", "not_found")
        data = self.files[path]
        if len(data) > int(args["max_bytes"]):
            return self._refuse(f"{path} is larger than {args['max_bytes']} bytes", "too_large")
        return {"path": path, "data_b64": base64.b64encode(data).decode()}

    def _clipboard_get(self, args: Mapping[str, Any]) -> dict[str, Any]:
        return {"text": self.display.clipboard[: int(args["max_chars"])]}

    def _clipboard_set(self, args: Mapping[str, Any]) -> dict[str, Any]:
        self.display.clipboard = str(args["text"])
        return {}

    def _windows(self, args: Mapping[str, Any]) -> dict[str, Any]:
        return {"windows": [dict(w) for w in self.windows]}

    def _window(self, wid: Any) -> dict[str, Any] | None:
        return next((w for w in self.windows if w["id"] == wid), None)

    def _window_activate(self, args: Mapping[str, Any]) -> dict[str, Any]:
        window = self._window(args["window_id"])
        if window is None:
            return self._refuse(f"no window {args['window_id']:#x}", "window_not_found")
        for w in self.windows:
            w["focused"] = w is window
        return {}

    def _window_close(self, args: Mapping[str, Any]) -> dict[str, Any]:
        window = self._window(args["window_id"])
        if window is None:
            return self._refuse(f"no window {args['window_id']:#x}", "window_not_found")
        self.windows.remove(window)
        return {}

    def _a11y_tree(self, args: Mapping[str, Any]) -> dict[str, Any]:
        wid = args.get("window_id")
        shown = [w for w in self.windows if wid is None or w["id"] == wid]
        if wid is not None and not shown:
            return self._refuse(f"no window {wid:#x}", "window_not_found")
        apps = [{"role": "frame", "name": w["title"],
                 "states": ["active", "showing", "visible"] if w["focused"] else
                 ["showing", "visible"], "x": w["x"], "y": w["y"], "width": w["width"],
                 "height": w["height"], "children": [
                     {"role": "terminal", "name": "", "states": ["focusable"], "x": w["x"],
                      "y": w["y"], "width": w["width"], "height": w["height"],
                      "children": []}]} for w in shown]  # fmt: skip
        budget = int(args["max_nodes"]) - 1
        truncated = False
        kept = []
        for app in apps:
            if budget < 2:
                truncated = True
                break
            kept.append(app)
            budget -= 2
        tree = {"role": "desktop frame", "name": "main", "states": [], "x": 0, "y": 0,
                "width": self.display.width_px, "height": self.display.height_px,
                "children": kept}  # fmt: skip
        return {"tree": tree, "truncated": truncated}

    def _set_resolution(self, args: Mapping[str, Any]) -> dict[str, Any]:
        w, h = int(args["width"]), int(args["height"])
        self.display.resize(w, h)
        return {"width": w, "height": h}

    def close(self) -> None:
        self.available = False
