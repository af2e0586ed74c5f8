"""The :class:`Vocabulary` seam and the parameter readers the vendor adapters share. Pure.

Every reader raises :class:`~orchestrator.errors.ActionError` (code ``missing_parameter``
or ``invalid_action``) naming the vendor's own parameter, so a model sees its mistake in
its own terms.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from agent_bridge.protocol.actions import MAX_WAIT_MS, Action, Point
from agent_bridge.protocol.keys import MODIFIER_QCODES, KeyCombo, key_to_combo
from agent_bridge.protocol.messages import MAX_TEXT_CHARS, json_type, shown
from agent_bridge.protocol.results import ImageResult, Result
from orchestrator.errors import ActionError, ProtocolError

__all__ = [
    "MAX_SCROLL_NOTCHES",
    "Vocabulary",
    "b64",
    "combo_of",
    "last_image",
    "merge_combos",
    "read_bool",
    "read_number",
    "read_pixel",
    "read_point",
    "read_str",
    "read_text",
    "seconds_to_ms",
    "unknown_action",
]

MAX_SCROLL_NOTCHES = 100
"""Most wheel notches one scroll may turn on either axis (the deskvm parser's limit)."""


@runtime_checkable
class Vocabulary(Protocol):
    """One action vocabulary a WebSocket connection may speak (``?schema=<name>``).

    A vocabulary turns the body of a request (the JSON object without its ``id``, shaped as
    the vendor's model emits it) into deskvm actions, and the results of those actions into
    the vendor-shaped tool result that becomes the reply's ``result``.

    Contract with the server: ``parse`` returns at least one action; the server executes
    them in order (scaling coordinates first if the session scales screenshots) and passes
    one result per executed action, in the same order, to ``format_result``.
    """

    @property
    def name(self) -> str:
        """The ``schema`` query value that selects this vocabulary."""
        ...

    @property
    def supported(self) -> tuple[str, ...]:
        """The action names this vocabulary accepts, as its vendor spells them."""
        ...

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]:
        """Parse one request body into deskvm actions (one vendor action may be several).

        Raises:
            ProtocolError: code ``unknown_action`` (the message lists :attr:`supported`),
                or an :class:`~orchestrator.errors.ActionError` for a bad parameter.
        """
        ...

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        """The vendor-shaped tool result for ``body`` given the results of its actions."""
        ...


def unknown_action(
    schema: str, name: object, supported: Iterable[str], why: str = ""
) -> ProtocolError:
    """A ``ProtocolError`` (code ``unknown_action``) that lists what ``schema`` supports."""
    head = f"unknown action {name!r} for schema {schema!r}" if why == "" else why
    return ProtocolError(f"{head}; supported: {', '.join(supported)}", code="unknown_action")


def _missing(name: str, where: str) -> ActionError:
    return ActionError(f"{where}: missing parameter {name!r}", code="missing_parameter")


def read_number(body: Mapping[str, Any], name: str, where: str) -> float:
    """A finite JSON number (int or float; not a bool) under ``name``.

    Raises:
        ActionError: missing (``missing_parameter``) or not a finite number.
    """
    value = body.get(name)
    if value is None:
        raise _missing(name, where)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ActionError(f"{where}: {name!r} must be a number, got {shown(value)}")
    return float(value)


