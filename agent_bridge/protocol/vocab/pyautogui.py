"""``schema=pyautogui``: OSWorld's pyautogui action strings, parsed with :mod:`ast`, never run.

A request body is ``{"code": "<python source>"}`` as OSWorld's pyautogui agents write it
(``pyautogui.click(10, 20); time.sleep(0.5); pyautogui.write('hi')``), or one of the
special strings ``WAIT`` (pause 2 s), ``DONE`` and ``FAIL`` (end the episode).

The source is parsed, never executed (no ``eval``, ``exec``, ``compile`` to bytecode or
``literal_eval``): this module walks the syntax tree itself and knows the value of every
name because only constants can be assigned. What it accepts, besides the whitelisted
calls below:

- **The text around the code.** Code in Markdown fences (```` ```python ```` ... ```` ``` ````,
  language ``python``/``py``/``python3``/``pyautogui`` or none; several fences are
  joined in order; an unclosed last fence runs to the end) with the model's prose
  around them ignored; a fence in another language (```` ```bash ````) is refused. Code
  indented as a block has its common indentation removed. Line numbers in errors are
  those of the text as sent.
- **Imports** ``import pyautogui`` / ``import time`` (no-ops).
- **Constants in names.** ``x = 640``, ``x, y = 640, 400``, ``a = b = 3``, ``x += 10``,
  then ``pyautogui.click(x, y)``. Values: numbers, strings, booleans, ``None`` and
  lists/tuples of those (nesting depth 3), names assigned earlier, ``seq[i]`` with a whole
  number index, ``*seq`` in a call's arguments, and constant arithmetic: ``+ - * / // %``
  and unary ``-``/``+`` on numbers, ``+`` of two strings, ``int()``, ``float()``,
  ``round()``, ``abs()``, ``min()``, ``max()`` of numbers. Every number stays within
  ±2**53 and finite, every string within ``MAX_TEXT_CHARS``. The names ``pyautogui`` and
  ``time`` cannot be assigned. ``pyautogui.PAUSE = <number>`` and ``pyautogui.FAILSAFE =
  <bool>`` are accepted and ignored (deskvm paces input itself and has no fail-safe corner).
- **Bounded loops.** ``for i in range(...)`` with constant whole-number arguments, or over
  a constant list, tuple or string; at most ``MAX_LOOP_ITERATIONS`` (50) iterations per
  loop and ``MAX_LOOP_DEPTH`` (2) loops nested; no ``else``, ``break`` or ``continue``.
  ``pass`` is accepted.
- **OSWorld's special strings as statements.** A line ``WAIT`` pauses 2 s; ``DONE`` or
  ``FAIL`` as the last statement (outside loops) ends the episode after the actions before
  it; in fences as OSWorld agents write them (```` ```DONE``` ````).

Limits over the whole code: at most ``MAX_SCRIPT_ACTIONS`` (200) actions,
``MAX_STATEMENTS_RUN`` (2000) statements executed (loop bodies count each time), sleeps
and waits adding up to at most ``MAX_CODE_WAIT_MS`` (120 s).

Everything else is refused with a ``ProtocolError`` (code ``refused_code``) naming what
was refused and its line: other imports, names never assigned, attribute access beyond
``pyautogui.<call>`` / ``time.sleep``, calls of anything else (``pyautogui.size()`` and
``pyautogui.position()`` too: their values exist only on a running screen), f-strings,
lambdas, comprehensions, conditions (``if``, ``while``), functions, classes, ``with``,
``try``, ``**``, bitwise operators, string repetition or formatting, ``**kwargs``.

Whitelisted calls, with pyautogui's parameter names: ``click(x, y, clicks, interval,
button, duration)``, ``doubleClick``, ``tripleClick``, ``rightClick``, ``middleClick``,
``moveTo(x, y, duration)``, ``dragTo(x, y, duration, button)`` (from the pointer),
``mouseDown(x, y, button)``, ``mouseUp``, ``scroll(clicks, x, y)`` / ``vscroll`` (positive
scrolls *up*), ``hscroll(clicks, x, y)`` (positive scrolls right), ``typewrite(message,
interval)`` / ``write`` (a list message presses those keys), ``press(keys, presses,
interval)``, ``hotkey(*keys)``, ``keyDown(key)`` / ``keyUp(key)``, ``time.sleep(secs)``.
``interval``, ``duration``, ``logScreenshot`` and ``_pause`` are accepted and ignored
(deskvm paces input itself). Coordinates may be floats; they are rounded to the pixel.

Held keys: deskvm never leaves a key pressed between actions, so ``keyDown`` only marks a
key as held; a following click or scroll holds it (``hold``), a following ``press`` /
``hotkey`` includes it in the combo, a following ``time.sleep`` becomes a
:class:`~agent_bridge.protocol.actions.HoldKey`, and a ``keyUp`` with nothing in between
presses the held keys once. Keys still held when the code ends are released. Holding keys
while typing, moving or dragging is refused.
"""

from __future__ import annotations

