"""The pytest plugin, run by pytester against the fake backend (no VM): matching,
timeouts, update-refs, reports (HTML, PNGs, JUnit XML), recording policy, OCR skips, xdist."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PIL import Image

from orchestrator.display.fake import FakeDisplay

pytest_plugins = ["pytester"]

FAKE = ["--deskvm-backend", "fake", "-p", "no:cacheprovider", "-p", "no:randomly"]


def fake_screen(typed: str = "") -> Image.Image:
    """What the fake desktop shows (1280x800) after ``typed`` was typed, pointer at 0,0."""
    display = FakeDisplay(1280, 800)
    display.type_text(typed)
    return display.screendump()


def save_crop(path: Path, image: Image.Image, box: tuple[int, int, int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.crop(box).save(path)


@pytest.fixture(scope="module", autouse=True)
def _loaded(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Import what a run of the plugin imports lazily (server, uvicorn protocols) once in
    this process: pytester's in-process runs unload modules first imported inside them,
    and a half-unloaded uvicorn fails the next run's WebSocket upgrades."""
    from agent_bridge.pytest_plugin import _fake_manager, _start_server  # noqa: F401
    from agent_bridge.runtime import BackgroundServer
    from agent_bridge.server import create_app

    manager, settings = _fake_manager(tmp_path_factory.mktemp("fake"), capture_off=True)
    with BackgroundServer(create_app(manager, token="t" * 24, settings=settings)) as server:
        from agent_bridge.client import Client

        with Client(server.url, "t" * 24) as client, client.create_session() as session:
            session.wait_still(0.1, 1)


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in ("CI", "DESKVM_REQUIRE_OCR", "DESKVM_TEST_ARTIFACTS"):
        monkeypatch.delenv(name, raising=False)
    # the line with "hello" typed (x 160..400 of the prompt line)
    save_crop(pytester.path / "refs" / "hello_line.png", fake_screen("hello"), (160, 100, 400, 120))
    save_crop(pytester.path / "refs" / "hello_word.png", fake_screen("hello"), (248, 102, 276, 116))
    save_crop(pytester.path / "refs" / "goodbye.png", fake_screen("goodbye"), (160, 100, 400, 120))
    return pytester


def junit(path: Path) -> dict[str, ET.Element]:
    root = ET.parse(path).getroot()
    return {case.get("name", ""): case for case in root.iter("testcase")}


