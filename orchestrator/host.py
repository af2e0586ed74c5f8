"""Host set-up and checks behind ``deskvm doctor``: packages, daemons, /dev/kvm, acceleration.

There is no systemd on some hosts (containers, CI), so the daemons are started by hand
(``virtlogd -d``; ``libvirtd`` under ``tini -s``, see :func:`libvirtd_command`).
``/dev/kvm`` gets Debian's standard ``root:kvm 0660``: with ``root:root 0600`` libvirt sees
KVM "enabled when probing but not available now" for the ``libvirt-qemu`` user and
re-probes QEMU on every call (80 s per domain create, measured). Acceleration is probed by
really booting a tiny guest: KVM only if it runs.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from orchestrator.errors import HostSetupError

__all__ = [
    "APT_PACKAGES",
    "HOST_MEMORY_RESERVE_MIB",
    "Check",
    "HostReport",
    "boot_sector",
    "default_total_memory_mib",
    "host_memory_mib",
    "libvirtd_command",
    "load_accel",
    "probe_accel",
    "run_doctor",
]

APT_PACKAGES: tuple[str, ...] = (
    "qemu-system-x86",
    "qemu-utils",
    "libvirt-daemon-system",
    "libvirt-clients",
    "libvirt-dev",
    "pkg-config",
    "mmdebstrap",
    "e2fsprogs",
    "tini",
)

LIBVIRT_SOCKET = Path("/run/libvirt/libvirt-sock")
VIRTLOGD_SOCKET = Path("/run/libvirt/virtlogd-sock")
PROBE_MESSAGE = b"DESKVM-ACCEL-OK"

Status = Literal["ok", "fixed", "warn", "fail"]


@dataclass(slots=True)
class Check:
    """One doctor check: what was looked at, the verdict, and how to fix it."""

    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(slots=True)
class HostReport:
    """All checks of one doctor run, and the acceleration verdict."""

    checks: list[Check] = field(default_factory=list)
    accel: Literal["kvm", "tcg"] | None = None

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)


HOST_MEMORY_RESERVE_MIB = 2048
"""Host memory kept out of the sessions' default total (the host, libvirtd, the bridge)."""


