"""`deskvm image build|ls|rm|verify|import` without building or booting anything."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent_bridge.cli import app
from vm_images import DEFAULT_IMAGE, VerifyRecord, load_recipe, mark_verified, recipe_hash
from vm_images.recipe import RECIPES_DIR

BAR = "━"  # rich's progress bar


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {
        "DESKVM_STATE_DIR": str(tmp_path / "state"),
        "DESKVM_IMAGES_DIR": str(tmp_path / "images"),
        "COLUMNS": "200",
    }


def run(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.output


def _fake_built(images: Path, *, verified: bool) -> Path:
    from orchestrator.spec import BootImage

    digest = recipe_hash(DEFAULT_IMAGE)
    image_dir = images / DEFAULT_IMAGE / digest
    image_dir.mkdir(parents=True)
    for name in ("base.qcow2", "vmlinuz", "initrd.img"):
        (image_dir / name).write_bytes(b"x" * 5000)
    recipe = load_recipe(DEFAULT_IMAGE)
    meta = {
        "name": DEFAULT_IMAGE, "content_hash": digest, "source": "recipe",
        "kernel_cmdline": recipe.kernel_cmdline, "built_at": "2026-11-30T10:00:00+00:00",
    }  # fmt: skip
    (image_dir / "image.json").write_text(json.dumps(meta))
    if verified:
        image = BootImage(DEFAULT_IMAGE, digest, image_dir / "base.qcow2", image_dir / "vmlinuz",
                          image_dir / "initrd.img")  # fmt: skip
        record = VerifyRecord("2026-11-30T10:05:00+00:00", 23.4, "tcg", 1280, 800, "ok")
        mark_verified(image, record, b"png")
    return image_dir


def test_image_help_teaches_every_command(env: dict[str, str]) -> None:
    code, output = run(env, "image", "--help")
    assert code == 0
    for command in ("build", "ls", "rm", "verify", "import"):
        assert command in output


def test_build_of_an_unknown_recipe_errors_before_a_progress_bar(env: dict[str, str]) -> None:
    code, output = run(env, "image", "build", "nosuch")
    assert code == 1
    assert "error (image_not_found): no image recipe named 'nosuch'" in output
    assert "debian12-desktop" in output  # the available ones
    assert BAR not in output and "%" not in output


def test_build_of_an_invalid_recipe_file_names_the_field(
    env: dict[str, str], tmp_path: Path
) -> None:
    text = (RECIPES_DIR / f"{DEFAULT_IMAGE}.toml").read_text()
    path = tmp_path / "broken.toml"
    path.write_text(text.replace('variant = "apt"', 'variant = "huge"'))
    code, output = run(env, "image", "build", str(path))
    assert code == 1
    assert "error (invalid_recipe)" in output
    assert "base.variant: Input should be 'essential', 'apt'" in " ".join(output.split())
    assert BAR not in output


def test_ls_shows_name_hash_size_date_and_verified(env: dict[str, str], tmp_path: Path) -> None:
    _fake_built(tmp_path / "images", verified=True)
    code, output = run(env, "image", "ls")
    assert code == 0, output
    line = next(line for line in output.splitlines() if DEFAULT_IMAGE in line)
    assert recipe_hash(DEFAULT_IMAGE)[:8] in line
    assert "2026-11-30" in line
    assert "yes, 23 s tcg" in line
    assert "MiB" in line
    code, listed = run(env, "image", "list")  # kept for scripts
    assert code == 0 and DEFAULT_IMAGE in listed


def test_ls_fits_80_columns_with_whole_names(env: dict[str, str], tmp_path: Path) -> None:
    _fake_built(tmp_path / "images", verified=True)
    code, output = run({**env, "COLUMNS": "80"}, "image", "ls")
    assert code == 0, output
    rows = [line for line in output.splitlines() if line.startswith("debian12-")]
    assert any(row.startswith(f"{DEFAULT_IMAGE} ") and "yes, 23 s tcg" in row for row in rows)
    assert all("…" not in row and len(row.rstrip()) <= 80 for row in rows), output


def test_ls_says_how_to_verify_and_build(env: dict[str, str], tmp_path: Path) -> None:
    code, output = run(env, "image", "ls")
    assert code == 0 and "not built" in output
    _fake_built(tmp_path / "images", verified=False)
    code, output = run(env, "image", "ls")
    assert "deskvm image verify debian12-desktop" in " ".join(output.split())


def test_rm_refuses_while_a_domain_uses_the_image(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image_dir = _fake_built(tmp_path / "images", verified=True)
    monkeypatch.setattr("agent_bridge.runtime.domains_using", lambda _s, _p: ["deskvm-x"])
    code, output = run(env, "image", "rm", DEFAULT_IMAGE)
    assert code == 1 and "image_in_use" in output and "deskvm-x" in output
    assert image_dir.exists()
    monkeypatch.setattr("agent_bridge.runtime.domains_using", lambda _s, _p: [])
    code, output = run(env, "image", "rm", DEFAULT_IMAGE)
    assert code == 0, output
    assert not image_dir.exists()
    code, output = run(env, "image", "rm", DEFAULT_IMAGE)
    assert code == 1 and "no image named" in output


def test_verify_of_an_unbuilt_image_says_how_to_build(env: dict[str, str]) -> None:
    code, output = run(env, "image", "verify", DEFAULT_IMAGE)
    assert code == 1
    assert "deskvm image build debian12-desktop" in " ".join(output.split())
    assert BAR not in output


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="bootstrap installs qemu-utils")
def test_import_without_verify_then_ls(env: dict[str, str], tmp_path: Path) -> None:
    disk = tmp_path / "mine.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "64M"], check=True)
    code, output = run(env, "image", "import", str(disk), "--name", "mine")
    assert code == 1 and "--boot bios|uefi" in output
    (tmp_path / "mine.deskvm.json").write_text(json.dumps({"boot": "uefi", "guest_os": "x"}))
    code, output = run(env, "image", "import", str(disk), "--name", "mine", "--no-verify")
    assert code == 0, output
    assert "uefi boot" in output and "deskvm image verify mine" in output
    code, output = run(env, "image", "ls")
    line = next(line for line in output.splitlines() if line.lstrip("│ ").startswith("mine"))
    assert "import" in line and "uefi" in line and "no" in line
