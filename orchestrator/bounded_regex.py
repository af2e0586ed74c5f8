"""Regular expressions with a time bound, for text an agent or a guest controls.

Python's :mod:`re` backtracks without limit: a pattern such as ``(a|aa)+$`` takes time
exponential in the text, so an agent that types 30 characters (or a guest that writes
them) could stall the server. Patterns that operators write and deskvm matches against
such text (approval rules, task checks) are compiled with the ``regex`` package in its
``VERSION0`` mode, which keeps :mod:`re`'s syntax and meaning (``$`` before a final
newline, Unicode ``\\w``/``\\b``/``\\d``, backreferences, lookaround), and every search gets
a deadline. A search past its deadline raises :class:`RegexTimeout`; callers fail closed
(an approval rule that cannot decide holds the action; a task check that cannot decide
fails).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import regex

__all__ = ["BoundedPattern", "RegexError", "RegexTimeout", "compile_bounded"]


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
            RegexTimeout: the deadline passed first (or had passed already).
        """
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise RegexTimeout(self.pattern)
        try:
            return self._compiled.search(text, pos, timeout=left_s)
        except TimeoutError as exc:
            raise RegexTimeout(self.pattern) from exc


def compile_bounded(pattern: str) -> BoundedPattern:
    """Compile ``pattern`` (:mod:`re` syntax and meaning) for bounded searches.

    Raises:
        RegexError: the pattern does not compile.
    """
    try:
        compiled = regex.compile(pattern, regex.VERSION0)
    except regex.error as exc:
        raise RegexError(str(exc)) from exc
    return BoundedPattern(pattern, compiled)
