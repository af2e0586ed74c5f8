"""The guest helper script's control operations, run on the host (no X, no VM): exec's
caps, timeout and process-group kill, the path confinement after resolving symlinks."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.test_helper_script import load_helper


@pytest.fixture
def helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = load_helper()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setattr(module, "HOME", str(home))
    monkeypatch.setattr(module, "ALLOWED_ROOTS", (str(home),))
    return module


def test_exec_outputs_exit_codes_and_caps(helper: ModuleType) -> None:
    reply = helper.run_exec(
        {
            "argv": ["sh", "-c", "cat; echo E >&2; exit 4"],
            "timeout_s": 5,
            "cap_bytes": 4,
            "stdin_b64": base64.b64encode(b"123456").decode(),
            "env": {"X": "1"},
        }
    )
    assert reply["exit_code"] == 4 and base64.b64decode(reply["stdout_b64"]) == b"1234"
    assert reply["stdout_truncated"] is True and reply["stderr_truncated"] is False
    assert helper.run_exec({"argv": ["/no/such"], "timeout_s": 5})["exit_code"] == 127
    killed = helper.run_exec({"argv": ["sh", "-c", "kill -9 $$"], "timeout_s": 5})
    assert killed["exit_code"] == -9 and killed["timed_out"] is False


def test_exec_timeout_kills_the_whole_process_group(helper: ModuleType, tmp_path: Path) -> None:
    marker = tmp_path / "child-alive"
    t0 = time.monotonic()
    reply = helper.run_exec(
        {"argv": ["sh", "-c", f"(sleep 2; touch {marker}) & sleep 30"], "timeout_s": 0.5}
    )
    assert reply["timed_out"] is True and reply["exit_code"] == -9
    assert time.monotonic() - t0 < 3
    time.sleep(2.5)
    assert not marker.exists()  # the background child died with its group


def test_exec_returns_when_the_process_exits_even_if_a_child_keeps_the_pipes(
    helper: ModuleType,
) -> None:
    t0 = time.monotonic()
    reply = helper.run_exec({"argv": ["sh", "-c", "sleep 5 & echo started"], "timeout_s": 20})
    assert base64.b64decode(reply["stdout_b64"]) == b"started\n"
    assert time.monotonic() - t0 < 3


def test_paths_are_confined_after_resolving_symlinks(helper: ModuleType, tmp_path: Path) -> None:
    home = Path(helper.HOME)
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (home / "link").symlink_to(outside)
    (home / "dirlink").symlink_to(tmp_path)
    for path in (str(home / "link"), str(home / "dirlink" / "outside.txt"), str(outside), "/etc"):
        with pytest.raises(helper.RequestError) as caught:
            helper.get_file({"path": path})
        assert caught.value.code == "path_not_allowed", path
    with pytest.raises(helper.RequestError) as caught:
        helper.put_file({"path": str(home / "dirlink" / "new.txt"), "data_b64": ""})
    assert caught.value.code == "path_not_allowed"
    with pytest.raises(helper.RequestError):  # a symlink as the last component: not followed
        helper.put_file({"path": str(home / "link"), "data_b64": "eA=="})
    assert outside.read_text() == "secret"
    assert helper.put_file({"path": str(home / "a.txt"), "data_b64": "aGk="}) == {
        "path": str(home / "a.txt")
    }
    assert helper.get_file({"path": str(home / "a.txt")})["data_b64"] == "aGk="
    with pytest.raises(helper.RequestError) as caught:
        helper.get_file({"path": str(home / "a.txt"), "max_bytes": 1})
    assert caught.value.code == "too_large"
    with pytest.raises(helper.RequestError) as caught:
        helper.get_file({"path": str(home)})
    assert caught.value.code == "path_not_allowed"  # the root itself names no file
    os.mkfifo(home / "fifo")
    with pytest.raises(helper.RequestError, match="not a regular file"):
        helper.get_file({"path": str(home / "fifo")})


def test_hello_announces_the_guest_ops(helper: ModuleType) -> None:
    class Injector:
        spare = (1, 2)

    assert set(helper.GUEST_OPS) <= set(helper.hello(Injector())["ops"])
