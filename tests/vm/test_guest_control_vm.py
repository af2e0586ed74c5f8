"""The guest control plane on a real VM (the default image's helper over virtio-serial):
exec, files, clipboard pasted into an app, windows, the accessibility tree, and a
resolution change with a click at the new bottom-right corner.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from agent_bridge.client import RemoteError, Session

GTK_PROBE = """\
import gi
gi.require_version("Gtk", "3.0")
from gi.repository import Gtk

window = Gtk.Window(title="deskvm-gtk-probe")
window.set_default_size(420, 160)
box = Gtk.Box(orientation=Gtk.Orientation.VERTICAL, spacing=8)
entry = Gtk.Entry()
entry.connect("changed", lambda e: open("/tmp/entry.txt", "w").write(e.get_text()))
box.pack_start(entry, False, False, 0)
box.pack_start(Gtk.Button(label="Press me"), False, False, 0)
window.add(box)
window.connect("destroy", Gtk.main_quit)
window.show_all()
Gtk.main()
"""


def until(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def find(tree: dict[str, Any], role: str, name: str | None = None) -> dict[str, Any] | None:
    if tree["role"] == role and (name is None or tree["name"] == name):
        return tree
    for child in tree["children"]:
        hit = find(child, role, name)
        if hit is not None:
            return hit
    return None


@pytest.mark.deskvm(guest_control=True)
def test_exec_files_and_resolution(deskvm_session: Session) -> None:
    s = deskvm_session
    # exec: argv (no shell), stdin, environment, exit codes, timeout, caps.
    r = s.exec(["sh", "-c", 'echo "$GREETING $(id -un)"; cat; echo err >&2; exit 3'],
               stdin="from stdin\n", env={"GREETING": "hello"})  # fmt: skip
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hello desk\nfrom stdin\n", "err\n")
    assert s.exec(["pwd"]).stdout == "/home/desk\n"
    assert s.exec(["no-such-program"]).exit_code == 127
    t0 = time.monotonic()
    slow = s.exec(["sleep", "30"], timeout_s=2)
    assert slow.timed_out and slow.exit_code == -9 and time.monotonic() - t0 < 15
    big = s.exec(["head", "-c", "3000000", "/dev/zero"])
    assert big.stdout_truncated and len(big.stdout) == big.cap_bytes == 1 << 20

    # Files: binary round trip with the host's hash, both confinements.
    data = os.urandom(600_000)
    put = s.put_file("/home/desk/blob.bin", data)
    assert put["sha256"] == hashlib.sha256(data).hexdigest() and put["size_bytes"] == len(data)
    assert s.exec(["sha256sum", "/home/desk/blob.bin"]).stdout.split()[0] == put["sha256"]
    assert s.get_file("/home/desk/blob.bin") == data
    s.exec(["head", "-c", "5000000", "/dev/urandom", "-"], timeout_s=60)
    s.exec(["sh", "-c", "head -c 5000000 /dev/urandom > /tmp/five.bin"], timeout_s=60)
    five = s.get_file("/tmp/five.bin")
    assert (
        hashlib.sha256(five).hexdigest() == s.exec(["sha256sum", "/tmp/five.bin"]).stdout.split()[0]
    )
    with pytest.raises(RemoteError) as info:
        s.get_file("/etc/shadow")
    assert info.value.code == "path_not_allowed"  # the host's lexical check
    s.exec(["ln", "-sf", "/etc/passwd", "/tmp/escape"])
    with pytest.raises(RemoteError) as info:
        s.get_file("/tmp/escape")
    assert info.value.code == "path_not_allowed" and "resolves to '/etc/passwd'" in str(info.value)
    with pytest.raises(RemoteError) as info:
        s.get_file("/tmp/nothing-here")
    assert info.value.code == "guest_refused"

    # Resolution: a size the display cannot take is refused with the sizes it can.
    with pytest.raises(RemoteError) as info:
        s.set_resolution(1366, 768)
    assert info.value.code == "unsupported_resolution" and "1360x768, 1368x768" in str(info.value)
    assert s.set_resolution(1024, 768) == (1024, 768)
    shot = s.screenshot()
    assert (shot.width, shot.height) == (1024, 768)
    assert s.info()["display"] == {"width": 1024, "height": 768}
    s.click(1023, 767)
    where = s.exec(["xdotool", "getmouselocation", "--shell"]).stdout
    assert "X=1023\n" in where and "Y=767\n" in where, where
    with pytest.raises(RemoteError) as info:
        s.click(1100, 700)
    assert info.value.code == "out_of_screen"
    assert s.set_resolution(1280, 800) == (1280, 800)
    s.click(1279, 799)
    where = s.exec(["xdotool", "getmouselocation", "--shell"]).stdout
    assert "X=1279\n" in where and "Y=799\n" in where, where


@pytest.mark.deskvm(guest_control=True)
def test_clipboard_paste_windows_and_a11y(deskvm_session: Session) -> None:
    s = deskvm_session
    s.put_file("/tmp/probe.py", GTK_PROBE.encode())
    s.exec(["setsid", "-f", "python3", "/tmp/probe.py"])

    def probe() -> dict[str, Any] | None:
        return next((w for w in s.windows() if w["title"] == "deskvm-gtk-probe"), None)

    window = until("the GTK window", probe, 120)
    classes = {w["class"] for w in s.windows()}
    assert "xterm.XTerm" in classes, classes
    s.window_activate(window["id"])
    assert until("focus", lambda: (probe() or {}).get("focused"))

    # The accessibility tree of that window: the entry and the button, in screen pixels.
    result = until("an accessible window", lambda: s.a11y_tree(window_id=window["id"]), 60)
    tree = result["tree"]
    button = until("the button", lambda: find(s.a11y_tree(window_id=window["id"])["tree"],
                                                 "push button", "Press me"), 60)  # fmt: skip
    assert button["width"] > 0 and window["x"] <= button["x"] <= window["x"] + window["width"]
    assert tree["role"] == "frame" and tree["name"] == "deskvm-gtk-probe", tree
    whole = s.a11y_tree(max_nodes=5)
    assert whole["truncated"] and whole["nodes"] == 5

    # Clipboard: set, read back, paste with ctrl+v into the entry: exactly the new text.
    s.clipboard_set("first")
    text = "Pasted ✓ 42 — new"
    s.clipboard_set(text)
    assert s.clipboard_get() == text
    entry = find(tree, "text")
    assert entry is not None, tree
    s.click(entry["x"] + entry["width"] // 2, entry["y"] + entry["height"] // 2)
    s.key("ctrl+v")
    assert until("the pasted text", lambda: s.exec(["cat", "/tmp/entry.txt"]).stdout == text,
                 20)  # fmt: skip

    # Close it: it leaves the window list.
    s.window_close(window["id"])
    until("the window to go", lambda: probe() is None, 20)
    with pytest.raises(RemoteError) as info:
        s.window_activate(window["id"])
    assert info.value.code == "guest_refused"