import ast
import math
import re
import textwrap
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agent_bridge.protocol.actions import (
    MAX_WAIT_MS,
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
from agent_bridge.protocol.messages import MAX_TEXT_CHARS
from agent_bridge.protocol.results import Result
from agent_bridge.protocol.vocab._base import (
    MAX_SCROLL_NOTCHES,
    merge_combos,
    read_pixel,
    seconds_to_ms,
    unknown_action,
)
from agent_bridge.protocol.vocab.osworld import OSWORLD_WAIT_MS, osworld_key, osworld_step_result
from orchestrator.errors import ActionError, ProtocolError

__all__ = [
    "MAX_CODE_CHARS",
    "MAX_CODE_WAIT_MS",
    "MAX_LOOP_DEPTH",
    "MAX_LOOP_ITERATIONS",
    "MAX_SCRIPT_ACTIONS",
    "MAX_STATEMENTS_RUN",
    "PYAUTOGUI_CALLS",
    "PyAutoGUIProgram",
    "PyAutoGUIVocabulary",
    "extract_code",
    "parse_pyautogui",
    "parse_pyautogui_program",
]

MAX_CODE_CHARS = MAX_TEXT_CHARS
"""Longest accepted source, in characters."""

MAX_SCRIPT_ACTIONS = 200
"""Most deskvm actions one code string may produce."""

MAX_LOOP_ITERATIONS = 50
"""Most iterations of one ``for`` loop."""

MAX_LOOP_DEPTH = 2
"""Most ``for`` loops nested in one another."""

MAX_STATEMENTS_RUN = 2000
"""Most statements one code string may execute (a loop's body counts once per iteration)."""

MAX_CODE_WAIT_MS = 120_000
"""Longest total of the sleeps, waits and key holds of one code string, milliseconds."""

_MAX_NUMBER = 2**53  # every computed number stays within +-2**53 (exact as a float too)
_LINE_BREAK = r"\r\n|\r|\n"
_FENCE_LANGUAGES = frozenset({"", "python", "py", "python3", "pyautogui"})
_SETTINGS = {"pyautogui.PAUSE": "a number of seconds", "pyautogui.FAILSAFE": "True or False"}
_SCREEN_CALLS = frozenset({"pyautogui.size", "pyautogui.position", "pyautogui.onScreen",
                           "pyautogui.locateOnScreen", "pyautogui.locateCenterOnScreen",
                           "pyautogui.locateAllOnScreen", "pyautogui.pixel",
                           "pyautogui.pixelMatchesColor", "pyautogui.screenshot"})  # fmt: skip
_PURE_FUNCTIONS = ("int", "float", "round", "abs", "min", "max")

SPECIAL = ("WAIT", "DONE", "FAIL")

_IGNORED = ("interval", "duration", "logScreenshot", "_pause", "tween")
# Parameters (in positional order) of each whitelisted call; ignored ones included.
_CLICK = ("x", "y", "clicks", "interval", "button", "duration", "logScreenshot", "_pause")
_MULTI_CLICK = ("x", "y", "interval", "button", "duration", "logScreenshot", "_pause")
_SIGNATURES: Mapping[str, tuple[str, ...]] = {
    "pyautogui.click": _CLICK,
    "pyautogui.doubleClick": _MULTI_CLICK,
    "pyautogui.tripleClick": _MULTI_CLICK,
    "pyautogui.rightClick": ("x", "y", "duration", "logScreenshot", "_pause"),
    "pyautogui.middleClick": ("x", "y", "duration", "logScreenshot", "_pause"),
    "pyautogui.moveTo": ("x", "y", "duration", "logScreenshot", "_pause"),
    "pyautogui.dragTo": ("x", "y", "duration", "button", "logScreenshot", "_pause", "mouseDownUp"),
    "pyautogui.mouseDown": ("x", "y", "button", "duration", "logScreenshot", "_pause"),
    "pyautogui.mouseUp": ("x", "y", "button", "duration", "logScreenshot", "_pause"),
    "pyautogui.scroll": ("clicks", "x", "y", "logScreenshot", "_pause"),
    "pyautogui.vscroll": ("clicks", "x", "y", "logScreenshot", "_pause"),
    "pyautogui.hscroll": ("clicks", "x", "y", "logScreenshot", "_pause"),
    "pyautogui.typewrite": ("message", "interval", "logScreenshot", "_pause"),
    "pyautogui.write": ("message", "interval", "logScreenshot", "_pause"),
    "pyautogui.press": ("keys", "presses", "interval", "logScreenshot", "_pause"),
    "pyautogui.hotkey": (),  # *keys, plus the keywords below
    "pyautogui.keyDown": ("key", "logScreenshot", "_pause"),
    "pyautogui.keyUp": ("key", "logScreenshot", "_pause"),
    "time.sleep": ("secs",),
}  # fmt: skip
_HOTKEY_KEYWORDS = ("interval", "logScreenshot", "_pause")

PYAUTOGUI_CALLS: tuple[str, ...] = tuple(_SIGNATURES)
"""The calls accepted in pyautogui code (besides the special strings WAIT, DONE, FAIL)."""

_MODULES = frozenset({"pyautogui", "time"})
_BUTTONS: Mapping[str, Button] = {
    "left": Button.LEFT,
    "primary": Button.LEFT,
    "right": Button.RIGHT,
    "secondary": Button.RIGHT,
    "middle": Button.MIDDLE,
}
_MAX_LITERAL_DEPTH = 3

LiteralValue = int | float | str | bool | None | list[Any]

_NODE_NAMES: Mapping[type[ast.AST], str] = {
    ast.Name: "a name",
    ast.Attribute: "attribute access",
    ast.Call: "a call",
    ast.JoinedStr: "an f-string",
    ast.Lambda: "a lambda",
    ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension",
    ast.DictComp: "a comprehension",
    ast.GeneratorExp: "a generator expression",
    ast.BinOp: "an operator expression",
    ast.BoolOp: "a boolean expression",
    ast.Compare: "a comparison",
    ast.IfExp: "a conditional expression",
    ast.Subscript: "a subscript",
    ast.Starred: "*-unpacking",
    ast.Dict: "a dict",
    ast.Set: "a set",
    ast.NamedExpr: "an assignment expression",
    ast.Await: "await",
}


def _describe(node: ast.AST) -> str:
    kind = _NODE_NAMES.get(type(node), type(node).__name__)
    try:
        text = ast.unparse(node)
    except Exception:  # pragma: no cover - unparse of a parsed tree does not fail
        text = "?"
    if len(text) > 60:
        text = text[:57] + "..."
    line = getattr(node, "lineno", "?")
    return f"{kind} `{text}` (line {line})"


def _refused(node: ast.AST, why: str) -> ProtocolError:
    return ProtocolError(f"refused {_describe(node)}: {why}", code="refused_code")


def _qualified_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        raise _refused(func, "only pyautogui.<function>(...) and time.sleep(...) may be called")
    if not isinstance(func, ast.Attribute) or not isinstance(func.value, ast.Name):
        raise _refused(func, "only pyautogui.<function>(...) and time.sleep(...) may be called")
    module = func.value.id
    if module not in _MODULES:
        raise _refused(func, f"module {module!r} is not available; only pyautogui and time")
    return f"{module}.{func.attr}"


@dataclass
class _Call:
    name: str
    args: dict[str, LiteralValue]
    positional: list[LiteralValue]
    line: int

    @property
    def where(self) -> str:
        return f"{self.name} (line {self.line})"


def _bind(
    name: str,
    line: int,
    positional: list[LiteralValue],
    keywords: dict[str, LiteralValue],
) -> _Call:
    where = f"{name} (line {line})"
    if name == "pyautogui.hotkey":
        bad = sorted(set(keywords) - set(_HOTKEY_KEYWORDS))
        if bad:
            raise ActionError(f"{where}: unexpected keyword argument {bad[0]!r}")
        return _Call(name, keywords, positional, line)
    params = _SIGNATURES[name]
    if len(positional) > len(params):
        raise ActionError(f"{where}: takes at most {len(params)} positional arguments")
    bound: dict[str, LiteralValue] = dict(zip(params, positional, strict=False))
    for key, value in keywords.items():
        if key not in params:
            raise ActionError(f"{where}: unexpected keyword argument {key!r}")
        if key in bound:
            raise ActionError(f"{where}: got multiple values for {key!r}")
        bound[key] = value
    for key in _IGNORED:
        value = bound.get(key)
        if key in ("logScreenshot", "_pause") or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ActionError(f"{where}: {key!r} must be a number, got {value!r}")
    return _Call(name, bound, positional, line)


def _xy(c: _Call, *, required: bool) -> tuple[int | None, int | None]:
    x, y = c.args.get("x"), c.args.get("y")
    if isinstance(x, list) and y is None:  # pyautogui.click((x, y))
        if len(x) != 2:
            raise ActionError(f"{c.where}: a point must be (x, y), got {x!r}")
        x, y = x
    if x is None and y is None and not required:
        return None, None
    if x is None or y is None:
        raise ActionError(f"{c.where}: give both x and y", code="missing_parameter")
    return (
        read_pixel(x, "x", c.where, round_to_pixel=True),
        read_pixel(y, "y", c.where, round_to_pixel=True),
    )


def _button(c: _Call, default: str = "left") -> Button:
    value = c.args.get("button", default)
    if value is None:
        value = default
    if not isinstance(value, str) or value.lower() not in _BUTTONS:
        raise ActionError(
            f"{c.where}: 'button' must be one of {', '.join(_BUTTONS)}, got {value!r}"
        )
    return _BUTTONS[value.lower()]


def _whole(c: _Call, name: str, *, low: int, high: int, default: int | None = None) -> int:
    value = c.args.get(name, default)
    if value is None:
        raise ActionError(f"{c.where}: missing argument {name!r}", code="missing_parameter")
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not float(value).is_integer()
        or not low <= value <= high
    ):
        raise ActionError(
            f"{c.where}: {name!r} must be a whole number in {low}..{high}, got {value!r}"
        )
    return int(value)


