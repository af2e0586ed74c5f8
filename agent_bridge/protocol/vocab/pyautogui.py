"""``schema=pyautogui``: OSWorld's pyautogui action strings, parsed with :mod:`ast`, never run.

A request body is ``{"code": "<python source>"}`` as OSWorld's pyautogui agents write it
(``pyautogui.click(10, 20); time.sleep(0.5); pyautogui.write('hi')``), or one of the
special strings ``WAIT`` (pause 2 s), ``DONE`` and ``FAIL`` (end the episode).

The source is parsed, never executed (no ``eval``, ``exec``, ``compile`` to bytecode or
``literal_eval``). It is accepted only if it is a sequence of statements, each either a
call from the whitelist below with literal arguments (numbers, strings, booleans, ``None``,
lists/tuples of those) or a plain ``import pyautogui`` / ``import time`` (a no-op: OSWorld
models habitually write them). Everything else is refused with a ``ProtocolError`` naming
what was refused and where: other imports, assignments, names, attribute access beyond
``pyautogui.<call>`` / ``time.sleep``, calls of anything else, calls in arguments,
f-strings, lambdas, comprehensions, operators, ``*args`` / ``**kwargs``.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    "MAX_SCRIPT_ACTIONS",
    "PYAUTOGUI_CALLS",
    "PyAutoGUIVocabulary",
    "parse_pyautogui",
]

MAX_CODE_CHARS = MAX_TEXT_CHARS
"""Longest accepted source, in characters."""

MAX_SCRIPT_ACTIONS = 200
"""Most deskvm actions one code string may produce."""

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


def _literal(node: ast.expr, depth: int = 0) -> LiteralValue:
    """A literal argument, read from the tree (never evaluated)."""
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, bool | int | float | str)
    ):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub | ast.UAdd)
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, int | float)
        and not isinstance(node.operand.value, bool)
    ):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple) and depth < _MAX_LITERAL_DEPTH:
        return [_literal(item, depth + 1) for item in node.elts]
    raise _refused(node, "arguments must be literal numbers, strings, booleans, None or lists")


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


def _bind(name: str, call: ast.Call) -> _Call:
    positional = [_literal(arg) for arg in call.args]
    keywords: dict[str, LiteralValue] = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise _refused(kw.value, "**-unpacking of arguments")
        keywords[kw.arg] = _literal(kw.value)
    where = f"{name} (line {call.lineno})"
    if name == "pyautogui.hotkey":
        bad = sorted(set(keywords) - set(_HOTKEY_KEYWORDS))
        if bad:
            raise ActionError(f"{where}: unexpected keyword argument {bad[0]!r}")
        return _Call(name, keywords, positional, call.lineno)
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
    return _Call(name, bound, positional, call.lineno)


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

    def emit(self, *actions: Action) -> None:
        self.actions.extend(actions)
        if len(self.actions) > MAX_SCRIPT_ACTIONS:
            raise ActionError(f"the code produces more than {MAX_SCRIPT_ACTIONS} actions")

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


def _statement(s: _Script, stmt: ast.stmt) -> None:
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.name not in _MODULES or alias.asname is not None:
                raise _refused(
                    stmt, f"import of {alias.name!r}; only `import pyautogui` and `import time`"
                )
        return
    if isinstance(stmt, ast.ImportFrom):
        raise _refused(stmt, "from-imports; only `import pyautogui` and `import time`")
    if not isinstance(stmt, ast.Expr):
        raise _refused(stmt, "only calls of pyautogui functions and time.sleep are accepted")
    call = stmt.value
    if not isinstance(call, ast.Call):
        raise _refused(call, "only calls of pyautogui functions and time.sleep are accepted")
    name = _qualified_name(call)
    if name not in _SIGNATURES:
        raise unknown_action(
            "pyautogui", name, _SUPPORTED, why=f"unsupported call {name}() (line {call.lineno})"
        )
    s.call(_bind(name, call))


def parse_pyautogui(code: str) -> tuple[Action, ...]:
    """Parse OSWorld pyautogui code into deskvm actions without running it.

    Args:
        code: Python source as an OSWorld pyautogui agent emits it, or ``WAIT`` /
            ``DONE`` / ``FAIL``.

    Returns:
        The actions in order; empty for ``DONE`` / ``FAIL`` or code that does nothing.

    Raises:
        ProtocolError: code ``invalid_code`` (not Python, or too long), ``refused_code``
            (a construct outside the whitelist; the message names it and its line),
            ``unknown_action`` (a pyautogui/time function not in the whitelist; the
            message lists the supported calls); ``ActionError`` for bad arguments.
    """
    if len(code) > MAX_CODE_CHARS:
        raise ProtocolError(f"code is longer than {MAX_CODE_CHARS} characters", code="invalid_code")
    special = code.strip()
    if special == "WAIT":
        return (Wait(ms=min(OSWORLD_WAIT_MS, MAX_WAIT_MS)),)
    if special in ("DONE", "FAIL"):
        return ()
    try:
        tree = ast.parse(code, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ProtocolError(f"code is not valid Python: {exc}", code="invalid_code") from None
    script = _Script()
    for stmt in tree.body:
        _statement(script, stmt)
    return tuple(script.actions)


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
        actions = parse_pyautogui(code)
        if self.screenshot_after_action or not actions:
            return (*actions, Screenshot())
        return actions

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        """OSWorld's step outcome; ``DONE`` / ``FAIL`` end the episode."""
        code = body.get("code")
        special = code.strip() if isinstance(code, str) else ""
        return osworld_step_result(
            results, terminal=special if special in ("DONE", "FAIL") else None
        )
