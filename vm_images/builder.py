"""Offline image builder: a recipe (TOML data) in, a bootable read-only base image out.

A recipe (:mod:`vm_images.recipe`, ``vm_images/recipes/<name>.toml``) declares the suite,
packages, path filters, file sets, users, services, desktop defaults, keyboard layout and
what a ready frame looks like. The build is ``mmdebstrap`` (from the host's deb.debian.org
apt sources) into a directory, the recipe's file sets and generated files copied over it,
one generated finalize script run in the new root (users, services, caches, the recipe's
declared ``customize.commands``), ``mkfs.ext4 -d`` into a raw whole-disk ext4 file (no
partition table, no loop mount), then ``qemu-img convert -O qcow2``. The result lands in
``<images_dir>/<name>/<content_hash>/`` (layout: :mod:`vm_images.store`).

Generated in the guest from the recipe (a file set providing one of these is an error)::

    /etc/deskvm/image.conf        DESKVM_IMAGE, DESKVM_DISPLAY_DEFAULT, DESKVM_BACKGROUND,
                                  DESKVM_KEYBOARD_LAYOUT (sourced by the session scripts)
    /etc/deskvm/autostart         desktop.autostart, one command per line
    /etc/X11/xorg.conf.d/00-deskvm-keyboard.conf, /etc/default/keyboard   the XKB layout
    /etc/hostname, /etc/hosts, /etc/fstab

The content hash (:func:`vm_images.recipe.recipe_hash`) covers everything that goes in; an
image directory that exists and is complete is never rebuilt. Builds happen in a temporary
directory next to the final one, renamed into place at the end: a failed or interrupted
build leaves nothing behind. Downloaded packages are kept in ``<images_dir>/.cache/<suite>/``
and reused; dpkg runs under eatmydata (no fsync) when the host has it.

Errors (all :class:`~orchestrator.errors.DeskvmError`)::

    ImageNotFound     unknown recipe
    RecipeError       the recipe does not validate (names the field and allowed values)
    HostSetupError    not root, or mmdebstrap / mkfs.ext4 / qemu-img missing
    ImageBuildError   a build tool failed (message ends with the tool's output tail)
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.errors import HostSetupError, ImageBuildError
from orchestrator.interrupt import stop_process_group
from orchestrator.spec import BootImage
from vm_images.bootfiles import INITRD_DIR, deskvm_initrd, pvh_vmlinux
from vm_images.recipe import (
    BUILDER_FORMAT_VERSION,
    Recipe,
    RecipeError,
    load_recipe,
    recipe_hash,
)
from vm_images.store import boot_image, locked, make_dirs, now_iso, read_meta

__all__ = [
    "DEFAULT_IMAGE",
    "HOST_APT_SOURCES",
    "ProgressCallback",
    "build_image",
    "generated_files",
]

DEFAULT_IMAGE = "debian12-desktop"
"""The recipe sessions boot unless told otherwise."""

HOST_APT_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
"""The host's deb822 apt sources; only deb.debian.org entries of the recipe's suites are used."""

EATMYDATA_HOOKS = Path("/usr/share/mmdebstrap/hooks/eatmydata")
"""mmdebstrap's hook directory that runs dpkg under eatmydata (used if the host has it)."""

ProgressCallback = Callable[[str, float], None]
"""``progress(phase, fraction)``: phase name and overall completion in 0..1."""

_MIB = 1024 * 1024
_TAIL_LINES = 60
_STOP_GRACE_S = 30.0  # an interrupted build tool's time to clean up (mmdebstrap: unmount)
_TOOLS = ("mmdebstrap", "mkfs.ext4", "qemu-img", "chroot")

