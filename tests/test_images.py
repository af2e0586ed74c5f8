# ruff: noqa: E501  (the validation table reads best one case per line)
"""Pure tests of vm_images: recipes as data, content hash, the image store, import checks.

No build and no VM: images are faked as directories with the files a build writes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import vm_images
from orchestrator.errors import DeskvmError, ImageBuildError, ImageNotFound
from orchestrator.spec import BootImage, ReadyRegion
from vm_images import (
    DEFAULT_IMAGE,
    ImageNotVerified,
    RecipeError,
    VerifyRecord,
    find_image,
    image_records,
    list_recipes,
    load_recipe,
    mark_verified,
    recipe_hash,
    remove_image,
)
from vm_images.builder import (
    _guest_apt_sources,
    _mmdebstrap_command,
    finalize_script,
    generated_files,
)
from vm_images.recipe import GUEST_DIR, RECIPES_DIR, guest_sets

SHIPPED = (DEFAULT_IMAGE, "debian12-full")

GUEST_FILES = (
    "base/usr/local/lib/deskvm/session",
    "base/usr/local/lib/deskvm/bootstats",
    "base/usr/local/lib/deskvm/acct-summary",
    "base/usr/local/lib/deskvm/initrd/init",
    "base/usr/local/lib/deskvm/initrd/modules",
    "base/usr/local/lib/deskvm/autostart",
    "base/usr/local/lib/deskvm/xkbcomp",
    "base/usr/local/lib/deskvm/xkb-cache",
    "base/usr/local/bin/deskvm-input-probe",
    "base/usr/local/bin/deskvm-helper",
    "base/etc/systemd/system/deskvm-session.service",
    "base/etc/initramfs-tools/hooks/deskvm",
    "openbox/usr/local/lib/deskvm/desktop",
    "openbox/etc/systemd/system/systemd-udev-trigger.service.d/deskvm.conf",
    "xfce/usr/local/lib/deskvm/desktop",
    "xfce/etc/xdg/xfce4/xfconf/xfce-perchannel-xml/xfce4-panel.xml",
    "xfce/usr/lib/firefox-esr/distribution/policies.json",
    "xfce/etc/chromium/policies/managed/deskvm.json",
)
EXECUTABLES = (
    "base/usr/local/lib/deskvm/session",
    "base/usr/local/lib/deskvm/bootstats",
    "base/usr/local/lib/deskvm/acct-summary",
    "base/usr/local/lib/deskvm/initrd/init",
    "base/usr/local/lib/deskvm/autostart",
    "base/usr/local/lib/deskvm/xkbcomp",
    "base/usr/local/lib/deskvm/xkb-cache",
    "base/usr/local/bin/deskvm-input-probe",
    "base/usr/local/bin/deskvm-helper",
    "base/etc/initramfs-tools/hooks/deskvm",
    "openbox/usr/local/lib/deskvm/desktop",
    "xfce/usr/local/lib/deskvm/desktop",
)


@pytest.fixture
def recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Private copies of the shipped recipes and guest file sets, safe to modify."""
    target = tmp_path / "recipes"
    shutil.copytree(RECIPES_DIR, target)
    guest = tmp_path / "guest"
    shutil.copytree(GUEST_DIR, guest, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr("vm_images.recipe.GUEST_DIR", guest)
    return target


def _edit(recipes: Path, name: str, old: str, new: str) -> None:
    path = recipes / f"{name}.toml"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def _fake_build(
    recipes: Path | None, images: Path, name: str = DEFAULT_IMAGE, *, verified: bool = True
) -> Path:
    digest = recipe_hash(name, recipes_dir=recipes)
    image_dir = images / name / digest
    image_dir.mkdir(parents=True)
    for filename in ("base.qcow2", "vmlinuz", "initrd.img"):
        (image_dir / filename).write_bytes(b"x")
    recipe = load_recipe(name, recipes_dir=recipes)
    meta = {
        "name": name,
        "content_hash": digest,
        "source": "recipe",
        "kernel_cmdline": "root=/dev/vda rw quiet",
        "background_rgb": list(recipe.background_rgb),
        "helper_port": recipe.helper_port,
        "ready": recipe.model.ready.model_dump(mode="json"),
        "built_at": "2026-01-01T00:00:00+00:00",
    }
    (image_dir / "image.json").write_text(json.dumps(meta))
    if verified:
        _verify(image_dir)
    return image_dir


def _verify(image_dir: Path) -> None:
    meta = json.loads((image_dir / "image.json").read_text())
    image = BootImage(
        meta["name"], image_dir.name, image_dir / "base.qcow2", image_dir / "vmlinuz",
        image_dir / "initrd.img",
    )  # fmt: skip
    record = VerifyRecord("2026-01-02T00:00:00+00:00", 21.5, "tcg", 1280, 800, "ok")
    mark_verified(image, record, b"\x89PNG fake")


# --- the shipped recipes ----------------------------------------------------------------------


def test_public_api() -> None:
    assert set(vm_images.__all__) >= {
        "build_image", "find_image", "list_recipes", "DEFAULT_IMAGE", "import_image",
        "image_records", "remove_image", "mark_verified", "load_recipe", "RecipeError",
    }  # fmt: skip
    assert DEFAULT_IMAGE == "debian12-desktop"
    assert set(SHIPPED) <= set(list_recipes())


def test_recipes_are_single_toml_files() -> None:
    assert sorted(p.name for p in RECIPES_DIR.iterdir()) == sorted(f"{n}.toml" for n in SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_validate(name: str) -> None:
    recipe = load_recipe(name)
    assert recipe.suite == "bookworm"
    assert recipe.autologin_user == "desk"
    assert recipe.keyboard_layout == "us"
    assert recipe.helper_port == "dev.deskvm.helper.0"
    assert recipe.model.files.sets[0] == "base"
    assert "linux-image-amd64" in recipe.packages
    cmdline = recipe.kernel_cmdline.split()
    assert cmdline[:3] == ["root=/dev/vda", "rw", "console=ttyS0,115200"]
    assert not any(arg.startswith("deskvm.") for arg in cmdline)


def test_default_recipe_contents() -> None:
    recipe = load_recipe(DEFAULT_IMAGE)
    assert set(recipe.mirror_suites) == {"bookworm", "bookworm-updates", "bookworm-security"}
    assert recipe.components == ("main",)
    for package in (
        "systemd-sysv", "udev", "linux-image-amd64", "initramfs-tools", "xserver-xorg-core",
        "xinit", "openbox", "xterm", "x11-xserver-utils", "fonts-dejavu-core", "python3",
        "python3-tk", "xdotool", "xclip", "iproute2", "curl", "dnsutils", "iputils-ping",
    ):  # fmt: skip
        assert package in recipe.packages
    assert recipe.background_rgb == (0x2E, 0x4A, 0x62)
    assert recipe.model.files.sets == ["base", "openbox"]
    assert recipe.ready_regions == ()


def test_full_recipe_contents() -> None:
    recipe = load_recipe("debian12-full")
    for package in (
        "xfwm4", "xfce4-panel", "thunar", "xfce4-terminal", "firefox-esr", "chromium",
        "libreoffice-writer", "libreoffice-calc", "libreoffice-impress", "mousepad", "atril",
        "ristretto", "gimp", "xarchiver", "fonts-dejavu-core", "fonts-liberation2",
        "fonts-noto-cjk", "fonts-noto-color-emoji", "xdotool", "python3-tk",
    ):  # fmt: skip
        assert package in recipe.packages
    assert recipe.model.files.sets == ["base", "xfce"]
    assert recipe.keyboard_layout == "us"
    # Ready means the panel across the top is drawn, not only the background.
    assert [(r.name, r.top_px, r.height_px) for r in recipe.ready_regions] == [("panel", 0, 28)]
    assert recipe.model.boot.qcow2_compression == "zstd"
    excluded = recipe.model.strip.path_exclude
    assert {"/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*"} <= set(excluded)
    # The policies the quiet desktop depends on are valid JSON.
    for relative in (
        "xfce/usr/lib/firefox-esr/distribution/policies.json",
        "xfce/etc/chromium/policies/managed/deskvm.json",
    ):
        json.loads((GUEST_DIR / relative).read_text())


def test_fontconfig_caches_survive_whole_second_times() -> None:
    script = finalize_script(load_recipe("debian12-full"))
    assert script.index("touch -m -d") < script.index("fc-cache -s")


@pytest.mark.parametrize("relative", GUEST_FILES)
def test_guest_sets_ship_their_files(relative: str) -> None:
    assert (GUEST_DIR / relative).is_file()


@pytest.mark.parametrize("relative", EXECUTABLES)
def test_guest_scripts_are_executable(relative: str) -> None:
    assert (GUEST_DIR / relative).stat().st_mode & 0o111


def test_session_script_matches_contract() -> None:
    session = (GUEST_DIR / "base/usr/local/lib/deskvm/session").read_text()
    assert "deskvm.display=" in session and "deskvm.autostart=" in session
    assert "stty -F" in session and "raw -echo" in session
    assert ". /etc/deskvm/image.conf" in session
    assert "/sys/firmware/dmi/entries/11-" in session  # OEM strings for BIOS/UEFI imports
    for desktop_set in ("openbox",):
        desktop = (GUEST_DIR / desktop_set / "usr/local/lib/deskvm/desktop").read_text()
        assert "DESKVM_READY" in desktop and "DESKVM_BACKGROUND" in desktop
        assert "input-probe" in desktop
        assert "until /usr/local/bin/deskvm-helper; do nap 1; done) &" in desktop


def test_small_image_boots_its_own_init_into_the_session() -> None:
    """The default image's PID 1 is its file set's init (docs/images.md); it starts udevd
    before the session and the coldplug, and ends as busybox init with an empty table."""
    recipe = load_recipe(DEFAULT_IMAGE)
    inits = [w[len("init=") :] for w in recipe.kernel_cmdline.split() if w.startswith("init=")]
    assert inits == ["/usr/local/lib/deskvm/init"]
    script = GUEST_DIR / "openbox" / inits[0].lstrip("/")
    assert os.access(script, os.X_OK)
    lines = [line.strip() for line in script.read_text().splitlines()]
    udevd = lines.index(
        '/lib/systemd/systemd-udevd --daemon || echo "deskvm-init: systemd-udevd did not start"'
    )
    assert udevd < lines.index("/usr/local/lib/deskvm/session &")
    assert udevd < lines.index("/usr/local/lib/deskvm/coldplug &")
    assert lines[-1] == "exec $bb init"
    inittab = (GUEST_DIR / "openbox/etc/inittab").read_text().splitlines()
    assert all(line.startswith("#") for line in inittab)


def test_default_image_has_a_guest_helper_wired_to_its_port() -> None:
    recipe = load_recipe(DEFAULT_IMAGE)
    root = GUEST_DIR / "base"
    helper = (root / "usr/local/bin/deskvm-helper").read_text()
    assert f'/dev/virtio-ports/{recipe.helper_port}"' in helper
    rules = (root / "etc/udev/rules.d/80-deskvm.rules").read_text()
    assert f'ATTR{{name}}=="{recipe.helper_port}", OWNER="desk"' in rules


# --- generated guest files ------------------------------------------------------------------


def test_generated_files_carry_the_recipe_data() -> None:
    files = generated_files(load_recipe(DEFAULT_IMAGE))
    conf = files["etc/deskvm/image.conf"]
    assert "DESKVM_DISPLAY_DEFAULT=1280x800\n" in conf
    assert "DESKVM_BACKGROUND='#2E4A62'\n" in conf
    assert "DESKVM_KEYBOARD_LAYOUT=us\n" in conf
    assert 'Option "XkbLayout" "us"' in files["etc/X11/xorg.conf.d/00-deskvm-keyboard.conf"]
    assert 'XKBLAYOUT="us"' in files["etc/default/keyboard"]
    assert files["etc/deskvm/autostart"] == ""


def test_keyboard_layout_goes_into_the_x_configuration(recipes: Path) -> None:
    _edit(recipes, DEFAULT_IMAGE, 'keyboard_layout = "us"', 'keyboard_layout = "de"')
    files = generated_files(load_recipe(DEFAULT_IMAGE, recipes_dir=recipes))
    assert 'Option "XkbLayout" "de"' in files["etc/X11/xorg.conf.d/00-deskvm-keyboard.conf"]
    assert "DESKVM_KEYBOARD_LAYOUT=de\n" in files["etc/deskvm/image.conf"]
    # The static X configuration no longer pins a layout.
    assert "XkbLayout" not in (GUEST_DIR / "base/etc/X11/xorg.conf.d/10-deskvm.conf").read_text()


def test_a_file_set_may_not_provide_a_generated_file(recipes: Path) -> None:
    import vm_images.recipe as recipe_mod

    target = recipe_mod.GUEST_DIR / "openbox" / "etc" / "deskvm"
    target.mkdir(parents=True)
    (target / "image.conf").write_text("X=1\n")
    with pytest.raises(RecipeError, match=r"provides /etc/deskvm/image.conf"):
        generated_files(load_recipe(DEFAULT_IMAGE, recipes_dir=recipes))


def test_finalize_script_declares_users_services_and_commands(recipes: Path) -> None:
    _edit(
        recipes, DEFAULT_IMAGE, 'commands = [\n  "/usr/local/lib/deskvm/xkb-cache',
        'commands = [\n  "echo hello > /etc/motd", "/usr/local/lib/deskvm/xkb-cache',
    )  # fmt: skip
    script = finalize_script(load_recipe(DEFAULT_IMAGE, recipes_dir=recipes))
    assert "useradd --create-home --uid 1000 --user-group --shell /bin/bash" in script
    assert "passwd --lock desk" in script
    assert "systemctl enable deskvm-session.service" in script
    assert "systemctl mask " in script and "systemd-logind.service" in script
    assert "/bin/sh -eu -c 'echo hello > /etc/motd'" in script
    # The X server's keymap cache (guest/base/usr/local/lib/deskvm/xkb-cache), after it.
    assert script.index("echo hello") < script.index("/usr/local/lib/deskvm/xkb-cache us de fr")
    # A fontconfig template conf.d names but [strip] left out fails the build.
    assert "names a template the image left out" in script


def test_mmdebstrap_command(tmp_path: Path) -> None:
    recipe = load_recipe(DEFAULT_IMAGE)
    cmd = _mmdebstrap_command(recipe, tmp_path, tmp_path / "s", tmp_path / "c", tmp_path / "r")
    assert '--aptopt=APT::Install-Recommends "false"' in cmd
    assert "--dpkgopt=force-unsafe-io" in cmd
    assert "--dpkgopt=path-exclude=/usr/share/doc/*" in cmd
    assert any(a.startswith("--include=systemd-sysv,") for a in cmd)
    assert cmd[-3:] == ["bookworm", str(tmp_path / "r"), str(tmp_path / "s")]


# --- validation: every error names the field and the allowed values -------------------------


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('variant = "apt"', 'variant = "tiny"', r"base\.variant: Input should be 'essential', 'apt'"),
        ('suite = "bookworm"', 'suite = "sid"', r"base\.suite: Input should be 'bookworm'"),
        ('components = ["main"]', 'components = ["universe"]', r"base\.components\[0\]"),
        ('keyboard_layout = "us"', 'keyboard_layout = "xx"', r"desktop\.keyboard_layout: 'xx' is not an XKB layout .*allowed: .*de"),
        ('width_px = 1280', 'width_px = 1283', r"desktop\.width_px: Input should be a multiple of 8"),
        ("background_rgb = [0x2E, 0x4A, 0x62]", "background_rgb = [0x2E, 0x4A]", r"desktop\.background_rgb"),
        ("background_rgb = [0x2E, 0x4A, 0x62]", "background_rgb = [300, 0, 0]", r"desktop\.background_rgb\[0\]: Input should be less than or equal to 255"),
        ('helper_port = "dev.deskvm.helper.0"', 'helper_port = "../etc/passwd"', r"boot\.helper_port: String should match pattern"),
        ('helper_port = "dev.deskvm.helper.0"', "helper_port = 5", r"boot\.helper_port: Input should be a valid string"),
        ('sets = ["base", "openbox"]', 'sets = ["base", "kde"]', r"files\.sets: unknown file set 'kde' \(allowed: base, openbox"),
        ('"less",', '"less", "less",', r"packages\.install: packages listed twice: less"),
        ('"less",', '"Bad_Name",', r"packages\.install\[\d+\]: String should match pattern"),
        ('uid = 1000', 'uid = 0', r"users\[0\]\.uid: Input should be greater than or equal to 1000"),
        ('autologin = true', 'autologin = false', r"exactly one user must have autologin"),
        ('name = "desk"', 'name = "bob"', r"the autologin user is 'bob'; it must be 'desk'"),
        ("headroom_mib = 1024", 'headroom_mib = "1024"', r"boot\.headroom_mib: Input should be a valid integer"),
        ('hostname = "deskvm"', 'hostname = "deskvm"\nflavour = "x"', r"boot\.flavour: unknown field \(allowed here: headroom_mib, helper_port, hostname, kernel_cmdline, qcow2_compression\)"),
        ('qcow2_compression = "none"', 'qcow2_compression = "xz"', r"boot\.qcow2_compression: Input should be 'none', 'zlib' or 'zstd'"),
        ('default_target = "deskvm-boot.target"', 'default_target = "rescue.target"', r"services\.default_target: Input should be 'multi-user.target', 'graphical.target' or 'deskvm-boot.target'"),
        ('"deskvm-session.service"]', '"deskvm session"]', r"services\.enable\[0\]"),
        ("kernel_cmdline = \"root=/dev/vda rw", "kernel_cmdline = \"root=/dev/sda1 rw", r"boot\.kernel_cmdline: must start with root=/dev/vda"),
        ("kernel_cmdline = \"root=/dev/vda rw", "kernel_cmdline = \"root=/dev/vda deskvm.display=1x1 rw", r"deskvm\.\* options are appended by the host"),
        ("boot_timeout_s = 180", "boot_timeout_s = -1", r"ready\.boot_timeout_s: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_invalid_recipes_name_field_and_allowed_values(
    recipes: Path, old: str, new: str, expected: str
) -> None:
    _edit(recipes, DEFAULT_IMAGE, old, new)
    with pytest.raises(RecipeError, match=expected) as info:
        load_recipe(DEFAULT_IMAGE, recipes_dir=recipes)
    assert info.value.code == "invalid_recipe"
    assert isinstance(info.value, ImageBuildError)
    assert f"{recipes / DEFAULT_IMAGE}.toml" in info.value.message


def test_unknown_top_level_table(recipes: Path) -> None:
    (recipes / f"{DEFAULT_IMAGE}.toml").write_text(
        (recipes / f"{DEFAULT_IMAGE}.toml").read_text() + "\n[network]\nnic = true\n"
    )
    with pytest.raises(RecipeError, match=r"network: unknown field \(allowed here: base, boot"):
        load_recipe(DEFAULT_IMAGE, recipes_dir=recipes)


def test_missing_required_tables(recipes: Path) -> None:
    (recipes / f"{DEFAULT_IMAGE}.toml").write_text("[base]\nsuite = 'bookworm'\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(DEFAULT_IMAGE, recipes_dir=recipes)
    for field in ("packages: required field missing", "users: required", "boot: required"):
        assert field in info.value.message


def test_not_toml(recipes: Path) -> None:
    (recipes / f"{DEFAULT_IMAGE}.toml").write_text("[base\n")
    with pytest.raises(RecipeError, match="is not valid TOML"):
        load_recipe(DEFAULT_IMAGE, recipes_dir=recipes)


def test_preseed_path_must_exist(recipes: Path) -> None:
    _edit(recipes, DEFAULT_IMAGE, 'preseed = ["etc/initramfs-tools"]', 'preseed = ["etc/nope"]')
    with pytest.raises(RecipeError, match=r"files\.preseed: 'etc/nope' is in none"):
        load_recipe(DEFAULT_IMAGE, recipes_dir=recipes)


def test_recipe_given_as_a_file_with_its_own_tree(tmp_path: Path) -> None:
    text = (RECIPES_DIR / f"{DEFAULT_IMAGE}.toml").read_text()
    text = text.replace(
        'sets = ["base", "openbox"]', 'sets = ["base", "openbox"]\ntrees = ["mine"]'
    )
    (tmp_path / "mine" / "etc").mkdir(parents=True)
    (tmp_path / "mine" / "etc" / "motd").write_text("hello\n")
    path = tmp_path / "my-desktop.toml"
    path.write_text(text)
    recipe = load_recipe(str(path))
    assert recipe.name == "my-desktop"
    assert ("tree mine", tmp_path / "mine") in recipe.trees()
    before = recipe_hash(recipe)
    (tmp_path / "mine" / "etc" / "motd").write_text("hello!\n")
    assert recipe_hash(str(path)) != before


@pytest.mark.parametrize("name", ["nope", "../etc", "", "Debian12-Desktop"])
def test_unknown_recipe(name: str, tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound):
        find_image(name, tmp_path)
    with pytest.raises(ImageNotFound, match=r"no (image )?recipe"):
        recipe_hash(name)


def test_guest_sets() -> None:
    assert {"base", "openbox", "xfce"} <= set(guest_sets())


# --- content hash -----------------------------------------------------------------------------


def test_hash_is_stable(recipes: Path) -> None:
    shipped = recipe_hash(DEFAULT_IMAGE)
    assert len(shipped) == 64 and int(shipped, 16) >= 0
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) == shipped


def test_hash_ignores_comments_but_not_values(recipes: Path) -> None:
    before = recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes)
    _edit(recipes, DEFAULT_IMAGE, "[base]", "# a new comment\n[base]")
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) == before
    _edit(recipes, DEFAULT_IMAGE, '"less",', '"less", "nano",')
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) != before


