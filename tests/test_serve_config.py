"""``deskvm serve``'s config file: what it may say, how it is checked, what overrides it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import agent_bridge.runtime
import agent_bridge.server
from agent_bridge.cli import app
from orchestrator.errors import ConfigError
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.manager import SessionManager
from orchestrator.settings import PoolTarget, Settings, read_serve_config

FULL = """
[serve]
host = "127.0.0.2"
port = 9999
max_sessions = 6
max_total_memory_mib = 20000
session_ttl_s = 0
idle_timeout_s = 600
capture_fps = 1
allowed_origins = ["https://a.example"]
accel = "tcg"
images_dir = "/srv/images"
on_exit = "keep"

[[warm_pool]]
image = "debian12-desktop"
size = 3

[[warm_pool]]
image = "debian12-desktop"
size = 1
width_px = 1024
height_px = 768
memory_mib = 4096
vcpus = 1
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return path


def test_a_full_config_file(tmp_path: Path) -> None:
    config = read_serve_config(write(tmp_path, FULL), env={})
    assert (config.host, config.port) == ("127.0.0.2", 9999)
    settings = Settings.from_env({}, config=config.settings)
    assert settings.max_sessions == 6 and settings.max_total_memory_mib == 20000
    assert settings.session_ttl_s is None and settings.idle_timeout_s == 600.0
    assert settings.capture_fps == 1.0 and settings.allowed_origins == ("https://a.example",)
    assert settings.accel == "tcg" and settings.on_exit == "keep"
    assert settings.images_dir == Path("/srv/images")
    assert settings.warm_pool == (
        PoolTarget("debian12-desktop", 3),
        PoolTarget("debian12-desktop", 1, 1024, 768, 4096, 1),
    )


def test_the_environment_and_flags_override_the_file(tmp_path: Path) -> None:
    config = read_serve_config(write(tmp_path, FULL), env={})
    env = {"DESKVM_MAX_SESSIONS": "2", "DESKVM_WARM_POOL": "other:1"}
    settings = Settings.from_env(env, config=config.settings, capture_fps=0.0)
    assert settings.max_sessions == 2 and settings.capture_fps == 0.0
    assert settings.warm_pool == (PoolTarget("other", 1),)
    assert settings.idle_timeout_s == 600.0  # from the file, nobody overrode it


def test_where_the_file_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "[serve]\nmax_sessions = 3\n")
    assert read_serve_config(env={"DESKVM_CONFIG": str(path)}).path == path
    monkeypatch.setattr("orchestrator.settings.DEFAULT_CONFIG", tmp_path / "absent.toml")
    assert read_serve_config(env={}).path is None  # no default file: no error
    monkeypatch.setattr("orchestrator.settings.DEFAULT_CONFIG", path)
    assert read_serve_config(env={}).settings == {"max_sessions": 3}
    with pytest.raises(ConfigError, match=r"cannot read the config file .*absent"):
        read_serve_config(tmp_path / "absent.toml", env={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[serve\n", "is not valid TOML"),
        ("[serve]\nmax_sessions = 'four'\n", r"serve\.max_sessions: must be an integer, not str"),
        ("[serve]\nmax_sesions = 4\n",
         r"serve\.max_sesions: unknown setting \(known: .*max_sessions"),
        ("[serve]\ncapture_fps = true\n", r"serve\.capture_fps: must be a number, not a boolean"),
        ("[serve]\naccel = 'xen'\n", r"serve\.accel: must be one of auto, kvm, tcg"),
        ("[serve]\ntoken = 'x'\n", r"serve\.token: not allowed here: keep the admin token out"),
        ("[serve]\nport = 70000\n", r"serve\.port: 70000 is not a TCP port"),
        ("[serve]\nallowed_origins = 'x'\n", r"serve\.allowed_origins: must be a list of strings"),
        ("[sreve]\n", r"unknown table or key 'sreve'"),
        ("[[warm_pool]]\nimage = 'x'\n", r"warm_pool\[0\]\.size: missing"),
        ("[[warm_pool]]\nimage = 'x'\nsize = 0\n", r"warm_pool\[0\]: warm pool size 0 is outside"),
        ("[[warm_pool]]\nimage='x'\nsize=1\n[[warm_pool]]\nimage='x'\nsize=1\ncpus=2\n",
         r"warm_pool\[1\]\.cpus: unknown setting \(known: image, size, width_px"),
        ("[[warm_pool]]\nimage = 'x'\nsize = 1\nvcpus = 0\n", r"warm_pool\[0\]: warm pool vcpus 0"),
        ("[serve]\nwarm_pool = 'x:1'\n", r"serve\.warm_pool: not allowed here: give the pool as"),
    ],
)  # fmt: skip
def test_a_bad_file_is_refused_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as caught:
        read_serve_config(path, env={})
    assert str(path) in caught.value.message


def test_a_repeated_pool_target_is_refused(tmp_path: Path) -> None:
    text = "[[warm_pool]]\nimage='x'\nsize=1\n[[warm_pool]]\nimage='x'\nsize=2\n"
    config = read_serve_config(write(tmp_path, text), env={})
    with pytest.raises(ConfigError, match="same image, display, memory and vCPUs twice"):
        Settings.from_env({}, config=config.settings)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_reads_the_file_and_its_flags_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    def build_manager(settings: Settings, **_: Any) -> SessionManager:
        seen.append(settings)
        return SessionManager(
            hypervisor=FakeHypervisor(),
            resolve_image=lambda name: None,  # type: ignore[arg-type,return-value]
            recordings_dir=tmp_path / "recordings",
        )

    def run_server(app_: Any, host: str, port: int, **kw: Any) -> None:
        seen.append((host, port))
        kw["sock"].close()

    monkeypatch.setattr(agent_bridge.runtime, "build_manager", build_manager)
    monkeypatch.setattr(agent_bridge.server, "run_server", run_server)
    port = _free_port()
    path = write(
        tmp_path,
        f"[serve]\nport = {port}\nmax_sessions = 6\nidle_timeout_s = 60\n"
        "[[warm_pool]]\nimage = 'debian12-desktop'\nsize = 2\n",
    )
    result = CliRunner().invoke(
        app,
        ["serve", "--state-dir", str(tmp_path / "s"), "--config", str(path), "--max-sessions", "1"],
        env={"COLUMNS": "200", "DESKVM_TOKEN": ""},
    )
    assert result.exit_code == 0, result.output
    settings, listened = seen
    assert listened == ("127.0.0.1", port)
    assert settings.max_sessions == 1 and settings.idle_timeout_s == 60.0
    assert settings.warm_pool == (PoolTarget("debian12-desktop", 2),)
    assert f"config: {path}" in result.output

    bad = write(tmp_path, "[serve]\nmax_sessions = 'x'\n")
    result = CliRunner().invoke(
        app, ["serve", "--config", str(bad)], env={"COLUMNS": "200", "DESKVM_TOKEN": ""}
    )
    assert result.exit_code != 0 and "serve.max_sessions: must be an integer" in result.output