# mmdebstrap --verbose progress lines -> (phase, overall fraction when they appear).
_MMDEBSTRAP_MILESTONES = (
    ("I: running apt-get update", "bootstrap", 0.02),
    ("I: downloading packages", "bootstrap", 0.06),
    ("I: extracting archives", "bootstrap", 0.16),
    ("I: installing essential packages", "bootstrap", 0.20),
    ("I: installing remaining packages", "bootstrap", 0.30),
    ("I: running --customize-hook", "customize", 0.60),
    ("I: cleaning package lists", "customize", 0.68),
)
_BOOTSTRAP_END = 0.70
_FILESYSTEM_END = 0.85
_QCOW2_END = 0.98


def build_image(
    name: str,
    images_dir: Path,
    *,
    progress: ProgressCallback | None = None,
    force: bool = False,
    recipes_dir: Path | None = None,
    apt_sources: Path = HOST_APT_SOURCES,
) -> BootImage:
    """Build a recipe into ``<images_dir>/<name>/<content_hash>/`` (no-op if already built).

    The recipe is loaded and validated before anything else happens. Needs root
    (mmdebstrap ``--mode=root``), mmdebstrap, e2fsprogs >= 1.43 (``mkfs.ext4 -d``) and
    qemu-utils. Builds of the same image name are serialized with a lock file. Everything
    written is readable by the ``libvirt-qemu`` user (dirs 0755, files 0644). The image
    is not verified: ``deskvm image verify`` boots it (``deskvm image build`` does so by
    default).

    Args:
        name: recipe name (``"debian12-desktop"``) or path of a recipe file (``*.toml``).
        images_dir: root of built images; created (0755) if missing.
        progress: called as ``progress(phase, fraction)`` with phase one of ``"bootstrap"``,
            ``"customize"``, ``"filesystem"``, ``"qcow2"``, ``"done"`` and ``fraction`` the
            overall completion in 0..1 (never decreasing).
        force: rebuild even if a complete image of the current hash exists (it is replaced
            only once the new one is complete; its verification goes with it).
        recipes_dir: directory holding shipped recipes (default ``vm_images/recipes``).
        apt_sources: the host's deb822 apt sources to take deb.debian.org entries from.

    Returns:
        The built (or already present) image.

    Raises:
        ImageNotFound: no recipe of that name.
        RecipeError: the recipe is invalid.
        HostSetupError: not root, or a build tool is missing.
        ImageBuildError: a build step failed; nothing is left behind. The message ends
            with the failing tool's output tail.
    """
    report = _Progress(progress)
    recipe = load_recipe(name, recipes_dir=recipes_dir)
    generated = generated_files(recipe)
    digest = recipe_hash(recipe)
    name_dir = images_dir / recipe.name
    final_dir = name_dir / digest
    if not force and (meta := read_meta(final_dir)) is not None:
        report("done", 1.0)
        return boot_image(final_dir, meta)
    _check_host()
    make_dirs(name_dir)
    with locked(name_dir / ".lock"):
        if not force and (meta := read_meta(final_dir)) is not None:
            report("done", 1.0)
            return boot_image(final_dir, meta)
        for stale in name_dir.glob(".build-*"):  # left by a killed build (we hold the lock)
            _remove_build_dir(stale)
        build_dir = name_dir / f".build-{digest[:12]}-{os.getpid()}"
        build_dir.mkdir(mode=0o755)
        try:
            _build(recipe, digest, generated, build_dir, images_dir, apt_sources, report)
            if final_dir.exists():  # force: replace the old image only now
                trash = name_dir / f".build-old-{digest[:12]}-{os.getpid()}"
                final_dir.rename(trash)
                shutil.rmtree(trash)
            build_dir.rename(final_dir)
        except BaseException:
            _remove_build_dir(build_dir)
            raise
    meta = read_meta(final_dir)
    if meta is None:  # pragma: no cover - we just wrote it
        raise ImageBuildError(f"image {recipe.name!r} incomplete after build in {final_dir}")
    report("done", 1.0)
    return boot_image(final_dir, meta)


# --- what the recipe generates in the guest -------------------------------------------------