def read_pixel(value: object, name: str, where: str, *, round_to_pixel: bool) -> int:
    """One coordinate in pixels.

    Args:
        value: the JSON value.
        name: the vendor's parameter name, for messages.
        where: the action, for messages.
        round_to_pixel: round a fractional value to the nearest pixel (half up), as the
            OSWorld schemas allow floats; otherwise a fractional value is an error, as the
            Anthropic and OpenAI schemas declare integers.

    Raises:
        ActionError: not a number, or fractional when ``round_to_pixel`` is false.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ActionError(f"{where}: {name!r} must be a number of pixels, got {shown(value)}")
    if isinstance(value, int):
        return value
    if value.is_integer():
        return int(value)
    if not round_to_pixel:
        raise ActionError(f"{where}: {name!r} must be a whole number of pixels, got {shown(value)}")
    return math.floor(value + 0.5)


def read_str(body: Mapping[str, Any], name: str, where: str) -> str:
    """A string parameter.

    Raises:
        ActionError: missing (``missing_parameter``) or not a string.
    """
    value = body.get(name)
    if value is None:
        raise _missing(name, where)
    if not isinstance(value, str):
        raise ActionError(f"{where}: {name!r} must be a string, got {json_type(value)}")
    return value


def read_text(body: Mapping[str, Any], name: str, where: str) -> str:
    """Text to type: a string of at most ``MAX_TEXT_CHARS`` characters.

    Raises:
        ActionError: missing, not a string, or too long.
    """
    text = read_str(body, name, where)
    if len(text) > MAX_TEXT_CHARS:
        raise ActionError(f"{where}: {name!r} is longer than {MAX_TEXT_CHARS} characters")
    return text


def read_bool(body: Mapping[str, Any], name: str, where: str, default: bool) -> bool:
    """An optional boolean parameter.

    Raises:
        ActionError: present but not true/false.
    """
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ActionError(f"{where}: {name!r} must be true or false, got {shown(value)}")
    return value


def seconds_to_ms(seconds: float, name: str, where: str) -> int:
    """Seconds (vendor unit) to whole milliseconds within ``0..MAX_WAIT_MS``.

    Raises:
        ActionError: negative or longer than ``MAX_WAIT_MS``.
    """
    ms = math.floor(seconds * 1000 + 0.5)
    if not 0 <= ms <= MAX_WAIT_MS:
        raise ActionError(
            f"{where}: {name!r} must be within 0..{MAX_WAIT_MS / 1000:g} seconds,"
            f" got {shown(seconds)}"
        )
    return ms


def merge_combos(combos: Iterable[KeyCombo]) -> KeyCombo:
    """Keys of several combos pressed together: duplicates once, modifiers first."""
    qcodes: list[str] = []
    for combo in combos:
        for qcode in combo.qcodes:
            if qcode not in qcodes:
                qcodes.append(qcode)
    modifiers = [q for q in qcodes if q in MODIFIER_QCODES]
    others = [q for q in qcodes if q not in MODIFIER_QCODES]
    return KeyCombo(tuple(modifiers + others))


def combo_of(names: Sequence[str], *, alias: Callable[[str], KeyCombo] = key_to_combo) -> KeyCombo:
    """One combo from key names pressed together (e.g. OpenAI ``keys: ["CTRL", "C"]``).

    Args:
        names: key names, each resolved by ``alias``.
        alias: resolves one vendor key name to a combo; defaults to the xdotool/common
            spellings of :func:`agent_bridge.protocol.keys.key_to_combo`.

    Raises:
        ActionError: empty list (code ``unknown_key``) or an unknown key name.
    """
    if not names:
        raise ActionError("no keys given", code="unknown_key")
    return merge_combos(alias(name) for name in names)


def b64(data: bytes) -> str:
    """``data`` as base64 text (RFC 4648, standard alphabet, padded)."""
    return base64.b64encode(data).decode("ascii")


def last_image(results: Sequence[Result]) -> ImageResult | None:
    """The last image among ``results`` (the screenshot taken after the actions), if any."""
    for result in reversed(results):
        if isinstance(result, ImageResult):
            return result
    return None


def read_point(value: object, name: str, where: str, *, round_to_pixel: bool) -> Point:
    """A ``[x, y]`` pair of pixels (a JSON array of two numbers).

    Raises:
        ActionError: not a pair of numbers.
    """
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ActionError(f"{where}: {name!r} must be [x, y], got {shown(value)}")
    return (
        read_pixel(value[0], f"{name}[0]", where, round_to_pixel=round_to_pixel),
        read_pixel(value[1], f"{name}[1]", where, round_to_pixel=round_to_pixel),
    )