def test_hash_ignores_pycache(recipes: Path) -> None:
    import vm_images.recipe as recipe_mod

    before = recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes)
    cache = recipe_mod.GUEST_DIR / "base" / "usr" / "local" / "bin" / "__pycache__"
    cache.mkdir()
    (cache / "x.pyc").write_bytes(b"\0")
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) == before


@pytest.mark.parametrize("relative", GUEST_FILES[:4])
def test_hash_changes_with_one_byte_of_a_shared_file(recipes: Path, relative: str) -> None:
    import vm_images.recipe as recipe_mod

    before = {n: recipe_hash(n, recipes_dir=recipes) for n in SHIPPED}
    path = recipe_mod.GUEST_DIR / relative
    path.write_bytes(path.read_bytes() + b"\n")
    after = {n: recipe_hash(n, recipes_dir=recipes) for n in SHIPPED}
    assert after[DEFAULT_IMAGE] != before[DEFAULT_IMAGE]


def test_hash_changes_with_new_file_rename_and_exec_bit(recipes: Path) -> None:
    import vm_images.recipe as recipe_mod

    etc = recipe_mod.GUEST_DIR / "openbox" / "etc"
    etc.mkdir(exist_ok=True)
    seen = {recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes)}
    (etc / "new.conf").write_text("x\n")
    seen.add(recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes))
    (etc / "new.conf").rename(etc / "new2.conf")
    seen.add(recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes))
    (etc / "new2.conf").chmod(0o755)
    seen.add(recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes))
    assert len(seen) == 4


