"""The boot bench's process accounting summary (guest ``/usr/local/lib/deskvm/acct-summary``).

``bench/boot.py`` boots with ``deskvm.bootstats=1``; the guest's session then turns on BSD
process accounting (acct(2)) and ``bootstats`` sums the records by command at ready. Here the
summary reads records written by this host's kernel for processes of known CPU time, and
synthetic records of both layouts it accepts (acct v3 and v2, acct(5)).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from vm_images.recipe import GUEST_DIR

SUMMARY = GUEST_DIR / "base/usr/local/lib/deskvm/acct-summary"


def summarize(path: Path) -> dict[str, tuple[int, float]]:
    out = subprocess.run(
        [SUMMARY, str(path)], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    rows = {}
    for line in out.splitlines():
        count, seconds, comm = line.split(maxsplit=2)
        rows[comm] = (int(count), float(seconds))
    return rows


def comp_t(ticks: int) -> int:
    """acct(5)'s comp_t: 13-bit mantissa, 3-bit base-8 exponent."""
    exponent = 0
    while ticks > 0x1FFF:
        ticks >>= 3
        exponent += 1
    return (exponent << 13) | ticks


def v3_record(comm: str, utime_ticks: int, stime_ticks: int) -> bytes:
    # struct acct_v3: flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime (float),
    # utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm[16]
    return struct.pack(
        "<BBHIIIIIIf8H16s", 0, 3, 0, 0, 0, 0, 1, 1, 0, 0.0,
        comp_t(utime_ticks), comp_t(stime_ticks), 0, 0, 0, 0, 0, 0, comm.encode(),
    )  # fmt: skip


def v2_record(comm: str, utime_ticks: int, stime_ticks: int) -> bytes:
    # struct acct: flag, version, uid16, gid16, tty, btime, utime, stime, etime, mem, io, rw,
    # minflt, majflt, swaps (comp_t), ahz, exitcode, comm[17], etime_hi, etime_lo, uid, gid
    return struct.pack(
        "<BBHHHI9HHI17sBHII", 0, 2, 0, 0, 0, 0,
        comp_t(utime_ticks), comp_t(stime_ticks), 0, 0, 0, 0, 0, 0, 0, 100, 0,
        comm.encode(), 0, 0, 0, 0,
    )  # fmt: skip


def test_synthetic_records_of_both_layouts_are_summed_by_command(tmp_path: Path) -> None:
    assert len(v3_record("x", 0, 0)) == len(v2_record("x", 0, 0)) == 64
    pacct = tmp_path / "pacct"
    pacct.write_bytes(
        v3_record("udev-worker", 150, 50)  # 2.00 s
        + v3_record("udev-worker", 100_000, 0)  # 1000 s: needs comp_t's exponent
        + v2_record("xprop", 7, 3)  # 0.10 s
        + b"\x00\x09"
        + bytes(62)  # an unknown version: skipped
        + b"\x00\x03"
        + bytes(10)  # a torn last record: ignored
    )
    rows = summarize(pacct)
    assert rows["udev-worker"][0] == 2
    assert rows["udev-worker"][1] == pytest.approx(1002.0, rel=1e-3)
    assert rows["xprop"] == (1, pytest.approx(0.10))
    assert list(rows) == ["udev-worker", "xprop"]  # busiest first


# Runs as PID 1 of a new PID namespace (unshare): acct(2) is per PID namespace, so the host's
# own accounting, if any, is neither recorded into nor switched off, and a killed test takes
# its accounting down with its namespace.
_IN_NAMESPACE = """
import ctypes, os, shutil, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
pacct, spin = sys.argv[1], sys.argv[2]
if libc.acct(pacct.encode()) != 0:
    sys.exit(f"acct(2) failed: {os.strerror(ctypes.get_errno())}")
try:
    subprocess.run([spin, "-c", "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.5: pass"], check=True, timeout=60)
    subprocess.run(["true"], check=True)
finally:
    libc.acct(None)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="acct(2) and unshare(1) --pid need root")
def test_records_written_by_the_kernel(tmp_path: Path) -> None:
    pacct = tmp_path / "pacct"
    pacct.touch()
    # A process that burns about 0.5 s of CPU under its own name, and one that burns none.
    spin = tmp_path / "deskvm-spin"
    shutil.copy(sys.executable, spin)
    done = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", _IN_NAMESPACE, str(pacct), str(spin)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = summarize(pacct)
    count, seconds = rows["deskvm-spin"]
    assert count == 1
    assert 0.4 <= seconds <= 1.5
    assert rows["true"][1] < 0.1