def generated_files(recipe: Recipe) -> dict[str, str]:
    """Guest files the builder writes from the recipe's data: relative path -> text.

    Raises:
        RecipeError: a file set or tree of the recipe provides one of these paths.
    """
    m = recipe.model
    r, g, b = m.desktop.background_rgb
    layout = m.desktop.keyboard_layout
    conf = {
        "DESKVM_IMAGE": recipe.name,
        "DESKVM_DISPLAY_DEFAULT": f"{m.desktop.width_px}x{m.desktop.height_px}",
        "DESKVM_BACKGROUND": f"#{r:02X}{g:02X}{b:02X}",
        "DESKVM_KEYBOARD_LAYOUT": layout,
    }
    host = m.boot.hostname
    files = {
        "etc/deskvm/image.conf": "# deskvm: written by the image builder from the recipe.\n"
        + "".join(f"{k}={shlex.quote(v)}\n" for k, v in conf.items()),
        "etc/deskvm/autostart": "".join(f"{command}\n" for command in m.desktop.autostart),
        "etc/X11/xorg.conf.d/00-deskvm-keyboard.conf": (
            "# deskvm: the recipe's keyboard layout (desktop.keyboard_layout).\n"
            'Section "InputClass"\n'
            '    Identifier "deskvm-keyboard"\n'
            '    MatchIsKeyboard "on"\n'
            '    Option "XkbModel" "pc105"\n'
            f'    Option "XkbLayout" "{layout}"\n'
            "EndSection\n"
        ),
        "etc/default/keyboard": (
            f'XKBMODEL="pc105"\nXKBLAYOUT="{layout}"\nXKBVARIANT=""\nXKBOPTIONS=""\n'
            'BACKSPACE="guess"\n'
        ),
        "etc/hostname": f"{host}\n",
        "etc/hosts": f"127.0.0.1\tlocalhost\n127.0.1.1\t{host}\n::1\t\tlocalhost ip6-localhost "
        "ip6-loopback\n",
        # Whole-disk ext4 on virtio-blk; the base is fresh for every session, so no fsck.
        "etc/fstab": "/dev/vda / ext4 rw,noatime,errors=remount-ro 0 0\n",
    }
    for label, root in recipe.trees():
        for rel in files:
            if (root / rel).exists():
                raise RecipeError(
                    f"recipe {recipe.name!r}: files: {label} provides /{rel}, which the "
                    "builder generates from the recipe"
                )
    return files


