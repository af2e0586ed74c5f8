"""Regular expressions matched in linear time, for text an agent or a guest controls.

Python's :mod:`re` backtracks: a pattern such as ``(a+)+$`` takes time exponential in the
text, so an agent that types 30 characters (or a guest that prints them) could stall the
server. Patterns that operators write and deskvm matches against such text (approval
rules, task checks) are compiled with RE2 (``google-re2``), whose matching time is linear
in the text. RE2 takes Python's syntax except backreferences (``\\1``) and lookaround
(``(?=``, ``(?!``, ``(?<=``, ``(?<!``), which it refuses at compile time.
"""

from __future__ import annotations

from typing import Any

import re2

__all__ = ["LinearPattern", "RegexError", "compile_linear"]

LinearPattern = Any
"""A compiled RE2 pattern: ``search(text, pos=0)`` gives a match with ``start()``,
``end()`` and ``group()``, or ``None``, as :class:`re.Pattern` does."""

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is the caller's error, not a log line


class RegexError(ValueError):
    """A pattern RE2 refuses; the message says why and what RE2 does not support."""


def compile_linear(pattern: str) -> LinearPattern:
    """Compile ``pattern`` (Python syntax, less backreferences and lookaround) with RE2.

    Raises:
        RegexError: the pattern does not parse, or uses what RE2 does not support.
    """
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        detail = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise RegexError(
            f"{detail} (patterns are RE2: Python's syntax without backreferences or "
            "lookaround, so matching takes linear time)"
        ) from exc
