"""The guest's keymap cache: /usr/local/lib/deskvm/xkbcomp (the wrapper the X server runs as
/usr/bin/xkbcomp) and /usr/local/lib/deskvm/xkb-cache (builds the cache when the image is
built). Run with the host's /bin/sh on copies whose paths point into a temporary directory;
the "real" xkbcomp is a stand-in that records its arguments and input and writes an .xkm
made of that input.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vm_images.recipe import GUEST_DIR

LIB = GUEST_DIR / "base/usr/local/lib/deskvm"

# What Xorg 21.1.7 (Debian 12) writes to xkbcomp for rules evdev, model pc105, layout us
# (captured with strace from the server's pipe).
SERVER_US = (
    'xkb_keymap "default" {\n'
    '    xkb_keycodes             { include "evdev+aliases(qwerty)" };\n'
    '    xkb_types                { include "complete" };\n'
    '    xkb_compatibility        { include "complete" };\n'
    '    xkb_symbols              { include "pc+us+inet(evdev)" };\n'
    '    xkb_geometry             { include "pc(pc105)" };\n'
    "};\n"
)


def server_args(out: Path) -> list[str]:
    return [
        "-w", "1", "-R/usr/share/X11/xkb", "-xkm", "-",
        "-em1", "The XKEYBOARD keymap compiler (xkbcomp) reports:", "-emp", "> ",
        "-eml", "Errors from xkbcomp are not fatal to the X server", str(out),
    ]  # fmt: skip


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    cache = tmp_path / "cache"
    log = tmp_path / "real.log"
    real = tmp_path / "xkbcomp.real"
    # Records argv and stdin; the .xkm it writes is "compiled:" + its input.
    real.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" >>{log}\n'
        'for out; do :; done\n'
        '{ printf compiled:; cat; } >"$out"\n'
    )  # fmt: skip
    real.chmod(0o755)
    rules = tmp_path / "evdev"
    rules.write_text("! $azerty = be fr\n! $qwertz = al ch cz de hr\n! model = keycodes\n")
    symbols = tmp_path / "symbols"
    symbols.mkdir()
    for layout in ("us", "de", "fr", "gb"):
        (symbols / layout).write_text("")
    wrapper = tmp_path / "xkbcomp"
    wrapper.write_text(
        (LIB / "xkbcomp")
        .read_text()
        .replace("REAL=/usr/bin/xkbcomp.real", f"REAL={real}")
        .replace("CACHE=/usr/local/share/deskvm/xkb", f"CACHE={cache}")
    )
    builder = tmp_path / "xkb-cache"
    text = (LIB / "xkb-cache").read_text()
    # Without the diversion and the symlink (they act on this host's /usr/bin).
    start = text.index('if [ "$(dpkg-divert')
    end = text.index("ln -sf /usr/local/lib/deskvm/xkbcomp /usr/bin/xkbcomp\n", start)
    text = text[:start] + text[end:].split("\n", 1)[1]
    assert "dpkg-divert" not in text and "ln -sf" not in text
    builder.write_text(
        text.replace("CACHE=/usr/local/share/deskvm/xkb", f"CACHE={cache}")
        .replace("RULES=/usr/share/X11/xkb/rules/evdev", f"RULES={rules}")
        .replace("/usr/share/X11/xkb/symbols/", f"{symbols}/")
        .replace("/usr/bin/xkbcomp.real", str(real))
    )
    return {"cache": cache, "log": log, "wrapper": wrapper, "builder": builder, "dir": tmp_path}


def run(cmd: list[str], stdin: str = "", env: dict[str, str] | None = None):
    return subprocess.run(
        ["/bin/sh", *cmd], input=stdin, capture_output=True, text=True, env=env, check=False
    )


def test_builder_writes_the_servers_text_and_aliases_by_the_rules(world) -> None:
    result = run([str(world["builder"]), "us", "de", "fr"])
    assert result.returncode == 0, result.stderr
    cache = world["cache"]
    assert (cache / "us.keymap").read_text() == SERVER_US
    assert '"evdev+aliases(qwertz)"' in (cache / "de.keymap").read_text()
    assert '"pc+de+inet(evdev)"' in (cache / "de.keymap").read_text()
    assert '"evdev+aliases(azerty)"' in (cache / "fr.keymap").read_text()
    assert (cache / "us.xkm").read_text() == "compiled:" + SERVER_US


def test_builder_refuses_a_layout_without_symbols(world) -> None:
    assert run([str(world["builder"]), "xx"]).returncode != 0
    assert run([str(world["builder"]), "../us"]).returncode != 0


def test_wrapper_copies_a_cached_keymap_without_compiling(world) -> None:
    assert run([str(world["builder"]), "us", "de"]).returncode == 0
    world["log"].unlink()
    out = world["dir"] / "server-0.xkm"
    result = run([str(world["wrapper"]), *server_args(out)], SERVER_US)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "compiled:" + SERVER_US
    assert not world["log"].exists()  # the real xkbcomp never ran
    assert "cached us.keymap" in result.stderr


def test_wrapper_compiles_anything_else_exactly_as_given(world) -> None:
    assert run([str(world["builder"]), "us"]).returncode == 0
    world["log"].unlink()
    out = world["dir"] / "server-0.xkm"
    other = SERVER_US.replace("pc+us+", "pc+gb+")
    result = run([str(world["wrapper"]), *server_args(out)], other)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "compiled:" + other  # same bytes in, through the real one
    assert world["log"].read_text().split("\n")[0].endswith(str(out))
    # A text without its final newline is passed on as it came.
    result = run([str(world["wrapper"]), *server_args(out)], other.rstrip("\n"))
    assert out.read_text() == "compiled:" + other.rstrip("\n")


def test_wrapper_leaves_other_command_lines_and_the_switch_to_the_real_one(world) -> None:
    assert run([str(world["builder"]), "us"]).returncode == 0
    out = world["dir"] / "x.xkm"
    world["log"].unlink()
    result = run([str(world["wrapper"]), "-xkm", "-", str(out)], SERVER_US)
    assert result.returncode == 0 and world["log"].read_text() == f"-xkm - {out}\n"
    world["log"].unlink()
    env = {"PATH": "/usr/bin:/bin", "DESKVM_XKB_CACHE": "0"}
    result = run([str(world["wrapper"]), *server_args(out)], SERVER_US, env)
    assert result.returncode == 0 and world["log"].exists()  # deskvm.xkb_cache=0: compiled