def finalize_script(recipe: Recipe) -> str:
    """The shell script run (``/bin/sh -eu``) in the new root after the files are in."""
    m = recipe.model
    q = shlex.quote
    lines = [
        "# deskvm: generated by vm_images.builder from the recipe; runs in the new root.",
        "set -eu",
    ]
    for user in m.users:
        lines.append(
            f"useradd --create-home --uid {user.uid} --user-group --shell {q(user.shell)} "
            f"--comment {q(user.comment)} {q(user.name)}"
        )
        lines.append(f"passwd --lock {q(user.name)} >/dev/null")
        if user.groups:
            lines.append(f"usermod --append --groups {q(','.join(user.groups))} {q(user.name)}")
    lines += [
        # A fixed machine id: no "first boot" (which would re-run presets) in any session.
        "od -An -N16 -tx1 /dev/urandom | tr -d ' \\n' >/etc/machine-id",
        "echo >>/etc/machine-id",
        f"systemctl set-default {q(m.services.default_target)}",
    ]
    if m.services.enable:
        lines.append("systemctl enable " + " ".join(map(q, m.services.enable)))
    if m.services.disable:
        units = " ".join(map(q, m.services.disable))
        lines.append(f"systemctl disable {units} 2>/dev/null || true")
    if m.services.mask:
        lines.append("systemctl mask " + " ".join(map(q, m.services.mask)) + " >/dev/null")
    lines += [
        # Caches the first boot would otherwise build.
        "systemd-hwdb update",
        "ldconfig",
        # mkfs.ext4 -d keeps whole-second times only: fontconfig compares a font directory's
        # mtime to the nanosecond, so caches built on the finer times would all be stale in
        # the guest and every program would rescan the fonts (tens of seconds under TCG).
        "if command -v fc-cache >/dev/null; then",
        "    for dir in /usr/share/fonts /usr/local/share/fonts /var/cache/fontconfig; do",
        '        [ -d "$dir" ] || continue',
        '        find "$dir" -type d -exec sh -c '
        '\'for d; do touch -m -d "@$(stat -c %Y "$d")" "$d"; done\' sh {} +',
        "    done",
        "    fc-cache -s >/dev/null 2>&1 || true",
        "fi",
        "touch /etc/.updated /var/.updated",
    ]
    if not any((root / INITRD_DIR / "init").is_file() for _label, root in recipe.trees()):
        # The distribution's initrd boots: it must carry virtio-blk and ext4 (root=/dev/vda,
        # no partition table). (The file sets' own initrd checks its modules when built.)
        lines += [
            "kver=$(ls /lib/modules | sort -V | tail -n 1)",
            "for module in virtio_blk ext4; do",
            '    if ! grep -q "/$module.ko" "/lib/modules/$kver/modules.builtin" &&',
            '        ! lsinitramfs "/boot/initrd.img-$kver" | grep -q "/$module.ko"; then',
            '        echo "deskvm finalize: $module missing from the initrd" >&2',
            "        exit 1",
            "    fi",
            "done",
        ]
    for index, command in enumerate(m.customize.commands):
        lines.append(f"echo 'deskvm finalize: customize.commands[{index}]'")
        lines.append(f"/bin/sh -eu -c {q(command)}")
    return "\n".join(lines) + "\n"


# --- the build ------------------------------------------------------------------------------


