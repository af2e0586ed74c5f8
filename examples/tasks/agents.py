"""Scripted agents for the example tasks (``deskvm task run examples/tasks --agent ...``).

Both have OSWorld's agent shape (``predict(instruction, obs) -> (response, actions)``) and
act only through the desktop: they type shell commands into the focused xterm (each task's
setup focuses it), in the three vocabularies ``DesktopEnv.step`` takes (pyautogui code,
OSWorld's computer_13, deskvm's own), then say ``DONE``.

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
