"""OSWorld pyautogui code strings: parsed with ast into deskvm actions, never executed."""

from __future__ import annotations

import pytest

from agent_bridge.protocol.actions import (
    Action,
    Button,
    Click,
    HoldKey,
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
from agent_bridge.protocol.results import Done, ImageResult
from agent_bridge.protocol.vocab import PyAutoGUIVocabulary, get_vocabulary, parse_pyautogui
from orchestrator.errors import ActionError, ProtocolError

SHOT = Screenshot()
V = get_vocabulary("pyautogui")


def k(*qcodes: str) -> KeyCombo:
    return KeyCombo(qcodes)


CASES: list[tuple[str, tuple[Action, ...]]] = [
    ("pyautogui.click(10, 20)", (Click(10, 20),)),
    ("pyautogui.click(x=10, y=20)", (Click(10, 20),)),
    ("pyautogui.click((10, 20))", (Click(10, 20),)),
    ("pyautogui.click()", (Click(None, None),)),
    ("pyautogui.click(10.6, 20.4)", (Click(11, 20),)),
    ("pyautogui.click(10, 20, clicks=2)", (Click(10, 20, count=2),)),
    ("pyautogui.click(10, 20, button='right')", (Click(10, 20, Button.RIGHT),)),
    ("pyautogui.click(10, 20, 1, 0.0, 'middle')", (Click(10, 20, Button.MIDDLE),)),
    ("pyautogui.click(10, 20, button='secondary', duration=0.5)", (Click(10, 20, Button.RIGHT),)),
    ("pyautogui.doubleClick(5, 6)", (Click(5, 6, count=2),)),
    ("pyautogui.tripleClick(5, 6)", (Click(5, 6, count=3),)),
    ("pyautogui.rightClick(5, 6)", (Click(5, 6, Button.RIGHT),)),
    ("pyautogui.middleClick()", (Click(None, None, Button.MIDDLE),)),
    ("pyautogui.moveTo(100, 200, duration=0.3)", (Move(100, 200),)),
    (
        "pyautogui.dragTo(300, 400, duration=1, button='left')",
        (MouseDown(Button.LEFT), Move(300, 400), MouseUp(Button.LEFT, 300, 400)),
    ),
    ("pyautogui.mouseDown()", (MouseDown(Button.LEFT),)),
    ("pyautogui.mouseDown(1, 2, button='right')", (MouseDown(Button.RIGHT, 1, 2),)),
    ("pyautogui.mouseUp(x=1, y=2)", (MouseUp(Button.LEFT, 1, 2),)),
    # pyautogui signs: scroll(+n) scrolls up, hscroll(+n) scrolls right.
    ("pyautogui.scroll(5)", (Scroll(None, None, dy=-5),)),
    ("pyautogui.scroll(-20, x=10, y=20)", (Scroll(10, 20, dy=20),)),
    ("pyautogui.vscroll(1)", (Scroll(None, None, dy=-1),)),
    ("pyautogui.hscroll(3)", (Scroll(None, None, dx=3),)),
    ("pyautogui.hscroll(-3)", (Scroll(None, None, dx=-3),)),
    ("pyautogui.typewrite('hello world')", (Type("hello world"),)),
    ("pyautogui.write('a\\nb', interval=0.05)", (Type("a\nb"),)),
    ("pyautogui.typewrite(['a', 'enter'])", (Key((k("a"), k("ret"))),)),
    ("pyautogui.press('enter')", (Key((k("ret"),)),)),
    ("pyautogui.press('tab', presses=3)", (Key((k("tab"),) * 3),)),
    ("pyautogui.press(['up', 'down'])", (Key((k("up"), k("down"))),)),
    ("pyautogui.hotkey('ctrl', 'c')", (Key((k("ctrl", "c"),)),)),
    ("pyautogui.hotkey('ctrl', 'shift', 't', interval=0.1)", (Key((k("ctrl", "shift", "t"),)),)),
    ("pyautogui.hotkey(['alt', 'f4'])", (Key((k("alt", "f4"),)),)),
    ("time.sleep(0.5)", (Wait(500),)),
    ("time.sleep(2)", (Wait(2000),)),
    # keyDown marks keys held: they are held for what follows, never latched.
    (
        "pyautogui.keyDown('shift'); pyautogui.click(1, 2); pyautogui.keyUp('shift')",
        (Click(1, 2, hold=k("shift")),),
    ),
    (
        "pyautogui.keyDown('ctrl')\npyautogui.press('c')\npyautogui.keyUp('ctrl')",
        (Key((k("ctrl", "c"),)),),
    ),
    (
        "pyautogui.keyDown('ctrl'); pyautogui.keyDown('c'); pyautogui.keyUp('c'); "
        "pyautogui.keyUp('ctrl')",
        (Key((k("ctrl", "c"),)),),
    ),
    (
        "pyautogui.keyDown('w'); time.sleep(2); pyautogui.keyUp('w')",
        (HoldKey(k("w"), 2000),),
    ),
    (
        "pyautogui.keyDown('ctrl'); pyautogui.scroll(1)",
        (Scroll(None, None, dy=-1, hold=k("ctrl")),),
    ),
    ("pyautogui.keyDown('shift')", ()),
    ("pyautogui.keyUp('shift')", ()),
    # What OSWorld agents actually write.
    (
        "import pyautogui\nimport time\n\npyautogui.click(960, 540)  # the icon\n"
        "time.sleep(0.5)\npyautogui.typewrite('Spotify')\npyautogui.press('enter')\n",
        (Click(960, 540), Wait(500), Type("Spotify"), Key((k("ret"),))),
    ),
    ("import pyautogui, time; pyautogui.rightClick()", (Click(None, None, Button.RIGHT),)),
    ("", ()),
    ("# nothing to do", ()),
]


@pytest.mark.parametrize(("code", "expected"), CASES)
def test_whitelisted_code(code: str, expected: tuple[Action, ...]) -> None:
    assert parse_pyautogui(code) == expected
    assert V.parse({"code": code}) == (*expected, SHOT)


@pytest.mark.parametrize(
    ("code", "expected"),
    [("WAIT", (Wait(2000),)), ("DONE", ()), ("FAIL", ()), ("  DONE\n", ())],
)
def test_special_strings(code: str, expected: tuple[Action, ...]) -> None:
    assert parse_pyautogui(code) == expected
    assert V.parse({"code": code}) == (*expected, SHOT)


def test_results_end_the_episode_on_done_and_fail() -> None:
    image = ImageResult(1, 1, "image/png", b"png")
    assert V.format_result({"code": "DONE"}, [image]) == {
        "observation": {"screenshot": "cG5n"},
        "done": True,
        "info": {"done": True},
    }
    assert V.format_result({"code": "FAIL"}, [image])["info"] == {"fail": True}
    assert V.format_result({"code": "pyautogui.click()"}, [Done(), image])["done"] is False


def test_without_screenshot_after_action() -> None:
    vocab = PyAutoGUIVocabulary(screenshot_after_action=False)
    assert vocab.parse({"code": "pyautogui.click(1, 2)"}) == (Click(1, 2),)
    assert vocab.parse({"code": "DONE"}) == (SHOT,)


# Code that tries to do anything but the whitelisted calls: refused, naming what was refused.
ESCAPES: list[tuple[str, str]] = [
    ("__import__('os').system('id')", "only pyautogui"),
    ("__import__('os')", "a name `__import__`"),
    ("pyautogui.__dict__", "attribute access `pyautogui.__dict__`"),
    ("pyautogui.__dict__['click'](1, 2)", "a subscript"),
    ("pyautogui.click.__globals__", "attribute access"),
    ("pyautogui.os.system('id')", "pyautogui.os.system"),
    ("open('/etc/passwd')", "a name `open`"),
    ("exec('print(1)')", "a name `exec`"),
    ("eval('1')", "a name `eval`"),
    ("getattr(pyautogui, 'click')(1, 2)", "a call `getattr(pyautogui, 'click')`"),
    ("(lambda: 1)()", "a lambda"),
    ("pyautogui.click(*(lambda: (1, 2))())", "a call"),
    ("pyautogui.click(*'ab')", "*-unpacking needs a list"),
    ("pyautogui.typewrite(f\"{open('/etc/passwd').read()}\")", "an f-string"),
    ("pyautogui.typewrite(f'{1}')", "an f-string"),
    ("pyautogui.click(x)", "a name `x`"),
    ("pyautogui.click(1 ** 2, 3)", "an operator expression"),
    ("pyautogui.typewrite(''.join(['a']))", "a call"),
    ("pyautogui.typewrite([c for c in 'ab'])", "a comprehension"),
    ("pyautogui.typewrite(open('x').read())", "a call"),
    ("pyautogui.click(**{'x': 1})", "**-unpacking"),
    ("pyautogui.click(pyautogui.size()[0], 1)", "a subscript"),
    ("import os", "import of 'os'"),
    ("import subprocess; subprocess.run(['id'])", "import of 'subprocess'"),
    ("import pyautogui as p", "import of 'pyautogui'"),
    ("from os import system", "from-imports"),
    ("os.system('id')", "module 'os'"),
    ("x = open('x')", "a call `open('x')`"),
    ("pyautogui.FAILSAFE = 'no'", "pyautogui.FAILSAFE must be True or False"),
    ("pyautogui.MINIMUM_DURATION = 0", "only pyautogui.PAUSE and pyautogui.FAILSAFE"),
    ("def f():\n    pass", "FunctionDef"),
    ("for i in range(3000):\n    pyautogui.click()", "runs 3000 times"),
    ("while True:\n    pass", "While"),
    ("with open('x') as f:\n    pass", "With"),
    ("try:\n    pass\nexcept Exception:\n    pass", "Try"),
    ("if True:\n    pyautogui.click()", "If"),
    ("class A: pass", "ClassDef"),
    ("del pyautogui", "Delete"),
    ("global x", "Global"),
    ("'just a string'", "only calls"),
    ("DONE\npyautogui.click()", "`DONE` (line 1) ends the episode"),
    ("pyautogui.click(b'1', 2)", "literal"),
    ("pyautogui.click({1, 2})", "a set"),
    ("pyautogui.click({'x': 1})", "a dict"),
    ("pyautogui.click(1 if True else 2, 3)", "a conditional expression"),
    ("pyautogui.click((y := 1), 2)", "an assignment expression"),
    ("[pyautogui.click() for _ in range(9)]", "only calls"),
    ("pyautogui.typewrite([[[['a']]]])", "literal"),
]


@pytest.mark.parametrize(("code", "needle"), ESCAPES)
def test_escapes_are_refused(code: str, needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_pyautogui(code)
    assert info.value.code == "refused_code"
    assert info.value.message.startswith("refused ")
    assert needle in info.value.message


def test_refusal_names_the_line() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_pyautogui("pyautogui.click(1, 2)\ntime.sleep(1)\nopen('x')")
    assert "(line 3)" in info.value.message


def test_nothing_is_executed(monkeypatch: pytest.MonkeyPatch) -> None:
    import ast as ast_module
    import builtins
    import inspect

    from agent_bridge.protocol.vocab import pyautogui as module

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("executed!")

    code = "pyautogui.click(1, 2); pyautogui.typewrite('x'); time.sleep(1)"
    with monkeypatch.context() as patch:
        for name in ("eval", "exec"):
            patch.setattr(builtins, name, boom)
        patch.setattr(ast_module, "literal_eval", boom)
        actions = parse_pyautogui(code)
    assert actions == (Click(1, 2), Type("x"), Wait(1000))
    source = inspect.getsource(module)
    for forbidden in ("eval(", "exec(", "compile(", "__import__(", "importlib"):
        assert forbidden not in source


@pytest.mark.parametrize(
    "name",
    ["pyautogui.screenshot", "pyautogui.moveRel", "pyautogui.position", "time.time"],
)
def test_other_functions_of_the_modules_are_unknown_actions(name: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_pyautogui(f"{name}()")
    assert info.value.code == "unknown_action"
    assert "supported: pyautogui.click" in info.value.message
    assert "time.sleep, WAIT, DONE, FAIL" in info.value.message


@pytest.mark.parametrize(
    "code",
    [
        "pyautogui.click(",
        "pyautogui.click(1, 2",
        "def",
        "pyautogui.click(1)\x00",
        "pyautogui.click(1, 2)\n    pyautogui.click(3, 4)",
    ],
)
def test_invalid_python(code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_pyautogui(code)
    assert info.value.code == "invalid_code"


def test_deep_nesting_is_invalid_not_a_crash() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_pyautogui("pyautogui.click(" + "(" * 5000 + "1" + ")" * 5000 + ")")
    assert info.value.code in ("invalid_code", "refused_code")


def test_code_size_is_limited() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_pyautogui("#" * 100_001)
    assert info.value.code == "invalid_code"


BAD: list[tuple[str, str, str]] = [
    ("pyautogui.click(1)", "missing_parameter", "both x and y"),
    ("pyautogui.click((1, 2, 3))", "invalid_action", "(x, y)"),
    ("pyautogui.click('a', 2)", "invalid_action", "'x'"),
    ("pyautogui.click(1, 2, clicks=4)", "invalid_action", "clicks"),
    ("pyautogui.click(1, 2, button='left2')", "invalid_action", "button"),
    ("pyautogui.click(1, 2, speed=3)", "invalid_action", "unexpected keyword argument 'speed'"),
    ("pyautogui.click(1, 2, x=3)", "invalid_action", "multiple values"),
    ("pyautogui.click(1, 2, 1, 0, 'left', 0, None, True, 9)", "invalid_action", "positional"),
    ("pyautogui.click(1, 2, interval='slow')", "invalid_action", "interval"),
    ("pyautogui.moveTo()", "missing_parameter", "x and y"),
    ("pyautogui.scroll()", "missing_parameter", "clicks"),
    ("pyautogui.scroll(2.5)", "invalid_action", "whole number"),
    ("pyautogui.scroll(500)", "invalid_action", "-100..100"),
    ("pyautogui.typewrite()", "missing_parameter", "message"),
    ("pyautogui.typewrite(5)", "invalid_action", "message"),
    ("pyautogui.press()", "missing_parameter", "keys"),
    ("pyautogui.press('hyperspace')", "unknown_key", "hyperspace"),
    ("pyautogui.press('a', presses=0)", "invalid_action", "presses"),
    ("pyautogui.hotkey()", "invalid_action", "strings"),
    ("pyautogui.hotkey('ctrl', 1)", "invalid_action", "strings"),
    ("pyautogui.hotkey('ctrl', 'c', speed=1)", "invalid_action", "speed"),
    ("pyautogui.keyDown(5)", "invalid_action", "key"),
    ("time.sleep('1')", "invalid_action", "secs"),
    ("time.sleep(61)", "invalid_action", "seconds"),
    ("time.sleep(-1)", "invalid_action", "seconds"),
    ("pyautogui.typewrite('Ñandú', interval=0)", "untypeable_text", ""),
    ("pyautogui.keyDown('shift'); pyautogui.typewrite('abc')", "unsupported_parameter", "shift"),
    ("pyautogui.keyDown('shift'); pyautogui.moveTo(1, 2)", "unsupported_parameter", "moveTo"),
    ("pyautogui.keyDown('shift'); pyautogui.dragTo(1, 2)", "unsupported_parameter", "dragTo"),
    ("pyautogui.press('a', presses=100); pyautogui.click()\n" * 101, "invalid_action", "200"),
]


@pytest.mark.parametrize(("code", "err_code", "needle"), BAD)
def test_bad_arguments_give_structured_errors(code: str, err_code: str, needle: str) -> None:
    if err_code == "untypeable_text":
        # Typing is checked against the keyboard when typed (the session may have a helper
        # for text without keys); parsing accepts any text.
        assert parse_pyautogui(code) == (Type("Ñandú"),)
        return
    with pytest.raises(ActionError) as info:
        parse_pyautogui(code)
    assert info.value.code == err_code
    assert needle in info.value.message


@pytest.mark.parametrize("body", [{}, {"code": None}, {"code": 5}])
def test_body_needs_a_code_string(body: dict[str, object]) -> None:
    with pytest.raises(ActionError) as info:
        V.parse(body)
    assert info.value.code in ("missing_parameter", "invalid_action")
