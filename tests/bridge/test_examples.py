"""The example agent loops (examples/) against a scripted fake model and the fake hypervisor.

In-process bridge server over real HTTP/WebSocket; no real model API is called.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import TOKEN
from fastapi import FastAPI

from agent_bridge.client import Client
from agent_bridge.runtime import BackgroundServer
from orchestrator.display.base import AbsMove, ButtonEvent
from orchestrator.hypervisor.fake import FakeHypervisor

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deskvm_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def client(app: FastAPI) -> Iterator[Client]:
    with BackgroundServer(app) as server, Client(server.url, TOKEN, timeout_s=10) as c:
        yield c


def test_anthropic_loop_with_a_scripted_model(client: Client, hypervisor: FakeHypervisor) -> None:
    example = _load("anthropic_agent")
    created = client.create_session(width=1280, height=800)
    session = example.attach(client, created.id, max_long_edge=1024)
    script = [
        [{"type": "tool_use", "id": "t1", "name": "computer", "input": {"action": "screenshot"}}],
        [{"type": "tool_use", "id": "t2", "name": "computer",
          "input": {"action": "left_click", "coordinate": [512, 320]}}],
        [{"type": "tool_use", "id": "t3", "name": "computer",
          "input": {"action": "type", "text": "hello\n"}},
         {"type": "tool_use", "id": "t4", "name": "computer",
          "input": {"action": "fly", "coordinate": [1, 1]}}],
        [{"type": "text", "text": "done"}],
    ]  # fmt: skip
    seen: list[list[dict[str, Any]]] = []

    def model(messages: list[dict[str, Any]]) -> dict[str, Any]:
        seen.append([dict(m) for m in messages])
        return {"content": script[len(seen) - 1], "stop_reason": "tool_use"}

    assert example.run_agent(session, model, "say hello") == "done"
    session.close()
    first_result = seen[1][-1]["content"][0]
    assert first_result["type"] == "tool_result" and first_result["tool_use_id"] == "t1"
    (image,) = [b for b in first_result["content"] if b["type"] == "image"]
    assert image["source"]["type"] == "base64" and image["source"]["media_type"] == "image/png"
    display = hypervisor.domains[created.id].display
    assert AbsMove(640, 400) in display.events  # scaled 1024x640 -> 1280x800
    assert "hello" in created.guest_log()
    type_result, bad = seen[3][-1]["content"]
    assert type_result["tool_use_id"] == "t3" and "is_error" not in type_result
    assert bad["tool_use_id"] == "t4" and bad["is_error"] is True
    assert "unknown_action" in bad["content"][0]["text"]


def test_openai_loop_with_a_scripted_model(client: Client, hypervisor: FakeHypervisor) -> None:
    example = _load("openai_agent")
    created = client.create_session(width=1280, height=800)
    session = example.attach(client, created.id, max_long_edge=None)
    script = [
        [{"type": "computer_call", "call_id": "c1",
          "action": {"type": "click", "x": 10, "y": 20, "button": "left"},
          "pending_safety_checks": [{"id": "s1", "code": "x", "message": "m"}]}],
        [{"type": "computer_call", "call_id": "c2",
          "actions": [{"type": "drag", "path": [{"x": 1, "y": 1}, {"x": 5, "y": 5}],
                       "keys": ["SHIFT"]},
                      {"type": "type", "text": "hi\n"}]}],
        [{"type": "message", "content": [{"type": "output_text", "text": "done"}]}],
    ]  # fmt: skip
    inputs: list[list[dict[str, Any]]] = []

    def model(items: list[dict[str, Any]], previous: str | None) -> dict[str, Any]:
        inputs.append(items)
        return {"id": f"r{len(inputs)}", "output": script[len(inputs) - 1]}

    assert example.run_agent(session, model, "click and type") == "done"
    session.close()
    (out1,) = inputs[1]
    assert out1["type"] == "computer_call_output" and out1["call_id"] == "c1"
    assert out1["output"]["type"] == "computer_screenshot"
    assert out1["output"]["image_url"].startswith("data:image/png;base64,")
    assert out1["acknowledged_safety_checks"][0]["id"] == "s1"
    display = hypervisor.domains[created.id].display
    assert display.events[:3] == [AbsMove(10, 20), ButtonEvent("left", True),
                                  ButtonEvent("left", False)]  # fmt: skip
    assert "hi" in created.guest_log()
