"""The guest helper: its host channel against a scripted (and hostile) guest, and the
session's use of it for non-US text and the horizontal wheel (fakes, no VM).

The real helper in a real guest is exercised by ``tests/vm/test_input_fidelity_vm.py``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_bridge.protocol import parse_deskvm_action
from agent_bridge.protocol.actions import Scroll, Type
from agent_bridge.protocol.keys import parse_combo
from orchestrator.clock import FakeClock
from orchestrator.display import guest_helper
from orchestrator.display.base import KeyEvent, WheelEvent
from orchestrator.display.guest_helper import MAX_LINE_BYTES, HelperChannel
from orchestrator.errors import ActionError, GuestHelperError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import HelperStep, Pacing, Step, plan_action
from orchestrator.recorder import MemoryRecorder
from orchestrator.session import Session
from orchestrator.spec import BootImage, DisplaySpec, SessionSpec

HELLO = {"hello": "deskvm-helper", "protocol": 1, "ops": ["hello", "type", "wheel"],
         "spare_keycodes": 110}  # fmt: skip
PACING = Pacing(0, 0, 0, 0, 0)


# --- the channel ------------------------------------------------------------------------


class FakeGuest:
    """QEMU's listening end of the channel, with a scripted guest behind it.

    ``answer(message)`` returns the lines the guest sends back for each message it reads
    (requests, ``go`` confirmations and ``hello`` asks alike).
    """

    def __init__(
        self,
        path: Path,
        answer: Callable[[dict[str, Any]], list[bytes]],
        *,
        greet: bool = False,
        read: bool = True,
    ) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.answer = answer
        self.greet = greet
        self.read = read
        self.received: list[dict[str, Any]] = []
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.conn, _ = self.server.accept()
            if self.greet:
                self.conn.sendall(line(HELLO))
        except OSError:
            return
        if not self.read:
            return
        buf = b""
        while True:
            try:
                chunk = self.conn.recv(65536)
            except OSError:  # closed by the test
                return
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                raw, buf = buf.split(b"\n", 1)
                message = json.loads(raw)
                self.received.append(message)
                try:
                    for out in self.answer(message):
                        self.conn.sendall(out)
                except OSError:  # the host hung up mid-answer (a flood it stopped reading)
                    return

    def send(self, data: bytes) -> None:
        assert self.conn is not None
        self.conn.sendall(data)

    def hang_up(self) -> None:
        assert self.conn is not None
        self.conn.close()

    def close(self) -> None:
        self.server.close()
        if self.conn is not None:
            self.conn.close()


def line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


class Guest:
    """A well-behaved helper: hello, ``ready`` for each request, the result on ``go``.

    ``refuse``: requests answered ``ok: false`` instead of ``ready``; ``fail``: ``go``
    answered ``ok: false``; ``silent``: requests never answered; ``stall``: ``go`` never
    answered.
    """

    def __init__(self, *, refuse: str = "", fail: str = "", silent: str = "", stall: str = ""):
        self.refuse, self.fail, self.silent, self.stall = refuse, fail, silent, stall
        self.waiting: dict[int, dict[str, Any]] = {}
        self.executed: list[dict[str, Any]] = []

    def __call__(self, m: dict[str, Any]) -> list[bytes]:
        rid, op = m.get("id"), m.get("op")
        if op == "hello":
            return [line({**HELLO, "id": rid})]
        if op == "go":
            request = self.waiting.pop(rid)
            if request.get("text") == self.stall:
                return []
            self.executed.append(request)
            if request.get("text") == self.fail:
                return [line({"id": rid, "ok": False, "error": "pointer is elsewhere"})]
            return [line({"id": rid, "ok": True, "count": len(request.get("text", "x"))})]
        if m.get("text") == self.silent:
            return []
        if m.get("text") == self.refuse:
            return [line({"id": rid, "ok": False, "error": "too many characters"})]
        self.waiting[rid] = m
        return [line({"id": rid, "ready": True})]


@pytest.fixture
def channel_to(tmp_path: Path) -> Iterator[Callable[..., tuple[HelperChannel, FakeGuest]]]:
    made: list[tuple[HelperChannel, FakeGuest]] = []

    def make(
        answer: Callable[[dict[str, Any]], list[bytes]], **kwargs: Any
    ) -> tuple[HelperChannel, FakeGuest]:
        path = tmp_path / f"helper{len(made)}.sock"
        guest = FakeGuest(path, answer, **kwargs)
        channel = HelperChannel(path, connect_timeout_s=2.0)
        channel.connect()
        made.append((channel, guest))
        return channel, guest

    yield make
    for channel, guest in made:
        channel.close()
        guest.close()


def test_hello_then_ready_go_and_reply(channel_to) -> None:  # type: ignore[no-untyped-def]
    guest_script = Guest()
    channel, guest = channel_to(guest_script)
    assert channel.unavailable_reason(wait_s=2.0) is None
    assert channel.hello_info["spare_keycodes"] == 110
    reply = channel.request("type", {"text": "Ñandú 美国"}, timeout_s=2.0)
    assert reply == {"id": 1, "ok": True, "count": 8}
    assert guest.received[-2:] == [
        {"text": "Ñandú 美国", "id": 1, "op": "type"},
        {"id": 1, "op": "go"},
    ]
    assert guest_script.executed == [{"text": "Ñandú 美国", "id": 1, "op": "type"}]


def test_refusal_before_ready_says_nothing_was_injected(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, guest = channel_to(Guest(refuse="美" * 3))
    assert channel.unavailable_reason(wait_s=2.0) is None
    with pytest.raises(GuestHelperError, match=r"too many characters \(nothing was injected\)"):
        channel.request("type", {"text": "美" * 3}, timeout_s=2.0)
    assert {"id": 1, "op": "go"} not in guest.received
    assert channel.unavailable_reason() is None  # a refusal is an answer: still there


def test_failure_after_go_is_a_guest_helper_error(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, _ = channel_to(Guest(fail="x"))
    assert channel.unavailable_reason(wait_s=2.0) is None
    with pytest.raises(GuestHelperError, match=r"could not wheel: pointer is elsewhere$"):
        channel.request("wheel", {"text": "x", "direction": "left", "count": 1}, timeout_s=2.0)


def test_unacknowledged_request_is_never_confirmed_and_marks_the_helper_gone(channel_to) -> None:  # type: ignore[no-untyped-def]
    script = Guest(silent="drop me")
    channel, guest = channel_to(script)
    assert channel.unavailable_reason(wait_s=2.0) is None
    t0 = time.monotonic()
    with pytest.raises(GuestHelperError, match=r"did not acknowledge 'type' within 0\.3 s"):
        channel.request("type", {"text": "drop me"}, timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
    # The helper answers late (a new helper read the stale request): no "go" follows.
    guest.send(line({"id": 1, "ready": True}))
    time.sleep(0.3)
    assert all(m.get("op") != "go" for m in guest.received)
    # Until it announces itself again, the helper counts as gone: refused at once.
    reason = channel.unavailable_reason()
    assert reason is not None and "did not acknowledge" in reason
    with pytest.raises(GuestHelperError, match="did not acknowledge"):
        channel.request("type", {"text": "ok"}, timeout_s=2.0)
    # Asked with a wait, the channel asks the helper to announce itself again.
    assert channel.unavailable_reason(wait_s=2.0) is None
    assert guest.received[-1] == {"id": 0, "op": "hello"}
    assert channel.request("type", {"text": "ok"}, timeout_s=2.0)["ok"] is True
    assert [r["text"] for r in script.executed] == ["ok"]


def test_unfinished_request_says_part_may_have_reached_the_guest(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, _ = channel_to(Guest(stall="slow"))
    assert channel.unavailable_reason(wait_s=2.0) is None
    with pytest.raises(GuestHelperError, match=r"did not finish 'type' within 0\.5 s .*part of it"):
        channel.request("type", {"text": "slow"}, timeout_s=0.5)


def test_hostile_lines_are_dropped(channel_to) -> None:  # type: ignore[no-untyped-def]
    def hostile(m: dict[str, Any]) -> list[bytes]:
        rid = m["id"]
        if m["op"] == "hello":
            return [line({**HELLO, "id": rid})]
        if m["op"] == "go":
            return [
                line({"id": rid, "ok": True, "count": 1}),
                line({"id": rid, "ok": False, "error": "second answer ignored"}),
            ]
        return [
            b"\xff\xfe not json\n",
            b"[1, 2, 3]\n",
            b"x" * (MAX_LINE_BYTES + 10) + b"\n",  # too long, even with a reply inside
            line({"id": rid + 1000, "ok": True}),  # nobody asked
            line({"id": rid, "ready": True}),
        ]

    channel, _ = channel_to(hostile)
    assert channel.unavailable_reason(wait_s=2.0) is None
    assert channel.request("type", {"text": "a"}, timeout_s=2.0)["ok"] is True
    deadline = time.monotonic() + 2.0
    while channel.dropped_lines < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert channel.dropped_lines >= 5


def test_key_events_come_with_the_hello_and_on_their_own(channel_to) -> None:  # type: ignore[no-untyped-def]
    def counting(m: dict[str, Any]) -> list[bytes]:
        return [line({**HELLO, "key_events": 40, "id": m["id"]})] if m["op"] == "hello" else []

    channel, guest = channel_to(counting)
    assert channel.unavailable_reason(wait_s=2.0) is None
    assert channel.key_events() == 40
    waiter = threading.Timer(0.2, guest.send, [line({"key_events": 46})])
    waiter.start()
    t0 = time.monotonic()
    assert channel.wait_key_events(46, timeout_s=5.0) == 46
    assert time.monotonic() - t0 < 2.0
    # A restarted helper counts from 0: a wait ends on a lower count too.
    threading.Timer(0.2, guest.send, [line({"key_events": 2})]).start()
    assert channel.wait_key_events(100, timeout_s=5.0) == 2
    t0 = time.monotonic()
    assert channel.wait_key_events(100, timeout_s=0.3) == 2  # times out
    assert time.monotonic() - t0 >= 0.3
    assert guest.conn is not None
    guest.conn.shutdown(socket.SHUT_RDWR)  # the domain stopped: no count any more
    deadline = time.monotonic() + 2.0
    while channel.key_events() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert channel.key_events() is None


def test_hostile_key_events_are_dropped(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, guest = channel_to(lambda m: [line({**HELLO, "id": m["id"]})])
    assert channel.unavailable_reason(wait_s=2.0) is None
    assert channel.key_events() is None  # a helper that does not count
    for value in (True, -1, 1.5, "7", None, 1 << 63, [3]):
        guest.send(line({"key_events": value}))
    guest.send(line({"key_events": 9}))
    deadline = time.monotonic() + 2.0
    while channel.key_events() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert channel.key_events() == 9
    assert channel.dropped_lines == 7


def test_unannounced_helper_is_unavailable_with_a_reason(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, _ = channel_to(lambda m: [])
    reason = channel.unavailable_reason(wait_s=0.2)
    assert reason is not None and "not announced" in reason
    with pytest.raises(GuestHelperError, match="not announced"):
        channel.request("type", {"text": "a"}, timeout_s=1.0)


def test_wrong_protocol_makes_an_announced_helper_unavailable(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, guest = channel_to(Guest())
    assert channel.unavailable_reason(wait_s=2.0) is None
    guest.send(line({**HELLO, "protocol": 99}))
    time.sleep(0.3)
    reason = channel.unavailable_reason()
    assert reason is not None and "protocol 99" in reason


def test_hang_up_fails_the_pending_request_at_once(channel_to) -> None:  # type: ignore[no-untyped-def]
    holder: dict[str, FakeGuest] = {}
    script = Guest()

    def hang_up_on_go(m: dict[str, Any]) -> list[bytes]:
        if m.get("op") == "go":
            holder["guest"].hang_up()
            return []
        return script(m)

    channel, guest = channel_to(hang_up_on_go)
    holder["guest"] = guest
    assert channel.unavailable_reason(wait_s=2.0) is None
    t0 = time.monotonic()
    with pytest.raises(GuestHelperError, match="closed"):
        channel.request("type", {"text": "a"}, timeout_s=10.0)
    assert time.monotonic() - t0 < 5.0
    assert "closed" in (channel.unavailable_reason() or "")


def test_a_guest_that_never_reads_cannot_block_a_write(
    channel_to, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(guest_helper, "SEND_TIMEOUT_S", 0.5)
    channel, _ = channel_to(lambda m: [], greet=True, read=False)
    assert channel.unavailable_reason(wait_s=2.0) is None
    t0 = time.monotonic()
    with pytest.raises(GuestHelperError, match="writing to the guest helper failed"):
        channel.request("type", {"text": "美" * 4_000_000}, timeout_s=30.0)
    assert time.monotonic() - t0 < 10.0
    assert "channel is closed" in (channel.unavailable_reason() or "")


def test_connect_to_nothing_is_a_clear_error(tmp_path: Path) -> None:
    channel = HelperChannel(tmp_path / "absent.sock", connect_timeout_s=0.2)
    with pytest.raises(GuestHelperError, match="cannot connect to the guest helper channel"):
        channel.connect()


# --- the plan -------------------------------------------------------------------------------


def test_text_without_us_keys_is_one_helper_request_in_order() -> None:
    text = "Ñandú and 美国\n"
    assert plan_action(Type(text), PACING) == [HelperStep("type", {"text": text}, 0)]


def test_us_text_stays_on_qemu() -> None:
    steps = plan_action(Type("a"), PACING)
    assert all(isinstance(s, Step) for s in steps) and steps


def test_horizontal_wheel_without_qemu_support_goes_to_the_helper_with_its_barrier() -> None:
    hold = parse_combo("ctrl+shift")
    steps = plan_action(Scroll(x=10, y=20, dx=-3, dy=2, hold=hold), PACING, horizontal_wheel=False)
    helper_steps = [s for s in steps if isinstance(s, HelperStep)]
    assert helper_steps == [
        HelperStep("wheel", {"direction": "left", "count": 3, "x": 10, "y": 20, "mods": 0x5}, 0)
    ]
    # The vertical notches stay on QEMU; the held keys go down before, up after.
    wheels = [e for s in steps for e in s.events if isinstance(e, WheelEvent)]
    assert wheels == [WheelEvent("down"), WheelEvent("down")]
    ctrl_down = next(i for i, s in enumerate(steps) if s.events == (KeyEvent("ctrl", True),))
    assert ctrl_down < steps.index(helper_steps[0])


def test_scroll_without_coordinates_uses_the_cursor() -> None:
    (step,) = plan_action(Scroll(None, None, dx=1), PACING, horizontal_wheel=False, cursor=(7, 9))
    assert isinstance(step, HelperStep) and (step.args["x"], step.args["y"]) == (7, 9)


def test_horizontal_wheel_with_qemu_support_stays_on_qemu() -> None:
    steps = plan_action(Scroll(x=1, y=1, dx=2), PACING, horizontal_wheel=True)
    wheels = [e for s in steps for e in s.events if isinstance(e, WheelEvent)]
    assert wheels == [WheelEvent("right"), WheelEvent("right")]


# --- the session ----------------------------------------------------------------------------

WITH_HELPER = BootImage(
    "debian12-desktop", "cd" * 32, Path("/b"), Path("/k"), Path("/i"),
    helper_port="dev.deskvm.helper.0",
)  # fmt: skip
WITHOUT_HELPER = BootImage("plain", "cd" * 32, Path("/b"), Path("/k"), Path("/i"))


def make(image: BootImage, *, horizontal_wheel: bool = False) -> tuple[Session, FakeHypervisor]:
    clock = FakeClock()
    hv = FakeHypervisor(horizontal_wheel=horizontal_wheel)
    spec = SessionSpec("abcdef012345", image, DisplaySpec(1024, 768), boot_timeout_s=5.0)
    session = Session(
        spec, hypervisor=hv, recorder=MemoryRecorder(clock), clock=clock, pacing=PACING,
        ready_poll_s=0.5,
    )  # fmt: skip
    return session, hv


def act(session: Session, **body: object) -> Any:
    return session.execute(parse_deskvm_action(body))


def test_session_types_non_us_text_through_the_helper() -> None:
    session, hv = make(WITH_HELPER)
    with session:
        domain = hv.domains[session.id]
        act(session, action="type", text="Ñandú 美国降息新闻\n")
        assert domain.read_guest_log().decode().endswith("Ñandú 美国降息新闻\n")
        assert domain.display.events == []  # nothing went through QEMU
        injected = [e for e in session.recorder.events if e.kind == "injected"]
        assert injected[-1].data["events"] == ["helper type 13 chars"]


def test_session_scrolls_sideways_through_the_helper_at_the_pointer() -> None:
    session, hv = make(WITH_HELPER)
    with session:
        act(session, action="scroll", x=100, y=200, dx=-4, dy=1)
        helper = hv.domains[session.id].helper
        assert helper is not None
        assert helper.wheels == [("left", 4, 100, 200, 0)]
        wheels = [e for e in hv.domains[session.id].display.events if isinstance(e, WheelEvent)]
        assert wheels == [WheelEvent("down")]


def test_without_a_helper_non_us_text_is_refused_before_any_input() -> None:
    session, hv = make(WITHOUT_HELPER)
    with session:
        with pytest.raises(ActionError) as info:
            act(session, action="type", text="abcÑ")
        assert info.value.code == "untypeable_text"
        assert "U+00D1" in info.value.message and "no guest helper" in info.value.message
        assert hv.domains[session.id].display.events == []  # not even "abc"
        act(session, action="type", text="still alive\n")  # the session lives on
        assert b"still alive" in hv.domains[session.id].read_guest_log()


def test_without_a_helper_or_qemu_wheel_horizontal_scroll_is_refused() -> None:
    session, hv = make(WITHOUT_HELPER, horizontal_wheel=False)
    with session:
        with pytest.raises(ActionError) as info:
            act(session, action="scroll", x=5, y=5, dx=2)
        assert info.value.code == "unsupported_input"
        assert "QEMU 8.1" in info.value.message
        assert hv.domains[session.id].display.events == []


def test_unannounced_helper_is_refused_with_its_reason() -> None:
    session, hv = make(WITH_HELPER)
    with session:
        helper = hv.domains[session.id].helper
        assert helper is not None
        helper.available = False
        with pytest.raises(ActionError, match="has not announced itself") as info:
            act(session, action="type", text="ñ")
        assert info.value.code == "untypeable_text"


def test_helper_failure_mid_action_releases_held_keys_and_is_recorded() -> None:
    session, hv = make(WITH_HELPER)
    with session:
        domain = hv.domains[session.id]
        assert domain.helper is not None
        domain.helper.fail_next = "pointer is at (0, 0)"
        with pytest.raises(GuestHelperError):
            session.execute(Scroll(x=3, y=4, dx=1, hold=parse_combo("shift")))
        assert session.held() == (set(), set())
        assert not domain.display.pressed_keys
        errors = [e for e in session.recorder.events if e.kind == "error"]
        assert errors[-1].data["code"] == "guest_helper_error"
        act(session, action="scroll", x=3, y=4, dx=1)  # the session lives on
        assert domain.helper.wheels[-1] == ("right", 1, 3, 4, 0)


def test_secret_text_through_the_helper_is_not_recorded() -> None:
    session, _ = make(WITH_HELPER)
    with session:
        act(session, action="type", text="pässwörd", secret=True)
        dump = json.dumps([e.data for e in session.recorder.events], ensure_ascii=False)
        assert "pässwörd" not in dump


def test_more_distinct_non_us_characters_than_spare_keycodes_are_refused_up_front() -> None:
    session, hv = make(WITH_HELPER)
    with session:
        helper = hv.domains[session.id].helper
        assert helper is not None
        helper.spare_keycodes = 3
        with pytest.raises(ActionError, match="4 different characters with no US key") as info:
            act(session, action="type", text="ab 美国降息")
        assert info.value.code == "untypeable_text"
        assert helper.requests == []
        act(session, action="type", text="美国降美国降")  # 3 distinct: fine, repeats included
        assert helper.requests[-1] == ("type", {"text": "美国降美国降"})


def test_overlong_helper_text_is_refused_up_front() -> None:
    session, hv = make(WITH_HELPER)
    with session:
        with pytest.raises(ActionError, match="at most 10000 characters per action") as info:
            act(session, action="type", text="ñ" * 10_001)
        assert info.value.code == "untypeable_text"
        helper = hv.domains[session.id].helper
        assert helper is not None and helper.requests == []


def test_secret_untypeable_text_is_not_named_in_the_error() -> None:
    session, _ = make(WITHOUT_HELPER)
    with session:
        with pytest.raises(ActionError) as info:
            act(session, action="type", text="hunter2-Ñ-topsecret", secret=True)
        assert info.value.code == "untypeable_text"
        assert "Ñ" not in info.value.message and "00D1" not in info.value.message
        dump = json.dumps([e.data for e in session.recorder.events], ensure_ascii=False)
        assert "Ñ" not in dump and "00D1" not in dump and "hunter2" not in dump


@pytest.mark.parametrize("text", ["a\x00b", "x\x1by", "a\x7f", "\x85", "a\ud800b"])
def test_control_characters_and_lone_surrogates_are_refused(text: str) -> None:
    session, hv = make(WITH_HELPER)
    with session:
        with pytest.raises(ActionError) as info:
            act(session, action="type", text=text)
        assert info.value.code == "invalid_action"
        assert "key action" in info.value.message
        helper = hv.domains[session.id].helper
        assert helper is not None and helper.requests == []
        act(session, action="type", text="fine\r\n")  # \r and \n are Return; session lives