def test_hash_includes_builder_format_version(
    recipes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes)
    monkeypatch.setattr("vm_images.recipe.BUILDER_FORMAT_VERSION", 999)
    assert recipe_hash(DEFAULT_IMAGE, recipes_dir=recipes) != before


# --- the store: find, verified, ls, rm ------------------------------------------------------


def test_find_image_returns_built_verified_image(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    _edit(
        recipes,
        DEFAULT_IMAGE,
        "boot_timeout_s = 180",
        'boot_timeout_s = 180\n[[ready.regions]]\nname = "panel"\ntop_px = 0\nheight_px = 26',
    )
    image_dir = _fake_build(recipes, images, DEFAULT_IMAGE)
    image = find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)
    assert isinstance(image, BootImage)
    assert image.name == DEFAULT_IMAGE
    assert image.content_hash == image_dir.name
    assert image.base_path == image_dir / "base.qcow2"
    assert image.kernel_path == image_dir / "vmlinuz"
    assert image.kernel_cmdline == "root=/dev/vda rw quiet"
    assert image.helper_port == "dev.deskvm.helper.0"
    assert image.boot == "direct"
    assert image.ready.regions and image.ready.regions[0].name == "panel"
    assert isinstance(image.ready.regions[0], ReadyRegion)


def test_an_unverified_image_is_refused_with_the_command_to_run(
    recipes: Path, tmp_path: Path
) -> None:
    images = tmp_path / "images"
    image_dir = _fake_build(recipes, images, verified=False)
    with pytest.raises(
        ImageNotVerified, match=r"run `deskvm image verify debian12-desktop`"
    ) as info:
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)  # fmt: skip
    assert info.value.code == "image_not_verified"
    assert find_image(DEFAULT_IMAGE, images, recipes_dir=recipes, require_verified=False)
    _verify(image_dir)
    assert find_image(DEFAULT_IMAGE, images, recipes_dir=recipes).content_hash == image_dir.name


