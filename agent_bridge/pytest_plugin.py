"""pytest plugin for desktop tests against deskvm sessions (installed with deskvm).

Fixtures:
    deskvm_server: ``(url, token)`` of a bridge. With ``--deskvm-url`` (and
        ``--deskvm-token`` or ``DESKVM_TOKEN``) an existing server is used; otherwise one is
        started in-process on 127.0.0.1 for the run (libvirt: needs root, libvirtd and a
        built image; ``--deskvm-backend fake``: the in-package fake desktop, no VM). Under
        pytest-xdist the controller starts that one server and every worker uses it, one
        session per worker at a time (sessions come from the server's normal create path,
        so its warm pool is used where the server has one: ``--deskvm-warm-pool IMAGE:N``
        gives the run's own server one, as ``deskvm serve --warm-pool``).
    deskvm_client: an :class:`agent_bridge.client.Client` for that server.
    deskvm_session: a fresh session per test, deleted afterwards, with visual checks
        (``wait_for``, ``click(ref)``, ``expect_change``, ``find_text``...) looking up
        references in ``refs/`` beside the test file (ini ``deskvm_refs_dir``). The marker
        ``@pytest.mark.deskvm(image=..., width=..., height=..., autostart=...)`` passes
        arguments to ``create_session``.
    deskvm_refs: that test's :class:`~agent_bridge.qa.refs.RefStore`.

When a test using ``deskvm_session`` fails, ``<artifacts>/<test>/`` receives
``report.html`` (self-contained: expected reference, actual frame and their difference
side by side, best score and where it was found, the recording path with frame number and
time), the PNGs, the last frame, the guest log and console tail. JUnit XML (``--junitxml``)
gets them as ``<property name="deskvm_...">`` on the test case and as
``[[ATTACHMENT|path]]`` lines in its system-out (shown by Jenkins and GitLab; needs
``-o junit_logging=system-out``).

Options (``pytest --help``, group "deskvm"): ``--deskvm-url``, ``--deskvm-token``,
``--deskvm-backend``, ``--deskvm-image``, ``--deskvm-display``, ``--deskvm-update-refs``,
``--deskvm-record``, ``--deskvm-artifacts``, ``--deskvm-require-ocr``, ``--deskvm-warm-pool``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from agent_bridge.client import Client, Session
    from agent_bridge.qa.errors import Evidence
    from agent_bridge.qa.refs import RefStore

__all__ = ["pytest_addoption"]

_RECORD_POLICIES = ("on", "off", "retain-on-failure")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deskvm", "deskvm desktop tests")
    group.addoption(
        "--deskvm-url", default=None, help="Use this bridge server instead of starting one."
    )
    group.addoption(
        "--deskvm-token", default=None, help="Bearer token for --deskvm-url (or DESKVM_TOKEN)."
    )
    group.addoption(
        "--deskvm-backend",
        default="libvirt",
        choices=("libvirt", "fake"),
        help="Server started in-process: real VMs through libvirt (default), or the "
        "in-package fake desktop (no VM; for testing test code).",
    )
    group.addoption(
        "--deskvm-image", default=None, help="Image for deskvm_session (default image if unset)."
    )
    group.addoption(
        "--deskvm-display", default="1280x800", help="Display size WxH for deskvm_session."
    )
    group.addoption(
        "--deskvm-update-refs",
        action="store_true",
        default=False,
        help="Write a missing reference (refs/<name>.png) from the screen once it is still, "
        "instead of failing. Existing references are never overwritten.",
    )
    group.addoption(
        "--deskvm-record",
        default="retain-on-failure",
        choices=_RECORD_POLICIES,
        help="Recordings of the server this run starts: keep every test's (on), only failed "
        "tests' (retain-on-failure, default), or none and no video capture (off). A server "
        "given with --deskvm-url keeps its recordings itself.",
    )
    group.addoption(
        "--deskvm-artifacts",
        default=None,
        help="Directory for failure reports (default: $DESKVM_TEST_ARTIFACTS or ./artifacts).",
    )
    group.addoption(
        "--deskvm-require-ocr",
        action="store_true",
        default=False,
        help="Fail (instead of skip) tests that need OCR when tesseract is missing "
        "(also when the CI or DESKVM_REQUIRE_OCR environment variable is set).",
    )
    group.addoption(
        "--deskvm-warm-pool",
        default=None,
        metavar="IMAGE:N[,IMAGE:N]",
        help="The server this run starts (libvirt backend) keeps N desktops of IMAGE "
        "restored and ready, as `deskvm serve --warm-pool`: sessions of the default size "
        "(1280x800, 2048 MiB, no network) start warm. Default: $DESKVM_WARM_POOL, else none.",
    )
    parser.addini(
        "deskvm_refs_dir", "References directory, relative to each test file.", default="refs"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "deskvm(**kwargs): arguments for deskvm_session's create_session "
        "(image, width, height, autostart, memory_mib, ...)",
    )
    config.stash[_STATE] = _RunState()
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Summary(config), "deskvm-summary")
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(_XdistController(config), "deskvm-xdist-controller")


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is not None:
        state.close()


# --- run-wide state: the in-process server ------------------------------------------------


@dataclass
class _Server:
    url: str
    token: str
    owned: bool  # started by this run: its recordings are ours to delete
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


@dataclass
class _RunState:
    server: _Server | None = None
    error: str | None = None

    def close(self) -> None:
        if self.server is not None:
            self.server.stack.close()
            self.server = None


_STATE = pytest.StashKey[_RunState]()


def _start_server(config: pytest.Config) -> _Server:
    """Start the bridge in-process (libvirt or fake backend), on 127.0.0.1."""
    from agent_bridge.runtime import BackgroundServer, build_manager
    from agent_bridge.server import create_app
    from orchestrator.settings import Settings

    token = secrets.token_urlsafe(24)
    record = config.getoption("--deskvm-record")
    stack = contextlib.ExitStack()
    if config.getoption("--deskvm-backend") == "fake":
        if config.getoption("--deskvm-warm-pool") is not None:
            raise pytest.UsageError("--deskvm-warm-pool needs the libvirt backend")
        root = _artifact_root(config) / "fake-recordings"
        manager, settings = _fake_manager(root, capture_off=record == "off")
    else:
        settings = Settings.from_env()
        warm_pool = config.getoption("--deskvm-warm-pool")
        if warm_pool is not None:
            settings = settings.replace(warm_pool=warm_pool)
        if record == "off":
            settings = settings.replace(capture_fps=0.0)
        manager = build_manager(settings)
        manager.reap()
    server = stack.enter_context(
        BackgroundServer(create_app(manager, token=token, settings=settings))
    )
    if getattr(manager, "pool", None) is not None:
        _wait_pool_ready(manager.pool)
    return _Server(server.url, token, owned=True, stack=stack)


_POOL_READY_TIMEOUT_S = 600.0


def _wait_pool_ready(pool: Any, timeout_s: float = _POOL_READY_TIMEOUT_S) -> None:
    """Before the first test: wait until every warm pool target has one desktop ready (or
    failed, or ``timeout_s`` passed: then sessions boot cold, as the server does)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        targets = pool.status()
        if all(t["ready"] >= 1 or t["phase"] == "failed" for t in targets):
            return
        time.sleep(0.5)


