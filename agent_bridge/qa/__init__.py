"""Visual QA for deskvm sessions: references, matching, OCR, waits, failure reports.

The session methods (``wait_for``, ``click(ref)``, ``exists``, ``wait_gone``,
``expect_change``, ``wait_still``, ``find_text``, ``read_text``) live on
:class:`agent_bridge.client.Session` through :class:`~agent_bridge.qa.checks.VisualChecks`.
Modules, bottom up (import-linter keeps this order)::

    model     Box, Point, Frame, Match, TextBox... (values, no I/O)
    errors    ReferenceMissing, MatchTimeout, ... with the Evidence of failed checks
    match     the matching core: frames in, matches out (OpenCV, scikit-image)
    refs      refs/<name>.png + .json on disk;  ocr: tesseract through pytesseract
    waits     waits as sans-I/O plans, and the blocking and asyncio drivers
    checks    the session mixins (sync and async)
    report    failure reports (HTML, PNGs, JUnit properties);  needles: openQA import

Names below are loaded on first use, so ``import agent_bridge.qa`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "Box",
    "CheckFailed",
    "Match",
    "MatchTimeout",
    "NoChange",
    "NotStill",
    "OcrUnavailable",
    "Point",
    "QaOptions",
    "RefSpec",
    "RefStore",
    "Reference",
    "ReferenceInvalid",
    "ReferenceMissing",
    "StillVisible",
    "TextNotFound",
]

_WHERE = {
    "Box": "model",
    "Match": "model",
    "Point": "model",
    "CheckFailed": "errors",
    "MatchTimeout": "errors",
    "NoChange": "errors",
    "NotStill": "errors",
    "OcrUnavailable": "errors",
    "ReferenceInvalid": "errors",
    "ReferenceMissing": "errors",
    "StillVisible": "errors",
    "TextNotFound": "errors",
    "RefSpec": "match",
    "Reference": "match",
    "RefStore": "refs",
    "QaOptions": "waits",
}

if TYPE_CHECKING:
    from agent_bridge.qa.errors import (
        CheckFailed,
        MatchTimeout,
        NoChange,
        NotStill,
        OcrUnavailable,
        ReferenceInvalid,
        ReferenceMissing,
        StillVisible,
        TextNotFound,
    )
    from agent_bridge.qa.match import Reference, RefSpec
    from agent_bridge.qa.model import Box, Match, Point
    from agent_bridge.qa.refs import RefStore
    from agent_bridge.qa.waits import QaOptions


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"agent_bridge.qa.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'agent_bridge.qa' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
