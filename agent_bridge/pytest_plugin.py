"""pytest plugin for scripted desktop tests against real deskvm sessions.

Fixtures:
    deskvm_server: ``(url, token)`` of a bridge. With ``--deskvm-url`` (and
        ``--deskvm-token`` or ``DESKVM_TOKEN``) an existing server is used; otherwise one is
        started in-process on 127.0.0.1 for the test run (needs root, libvirtd, a built image).
    deskvm_client: an :class:`agent_bridge.client.Client` for that server.
    deskvm_session: a fresh session per test, deleted afterwards. When the test fails, the
        console tail, the last frame and the recording path are written to
        ``$DESKVM_TEST_ARTIFACTS/<test name>/`` (default ``./artifacts``).

Options: ``--deskvm-url``, ``--deskvm-token``, ``--deskvm-image``, ``--deskvm-display WxH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["pytest_addoption"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deskvm")
    group.addoption(
        "--deskvm-url", default=None, help="Use this bridge server instead of starting one."
    )
    group.addoption(
        "--deskvm-token", default=None, help="Bearer token for --deskvm-url (or DESKVM_TOKEN)."
    )
    group.addoption(
        "--deskvm-image", default=None, help="Image for deskvm_session (default image if unset)."
    )
    group.addoption(
        "--deskvm-display", default="1280x800", help="Display size WxH for deskvm_session."
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"deskvm_rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def deskvm_server(pytestconfig: pytest.Config) -> Iterator[tuple[str, str]]:
    url = pytestconfig.getoption("--deskvm-url")
    if url:
        token = pytestconfig.getoption("--deskvm-token") or os.environ.get("DESKVM_TOKEN")
        if not token:
            raise pytest.UsageError("--deskvm-url needs --deskvm-token or DESKVM_TOKEN")
        yield url, token
        return
    import secrets

    from agent_bridge.runtime import BackgroundServer, build_manager
    from agent_bridge.server import create_app
    from orchestrator.settings import Settings

    settings = Settings.from_env()
    manager = build_manager(settings)
    manager.reap()
    token = secrets.token_urlsafe(24)
    with BackgroundServer(create_app(manager, token=token, settings=settings)) as server:
        yield server.url, token


@pytest.fixture(scope="session")
def deskvm_client(deskvm_server: tuple[str, str]) -> Iterator[Any]:
    from agent_bridge.client import Client

    url, token = deskvm_server
    with Client(url, token) as client:
        yield client


def _artifact_dir(node_name: str) -> Path:
    root = Path(os.environ.get("DESKVM_TEST_ARTIFACTS", "artifacts"))
    return root / re.sub(r"[^A-Za-z0-9_.-]+", "_", node_name)


@pytest.fixture
def deskvm_session(request: pytest.FixtureRequest, deskvm_client: Any) -> Iterator[Any]:
    width, _, height = str(request.config.getoption("--deskvm-display")).partition("x")
    session = deskvm_client.create_session(
        image=request.config.getoption("--deskvm-image"), width=int(width), height=int(height)
    )
    try:
        yield session
    finally:
        call = getattr(request.node, "deskvm_rep_call", None)
        failed = call is not None and call.failed
        where = _artifact_dir(request.node.name)
        info: dict[str, Any] = {}
        if failed:
            info = _dump_live_artifacts(session, where)
        with contextlib.suppress(Exception):
            session.delete()
        if failed:
            _copy_recording_files(info, where)


def _dump_live_artifacts(session: Any, where: Path) -> dict[str, Any]:
    where.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        (where / "last-frame.png").write_bytes(session.screenshot().png)
    with contextlib.suppress(Exception):
        (where / "guest.log").write_text(session.guest_log())
    with contextlib.suppress(Exception):
        info = dict(session.info())
        (where / "session.json").write_text(json.dumps(dict(info), indent=2))
    return info


def _copy_recording_files(info: dict[str, Any], where: Path) -> None:
    """After teardown the recording holds the console tail; copy it beside the frame."""
    recording = Path(str(info.get("recording", "")))
    for name in ("console.log", "guest.log", "events.jsonl", "manifest.json"):
        with contextlib.suppress(OSError):
            if (recording / name).is_file():
                (where / name).write_bytes((recording / name).read_bytes())
    print(f"\ndeskvm artifacts: {where} (recording: {info.get('recording')})")