def test_a_verification_of_another_hash_does_not_count(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    image_dir = _fake_build(recipes, images)
    data = json.loads((image_dir / "verified.json").read_text())
    data["content_hash"] = "0" * 64
    (image_dir / "verified.json").write_text(json.dumps(data))
    with pytest.raises(ImageNotVerified):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)


def test_find_image_not_built_tells_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound, match=r"deskvm image build debian12-desktop") as info:
        find_image(DEFAULT_IMAGE, tmp_path / "images")
    assert isinstance(info.value, DeskvmError)
    assert info.value.code == "image_not_found"


def test_find_image_after_recipe_change(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    old = _fake_build(recipes, images)
    _edit(recipes, DEFAULT_IMAGE, '"less",', '"less", "nano",')
    with pytest.raises(ImageNotFound, match=f"older recipe versions: {old.name[:12]}"):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)


def test_find_image_incomplete_dir(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    image_dir = _fake_build(recipes, images)
    (image_dir / "initrd.img").unlink()
    with pytest.raises(ImageNotFound, match="not built"):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)


def test_a_pvh_kernel_is_named_in_the_metadata(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    image_dir = _fake_build(recipes, images)
    meta = json.loads((image_dir / "image.json").read_text())
    (image_dir / "image.json").write_text(json.dumps({**meta, "kernel_file": "vmlinux"}))
    with pytest.raises(ImageNotFound, match="not built"):  # no vmlinux file yet
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)
    (image_dir / "vmlinuz").rename(image_dir / "vmlinux")
    assert find_image(DEFAULT_IMAGE, images, recipes_dir=recipes).kernel_path == (
        image_dir / "vmlinux"
    )
    (image_dir / "image.json").write_text(json.dumps({**meta, "kernel_file": "../x"}))
    with pytest.raises(ImageNotFound, match="not built"):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)


