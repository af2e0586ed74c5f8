"""Guest control over the helper channel against a scripted hostile guest (no VM).

The guest may send garbage, huge replies, replies of the wrong shape or nothing at all: the
host checks every reply against the op's caps and shape, enforces its own deadlines, and
nothing of a bad reply is used.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_bridge.protocol.guest import (
    EXEC_OUTPUT_CAP_BYTES,
    A11yTree,
    ClipboardGet,
    Exec,
    GetFile,
    ListWindows,
    SetResolution,
    WindowActivate,
    WindowClose,
)
from orchestrator.display.guest_helper import MAX_LINE_BYTES, HelperChannel
from orchestrator.errors import ActionError, GuestHelperError
from orchestrator.guest_control import run_guest_action
from tests.test_guest_helper import FakeGuest, line

OPS = ["hello", "type", "wheel", "exec", "put_file", "get_file", "clipboard_get",
       "clipboard_set", "windows", "window_activate", "window_close", "a11y_tree",
       "set_resolution"]  # fmt: skip
HELLO = {"hello": "deskvm-helper", "protocol": 1, "ops": OPS, "spare_keycodes": 110}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def exec_reply(**over: Any) -> dict[str, Any]:
    reply = {"ok": True, "exit_code": 0, "stdout_b64": b64(b"out"), "stderr_b64": "",
             "stdout_truncated": False, "stderr_truncated": False, "timed_out": False}  # fmt: skip
    reply.update(over)
    return reply


class Scripted:
    """A guest that acknowledges every request and answers ``go`` with ``final(request)``
    (raw bytes, sent as they are: garbage, several lines, nothing)."""

    def __init__(self, final: Callable[[dict[str, Any]], bytes]) -> None:
        self.final = final
        self.waiting: dict[Any, dict[str, Any]] = {}

    def __call__(self, m: dict[str, Any]) -> list[bytes]:
        rid, op = m.get("id"), m.get("op")
        if op == "hello":
            return [line({**HELLO, "id": rid})]
        if op == "go":
            request = self.waiting.pop(rid)
            return [self.final({**request, "id": rid})]
        self.waiting[rid] = m
        return [line({"id": rid, "ready": True})]


@pytest.fixture
def helper_with(tmp_path: Path) -> Iterator[Callable[..., tuple[HelperChannel, FakeGuest]]]:
    made: list[tuple[HelperChannel, FakeGuest]] = []

    def make(final: Callable[[dict[str, Any]], bytes]) -> tuple[HelperChannel, FakeGuest]:
        path = tmp_path / f"helper{len(made)}.sock"
        guest = FakeGuest(path, Scripted(final))
        channel = HelperChannel(path, connect_timeout_s=2.0)
        channel.connect()
        assert channel.unavailable_reason(wait_s=2.0) is None
        made.append((channel, guest))
        return channel, guest

    yield make
    for channel, guest in made:
        channel.close()
        guest.close()


def reply_line(obj: dict[str, Any]) -> Callable[[dict[str, Any]], bytes]:
    return lambda request: line({**obj, "id": request["id"]})


def test_exec_reply_is_checked_and_hashed_on_the_host(helper_with) -> None:  # type: ignore[no-untyped-def]
    channel, guest = helper_with(reply_line(exec_reply(stdout_b64=b64("héllo\n".encode()))))
    result = run_guest_action(channel, Exec(argv=("echo", "héllo"), stdin="in", timeout_s=2.0))
    assert result.data["stdout"] == "héllo\n" and result.data["exit_code"] == 0
    assert result.data["cap_bytes"] == EXEC_OUTPUT_CAP_BYTES
    assert result.record["stdout_bytes"] == len("héllo\n".encode())
    assert "stdout" not in result.record and "héllo" not in json.dumps(result.record)
    sent = next(m for m in guest.received if m.get("op") == "exec")
    assert sent["argv"] == ["echo", "héllo"] and base64.b64decode(sent["stdin_b64"]) == b"in"


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (exec_reply(exit_code="0"), "'exit_code'"),
        (exec_reply(exit_code=True), "'exit_code'"),
        (exec_reply(exit_code=100000), "outside"),
        (exec_reply(stdout_b64="not base64!"), "not base64"),
        (exec_reply(stdout_b64=b64(b"x" * (EXEC_OUTPUT_CAP_BYTES + 1))), "over its cap"),
        (exec_reply(stderr_b64=None), "'stderr_b64'"),
        (exec_reply(stdout_truncated="no"), "'stdout_truncated'"),
    ],
)
def test_exec_replies_of_the_wrong_shape_are_refused(helper_with, reply, why) -> None:  # type: ignore[no-untyped-def]
    channel, _ = helper_with(reply_line(reply))
    with pytest.raises(GuestHelperError, match=why) as caught:
        run_guest_action(channel, Exec(argv=("true",), timeout_s=2.0))
    assert caught.value.code == "guest_reply_invalid"
    assert "nothing of it was used" in caught.value.message


def test_garbage_before_the_reply_is_dropped(helper_with) -> None:  # type: ignore[no-untyped-def]
    def final(request: dict[str, Any]) -> bytes:
        return (b"\xff\xfe garbage\n[1, 2]\n{\"id\": 999, \"ok\": true}\nnull\n"
                + line({**exec_reply(), "id": request["id"]}))  # fmt: skip

    channel, _ = helper_with(final)
    result = run_guest_action(channel, Exec(argv=("true",), timeout_s=2.0))
    assert result.data["stdout"] == "out"
    assert channel.dropped_lines >= 4


def test_a_deeply_nested_line_is_dropped_and_the_reader_lives_on(helper_with) -> None:  # type: ignore[no-untyped-def]
    # Under the line cap, but deeper than the JSON parser recurses: one such line must not
    # end the host's reader (every later reply would be lost until the deadline).
    deep = b"[" * 200_000 + b"]" * 200_000 + b"\n"

    def final(request: dict[str, Any]) -> bytes:
        return (
            deep
            + b'{"id": 1, '
            + b'"a": ' * 100_000
            + b"1"
            + b"}" * 100_001
            + b"\n"
            + (line({**exec_reply(), "id": request["id"]}))
        )

    channel, _ = helper_with(final)
    result = run_guest_action(channel, Exec(argv=("true",), timeout_s=2.0))
    assert result.data["stdout"] == "out"
    assert channel.dropped_lines >= 2
    assert run_guest_action(channel, Exec(argv=("true",), timeout_s=2.0)).data["exit_code"] == 0


def test_a_flooding_guest_cannot_hold_a_request_past_its_deadline(helper_with) -> None:  # type: ignore[no-untyped-def]
    # Acknowledged, then a stream of lines that answer nothing, for longer than the deadline.
    flood = (b"x\n" * 50_000 + b'{"id": 99999, "ok": true}\n' * 20_000) * 4
    channel, _ = helper_with(lambda request: flood)
    t0 = time.monotonic()
    with pytest.raises(GuestHelperError, match="did not finish"):
        channel.request("clipboard_get", {"max_chars": 10}, timeout_s=1.0)
    assert time.monotonic() - t0 < 3.0
    assert channel.dropped_lines >= 100_000


def test_a_line_over_the_cap_is_dropped_whole_and_the_request_times_out(helper_with) -> None:  # type: ignore[no-untyped-def]
    huge = b'{"id": 1, "ok": true, "stdout_b64": "' + b"A" * (MAX_LINE_BYTES + 10) + b'"}\n'
    channel, _ = helper_with(lambda request: huge)
    t0 = time.monotonic()
    with pytest.raises(GuestHelperError, match="did not finish"):
        channel.request("clipboard_get", {"max_chars": 10}, timeout_s=3.0)
    assert time.monotonic() - t0 < 6.0
    assert channel.dropped_lines >= 1
    assert channel.unavailable_reason() is None  # still in step: the next request works


def test_a_stalled_exec_is_cut_at_the_host_deadline(helper_with, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from orchestrator import guest_control

    monkeypatch.setattr(guest_control, "REPLY_MARGIN_S", 0.5)
    channel, _ = helper_with(lambda request: b"")  # acknowledged, then never answered
    t0 = time.monotonic()
    with pytest.raises(GuestHelperError, match=r"did not finish 'exec' within 0\.7 s"):
        run_guest_action(channel, Exec(argv=("sleep", "100"), timeout_s=0.2))
    assert time.monotonic() - t0 < 2.0


def test_window_requests_carry_the_window_not_the_request_id(helper_with) -> None:  # type: ignore[no-untyped-def]
    channel, guest = helper_with(reply_line({"ok": True}))
    run_guest_action(channel, WindowActivate(id=0x1400003))
    run_guest_action(channel, WindowClose(id=0x1400004))
    sent = [m for m in guest.received if m.get("op") in ("window_activate", "window_close")]
    assert [m["window_id"] for m in sent] == [0x1400003, 0x1400004]
    assert all(m["id"] != m["window_id"] for m in sent)


def test_get_file_over_the_cap_is_refused(helper_with, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from orchestrator import guest_control

    monkeypatch.setattr(guest_control, "GET_FILE_MAX_BYTES", 1000)
    channel, _ = helper_with(
        reply_line({"ok": True, "path": "/tmp/x", "data_b64": b64(b"x" * 1001)})
    )
    with pytest.raises(GuestHelperError, match="over its cap of 1000 bytes"):
        run_guest_action(channel, GetFile(path="/tmp/x"))


def test_get_file_hash_is_the_hosts_own(helper_with) -> None:  # type: ignore[no-untyped-def]
    channel, _ = helper_with(
        reply_line({"ok": True, "path": "/tmp/x", "data_b64": b64(b"abc"), "sha256": "lies"})
    )
    result = run_guest_action(channel, GetFile(path="/tmp/x"))
    assert result.data["sha256"] == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
    assert result.data["size_bytes"] == 3


def test_guest_refusal_codes_are_allowlisted(helper_with) -> None:  # type: ignore[no-untyped-def]
    channel, _ = helper_with(reply_line(
        {"ok": False, "error": "x" * 5000, "code": "path_not_allowed"}))  # fmt: skip
    with pytest.raises(GuestHelperError) as caught:
        run_guest_action(channel, GetFile(path="/tmp/x"))
    assert caught.value.code == "path_not_allowed"
    assert len(caught.value.message) < 600
    channel2, _ = helper_with(reply_line({"ok": False, "error": "no", "code": "internal_error"}))
    with pytest.raises(GuestHelperError) as caught:
        run_guest_action(channel2, GetFile(path="/tmp/x"))
    assert caught.value.code == "guest_refused"


@pytest.mark.parametrize(
    ("windows", "why"),
    [
        ("nope", "not a list"),
        ([{"id": 1}] * 600, "at most 512"),
        (
            [
                {
                    "id": 1,
                    "title": 5,
                    "class": "",
                    "x": 0,
                    "y": 0,
                    "width": 1,
                    "height": 1,
                    "focused": True,
                }
            ],
            "title",
        ),
        (
            [
                {
                    "id": -1,
                    "title": "",
                    "class": "",
                    "x": 0,
                    "y": 0,
                    "width": 1,
                    "height": 1,
                    "focused": True,
                }
            ],
            "'id'",
        ),
        (
            [
                {
                    "id": 1,
                    "title": "\ud800",
                    "class": "",
                    "x": 0,
                    "y": 0,
                    "width": 1,
                    "height": 1,
                    "focused": True,
                }
            ],
            "surrogate",
        ),
    ],
)
def test_window_lists_are_checked(helper_with, windows, why) -> None:  # type: ignore[no-untyped-def]
    channel, _ = helper_with(reply_line({"ok": True, "windows": windows}))
    with pytest.raises(GuestHelperError, match=why):
        run_guest_action(channel, ListWindows())


def _chain(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"role": "leaf", "name": "", "states": [], "children": []}
    for _ in range(depth):
        node = {"role": "panel", "name": "", "states": [], "children": [node]}
    return node


def test_a11y_trees_larger_or_deeper_than_asked_are_refused(helper_with) -> None:  # type: ignore[no-untyped-def]
    wide = {"role": "frame", "name": "", "states": [],
            "children": [{"role": "x", "name": "", "states": [], "children": []}] * 20}  # fmt: skip
    channel, _ = helper_with(reply_line({"ok": True, "tree": wide, "truncated": False}))
    with pytest.raises(GuestHelperError, match="more nodes than asked"):
        run_guest_action(channel, A11yTree(max_nodes=10))
    channel2, _ = helper_with(reply_line({"ok": True, "tree": _chain(100), "truncated": False}))
    with pytest.raises(GuestHelperError, match="deeper than"):
        run_guest_action(channel2, A11yTree(max_nodes=1000))
    channel3, _ = helper_with(reply_line({"ok": True, "tree": _chain(3), "truncated": True}))
    result = run_guest_action(channel3, A11yTree(max_nodes=1000))
    assert result.data["nodes"] == 4 and result.data["truncated"] is True
    assert result.data["tree"]["children"][0]["x"] is None


def test_clipboard_text_over_the_cap_is_refused(helper_with, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from orchestrator import guest_control

    monkeypatch.setattr(guest_control, "CLIPBOARD_MAX_CHARS", 5)
    channel, _ = helper_with(reply_line({"ok": True, "text": "123456"}))
    with pytest.raises(GuestHelperError, match="longer than 5"):
        run_guest_action(channel, ClipboardGet())


def test_a_resolution_reply_must_be_integers(helper_with) -> None:  # type: ignore[no-untyped-def]
    channel, _ = helper_with(reply_line({"ok": True, "width": "1024", "height": 768}))
    with pytest.raises(GuestHelperError, match="'width'"):
        run_guest_action(channel, SetResolution(1024, 768))


def test_an_old_helper_without_the_op_is_refused_before_sending(tmp_path: Path) -> None:
    from tests.test_guest_helper import HELLO as OLD_HELLO
    from tests.test_guest_helper import Guest

    path = tmp_path / "old.sock"
    guest = FakeGuest(path, Guest())
    channel = HelperChannel(path, connect_timeout_s=2.0)
    channel.connect()
    try:
        assert channel.unavailable_reason(wait_s=2.0) is None
        assert channel.hello_info["ops"] == OLD_HELLO["ops"]
        with pytest.raises(ActionError) as caught:
            run_guest_action(channel, Exec(argv=("true",)))
        assert caught.value.code == "guest_control_unavailable"
        assert not [m for m in guest.received if m.get("op") == "exec"]
    finally:
        channel.close()
        guest.close()