def properties(case: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def test_wait_for_click_exists_and_the_match_values(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        """
        def test_flow(deskvm_session):
            s = deskvm_session
            assert s.exists("hello_line") is None
            s.type("hello")
            m = s.wait_for("hello_line", timeout_s=5)
            assert (m.box.x, m.box.y, m.box.width, m.box.height) == (160, 100, 240, 20)
            assert m.score > 0.99 and m.name == "hello_line"
            assert m.frame_seq is not None and m.t_s is not None and m.t_s > 0
            clicked = s.click("hello_word")
            assert s.cursor_position() == (clicked.click_point.x, clicked.click_point.y)
            assert s.exists("goodbye") is None
            s.click(10, 10)  # coordinates still work
            assert s.cursor_position() == (10, 10)
        """
    )
    result = suite.runpytest(*FAKE)
    result.assert_outcomes(passed=1)


def test_a_timeout_fails_with_a_report_and_junit_properties(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_fail="""
        def test_goodbye(deskvm_session):
            deskvm_session.type("hello")
            deskvm_session.wait_for("goodbye", timeout_s=1.0)
        """
    )
    result = suite.runpytest(
        *FAKE, "--junitxml=junit.xml", "-o", "junit_logging=system-out", "-o", "junit_family=xunit2"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*MatchTimeout: wait_for('goodbye'): not on the screen within 1 s*best score*",
            "*deskvm failure reports*",
            "*artifacts/test_goodbye/report.html",
        ]
    )
    case = junit(suite.path / "junit.xml")["test_goodbye"]
    props = properties(case)
    where = suite.path / "artifacts" / "test_goodbye"
    assert props["deskvm_report"] == str(where / "report.html")
    assert props["deskvm_check"] == "reference"
    assert 0.5 < float(props["deskvm_best_score"]) < 0.95  # same line, other word
    assert props["deskvm_best_box"] == "160,100,400,120"
    for role in ("expected", "actual", "diff", "side_by_side", "last_frame"):
        assert Path(props[f"deskvm_{role}"]).is_file(), role
    system_out = case.findtext("system-out") or ""
    attachments = re.findall(r"\[\[ATTACHMENT\|(.+?)\]\]", system_out)
    assert str(where / "report.html") in attachments
    assert str(where / "side-by-side.png") in attachments

    # the frame number and time point into the recording, which was kept (test failed)
    recording = Path(props["deskvm_recording"])
    seq, t_s = int(props["deskvm_frame_seq"]), float(props["deskvm_t_s"])
    manifest = json.loads((recording / "manifest.json").read_text())
    events = [json.loads(line) for line in (recording / "events.jsonl").read_text().splitlines()]
    event = events[seq]
    assert event["kind"] == "frame"
    assert (event["data"]["pts_ns"] - manifest["monotonic_origin_ns"]) / 1e9 == pytest.approx(
        t_s, abs=1e-3
    )
    # the report page is self-contained and says all of it
    html = (where / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4  # expected, actual, diff, last frame
    for text in ("best score", "threshold 0.95", str(recording), f"frame {seq} at",
                 "deskvm replay frames", "refs/goodbye.png", "difference"):  # fmt: skip
        assert text in html, text
    with Image.open(where / "side-by-side.png") as image:
        assert image.width > 3 * image.height  # three panels


def test_update_refs_writes_missing_references_and_never_overwrites(
    suite: pytest.Pytester,
) -> None:
    suite.makepyfile(
        """
        def test_prompt(deskvm_session):
            deskvm_session.type("abc")
            m = deskvm_session.wait_for("prompt", timeout_s=5, region=(160, 100, 400, 120))
            assert (m.box.x, m.box.y) == (160, 100)
        """
    )
    missing = suite.runpytest(*FAKE)
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*ReferenceMissing*--deskvm-update-refs*"])

    written = suite.runpytest(*FAKE, "--deskvm-update-refs")
    written.assert_outcomes(passed=1)
    written.stdout.fnmatch_lines(["*deskvm references written*", "*refs/prompt.png*"])
    png = suite.path / "refs" / "prompt.png"
    spec = json.loads((suite.path / "refs" / "prompt.json").read_text())
    assert spec["match"] == [{"x": 160, "y": 100, "width": 240, "height": 20}]
    assert "written by --deskvm-update-refs from frame" in spec["source"]
    with Image.open(png) as image:
        assert image.size == (1280, 800)  # the whole frame; the JSON names the area
    content = png.read_bytes()

    assert suite.runpytest(*FAKE).ret == 0  # now it is a reference like any other

    suite.makepyfile(
        """
        def test_prompt(deskvm_session):
            deskvm_session.type("xyz")  # the screen differs from the reference now
            deskvm_session.wait_for("prompt", timeout_s=1, region=(160, 100, 400, 120))
        """
    )
    kept = suite.runpytest(*FAKE, "--deskvm-update-refs")
    kept.assert_outcomes(failed=1)  # an existing reference is compared, never rewritten
    assert png.read_bytes() == content


def test_expect_change_wait_still_and_ocr(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        """
        import re
        import pytest
        from agent_bridge.qa.errors import NoChange

        def test_text(deskvm_session):
            s = deskvm_session
            with s.expect_change(region=(160, 100, 640, 130)) as watch:
                s.type("hello world")
            assert watch.change is not None and watch.change.box.y >= 100
            assert watch.before.frame_seq < watch.change.frame_seq
            s.wait_still(for_s=0.3, timeout_s=5)
            m = s.find_text("hello world", timeout_s=5)
            assert 240 < m.box.x < 260 and m.text == "hello world"
            assert s.find_text(re.compile(r"w.rld"), region=(160, 100, 640, 130)).text == "world"
            reading = s.read_text((160, 100, 640, 130))
            assert "hello world" in reading.text
            s.move(300, 300)
            with pytest.raises(NoChange):
                with s.expect_change(timeout_s=0.5):
                    s.move(5, 5)  # the pointer moving is no change of the application
        """
    )
    suite.runpytest(*FAKE).assert_outcomes(passed=1)


def test_recording_policy(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        """
        def test_pass(deskvm_session, record_property):
            record_property("rec", deskvm_session.info().recording)

        def test_fail(deskvm_session, record_property):
            record_property("rec", deskvm_session.info().recording)
            assert False
        """
    )

    def run(policy: str) -> dict[str, bool]:
        suite.runpytest(*FAKE, "--deskvm-record", policy, "--junitxml=j.xml")
        cases = junit(suite.path / "j.xml")
        return {name: Path(properties(c)["rec"]).is_dir() for name, c in cases.items()}

    assert run("on") == {"test_pass": True, "test_fail": True}
    assert run("retain-on-failure") == {"test_pass": False, "test_fail": True}
    assert run("off") == {"test_pass": False, "test_fail": False}
    report = (suite.path / "artifacts" / "test_fail" / "report.html").read_text()
    assert "--deskvm-record off" in report and "data:image/png;base64," in report


def test_missing_tesseract_skips_with_the_reason_or_fails_when_required(
    suite: pytest.Pytester,
) -> None:
    suite.makeconftest(
        """
        import pytesseract
        pytesseract.pytesseract.tesseract_cmd = "/nonexistent/tesseract"
        """
    )
    suite.makepyfile(
        """
        def test_ocr(deskvm_session):
            deskvm_session.find_text("desk@deskvm", timeout_s=1)
        """
    )
    # in a subprocess: the conftest changes pytesseract for the whole process
    skipped = suite.runpytest_subprocess(*FAKE, "-rs")
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines(["*OCR unavailable: tesseract is not installed*apt-get*"])
    required = suite.runpytest_subprocess(*FAKE, "--deskvm-require-ocr")
    required.assert_outcomes(failed=1)


def test_marker_sets_the_session_and_xdist_shares_one_server(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("n", range(4))
        @pytest.mark.deskvm(width=640, height=480)
        def test_worker(deskvm_session, deskvm_server, record_property, n):
            info = deskvm_session.info()
            assert (info.width, info.height) == (640, 480)
            record_property("server", deskvm_server[0])
            record_property("session", deskvm_session.id)
        """
    )
    result = suite.runpytest_subprocess(*FAKE, "-n", "2", "--junitxml=x.xml")
    result.assert_outcomes(passed=4)
    cases = [properties(c) for c in junit(suite.path / "x.xml").values()]
    assert len({c["server"] for c in cases}) == 1  # one server for both workers
    assert len({c["session"] for c in cases}) == 4  # a fresh session per test


def test_warm_pool_option_is_refused_where_it_cannot_apply(suite: pytest.Pytester) -> None:
    suite.makepyfile("def test_one(deskvm_session):\n    pass\n")
    fake = suite.runpytest_subprocess(*FAKE, "--deskvm-warm-pool", "debian12-desktop:1")
    assert fake.ret != 0
    fake.stdout.fnmatch_lines(["*--deskvm-warm-pool needs the libvirt backend*"])
    remote = suite.runpytest_subprocess(
        "--deskvm-url", "http://127.0.0.1:9", "--deskvm-token", "t",
        "--deskvm-warm-pool", "debian12-desktop:1", "-p", "no:cacheprovider",
    )  # fmt: skip
    assert remote.ret != 0
    remote.stdout.fnmatch_lines(["*--deskvm-warm-pool applies to a server this run starts*"])


def test_the_run_waits_for_the_first_pooled_desktop_or_a_failure() -> None:
    from agent_bridge.pytest_plugin import _wait_pool_ready

    class Pool:
        def __init__(self, states: list[list[tuple[int, str]]]) -> None:
            self.states, self.calls = states, 0

        def status(self) -> list[dict[str, object]]:
            state = self.states[min(self.calls, len(self.states) - 1)]
            self.calls += 1
            return [{"ready": ready, "phase": phase} for ready, phase in state]

    filling = Pool([[(0, "building"), (0, "new")], [(1, "filling"), (0, "building")],
                    [(1, "filling"), (0, "failed")]])  # fmt: skip
    _wait_pool_ready(filling, timeout_s=30)
    assert filling.calls == 3  # one ready, the other failed: go (it boots cold)
    never = Pool([[(0, "building")]])
    _wait_pool_ready(never, timeout_s=1.2)  # gives up; sessions then boot cold
    assert 2 <= never.calls <= 4