def host_memory_mib(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's RAM (``MemTotal``), MiB; ``None`` when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_total_memory_mib(host_mib: int) -> int:
    """Default cap on the sum of live sessions' memory hard limits for a host of
    ``host_mib`` MiB of RAM: all of it but :data:`HOST_MEMORY_RESERVE_MIB` or a tenth,
    whichever is larger (at least 1 GiB)."""
    return max(1024, host_mib - max(HOST_MEMORY_RESERVE_MIB, host_mib // 10))


def boot_sector(message: bytes = PROBE_MESSAGE) -> bytes:
    """A 512-byte x86 boot sector that writes ``message`` + CRLF to COM1 and halts.

    Real-mode code loaded at 0x7c00: zero DS, then ``lodsb``/``out 0x3f8`` until NUL.
    """
    code = bytes.fromhex(
        "31c0"  # xor ax, ax
        "8ed8"  # mov ds, ax
        "fc"  # cld
        "baf803"  # mov dx, 0x3f8
        "be177c"  # mov si, 0x7c17 (message, at offset 23)
        "ac"  # lodsb
        "84c0"  # test al, al
        "7403"  # jz halt
        "ee"  # out dx, al
        "ebf8"  # jmp lodsb
        "fa"  # halt: cli
        "f4"  # hlt
        "ebfd"  # jmp hlt
    )
    assert len(code) == 23
    sector = code + message + b"\r\n\x00"
    return sector.ljust(510, b"\x00") + b"\x55\xaa"


def _probe_xml(name: str, accel: str, disk: Path, serial: Path) -> str:
    cpu = "<cpu mode='host-passthrough' check='none'/>" if accel == "kvm" else ""
    return f"""<domain type='{"kvm" if accel == "kvm" else "qemu"}'>
  <name>{name}</name>
  <memory unit='MiB'>64</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type><boot dev='hd'/></os>
  {cpu}
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/><source file='{disk}'/><target dev='sda' bus='sata'/>
    </disk>
    <serial type='file'><source path='{serial}'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
</domain>"""


def probe_accel(
    probe_dir: Path, *, uri: str = "qemu:///system", timeout_s: float = 20.0
) -> tuple[Literal["kvm", "tcg"], str]:
    """Boot a tiny guest under KVM through libvirt; fall back to TCG if it does not run.

    The KVM guest uses the same CPU configuration as session domains (host-passthrough).

    Args:
        probe_dir: scratch directory (created, emptied afterwards).
        uri: libvirt URI.
        timeout_s: how long each probe guest may take to print its message.

    Returns:
        ``(accel, explanation)``.

    Raises:
        HostSetupError: not even a TCG guest runs (QEMU or libvirt is broken).
    """
    import libvirt

    from orchestrator.hypervisor.libvirt import open_connection

    conn = open_connection(uri)
    probe_dir.mkdir(parents=True, exist_ok=True)
    probe_dir.chmod(0o755)
    disk = probe_dir / "boot.img"
    # A disk of one sector is not booted by SeaBIOS; pad it to 1 MiB.
    disk.write_bytes(boot_sector().ljust(1 << 20, b"\x00"))
    reasons: list[str] = []
    try:
        candidates: list[Literal["kvm", "tcg"]] = ["tcg"]
        if Path("/dev/kvm").exists():
            candidates.insert(0, "kvm")
        else:
            reasons.append("kvm: /dev/kvm does not exist")
        for accel in candidates:
            serial = probe_dir / f"serial-{accel}.log"
            serial.unlink(missing_ok=True)
            name = f"deskvm-probe-{accel}-{os.getpid()}"
            try:
                dom = conn.createXML(_probe_xml(name, accel, disk, serial), 0)
            except libvirt.libvirtError as exc:
                reasons.append(f"{accel}: domain did not start: {exc.get_error_message()}")
                continue
            try:
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    if serial.exists() and PROBE_MESSAGE in serial.read_bytes():
                        ran = (
                            f"{accel}: guest ran"
                            if accel == "tcg"
                            else (
                                "kvm: a boot sector ran under KVM; not yet confirmed with "
                                "Linux: if KVM stops the first Linux guest, deskvm boots it "
                                "again under TCG and keeps TCG"
                            )
                        )
                        return accel, "; ".join([*reasons, ran])
                    if not dom.isActive():
                        reasons.append(f"{accel}: guest died")
                        break
                    time.sleep(0.1)
                else:
                    reasons.append(f"{accel}: guest printed nothing in {timeout_s:.0f} s")
            finally:
                with contextlib.suppress(libvirt.libvirtError):
                    dom.destroy()
        raise HostSetupError("no guest runs on this host: " + "; ".join(reasons))
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            conn.close()


def store_accel(
    host_file: Path,
    accel: Literal["kvm", "tcg"],
    why: str,
    *,
    source: Literal["probe", "boot"] = "probe",
    kvm_ran_linux: bool = False,
) -> None:
    """Store the host's acceleration verdict, written whole (a reader never sees half a file).

    The file is JSON: ``accel``, ``why``, ``source`` (``probe``: the doctor's boot sector;
    ``boot``: what a real boot showed), ``probed_at`` (seconds since the epoch) and, once a
    Linux guest reached ready under KVM, ``kvm_ran_linux: true``.

    Raises:
        OSError: the file could not be written (no temporary file is left).
    """
    host_file.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {
        "accel": accel, "why": why, "source": source, "probed_at": time.time(),
    }  # fmt: skip
    if kvm_ran_linux:
        record["kvm_ran_linux"] = True
    fd, tmp = tempfile.mkstemp(dir=host_file.parent, prefix=f".{host_file.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, host_file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_host_record(host_file: Path) -> dict[str, object]:
    """The stored verdict's record (see :func:`store_accel`); ``{}`` when there is none."""
    try:
        record = json.loads(host_file.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def load_accel(host_file: Path) -> Literal["kvm", "tcg"] | None:
    """The acceleration verdict stored by the last doctor run, if any."""
    try:
        value = json.loads(host_file.read_text()).get("accel")
    except (OSError, ValueError):
        return None
    return value if value in ("kvm", "tcg") else None


def _missing_packages() -> list[str]:
    missing = []
    for pkg in APT_PACKAGES:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True
        )
        if "install ok installed" not in out.stdout:
            missing.append(pkg)
    return missing


def _socket_alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def libvirtd_command() -> list[str]:
    """The command that starts libvirtd by hand: ``tini -s -- libvirtd`` when tini is
    installed, else ``libvirtd -d``.

    QEMU daemonizes, so its processes are re-parented to the nearest subreaper, PID 1 when
    nothing else is. Under systemd that reaps at once; the init of some container and
    microVM hosts reaps orphans only every second or two (measured here: a dead orphan
    stayed a zombie 1.4-1.7 s), and libvirt's domain destroy polls until the QEMU process is
    gone, so every destroy took that long (``virsh destroy`` 1.4-1.7 s). tini, run as a
    subreaper (``-s``) around libvirtd, reaps each QEMU process as it exits.
    """
    if shutil.which("tini"):
        return ["tini", "-s", "--", "libvirtd"]
    return ["libvirtd", "-d"]


def _start_daemon(cmd: list[str], sock: Path, timeout_s: float = 20.0) -> bool:
    if cmd[0] == "tini":  # stays in the foreground: detach it into its own session
        subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )  # fmt: skip
    else:
        subprocess.run(cmd, check=False, capture_output=True, timeout=30)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _socket_alive(sock):
            return True
        time.sleep(0.2)
    return False


def _default_network_active() -> bool:
    out = subprocess.run(
        ["virsh", "-c", "qemu:///system", "net-list", "--name"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return "default" in out.stdout.split()


def run_doctor(
    *,
    fix: bool,
    host_file: Path,
    probe_dir: Path,
    uri: str = "qemu:///system",
    reprobe: bool = False,
    on_check: Callable[[Check], None] | None = None,
) -> HostReport:
    """Check (and with ``fix``, repair) everything deskvm needs on this host.

    Args:
        fix: install packages, start daemons and set /dev/kvm permissions.
        host_file: where the acceleration verdict is stored (JSON).
        probe_dir: scratch directory for the acceleration probe.
        uri: libvirt URI.
        reprobe: probe acceleration even if a verdict is stored.
        on_check: called as each check completes (for live output).

    Returns:
        The report; ``report.ok`` is false if anything needed is still missing.
    """
    report = HostReport()

    def add(check: Check) -> None:
        report.checks.append(check)
        if on_check is not None:
            on_check(check)

    if os.geteuid() != 0:
        add(Check("root", "fail", "deskvm manages libvirt system domains and host networking",
                  "run as root (sudo)"))  # fmt: skip
        return report
    add(Check("root", "ok", "running as root"))

    missing = _missing_packages()
    if missing and fix:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        update = subprocess.run(
            ["apt-get", "update", "-q"], capture_output=True, text=True, env=env
        )
        install = subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        if install.returncode == 0:
            add(Check("packages", "fixed", "installed " + " ".join(missing)))
            missing = []
        else:
            tail = (update.stderr + install.stderr)[-800:]
            add(Check("packages", "fail", f"apt-get install failed: {tail}",
                      "apt-get install " + " ".join(missing)))  # fmt: skip
            return report
    elif missing:
        add(Check("packages", "fail", "missing " + " ".join(missing),
                  "apt-get install --no-install-recommends " + " ".join(missing)))  # fmt: skip
        return report
    else:
        add(Check("packages", "ok", "qemu, qemu-img, libvirt, mmdebstrap installed"))

    for label, cmd, sock in (
        ("virtlogd", ["virtlogd", "-d"], VIRTLOGD_SOCKET),
        ("libvirtd", libvirtd_command(), LIBVIRT_SOCKET),
    ):
        if _socket_alive(sock):
            add(Check(label, "ok", f"running ({sock})"))
        elif fix and _start_daemon(cmd, sock):
            add(Check(label, "fixed", f"started with `{' '.join(cmd)}`"))
        else:
            add(Check(label, "fail", f"not running (no answer on {sock})", " ".join(cmd)))
            return report

    kvm = Path("/dev/kvm")
    if kvm.exists():
        st = kvm.stat()
        try:
            kvm_gid = grp.getgrnam("kvm").gr_gid
        except KeyError:
            kvm_gid = -1
        good = st.st_gid == kvm_gid and stat.S_IMODE(st.st_mode) & 0o060 == 0o060
        if good:
            add(Check("/dev/kvm", "ok", "root:kvm, group read/write"))
        elif fix and kvm_gid >= 0:
            os.chown(kvm, 0, kvm_gid)
            os.chmod(kvm, 0o660)
            add(Check("/dev/kvm", "fixed",
                      "set root:kvm 0660 (Debian's udev default; without it libvirt re-probes "
                      "QEMU on every call)"))  # fmt: skip
            reprobe = True
        else:
            add(Check("/dev/kvm", "warn",
                      f"owner gid {st.st_gid} mode {stat.S_IMODE(st.st_mode):o}: libvirt will "
                      "re-probe QEMU on every call (domain create takes ~80 s)",
                      "chgrp kvm /dev/kvm && chmod 660 /dev/kvm"))  # fmt: skip
    else:
        add(
            Check(
                "/dev/kvm", "warn", "absent: guests run under TCG (slow, not a security boundary)"
            )
        )

    try:
        if _default_network_active():
            add(Check("libvirt default network", "warn",
                      "libvirt's NAT network 'default' is active; deskvm never uses it",
                      "virsh net-destroy default"))  # fmt: skip
        else:
            add(Check("libvirt default network", "ok", "inactive (deskvm never uses it)"))
    except (OSError, subprocess.SubprocessError) as exc:
        add(Check("libvirt default network", "warn", f"could not check: {exc}"))

    accel = None if reprobe else load_accel(host_file)
    if accel is None:
        try:
            accel, why = probe_accel(probe_dir, uri=uri)
        except HostSetupError as exc:
            add(
                Check(
                    "acceleration",
                    "fail",
                    exc.message,
                    "check `virsh -c qemu:///system capabilities`",
                )
            )
            return report
        store_accel(host_file, accel, why)
    else:
        stored_why = str(load_host_record(host_file).get("why") or "")
        why = f"{stored_why}; " if stored_why else ""
        why += f"stored verdict in {host_file} (--reprobe to test again)"
    report.accel = accel
    if accel == "kvm":
        add(Check("acceleration", "ok", f"KVM ({why})"))
    else:
        add(Check("acceleration", "warn",
                  f"TCG software emulation ({why}). TCG is slow and QEMU documents it is NOT a "
                  "security boundary: use a KVM host for untrusted guests."))  # fmt: skip
    return report
