"""Errors of deskvm's visual QA layer, all under :class:`orchestrator.errors.DeskvmError`.

::

    DeskvmError
    ├── ConfigError
    │   ├── ReferenceMissing     no refs/<name>.png (hint: pytest --deskvm-update-refs)
    │   └── ReferenceInvalid     unreadable PNG, malformed refs/<name>.json, bad needle
    ├── HostSetupError
    │   └── OcrUnavailable       tesseract is not installed (apt-get install tesseract-ocr)
    └── CheckFailed (also an AssertionError: a test that hits one has failed, not erred)
        ├── MatchTimeout         wait_for / click: the reference did not appear in time
        ├── StillVisible         wait_gone: it did not go away in time
        ├── NoChange             expect_change: the region did not change in time
        ├── NotStill             wait_still: the screen did not settle in time
        └── TextNotFound         find_text: OCR did not read the text in time

Every :class:`CheckFailed` carries :class:`Evidence`: the frames, the reference, the best
score and where it was found; the pytest plugin turns it into the failure report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from orchestrator.errors import ConfigError, DeskvmError, HostSetupError

if TYPE_CHECKING:
    from agent_bridge.qa.match import Candidate, Reference
    from agent_bridge.qa.model import Box, Frame, TextBox

__all__ = [
    "CheckFailed",
    "Evidence",
    "MatchTimeout",
    "NoChange",
    "NotStill",
    "OcrUnavailable",
    "ReferenceInvalid",
    "ReferenceMissing",
    "StillVisible",
    "TextNotFound",
]

EvidenceKind = Literal["reference", "gone", "change", "still", "text"]


@dataclass(frozen=True, eq=False)
class Evidence:
    """What a failed check saw, for the failure report.

    Attributes:
        kind: which check failed.
        title: one line, e.g. ``"wait_for('ok_button'): not found within 10.0 s"``.
        frame: the frame the verdict rests on (for a reference: the frame with the best
            score; otherwise the last frame).
        reference: the reference looked for (``reference`` and ``gone`` checks).
        candidate: the best candidate found (score, where) on ``frame``.
        before: the frame taken when an ``expect_change`` block started.
        words: what OCR read on ``frame`` (``text`` checks).
        region: the region the check looked at (``None``: the whole screen).
        details: more figures (``timeout_s``, ``frames``, ``threshold``, ``ssim``...).
    """

    kind: EvidenceKind
    title: str
    frame: Frame | None = None
    reference: Reference | None = None
    candidate: Candidate | None = None
    before: Frame | None = None
    words: tuple[TextBox, ...] = ()
    region: Box | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


class ReferenceMissing(ConfigError):
    """``refs/<name>.png`` does not exist (and references are not being written)."""

    code = "reference_missing"


class ReferenceInvalid(ConfigError):
    """A reference, its JSON or an openQA needle cannot be used (the message says why)."""

    code = "reference_invalid"


class OcrUnavailable(HostSetupError):
    """tesseract is not installed or cannot run (the pytest plugin skips with this reason)."""

    code = "ocr_unavailable"


class CheckFailed(DeskvmError, AssertionError):
    """A visual check did not hold within its time.

    Attributes:
        evidence: what it saw (frames, reference, best score and where).
    """

    code = "check_failed"

    def __init__(self, message: str, *, evidence: Evidence) -> None:
        super().__init__(message)
        self.evidence = evidence


class MatchTimeout(CheckFailed):
    code = "match_timeout"


class StillVisible(CheckFailed):
    code = "still_visible"


class NoChange(CheckFailed):
    code = "no_change"


class NotStill(CheckFailed):
    code = "not_still"


class TextNotFound(CheckFailed):
    code = "text_not_found"
