"""The kernel and initrd a built image boots with: made for a fast direct boot under TCG.

Two things cost seconds of every cold boot on a host without KVM, and the builder removes
both (measured with ``bench/boot.py``, see docs/performance.md):

* **Kernel decompression.** A distribution kernel is a compressed bzImage (Debian's: xz);
  QEMU's firmware loads it and its stub decompresses ~65 MB, about 3 s under TCG. Linux
  kernels built with ``CONFIG_PVH`` carry a PVH entry point (the Xen ELF note
  ``XEN_ELFNOTE_PHYS32_ENTRY``) in the ELF image inside the bzImage; QEMU boots such an ELF
  given as ``-kernel`` directly (its ``pvh.bin`` option ROM), without the stub.
  :func:`pvh_vmlinux` extracts it.
* **initramfs-tools' initrd.** Its udev, module probing and scripts take about 3 s before
  the root file system's init starts. :func:`deskvm_initrd` writes a small uncompressed one
  instead: a static busybox, the modules the image's file sets list, and the file sets'
  ``/init`` (``vm_images/guest/base/usr/local/lib/deskvm/initrd/``).

Pure functions over bytes and a root file system directory; no tools are run.

Errors: :class:`~orchestrator.errors.ImageBuildError` (a module or busybox missing, busybox
not static).
"""

from __future__ import annotations

import gzip
import lzma
import stat
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

from orchestrator.errors import ImageBuildError

__all__ = [
    "INITRD_DIR",
    "deskvm_initrd",
    "has_pvh_entry",
    "initrd_modules",
    "newc_archive",
    "pvh_vmlinux",
]

INITRD_DIR = "usr/local/lib/deskvm/initrd"
"""Where a file set puts the initrd's ``init`` and its ``modules`` list (relative to /)."""

_XEN_ELFNOTE_PHYS32_ENTRY = 18
_ELF_MAGIC = b"\x7fELF"
# Compressed payloads a bzImage may carry, by magic (Linux arch/x86/boot/compressed).
_XZ_MAGIC = b"\xfd7zXZ\x00"
_GZIP_MAGIC = b"\x1f\x8b\x08"


def pvh_vmlinux(bzimage: bytes) -> bytes | None:
    """The uncompressed ELF kernel inside ``bzimage``, if it has a PVH entry point.

    Args:
        bzimage: a Linux x86 bzImage (``/boot/vmlinuz-*``), xz or gzip compressed.

    Returns:
        The ELF image (QEMU boots it with ``-kernel`` through its PVH entry), or ``None``
        when the payload is in another format or the kernel has no PVH entry (then boot the
        bzImage as it is).
    """
    for magic, decompress in ((_XZ_MAGIC, _unxz), (_GZIP_MAGIC, _gunzip)):
        start = bzimage.find(magic)
        while start != -1:
            elf = decompress(bzimage[start:])
            if elf is not None and elf.startswith(_ELF_MAGIC):
                return elf if has_pvh_entry(elf) else None
            start = bzimage.find(magic, start + 1)
    return None


def _unxz(data: bytes) -> bytes | None:
    # The bzImage appends the payload's size after it: decompress the first stream only.
    try:
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)
    except lzma.LZMAError:
        return None


def _gunzip(data: bytes) -> bytes | None:
    try:
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
    except (zlib.error, gzip.BadGzipFile):
        return None


