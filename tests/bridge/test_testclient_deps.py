"""The in-process bridge tests run without deprecation warnings (issue 10 section 7).

Starlette's TestClient warned on every run: it is built on ``httpx2`` and only falls back
to ``httpx`` with a ``StarletteDeprecationWarning``. The test extras install ``httpx2``.
"""

from __future__ import annotations

import subprocess
import sys


def test_the_test_client_imports_without_a_deprecation_warning() -> None:
    # StarletteDeprecationWarning is a UserWarning (so that it shows): turn every warning
    # into an error.
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import fastapi.testclient"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, (
        "importing the TestClient warned; install the test extras "
        f"(pip install -e '.[test,cluster]', which brings httpx2):\n{result.stderr[-2000:]}"
    )