def _fake_manager(root: Path, *, capture_off: bool) -> tuple[Any, Any]:
    """A session manager on the in-package fake hypervisor (a drawn fake desktop); its
    recordings go to ``root/recordings`` (the run's artifacts directory, so a failed test's
    recording sits beside its report and the recording policy prunes the others)."""
    from orchestrator.hypervisor.fake import FakeHypervisor
    from orchestrator.input_plan import Pacing
    from orchestrator.manager import SessionManager
    from orchestrator.settings import Settings
    from orchestrator.spec import BootImage

    def resolve(name: str) -> BootImage:
        return BootImage(
            name=name or "fake-desktop",
            content_hash="0" * 64,
            base_path=root / "base.qcow2",
            kernel_path=root / "vmlinuz",
            initrd_path=root / "initrd.img",
        )

    manager = SessionManager(
        hypervisor=FakeHypervisor(),
        resolve_image=resolve,
        recordings_dir=root / "recordings",
        max_sessions=16,
        capture_fps=0.0 if capture_off else 2.0,
        pacing=Pacing(0, 0, 0, 0, 0),
        ready_poll_s=0.01,
    )
    return manager, Settings(default_image="fake-desktop", state_dir=root)


def _server(config: pytest.Config) -> _Server:
    state = config.stash[_STATE]
    if state.server is not None:
        return state.server
    url = config.getoption("--deskvm-url")
    workerinput = getattr(config, "workerinput", None)
    if url:
        token = config.getoption("--deskvm-token") or os.environ.get("DESKVM_TOKEN")
        if not token:
            raise pytest.UsageError("--deskvm-url needs --deskvm-token or DESKVM_TOKEN")
        if config.getoption("--deskvm-warm-pool") is not None:
            raise pytest.UsageError(
                "--deskvm-warm-pool applies to a server this run starts; the server of "
                "--deskvm-url has its own (deskvm serve --warm-pool)"
            )
        state.server = _Server(str(url), str(token), owned=False)
    elif workerinput is not None and "deskvm_url" in workerinput:
        if workerinput.get("deskvm_error"):
            raise pytest.UsageError(f"deskvm server: {workerinput['deskvm_error']}")
        state.server = _Server(workerinput["deskvm_url"], workerinput["deskvm_token"], owned=True)
    else:
        state.server = _start_server(config)
    return state.server


