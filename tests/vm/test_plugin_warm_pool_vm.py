"""The pytest plugin's own server with a warm pool (``--deskvm-warm-pool``): the run waits
for the pool's first desktop, and the test's session is a restored one ("start": "warm")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.settings import Settings


def test_a_run_with_a_warm_pool_starts_its_sessions_warm(tmp_path: Path) -> None:
    image = Settings.from_env().default_image
    (tmp_path / "test_warm.py").write_text(
        "def test_warm(deskvm_session):\n"
        "    info = deskvm_session.info()\n"
        "    assert info['start'] == 'warm', dict(info)\n"
        "    deskvm_session.wait_still(0.5, 30)\n"
    )
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", str(tmp_path / "test_warm.py"),
            "-p", "no:cacheprovider", "-p", "no:randomly", f"--rootdir={tmp_path}",
            f"--deskvm-warm-pool={image}:1", f"--deskvm-artifacts={tmp_path / 'artifacts'}",
        ],
        cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