def test_find_image_hash_mismatch_in_metadata(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    image_dir = _fake_build(recipes, images)
    meta = json.loads((image_dir / "image.json").read_text())
    (image_dir / "image.json").write_text(json.dumps({**meta, "content_hash": "0" * 64}))
    with pytest.raises(ImageNotFound):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)


def test_build_image_of_built_image_is_a_noop(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    _fake_build(recipes, images)
    calls: list[tuple[str, float]] = []
    image = vm_images.build_image(
        DEFAULT_IMAGE, images, recipes_dir=recipes, progress=lambda p, f: calls.append((p, f))
    )
    assert image == find_image(DEFAULT_IMAGE, images, recipes_dir=recipes)
    assert calls == [("done", 1.0)]


def test_build_refuses_an_invalid_recipe_before_anything(recipes: Path, tmp_path: Path) -> None:
    _edit(recipes, DEFAULT_IMAGE, 'variant = "apt"', 'variant = "tiny"')
    calls: list[tuple[str, float]] = []
    with pytest.raises(RecipeError, match="variant"):
        vm_images.build_image(
            DEFAULT_IMAGE, tmp_path / "images", recipes_dir=recipes,
            progress=lambda p, f: calls.append((p, f)),
        )  # fmt: skip
    assert calls == []
    assert not (tmp_path / "images").exists()


def test_image_records_and_removal(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    old = _fake_build(recipes, images)
    _edit(recipes, DEFAULT_IMAGE, '"less",', '"less", "nano",')
    new = _fake_build(recipes, images, verified=False)
    meta = json.loads((new / "image.json").read_text())
    (new / "image.json").write_text(json.dumps({**meta, "built_at": "2026-02-01T00:00:00+00:00"}))
    records = {r.content_hash: r for r in image_records(images, recipes_dir=recipes)}
    assert set(records) == {old.name, new.name}
    assert records[new.name].current and not records[old.name].current
    assert records[old.name].verified is not None
    assert records[old.name].verified.boot_to_ready_s == 21.5
    assert records[new.name].verified is None
    assert records[new.name].size_bytes > 0 and records[new.name].built_at.startswith("2026-02")
    removed = remove_image(DEFAULT_IMAGE, images, content_hash=old.name[:12])
    assert removed == [old] and not old.exists() and new.exists()
    remove_image(DEFAULT_IMAGE, images)
    assert not (images / DEFAULT_IMAGE).exists()
    with pytest.raises(ImageNotFound, match="no image named"):
        remove_image(DEFAULT_IMAGE, images)


# --- apt sources ----------------------------------------------------------------------------


def test_guest_apt_sources_keep_only_debian(tmp_path: Path) -> None:
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
    text = _guest_apt_sources(host, load_recipe(DEFAULT_IMAGE))
    assert "nodesource" not in text and "backports" not in text and "contrib" not in text
    assert "Suites: bookworm bookworm-updates\n" in text
    assert "Suites: bookworm-security\n" in text


def test_guest_apt_sources_fallback(tmp_path: Path) -> None:
    text = _guest_apt_sources(tmp_path / "missing", load_recipe(DEFAULT_IMAGE))
    assert "URIs: http://deb.debian.org/debian\n" in text
    assert "URIs: http://deb.debian.org/debian-security\n" in text


# --- import ---------------------------------------------------------------------------------

needs_qemu_img = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="qemu-img is installed by scripts/bootstrap"
)


def _qcow2(path: Path, *, backing: Path | None = None) -> Path:
    cmd = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if backing is not None:
        cmd += ["-F", "qcow2", "-b", str(backing)]
    subprocess.run([*cmd, str(path), "64M"], check=True)
    return path


@needs_qemu_img
def test_import_bios_image_with_metadata(tmp_path: Path) -> None:
    from vm_images.importer import ImportMetadata, import_image, metadata_beside

    disk = _qcow2(tmp_path / "debian12-packer.qcow2")
    assert metadata_beside(disk) == tmp_path / "debian12-packer.deskvm.json"
    meta = ImportMetadata.model_validate(
        {"boot": "bios", "helper_port": "dev.deskvm.helper.0",
         "ready": {"regions": [{"name": "panel", "top_px": 0, "height_px": 24}]}}
    )  # fmt: skip
    images = tmp_path / "images"
    phases: list[str] = []
    image = import_image(
        disk, "mine", images, metadata=meta, progress=lambda p, f: phases.append(p)
    )
    assert image.boot == "bios" and image.kernel_path is None
    assert image.helper_port == "dev.deskvm.helper.0"
    assert image.ready.regions[0].height_px == 24
    assert image.base_path.read_bytes() == disk.read_bytes()
    assert "copy" in phases and phases[-1] == "done"
    with pytest.raises(ImageNotVerified, match="deskvm image verify mine"):
        find_image("mine", images)
    assert find_image("mine", images, require_verified=False) == image
    again = import_image(disk, "mine", images, metadata=meta)
    assert again.content_hash == image.content_hash
    assert [r.source for r in image_records(images)] == ["import"]


@needs_qemu_img
def test_import_refuses_a_backing_file_and_non_qcow2(tmp_path: Path) -> None:
    from vm_images.importer import import_image

    base = _qcow2(tmp_path / "base.qcow2")
    overlay = _qcow2(tmp_path / "overlay.qcow2", backing=base)
    with pytest.raises(ImageBuildError, match="has a backing file"):
        import_image(overlay, "x", tmp_path / "images", boot="bios")
    raw = tmp_path / "disk.raw"
    raw.write_bytes(b"\0" * 65536)
    with pytest.raises(ImageBuildError, match="not qcow2"):
        import_image(raw, "x", tmp_path / "images", boot="bios")
    assert not any((tmp_path / "images" / "x").glob("[!.]*"))


@needs_qemu_img
def test_import_needs_a_boot_mode(tmp_path: Path) -> None:
    from vm_images.importer import import_image

    disk = _qcow2(tmp_path / "d.qcow2")
    with pytest.raises(RecipeError, match=r"--boot bios\|uefi"):
        import_image(disk, "x", tmp_path / "images")
    with pytest.raises(RecipeError, match="both --kernel and --initrd"):
        import_image(disk, "x", tmp_path / "images", kernel=disk)
    with pytest.raises(RecipeError, match="must match"):
        import_image(disk, "Bad Name", tmp_path / "images", boot="bios")
    with pytest.raises(ImageNotFound, match="does not exist"):
        import_image(tmp_path / "nope.qcow2", "x", tmp_path / "images", boot="bios")


def test_import_metadata_validation(tmp_path: Path) -> None:
    from vm_images.importer import load_metadata

    path = tmp_path / "m.deskvm.json"
    path.write_text(json.dumps({"boot": "floppy"}))
    with pytest.raises(RecipeError, match=r"boot: Input should be 'direct', 'bios' or 'uefi'"):
        load_metadata(path)
    path.write_text(json.dumps({"boot": "bios", "colour": 1}))
    with pytest.raises(RecipeError, match="colour: unknown field"):
        load_metadata(path)


# --- guest files for other tools (Packer) -----------------------------------------------------


def test_find_a_stored_version_by_hash(recipes: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    old = _fake_build(recipes, images, verified=False)
    _edit(recipes, DEFAULT_IMAGE, '"less",', '"less", "nano",')
    image = find_image(
        DEFAULT_IMAGE, images, recipes_dir=recipes, require_verified=False,
        content_hash=old.name[:8],
    )  # fmt: skip
    assert image.content_hash == old.name
    with pytest.raises(ImageNotFound, match="0 stored versions matching hash 'abc'"):
        find_image(DEFAULT_IMAGE, images, recipes_dir=recipes, content_hash="abc")
