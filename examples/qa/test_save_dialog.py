"""A desktop test as a QA engineer writes it: open an application, wait for it by
reference and by OCR, drive it, check the result.

The application is ``xmessage`` (on the small image, debian12-desktop), started from the
xterm the desktop opens with: a "Save changes?" dialog whose Yes button exits with
status 3. References live in ``refs/`` beside this file (``terminal``, ``save_dialog``,
``yes_button``; see docs/qa.md for their JSON).

``test_the_wrong_dialog_fails`` fails on purpose (the application asks another
question): it is marked ``xfail(strict=True)`` so the suite is green, and
``pytest --runxfail`` runs it as an ordinary failing test to show its report
(``artifacts/test_the_wrong_dialog_fails/report.html``).
"""

from __future__ import annotations

import re

import pytest

from agent_bridge.client import Session
from agent_bridge.qa import MatchTimeout

TERMINAL_TEXT = (41, 59, 810, 514)
"""Where the xterm shows text (x0, y0, x1, y1: display pixels, x1/y1 exclusive)."""
QUESTION = (583, 404, 699, 424)
"""The text of the dialog (xmessage -center: the middle of the screen), inside its frame:
OCR reads a region around the words better than one with borders and buttons in it."""


def ask(session: Session, question: str) -> None:
    """Type the xmessage command into the xterm (exit status 3 for Yes, 4 for No); the
    shell then prints ``answer <status>`` and writes it to the guest log."""
    session.wait_for("terminal", timeout_s=30)  # the xterm has the keyboard focus
    session.move(1100, 700)  # keep the pointer away from the dialog
    session.type(
        f"xmessage -center -buttons Yes:3,No:4 '{question}'; echo answer $? | tee /dev/ttyS1\n"
    )


def test_save_changes_yes(deskvm_session: Session) -> None:
    s = deskvm_session
    ask(s, "Save changes?")

    question = s.find_text("Save changes", region=QUESTION, timeout_s=30)  # by OCR
    dialog = s.wait_for("save_dialog", timeout_s=10)  # by reference
    assert dialog.score >= 0.95 and dialog.box.contains(question.box.center)
    assert s.exists("yes_button") is not None

    with s.expect_change(region=dialog.box) as watch:
        s.click("yes_button")
    assert watch.change is not None and watch.change.changed_px > 100
    s.wait_gone("save_dialog", timeout_s=10)

    # the result, twice: on the screen (OCR of the terminal) and in the guest log
    answer = s.find_text(re.compile(r"answer 3\b"), region=TERMINAL_TEXT, timeout_s=15)
    assert answer.text.startswith("answer")
    assert "answer 3" in s.guest_log()
    s.wait_still(0.5, timeout_s=10)
    assert "answer 3" in s.read_text(TERMINAL_TEXT).text


@pytest.mark.xfail(
    strict=True, raises=MatchTimeout, reason="fails on purpose: shows the failure report"
)
def test_the_wrong_dialog_fails(deskvm_session: Session) -> None:
    s = deskvm_session
    ask(s, "Quit without saving?")
    s.wait_for("yes_button", timeout_s=30)  # a dialog is up, but another one...
    s.wait_for("save_dialog", timeout_s=5)  # ...so this times out, with a report