def _build(
    recipe: Recipe,
    digest: str,
    generated: dict[str, str],
    build_dir: Path,
    images_dir: Path,
    apt_sources: Path,
    report: _Progress,
) -> None:
    started_s = time.monotonic()
    stage = build_dir / "stage"
    _stage_files(recipe, generated, stage / "rootfs")
    (stage / "finalize.sh").write_text(finalize_script(recipe), encoding="utf-8")
    sources = build_dir / "apt.sources"
    sources.write_text(_guest_apt_sources(apt_sources, recipe), encoding="utf-8")
    cache = images_dir / ".cache" / recipe.suite
    make_dirs(cache)
    rootfs = build_dir / "rootfs"

    report("bootstrap", 0.0)
    _run(_mmdebstrap_command(recipe, stage, sources, cache, rootfs), _mmdebstrap_progress(report))
    report("filesystem", _BOOTSTRAP_END)

    kernel = _single(rootfs / "boot", "vmlinuz-*")
    kernel_version = kernel.name.removeprefix("vmlinuz-")
    # The kernel's ELF image when it has a PVH entry (no decompression at boot, ~3 s under
    # TCG), else the bzImage; the file sets' small initrd when they provide one (~3 s less
    # than initramfs-tools'), else the distribution's. See vm_images.bootfiles.
    vmlinux = pvh_vmlinux(kernel.read_bytes())
    kernel_file = "vmlinuz" if vmlinux is None else "vmlinux"
    if vmlinux is None:
        shutil.copyfile(kernel, build_dir / kernel_file)
    else:
        (build_dir / kernel_file).write_bytes(vmlinux)
    if (rootfs / INITRD_DIR / "init").is_file():
        initrd_kind = "deskvm"
        (build_dir / "initrd.img").write_bytes(deskvm_initrd(rootfs, kernel_version))
    else:
        initrd_kind = "distribution"
        shutil.copyfile(_single(rootfs / "boot", "initrd.img-*"), build_dir / "initrd.img")
    packages = _run(
        ["dpkg-query", f"--admindir={rootfs}/var/lib/dpkg", "-W", "-f=${Package}\t${Version}\n"]
    )
    (build_dir / "packages.tsv").write_text(packages, encoding="utf-8")

    content_bytes, inode_count = _tree_usage(rootfs)
    fs_bytes = _round_up(
        int(content_bytes * 1.10) + inode_count * 256 + 64 * _MIB + recipe.headroom_mib * _MIB,
        _MIB,
    )
    raw = build_dir / "root.raw"
    with raw.open("wb") as f:
        f.truncate(fs_bytes)
    _run(
        [
            "mkfs.ext4", "-q", "-F", "-L", "deskvm-root", "-m", "1", "-d", str(rootfs),
            "-E", "lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0", str(raw),
        ]
    )  # fmt: skip
    _remove_tree(rootfs)
    report("qcow2", _FILESYSTEM_END)

    base = build_dir / "base.qcow2"
    compression = recipe.model.boot.qcow2_compression
    convert = ["qemu-img", "convert", "-f", "raw", "-O", "qcow2"]
    if compression != "none":
        # Compressed clusters; zstd decompresses fast enough not to show in boot time.
        convert += ["-c", "-o", f"compression_type={compression}", "-m", "4", "-W"]
    _run([*convert, str(raw), str(base)])
    raw.unlink()
    shutil.rmtree(stage)
    sources.unlink()
    report("qcow2", _QCOW2_END)

    m = recipe.model
    meta: dict[str, Any] = {
        "name": recipe.name,
        "content_hash": digest,
        "source": "recipe",
        "builder_format_version": BUILDER_FORMAT_VERSION,
        "description": recipe.description,
        "boot": "direct",
        "kernel_cmdline": recipe.kernel_cmdline,
        "background_rgb": list(recipe.background_rgb),
        "helper_port": recipe.helper_port,
        "keyboard_layout": recipe.keyboard_layout,
        "display_default": [m.desktop.width_px, m.desktop.height_px],
        "ready": m.ready.model_dump(mode="json"),
        "kernel_file": kernel_file,
        "initrd": initrd_kind,
        "kernel_version": kernel_version,
        "built_at": now_iso(),
        "build_duration_s": round(time.monotonic() - started_s, 1),
        "sizes": {
            "rootfs_content_bytes": content_bytes,
            "filesystem_bytes": fs_bytes,
            "base_qcow2_bytes": base.stat().st_size,
            "kernel_bytes": (build_dir / kernel_file).stat().st_size,
            "initrd_bytes": (build_dir / "initrd.img").stat().st_size,
        },
        "packages_installed": len(packages.splitlines()),
        "recipe": m.model_dump(mode="json"),
    }
    for path in build_dir.iterdir():
        path.chmod(0o644)
    build_dir.chmod(0o755)
    meta_tmp = build_dir / ".image.json.tmp"
    meta_tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    meta_tmp.chmod(0o644)
    meta_tmp.rename(build_dir / "image.json")


def _stage_files(recipe: Recipe, generated: dict[str, str], target: Path) -> None:
    """Merge the recipe's trees and generated files into ``target``, modes normalized
    (dirs 0755, files 0644, or 0755 when executable in the source)."""
    for _label, root in recipe.trees():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                if filename == ".DS_Store":
                    continue
                source = Path(dirpath) / filename
                dest = target / source.relative_to(root)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, dest)
                dest.chmod(0o755 if os.stat(source).st_mode & 0o111 else 0o644)
    for rel, text in generated.items():
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text, encoding="utf-8")
        dest.chmod(0o644)
    for dirpath, _dirnames, _filenames in os.walk(target):
        os.chmod(dirpath, 0o755)


