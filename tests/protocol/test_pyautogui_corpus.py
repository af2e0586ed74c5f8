"""pyautogui code as models really write it: a corpus of answers, accepted and refused.

Each accepted answer is parsed (never run) into the exact deskvm actions and the episode
end it means; each refused one names what was refused and on which line of the text as
sent. The answers are written for this test in the shapes OSWorld-style agents produce:
prose around Markdown fences, code indented as a block, constants in names, bounded
loops, OSWorld's WAIT/DONE/FAIL.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_bridge.protocol.actions import (
    Action,
    Button,
    Click,
    Key,
    MouseDown,
    MouseUp,
    Move,
    Screenshot,
    Scroll,
    Type,
    Wait,
)
from agent_bridge.protocol.keys import KeyCombo
from agent_bridge.protocol.results import ImageResult
from agent_bridge.protocol.vocab import get_vocabulary
from agent_bridge.protocol.vocab.pyautogui import (
    MAX_LOOP_ITERATIONS,
    extract_code,
    parse_pyautogui_program,
)
from orchestrator.errors import ActionError, ProtocolError


def k(*qcodes: str) -> KeyCombo:
    return KeyCombo(qcodes)


DOWN = Key((k("down"),))
ENTER = Key((k("ret"),))

# (name, answer as the model wrote it, actions, terminal)
ACCEPTED: list[tuple[str, str, tuple[Action, ...], str | None]] = [
    (
        "prose and a python fence",
        "I'll open the terminal from the dock first.\n"
        "```python\n"
        "import pyautogui\n"
        "import time\n"
        "pyautogui.click(35, 512)\n"
        "time.sleep(1)\n"
        "```\n",
        (Click(35, 512), Wait(1000)),
        None,
    ),
    (
        "tuple assignment used later",
        "x, y = 640, 400\npyautogui.click(x, y)\n",
        (Click(640, 400),),
        None,
    ),
    (
        "centre of a bounding box",
        "# The Save button spans (820, 610) to (900, 640)\n"
        "left, top, right, bottom = 820, 610, 900, 640\n"
        "center_x = (left + right) / 2\n"
        "center_y = (top + bottom) / 2\n"
        "pyautogui.click(center_x, center_y)\n",
        (Click(860, 625),),
        None,
    ),
    (
        "one-line loop",
        "for _ in range(3): pyautogui.press('down')",
        (DOWN, DOWN, DOWN),
        None,
    ),
    (
        "loop with a sleep",
        "for i in range(2):\n    pyautogui.scroll(-3)\n    time.sleep(0.2)\n",
        (Scroll(None, None, dy=3), Wait(200), Scroll(None, None, dy=3), Wait(200)),
        None,
    ),
    (
        "code indented as a block",
        "    import pyautogui\n    pyautogui.hotkey('ctrl', 'alt', 't')\n    time.sleep(2)\n",
        (Key((k("ctrl", "alt", "t"),)), Wait(2000)),
        None,
    ),
    (
        "tab-indented block",
        "\tpyautogui.click(10, 20)\n\tpyautogui.press('enter')\n",
        (Click(10, 20), ENTER),
        None,
    ),
    ("WAIT in a one-line fence", "```WAIT```", (Wait(2000),), None),
    ("DONE in a fence", "The file is saved.\n```\nDONE\n```\n", (), "DONE"),
    (
        "FAIL with an explanation",
        "There is no such setting in this application, so the task is infeasible.\n```\nFAIL\n```",
        (),
        "FAIL",
    ),
    (
        "code then DONE in its own fence",
        "```python\npyautogui.typewrite('ls -la\\n', interval=0.05)\n```\n```DONE```\n",
        (Type("ls -la\n"),),
        "DONE",
    ),
    (
        "two fences with prose between",
        "First open the File menu:\n"
        "```python\n"
        "pyautogui.hotkey('alt', 'f')\n"
        "```\n"
        "Then choose Save As:\n"
        "```python\n"
        "pyautogui.press('a')\n"
        "```\n",
        (Key((k("alt", "f"),)), Key((k("a"),))),
        None,
    ),
    (
        "loop over a list of points",
        "points = [(100, 200), (300, 400), (500, 600)]\n"
        "for px, py in points:\n"
        "    pyautogui.click(px, py)\n",
        (Click(100, 200), Click(300, 400), Click(500, 600)),
        None,
    ),
    (
        "indexing a tuple",
        "coords = (512, 384)\npyautogui.doubleClick(coords[0], coords[1])\n",
        (Click(512, 384, count=2),),
        None,
    ),
    (
        "star-unpacking a point",
        "target = (512, 384)\npyautogui.moveTo(*target, duration=0.5)\n",
        (Move(512, 384),),
        None,
    ),
    (
        "augmented assignment in a loop",
        "y = 200\nfor _ in range(3):\n    pyautogui.click(100, y)\n    y += 40\n",
        (Click(100, 200), Click(100, 240), Click(100, 280)),
        None,
    ),
    (
        "int() of scaled coordinates",
        "pyautogui.click(int(1280 * 0.5), int(800 * 0.25))",
        (Click(640, 200),),
        None,
    ),
    (
        "text in a variable",
        'text = "Hello, world!"\npyautogui.write(text)\npyautogui.press("enter")\n',
        (Type("Hello, world!"), ENTER),
        None,
    ),
    (
        "string concatenation",
        "name = 'report'\npyautogui.typewrite(name + '.txt')\n",
        (Type("report.txt"),),
        None,
    ),
    (
        "PAUSE and FAILSAFE settings",
        "import pyautogui\npyautogui.FAILSAFE = False\npyautogui.PAUSE = 0.5\n"
        "pyautogui.press('enter')\n",
        (ENTER,),
        None,
    ),
    (
        "CRLF line endings",
        "```python\r\nx = 5\r\npyautogui.click(x, x)\r\n```\r\n",
        (Click(5, 5),),
        None,
    ),
    ("py fence", "```py\npyautogui.rightClick(7, 8)\n```", (Click(7, 8, Button.RIGHT),), None),
    (
        "python3 fence",
        "```python3\npyautogui.middleClick()\n```",
        (Click(None, None, Button.MIDDLE),),
        None,
    ),
    (
        "semicolons on one line",
        "import pyautogui; pyautogui.click(10, 10); pyautogui.write('abc')",
        (Click(10, 10), Type("abc")),
        None,
    ),
    (
        "comments and blank lines",
        "# Step 1: focus the search box\n\npyautogui.click(960, 60)  # search\n\n"
        "# Step 2: search\npyautogui.typewrite('weather')\npyautogui.press('enter')\n",
        (Click(960, 60), Type("weather"), ENTER),
        None,
    ),
    (
        "a grid of clicks (nested loops)",
        "for row in range(2):\n"
        "    for col in range(3):\n"
        "        pyautogui.click(100 + col * 50, 200 + row * 30)\n",
        tuple(Click(100 + c * 50, 200 + r * 30) for r in range(2) for c in range(3)),
        None,
    ),
    (
        "loop over a string",
        "for ch in 'ab1':\n    pyautogui.press(ch)\n",
        (Key((k("a"),)), Key((k("b"),)), Key((k("1"),))),
        None,
    ),
    (
        "a cut-off answer (fence never closed)",
        "Clicking the OK button.\n```python\npyautogui.click(1, 2)\n",
        (Click(1, 2),),
        None,
    ),
    (
        "DONE as the last line of code",
        "pyautogui.hotkey('ctrl', 's')\ntime.sleep(1)\nDONE\n",
        (Key((k("ctrl", "s"),)), Wait(1000)),
        "DONE",
    ),
    (
        "drag with computed target",
        "start_x, start_y = 200, 300\n"
        "pyautogui.moveTo(start_x, start_y)\n"
        "pyautogui.dragTo(start_x + 150, start_y, duration=0.5, button='left')\n",
        (Move(200, 300), MouseDown(Button.LEFT), Move(350, 300), MouseUp(Button.LEFT, 350, 300)),
        None,
    ),
    (
        "round() of fractional coordinates",
        "pyautogui.click(round(100.6), round(200.4))",
        (Click(101, 200),),
        None,
    ),
    (
        "shift+tab in a loop",
        "for _ in range(2):\n"
        "    pyautogui.keyDown('shift')\n"
        "    pyautogui.press('tab')\n"
        "    pyautogui.keyUp('shift')\n",
        (Key((k("shift", "tab"),)), Key((k("shift", "tab"),))),
        None,
    ),
    ("pass", "pass\npyautogui.click(3, 4)", (Click(3, 4),), None),
    (
        "WAIT between actions",
        "pyautogui.press('enter')\nWAIT\npyautogui.press('enter')",
        (ENTER, Wait(2000), ENTER),
        None,
    ),
    ("chained assignment", "a = b = 5\npyautogui.click(a, b)", (Click(5, 5),), None),
    (
        "min/max/abs of numbers",
        "pyautogui.click(min(5000, 1279), max(-3, abs(-12)))",
        (Click(1279, 12),),
        None,
    ),
    (
        "negative index and floor division",
        "xs = [10, 20, 30]\npyautogui.click(xs[-1] // 7, 90 % 7)",
        (Click(4, 6),),
        None,
    ),
    (
        "range with start, stop and step",
        "for x in range(100, 400, 100):\n    pyautogui.click(x, 50)\n",
        (Click(100, 50), Click(200, 50), Click(300, 50)),
        None,
    ),
    (
        "keyword arguments from names",
        "x = 12\ny = 34\nclicks = 2\npyautogui.click(x=x, y=y, clicks=clicks, button='left')",
        (Click(12, 34, count=2),),
        None,
    ),
    (
        "indented code inside a fence",
        "```python\n    pyautogui.press('f5')\n    time.sleep(0.5)\n```",
        (Key((k("f5"),)), Wait(500)),
        None,
    ),
]


@pytest.mark.parametrize(
    ("answer", "actions", "terminal"),
    [pytest.param(a, b, c, id=name) for name, a, b, c in ACCEPTED],
)
def test_accepted_answers(answer: str, actions: tuple[Action, ...], terminal: str | None) -> None:
    program = parse_pyautogui_program(answer)
    assert program.actions == actions
    assert program.terminal == terminal


def test_the_vocabulary_ends_the_episode_for_code_ending_in_done() -> None:
    vocab = get_vocabulary("pyautogui")
    body = {"code": "```python\npyautogui.press('enter')\n```\n```DONE```"}
    assert vocab.parse(body) == (ENTER, Screenshot())
    image = ImageResult(1, 1, "image/png", b"png")
    result = vocab.format_result(body, [image])
    assert result["done"] is True and result["info"] == {"done": True}


# (name, answer, error code, text the message must hold)
REFUSED: list[tuple[str, str, str, str]] = [
    (
        "screen size",
        "screen_width, screen_height = pyautogui.size()\n"
        "pyautogui.click(screen_width / 2, screen_height / 2)",
        "refused_code",
        "pyautogui.size() has a value only on a running screen",
    ),
    (
        "pointer position",
        "x, y = pyautogui.position()\npyautogui.click(x + 10, y)",
        "refused_code",
        "pyautogui.position()",
    ),
    ("while loop", "while True:\n    pyautogui.press('down')", "refused_code", "While"),
    (
        "condition on the screen",
        "if pyautogui.locateOnScreen('ok.png'):\n    pyautogui.click()",
        "refused_code",
        "If",
    ),
    (
        "loop too long",
        "for i in range(100):\n    pyautogui.press('down')",
        "refused_code",
        f"the loop runs 100 times; at most {MAX_LOOP_ITERATIONS}",
    ),
    ("import os", "import os\nos.system('rm -rf ~')", "refused_code", "(line 1): import of 'os'"),
    (
        "import in a fence: line of the text as sent",
        "Let me check the files.\n```python\nimport subprocess\n```",
        "refused_code",
        "(line 3)",
    ),
    (
        "a bash fence",
        "Run this in the terminal:\n```bash\nxdotool key ctrl+s\n```",
        "refused_code",
        "```bash code block (line 2)",
    ),
    (
        "import as",
        "import pyautogui as pg\npg.click(1, 2)",
        "refused_code",
        "import of 'pyautogui'",
    ),
    ("from-import", "from pyautogui import click\nclick(1, 2)", "refused_code", "from-imports"),
    (
        "function definition",
        "def click_center():\n    pyautogui.click(640, 400)\nclick_center()",
        "refused_code",
        "FunctionDef",
    ),
    ("with open", "with open('/tmp/x') as f:\n    pass", "refused_code", "With"),
    ("f-string", "user = 'me'\npyautogui.typewrite(f'{user}')", "refused_code", "an f-string"),
    ("reading a file", "text = open('/etc/passwd').read()", "refused_code", "a call"),
    ("print", "print('Clicking')\npyautogui.click(1, 2)", "refused_code", "a name `print`"),
    ("power", "n = 10 ** 9", "refused_code", "an operator expression `10 ** 9`"),
    ("string repetition", "s = 'a' * 100000", "refused_code", "arithmetic needs two numbers"),
    ("unassigned names", "pyautogui.click(x, y)", "refused_code", "a name `x`"),
    ("division by zero", "x = 1 / 0", "refused_code", "division by zero"),
    (
        "loops nested three deep",
        "for _ in range(2):\n    for _ in range(2):\n        for _ in range(2):\n"
        "            pyautogui.press('a')",
        "refused_code",
        "nested at most 2 deep",
    ),
    (
        "break",
        "for _ in range(3):\n    pyautogui.press('a')\n    break",
        "refused_code",
        "break and continue",
    ),
    ("DONE in a loop", "for _ in range(3):\n    DONE", "refused_code", "cannot be inside a loop"),
    (
        "code after DONE",
        "```DONE```\n```python\npyautogui.click()\n```",
        "refused_code",
        "`DONE` (line 1) ends the episode; nothing may follow it",
    ),
    ("shadowing the module", "pyautogui = None", "refused_code", "`pyautogui` cannot be assigned"),
    ("comprehension", "xs = [i for i in range(3)]", "refused_code", "a comprehension"),
    (
        "try/except",
        "try:\n    pyautogui.click()\nexcept Exception:\n    pass",
        "refused_code",
        "Try",
    ),
    ("exec of a string", "exec('pyautogui.click(1, 2)')", "refused_code", "a name `exec`"),
    ("lambda", "click = lambda: pyautogui.click()", "refused_code", "a lambda"),
    (
        "patching time",
        "time.sleep = None",
        "refused_code",
        "only pyautogui.PAUSE and pyautogui.FAILSAFE",
    ),
    (
        "attribute of a call",
        "pyautogui.click(x=pyautogui.size().width // 2, y=10)",
        "refused_code",
        "attribute access",
    ),
    ("number too large", "x = 9007199254740993", "refused_code", "within -2**53..2**53"),
    ("annotated assignment", "x: int = 5", "refused_code", "AnnAssign"),
    ("slice", "text = 'hello world'\npyautogui.write(text[0:5])", "refused_code", "slices"),
    (
        "range from a call",
        "for i in range(len('abc')):\n    pyautogui.press('a')",
        "refused_code",
        "a call `len('abc')`",
    ),
    ("unpacking mismatch", "x, y = 1, 2, 3", "refused_code", "cannot unpack"),
    ("loop over a dict", "for k in {'a': 1}:\n    pass", "refused_code", "a dict"),
    ("for-else", "for _ in range(2):\n    pass\nelse:\n    pass", "refused_code", "for-else"),
    ("unknown pyautogui call", "pyautogui.moveRel(10, 0)", "unknown_action", "pyautogui.moveRel"),
    (
        "sleeps adding up",
        "for _ in range(40):\n    time.sleep(5)",
        "invalid_action",
        "add up to more than 120 s",
    ),
    (
        "too many actions from a loop",
        "for _ in range(50):\n    for _ in range(50):\n        pyautogui.press('a')",
        "invalid_action",
        "more than 200 actions",
    ),
    ("not python", "Click the OK button at (10, 20).", "invalid_code", "not valid Python"),
]


@pytest.mark.parametrize(
    ("answer", "code", "needle"),
    [pytest.param(a, b, c, id=name) for name, a, b, c in REFUSED],
)
def test_refused_answers(answer: str, code: str, needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_pyautogui_program(answer)
    assert info.value.code == code
    assert needle in info.value.message
    if code == "refused_code":
        assert info.value.message.startswith("refused ")
    if code == "invalid_action":
        assert isinstance(info.value, ActionError)


def test_corpus_size() -> None:
    assert len(ACCEPTED) >= 25 and len(REFUSED) >= 25


def test_extract_code_keeps_line_numbers() -> None:
    answer = "Thinking...\n```python\n    a = 1\n    b = 2\n```\nmore prose\n"
    assert extract_code(answer).split("\n") == ["", "", "a = 1", "b = 2", "", "", ""]


def test_statement_budget_is_enforced() -> None:
    # 50 x 40 loop iterations of assignments only: no actions, but 2000+ statements.
    answer = "for _ in range(50):\n    for _ in range(41):\n        x = 1"
    with pytest.raises(ProtocolError) as info:
        parse_pyautogui_program(answer)
    assert info.value.code == "refused_code"
    assert "more than 2000 statements" in info.value.message


_TOKENS = [
    "pyautogui.click(", "pyautogui.press(", "time.sleep(", "x", "y", " = ", ", ", ")", "(",
    "[", "]", "1", "0", "-2", "0.5", "'a'", " + ", " * ", " / ", " // ", " % ", "\n",
    "for _ in range(", "):\n    ", "```python\n", "```\n", "DONE", "WAIT", "int(", "round(",
    "*", "x, y", "[0]", "    ", "import pyautogui\n", "pyautogui.PAUSE = ", "True", "None",
]  # fmt: skip


@given(st.lists(st.sampled_from(_TOKENS), max_size=40).map("".join))
@settings(max_examples=400, deadline=None)
def test_token_soup_only_ever_gives_structured_errors(answer: str) -> None:
    try:
        program = parse_pyautogui_program(answer)
    except ProtocolError as exc:  # ActionError included
        assert exc.code
        return
    assert len(program.actions) <= 200


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_any_text_only_ever_gives_structured_errors(answer: str) -> None:
    try:
        parse_pyautogui_program(answer)
    except ProtocolError as exc:
        assert exc.code
