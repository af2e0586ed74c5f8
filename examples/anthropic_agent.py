#!/usr/bin/env python3
"""A minimal Anthropic computer-use agent loop driving a deskvm session.

The WebSocket speaks Anthropic's computer tool (``?schema=computer_20250124``): each
``tool_use`` block's ``input`` goes to deskvm unchanged, and deskvm's reply *is* the
``tool_result`` block (base64 PNG image blocks), which only needs the ``tool_use_id``.
With ``--max-long-edge`` screenshots are scaled down and the model's coordinates are mapped
back to display pixels by the server.

    export ANTHROPIC_API_KEY=...   # and a running `deskvm serve`
    python3 examples/anthropic_agent.py --url http://127.0.0.1:8765 --token $DESKVM_TOKEN \\
        "Open a terminal and print the kernel version"

:func:`run_agent` takes any ``model`` callable, so tests drive it with a scripted fake.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from agent_bridge.client import Client, RemoteError, Session
from orchestrator.interrupt import run_main

TOOL_VERSION = "computer_20250124"
BETA = "computer-use-2025-01-24"

Model = Callable[[list[dict[str, Any]]], dict[str, Any]]
"""``model(messages) -> {"content": [blocks...], "stop_reason": ...}`` (Messages API shape)."""


def run_agent(session: Session, model: Model, task: str, max_steps: int = 30) -> str:
    """Loop: ask the model, run its tool calls on the session, feed back the results.

    Args:
        session: attached with ``schema=computer_2025…`` (see :func:`attach`).
        model: returns one assistant message for the conversation so far.
        task: the user's instruction.
        max_steps: model calls at most.

    Returns:
        The model's final text (its last message without tool calls).
    """
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    for _ in range(max_steps):
        reply = model(messages)
        content = reply["content"]
        messages.append({"role": "assistant", "content": content})
        calls = [b for b in content if b.get("type") == "tool_use"]
        if not calls:
            return " ".join(b.get("text", "") for b in content if b.get("type") == "text")
        results = []
        for call in calls:
            try:
                result = session.request(call["input"], timeout_s=120)
                results.append({**result, "tool_use_id": call["id"]})
            except RemoteError as exc:  # the session lives on; tell the model what was wrong
                results.append(
                    {
                        "type": "tool_result",
                        "tool_use_id": call["id"],
                        "is_error": True,
                        "content": [{"type": "text", "text": f"{exc.code}: {exc}"}],
                    }
                )
        messages.append({"role": "user", "content": results})
    return "(step limit reached)"


def attach(client: Client, session_id: str, max_long_edge: int | None) -> Session:
    """The session, spoken to in Anthropic's computer tool vocabulary."""
    query = {"max_long_edge": str(max_long_edge)} if max_long_edge else None
    return client.attach(session_id, schema=TOOL_VERSION, query=query)


def anthropic_model(width_px: int, height_px: int, model_name: str) -> Model:  # pragma: no cover
    """The real Messages API (needs ``pip install anthropic`` and ``ANTHROPIC_API_KEY``)."""
    import anthropic

    api = anthropic.Anthropic()
    tool = {
        "type": TOOL_VERSION,
        "name": "computer",
        "display_width_px": width_px,
        "display_height_px": height_px,
    }

    def call(messages: list[dict[str, Any]]) -> dict[str, Any]:
        response = api.beta.messages.create(
            model=model_name, max_tokens=1024, tools=[tool], messages=messages, betas=[BETA]
        )
        return response.model_dump()  # type: ignore[no-any-return]

    return call


def main() -> int:  # pragma: no cover
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task")
    parser.add_argument("--url", default="http://127.0.0.1:8765")
    parser.add_argument("--token", default=os.environ.get("DESKVM_TOKEN", ""))
    parser.add_argument("--model", default="claude-sonnet-4-5")
    parser.add_argument("--max-long-edge", type=int, default=1024)
    args = parser.parse_args()
    if not os.environ.get("ANTHROPIC_API_KEY"):
        print("set ANTHROPIC_API_KEY to run against the real API", file=sys.stderr)
        return 2
    with Client(args.url, args.token) as client, client.create_session() as created:
        session = attach(client, created.id, args.max_long_edge)
        width, height = _client_size(created, args.max_long_edge)
        print(run_agent(session, anthropic_model(width, height, args.model), args.task))
        session.close()
    return 0


def _client_size(session: Session, max_long_edge: int | None) -> tuple[int, int]:
    from agent_bridge.protocol.scaling import scaled_size

    w, h = session.info_at_start.width, session.info_at_start.height
    return scaled_size(w, h, max_long_edge) if max_long_edge else (w, h)


if __name__ == "__main__":
    sys.exit(run_main(main))