def _mmdebstrap_command(
    recipe: Recipe, stage: Path, sources: Path, cache: Path, rootfs: Path
) -> list[str]:
    overlay = stage / "rootfs"
    m = recipe.model
    recommends = "true" if m.packages.recommends else "false"
    cmd = [
        "mmdebstrap",
        "--verbose",
        "--mode=root",
        "--format=directory",
        f"--variant={recipe.variant}",
        f"--architectures={m.base.architecture}",
        f'--aptopt=APT::Install-Recommends "{recommends}"',
        '--aptopt=APT::Install-Suggests "false"',
        "--dpkgopt=force-unsafe-io",
        "--skip=essential/unlink",
        *(f"--dpkgopt=path-exclude={glob}" for glob in m.strip.path_exclude),
        *(f"--dpkgopt=path-include={glob}" for glob in m.strip.path_include),
        f'--setup-hook=mkdir -p "$1/var/cache/apt/archives" && find {_q(cache)} -maxdepth 1 '
        f"-name '*.deb' -exec cp -t \"$1/var/cache/apt/archives/\" {{}} +",
    ]
    if EATMYDATA_HOOKS.is_dir() and shutil.which("eatmydata") is not None:
        cmd.append(f"--hook-dir={EATMYDATA_HOOKS}")
    for preseed in m.files.preseed:
        cmd += [
            f'--setup-hook=mkdir -p "$1/{preseed}"',
            f"--setup-hook=sync-in {_q(overlay / preseed)} /{preseed}",
        ]
    cmd.append("--include=" + ",".join(recipe.packages))
    cmd += [
        f"--customize-hook=find \"$1/var/cache/apt/archives\" -maxdepth 1 -name '*.deb' "
        f"-exec cp -n -t {_q(cache)} {{}} +",
        f"--customize-hook=sync-in {_q(overlay)} /",
        f"--customize-hook=copy-in {_q(stage / 'finalize.sh')} /tmp",
        '--customize-hook=chroot "$1" /bin/sh -eu /tmp/finalize.sh',
        '--customize-hook=rm -f "$1/tmp/finalize.sh"',
        recipe.suite,
        str(rootfs),
        str(sources),
    ]
    return cmd


def _mmdebstrap_progress(report: _Progress) -> Callable[[str], None]:
    state = {"fraction": 0.0}

    def on_line(line: str) -> None:
        for prefix, phase, fraction in _MMDEBSTRAP_MILESTONES:
            if line.startswith(prefix):
                state["fraction"] = fraction
                report(phase, fraction)
                return
        if line.startswith(("Unpacking ", "Setting up ")) and state["fraction"] >= 0.30:
            # Creep towards the customize milestone as packages install.
            state["fraction"] += (0.58 - state["fraction"]) * 0.006
            report("bootstrap", state["fraction"])

    return on_line


def _guest_apt_sources(host_sources: Path, recipe: Recipe) -> str:
    """deb822 stanzas of the host's sources: deb.debian.org, the recipe's suites, components."""
    try:
        text = host_sources.read_text(encoding="utf-8")
    except OSError:
        text = ""
    stanzas: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        uris = [u for u in fields.get("uris", "").split() if "://deb.debian.org/" in u]
        suites = [s for s in fields.get("suites", "").split() if s in recipe.mirror_suites]
        components = [c for c in fields.get("components", "").split() if c in recipe.components]
        if "deb" not in fields.get("types", "").split() or not uris or not suites or not components:
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        stanza = [
            "Types: deb",
            f"URIs: {' '.join(uris)}",
            f"Suites: {' '.join(suites)}",
            f"Components: {' '.join(components)}",
        ]
        if "signed-by" in fields:
            stanza.append(f"Signed-By: {fields['signed-by']}")
        stanzas.append("\n".join(stanza))
    if not stanzas:  # no usable host entry: the standard Debian mirrors
        keyring = "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
        main = [s for s in recipe.mirror_suites if not s.endswith("-security")]
        security = [s for s in recipe.mirror_suites if s.endswith("-security")]
        component_list = " ".join(recipe.components)
        if main:
            stanzas.append(
                f"Types: deb\nURIs: http://deb.debian.org/debian\nSuites: {' '.join(main)}\n"
                f"Components: {component_list}\n{keyring}"
            )
        if security:
            stanzas.append(
                f"Types: deb\nURIs: http://deb.debian.org/debian-security\n"
                f"Suites: {' '.join(security)}\nComponents: {component_list}\n{keyring}"
            )
    return "\n\n".join(stanzas) + "\n"