class _XdistController:
    """On the xdist controller: one server for all workers, started for the first one."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        state = self.config.stash[_STATE]
        if state.server is None and state.error is None:
            try:
                _server(self.config)
            except Exception as exc:  # handed to the workers: tests that need it fail
                state.error = f"{type(exc).__name__}: {exc}"
        if state.server is not None:
            node.workerinput["deskvm_url"] = state.server.url
            node.workerinput["deskvm_token"] = state.server.token
        else:
            node.workerinput["deskvm_url"] = ""
            node.workerinput["deskvm_token"] = ""
            node.workerinput["deskvm_error"] = state.error


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def deskvm_server(pytestconfig: pytest.Config) -> tuple[str, str]:
    server = _server(pytestconfig)
    return server.url, server.token


@pytest.fixture(scope="session")
def deskvm_client(deskvm_server: tuple[str, str]) -> Iterator[Client]:
    from agent_bridge.client import Client

    url, token = deskvm_server
    with Client(url, token) as client:
        yield client


@pytest.fixture
def deskvm_refs(request: pytest.FixtureRequest) -> RefStore:
    from agent_bridge.qa.refs import RefStore

    root = Path(request.path).parent / str(request.config.getini("deskvm_refs_dir"))
    return RefStore(root, update_missing=bool(request.config.getoption("--deskvm-update-refs")))


def _create_kwargs(request: pytest.FixtureRequest) -> dict[str, Any]:
    width, _, height = str(request.config.getoption("--deskvm-display")).partition("x")
    kwargs: dict[str, Any] = {
        "image": request.config.getoption("--deskvm-image"),
        "width": int(width),
        "height": int(height),
    }
    for marker in reversed(list(request.node.iter_markers("deskvm"))):
        kwargs.update(marker.kwargs)
    return kwargs


@pytest.fixture
def deskvm_session(
    request: pytest.FixtureRequest, deskvm_client: Client, deskvm_refs: RefStore
) -> Iterator[Session]:
    from agent_bridge.qa.waits import QaOptions

    session = deskvm_client.create_session(**_create_kwargs(request))
    session.qa = QaOptions(refs=deskvm_refs)
    written_before = len(deskvm_refs.written)
    try:
        yield session
    finally:
        _finish(request, session, deskvm_refs.written[written_before:])


# --- after a test ---------------------------------------------------------------------------


def _artifact_root(config: pytest.Config) -> Path:
    root = Path(
        config.getoption("--deskvm-artifacts")
        or os.environ.get("DESKVM_TEST_ARTIFACTS")
        or "artifacts"
    )
    return root if root.is_absolute() else Path(config.invocation_params.dir) / root


def _artifact_dir(config: pytest.Config, node_name: str) -> Path:
    return _artifact_root(config) / re.sub(r"[^A-Za-z0-9_.-]+", "_", node_name)


def _evidence(exc: BaseException | None) -> list[Evidence]:
    """The evidence of every failed check in an exception and its causes."""
    from agent_bridge.qa.errors import CheckFailed

    out: list[Evidence] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CheckFailed):
            out.append(exc.evidence)
        exc = exc.__cause__ or exc.__context__
    return out


def _finish(request: pytest.FixtureRequest, session: Session, refs_written: list[Path]) -> None:
    item = request.node
    config = request.config
    state = config.stash[_STATE]
    call = getattr(item, "deskvm_rep_call", None)
    failed = call is not None and call.failed
    record = config.getoption("--deskvm-record")
    where = _artifact_dir(config, item.name)
    info: dict[str, Any] = {}
    report = None
    for path in refs_written:
        item.user_properties.append(("deskvm_ref_written", str(path)))
    if failed:
        info = _dump_live_artifacts(session, where)
        report = _write_report(item, session, where, info, record)
    else:
        with contextlib.suppress(Exception):
            info = dict(session.info())
    with contextlib.suppress(Exception):
        session.delete()
    recording = info.get("recording")
    if failed:
        _copy_recording_files(info, where)
    if recording and (record == "on" or failed) and report is None:
        item.user_properties.append(("deskvm_recording", str(recording)))
    server = state.server
    keep = record == "on" or (record == "retain-on-failure" and failed)
    if recording and not keep and server is not None and server.owned:
        shutil.rmtree(str(recording), ignore_errors=True)
    if report is not None:
        item.user_properties.extend(report.properties.items())
        lines = [f"deskvm failure report: {report.html}"]
        for role in ("side_by_side", "expected", "actual", "diff", "last_frame"):
            if role in report.images:
                lines.append(f"[[ATTACHMENT|{report.images[role].resolve()}]]")
        lines.append(f"[[ATTACHMENT|{report.html.resolve()}]]")
        item.add_report_section("teardown", "stdout", "\n".join(lines) + "\n")


def _write_report(
    item: pytest.Item, session: Session, where: Path, info: dict[str, Any], record: str
) -> Any:
    from agent_bridge.qa.report import write_report

    call = item.deskvm_rep_call  # type: ignore[attr-defined]
    excinfo = getattr(item, "deskvm_excinfo", None)
    last = None
    with contextlib.suppress(Exception):
        last = session._qa_frame()
    notes = []
    if record == "off":
        notes.append("The recording was deleted after the test (--deskvm-record off).")
    try:
        return write_report(
            where,
            test_id=item.nodeid,
            message=call.longreprtext,
            evidence=_evidence(excinfo.value if excinfo is not None else None),
            last_frame=last,
            recording=info.get("recording"),
            session_id=session.id,
            notes=notes,
        )
    except Exception as exc:  # a report must never hide the failure itself
        item.add_report_section("teardown", "deskvm", f"could not write the report: {exc!r}")
        return None


def _dump_live_artifacts(session: Session, where: Path) -> dict[str, Any]:
    where.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        (where / "guest.log").write_text(session.guest_log())
    with contextlib.suppress(Exception):
        info = dict(session.info())
        (where / "session.json").write_text(json.dumps(dict(info), indent=2))
    return info


def _copy_recording_files(info: dict[str, Any], where: Path) -> None:
    """After teardown the recording holds the console tail; copy it beside the report."""
    recording = Path(str(info.get("recording", "")))
    for name in ("console.log", "guest.log", "events.jsonl", "manifest.json"):
        with contextlib.suppress(OSError):
            if (recording / name).is_file():
                (where / name).write_bytes((recording / name).read_bytes())


# --- hooks ----------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"deskvm_rep_{report.when}", report)
    if report.when == "call" and call.excinfo is not None:
        item.deskvm_excinfo = call.excinfo  # type: ignore[attr-defined]
    return report


def _ocr_required(config: pytest.Config) -> bool:
    return bool(
        config.getoption("--deskvm-require-ocr")
        or os.environ.get("CI")
        or os.environ.get("DESKVM_REQUIRE_OCR")
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    from agent_bridge.qa.errors import OcrUnavailable

    try:
        return (yield)
    except OcrUnavailable as exc:
        if _ocr_required(item.config):
            raise
        pytest.skip(f"OCR unavailable: {exc.message}")


class _Summary:
    """Collects report paths and written references from test reports (on the xdist
    controller too: worker reports carry their user_properties) and lists them at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.reports: list[str] = []
        self.refs_written: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        for name, value in report.user_properties:
            if name == "deskvm_report":
                self.reports.append(str(value))
            elif name == "deskvm_ref_written":
                self.refs_written.append(str(value))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.reports:
            terminalreporter.section("deskvm failure reports")
            for path in dict.fromkeys(self.reports):
                terminalreporter.line(path)
        if self.refs_written:
            terminalreporter.section("deskvm references written")
            for path in dict.fromkeys(self.refs_written):
                terminalreporter.line(f"{path}  (new: check it; crop it or set its match areas)")
        config = self.config
        if config.getoption("--deskvm-url") and config.getoption("--deskvm-record") != "on":
            state = config.stash.get(_STATE, None)
            if state is not None and state.server is not None:
                terminalreporter.line(
                    "deskvm: the recordings of the --deskvm-url server stay there "
                    "(--deskvm-record applies to a server this run starts)"
                )