def has_pvh_entry(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF image has the Xen note ``PHYS32_ENTRY`` (PVH).

    Reads the program headers' ``PT_NOTE`` segments (ELF-64, System V gABI; the note is
    defined in Xen's ``public/elfnote.h``).
    """
    if len(elf) < 64 or not elf.startswith(_ELF_MAGIC) or elf[4] != 2 or elf[5] != 1:
        return False
    (phoff,) = struct.unpack_from("<Q", elf, 32)
    phentsize, phnum = struct.unpack_from("<HH", elf, 54)
    for index in range(phnum):
        p_type, _flags, offset, _vaddr, _paddr, filesz = struct.unpack_from(
            "<IIQQQQ", elf, phoff + index * phentsize
        )
        if p_type != 4:  # PT_NOTE
            continue
        pos, end = offset, min(offset + filesz, len(elf))
        while pos + 12 <= end:
            namesz, descsz, note_type = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and note_type == _XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            pos += 12 + _align4(namesz) + _align4(descsz)
    return False


def _align4(n: int) -> int:
    return (n + 3) & ~3


def initrd_modules(modules_dir: Path, names: Iterable[str]) -> list[str]:
    """Module files to load for ``names``, each after what it depends on.

    Args:
        modules_dir: ``/lib/modules/<version>`` of the root file system (its ``modules.dep``
            and ``modules.builtin``, as depmod writes them).
        names: module names (``-`` and ``_`` are the same); built-in ones are skipped.

    Returns:
        Paths relative to ``modules_dir``, dependencies first, each once.

    Raises:
        ImageBuildError: a name is neither a module nor built in.
    """
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_dir / "modules.dep").read_text(encoding="utf-8").splitlines():
        path, _, rest = line.partition(":")
        if path:
            deps[path] = rest.split()
            by_name[_module_name(path)] = path
    builtin_file = modules_dir / "modules.builtin"
    builtin = set()
    if builtin_file.is_file():
        builtin = {_module_name(p) for p in builtin_file.read_text(encoding="utf-8").split()}
    order: list[str] = []

    def add(path: str) -> None:
        if path in order:
            return
        for dep in deps.get(path, []):
            add(dep)
        order.append(path)

    for name in names:
        key = name.replace("-", "_")
        if key in by_name:
            add(by_name[key])
        elif key not in builtin:
            raise ImageBuildError(f"initrd: no kernel module {name!r} in {modules_dir}")
    return order


def _module_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    for suffix in (".ko", ".ko.xz", ".ko.zst", ".ko.gz"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")


def deskvm_initrd(rootfs: Path, kernel_version: str) -> bytes:
    """The initrd of an image whose file sets provide ``/usr/local/lib/deskvm/initrd``.

    Contents (newc cpio, uncompressed: nothing to decompress under TCG): ``/init`` from
    :data:`INITRD_DIR`, ``/bin/busybox`` from the root file system (it must be static,
    Debian's ``busybox-static``), the modules named in :data:`INITRD_DIR` ``/modules`` (one
    per line, ``#`` comments) with their dependencies under ``/lib/modules/``, and
    ``/lib/modules/load``, the order ``/init`` loads them in.

    Args:
        rootfs: the built root file system.
        kernel_version: the directory name under ``/lib/modules``.

    Raises:
        ImageBuildError: busybox missing or not static, a module missing.
    """
    source = rootfs / INITRD_DIR
    busybox = rootfs / "bin/busybox"
    if not busybox.is_file() or busybox.is_symlink():
        raise ImageBuildError(
            "initrd: the file sets provide /" + INITRD_DIR + " but the image has no "
            "/bin/busybox; add busybox-static to the recipe's packages"
        )
    busybox_bytes = busybox.read_bytes()
    if _elf_interpreter(busybox_bytes):
        raise ImageBuildError(
            "initrd: /bin/busybox is dynamically linked; the recipe needs busybox-static "
            "(not busybox)"
        )
    modules_dir = rootfs / "lib/modules" / kernel_version
    names = [
        line.strip()
        for line in (source / "modules").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    order = initrd_modules(modules_dir, names)
    entries: list[tuple[str, int, bytes]] = [
        ("bin", stat.S_IFDIR | 0o755, b""),
        ("dev", stat.S_IFDIR | 0o755, b""),
        ("lib", stat.S_IFDIR | 0o755, b""),
        ("lib/modules", stat.S_IFDIR | 0o755, b""),
        ("proc", stat.S_IFDIR | 0o755, b""),
        ("root", stat.S_IFDIR | 0o700, b""),
        ("init", stat.S_IFREG | 0o755, (source / "init").read_bytes()),
        ("bin/busybox", stat.S_IFREG | 0o755, busybox_bytes),
        ("bin/sh", stat.S_IFLNK | 0o777, b"busybox"),
    ]
    seen_dirs = {"lib/modules"}
    for rel in order:
        parts = rel.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            directory = "lib/modules/" + "/".join(parts[:depth])
            if directory not in seen_dirs:
                seen_dirs.add(directory)
                entries.append((directory, stat.S_IFDIR | 0o755, b""))
        entries.append(
            ("lib/modules/" + rel, stat.S_IFREG | 0o644, (modules_dir / rel).read_bytes())
        )
    load = "".join(f"{rel}\n" for rel in order).encode()
    entries.append(("lib/modules/load", stat.S_IFREG | 0o644, load))
    return newc_archive(entries, devices=[("dev/console", 5, 1)])


def _elf_interpreter(elf: bytes) -> bool:
    """Whether a 64-bit ELF has a ``PT_INTERP`` segment (is dynamically linked)."""
    if len(elf) < 64 or not elf.startswith(_ELF_MAGIC) or elf[4] != 2:
        return False
    (phoff,) = struct.unpack_from("<Q", elf, 32)
    phentsize, phnum = struct.unpack_from("<HH", elf, 54)
    return any(struct.unpack_from("<I", elf, phoff + i * phentsize)[0] == 3 for i in range(phnum))


def newc_archive(
    entries: Iterable[tuple[str, int, bytes]],
    *,
    devices: Iterable[tuple[str, int, int]] = (),
) -> bytes:
    """A cpio archive in the "new ASCII" (newc) format the kernel unpacks as an initramfs.

    Args:
        entries: ``(path, mode, data)``: path relative to / (parents first), mode with its
            file type bits (``stat.S_IFREG``, ``S_IFDIR``, ``S_IFLNK``: data is the target).
        devices: character devices ``(path, major, minor)``, mode 0600.

    Returns:
        The archive, owner root, mtime 0, ending with ``TRAILER!!!`` (kernel
        Documentation/driver-api/early-userspace/buffer-format.rst).
    """
    out = bytearray()
    ino = 1

    def member(name: str, mode: int, data: bytes, rdev: tuple[int, int] = (0, 0)) -> None:
        nonlocal ino
        encoded = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0)
        out.extend(b"070701" + b"".join(b"%08X" % f for f in fields))
        out.extend(encoded)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))
        ino += 1

    for path, mode, data in entries:
        member(path, mode, data)
    for path, major, minor in devices:
        member(path, stat.S_IFCHR | 0o600, b"", (major, minor))
    member("TRAILER!!!", 0, b"")
    return bytes(out)
