"""Reply extras: screenshot_after parsing and the binary reply format (pure)."""

from __future__ import annotations

import json

import pytest

from agent_bridge.protocol.replies import (
    ScreenshotAfter,
    decode_binary_reply,
    encode_binary_reply,
    split_screenshot_after,
)
from orchestrator.errors import ProtocolError


def test_screenshot_after_is_split_from_the_request() -> None:
    body = {"action": "click", "x": 1, "y": 2, "screenshot_after": {"still_ms": 300}}
    rest, after = split_screenshot_after(body)
    assert rest == {"action": "click", "x": 1, "y": 2}
    assert after == ScreenshotAfter(still_ms=300, timeout_ms=10_000)
    assert split_screenshot_after({"action": "move"}) == ({"action": "move"}, None)
    _, after = split_screenshot_after({"screenshot_after": {"still_ms": 0, "timeout_ms": 50}})
    assert after == ScreenshotAfter(0, 50)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (300, "must be an object"),
        ({}, "needs still_ms"),
        ({"still_ms": 100, "still": 1}, "not still"),
        ({"still_ms": -1}, "still_ms must be an integer"),
        ({"still_ms": True}, "still_ms must be an integer"),
        ({"still_ms": 100, "timeout_ms": 60_001}, "timeout_ms must be an integer 0..60000"),
        ({"still_ms": 1.5}, "still_ms"),
    ],
)
def test_bad_screenshot_after_is_refused(value: object, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle) as error:
        split_screenshot_after({"action": "move", "screenshot_after": value})
    assert error.value.code == "invalid_action"


def test_binary_reply_round_trip() -> None:
    reply = {"id": 3, "ok": True, "result": {"width": 2, "height": 1, "blob": 0}}
    message = encode_binary_reply(reply, [b"\x89PNG..", b"second"])
    size = int.from_bytes(message[:4], "big")
    assert json.loads(message[4 : 4 + size])["blobs"] == [6, 6]
    got, blobs = decode_binary_reply(message)
    assert got == {**reply, "blobs": [6, 6]} and blobs == [b"\x89PNG..", b"second"]


@pytest.mark.parametrize("message", [b"", b"\x00\x00\x00\x09{}", b"\x00\x00\x00\x02[]",
                                     b'\x00\x00\x00\x0d{"blobs":[9]}abc'])  # fmt: skip
def test_malformed_binary_replies(message: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_binary_reply(message)
