"""The vocabulary registry: schema names, defaults, the Vocabulary protocol, the deskvm wrap."""

from __future__ import annotations

import pytest

from agent_bridge.protocol import vocab
from agent_bridge.protocol.actions import Click, Screenshot
from agent_bridge.protocol.messages import DESKVM_ACTIONS
from agent_bridge.protocol.results import CursorResult, Done, ImageResult
from agent_bridge.protocol.vocab import VOCABULARIES, Vocabulary, get_vocabulary
from orchestrator.errors import ProtocolError

SCHEMAS = [
    "deskvm",
    "computer_20241022",
    "computer_20250124",
    "computer_20251124",
    "openai",
    "computer_13",
    "pyautogui",
]


def test_every_schema_of_the_issue_is_registered() -> None:
    assert list(VOCABULARIES) == SCHEMAS


@pytest.mark.parametrize("name", SCHEMAS)
def test_each_vocabulary_follows_the_protocol(name: str) -> None:
    v = get_vocabulary(name)
    assert isinstance(v, Vocabulary)
    assert v.name == name
    assert v.supported and all(isinstance(s, str) for s in v.supported)


@pytest.mark.parametrize("name", [None, ""])
def test_no_schema_means_deskvm(name: str | None) -> None:
    assert get_vocabulary(name).name == "deskvm"


@pytest.mark.parametrize("name", ["anthropic", "computer_20240101", "DESKVM", "openai "])
def test_unknown_schema_lists_the_valid_names(name: str) -> None:
    with pytest.raises(ProtocolError) as info:
        get_vocabulary(name)
    assert info.value.code == "unknown_schema"
    for valid in SCHEMAS:
        assert valid in info.value.message


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("deskvm", {"action": "fly"}),
        ("deskvm", {}),
        ("computer_20241022", {"action": "fly"}),
        ("computer_20241022", {}),
        ("computer_20250124", {"action": 3}),
        ("computer_20251124", {"action": "open_application"}),
        ("openai", {"type": "fly"}),
        ("openai", {}),
        ("openai", {"actions": [{"type": "click", "x": 1, "y": 2}, {"type": "fly"}]}),
        ("computer_13", {"action_type": "FLY"}),
        ("computer_13", {}),
        ("pyautogui", {"code": "pyautogui.screenshot()"}),
    ],
)
def test_unknown_action_in_any_vocabulary_lists_the_supported_ones(
    name: str, body: dict[str, object]
) -> None:
    v = get_vocabulary(name)
    with pytest.raises(ProtocolError) as info:
        v.parse(body)
    assert info.value.code == "unknown_action"
    assert "supported: " in info.value.message
    assert all(s in info.value.message for s in v.supported)


def test_public_names() -> None:
    assert sorted(vocab.__all__) == sorted(
        [
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
    )


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        VOCABULARIES["x"] = VOCABULARIES["deskvm"]  # type: ignore[index]


class TestDeskvm:
    v = get_vocabulary("deskvm")

    def test_wraps_the_deskvm_parser(self) -> None:
        assert self.v.supported == DESKVM_ACTIONS
        assert self.v.parse({"action": "click", "x": 1, "y": 2}) == (Click(1, 2),)
        assert self.v.parse({"action": "screenshot"}) == (Screenshot(),)

    def test_results_keep_the_deskvm_shape(self) -> None:
        body = {"action": "screenshot"}
        image = ImageResult(2, 1, "image/png", b"\x89PNG")
        assert self.v.format_result(body, [image]) == {
            "width": 2,
            "height": 1,
            "mime": "image/png",
            "data": "iVBORw==",
        }
        assert self.v.format_result(body, [CursorResult(3, 4)]) == {"x": 3, "y": 4}
        assert self.v.format_result(body, [Done((("chars", 2),))]) == {"chars": 2}
