"""Regular expressions with a time bound, for text an agent or a guest controls.

Python's :mod:`re` backtracks without limit: a pattern such as ``(a|aa)+$`` takes time
exponential in the text, so an agent that types 30 characters (or a guest that writes
them) could stall the server. Patterns that operators write and deskvm matches against
such text (approval rules, task checks) must be patterns :mod:`re` compiles; they are
compiled with the ``regex`` package in its ``VERSION0`` mode, which keeps :mod:`re`'s
meaning (``$`` before a final newline, Unicode ``\\w``/``\\b``/``\\d``, backreferences,
lookaround; its Unicode data is newer, so a few rare characters class differently), and
every search gets a deadline. A search past its deadline (or out of memory) raises
:class:`RegexTimeout`; callers fail closed (an approval rule that cannot decide holds the
action; a task check that cannot decide fails).
"""

from __future__ import annotations

import re
import re._parser as _re_parser  # the parse tree, for the repeat limits
import time
from dataclasses import dataclass, field
from typing import Any

import regex

__all__ = [
    "MAX_EXPANSION",
    "MAX_REPEAT",
    "BoundedPattern",
    "RegexError",
    "RegexTimeout",
    "compile_bounded",
]

_MAXREPEAT = _re_parser.MAXREPEAT


class RegexError(ValueError):
    """A pattern that does not compile; the message says why."""


class RegexTimeout(Exception):
    """A search ran past its deadline (the pattern backtracks on this text)."""

    def __init__(self, pattern: str) -> None:
        super().__init__(f"pattern {pattern!r} did not finish before its deadline")
        self.pattern = pattern


@dataclass(frozen=True, slots=True)
class BoundedPattern:
    """A compiled pattern whose searches stop at a deadline.

    Attributes:
        pattern: the source text, as written.
    """

    pattern: str
    _compiled: Any = field(repr=False, compare=False)

    def search(self, text: str, pos: int = 0, *, deadline: float) -> Any:
        """:meth:`re.Pattern.search` from ``pos``, stopped at ``deadline``.

        Args:
            deadline: a :func:`time.monotonic` value, seconds.

        Returns:
            A match (``start()``, ``end()``, ``group()``) or ``None``.

        Raises:
            RegexTimeout: the deadline passed first (or had passed already), or the search
                ran out of memory: it could not decide.
        """
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise RegexTimeout(self.pattern)
        try:
            return self._compiled.search(text, pos, timeout=left_s)
        except (TimeoutError, MemoryError, RecursionError) as exc:
            raise RegexTimeout(self.pattern) from exc


MAX_REPEAT = 1000
"""Largest repeat count (``{n}``, ``{n,m}``) a pattern may give, as RE2 allows."""
MAX_EXPANSION = 100_000
"""Largest product of nested minimum repeat counts (``(x{100}){100}``): ``regex``
expands them when it compiles (``x{100000000}`` took over 1.4 GB)."""

_COMPILE_ERRORS = (regex.error, re.error, ValueError, OverflowError, RecursionError, MemoryError)


def _check_repeats(items: Any, outer: int = 1) -> None:
    """Walk :mod:`re`'s parse tree, refusing repeat counts past the limits."""
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], tuple):
            op, args = item
            if str(op) in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                low, high, sub = args
                for count in (low, high):
                    if count is not _MAXREPEAT and count > MAX_REPEAT:
                        raise RegexError(f"repeat count {count} is over {MAX_REPEAT}")
                if outer * max(low, 1) > MAX_EXPANSION:
                    raise RegexError(f"nested repeats expand past {MAX_EXPANSION}")
                _check_repeats(sub, outer * max(low, 1))
                continue
            _check_repeats(args, outer)
        elif isinstance(item, (list, tuple)) or hasattr(item, "data"):
            _check_repeats(getattr(item, "data", item), outer)


_REPEAT_BRACES = re.compile(r"\{(\d+(,\d*)?|,\d+)\}")


def _bare_brace(pattern: str) -> int | None:
    """The position of the first ``{`` outside character sets that is neither escaped nor
    a repeat count (``{n}``, ``{n,}``, ``{n,m}``, ``{,m}``); ``None`` if there is none."""
    i, in_set = 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_set:
            in_set = char != "]"
        elif char == "[":
            in_set = True
            if pattern[i + 1 : i + 2] == "^":
                i += 1
            if pattern[i + 1 : i + 2] == "]":
                i += 1  # a leading ] is a member
        elif char == "{" and not _REPEAT_BRACES.match(pattern, i):
            return i
        i += 1
    return None


def compile_bounded(pattern: str) -> BoundedPattern:
    """Compile ``pattern`` for bounded searches.

    It must be a pattern :mod:`re` compiles (``regex``'s own additions, such as recursion
    ``(?R)`` or ``\\p{..}``, are refused with :mod:`re`'s error), with a literal brace
    written ``\\{`` (``regex`` may read a bare one as fuzzy matching), repeat counts of at
    most :data:`MAX_REPEAT` and nested ones expanding to at most :data:`MAX_EXPANSION`.

    Raises:
        RegexError: the pattern does not compile, or is past those limits.
    """
    try:
        re.compile(pattern)
        tree = _re_parser.parse(pattern).data
        _check_repeats(tree)
        brace = _bare_brace(pattern)
        if brace is not None:
            # re reads a "{" that starts no repeat count literally; regex may read it as
            # fuzzy matching ("sudo{e<=1}" matches "sud"). Written \{, both read it alike.
            raise RegexError(
                f"write \\{{ for a literal brace (position {brace}: a bare {{ that is no "
                "repeat count may read as fuzzy matching)"
            )
        compiled = regex.compile(pattern, regex.VERSION0)
    except RegexError:
        raise
    except _COMPILE_ERRORS as exc:
        raise RegexError(str(exc) or type(exc).__name__) from exc
    return BoundedPattern(pattern, compiled)
