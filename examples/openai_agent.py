#!/usr/bin/env python3
"""A minimal OpenAI computer-use agent loop (Responses API) driving a deskvm session.

The WebSocket speaks OpenAI's computer use (``?schema=openai``): each ``computer_call``'s
``action`` (single or batched ``actions``) goes to deskvm unchanged, and deskvm's reply *is*
the ``computer_call_output`` item (a ``computer_screenshot``), which only needs the
``call_id``. With ``--max-long-edge`` screenshots are scaled down and the model's
coordinates are mapped back to display pixels by the server.

    export OPENAI_API_KEY=...   # and a running `deskvm serve`
    python3 examples/openai_agent.py --url http://127.0.0.1:8765 --token $DESKVM_TOKEN \\
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

Model = Callable[[list[dict[str, Any]], str | None], dict[str, Any]]
"""``model(input_items, previous_response_id) -> {"id", "output": [items...]}``."""


def run_agent(session: Session, model: Model, task: str, max_steps: int = 30) -> str:
    """Loop: ask the model, run its computer calls on the session, feed back screenshots.

    Args:
        session: attached with ``schema="openai"`` (see :func:`attach`).
        model: one Responses API call.
        task: the user's instruction.
        max_steps: model calls at most.

    Returns:
        The model's final text (its last output without computer calls).
    """
    items: list[dict[str, Any]] = [{"role": "user", "content": task}]
    previous: str | None = None
    for _ in range(max_steps):
        response = model(items, previous)
        previous = response["id"]
        calls = [o for o in response["output"] if o.get("type") == "computer_call"]
        if not calls:
            return " ".join(
                part.get("text", "")
                for o in response["output"]
                if o.get("type") == "message"
                for part in o.get("content", [])
            )
        items = []
        for call in calls:
            action = {"actions": call["actions"]} if "actions" in call else call["action"]
            try:
                result = session.request(action, timeout_s=120)
            except RemoteError as exc:
                # Nothing ran (or the session refused part of a batch): show the model the
                # screen as it is now, and say why in the next user turn.
                result = session.request({"type": "screenshot"}, timeout_s=120)
                items.append({"role": "user", "content": f"that action failed: {exc.code}: {exc}"})
            output = {**result, "call_id": call["call_id"]}
            if call.get("pending_safety_checks"):
                output["acknowledged_safety_checks"] = call["pending_safety_checks"]
            items.insert(0, output)
    return "(step limit reached)"


def attach(client: Client, session_id: str, max_long_edge: int | None) -> Session:
    """The session, spoken to in OpenAI's computer-use vocabulary."""
    query = {"max_long_edge": str(max_long_edge)} if max_long_edge else None
    return client.attach(session_id, schema="openai", query=query)


def openai_model(width_px: int, height_px: int, model_name: str) -> Model:  # pragma: no cover
    """The real Responses API (needs ``pip install openai`` and ``OPENAI_API_KEY``)."""
    import openai

    api = openai.OpenAI()
    tool = {
        "type": "computer_use_preview",
        "display_width": width_px,
        "display_height": height_px,
        "environment": "linux",
    }

    def call(items: list[dict[str, Any]], previous: str | None) -> dict[str, Any]:
        response = api.responses.create(
            model=model_name,
            tools=[tool],
            input=items,
            previous_response_id=previous,
            truncation="auto",
        )
        return response.model_dump()  # type: ignore[no-any-return]

    return call


def main() -> int:  # pragma: no cover
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task")
    parser.add_argument("--url", default="http://127.0.0.1:8765")
    parser.add_argument("--token", default=os.environ.get("DESKVM_TOKEN", ""))
    parser.add_argument("--model", default="computer-use-preview")
    parser.add_argument("--max-long-edge", type=int, default=1024)
    args = parser.parse_args()
    if not os.environ.get("OPENAI_API_KEY"):
        print("set OPENAI_API_KEY to run against the real API", file=sys.stderr)
        return 2
    from agent_bridge.protocol.scaling import scaled_size

    with Client(args.url, args.token) as client, client.create_session() as created:
        w, h = created.info_at_start.width, created.info_at_start.height
        width, height = scaled_size(w, h, args.max_long_edge) if args.max_long_edge else (w, h)
        session = attach(client, created.id, args.max_long_edge)
        print(run_agent(session, openai_model(width, height, args.model), args.task))
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
