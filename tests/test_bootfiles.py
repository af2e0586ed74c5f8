"""Pure tests of vm_images.bootfiles: the PVH kernel and the small initrd an image boots.

Kernels, modules and busybox are synthetic bytes; the real ones boot in tests/vm.
"""

from __future__ import annotations

import lzma
import stat
import struct
from pathlib import Path

import pytest

from orchestrator.errors import ImageBuildError
from vm_images.bootfiles import (
    INITRD_DIR,
    deskvm_initrd,
    has_pvh_entry,
    initrd_modules,
    newc_archive,
    pvh_vmlinux,
)
from vm_images.recipe import GUEST_DIR


def _elf(notes: list[tuple[bytes, int]], *, interp: bool = False) -> bytes:
    """A minimal ELF-64 LE image: one PT_NOTE segment with ``notes``, optionally PT_INTERP."""
    body = b""
    for name, note_type in notes:
        padded = name + b"\0" * (-len(name) % 4)
        body += struct.pack("<III", len(name), 4, note_type) + padded + b"\0\0\0\0"
    phnum = 2 if interp else 1
    phoff = 64
    data_off = phoff + 56 * phnum
    header = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
    header += struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, phoff, 0, 0, 64, 56, phnum, 0, 0, 0)
    phdrs = struct.pack("<IIQQQQQQ", 4, 4, data_off, 0, 0, len(body), len(body), 4)
    if interp:
        phdrs += struct.pack("<IIQQQQQQ", 3, 4, data_off, 0, 0, 0, 0, 1)
    return header + phdrs + body