# --- helpers --------------------------------------------------------------------------


class _Progress:
    """Forwards monotonic progress to the user's callback."""

    def __init__(self, callback: ProgressCallback | None) -> None:
        self._callback = callback
        self._fraction = 0.0

    def __call__(self, phase: str, fraction: float) -> None:
        self._fraction = max(self._fraction, min(1.0, fraction))
        if self._callback is not None:
            self._callback(phase, self._fraction)


def _check_host() -> None:
    if os.geteuid() != 0:
        raise HostSetupError("building images needs root (mmdebstrap --mode=root)")
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        raise HostSetupError(
            f"missing image build tools: {', '.join(missing)} "
            "(apt-get install mmdebstrap e2fsprogs qemu-utils)"
        )


def _run(cmd: list[str], on_line: Callable[[str], None] | None = None) -> str:
    """Run a build tool, streaming its output; return stdout+stderr text.

    Raises:
        ImageBuildError: the tool could not start or exited non-zero (with its output tail).
    """
    env = dict(os.environ, LC_ALL="C.UTF-8", DEBIAN_FRONTEND="noninteractive")
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    lines: list[str] = []
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, text=True, errors="replace", start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        raise ImageBuildError(f"cannot run {cmd[0]}: {exc}") from exc
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            lines.append(line)
            if on_line is not None:
                on_line(line)
        returncode = proc.wait()
    except BaseException:
        # The tool's children (apt, dpkg, maintainer scripts) go with it: its own group.
        stop_process_group(proc, grace_s=_STOP_GRACE_S)
        raise
    if returncode != 0:
        output = "\n".join(tail)
        raise ImageBuildError(
            f"{cmd[0]} failed with exit status {returncode}; output tail:\n{output}"
        )
    return "\n".join(lines) + "\n"


def _single(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise ImageBuildError(f"expected one {pattern} in {directory}, found {len(found)}")
    return found[0]


def _tree_usage(root: Path) -> tuple[int, int]:
    """(bytes of allocated blocks, number of inodes) of a directory tree, not following links."""
    used_bytes = 0
    inodes = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for entry in (*dirnames, *filenames):
            st = os.lstat(os.path.join(dirpath, entry))
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            inodes += 1
            used_bytes += max(st.st_blocks * 512, 4096 if stat.S_ISDIR(st.st_mode) else 0)
    return used_bytes, inodes


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    mounts: list[str] = []
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            target = line.split()[1].encode().decode("unicode_escape")
            if target == prefix or target.startswith(prefix + "/"):
                mounts.append(target)
    return sorted(mounts, key=len, reverse=True)


def _remove_tree(path: Path) -> None:
    """Delete a build tree, first unmounting anything a killed mmdebstrap left mounted in it.

    Raises:
        ImageBuildError: something stays mounted below ``path`` (it is then left alone).
    """
    if not path.exists():
        return
    for mount in _mounts_under(path):
        subprocess.run(["umount", "--lazy", mount], check=False, capture_output=True)
    remaining = _mounts_under(path)
    if remaining:
        raise ImageBuildError(f"cannot clean {path}: still mounted: {', '.join(remaining)}")
    shutil.rmtree(path)


def _remove_build_dir(path: Path) -> None:
    with contextlib.suppress(OSError, ImageBuildError):
        _remove_tree(path)


def _q(path: Path) -> str:
    """Quote a path for the shell mmdebstrap runs hooks with."""
    return "'" + str(path).replace("'", "'\\''") + "'"
