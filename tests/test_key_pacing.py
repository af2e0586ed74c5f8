"""Keys paced by the guest X server's processed-key count (fakes, no VM).

The real count (the helper's XInput2 raw events) is exercised on Xvfb by
``tests/test_helper_script.py`` and in a busy real guest by
``tests/vm/test_key_pacing_vm.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent_bridge.protocol import parse_deskvm_action
from orchestrator.clock import FakeClock
from orchestrator.display.base import KeyEvent
from orchestrator.display.key_pacing import KEY_ACK_WINDOW, KeyPacer
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.input_plan import Pacing
from orchestrator.recorder import MemoryRecorder
from orchestrator.session import Session
from orchestrator.spec import BootImage, DisplaySpec, SessionSpec


class Counter:
    """A guest helper's key count, moved by the test (or by a thread)."""

    def __init__(self, value: int | None = 0) -> None:
        self.value = value
        self.waits: list[int] = []
        self.on_wait: list[int | None] = []  # values taken, one per wait, if any

    def key_events(self) -> int | None:
        return self.value

    def wait_key_events(self, at_least: int, timeout_s: float) -> int | None:
        self.waits.append(at_least)
        if self.on_wait:
            self.value = self.on_wait.pop(0)
        else:
            time.sleep(min(timeout_s, 0.01))
        return self.value


def test_keys_within_the_window_go_at_once() -> None:
    counter = Counter(100)
    pacer = KeyPacer(counter, window=4)  # type: ignore[arg-type]
    pacer.before(4)
    pacer.sent(4)
    assert counter.waits == []


def test_keys_beyond_the_window_wait_for_the_count() -> None:
    counter = Counter(100)
    pacer = KeyPacer(counter, window=4)  # type: ignore[arg-type]
    pacer.before(3)
    pacer.sent(3)
    counter.on_wait = [100, 101, 102]
    pacer.before(3)  # 6 sent, 4 may be unprocessed: wait for 102
    assert counter.waits == [102, 102, 102]
    assert counter.value == 102


def test_short_actions_cannot_run_ahead_one_after_another() -> None:
    counter = Counter(0)
    pacer = KeyPacer(counter, window=4, stall_s=0.2)  # type: ignore[arg-type]
    for _ in range(2):  # each action alone is within the window; together they are not
        pacer.begin_action()
        pacer.before(3)
        pacer.sent(3)
    assert pacer.waited_s >= 0.2 and pacer.gave_up  # the X server never counted a key


