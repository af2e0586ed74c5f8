"""Scripted agents for the example tasks (``deskvm task run examples/tasks --agent ...``).

Both have OSWorld's agent shape (``predict(instruction, obs) -> (response, actions)``) and
act only through the desktop, on the window each task's setup focuses: on the small image
they type shell commands into the xterm, on the full image (``examples/tasks/full``) they
type and press keys in LibreOffice Calc, Mousepad and Firefox; in the three vocabularies
``DesktopEnv.step`` takes (pyautogui code, OSWorld's computer_13, deskvm's own), then say
``DONE``.

- ``SolvingAgent`` solves every example task: ``deskvm task run`` passes them all.
- ``FailingAgent`` makes a plausible mistake in each (a typo, half the job, the wrong
  place): every task fails, so the harness is seen to reject wrong work, not only to
  accept right work.

They recognise a task by a phrase of its instruction (an agent never sees task ids).
"""

from __future__ import annotations

from typing import Any

# The shell needs a moment to run what was typed before the evaluator looks.
SETTLE = "time.sleep(2)"


def _typed(command: str) -> str:
    """pyautogui code typing ``command`` and Return, then settling."""
    return f"pyautogui.write({command + chr(10)!r})\n{SETTLE}"


# deskvm's own vocabulary: wait until the screen has been still for 2 s (an application
# done starting and drawing), as an agent looks before it types.
LOOK = {"action": "wait", "ms": 200, "screenshot_after": {"still_ms": 2000, "timeout_ms": 20000}}


def _calc_total(formula: str) -> str:
    """pyautogui code: in Calc (maximized, 1280x800), click cell A5, type ``total`` and,
    in B5, ``formula``, then save. Pauses let each input land before the next."""
    return (
        "pyautogui.click(80, 305)\n"
        "time.sleep(1)\n"
        f"pyautogui.write('total\\t{formula}\\n')\n"
        "time.sleep(1)\n"
        "pyautogui.hotkey('ctrl', 's')\n"
        "time.sleep(8)"
    )


def _open_url(url: str) -> str:
    """pyautogui code: the browser's address bar, the URL, Return, and time to load."""
    return (
        f"pyautogui.hotkey('ctrl', 'l')\ntime.sleep(1)\npyautogui.write({url + chr(10)!r})\n"
        "time.sleep(10)"
    )


def _edit_note(key: str, text: str) -> list[Any]:
    """Mousepad, once drawn, in OSWorld's computer_13: ctrl+``key`` (``"end"``: to the end of
    the text), type ``text``, save."""
    return [
        LOOK,
        {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", key]}},
        {"action_type": "TYPING", "parameters": {"text": text}},
        {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "s"]}},
        "time.sleep(2)",
    ]


SOLUTIONS: dict[str, list[Any]] = {
    "~/hello.txt": [
        # OSWorld's computer_13 vocabulary.
        {"action_type": "TYPING", "parameters": {"text": "echo 'hello deskvm' > ~/hello.txt\n"}},
        {"action_type": "WAIT"},
    ],
    "uname -s": [
        # deskvm's own vocabulary.
        {"action": "type", "text": "uname -s > ~/kernel.txt\n"},
        {"action": "wait", "ms": 2000},
    ],
    "report-draft.txt": [_typed("mv ~/report-draft.txt ~/report-final.txt")],
    "clipboard": [_typed("printf 'deskvm clipboard' | xclip -selection clipboard")],
    "people.csv": [
        # Model-style code: a Markdown fence, a loop over constant lines.
        "```python\n"
        "lines = ['name,age', 'alice,30', 'bob,25']\n"
        "pyautogui.write('rm -f ~/people.csv\\n')\n"
        "for line in lines:\n"
        "    pyautogui.write('echo ' + line + ' >> ~/people.csv\\n')\n"
        f"{SETTLE}\n"
        "```"
    ],
    "config.json": [_typed("""echo '{"theme": "dark", "size": 12}' > ~/config.json""")],
    "numbers.txt": [_typed("sort -n ~/numbers.txt > ~/sorted.txt")],
    "~/junk": [_typed("rm ~/junk/*.tmp")],
    "notes-window": [_typed("pkill -f 'xterm -T notes-window'")],
    "sales.xlsx": [_typed("mkdir ~/backup && cp ~/sales.xlsx ~/backup/")],
    # The full image's applications.
    "budget.xlsx": [LOOK, _calc_total("=SUM(B2:B4)")],
    "~/note.txt": _edit_note("end", "checked by deskvm"),
    "allowed.test/colour": [LOOK, _open_url("http://allowed.test/colour/3A7BC8")],
}

MISTAKES: dict[str, list[Any]] = {
    "~/hello.txt": [_typed("echo 'hello deskvm!' > ~/hello.txt")],
    "uname -s": [_typed("uname -r > ~/kernel.txt")],
    "report-draft.txt": [_typed("cp ~/report-draft.txt ~/report-final.txt")],
    "clipboard": [_typed("echo 'deskvm clipboard' | xclip -selection clipboard")],
    "people.csv": [_typed("printf 'name,age\\nbob,25\\nalice,30\\n' > ~/people.csv")],
    "config.json": [_typed("""echo '{"theme": "dark", "size": "12"}' > ~/config.json""")],
    "numbers.txt": [_typed("sort ~/numbers.txt > ~/sorted.txt")],
    "~/junk": [_typed("rm ~/junk/a.tmp")],
    "notes-window": [_typed("true")],
    "sales.xlsx": [_typed("mkdir ~/backup && echo sales > ~/backup/sales.xlsx")],
    "budget.xlsx": [LOOK, _calc_total("=SUM(B2:B3)")],  # one amount short
    "~/note.txt": _edit_note("home", "checked by deskvm\n"),  # at the start, not the end
    "allowed.test/colour": [LOOK, _open_url("http://allowed.test/colour/3A7BC9")],  # a typo
}


class _Scripted:
    script: dict[str, list[Any]]

    def __init__(self) -> None:
        self.acted = False

    def reset(self) -> None:
        self.acted = False

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[Any]]:
        if self.acted:
            return "done", ["DONE"]
        self.acted = True
        for phrase, actions in self.script.items():
            if phrase in instruction:
                return f"solving: {phrase}", [*actions, "DONE"]
        return "no idea", ["FAIL"]


class SolvingAgent(_Scripted):
    """Solves every example task."""

    script = SOLUTIONS


class FailingAgent(_Scripted):
    """Gets every example task slightly wrong."""

    script = MISTAKES
