"""The image store: built and imported images on disk, their verification, lookup, removal.

Layout (``images_dir`` is ``DESKVM_IMAGES_DIR``, default ``<state_dir>/images``)::

    <images_dir>/<name>/<content_hash>/
        base.qcow2      read-only base disk (sessions add an overlay)
        vmlinux         kernel (direct-boot images only): the ELF image with a PVH entry
                        (recipe builds whose kernel has one; image.json "kernel_file"),
                        else vmlinuz, the bzImage
        initrd.img      initial ramdisk (direct-boot images only)
        packages.tsv    installed Debian packages (recipe builds)
        image.json      what the session needs to boot it (written last: its presence
                        makes the directory complete)
        verified.json   written by ``deskvm image verify`` once a boot reached a ready frame
        ready.png       that ready frame
    <images_dir>/<name>/.lock       serializes builds, imports and removals of one name
    <images_dir>/.cache/<suite>/    downloaded .deb files reused by later builds

An image is *usable* (:func:`find_image` without ``require_verified=False``) only once it
is verified. A name with a shipped recipe resolves to the image of the recipe's *current*
content hash; any other name (imported images, recipes built from a file) to its most
recently built or imported image.

Errors: :class:`~orchestrator.errors.ImageNotFound` (unknown or not built),
:class:`ImageNotVerified` (built, never verified), :class:`~orchestrator.errors.ImageBuildError`
(a removal or metadata write failed).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from orchestrator.errors import ImageBuildError, ImageNotFound
from orchestrator.spec import BootImage, BootMode, ReadyCheck, ReadyRegion
from vm_images.recipe import NAME_RE, RECIPES_DIR, list_recipes, recipe_hash

__all__ = [
    "ImageNotVerified",
    "ImageRecord",
    "VerifyRecord",
    "boot_image",
    "find_image",
    "image_records",
    "locked",
    "make_dirs",
    "mark_verified",
    "remove_image",
]

IMAGE_FILES = ("base.qcow2", "image.json")
KERNEL_FILES = ("vmlinuz", "vmlinux")
"""Names the kernel of a direct-boot image may have (``image.json`` ``kernel_file``)."""


def _kernel_file(meta: dict[str, Any]) -> str:
    name = meta.get("kernel_file", "vmlinuz")
    if name not in KERNEL_FILES:
        raise ValueError(f"kernel_file {name!r} (one of {', '.join(KERNEL_FILES)})")
    return str(name)


class ImageNotVerified(ImageNotFound):
    """The image is built (or imported) but no verify boot has reached a ready frame."""

    code = "image_not_verified"


@dataclass(frozen=True, slots=True)
class VerifyRecord:
    """What a successful ``deskvm image verify`` measured.

    Attributes:
        verified_at: ISO 8601 UTC time of the verify boot.
        boot_to_ready_s: seconds from the session's start request to the ready frame.
        accel: ``"kvm"`` or ``"tcg"``.
        width_px, height_px: the display the image was verified at.
        reason: the frame check's verdict on the ready frame.
    """

    verified_at: str
    boot_to_ready_s: float
    accel: str
    width_px: int
    height_px: int
    reason: str


@dataclass(frozen=True, slots=True)
class ImageRecord:
    """One image directory, as ``deskvm image ls`` shows it.

    Attributes:
        name: image name.
        content_hash: the directory name (sha256 hex).
        path: the image directory.
        source: ``"recipe"`` or ``"import"``.
        built_at: ISO 8601 UTC time of the build or import.
        size_bytes: bytes the directory takes on disk.
        qcow2_bytes: size of ``base.qcow2`` on disk.
        boot: ``direct``, ``bios`` or ``uefi``.
        current: for a shipped recipe, whether this is its current content hash; for other
            names, whether it is the newest image of the name (the one sessions get).
        verified: the verification, or ``None`` if the image was never verified.
        description: one line from the recipe or the import metadata.
    """

    name: str
    content_hash: str
    path: Path
    source: str
    built_at: str
    size_bytes: int
    qcow2_bytes: int
    boot: str
    current: bool
    verified: VerifyRecord | None
    description: str


def make_dirs(path: Path) -> None:
    """Create ``path`` and missing parents, each new one 0755 (libvirt-qemu must traverse)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir(exist_ok=True)
        p.chmod(0o755)


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing) for the block."""
    make_dirs(lock_path.parent)
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_meta(image_dir: Path) -> dict[str, Any] | None:
    """``image.json`` of a complete image directory, or ``None``."""
    try:
        meta = json.loads((image_dir / "image.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("content_hash") != image_dir.name:
        return None
    boot = meta.get("boot", "direct")
    try:
        direct = (_kernel_file(meta), "initrd.img") if boot == "direct" else ()
    except ValueError:
        return None
    if not all((image_dir / f).is_file() for f in IMAGE_FILES + direct):
        return None
    return meta


def boot_image(image_dir: Path, meta: dict[str, Any]) -> BootImage:
    """The :class:`BootImage` an image directory describes (its ``image.json``).

    Raises:
        ImageBuildError: the metadata is malformed.
    """
    try:
        ready = meta.get("ready") or {}
        regions = tuple(
            ReadyRegion(
                name=str(r["name"]),
                top_px=int(r["top_px"]),
                height_px=int(r["height_px"]),
                min_foreground_share=float(r.get("min_foreground_share", 0.9)),
                min_colours=int(r.get("min_colours", 3)),
            )
            for r in ready.get("regions", [])
        )
        rgb = [int(c) for c in meta.get("background_rgb", (0x2E, 0x4A, 0x62))]
        boot = str(meta.get("boot", "direct"))
        if boot not in ("direct", "bios", "uefi") or len(rgb) != 3:
            raise ValueError(f"boot {boot!r} / background_rgb {rgb!r}")
        direct = boot == "direct"
        port = meta.get("helper_port")
        return BootImage(
            name=str(meta["name"]),
            content_hash=image_dir.name,
            base_path=image_dir / "base.qcow2",
            kernel_path=image_dir / _kernel_file(meta) if direct else None,
            initrd_path=image_dir / "initrd.img" if direct else None,
            kernel_cmdline=str(meta.get("kernel_cmdline", "")),
            background_rgb=(rgb[0], rgb[1], rgb[2]),
            helper_port=None if port is None else str(port),
            ready=ReadyCheck(
                min_background_share=float(ready.get("min_background_share", 0.10)),
                min_window_share=float(ready.get("min_window_share", 0.01)),
                regions=regions,
            ),
            boot=cast(BootMode, boot),
            keyboard_layout=str(meta.get("keyboard_layout", "us")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ImageBuildError(f"{image_dir / 'image.json'} is malformed: {exc}") from exc


def read_verified(image_dir: Path) -> VerifyRecord | None:
    """The verification record of an image directory, or ``None`` if it was not verified."""
    try:
        data = json.loads((image_dir / "verified.json").read_text(encoding="utf-8"))
        if data.get("content_hash") != image_dir.name:
            return None
        return VerifyRecord(
            verified_at=str(data["verified_at"]),
            boot_to_ready_s=float(data["boot_to_ready_s"]),
            accel=str(data["accel"]),
            width_px=int(data["width_px"]),
            height_px=int(data["height_px"]),
            reason=str(data.get("reason", "")),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def mark_verified(image: BootImage, record: VerifyRecord, ready_png: bytes) -> Path:
    """Record a successful verify boot next to the image (``verified.json``, ``ready.png``).

    Written atomically (temporary file, then rename), ``verified.json`` last.

    Returns:
        The path of ``verified.json``.

    Raises:
        ImageBuildError: the files could not be written.
    """
    image_dir = image.base_path.parent
    data = {
        "content_hash": image.content_hash,
        "verified_at": record.verified_at,
        "boot_to_ready_s": record.boot_to_ready_s,
        "accel": record.accel,
        "width_px": record.width_px,
        "height_px": record.height_px,
        "reason": record.reason,
        "frame": "ready.png",
    }
    try:
        _write_atomic(image_dir / "ready.png", ready_png)
        _write_atomic(image_dir / "verified.json", (json.dumps(data, indent=2) + "\n").encode())
    except OSError as exc:
        raise ImageBuildError(f"cannot record the verification in {image_dir}: {exc}") from exc
    return image_dir / "verified.json"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    tmp.rename(path)


def _complete_dirs(name_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    if not name_dir.is_dir():
        return []
    found = []
    for path in name_dir.iterdir():
        if path.is_dir() and not path.name.startswith("."):
            meta = read_meta(path)
            if meta is not None:
                found.append((path, meta))
    return sorted(found, key=lambda item: (str(item[1].get("built_at", "")), item[0].name))


def _current_hash(name: str, recipes_dir: Path | None) -> str | None:
    """The shipped recipe's current hash, or ``None`` if no shipped recipe has this name."""
    if name not in list_recipes(recipes_dir=recipes_dir):
        return None
    return recipe_hash(name, recipes_dir=recipes_dir)


