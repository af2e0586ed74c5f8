"""Import a qcow2 built elsewhere (Packer, another host) into the image store.

``import_image`` checks the disk with ``qemu-img info`` (qcow2, no backing file, no external
data file, not encrypted: a disk that names host files is refused), copies it into
``<images_dir>/<name>/<content_hash>/base.qcow2`` while hashing it, runs ``qemu-img check``
on the copy and writes ``image.json``. Like a build, an import is atomic (temporary
directory, rename) and the result is not usable until ``deskvm image verify`` booted it to
a ready frame.

The metadata file (:class:`ImportMetadata`, JSON, written by the Packer templates next to
their qcow2 as ``<name>.deskvm.json``) says how the image boots and what its ready frame
looks like::

    {"format": "deskvm-image/1", "boot": "bios", "helper_port": "dev.deskvm.helper.0",
     "background_rgb": [46, 74, 98], "ready": {"regions": [...]}, "description": "..."}

Boot modes: ``direct`` (``--kernel``/``--initrd`` given; the host passes the command line),
``bios`` or ``uefi`` (the image's own boot loader; the ``deskvm.*`` options reach the guest
as SMBIOS OEM strings).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, ValidationError

from agent_bridge.protocol.keys import KeyboardLayout
from orchestrator.errors import HostSetupError, ImageBuildError, ImageNotFound
from orchestrator.spec import BootImage
from vm_images.recipe import NAME_RE, ReadyModel, RecipeError, _explain, _Strict
from vm_images.store import boot_image, locked, make_dirs, now_iso, read_meta

__all__ = ["METADATA_SUFFIX", "ImportMetadata", "import_image", "metadata_beside"]

METADATA_SUFFIX = ".deskvm.json"
"""``FILE.qcow2`` -> ``FILE.deskvm.json``: where :func:`metadata_beside` looks."""

Channel = Annotated[int, Field(ge=0, le=255)]
_CHUNK = 8 * 1024 * 1024


class ImportMetadata(_Strict):
    """How an imported image boots and what its ready frame looks like (JSON file)."""

    format: Literal["deskvm-image/1"] = "deskvm-image/1"
    description: Annotated[str, StringConstraints(max_length=200)] = ""
    boot: Literal["direct", "bios", "uefi"] | None = None
    kernel_cmdline: Annotated[str, StringConstraints(pattern=r"^[ -~]{0,1024}$")] = (
        "root=/dev/vda rw console=ttyS0,115200"
    )
    helper_port: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9.]{0,62}$")] | None = None
    background_rgb: list[Channel] = Field(
        default_factory=lambda: [0x2E, 0x4A, 0x62], min_length=3, max_length=3
    )
    keyboard_layout: KeyboardLayout = "us"
    ready: ReadyModel = Field(default_factory=lambda: ReadyModel.model_validate({}))
    guest_os: Annotated[str, StringConstraints(max_length=64)] = ""
    built_by: Annotated[str, StringConstraints(max_length=64)] = ""


def metadata_beside(qcow2: Path) -> Path:
    """``dir/NAME.qcow2`` -> ``dir/NAME.deskvm.json`` (the Packer templates' convention)."""
    stem = qcow2.name.removesuffix(".qcow2")
    return qcow2.with_name(stem + METADATA_SUFFIX)


def load_metadata(path: Path) -> ImportMetadata:
    """Read and validate an import metadata file.

    Raises:
        RecipeError: not JSON, or a field is invalid (named with the allowed values).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecipeError(f"import metadata {path}: cannot read JSON: {exc}") from exc
    try:
        return ImportMetadata.model_validate(data)
    except ValidationError as exc:
        problems = _explain(exc, ImportMetadata)
        raise RecipeError(f"import metadata {path} is invalid:\n{problems}") from exc


def import_image(
    qcow2: Path,
    name: str,
    images_dir: Path,
    *,
    metadata: ImportMetadata | None = None,
    boot: Literal["bios", "uefi"] | None = None,
    kernel: Path | None = None,
    initrd: Path | None = None,
    kernel_cmdline: str | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> BootImage:
    """Copy a qcow2 (and a kernel/initrd for direct boot) into the image store.

    Args:
        qcow2: the disk image.
        name: image name (``[a-z0-9][a-z0-9._-]{0,63}``); sessions ask for it by this name.
        images_dir: root of the image store.
        metadata: boot mode, ready check, helper port...; default :class:`ImportMetadata`.
        boot: ``bios`` or ``uefi``; overrides ``metadata.boot``. Not with ``kernel``.
        kernel, initrd: direct kernel boot (both or neither).
        kernel_cmdline: direct boot's base command line (default: the metadata's).
        progress: ``progress(phase, fraction)``, phases ``"check"``, ``"copy"``, ``"done"``.

    Returns:
        The imported (not yet verified) image. Importing the same content again is a no-op.

    Raises:
        ImageNotFound: a given file does not exist.
        RecipeError: bad name, or contradictory/missing boot options.
        ImageBuildError: not a qcow2, has a backing or data file, is encrypted, or fails
            ``qemu-img check``.
        HostSetupError: ``qemu-img`` is missing.
    """
    report = progress or (lambda _phase, _fraction: None)
    meta = metadata or ImportMetadata()
    if not NAME_RE.match(name):
        raise RecipeError(f"image name {name!r} must match {NAME_RE.pattern}")
    for label, path in (("disk", qcow2), ("kernel", kernel), ("initrd", initrd)):
        if path is not None and not path.is_file():
            raise ImageNotFound(f"{label} file {path} does not exist")
    if (kernel is None) != (initrd is None):
        raise RecipeError("give both --kernel and --initrd for direct kernel boot, or neither")
    if kernel is not None:
        if boot is not None:
            raise RecipeError("--boot and --kernel/--initrd exclude each other")
        mode = "direct"
    else:
        chosen = boot or meta.boot
        if chosen is None or chosen == "direct":
            raise RecipeError(
                "say how the image boots: --kernel K --initrd I (direct kernel boot) or "
                '--boot bios|uefi (its own boot loader), or put "boot" in the metadata file'
            )
        mode = chosen
    cmdline = kernel_cmdline if kernel_cmdline is not None else meta.kernel_cmdline
    if mode == "direct" and any(w.startswith("deskvm.") for w in cmdline.split()):
        raise RecipeError("kernel command line: deskvm.* options are appended by the host")

    report("check", 0.0)
    info = _qemu_img_info(qcow2)
    source_bytes = qcow2.stat().st_size
    name_dir = images_dir / name
    make_dirs(name_dir)
    with locked(name_dir / ".lock"):
        work = name_dir / f".import-{os.getpid()}"
        work.mkdir(mode=0o755)
        try:
            digest = hashlib.sha256(b"deskvm-import 1\n")
            canonical = {
                "boot": mode,
                "kernel_cmdline": cmdline if mode == "direct" else "",
                "metadata": meta.model_dump(mode="json", exclude={"boot", "kernel_cmdline"}),
            }
            digest.update(json.dumps(canonical, sort_keys=True).encode() + b"\0")
            done = 0

            def copied(n: int) -> None:
                nonlocal done
                done += n
                report("copy", 0.02 + 0.9 * done / max(1, source_bytes))

            _copy_hashing(qcow2, work / "base.qcow2", digest, copied)
            if kernel is not None and initrd is not None:
                _copy_hashing(kernel, work / "vmlinuz", digest, lambda _n: None)
                _copy_hashing(initrd, work / "initrd.img", digest, lambda _n: None)
            content_hash = digest.hexdigest()
            final = name_dir / content_hash
            if read_meta(final) is not None:
                shutil.rmtree(work)
                report("done", 1.0)
                return boot_image(final, read_meta(final) or {})
            report("check", 0.93)
            _run(["qemu-img", "check", "-q", "-f", "qcow2", str(work / "base.qcow2")])
            image_meta: dict[str, Any] = {
                "name": name,
                "content_hash": content_hash,
                "source": "import",
                "imported_from": str(qcow2.resolve()),
                "description": meta.description or f"imported from {qcow2.name}",
                "boot": mode,
                "kernel_cmdline": cmdline if mode == "direct" else "",
                "background_rgb": list(meta.background_rgb),
                "helper_port": meta.helper_port,
                "keyboard_layout": meta.keyboard_layout,
                "ready": meta.ready.model_dump(mode="json"),
                "guest_os": meta.guest_os,
                "built_by": meta.built_by,
                "built_at": now_iso(),
                "virtual_size_bytes": int(info.get("virtual-size", 0)),
                "sizes": {"base_qcow2_bytes": (work / "base.qcow2").stat().st_size},
            }
            for path in work.iterdir():
                path.chmod(0o644)
            tmp = work / ".image.json.tmp"
            tmp.write_text(json.dumps(image_meta, indent=2) + "\n", encoding="utf-8")
            tmp.chmod(0o644)
            tmp.rename(work / "image.json")
            work.rename(final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    report("done", 1.0)
    return boot_image(final, image_meta)


def _copy_hashing(source: Path, target: Path, digest: Any, on_bytes: Callable[[int], None]) -> None:
    with source.open("rb") as src, target.open("wb") as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            on_bytes(len(chunk))
    digest.update(f"\0{target.name}\0".encode())


def _qemu_img_info(path: Path) -> dict[str, Any]:
    out = _run(["qemu-img", "info", "--output=json", str(path)])
    try:
        info = json.loads(out)
    except ValueError as exc:
        raise ImageBuildError(f"qemu-img info {path}: unreadable output") from exc
    if info.get("format") != "qcow2":
        raise ImageBuildError(
            f"{path} is {info.get('format')!r}, not qcow2 (convert it: qemu-img convert -O qcow2)"
        )
    if info.get("backing-filename") or info.get("full-backing-filename"):
        raise ImageBuildError(
            f"{path} has a backing file ({info.get('backing-filename')}); flatten it first "
            "(qemu-img convert -O qcow2 SRC FLAT.qcow2)"
        )
    data = info.get("format-specific", {}).get("data", {})
    if data.get("data-file") or data.get("encrypt"):
        raise ImageBuildError(f"{path} uses an external data file or encryption: refused")
    if info.get("encrypted"):
        raise ImageBuildError(f"{path} is encrypted: refused")
    return dict(info)


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        raise HostSetupError(f"{cmd[0]} is missing (apt-get install qemu-utils)")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise ImageBuildError(f"{' '.join(cmd[:2])} failed ({proc.returncode}): {tail}")
    return proc.stdout
