"""Pure tests of vm_images: recipes, content hash, find_image, no build and no VM needed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import vm_images
from orchestrator.errors import DeskvmError, ImageBuildError, ImageNotFound
from orchestrator.spec import BootImage
from vm_images import DEFAULT_IMAGE, find_image, list_recipes, load_recipe, recipe_hash
from vm_images.builder import RECIPES_DIR, _guest_apt_sources

RECIPE_FILES = (
    "recipe.toml",
    "customize.sh",
    "rootfs/usr/local/lib/deskvm/session",
    "rootfs/usr/local/lib/deskvm/desktop",
    "rootfs/usr/local/bin/deskvm-input-probe",
    "rootfs/etc/systemd/system/deskvm-session.service",
    "rootfs/etc/initramfs-tools/hooks/deskvm",
)


@pytest.fixture
def recipes(tmp_path: Path) -> Path:
    """A private copy of the shipped recipes, safe to modify."""
    target = tmp_path / "recipes"
    shutil.copytree(RECIPES_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def _fake_build(recipes: Path, images: Path, name: str = DEFAULT_IMAGE) -> Path:
    digest = recipe_hash(name, recipes_dir=recipes)
    image_dir = images / name / digest
    image_dir.mkdir(parents=True)
    for filename in ("base.qcow2", "vmlinuz", "initrd.img"):
        (image_dir / filename).write_bytes(b"x")
    meta = {"name": name, "content_hash": digest, "kernel_cmdline": "root=/dev/vda rw quiet"}
    (image_dir / "image.json").write_text(json.dumps(meta))
    return image_dir


def test_public_api() -> None:
    assert set(vm_images.__all__) >= {"build_image", "find_image", "list_recipes", "DEFAULT_IMAGE"}
    assert DEFAULT_IMAGE == "debian12-desktop"
    assert DEFAULT_IMAGE in list_recipes()


@pytest.mark.parametrize("relative", RECIPE_FILES)
def test_recipe_ships_its_files(relative: str) -> None:
    assert (RECIPES_DIR / DEFAULT_IMAGE / relative).is_file()


@pytest.mark.parametrize(
    "relative",
    [
        "customize.sh",
        "rootfs/usr/local/lib/deskvm/session",
        "rootfs/usr/local/lib/deskvm/desktop",
        "rootfs/usr/local/bin/deskvm-input-probe",
        "rootfs/usr/local/bin/deskvm-helper",
        "rootfs/etc/initramfs-tools/hooks/deskvm",
    ],
)
def test_recipe_scripts_are_executable(relative: str) -> None:
    assert (RECIPES_DIR / DEFAULT_IMAGE / relative).stat().st_mode & 0o111


def test_hash_is_stable_and_ignores_location(recipes: Path) -> None:
    shipped = recipe_hash(DEFAULT_IMAGE)
    assert len(shipped) == 64
    assert int(shipped, 16) >= 0
    assert recipe_hash(DEFAULT_IMAGE) == shipped
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) == shipped


def test_hash_ignores_pycache(recipes: Path) -> None:
    before = recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes)
    cache = recipes / DEFAULT_IMAGE / "rootfs" / "usr" / "local" / "bin" / "__pycache__"
    cache.mkdir()
    (cache / "x.pyc").write_bytes(b"\0")
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) == before


@pytest.mark.parametrize("relative", RECIPE_FILES)
def test_hash_changes_with_one_byte(recipes: Path, relative: str) -> None:
    before = recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes)
    path = recipes / DEFAULT_IMAGE / relative
    path.write_bytes(path.read_bytes() + b"\n")
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) != before


def test_hash_changes_with_new_file_rename_and_exec_bit(recipes: Path) -> None:
    root = recipes / DEFAULT_IMAGE
    seen = {recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes)}
    (root / "rootfs" / "etc" / "new.conf").write_text("x\n")
    seen.add(recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes))
    (root / "rootfs" / "etc" / "new.conf").rename(root / "rootfs" / "etc" / "new2.conf")
    seen.add(recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes))
    (root / "rootfs" / "etc" / "new2.conf").chmod(0o755)
    seen.add(recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes))
    assert len(seen) == 4


def test_hash_includes_builder_format_version(
    recipes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes)
    monkeypatch.setattr("vm_images.builder.BUILDER_FORMAT_VERSION", 999)
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) != before


def test_recipe_contents() -> None:
    recipe = load_recipe(DEFAULT_IMAGE)
    assert recipe.suite == "bookworm"
    assert set(recipe.mirror_suites) == {"bookworm", "bookworm-updates", "bookworm-security"}
    assert recipe.components == ("main",)
    for package in (
        "systemd-sysv", "udev", "linux-image-amd64", "initramfs-tools", "xserver-xorg-core",
        "xinit", "openbox", "xterm", "x11-xserver-utils", "fonts-dejavu-core", "python3",
        "python3-tk", "xdotool", "xclip", "iproute2", "curl", "dnsutils", "iputils-ping",
    ):  # fmt: skip
        assert package in recipe.packages
    assert recipe.background_rgb == (0x2E, 0x4A, 0x62)


def test_kernel_cmdline() -> None:
    cmdline = load_recipe(DEFAULT_IMAGE).kernel_cmdline.split()
    assert cmdline[:3] == ["root=/dev/vda", "rw", "console=ttyS0,115200"]
    assert "quiet" in cmdline
    # The host appends these; the image must not preset them.
    assert not any(arg.startswith("deskvm.") for arg in cmdline)


def test_session_script_matches_contract() -> None:
    root = RECIPES_DIR / DEFAULT_IMAGE / "rootfs"
    session = (root / "usr/local/lib/deskvm/session").read_text()
    desktop = (root / "usr/local/lib/deskvm/desktop").read_text()
    assert "deskvm.display=" in session and "deskvm.autostart=" in session
    assert "stty -F" in session and "raw -echo" in session
    assert "DESKVM_READY" in desktop and "#2E4A62" in desktop
    assert "input-probe" in desktop


def test_find_image_returns_built_image(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    image_dir = _fake_build(recipes, images)
    image = find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)
    assert isinstance(image, BootImage)
    assert image.name == DEFAULT_IMAGE
    assert image.content_hash == image_dir.name
    assert image.base_path == image_dir / "base.qcow2"
    assert image.kernel_path == image_dir / "vmlinuz"
    assert image.initrd_path == image_dir / "initrd.img"
    assert image.kernel_cmdline == "root=/dev/vda rw quiet"
    assert image.background_rgb == (0x2E, 0x4A, 0x62)
    assert image.helper_port == "dev.deskvm.helper.0"


def test_find_image_not_built_tells_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound, match=r"deskvm image build debian12-desktop") as info:
        find_image(DEFAULT_IMAGE, tmp_path / "images")
    assert isinstance(info.value, DeskvmError)
    assert info.value.code == "image_not_found"


def test_find_image_after_recipe_change(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    _fake_build(recipes, images)
    (recipes / DEFAULT_IMAGE / "customize.sh").write_text("#!/bin/sh\ntrue\n")
    with pytest.raises(ImageNotFound, match="older recipe versions"):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)


def test_find_image_incomplete_dir(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    image_dir = _fake_build(recipes, images)
    (image_dir / "initrd.img").unlink()
    with pytest.raises(ImageNotFound):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)


def test_find_image_hash_mismatch_in_metadata(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    image_dir = _fake_build(recipes, images)
    (image_dir / "image.json").write_text(json.dumps({"content_hash": "0" * 64}))
    with pytest.raises(ImageNotFound):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)


@pytest.mark.parametrize("name", ["nope", "../etc", "", "Debian12-Desktop"])
def test_unknown_recipe(name: str, tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound, match="no image recipe"):
        find_image(name, tmp_path)
    with pytest.raises(ImageNotFound):
        recipe_hash(name)


def test_build_image_of_built_image_is_a_noop(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    _fake_build(recipes, images)
    calls: list[tuple[str, float]] = []
    image = vm_images.build_image(
        DEFAULT_IMAGE, images, recipes_dir=recipes, progress=lambda p, f: calls.append((p, f))
    )
    assert image == find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)
    assert calls == [("done", 1.0)]


def test_default_image_has_a_guest_helper_wired_to_its_port() -> None:
    recipe = load_recipe(DEFAULT_IMAGE)
    assert recipe.helper_port == "dev.deskvm.helper.0"
    root = RECIPES_DIR / DEFAULT_IMAGE / "rootfs"
    helper = (root / "usr/local/bin/deskvm-helper").read_text()
    assert f'/dev/virtio-ports/{recipe.helper_port}"' in helper
    rules = (root / "etc/udev/rules.d/80-deskvm.rules").read_text()
    assert f'ATTR{{name}}=="{recipe.helper_port}", OWNER="desk"' in rules
    desktop = (root / "usr/local/lib/deskvm/desktop").read_text()
    assert "(until /usr/local/bin/deskvm-helper; do nap 1; done) &" in desktop


@pytest.mark.parametrize("port", ["../etc/passwd", "Dev.X", "", "a" * 70, 5])
def test_recipe_refuses_a_bad_helper_port(recipes: Path, port: object) -> None:
    path = recipes / DEFAULT_IMAGE / "recipe.toml"
    line = f"helper_port = {port!r}"
    text = path.read_text().replace('helper_port = "dev.deskvm.helper.0"', line)
    path.write_text(text.replace("'", '"') if isinstance(port, str) else text)
    with pytest.raises(ImageBuildError, match="helper_port"):
        load_recipe(DEFAULT_IMAGE, recipes_dir=recipes)


def test_invalid_recipe_raises_build_error(recipes: Path) -> None:
    (recipes / DEFAULT_IMAGE / "recipe.toml").write_text("[image]\nsuite = 'bookworm'\n")
    with pytest.raises(ImageBuildError, match="kernel_cmdline"):
        load_recipe(DEFAULT_IMAGE, recipes_dir=recipes)


def test_guest_apt_sources_keep_only_debian(recipes: Path, tmp_path: Path) -> None:
    host = tmp_path / "debian.sources"
    host.write_text(
        "Types: deb\n# snapshot comment\nURIs: http://deb.debian.org/debian\n"
        "Suites: bookworm bookworm-updates bookworm-backports\nComponents: main contrib\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\n"
        "Components: main\n\n"
        "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n"
        "Components: main\n"
    )
    text = _guest_apt_sources(host, load_recipe(DEFAULT_IMAGE, recipes_dir=recipes))
    assert "nodesource" not in text and "backports" not in text and "contrib" not in text
    assert "Suites: bookworm bookworm-updates\n" in text
    assert "Suites: bookworm-security\n" in text


def test_guest_apt_sources_fallback(tmp_path: Path) -> None:
    text = _guest_apt_sources(tmp_path / "missing", load_recipe(DEFAULT_IMAGE))
    assert "URIs: http://deb.debian.org/debian\n" in text
    assert "URIs: http://deb.debian.org/debian-security\n" in text