def find_image(
    name: str,
    images_dir: Path,
    *,
    require_verified: bool = True,
    recipes_dir: Path | None = None,
    content_hash: str | None = None,
) -> BootImage:
    """The image sessions of ``name`` boot.

    For a shipped recipe: the image of its current content hash. For any other name
    (imported, or built from a recipe file): the newest complete image of that name. With
    ``content_hash`` (a prefix of at least 6 hex digits): that stored version, whatever the
    recipe says now.

    Args:
        name: image name, e.g. ``"debian12-desktop"``.
        images_dir: root of the image store.
        require_verified: refuse an image no verify boot has accepted (the default; only
            ``deskvm image verify`` itself passes ``False``).
        recipes_dir: directory of shipped recipes (default :data:`RECIPES_DIR`).

    Raises:
        ImageNotFound: unknown name, or not built for the recipe's current content.
        ImageNotVerified: built but not verified; the message says to run ``deskvm image
            verify NAME``.
        RecipeError: the shipped recipe of that name is invalid.
    """
    if not NAME_RE.match(name):
        raise ImageNotFound(f"no image recipe named {name!r} (names match {NAME_RE.pattern})")
    name_dir = images_dir / name
    current = _current_hash(name, recipes_dir) if content_hash is None else None
    if content_hash is not None:
        matches = [
            (p, m) for p, m in _complete_dirs(name_dir)
            if len(content_hash) >= 6 and p.name.startswith(content_hash)
        ]  # fmt: skip
        if len(matches) != 1:
            raise ImageNotFound(
                f"image {name!r} has {len(matches)} stored versions matching hash "
                f"{content_hash!r} (give at least 6 hex digits; see `deskvm image ls --all`)"
            )
        image_dir, meta = matches[0]
    elif current is not None:
        found = read_meta(name_dir / current)
        if found is None:
            older = [p.name[:12] for p, _m in _complete_dirs(name_dir)]
            hint = f" (built images of older recipe versions: {', '.join(older)})" if older else ""
            raise ImageNotFound(
                f"image {name!r} is not built for its current recipe (hash {current[:12]}) "
                f"under {images_dir}{hint}; run `deskvm image build {name}`"
            )
        image_dir, meta = name_dir / current, found
    else:
        complete = _complete_dirs(name_dir)
        if not complete:
            known = sorted({*list_recipes(recipes_dir=recipes_dir), *_store_names(images_dir)})
            raise ImageNotFound(
                f"no image recipe named {name!r} and no such image under {images_dir} "
                f"(known: {', '.join(known) or 'none'}); build one with `deskvm image build` "
                "or import one with `deskvm image import`"
            )
        image_dir, meta = complete[-1]
    image = boot_image(image_dir, meta)
    if require_verified and read_verified(image_dir) is None:
        raise ImageNotVerified(
            f"image {name!r} ({image.content_hash[:12]}) has not been verified: no boot of it "
            f"has reached a ready frame yet; run `deskvm image verify {name}`"
        )
    return image