def _key_names(value: LiteralValue, c: _Call, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [str(v) for v in value]
    raise ActionError(
        f"{c.where}: {name!r} must be a key name or a list of key names, got {value!r}"
    )


@dataclass
class _Script:
    """Turns whitelisted calls into actions, tracking keys marked held by ``keyDown``."""

    actions: list[Action] = field(default_factory=list)
    held: list[KeyCombo] = field(default_factory=list)
    held_unused: bool = False
    wait_ms: int = 0

    def emit(self, *actions: Action) -> None:
        self.actions.extend(actions)
        if len(self.actions) > MAX_SCRIPT_ACTIONS:
            raise ActionError(f"the code produces more than {MAX_SCRIPT_ACTIONS} actions")
        for action in actions:
            if isinstance(action, Wait):
                self.wait_ms += action.ms
            elif isinstance(action, HoldKey):
                self.wait_ms += action.duration_ms
        if self.wait_ms > MAX_CODE_WAIT_MS:
            raise ActionError(
                f"the code's sleeps and waits add up to more than {MAX_CODE_WAIT_MS / 1000:g} s"
            )

    def hold(self) -> KeyCombo | None:
        if not self.held:
            return None
        self.held_unused = False
        return merge_combos(self.held)

    def refuse_held(self, c: _Call) -> None:
        if self.held:
            raise ActionError(
                f"{c.where}: keys held with keyDown ({merge_combos(self.held)}) cannot be held "
                "during this call; deskvm holds keys only for clicks, scrolls, key presses "
                "and sleeps",
                code="unsupported_parameter",
            )

    def call(self, c: _Call) -> None:
        handler = _HANDLERS[c.name]
        handler(self, c)


def _click(button: Button | None, count: int | None) -> Callable[[_Script, _Call], None]:
    def handle(s: _Script, c: _Call) -> None:
        x, y = _xy(c, required=False)
        n = count if count is not None else _whole(c, "clicks", low=1, high=3, default=1)
        b = button if button is not None else _button(c)
        s.emit(Click(x=x, y=y, button=b, count=n, hold=s.hold()))

    return handle


def _move_to(s: _Script, c: _Call) -> None:
    s.refuse_held(c)
    x, y = _xy(c, required=True)
    assert x is not None and y is not None
    s.emit(Move(x, y))


def _drag_to(s: _Script, c: _Call) -> None:
    s.refuse_held(c)
    x, y = _xy(c, required=True)
    assert x is not None and y is not None
    button = _button(c)
    if c.args.get("mouseDownUp", True) is False:
        s.emit(Move(x, y))
    else:
        s.emit(MouseDown(button), Move(x, y), MouseUp(button, x, y))


def _mouse(kind: type[MouseDown] | type[MouseUp]) -> Callable[[_Script, _Call], None]:
    def handle(s: _Script, c: _Call) -> None:
        s.refuse_held(c)
        x, y = _xy(c, required=False)
        s.emit(kind(button=_button(c), x=x, y=y))

    return handle


def _scroll(horizontal: bool) -> Callable[[_Script, _Call], None]:
    def handle(s: _Script, c: _Call) -> None:
        clicks = _whole(c, "clicks", low=-MAX_SCROLL_NOTCHES, high=MAX_SCROLL_NOTCHES)
        x, y = _xy(c, required=False)
        hold = s.hold()
        if horizontal:
            s.emit(Scroll(x=x, y=y, dx=clicks, hold=hold))
        else:  # pyautogui: positive clicks scroll up; deskvm: positive dy scrolls down
            s.emit(Scroll(x=x, y=y, dy=-clicks, hold=hold))

    return handle


def _write(s: _Script, c: _Call) -> None:
    message = c.args.get("message")
    if message is None:
        raise ActionError(f"{c.where}: missing argument 'message'", code="missing_parameter")
    if isinstance(message, list):  # a list presses the named keys one after another
        _press_names(s, c, _key_names(message, c, "message"), presses=1)
        return
    if not isinstance(message, str):
        raise ActionError(f"{c.where}: 'message' must be a string, got {message!r}")
    if len(message) > MAX_TEXT_CHARS:
        raise ActionError(f"{c.where}: 'message' is longer than {MAX_TEXT_CHARS} characters")
    s.refuse_held(c)
    s.emit(Type(text=message))


def _press_names(s: _Script, c: _Call, names: list[str], *, presses: int) -> None:
    combos = [osworld_key(name) for name in names]
    hold = s.hold()
    if hold is not None:
        combos = [merge_combos((hold, combo)) for combo in combos]
    s.emit(Key(combos=tuple(combos) * presses))


def _press(s: _Script, c: _Call) -> None:
    keys = c.args.get("keys")
    if keys is None:
        raise ActionError(f"{c.where}: missing argument 'keys'", code="missing_parameter")
    presses = _whole(c, "presses", low=1, high=MAX_SCROLL_NOTCHES, default=1)
    _press_names(s, c, _key_names(keys, c, "keys"), presses=presses)


def _hotkey(s: _Script, c: _Call) -> None:
    if len(c.positional) == 1 and isinstance(c.positional[0], list):
        names = _key_names(c.positional[0], c, "keys")
    elif c.positional and all(isinstance(p, str) for p in c.positional):
        names = [str(p) for p in c.positional]
    else:
        raise ActionError(f"{c.where}: give the keys as strings, e.g. hotkey('ctrl', 'c')")
    combo = merge_combos([*s.held, *(osworld_key(n) for n in names)])
    s.held_unused = False
    s.emit(Key(combos=(combo,)))


def _key_down(s: _Script, c: _Call) -> None:
    key = c.args.get("key")
    if not isinstance(key, str):
        raise ActionError(f"{c.where}: 'key' must be a key name, got {key!r}")
    combo = osworld_key(key)
    if combo not in s.held:
        s.held.append(combo)
        s.held_unused = True


def _key_up(s: _Script, c: _Call) -> None:
    key = c.args.get("key")
    if not isinstance(key, str):
        raise ActionError(f"{c.where}: 'key' must be a key name, got {key!r}")
    combo = osworld_key(key)
    if combo not in s.held:
        return  # releasing a key that is not down does nothing
    if s.held_unused:  # keyDown ... keyUp with nothing in between: one press of the keys
        s.emit(Key(combos=(merge_combos(s.held),)))
        s.held_unused = False
    s.held.remove(combo)


def _sleep(s: _Script, c: _Call) -> None:
    secs = c.args.get("secs")
    if isinstance(secs, bool) or not isinstance(secs, int | float):
        raise ActionError(f"{c.where}: 'secs' must be a number of seconds, got {secs!r}")
    ms = seconds_to_ms(float(secs), "secs", c.where)
    if s.held and s.held_unused:
        s.emit(HoldKey(combo=merge_combos(s.held), duration_ms=ms))
        s.held_unused = False
    else:
        s.emit(Wait(ms=ms))


_HANDLERS: Mapping[str, Callable[[_Script, _Call], None]] = {
    "pyautogui.click": _click(None, None),
    "pyautogui.doubleClick": _click(None, 2),
    "pyautogui.tripleClick": _click(None, 3),
    "pyautogui.rightClick": _click(Button.RIGHT, 1),
    "pyautogui.middleClick": _click(Button.MIDDLE, 1),
    "pyautogui.moveTo": _move_to,
    "pyautogui.dragTo": _drag_to,
    "pyautogui.mouseDown": _mouse(MouseDown),
    "pyautogui.mouseUp": _mouse(MouseUp),
    "pyautogui.scroll": _scroll(horizontal=False),
    "pyautogui.vscroll": _scroll(horizontal=False),
    "pyautogui.hscroll": _scroll(horizontal=True),
    "pyautogui.typewrite": _write,
    "pyautogui.write": _write,
    "pyautogui.press": _press,
    "pyautogui.hotkey": _hotkey,
    "pyautogui.keyDown": _key_down,
    "pyautogui.keyUp": _key_up,
    "time.sleep": _sleep,
}

_SUPPORTED: tuple[str, ...] = (*PYAUTOGUI_CALLS, *SPECIAL)


def _fence_line(line: str) -> str | None:
    """The text after ```` ``` ```` if ``line`` is a Markdown fence line, else ``None``."""
    stripped = line.strip()
    return stripped[3:] if stripped.startswith("```") else None


def _dedented(lines: list[str]) -> list[str]:
    """``lines`` with their common leading whitespace removed (line count kept)."""
    if not lines:
        return []
    return textwrap.dedent("\n".join(lines)).split("\n")


def extract_code(text: str) -> str:
    """The Python source inside a model's answer, with the same line numbers.

    Without Markdown fences the whole text is the code. With fences, the code is what the
    ``python`` (or ``py``, ``python3``, ``pyautogui``, unnamed) fences hold, in order; the
    prose around them is blanked out (never parsed); a one-line fence (```` ```DONE``` ````)
    holds what is between its backticks; a last fence left open runs to the end. Each
    block's common indentation is removed. Lines keep their numbers, so errors point at
    the text as sent.

    Raises:
        ProtocolError: code ``refused_code`` for a fence in another language (the message
            names the language and line).
    """
    # Python's own line breaks only (str.splitlines would also break at \x0c, \u2028...).
    lines = re.split(_LINE_BREAK, text)
    if not any(_fence_line(line) is not None for line in lines):
        return "\n".join(_dedented(lines))
    out = [""] * len(lines)
    block: list[int] | None = None  # line indexes of the open block
    for index, line in enumerate(lines):
        info = _fence_line(line)
        if block is not None:
            if info is None:
                block.append(index)
                continue
            for i, text_line in zip(block, _dedented([lines[i] for i in block]), strict=True):
                out[i] = text_line
            block = None
            continue
        if info is None:
            continue  # prose around the fences
        if len(info) >= 3 and info.endswith("```"):  # ```DONE``` on one line
            out[index] = info[:-3].strip()
            continue
        words = info.split()
        language = words[0].lower() if words else ""
        if language not in _FENCE_LANGUAGES:
            raise ProtocolError(
                f"refused a ```{words[0]} code block (line {index + 1}): only Python "
                "(pyautogui) code is accepted",
                code="refused_code",
            )
        block = []
    if block is not None:  # an unclosed last fence (a cut-off answer) runs to the end
        for i, text_line in zip(block, _dedented([lines[i] for i in block]), strict=True):
            out[i] = text_line
    return "\n".join(out)


@dataclass(frozen=True, slots=True)
class PyAutoGUIProgram:
    """What one code string does, as parsed.

    Attributes:
        actions: the deskvm actions, in order.
        terminal: ``"DONE"`` or ``"FAIL"`` when the code ends the episode, else ``None``.
    """

    actions: tuple[Action, ...]
    terminal: Literal["DONE", "FAIL"] | None = None


def _number(value: float, node: ast.AST) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise _refused(node, "the result is not a finite number")
    if abs(value) > _MAX_NUMBER:
        raise _refused(node, f"numbers must stay within -2**53..2**53, got {value!r}")
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _binop(node: ast.BinOp, left: LiteralValue, right: LiteralValue) -> LiteralValue:
    op = node.op
    if isinstance(op, ast.Add) and isinstance(left, str) and isinstance(right, str):
        if len(left) + len(right) > MAX_TEXT_CHARS:
            raise _refused(node, f"strings may hold at most {MAX_TEXT_CHARS} characters")
        return left + right
    if not isinstance(op, ast.Add | ast.Sub | ast.Mult | ast.Div | ast.FloorDiv | ast.Mod):
        raise _refused(node, "only + - * / // % of numbers and + of strings are computed")
    if not (_is_number(left) and _is_number(right)):
        raise _refused(
            node, f"arithmetic needs two numbers (or + of two strings), got {left!r}, {right!r}"
        )
    a, b = float(left) if isinstance(left, float) else left, right
    assert isinstance(a, int | float) and isinstance(b, int | float)
    if isinstance(op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
        raise _refused(node, "division by zero")
    if isinstance(op, ast.Add):
        result: int | float = a + b
    elif isinstance(op, ast.Sub):
        result = a - b
    elif isinstance(op, ast.Mult):
        result = a * b
    elif isinstance(op, ast.Div):
        result = a / b
    elif isinstance(op, ast.FloorDiv):
        result = a // b
    else:
        result = a % b
    return _number(result, node)


def _pure_call(node: ast.Call, name: str, args: list[LiteralValue]) -> LiteralValue:
    """``int()``, ``float()``, ``round()``, ``abs()``, ``min()``, ``max()`` of numbers."""
    if not args or not all(_is_number(a) for a in args):
        raise _refused(node, f"{name}() takes numbers here, got {args!r}")
    numbers = [a for a in args if isinstance(a, int | float)]
    if name in ("min", "max"):
        return min(numbers) if name == "min" else max(numbers)
    if name == "round" and len(numbers) == 2:
        digits = numbers[1]
        if not isinstance(digits, int) or not 0 <= digits <= 15:
            raise _refused(
                node, f"round()'s digits must be a whole number in 0..15, got {digits!r}"
            )
        return _number(round(numbers[0], digits), node)
    if len(numbers) != 1:
        raise _refused(node, f"{name}() takes one number here")
    value = numbers[0]
    if name == "int":
        return int(value)
    if name == "float":
        return float(value)
    if name == "round":
        return round(value)
    return abs(value)


class _Interpreter:
    """Walks the tree of accepted code: constants in names, bounded loops, calls to actions.

    Nothing is executed: values are computed here from constants only (see the module
    docstring for what is accepted), and calls become actions through :class:`_Script`.
    """

    def __init__(self) -> None:
        self.script = _Script()
        self.names: dict[str, LiteralValue] = {}
        self.terminal: Literal["DONE", "FAIL"] | None = None
        self.terminal_line = 0
        self.statements_run = 0
        self.loop_depth = 0

    # --- values ---------------------------------------------------------------------

    def value(self, node: ast.expr, depth: int = 0) -> LiteralValue:
        """The value of an accepted expression (see the module docstring).

        Raises:
            ProtocolError: code ``refused_code``, naming the construct and its line.
        """
        if isinstance(node, ast.Constant):
            constant = node.value
            if isinstance(constant, int | float) and not isinstance(constant, bool):
                return _number(constant, node)
            if constant is None or isinstance(constant, bool | str):
                return constant
            raise _refused(node, "values must be literal numbers, strings, booleans, None or lists")
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            raise _refused(
                node, "only names assigned a constant earlier in the code can be used here"
            )
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            operand = self.value(node.operand, depth)
            if not _is_number(operand):
                raise _refused(node, f"unary minus/plus needs a number, got {operand!r}")
            assert isinstance(operand, int | float)
            return _number(-operand if isinstance(node.op, ast.USub) else operand, node)
        if isinstance(node, ast.BinOp):
            return _binop(node, self.value(node.left, depth), self.value(node.right, depth))
        if isinstance(node, ast.List | ast.Tuple):
            if depth >= _MAX_LITERAL_DEPTH:
                raise _refused(node, "literal lists may be nested at most 3 deep")
            return list(self.items(node.elts, depth + 1))
        if isinstance(node, ast.Subscript):
            return self.subscript(node, depth)
        if isinstance(node, ast.Call):
            return self.call_value(node, depth)
        raise _refused(node, "values must be literal numbers, strings, booleans, None or lists")

    def items(self, nodes: Sequence[ast.expr], depth: int) -> Iterator[LiteralValue]:
        """Values of a list's elements or a call's positional arguments (``*seq`` expanded)."""
        for item in nodes:
            if isinstance(item, ast.Starred):
                unpacked = self.value(item.value, depth)
                if not isinstance(unpacked, list):
                    raise _refused(item, f"*-unpacking needs a list or tuple, got {unpacked!r}")
                yield from unpacked
            else:
                yield self.value(item, depth)

    def subscript(self, node: ast.Subscript, depth: int) -> LiteralValue:
        if not isinstance(node.value, ast.Name | ast.List | ast.Tuple | ast.Constant):
            raise _refused(node, "only a list or string assigned earlier may be indexed")
        sequence = self.value(node.value, depth)
        if isinstance(node.slice, ast.Slice):
            raise _refused(node, "slices are not computed; index with a whole number")
        index = self.value(node.slice, depth)
        if not isinstance(sequence, list | str):
            raise _refused(node, f"only lists and strings can be indexed, got {sequence!r}")
        if isinstance(index, bool) or not isinstance(index, int):
            raise _refused(node, f"the index must be a whole number, got {index!r}")
        if not -len(sequence) <= index < len(sequence):
            raise _refused(node, f"index {index} is out of range (length {len(sequence)})")
        return sequence[index]

    def call_value(self, node: ast.Call, depth: int) -> LiteralValue:
        func = node.func
        if isinstance(func, ast.Name) and func.id in _PURE_FUNCTIONS and func.id not in self.names:
            if node.keywords:
                raise _refused(node, f"{func.id}() takes no keyword arguments here")
            return _pure_call(node, func.id, list(self.items(node.args, depth)))
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and f"{func.value.id}.{func.attr}" in _SCREEN_CALLS
        ):
            raise _refused(
                node,
                f"{func.value.id}.{func.attr}() has a value only on a running screen, and "
                "deskvm parses the code without running it; write the numbers instead",
            )
        raise _refused(
            node,
            "calls inside expressions are limited to "
            + ", ".join(f"{n}()" for n in _PURE_FUNCTIONS)
            + " of numbers",
        )

    # --- statements -----------------------------------------------------------------

    def run(self, body: Sequence[ast.stmt]) -> None:
        for stmt in body:
            if self.terminal is not None:
                raise _refused(
                    stmt,
                    f"`{self.terminal}` (line {self.terminal_line}) ends the episode; "
                    "nothing may follow it",
                )
            self.statements_run += 1
            if self.statements_run > MAX_STATEMENTS_RUN:
                raise _refused(
                    stmt, f"the code runs more than {MAX_STATEMENTS_RUN} statements (loops)"
                )
            self.statement(stmt)

    def statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.name not in _MODULES or alias.asname is not None:
                    raise _refused(
                        stmt,
                        f"import of {alias.name!r}; only `import pyautogui` and `import time`",
                    )
            return
        if isinstance(stmt, ast.ImportFrom):
            raise _refused(stmt, "from-imports; only `import pyautogui` and `import time`")
        if isinstance(stmt, ast.Pass):
            return
        if isinstance(stmt, ast.Assign):
            self.assign(stmt)
            return
        if isinstance(stmt, ast.AugAssign):
            self.aug_assign(stmt)
            return
        if isinstance(stmt, ast.For):
            self.loop(stmt)
            return
        if not isinstance(stmt, ast.Expr):
            raise _refused(
                stmt,
                "only calls of pyautogui functions and time.sleep, constant assignments "
                "and bounded for-loops are accepted",
            )
        if isinstance(stmt.value, ast.Name) and stmt.value.id in SPECIAL:
            self.special(stmt.value)
            return
        call = stmt.value
        if not isinstance(call, ast.Call):
            raise _refused(call, "only calls of pyautogui functions and time.sleep are accepted")
        name = _qualified_name(call)
        if name not in _SIGNATURES:
            raise unknown_action(
                "pyautogui", name, _SUPPORTED, why=f"unsupported call {name}() (line {call.lineno})"
            )
        positional = list(self.items(call.args, 0))
        keywords: dict[str, LiteralValue] = {}
        for kw in call.keywords:
            if kw.arg is None:
                raise _refused(kw.value, "**-unpacking of arguments")
            keywords[kw.arg] = self.value(kw.value)
        self.script.call(_bind(name, call.lineno, positional, keywords))

    def special(self, node: ast.Name) -> None:
        if node.id == "WAIT":
            self.script.emit(Wait(ms=min(OSWORLD_WAIT_MS, MAX_WAIT_MS)))
            return
        if self.loop_depth:
            raise _refused(node, f"`{node.id}` ends the episode and cannot be inside a loop")
        self.terminal = "DONE" if node.id == "DONE" else "FAIL"
        self.terminal_line = node.lineno

    def bind(self, target: ast.expr, value: LiteralValue) -> None:
        """Assign ``value`` to a name, or unpack it over a tuple/list of names."""
        if isinstance(target, ast.Name):
            if target.id in _MODULES or target.id in SPECIAL:
                raise _refused(target, f"`{target.id}` cannot be assigned")
            self.names[target.id] = value
            return
        if isinstance(target, ast.Tuple | ast.List):
            if any(isinstance(t, ast.Starred) for t in target.elts):
                raise _refused(target, "*-unpacking in assignments")
            if not isinstance(value, list | str) or len(value) != len(target.elts):
                raise _refused(target, f"cannot unpack {value!r} into {len(target.elts)} names")
            for sub, item in zip(target.elts, value, strict=True):
                self.bind(sub, item)
            return
        raise _refused(target, "only plain names can be assigned")

    def assign(self, stmt: ast.Assign) -> None:
        target = stmt.targets[0]
        if len(stmt.targets) == 1 and isinstance(target, ast.Attribute):
            self.setting(target, stmt.value)
            return
        value = self.value(stmt.value)
        for target in stmt.targets:
            self.bind(target, value)

    def setting(self, target: ast.Attribute, node: ast.expr) -> None:
        """``pyautogui.PAUSE = <number>`` / ``pyautogui.FAILSAFE = <bool>``: ignored."""
        name = ast.unparse(target)
        if name not in _SETTINGS:
            raise _refused(target, "only pyautogui.PAUSE and pyautogui.FAILSAFE may be set")
        value = self.value(node)
        if name == "pyautogui.PAUSE":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
        else:
            ok = isinstance(value, bool)
        if not ok:
            raise _refused(node, f"{name} must be {_SETTINGS[name]}")

    def aug_assign(self, stmt: ast.AugAssign) -> None:
        if not isinstance(stmt.target, ast.Name):
            raise _refused(stmt.target, "only plain names can be assigned")
        current = self.value(stmt.target)
        synthetic = ast.BinOp(left=stmt.target, op=stmt.op, right=stmt.value)
        ast.copy_location(synthetic, stmt)
        self.bind(stmt.target, _binop(synthetic, current, self.value(stmt.value)))

    def loop(self, stmt: ast.For) -> None:
        if stmt.orelse:
            raise _refused(stmt, "for-else")
        if self.loop_depth >= MAX_LOOP_DEPTH:
            raise _refused(stmt, f"loops may be nested at most {MAX_LOOP_DEPTH} deep")
        items = self.loop_items(stmt)
        for stmt_in_body in ast.walk(stmt):
            if isinstance(stmt_in_body, ast.Break | ast.Continue):
                raise _refused(stmt_in_body, "break and continue (loops run their whole range)")
        self.loop_depth += 1
        try:
            for item in items:
                self.bind(stmt.target, item)
                self.run(stmt.body)
        finally:
            self.loop_depth -= 1

    def loop_items(self, stmt: ast.For) -> list[LiteralValue]:
        """What a loop iterates over: ``range(...)`` of whole numbers, or a constant sequence."""
        source = stmt.iter
        if (
            isinstance(source, ast.Call)
            and isinstance(source.func, ast.Name)
            and source.func.id == "range"
            and "range" not in self.names
        ):
            if source.keywords or not 1 <= len(source.args) <= 3:
                raise _refused(source, "range() takes one to three whole numbers")
            args = list(self.items(source.args, 0))
            if not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
                raise _refused(source, f"range() takes whole numbers, got {args!r}")
            ints = [int(a) for a in args if isinstance(a, int)]
            if len(ints) == 3 and ints[2] == 0:
                raise _refused(source, "range() step must not be zero")
            count = len(range(*ints))
            if count > MAX_LOOP_ITERATIONS:
                raise _refused(stmt, f"the loop runs {count} times; at most {MAX_LOOP_ITERATIONS}")
            return list(range(*ints))
        sequence = self.value(source)
        if not isinstance(sequence, list | str):
            raise _refused(source, "loops run over range(...) or a constant list, tuple or string")
        if len(sequence) > MAX_LOOP_ITERATIONS:
            raise _refused(
                stmt, f"the loop runs {len(sequence)} times; at most {MAX_LOOP_ITERATIONS}"
            )
        return list(sequence)


def parse_pyautogui_program(code: str) -> PyAutoGUIProgram:
    """Parse OSWorld pyautogui code into deskvm actions without running it.

    Args:
        code: Python source as an OSWorld pyautogui agent emits it (possibly in Markdown
            fences with prose around, possibly indented as a block), or ``WAIT`` /
            ``DONE`` / ``FAIL``.

    Returns:
        The actions in order, and whether the code ends the episode (``DONE``/``FAIL``).

    Raises:
        ProtocolError: code ``invalid_code`` (not Python, or too long), ``refused_code``
            (a construct outside what is accepted, or a limit passed; the message names it
            and its line), ``unknown_action`` (a pyautogui/time function not in the
            whitelist; the message lists the supported calls); ``ActionError`` for bad
            arguments or too many actions.
    """
    if len(code) > MAX_CODE_CHARS:
        raise ProtocolError(f"code is longer than {MAX_CODE_CHARS} characters", code="invalid_code")
    source = extract_code(code)
    special = source.strip()
    if special == "WAIT":
        return PyAutoGUIProgram((Wait(ms=min(OSWORLD_WAIT_MS, MAX_WAIT_MS)),))
    if special in ("DONE", "FAIL"):
        return PyAutoGUIProgram((), "DONE" if special == "DONE" else "FAIL")
    try:
        with warnings.catch_warnings():  # "invalid escape sequence" and the like: no noise
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ProtocolError(f"code is not valid Python: {exc}", code="invalid_code") from None
    interpreter = _Interpreter()
    try:
        interpreter.run(tree.body)
    except RecursionError:
        raise ProtocolError("code is nested too deeply", code="invalid_code") from None
    return PyAutoGUIProgram(tuple(interpreter.script.actions), interpreter.terminal)


def parse_pyautogui(code: str) -> tuple[Action, ...]:
    """The actions of :func:`parse_pyautogui_program` (empty for ``DONE`` / ``FAIL``).

    Raises:
        ProtocolError: as :func:`parse_pyautogui_program`.
    """
    return parse_pyautogui_program(code).actions


@dataclass(frozen=True, slots=True)
class PyAutoGUIVocabulary:
    """OSWorld's ``pyautogui`` action space (see the module docstring).

    Attributes:
        screenshot_after_action: end every request with a :class:`Screenshot`, as OSWorld's
            ``step`` returns an observation after every action.
    """

    name: str = "pyautogui"
    supported: tuple[str, ...] = _SUPPORTED
    screenshot_after_action: bool = True

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]:
        """Parse ``{"code": "..."}`` (see :func:`parse_pyautogui`).

        Raises:
            ProtocolError: as :func:`parse_pyautogui`; ``ActionError`` code
                ``missing_parameter`` without a ``code`` string.
        """
        code = body.get("code")
        if code is None:
            raise ActionError("missing parameter 'code'", code="missing_parameter")
        if not isinstance(code, str):
            raise ActionError(f"'code' must be a string, got {type(code).__name__}")
        actions = parse_pyautogui_program(code).actions
        if self.screenshot_after_action or not actions:
            return (*actions, Screenshot())
        return actions

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        """OSWorld's step outcome; ``DONE`` / ``FAIL`` (alone or last) end the episode."""
        code = body.get("code")
        terminal = parse_pyautogui_program(code).terminal if isinstance(code, str) else None
        return osworld_step_result(results, terminal=terminal)
