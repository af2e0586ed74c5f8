"""Offline image builder: a recipe directory in, a bootable read-only base image out.

A recipe (``vm_images/recipes/<name>/``) is declarative::

    recipe.toml     suite, packages, dpkg path filters, kernel command line, disk headroom
    rootfs/         files copied over the root filesystem after the packages are installed
                    ([preseed] paths are also copied in before, e.g. initramfs config)
    customize.sh    run as root inside the new root filesystem (chroot), last

The build is ``mmdebstrap`` (from the host's deb.debian.org apt sources) into a directory,
``mkfs.ext4 -d`` into a raw whole-disk ext4 file (no partition table, no loop mount), then
``qemu-img convert -O qcow2``. The result lands in ``<images_dir>/<name>/<content_hash>/``::

    base.qcow2      read-only base disk (sessions add an overlay)
    vmlinuz         kernel for direct boot
    initrd.img      initial ramdisk for direct boot
    packages.tsv    installed Debian packages (name, version)
    image.json      name, content_hash, kernel_cmdline, built_at, sizes (written last)

The content hash is sha256 over the recipe's files (relative path, executable bit and
bytes, sorted by path) and :data:`BUILDER_FORMAT_VERSION`; an image directory that exists
and is complete is never rebuilt. Builds happen in a temporary directory next to the final
one, renamed into place at the end: a failed or interrupted build leaves nothing behind.

Errors (all :class:`~orchestrator.errors.DeskvmError`)::

    ImageNotFound     unknown recipe, or recipe not built yet (find_image)
    HostSetupError    not root, or mmdebstrap / mkfs.ext4 / qemu-img missing
    ImageBuildError   a build tool failed (message ends with the tool's output tail)
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import HostSetupError, ImageBuildError, ImageNotFound
from orchestrator.spec import BootImage

__all__ = [
    "BUILDER_FORMAT_VERSION",
    "DEFAULT_IMAGE",
    "HOST_APT_SOURCES",
    "RECIPES_DIR",
    "ProgressCallback",
    "Recipe",
    "build_image",
    "find_image",
    "list_recipes",
    "load_recipe",
    "recipe_hash",
]

DEFAULT_IMAGE = "debian12-desktop"
"""The recipe sessions boot unless told otherwise."""

BUILDER_FORMAT_VERSION = 1
"""Bumped whenever the builder changes what it produces; part of every content hash."""

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
"""Where the recipes shipped with deskvm live."""

HOST_APT_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
"""The host's deb822 apt sources; only deb.debian.org entries of the recipe's suites are used."""

ProgressCallback = Callable[[str, float], None]
"""``progress(phase, fraction)``: phase name and overall completion in 0..1."""

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_IMAGE_FILES = ("base.qcow2", "vmlinuz", "initrd.img", "image.json")
_MIB = 1024 * 1024
_TAIL_LINES = 60
_TOOLS = ("mmdebstrap", "mkfs.ext4", "qemu-img", "chroot")
_SKIPPED_NAMES = frozenset({"__pycache__", ".DS_Store"})

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


@dataclass(frozen=True, slots=True)
class Recipe:
    """A parsed ``recipe.toml`` and where its recipe directory is.

    Attributes:
        name: recipe (and image) name, the directory name.
        path: the recipe directory.
        description: one line for humans.
        suite: Debian suite given to mmdebstrap, e.g. ``"bookworm"``.
        variant: mmdebstrap variant, e.g. ``"apt"``.
        mirror_suites: suites kept from the host's deb.debian.org apt sources.
        components: archive components kept, e.g. ``("main",)``.
        packages: packages installed on top of the variant (no Recommends).
        dpkg_path_exclude: dpkg ``path-exclude`` globs (also kept in the guest).
        dpkg_path_include: dpkg ``path-include`` globs (exceptions to the excludes).
        preseed_paths: paths under ``rootfs/`` copied in before packages are installed.
        kernel_cmdline: base kernel command line (the host appends ``deskvm.*`` options).
        headroom_mib: free space in MiB left in the root filesystem beyond its content.
        background_rgb: root-window colour the desktop paints, 0..255 per channel.
        helper_port: name of the virtio-serial port the image's guest helper serves
            (e.g. ``"dev.deskvm.helper.0"``), or ``None`` when the image has no helper.
    """

    name: str
    path: Path
    description: str
    suite: str
    variant: str
    mirror_suites: tuple[str, ...]
    components: tuple[str, ...]
    packages: tuple[str, ...]
    dpkg_path_exclude: tuple[str, ...]
    dpkg_path_include: tuple[str, ...]
    preseed_paths: tuple[str, ...]
    kernel_cmdline: str
    headroom_mib: int
    background_rgb: tuple[int, int, int]
    helper_port: str | None = None


_PORT_RE = re.compile(r"^[a-z][a-z0-9.]{0,62}$")


def _port_name(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _PORT_RE.match(value):
        raise ValueError(f"helper_port must match {_PORT_RE.pattern}, got {value!r}")
    return value


def list_recipes(*, recipes_dir: Path | None = None) -> list[str]:
    """Names of the recipes that can be built, sorted.

    Args:
        recipes_dir: directory holding recipe directories (default :data:`RECIPES_DIR`).

    Returns:
        Names of the subdirectories that contain a ``recipe.toml``.
    """
    root = recipes_dir if recipes_dir is not None else RECIPES_DIR
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if (p / "recipe.toml").is_file() and _NAME_RE.match(p.name)
    )


def load_recipe(name: str, *, recipes_dir: Path | None = None) -> Recipe:
    """Read and validate one recipe.

    Args:
        name: recipe name, e.g. ``"debian12-desktop"``.
        recipes_dir: directory holding recipe directories (default :data:`RECIPES_DIR`).

    Returns:
        The parsed recipe.

    Raises:
        ImageNotFound: no recipe of that name.
        ImageBuildError: the recipe exists but ``recipe.toml`` is malformed.
    """
    path = _recipe_dir(name, recipes_dir)
    try:
        data = tomllib.loads((path / "recipe.toml").read_text(encoding="utf-8"))
        image = data["image"]
        rgb = tuple(int(c) for c in image.get("background_rgb", (0x2E, 0x4A, 0x62)))
        if len(rgb) != 3 or not all(0 <= c <= 255 for c in rgb):
            raise ValueError(f"background_rgb must be 3 values in 0..255, got {rgb}")
        recipe = Recipe(
            name=name,
            path=path,
            description=str(image.get("description", "")),
            suite=str(image["suite"]),
            variant=str(image.get("variant", "apt")),
            mirror_suites=_str_tuple(image.get("mirror_suites", [image["suite"]])),
            components=_str_tuple(image.get("components", ["main"])),
            packages=_str_tuple(data.get("packages", {}).get("include", [])),
            dpkg_path_exclude=_str_tuple(data.get("dpkg", {}).get("path_exclude", [])),
            dpkg_path_include=_str_tuple(data.get("dpkg", {}).get("path_include", [])),
            preseed_paths=_str_tuple(data.get("preseed", {}).get("paths", [])),
            kernel_cmdline=" ".join(str(image["kernel_cmdline"]).split()),
            headroom_mib=int(image.get("headroom_mib", 1024)),
            background_rgb=(rgb[0], rgb[1], rgb[2]),
            helper_port=_port_name(image.get("helper_port")),
        )
    except (KeyError, TypeError, ValueError, tomllib.TOMLDecodeError) as exc:
        raise ImageBuildError(
            f"recipe {name!r} ({path / 'recipe.toml'}) is invalid: {exc}"
        ) from exc
    if recipe.headroom_mib < 0:
        raise ImageBuildError(f"recipe {name!r}: headroom_mib must not be negative")
    for preseed in recipe.preseed_paths:
        if ".." in Path(preseed).parts or not (path / "rootfs" / preseed).exists():
            raise ImageBuildError(f"recipe {name!r}: preseed path {preseed!r} not under rootfs/")
    return recipe


def recipe_hash(name: str, *, recipes_dir: Path | None = None) -> str:
    """The content hash an image built from this recipe now would carry.

    sha256 over ``deskvm-image-format <BUILDER_FORMAT_VERSION>`` and, for every file of the
    recipe directory sorted by relative POSIX path: the path, whether it is executable, its
    length and its bytes. ``__pycache__`` directories are ignored.

    Args:
        name: recipe name.
        recipes_dir: directory holding recipe directories (default :data:`RECIPES_DIR`).

    Returns:
        64 lowercase hex digits.

    Raises:
        ImageNotFound: no recipe of that name.
    """
    return _hash_tree(_recipe_dir(name, recipes_dir))


def find_image(name: str, images_dir: Path, *, recipes_dir: Path | None = None) -> BootImage:
    """The built image of a recipe's current content hash.

    Args:
        name: recipe name, e.g. ``"debian12-desktop"``.
        images_dir: root of built images (``<images_dir>/<name>/<content_hash>/``).
        recipes_dir: directory holding recipe directories (default :data:`RECIPES_DIR`).

    Returns:
        The image, ready to boot.

    Raises:
        ImageNotFound: no such recipe, or it has not been built (since its last change).
    """
    recipe = load_recipe(name, recipes_dir=recipes_dir)
    digest = _hash_tree(recipe.path)
    image = _complete_image(recipe, digest, images_dir / name / digest)
    if image is None:
        older = _built_hashes(images_dir / name)
        hint = f" (built images of older recipe versions: {', '.join(older)})" if older else ""
        raise ImageNotFound(
            f"image {name!r} is not built for its current recipe (hash {digest[:12]}) under "
            f"{images_dir}{hint}; run `deskvm image build {name}`"
        )
    return image


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

    Needs root (mmdebstrap ``--mode=root``), mmdebstrap, e2fsprogs >= 1.43 (``mkfs.ext4 -d``)
    and qemu-utils. Downloaded packages are cached in ``<images_dir>/.cache/<suite>/`` for
    the next build. Builds of the same image name are serialized with a lock file.
    Everything written is readable by the ``libvirt-qemu`` user (dirs 0755, files 0644).

    Args:
        name: recipe name, e.g. ``"debian12-desktop"``.
        images_dir: root of built images; created (0755) if missing.
        progress: called as ``progress(phase, fraction)`` with phase one of ``"bootstrap"``,
            ``"customize"``, ``"filesystem"``, ``"qcow2"``, ``"done"`` and ``fraction`` the
            overall completion in 0..1 (never decreasing).
        force: rebuild even if a complete image of the current hash exists (it is replaced
            only once the new one is complete).
        recipes_dir: directory holding recipe directories (default :data:`RECIPES_DIR`).
        apt_sources: the host's deb822 apt sources to take deb.debian.org entries from.

    Returns:
        The built (or already present) image.

    Raises:
        ImageNotFound: no recipe of that name.
        HostSetupError: not root, or a build tool is missing.
        ImageBuildError: the recipe is invalid or a build step failed; nothing is left
            behind. The message ends with the failing tool's output tail.
    """
    report = _Progress(progress)
    recipe = load_recipe(name, recipes_dir=recipes_dir)
    digest = _hash_tree(recipe.path)
    name_dir = images_dir / name
    final_dir = name_dir / digest
    if not force and (image := _complete_image(recipe, digest, final_dir)) is not None:
        report("done", 1.0)
        return image
    _check_host()
    _make_dirs(name_dir)
    with _locked(name_dir / ".lock"):
        if not force and (image := _complete_image(recipe, digest, final_dir)) is not None:
            report("done", 1.0)
            return image
        for stale in name_dir.glob(".build-*"):  # left by a killed build (we hold the lock)
            _remove_build_dir(stale)
        build_dir = name_dir / f".build-{digest[:12]}-{os.getpid()}"
        build_dir.mkdir(mode=0o755)
        try:
            _build(recipe, digest, build_dir, images_dir, apt_sources, report)
            if final_dir.exists():  # force: replace the old image only now
                trash = name_dir / f".build-old-{digest[:12]}-{os.getpid()}"
                final_dir.rename(trash)
                shutil.rmtree(trash)
            build_dir.rename(final_dir)
        except BaseException:
            _remove_build_dir(build_dir)
            raise
    image = _complete_image(recipe, digest, final_dir)
    if image is None:  # pragma: no cover - we just wrote it
        raise ImageBuildError(f"image {name!r} incomplete after build in {final_dir}")
    report("done", 1.0)
    return image


