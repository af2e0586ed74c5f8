"""Action vocabularies: vendor action formats in, deskvm actions out, vendor results back.

A WebSocket connection picks its vocabulary with the URL query parameter ``schema``::

    schema               request body (the message without "id")           vendor
    deskvm (default)     {"action": "click", "x": 10, "y": 20}              deskvm
    computer_20241022    {"action": "left_click", "coordinate": [10, 20]}   Anthropic
    computer_20250124    ... adds scroll, hold_key, wait, triple_click ...  Anthropic
    computer_20251124    ... adds zoom                                      Anthropic
    openai               {"type": "click", "x": 10, "y": 20, ...}           OpenAI computer use
                         or {"actions": [{...}, ...]} (batched)
    computer_13          {"action_type": "CLICK", "parameters": {...}}      OSWorld
    pyautogui            {"code": "pyautogui.click(10, 20)"}                OSWorld, never run

Each is a :class:`Vocabulary`: ``parse(body)`` returns deskvm actions, and
``format_result(body, results)`` shapes the executed actions' results as the vendor's tool
result. Everything here is pure: no I/O, no execution of anything a client sends.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from agent_bridge.protocol.vocab._base import Vocabulary
from agent_bridge.protocol.vocab.anthropic import ACTIONS_BY_VERSION, AnthropicVocabulary
from agent_bridge.protocol.vocab.deskvm import DeskvmVocabulary
from agent_bridge.protocol.vocab.openai import OpenAIVocabulary
from agent_bridge.protocol.vocab.osworld import Computer13Vocabulary
from agent_bridge.protocol.vocab.pyautogui import PyAutoGUIVocabulary, parse_pyautogui
from orchestrator.errors import ProtocolError

__all__ = [
    "ACTIONS_BY_VERSION",
    "DEFAULT_SCHEMA",
    "VOCABULARIES",
    "AnthropicVocabulary",
    "Computer13Vocabulary",
    "DeskvmVocabulary",
    "OpenAIVocabulary",
    "PyAutoGUIVocabulary",
    "Vocabulary",
    "get_vocabulary",
    "parse_pyautogui",
]

DEFAULT_SCHEMA = "deskvm"
"""The vocabulary of a connection whose URL has no ``schema`` parameter."""

_ALL: tuple[Vocabulary, ...] = (
    DeskvmVocabulary(),
    AnthropicVocabulary("computer_20241022"),
    AnthropicVocabulary("computer_20250124"),
    AnthropicVocabulary("computer_20251124"),
    OpenAIVocabulary(),
    Computer13Vocabulary(),
    PyAutoGUIVocabulary(),
)

VOCABULARIES: Mapping[str, Vocabulary] = MappingProxyType({v.name: v for v in _ALL})
"""Every vocabulary with its default options, by ``schema`` name (read-only)."""


def get_vocabulary(name: str | None) -> Vocabulary:
    """The vocabulary for a ``schema`` query value (``None`` or ``""`` means the default).

    Raises:
        ProtocolError: code ``unknown_schema``; the message lists the valid names.
    """
    key = DEFAULT_SCHEMA if name is None or name == "" else name
    try:
        return VOCABULARIES[key]
    except KeyError:
        raise ProtocolError(
            f"unknown schema {name!r}; valid: {', '.join(VOCABULARIES)}", code="unknown_schema"
        ) from None