def test_a_count_that_stands_still_ends_the_pacing_for_the_action() -> None:
    counter = Counter(7)
    pacer = KeyPacer(counter, window=2, stall_s=0.2)  # type: ignore[arg-type]
    pacer.before(2)
    pacer.sent(2)
    t0 = time.monotonic()
    pacer.before(2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert pacer.gave_up and pacer.summary()["key_acks_stalled"] is True
    waits = len(counter.waits)
    pacer.sent(2)
    pacer.before(50)  # no more waiting in this action
    assert len(counter.waits) == waits
    pacer.begin_action()  # the next action tries again
    assert not pacer.gave_up


def test_slow_progress_is_not_a_stall() -> None:
    counter = Counter(0)
    pacer = KeyPacer(counter, window=1, stall_s=0.3)  # type: ignore[arg-type]

    def x_server() -> None:  # a key every 20 ms (50/s): 1 s in all, each step within stall_s
        for value in range(1, 51):
            time.sleep(0.02)
            counter.value = value

    thread = threading.Thread(target=x_server)
    thread.start()
    for _ in range(51):
        pacer.before(1)
        pacer.sent(1)
    thread.join()
    assert not pacer.gave_up and pacer.waited_s >= 0.8


def test_after_an_idle_gap_counting_starts_afresh() -> None:
    counter = Counter(0)
    pacer = KeyPacer(counter, window=4, stall_s=5.0, resync_s=0.2)  # type: ignore[arg-type]
    pacer.before(4)
    pacer.sent(4)
    counter.value = 1  # the X server read after the send; 3 never counted (lost, say)
    time.sleep(0.3)
    pacer.before(4)
    assert counter.waits == [] and not pacer.gave_up


def test_an_idle_gap_forgets_nothing_while_the_x_server_reads_nothing() -> None:
    counter = Counter(0)
    pacer = KeyPacer(counter, window=4, stall_s=0.3, resync_s=0.1)  # type: ignore[arg-type]
    pacer.before(4)
    pacer.sent(4)  # the X server is busy: not one key read since
    time.sleep(0.2)
    pacer.before(4)  # 4 still in the kernel's buffer: 4 more would be 8
    assert counter.waits and pacer.gave_up


def test_counts_beyond_what_was_sent_give_no_credit() -> None:
    counter = Counter(0)
    pacer = KeyPacer(counter, window=4, stall_s=0.2)  # type: ignore[arg-type]
    pacer.before(4)
    pacer.sent(4)
    counter.value = 100  # keys from elsewhere (another keyboard, repeats)
    pacer.before(4)
    pacer.sent(4)
    assert not pacer.gave_up
    pacer.before(1)  # 4 unprocessed: one more must wait
    assert pacer.gave_up


def test_a_restarted_helper_counts_from_its_new_start() -> None:
    counter = Counter(500)
    pacer = KeyPacer(counter, window=2)  # type: ignore[arg-type]
    pacer.before(2)
    pacer.sent(2)
    counter.value = 3  # a new helper: its count is lower than where counting started
    pacer.before(2)
    assert counter.waits == [] and not pacer.gave_up


def test_no_helper_or_no_count_never_waits() -> None:
    KeyPacer(None).before(1000)
    counter = Counter(None)
    pacer = KeyPacer(counter)  # type: ignore[arg-type]
    pacer.sent(1000)
    pacer.before(1000)
    assert counter.waits == [] and pacer.summary() == {}


def test_a_closing_session_stops_the_wait() -> None:
    counter = Counter(0)
    pacer = KeyPacer(counter, window=1, stall_s=30.0)  # type: ignore[arg-type]
    pacer.before(1)
    pacer.sent(1)
    closing = threading.Event()
    threading.Timer(0.2, closing.set).start()
    t0 = time.monotonic()
    pacer.before(1, closing)
    assert time.monotonic() - t0 < 2.0 and not pacer.gave_up


# --- the session ----------------------------------------------------------------------------

IMAGE = BootImage(
    "debian12-desktop", "cd" * 32, Path("/b"), Path("/k"), Path("/i"),
    helper_port="dev.deskvm.helper.0",
)  # fmt: skip


@contextmanager
def fake_session() -> Iterator[tuple[Session, FakeHypervisor, MemoryRecorder]]:
    """A running session on a fake hypervisor with an image that has a guest helper, no
    pacing pauses: (session, hypervisor, recorder)."""
    clock = FakeClock()
    hv = FakeHypervisor()
    recorder = MemoryRecorder(clock)
    spec = SessionSpec("abcdef012345", IMAGE, DisplaySpec(1024, 768), boot_timeout_s=5.0)
    session = Session(
        spec, hypervisor=hv, recorder=recorder, clock=clock,
        pacing=Pacing(0, 0, 0, 0, 0), ready_poll_s=0.5,
    )  # fmt: skip
    with session:
        yield session, hv, recorder


ONE_TYPE = [{"action": "type", "text": "Hello, World! " * 20 + "\n"}]
KEY_PER_CHAR = [{"action": "key", "keys": "x"} for _ in range(150)]  # pyautogui.press-style


@pytest.mark.parametrize("actions", [ONE_TYPE, KEY_PER_CHAR], ids=["one_type", "key_per_char"])
def test_a_session_never_runs_more_than_the_window_ahead_of_the_x_server(
    actions: list[dict[str, str]],
) -> None:
    with fake_session() as (session, hv, _):
        domain = hv.domains[session.id]
        helper, display = domain.helper, domain.display
        assert helper is not None
        helper.key_acks = True
        ahead: list[int] = []
        send = display.send

        def watched(events, **kwargs):  # type: ignore[no-untyped-def]
            keys = sum(isinstance(e, KeyEvent) for e in events)
            received = sum(isinstance(e, KeyEvent) for e in display.events)
            ahead.append(received + keys - helper.keys_processed)
            send(events, **kwargs)

        display.send = watched  # type: ignore[method-assign]
        for action in actions:
            session.execute(parse_deskvm_action(action))
        sent = sum(isinstance(e, KeyEvent) for e in display.events)
        assert sent >= 2 * len(actions) and ahead
        assert max(ahead) <= KEY_ACK_WINDOW
        # Most of the keys were sent while the X server lagged: the window was used.
        assert max(ahead) > KEY_ACK_WINDOW // 2


def test_the_result_says_how_long_keys_waited_only_when_the_guest_counts_them() -> None:
    with fake_session() as (session, hv, recorder):
        helper = hv.domains[session.id].helper
        assert helper is not None
        session.execute(parse_deskvm_action({"action": "type", "text": "no count\n"}))
        helper.key_acks = True
        session.execute(parse_deskvm_action({"action": "type", "text": "counted " * 10}))
        session.execute(parse_deskvm_action({"action": "click", "x": 5, "y": 5}))
        results = [e.data for e in recorder.events if e.kind == "result"]
        assert "key_wait_s" not in results[-3]
        assert isinstance(results[-2]["key_wait_s"], float)
        assert "key_wait_s" not in results[-1]  # no key sent
        assert session.guest_key_events() == helper.keys_processed
        helper.key_acks = False
        assert session.guest_key_events() is None


@pytest.mark.parametrize(
    "action",
    [
        {"action": "key", "keys": "shift+x"},
        {"action": "key", "keys": "ctrl+alt+t"},
        {"action": "hold_key", "keys": "x", "duration_ms": 10},
        {"action": "click", "x": 5, "y": 5, "hold": "ctrl"},
    ],
    ids=["combo", "three_keys", "hold_key", "click_with_hold"],
)
def test_keys_never_wait_while_a_key_is_down(
    action: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held key autorepeats in the guest (X after 660 ms): waits come before a press."""
    monkeypatch.setitem(KeyPacer.__init__.__kwdefaults__, "stall_s", 0.2)
    monkeypatch.setitem(KeyPacer.__init__.__kwdefaults__, "resync_s", 0.1)
    with fake_session() as (session, hv, _):
        domain = hv.domains[session.id]
        helper, display = domain.helper, domain.display
        assert helper is not None
        helper.key_acks, helper.keys_stalled = True, True  # the count stands still
        held: set[str] = set()
        waited_with: list[set[str]] = []
        send, last = display.send, [time.monotonic()]

        def watched(events, **kwargs):  # type: ignore[no-untyped-def]
            if time.monotonic() - last[0] >= 0.15:
                waited_with.append(set(held))
            for e in events:
                if isinstance(e, KeyEvent):
                    (held.add if e.down else held.discard)(e.qcode)
            send(events, **kwargs)
            last[0] = time.monotonic()

        display.send = watched  # type: ignore[method-assign]
        for lead in range(KEY_ACK_WINDOW - 6, KEY_ACK_WINDOW + 1, 2):  # the window nearly full
            session.execute(parse_deskvm_action({"action": "type", "text": "a" * (lead // 2)}))
            last[0] = time.monotonic()
            session.execute(parse_deskvm_action(action))
            time.sleep(0.15)  # an idle gap: counting starts afresh
        assert waited_with and all(not keys for keys in waited_with), waited_with


def test_a_count_that_creeps_cannot_stretch_an_action_without_end() -> None:
    counter = Counter(0)
    pacer = KeyPacer(counter, window=1, stall_s=0.3)  # type: ignore[arg-type]
    stop = threading.Event()

    def creeping() -> None:  # one key every 0.25 s: always just inside stall_s
        while not stop.wait(0.25):
            counter.value = (counter.value or 0) + 1

    thread = threading.Thread(target=creeping)
    thread.start()
    t0 = time.monotonic()
    try:
        for _ in range(200):  # 200 key events: at most 0.3 + 0.05 * 200 = 10.3 s of waits
            pacer.before(1)
            pacer.sent(1)
            if pacer.gave_up:
                break
    finally:
        stop.set()
        thread.join()
    assert pacer.gave_up and pacer.summary()["key_acks_stalled"] is True
    assert time.monotonic() - t0 < 0.3 + 0.05 * 200


def test_text_through_the_helper_waits_until_the_x_server_has_every_earlier_key() -> None:
    with fake_session() as (session, hv, _):
        domain = hv.domains[session.id]
        helper, display = domain.helper, domain.display
        assert helper is not None
        helper.key_acks = True
        unprocessed: list[int] = []
        request = helper.request

        def watched(op, args, **kwargs):  # type: ignore[no-untyped-def]
            received = sum(isinstance(e, KeyEvent) for e in display.events)
            unprocessed.append(received - helper.keys_processed)
            return request(op, args, **kwargs)

        helper.request = watched  # type: ignore[method-assign]
        session.execute(parse_deskvm_action({"action": "type", "text": "abcdef"}))
        session.execute(parse_deskvm_action({"action": "type", "text": "üß"}))
        assert unprocessed == [0]  # 12 without the wait: the text could overtake them