# --- the build ------------------------------------------------------------------------


def _build(
    recipe: Recipe,
    digest: str,
    build_dir: Path,
    images_dir: Path,
    apt_sources: Path,
    report: _Progress,
) -> None:
    started_s = time.monotonic()
    stage = build_dir / "recipe"
    _stage_recipe(recipe.path, stage)
    sources = build_dir / "apt.sources"
    sources.write_text(_guest_apt_sources(apt_sources, recipe), encoding="utf-8")
    cache = images_dir / ".cache" / recipe.suite
    _make_dirs(cache)
    rootfs = build_dir / "rootfs"

    report("bootstrap", 0.0)
    _run(_mmdebstrap_command(recipe, stage, sources, cache, rootfs), _mmdebstrap_progress(report))
    report("filesystem", _BOOTSTRAP_END)

    kernel = _single(rootfs / "boot", "vmlinuz-*")
    initrd = _single(rootfs / "boot", "initrd.img-*")
    shutil.copyfile(kernel, build_dir / "vmlinuz")
    shutil.copyfile(initrd, build_dir / "initrd.img")
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
    _run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(base)])
    raw.unlink()
    shutil.rmtree(stage)
    sources.unlink()
    report("qcow2", _QCOW2_END)

    meta: dict[str, Any] = {
        "name": recipe.name,
        "content_hash": digest,
        "builder_format_version": BUILDER_FORMAT_VERSION,
        "description": recipe.description,
        "kernel_cmdline": recipe.kernel_cmdline,
        "background_rgb": list(recipe.background_rgb),
        "helper_port": recipe.helper_port,
        "kernel_version": kernel.name.removeprefix("vmlinuz-"),
        "built_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "build_duration_s": round(time.monotonic() - started_s, 1),
        "sizes": {
            "rootfs_content_bytes": content_bytes,
            "filesystem_bytes": fs_bytes,
            "base_qcow2_bytes": base.stat().st_size,
            "vmlinuz_bytes": (build_dir / "vmlinuz").stat().st_size,
            "initrd_bytes": (build_dir / "initrd.img").stat().st_size,
        },
    }
    for path in build_dir.iterdir():
        path.chmod(0o644)
    build_dir.chmod(0o755)
    meta_tmp = build_dir / ".image.json.tmp"
    meta_tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    meta_tmp.chmod(0o644)
    meta_tmp.rename(build_dir / "image.json")


