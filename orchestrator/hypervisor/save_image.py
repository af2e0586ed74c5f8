"""libvirt's QEMU save image: read its header, write the same image under another domain XML.

A warm pool restores one saved desktop many times at once, each clone with its own name,
UUID, VM generation ID and overlay. libvirt's restore accepts an alternative XML (``dxml``)
but requires it to keep the saved domain's UUID (``Target domain uuid ... does not match
source``), and libvirt never runs two domains with one UUID. So each clone is restored
from a stream that carries the clone's own XML in the header, followed by the saved
QEMU migration stream unchanged (:func:`stream_clone`, into a FIFO that libvirt reads).

Format (libvirt ``src/qemu/qemu_saveimage.h``, version 2, little endian)::

    char     magic[16]      "LibvirtQemudSave" ("LibvirtQemudPart" while being written)
    uint32   version        2
    uint32   data_len       bytes after the header: XML + NUL, cookie + NUL, zero padding
    uint32   was_running    1: the domain ran when it was saved
    uint32   format         0: raw (the only one read here)
    uint32   cookieOffset   offset of the cookie in the data (0: no cookie)
    uint32   unused[14]
    data     (data_len bytes)
    QEMU migration stream (to the end of the file)

Pure apart from the file reads and the FIFO writer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import HypervisorError

__all__ = ["HEADER_SIZE", "SAVE_MAGIC", "SaveHeader", "build_header", "read_header", "stream_clone"]

SAVE_MAGIC = b"LibvirtQemudSave"
_PARTIAL_MAGIC = b"LibvirtQemudPart"
_HEADER = struct.Struct("<16s5I14I")
HEADER_SIZE = _HEADER.size
"""Bytes of the fixed header before the XML (92)."""
_MAX_DATA_LEN = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SaveHeader:
    """The parts of a save image's header a clone needs.

    Attributes:
        xml: the saved domain XML (migratable form).
        cookie: libvirt's save cookie (CPU model data) without its NUL, or ``None``.
        was_running: whether the domain ran when saved.
        stream_offset: byte offset of the QEMU migration stream in the file.
    """

    xml: str
    cookie: str | None
    was_running: bool
    stream_offset: int


def read_header(path: Path) -> SaveHeader:
    """Read and check the header of a libvirt QEMU save image.

    Raises:
        HypervisorError: the file is missing, truncated, incomplete (``LibvirtQemudPart``),
            compressed, of another version or otherwise not a save image.
    """
    try:
        with path.open("rb") as f:
            raw = f.read(HEADER_SIZE)
            if len(raw) != HEADER_SIZE:
                raise HypervisorError(f"saved state {path} is truncated (no header)")
            magic, version, data_len, was_running, fmt, cookie_offset, *_ = _HEADER.unpack(raw)
            if magic == _PARTIAL_MAGIC:
                raise HypervisorError(f"saved state {path} is incomplete (the save never ended)")
            if magic != SAVE_MAGIC:
                raise HypervisorError(f"{path} is not a libvirt save image (magic {magic!r})")
            if version != 2 or fmt != 0:
                raise HypervisorError(
                    f"saved state {path}: version {version}, format {fmt} (want 2, raw)"
                )
            if not 0 < data_len <= _MAX_DATA_LEN or cookie_offset > data_len:
                raise HypervisorError(f"saved state {path} has a corrupt header")
            data = f.read(data_len)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise HypervisorError(f"cannot read saved state {path}: {exc}") from exc
    if len(data) != data_len or size <= HEADER_SIZE + data_len:
        raise HypervisorError(f"saved state {path} is truncated (no memory stream)")
    xml_end = cookie_offset or data_len
    xml = data[:xml_end].split(b"\0", 1)[0].decode("utf-8", "replace")
    cookie = None
    if cookie_offset:
        cookie = data[cookie_offset:].split(b"\0", 1)[0].decode("utf-8", "replace") or None
    if not xml.lstrip().startswith("<domain"):
        raise HypervisorError(f"saved state {path} has no domain XML in its header")
    return SaveHeader(
        xml=xml,
        cookie=cookie,
        was_running=bool(was_running),
        stream_offset=HEADER_SIZE + data_len,
    )


def build_header(xml: str, cookie: str | None, *, was_running: bool) -> bytes:
    """The header and data of a save image carrying ``xml`` (and ``cookie``), raw format."""
    xml_bytes = xml.encode() + b"\0"
    cookie_bytes = cookie.encode() + b"\0" if cookie is not None else b""
    data = xml_bytes + cookie_bytes
    cookie_offset = len(xml_bytes) if cookie is not None else 0
    head = _HEADER.pack(
        SAVE_MAGIC, 2, len(data), 1 if was_running else 0, 0, cookie_offset, *([0] * 14)
    )
    return head + data


def stream_clone(
    source: Path, header: SaveHeader, xml: str, fifo: Path, *, timeout_s: float
) -> None:
    """Write a save image with ``xml`` and ``source``'s memory stream into ``fifo``.

    Waits up to ``timeout_s`` for a reader (libvirt's restore) to open the FIFO, then
    writes the header and copies the stream with ``sendfile``. A reader that goes away
    (a failed restore) ends the copy quietly.

    Raises:
        HypervisorError: no reader came, or ``source`` could not be read.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise HypervisorError(f"nobody read the restore stream {fifo}: {exc}") from exc
            time.sleep(0.002)
    try:
        os.set_blocking(fd, True)
        data = build_header(xml, header.cookie, was_running=header.was_running)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        with source.open("rb") as src:
            offset = header.stream_offset
            size = os.fstat(src.fileno()).st_size
            while offset < size:
                sent = os.sendfile(fd, src.fileno(), offset, min(size - offset, 1 << 24))
                if sent == 0:
                    break
                offset += sent
    except BrokenPipeError:
        return
    except OSError as exc:
        raise HypervisorError(f"cannot stream saved state {source}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