def _parse_newc(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """path -> (mode, data, (rdevmajor, rdevminor)) of a newc archive; checks the trailer."""
    out: dict[str, tuple[int, bytes, tuple[int, int]]] = {}
    pos = 0
    while True:
        assert data[pos : pos + 6] == b"070701"
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rmaj, rmin, namesize = fields[1], fields[6], fields[9], fields[10], fields[11]
        name = data[pos + 110 : pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        body = data[pos : pos + size]
        pos += size
        pos += -pos % 4
        if name == "TRAILER!!!":
            assert pos == len(data)
            return out
        out[name] = (mode, body, (rmaj, rmin))


PVH_NOTE = (b"Xen", 18)


def test_pvh_entry_is_found_in_the_note_segment() -> None:
    assert has_pvh_entry(_elf([(b"Xen", 6), PVH_NOTE]))
    assert not has_pvh_entry(_elf([(b"Xen", 6), (b"GNU", 18)]))
    assert not has_pvh_entry(b"MZ not an elf" + b"\0" * 64)


def test_the_elf_kernel_is_taken_out_of_an_xz_bzimage() -> None:
    elf = _elf([PVH_NOTE]) + b"kernel text" * 100
    payload = lzma.compress(elf, format=lzma.FORMAT_XZ)
    bzimage = b"setup code \xfd7zX not a stream" + payload + struct.pack("<I", len(elf))
    assert pvh_vmlinux(bzimage) == elf


def test_a_kernel_without_pvh_entry_stays_a_bzimage() -> None:
    elf = _elf([(b"Xen", 6)])
    assert pvh_vmlinux(b"setup" + lzma.compress(elf, format=lzma.FORMAT_XZ)) is None
    assert pvh_vmlinux(b"no payload at all") is None


def _modules_dir(root: Path) -> Path:
    mods = root / "lib/modules/6.1.0-test"
    for rel in (
        "kernel/drivers/virtio/virtio_ring.ko", "kernel/drivers/virtio/virtio.ko",
        "kernel/drivers/virtio/virtio_pci.ko", "kernel/drivers/block/virtio_blk.ko",
        "kernel/lib/crc16.ko", "kernel/fs/mbcache.ko", "kernel/fs/jbd2/jbd2.ko",
        "kernel/fs/ext4/ext4.ko", "kernel/crypto/crc32c_generic.ko",
        "kernel/drivers/char/hw_random/virtio-rng.ko",
    ):  # fmt: skip
        (mods / rel).parent.mkdir(parents=True, exist_ok=True)
        (mods / rel).write_bytes(f"module {rel}".encode())
    (mods / "modules.dep").write_text(
        "kernel/drivers/virtio/virtio_ring.ko:\n"
        "kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\n"
        "kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio.ko "
        "kernel/drivers/virtio/virtio_ring.ko\n"
        "kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko "
        "kernel/drivers/virtio/virtio_ring.ko\n"
        "kernel/lib/crc16.ko:\nkernel/fs/mbcache.ko:\nkernel/fs/jbd2/jbd2.ko:\n"
        "kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko\n"
        "kernel/crypto/crc32c_generic.ko:\n"
        "kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko "
        "kernel/drivers/virtio/virtio_ring.ko\n"
    )
    (mods / "modules.builtin").write_text("kernel/drivers/tty/serial/8250/8250.ko\n")
    return mods


def test_modules_come_after_their_dependencies_once(tmp_path: Path) -> None:
    mods = _modules_dir(tmp_path)
    order = initrd_modules(mods, ["virtio_blk", "ext4", "virtio_rng", "8250", "virtio-blk"])
    assert order == [
        "kernel/drivers/virtio/virtio_ring.ko", "kernel/drivers/virtio/virtio.ko",
        "kernel/drivers/block/virtio_blk.ko", "kernel/lib/crc16.ko", "kernel/fs/mbcache.ko",
        "kernel/fs/jbd2/jbd2.ko", "kernel/fs/ext4/ext4.ko",
        "kernel/drivers/char/hw_random/virtio-rng.ko",
    ]  # fmt: skip
    with pytest.raises(ImageBuildError, match="no kernel module 'btrfs'"):
        initrd_modules(mods, ["btrfs"])


def _rootfs(tmp_path: Path, busybox: bytes) -> Path:
    root = tmp_path / "rootfs"
    _modules_dir(root)
    (root / "bin").mkdir()
    (root / "bin/busybox").write_bytes(busybox)
    (root / INITRD_DIR).mkdir(parents=True)
    for name in ("init", "modules"):
        shipped = GUEST_DIR / "base" / INITRD_DIR / name
        (root / INITRD_DIR / name).write_bytes(shipped.read_bytes())
    return root


def test_the_initrd_holds_init_busybox_and_the_listed_modules(tmp_path: Path) -> None:
    static = _elf([]) + b"busybox"
    files = _parse_newc(deskvm_initrd(_rootfs(tmp_path, static), "6.1.0-test"))
    init_mode, init, _ = files["init"]
    assert stat.S_ISREG(init_mode) and init_mode & 0o111
    assert init == (GUEST_DIR / "base" / INITRD_DIR / "init").read_bytes()
    assert files["bin/busybox"][1] == static
    assert stat.S_ISLNK(files["bin/sh"][0]) and files["bin/sh"][1] == b"busybox"
    console_mode, _, rdev = files["dev/console"]
    assert stat.S_ISCHR(console_mode) and rdev == (5, 1)
    load = files["lib/modules/load"][1].decode().split()
    # The shipped list: the virtio disk and ext4 with crc32c, and the RNG, deps first.
    assert load[-1] == "kernel/drivers/char/hw_random/virtio-rng.ko"
    assert load.index("kernel/crypto/crc32c_generic.ko") < load.index("kernel/fs/ext4/ext4.ko")
    assert load.index("kernel/drivers/virtio/virtio.ko") < load.index(
        "kernel/drivers/block/virtio_blk.ko"
    )
    for rel in load:
        assert files[f"lib/modules/{rel}"][1] == f"module {rel}".encode()
    # Every file's directory is in the archive before it.
    names = list(files)
    for name in names:
        parent = name.rsplit("/", 1)[0]
        assert "/" not in name or names.index(parent) < names.index(name)


def test_the_initrd_needs_a_static_busybox(tmp_path: Path) -> None:
    root = _rootfs(tmp_path, _elf([], interp=True))
    with pytest.raises(ImageBuildError, match="busybox-static"):
        deskvm_initrd(root, "6.1.0-test")
    (root / "bin/busybox").unlink()
    with pytest.raises(ImageBuildError, match="no /bin/busybox; add busybox-static"):
        deskvm_initrd(root, "6.1.0-test")


def test_newc_archive_pads_to_four_bytes() -> None:
    data = newc_archive([("a", stat.S_IFREG | 0o644, b"xyz"), ("bb", stat.S_IFDIR | 0o755, b"")])
    assert len(data) % 4 == 0
    files = _parse_newc(data)
    assert files["a"][1] == b"xyz" and stat.S_ISDIR(files["bb"][0])


def test_the_shipped_recipes_install_a_static_busybox_for_their_initrd() -> None:
    from vm_images import load_recipe

    for name in ("debian12-desktop", "debian12-full"):
        recipe = load_recipe(name)
        assert "base" in recipe.model.files.sets
        assert "busybox-static" in recipe.packages