def _mmdebstrap_command(
    recipe: Recipe, stage: Path, sources: Path, cache: Path, rootfs: Path
) -> list[str]:
    overlay = stage / "rootfs"
    cmd = [
        "mmdebstrap",
        "--verbose",
        "--mode=root",
        "--format=directory",
        f"--variant={recipe.variant}",
        "--architectures=amd64",
        '--aptopt=APT::Install-Recommends "false"',
        '--aptopt=APT::Install-Suggests "false"',
        "--skip=essential/unlink",
        *(f"--dpkgopt=path-exclude={glob}" for glob in recipe.dpkg_path_exclude),
        *(f"--dpkgopt=path-include={glob}" for glob in recipe.dpkg_path_include),
        f'--setup-hook=mkdir -p "$1/var/cache/apt/archives" && find {_q(cache)} -maxdepth 1 '
        f"-name '*.deb' -exec cp -t \"$1/var/cache/apt/archives/\" {{}} +",
    ]
    for preseed in recipe.preseed_paths:
        cmd += [
            f'--setup-hook=mkdir -p "$1/{preseed}"',
            f"--setup-hook=sync-in {_q(overlay / preseed)} /{preseed}",
        ]
    if recipe.packages:
        cmd.append("--include=" + ",".join(recipe.packages))
    cmd += [
        f"--customize-hook=find \"$1/var/cache/apt/archives\" -maxdepth 1 -name '*.deb' "
        f"-exec cp -n -t {_q(cache)} {{}} +",
        f"--customize-hook=sync-in {_q(overlay)} /",
        f"--customize-hook=copy-in {_q(stage / 'customize.sh')} /tmp",
        '--customize-hook=chroot "$1" /bin/sh -eu /tmp/customize.sh',
        '--customize-hook=rm -f "$1/tmp/customize.sh"',
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


def _recipe_dir(name: str, recipes_dir: Path | None) -> Path:
    root = recipes_dir if recipes_dir is not None else RECIPES_DIR
    path = root / name
    if not _NAME_RE.match(name) or not (path / "recipe.toml").is_file():
        available = ", ".join(list_recipes(recipes_dir=root)) or "none"
        raise ImageNotFound(f"no image recipe named {name!r} (available: {available})")
    return path


def _recipe_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_NAMES)
        for filename in filenames:
            if filename not in _SKIPPED_NAMES:
                yield Path(dirpath) / filename


