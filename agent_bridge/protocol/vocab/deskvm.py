"""``schema=deskvm``: deskvm's own vocabulary, wrapping :func:`parse_deskvm_action`. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent_bridge.protocol.actions import Action
from agent_bridge.protocol.messages import DESKVM_ACTIONS, parse_deskvm_action
from agent_bridge.protocol.results import Done, Result, to_deskvm_result

__all__ = ["DeskvmVocabulary"]


@dataclass(frozen=True, slots=True)
class DeskvmVocabulary:
    """deskvm's native actions, ``{"action": "click", "x": 10, "y": 20}`` (``docs/protocol.md``).

    One request is exactly one action; the result is :func:`to_deskvm_result` of its result.
    """

    name: str = "deskvm"
    supported: tuple[str, ...] = DESKVM_ACTIONS

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]:
        """Parse a deskvm request body.

        Raises:
            ProtocolError: as :func:`~agent_bridge.protocol.messages.parse_deskvm_action`.
        """
        return (parse_deskvm_action(body),)

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        """The deskvm ``result`` object of the (single) action's result."""
        return to_deskvm_result(results[-1] if results else Done())