def _store_names(images_dir: Path) -> list[str]:
    if not images_dir.is_dir():
        return []
    return sorted(p.name for p in images_dir.iterdir() if p.is_dir() and NAME_RE.match(p.name))


def image_records(images_dir: Path, *, recipes_dir: Path | None = None) -> list[ImageRecord]:
    """Every complete image in the store, by name then build time.

    Raises:
        RecipeError: a shipped recipe is invalid.
    """
    records = []
    for name in _store_names(images_dir):
        complete = _complete_dirs(images_dir / name)
        current = _current_hash(name, recipes_dir)
        for index, (path, meta) in enumerate(complete):
            qcow2 = path / "base.qcow2"
            records.append(
                ImageRecord(
                    name=name,
                    content_hash=path.name,
                    path=path,
                    source=str(meta.get("source", "recipe")),
                    built_at=str(meta.get("built_at", "")),
                    size_bytes=_disk_usage(path),
                    qcow2_bytes=qcow2.stat().st_blocks * 512,
                    boot=str(meta.get("boot", "direct")),
                    current=(
                        path.name == current if current is not None
                        else index == len(complete) - 1
                    ),
                    verified=read_verified(path),
                    description=str(meta.get("description", "")),
                )
            )  # fmt: skip
    return records


def _disk_usage(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.iterdir() if p.is_file())


def remove_image(name: str, images_dir: Path, *, content_hash: str | None = None) -> list[Path]:
    """Delete images of ``name`` (all of them, or the one whose hash starts with
    ``content_hash``). The caller checks that no running domain uses them.

    Returns:
        The removed image directories.

    Raises:
        ImageNotFound: nothing of that name (and hash prefix) is stored.
        ImageBuildError: a directory could not be removed.
    """
    name_dir = images_dir / name
    if not NAME_RE.match(name) or not name_dir.is_dir():
        raise ImageNotFound(
            f"no image named {name!r} under {images_dir} "
            f"(stored: {', '.join(_store_names(images_dir)) or 'none'})"
        )
    removed: list[Path] = []
    with locked(name_dir / ".lock"):
        targets = [
            p for p in sorted(name_dir.iterdir())
            if p.is_dir() and not p.name.startswith(".")
            and (content_hash is None or p.name.startswith(content_hash))
        ]  # fmt: skip
        if not targets:
            raise ImageNotFound(f"image {name!r} has no version with hash {content_hash!r}")
        for path in targets:
            trash = name_dir / f".rm-{path.name[:12]}-{os.getpid()}"
            try:
                path.rename(trash)  # atomic: a session never sees half an image
                shutil.rmtree(trash)
            except OSError as exc:
                raise ImageBuildError(f"cannot remove {path}: {exc}") from exc
            removed.append(path)
    with contextlib.suppress(OSError):
        if not any(p for p in name_dir.iterdir() if p.name != ".lock"):
            (name_dir / ".lock").unlink()
            name_dir.rmdir()
    return removed


def now_iso() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def default_recipes_dir() -> Path:
    """Where the shipped recipes live (:data:`RECIPES_DIR`)."""
    return RECIPES_DIR
