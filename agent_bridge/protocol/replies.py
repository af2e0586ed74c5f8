"""Reply extras of the action WebSocket. Pure: values and bytes only.

- ``screenshot_after``: any request may carry ``"screenshot_after": {"still_ms": N,
  "timeout_ms": M}``; after the request's actions, the server waits until the screen has
  been unchanged for ``N`` ms (at most ``M`` ms) and adds that screen to the reply.
- Binary replies (``?images=binary``): a reply holding images is one binary message,
  ``u32 json_bytes | JSON reply | image bytes...`` (big-endian length), where every image
  object has ``"blob": i`` instead of a base64 ``"data"`` and the reply's ``"blobs"`` lists
  each image's byte length in order. Saves the base64 encode/decode and a third of the bytes.

See ``docs/protocol.md``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import ProtocolError

__all__ = [
    "MAX_SETTLE_MS",
    "ScreenshotAfter",
    "decode_binary_reply",
    "encode_binary_reply",
    "split_screenshot_after",
]

MAX_SETTLE_MS = 60_000
"""Longest ``timeout_ms`` (and ``still_ms``) of ``screenshot_after``, milliseconds."""

_LENGTH = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class ScreenshotAfter:
    """Wait for a still screen after the actions, then screenshot it.

    Attributes:
        still_ms: the screen must have been unchanged this long, milliseconds (0..60000).
        timeout_ms: give up waiting after this long (the last screen is returned, flagged
            ``settled: false``), milliseconds (0..60000; default 10000).
    """

    still_ms: int
    timeout_ms: int = 10_000


def split_screenshot_after(
    body: Mapping[str, Any],
) -> tuple[Mapping[str, Any], ScreenshotAfter | None]:
    """The request without its ``screenshot_after`` member, and that member parsed.

    Raises:
        ProtocolError: code ``invalid_action``: not an object, unknown keys, missing or
            out-of-range ``still_ms`` / ``timeout_ms``.
    """
    if "screenshot_after" not in body:
        return body, None
    rest = {k: v for k, v in body.items() if k != "screenshot_after"}
    raw = body["screenshot_after"]
    if not isinstance(raw, Mapping):
        raise ProtocolError(
            'screenshot_after must be an object {"still_ms": N, "timeout_ms": M}',
            code="invalid_action",
        )
    unknown = sorted(set(raw) - {"still_ms", "timeout_ms"})
    if unknown:
        raise ProtocolError(
            f"screenshot_after takes still_ms and timeout_ms, not {', '.join(unknown)}",
            code="invalid_action",
        )
    values = {}
    for name, default in (("still_ms", None), ("timeout_ms", 10_000)):
        value = raw.get(name, default)
        if value is None:
            raise ProtocolError(f"screenshot_after needs {name}", code="invalid_action")
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not (0 <= value <= MAX_SETTLE_MS)
        ):
            raise ProtocolError(
                f"screenshot_after.{name} must be an integer 0..{MAX_SETTLE_MS} (ms), "
                f"not {value!r}",
                code="invalid_action",
            )
        values[name] = value
    return rest, ScreenshotAfter(values["still_ms"], values["timeout_ms"])


def encode_binary_reply(reply: Mapping[str, Any], blobs: Sequence[bytes]) -> bytes:
    """One binary reply message: JSON length, JSON (with ``blobs``), then the images."""
    text = json.dumps({**reply, "blobs": [len(b) for b in blobs]}).encode("utf-8")
    return b"".join((_LENGTH.pack(len(text)), text, *blobs))


def decode_binary_reply(message: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """The JSON reply and its images (``reply["blobs"]`` gives their lengths).

    Raises:
        ProtocolError: code ``invalid_message``: truncated or malformed.
    """
    try:
        (size,) = _LENGTH.unpack_from(message)
        if 4 + size > len(message):
            raise ValueError("truncated")
        reply = json.loads(message[4 : 4 + size])
        offset, blobs = 4 + size, []
        for length in reply.get("blobs", []):
            if offset + int(length) > len(message):
                raise ValueError("truncated")
            blobs.append(message[offset : offset + int(length)])
            offset += int(length)
    except (struct.error, ValueError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"malformed binary reply: {exc}", code="invalid_message") from None
    if not isinstance(reply, dict):
        raise ProtocolError("malformed binary reply: not an object", code="invalid_message")
    return reply, blobs
