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
from orchestrator.display.base import KeyEvent, WheelEvent
from orchestrator.display.guest_helper import MAX_LINE_BYTES, HelperChannel
from orchestrator.errors import ActionError, GuestHelperError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import HelperStep, Pacing, Step, plan_action
from orchestrator.recorder import MemoryRecorder
from orchestrator.session import Session
from orchestrator.spec import BootImage, DisplaySpec, SessionSpec

HELLO = {"hello": "deskvm-helper", "protocol": 1, "ops": ["hello", "type", "wheel"]}
PACING = Pacing(0, 0, 0, 0, 0)


# --- the channel ------------------------------------------------------------------------


class FakeGuest:
    """QEMU's listening end of the channel, with a scripted guest behind it."""

    def __init__(self, path: Path, answer: Callable[[dict[str, Any]], list[bytes]]) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.answer = answer
        self.received: list[dict[str, Any]] = []
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.conn, _ = self.server.accept()
        except OSError:
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
                line, buf = buf.split(b"\n", 1)
                request = json.loads(line)
                self.received.append(request)
                for out in self.answer(request):
                    self.conn.sendall(out)

    def hang_up(self) -> None:
        assert self.conn is not None
        self.conn.close()

    def close(self) -> None:
        self.server.close()
        if self.conn is not None:
            self.conn.close()


def line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def good_guest(request: dict[str, Any]) -> list[bytes]:
    if request["op"] == "hello":
        return [line({**HELLO, "id": request["id"]})]
    if request["op"] == "type":
        return [line({"id": request["id"], "ok": True, "count": len(request["text"])})]
    return [line({"id": request["id"], "ok": False, "error": "pointer is elsewhere"})]


@pytest.fixture
def channel_to(tmp_path: Path) -> Iterator[Callable[..., tuple[HelperChannel, FakeGuest]]]:
    made: list[tuple[HelperChannel, FakeGuest]] = []

    def make(answer: Callable[[dict[str, Any]], list[bytes]]) -> tuple[HelperChannel, FakeGuest]:
        path = tmp_path / f"helper{len(made)}.sock"
        guest = FakeGuest(path, answer)
        channel = HelperChannel(path, connect_timeout_s=2.0)
        channel.connect()
        made.append((channel, guest))
        return channel, guest

    yield make
    for channel, guest in made:
        channel.close()
        guest.close()


def test_hello_then_request_and_reply(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, guest = channel_to(good_guest)
    assert channel.unavailable_reason(wait_s=2.0) is None
    assert channel.hello_info["ops"] == ["hello", "type", "wheel"]
    reply = channel.request("type", {"text": "Ñandú 美国"}, timeout_s=2.0)
    assert reply == {"id": 1, "ok": True, "count": 8}
    assert guest.received[-1] == {"text": "Ñandú 美国", "id": 1, "op": "type"}


def test_refusal_is_a_guest_helper_error(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, _ = channel_to(good_guest)
    assert channel.unavailable_reason(wait_s=2.0) is None
    with pytest.raises(GuestHelperError, match="could not wheel: pointer is elsewhere"):
        channel.request("wheel", {"direction": "left", "count": 1}, timeout_s=2.0)


def test_silent_guest_times_out_and_the_next_request_works(channel_to) -> None:  # type: ignore[no-untyped-def]
    def sometimes_silent(request: dict[str, Any]) -> list[bytes]:
        if request.get("text") == "drop me":
            return []
        return good_guest(request)

    channel, _ = channel_to(sometimes_silent)
    assert channel.unavailable_reason(wait_s=2.0) is None
    t0 = time.monotonic()
    with pytest.raises(GuestHelperError, match=r"did not answer 'type' within 0\.3 s"):
        channel.request("type", {"text": "drop me"}, timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
    assert channel.request("type", {"text": "ok"}, timeout_s=2.0)["ok"] is True


def test_hostile_lines_are_dropped(channel_to) -> None:  # type: ignore[no-untyped-def]
    def hostile(request: dict[str, Any]) -> list[bytes]:
        rid = request["id"]
        if request["op"] == "hello":
            return [line({**HELLO, "id": rid})]
        return [
            b"\xff\xfe not json\n",
            b"[1, 2, 3]\n",
            b"x" * (MAX_LINE_BYTES + 10) + b"\n",  # too long, even with a reply inside
            line({"id": rid + 1000, "ok": True}),  # nobody asked
            line({"id": rid, "ok": True, "count": 1}),
            line({"id": rid, "ok": False, "error": "second answer ignored"}),
        ]

    channel, _ = channel_to(hostile)
    assert channel.unavailable_reason(wait_s=2.0) is None
    assert channel.request("type", {"text": "a"}, timeout_s=2.0)["ok"] is True
    deadline = time.monotonic() + 2.0
    while channel.dropped_lines < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert channel.dropped_lines >= 4


def test_unannounced_helper_is_unavailable_with_a_reason(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, _ = channel_to(lambda request: [])
    reason = channel.unavailable_reason(wait_s=0.2)
    assert reason is not None and "not announced" in reason
    with pytest.raises(GuestHelperError, match="not announced"):
        channel.request("type", {"text": "a"}, timeout_s=1.0)


def test_wrong_protocol_is_unavailable(channel_to) -> None:  # type: ignore[no-untyped-def]
    channel, _ = channel_to(lambda r: [line({**HELLO, "protocol": 99, "id": r["id"]})])
    time.sleep(0.3)
    reason = channel.unavailable_reason(wait_s=0.2)
    assert reason is not None and "protocol 99" in reason


def test_hang_up_fails_the_pending_request_at_once(channel_to) -> None:  # type: ignore[no-untyped-def]
    holder: dict[str, FakeGuest] = {}

    def hang_up_on_type(request: dict[str, Any]) -> list[bytes]:
        if request["op"] == "type":
            holder["guest"].hang_up()
            return []
        return good_guest(request)

    channel, guest = channel_to(hang_up_on_type)
    holder["guest"] = guest
    assert channel.unavailable_reason(wait_s=2.0) is None
    t0 = time.monotonic()
    with pytest.raises(GuestHelperError, match="closed"):
        channel.request("type", {"text": "a"}, timeout_s=10.0)
    assert time.monotonic() - t0 < 5.0
    assert "closed" in (channel.unavailable_reason() or "")


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
    steps = plan_action(
        Scroll(x=10, y=20, dx=-3, dy=2, hold=hold), PACING, horizontal_wheel=False
    )
    helper_steps = [s for s in steps if isinstance(s, HelperStep)]
    assert helper_steps == [
        HelperStep("wheel", {"direction": "left", "count": 3, "x": 10, "y": 20, "mods": 0x5}, 0)
    ]
    # The vertical notches stay on QEMU; the held keys go down before, up after.
    wheels = [e for s in steps for e in s.events if isinstance(e, WheelEvent)]
    assert wheels == [WheelEvent("down"), WheelEvent("down")]
    ctrl_down = next(
        i for i, s in enumerate(steps) if s.events == (KeyEvent("ctrl", True),)
    )
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