def _hash_tree(root: Path) -> str:
    digest = hashlib.sha256(f"deskvm-image-format {BUILDER_FORMAT_VERSION}\n".encode())
    entries = sorted((p.relative_to(root).as_posix(), p) for p in _recipe_files(root))
    for rel, path in entries:
        data = path.read_bytes()
        executable = "x" if os.stat(path).st_mode & 0o111 else "-"
        digest.update(f"{rel}\0{executable}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _stage_recipe(source: Path, stage: Path) -> None:
    """Copy the recipe with normalized modes (dirs 0755, files 0644 or 0755, owner root)."""
    for path in _recipe_files(source):
        target = stage / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        target.chmod(0o755 if os.stat(path).st_mode & 0o111 else 0o644)
    for dirpath, _dirnames, _filenames in os.walk(stage):
        os.chmod(dirpath, 0o755)


def _complete_image(recipe: Recipe, digest: str, image_dir: Path) -> BootImage | None:
    if not all((image_dir / f).is_file() for f in _IMAGE_FILES):
        return None
    try:
        meta = json.loads((image_dir / "image.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("content_hash") != digest:
        return None
    return BootImage(
        name=recipe.name,
        content_hash=digest,
        base_path=image_dir / "base.qcow2",
        kernel_path=image_dir / "vmlinuz",
        initrd_path=image_dir / "initrd.img",
        kernel_cmdline=str(meta.get("kernel_cmdline", recipe.kernel_cmdline)),
        background_rgb=recipe.background_rgb,
        helper_port=recipe.helper_port,
    )


def _built_hashes(name_dir: Path) -> list[str]:
    if not name_dir.is_dir():
        return []
    return sorted(
        p.name[:12] for p in name_dir.iterdir() if p.is_dir() and (p / "image.json").is_file()
    )


def _check_host() -> None:
    if os.geteuid() != 0:
        raise HostSetupError("building images needs root (mmdebstrap --mode=root)")
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        raise HostSetupError(
            f"missing image build tools: {', '.join(missing)} "
            "(apt-get install mmdebstrap e2fsprogs qemu-utils)"
        )


def _make_dirs(path: Path) -> None:
    """Create ``path`` and missing parents, each new one 0755 (libvirt-qemu must traverse)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir(exist_ok=True)
        p.chmod(0o755)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
            env=env, text=True, errors="replace",
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
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
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


def _str_tuple(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"expected a list of strings, got {value!r}")
    return tuple(value)
