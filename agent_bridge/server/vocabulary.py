"""Which action vocabulary a WebSocket speaks (``?schema=``): deskvm's own, Anthropic's,
OpenAI's, OSWorld's... (see :mod:`agent_bridge.protocol.vocab`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent_bridge.protocol.actions import Action
from agent_bridge.protocol.messages import parse_deskvm_action
from agent_bridge.protocol.results import Done, Result, to_deskvm_result
from orchestrator.errors import DeskvmError, ProtocolError

__all__ = ["Vocabulary", "load_vocabulary"]


class Vocabulary(Protocol):
    """What the WebSocket handler needs of a vocabulary (see ``protocol/vocab``)."""

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]: ...

    def format_result(
        self, body: Mapping[str, Any], results: Sequence[Result]
    ) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class _DeskvmFallback:
    """deskvm's own actions, used when ``agent_bridge.protocol.vocab`` is not available."""

    name: str = "deskvm"

    def parse(self, body: Mapping[str, Any]) -> tuple[Action, ...]:
        return (parse_deskvm_action(body),)

    def format_result(self, body: Mapping[str, Any], results: Sequence[Result]) -> dict[str, Any]:
        return to_deskvm_result(results[-1] if results else Done())


def load_vocabulary(name: str) -> Vocabulary:
    """The vocabulary for ``?schema=name``.

    Uses ``agent_bridge.protocol.vocab.get_vocabulary`` when that package provides it,
    otherwise only ``deskvm`` is known.

    Raises:
        ProtocolError: code ``unknown_schema``.
    """
    try:
        module = importlib.import_module("agent_bridge.protocol.vocab")
    except ImportError:
        module = None
    get_vocabulary: Callable[[str], Vocabulary] | None = getattr(module, "get_vocabulary", None)
    if get_vocabulary is None:
        if name == "deskvm":
            return _DeskvmFallback()
        raise ProtocolError(
            f"unknown schema {name!r}; this server supports: deskvm", code="unknown_schema"
        )
    try:
        return get_vocabulary(name)
    except ProtocolError as exc:
        if exc.code == "unknown_schema":
            raise
        raise ProtocolError(
            f"unknown schema {name!r}: {exc.message}", code="unknown_schema"
        ) from None
    except (DeskvmError, LookupError, ValueError) as exc:
        detail = exc.message if isinstance(exc, DeskvmError) else str(exc)
        raise ProtocolError(f"unknown schema {name!r}: {detail}", code="unknown_schema") from None
