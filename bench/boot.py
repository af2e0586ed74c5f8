#!/usr/bin/env python3
"""Where a cold boot's time goes, by the guest's own counters: boots an image N times.

Each boot is an ordinary cold session start (no NIC, the image's default display), timed as
``deskvm image verify`` times it: from the call that defines and starts the domain to the
accepted ready frame at the host. The run is cut into phases:

  host      ``define+start``  libvirt defines the domain, QEMU starts, the hard limit is set
  host      ``firmware``      QEMU's firmware and kernel loading, until the guest kernel's clock
                              starts (host time of the guest log's ``DESKVM_READY`` line minus
                              the guest's uptime at that line)
  guest     ``kernel``        kernel start to ``Run /init`` (the initrd), printk time
  guest     ``initrd``        the initrd until PID 1 starts in the root filesystem
  guest     ``init``          PID 1 (the small image's own init, or systemd) until the session
                              script starts
  guest     ``session``       session script: keymap, xauth, display driver, /dev/dri/card0
  guest     ``xorg``          Xorg start until it accepts clients
  guest     ``wm``            the desktop script, screen size, background, window manager start
  guest     ``client``        the first client (the xterm, or the recipe's) until it runs
  guest     ``mapped``        until the client is mapped, managed and focused: ``DESKVM_READY``
  host      ``ready-frame``   from ``DESKVM_READY`` on the guest log to the accepted frame (the
                              session's poll interval and frame check)

Guest times come from the session scripts' uptime stamps on the console
(``deskvm-session: 3.21s start ...``) and, with ``deskvm.bootstats=1`` (added to every boot
here), the guest's boot counters which its session script prints on the console once the
desktop is ready: the kernel log (printk times), systemd's manager and unit timestamps,
processes' CPU times and ``systemd-analyze critical-chain``. Images whose session script
predates ``deskvm.bootstats`` get only the stamped phases (``kernel``..``init`` become one
``to-session`` phase).

Variants (``--variant LABEL=EXTRA``, repeatable) boot the same image with ``EXTRA`` appended to
its kernel command line; ``--kernel``/``--initrd LABEL=PATH`` boot another kernel or initrd
and ``--variant-hash LABEL=PREFIX`` another stored version of the image. Runs
interleave the variants (round-robin), so a host whose load drifts weighs on each alike.
Prints one line per boot, then p50s per phase and variant, then the detail (slowest kernel
initcalls with ``initcall_debug`` in EXTRA, systemd units before the session, CPU time per
process, the critical chain) of each variant's median boot with ``--detail``.

Run as root on a host set up by `deskvm doctor --fix`, with the image built, under the VM
lock (nothing else booting, or say so with the figures):
    flock /run/deskvm-vm.lock .venv/bin/python bench/boot.py [--runs 5] [--image NAME]
        [--hash PREFIX] [--variant LABEL=EXTRA ...] [--kernel LABEL=PATH ...]
        [--initrd LABEL=PATH ...] [--variant-hash LABEL=PREFIX ...] [--detail]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import statistics
import threading
import time
from pathlib import Path

from agent_bridge.runtime import build_manager
from orchestrator.errors import DeskvmError
from orchestrator.hypervisor.base import SessionPaths
from orchestrator.interrupt import run_main
from orchestrator.settings import Settings
from orchestrator.spec import BootImage, DisplaySpec
from vm_images import find_image

PHASES = (
    "define+start",
    "firmware",
    "kernel",
    "initrd",
    "init",
    "to-session",
    "session",
    "xorg",
    "wm",
    "client",
    "mapped",
    "ready-frame",
)
MARK_RE = re.compile(r"deskvm-(session|desktop|init): ([0-9]+\.[0-9]+)s (.*)")
STATS_RE = re.compile(r"deskvm-bootstats: (\S+) ?(.*)")
KMSG_RE = re.compile(r"^\[\s*([0-9]+\.[0-9]+)\] (.*)")
INITCALL_RE = re.compile(r"initcall (\S+) returned -?\d+ after (\d+) usecs")
# The session scripts' milestones, in order (the first mark whose text starts with it).
MARKS = {
    "start": "start ",
    "display": "display device ready",
    "xorg": "Xorg accepts clients",
    "wm": "screen set",
    "client": " running",
    "ready": "DESKVM_READY",
}


@dataclasses.dataclass
class Boot:
    """One boot's figures (seconds) and the guest's counters."""

    variant: str
    total_s: float
    phases: dict[str, float]
    detail: list[str]
    failed: bool = False


class LogWatcher(threading.Thread):
    """Polls a session's console and guest log; notes the host time each line arrived."""

    def __init__(self, paths: SessionPaths, t0: float, poll_s: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.paths, self.t0, self.poll_s = paths, t0, poll_s
        self.console_lines: list[tuple[float, str]] = []
        self.ready_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        pending = b""
        offset = 0
        while not self.stop.is_set():
            now = time.monotonic() - self.t0
            try:
                with self.paths.console_log.open("rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                data = b""
            offset += len(data)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self.console_lines.append((now, line.decode("utf-8", "replace").rstrip("\r")))
            if self.ready_at is None:
                try:
                    if b"DESKVM_READY" in self.paths.guest_log.read_bytes():
                        self.ready_at = now
                except OSError:
                    pass
            self.stop.wait(self.poll_s)


def boot_once(settings: Settings, image: BootImage, variant: str, extra: str, args) -> Boot:
    cmdline = " ".join(x for x in (image.kernel_cmdline, "deskvm.bootstats=1", extra) if x)
    kernels = dict(k.split("=", 1) for k in args.kernel)
    initrds = dict(i.split("=", 1) for i in args.initrd)
    variant_image = dataclasses.replace(
        image,
        kernel_cmdline=cmdline,
        kernel_path=Path(kernels[variant]) if variant in kernels else image.kernel_path,
        initrd_path=Path(initrds[variant]) if variant in initrds else image.initrd_path,
    )
    manager = build_manager(settings, egress=None, resolve_image=lambda _name: variant_image)
    watcher: list[LogWatcher] = []
    t0 = time.monotonic()

    def started(session) -> None:
        w = LogWatcher(SessionPaths.under(settings.sessions_dir, session.id), t0)
        w.start()
        watcher.append(w)

    display = DisplaySpec(width_px=args.width, height_px=args.height)
    session = None
    try:  # a stop signal anywhere in here ends the VM (run_main: SIGINT, SIGTERM, SIGHUP)
        try:
            session = manager.create(
                image=image.name,
                display=display,
                boot_timeout_s=args.boot_timeout,
                on_started=started,
            )
        except DeskvmError as e:
            # A boot that never got ready is a result too: keep its console, go on.
            lines = watcher[0].console_lines if watcher else []
            log = settings.state_dir / f"console-{variant}-failed-{secrets.token_hex(4)}.log"
            log.write_text(f"{e}\n" + "".join(f"{t:8.3f} {line}\n" for t, line in lines))
            print(f"{variant:14} FAILED ({type(e).__name__}: {str(e)[:120]}); console in {log}")
            return Boot(variant=variant, total_s=float("nan"), phases={}, detail=[], failed=True)
        total_s = time.monotonic() - t0
        (w,) = watcher
        # The counters come once the desktop is ready; wait for their end (or give up).
        deadline = time.monotonic() + args.stats_timeout
        while time.monotonic() < deadline and not any(
            "deskvm-bootstats: end" in line for _, line in w.console_lines
        ):
            time.sleep(0.2)
        time.sleep(0.1)
    finally:
        for w in watcher:
            w.stop.set()
            w.join()
        if session is not None:
            session.close(reason="bench boot")
    log = settings.state_dir / f"console-{variant}-{session.id}.log"
    log.write_text("".join(f"{t:8.3f} {line}\n" for t, line in w.console_lines))
    return analyse(variant, total_s, session.start_phases_s, w, args)


def analyse(variant: str, total_s: float, host_phases: dict, w: LogWatcher, args) -> Boot:
    marks: dict[str, float] = {}
    kmsg: list[tuple[float, str]] = []
    stats: dict[str, str] = {}
    units: list[tuple[float, float, str]] = []
    procs: list[str] = []
    chain: list[str] = []
    xlog: list[str] = []
    acct: list[str] = []
    ticks: list[int] = []
    for _, line in w.console_lines:
        if m := MARK_RE.search(line):
            uptime_s, text = float(m.group(2)), m.group(3)
            if m.group(1) == "init":  # deskvm's init (PID 1): "deskvm-init: 2.9s start"
                marks.setdefault("init", uptime_s)
                continue
            for key, prefix in MARKS.items():
                found = text.startswith(prefix) if key != "client" else prefix in text
                if key not in marks and found:
                    marks[key] = uptime_s
                    break
            continue
        if not (m := STATS_RE.search(line)):
            continue
        kind, rest = m.group(1), m.group(2)
        if kind == "kmsg" and (k := KMSG_RE.match(rest)):
            kmsg.append((float(k.group(1)), k.group(2)))
        elif kind == "manager" and "=" in rest:
            key, _, value = rest.partition("=")
            stats[key] = value
        elif kind == "unit":
            # unit ID INACTIVE_EXIT_US ACTIVE_ENTER_US
            parts = rest.split()
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                exit_us, enter_us = int(parts[1]), int(parts[2])
                if exit_us:
                    units.append((exit_us / 1e6, max(0, enter_us - exit_us) / 1e6, parts[0]))
        elif kind == "ps":
            procs.append(rest)
        elif kind in ("acct", "live"):
            acct.append(f"{kind:4} {rest}")
        elif kind == "stat" and rest.startswith("cpu "):
            ticks = [int(v) for v in rest.split()[1:] if v.isdigit()]
        elif kind == "chain":
            chain.append(rest)
        elif kind == "xlog" and KMSG_RE.match(rest):
            xlog.append(rest)

    phases: dict[str, float] = {"define+start": host_phases.get("domain_start_s", 0.0)}
    ready_u = marks.get("ready")
    if ready_u is not None and w.ready_at is not None:
        guest_zero = w.ready_at - ready_u  # host time (since t0) of the guest's uptime 0
        phases["firmware"] = guest_zero - phases["define+start"]
        phases["ready-frame"] = total_s - w.ready_at
    run_init = next((t for t, msg in kmsg if msg.startswith("Run /init")), None)
    # PID 1's start: systemd's userspace timestamp, or deskvm init's first mark.
    userspace_us = int(stats.get("UserspaceTimestampMonotonic", "0") or 0)
    if not userspace_us and "init" in marks:
        userspace_us = int(marks["init"] * 1e6)
    start_u = marks.get("start")
    if start_u is not None:
        if run_init is not None and userspace_us:
            phases["kernel"] = run_init
            phases["initrd"] = userspace_us / 1e6 - run_init
            phases["init"] = start_u - userspace_us / 1e6
        else:
            phases["to-session"] = start_u
    for name, (a, b) in {
        "session": ("start", "display"),
        "xorg": ("display", "xorg"),
        "wm": ("xorg", "wm"),
        "client": ("wm", "client"),
        "mapped": ("client", "ready"),
    }.items():
        if a in marks and b in marks:
            phases[name] = marks[b] - marks[a]

    detail: list[str] = []
    if kmsg:
        detail.append("kernel (printk time, s):")
        for t, msg in kmsg:
            if re.match(
                r"(Run /init|Trying to unpack|Freeing initrd|Freeing unused kernel image"
                r"|EXT4-fs \(vda\): mounted|systemd\[1\]: systemd \d)",
                msg,
            ):
                detail.append(f"  {t:7.3f}  {msg[:90]}")
        calls = sorted(
            ((int(c.group(2)), c.group(1)) for _, msg in kmsg if (c := INITCALL_RE.search(msg))),
            reverse=True,
        )
        if calls:
            detail.append("slowest initcalls (ms):")
            detail += [f"  {us / 1000:7.1f}  {name}" for us, name in calls[:15]]
    if units and start_u is not None:
        detail.append(f"systemd units started before the session ({start_u:.2f} s): start  took")
        early = sorted(u for u in units if u[0] <= start_u)
        detail += [f"  {t:6.2f} {d:6.2f}  {name}" for t, d, name in early]
        later = sorted((u for u in units if u[0] > start_u), key=lambda u: -u[1])[:8]
        detail.append("slowest units after it: start  took")
        detail += [f"  {t:6.2f} {d:6.2f}  {name}" for t, d, name in later]
    if len(ticks) >= 5:
        # /proc/stat at ready, USER_HZ (100/s) ticks summed over the vCPUs: user nice system
        # idle iowait irq softirq steal.
        # Steal (time the host did not run a vCPU that wanted to run: zero under TCG) is
        # neither the guest's work nor idle: shown apart.
        ticks += [0] * (8 - len(ticks))
        idle_s = (ticks[3] + ticks[4]) / 100
        busy_s = (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / 100
        steal_s = ticks[7] / 100
        share = busy_s / (busy_s + idle_s) if busy_s + idle_s else float("nan")
        detail.append(
            f"guest CPU from boot to ready (all vCPUs): busy {busy_s:.2f} s, idle {idle_s:.2f} s"
            f" ({share:.0%} busy), stolen by the host {steal_s:.2f} s"
        )
    if acct:
        detail.append(
            "CPU time to ready: acct = processes that exited between the session's start and"
            " ready (count, seconds, command); live = processes alive at ready (seconds, pid,"
            " command):"
        )
        detail += [f"  {a}" for a in acct[:45]]
    if procs:
        detail.append("CPU time by process at the dump (ps: TIME ELAPSED COMMAND):")
        detail += [f"  {p}" for p in procs[:16]]
    if xlog:
        detail.append("X server log (uptime s), start, modules, keymap, devices:")
        keep = re.compile(
            r"X\.Org X Server|LoadModule|XKB|xkbcomp|Adding input device"
            r"|modeset\(0\): Output|Using input driver"
        )
        detail += [f"  {line[:110]}" for line in xlog if keep.search(line)][:40]
    if chain:
        detail.append("systemd-analyze critical-chain deskvm-session.service:")
        detail += [f"  {c}" for c in chain]
    return Boot(variant=variant, total_s=total_s, phases=phases, detail=detail)


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="boots per variant")
    parser.add_argument("--image", default=None, help="image name (default: the default image)")
    parser.add_argument("--hash", default=None, help="stored version (content hash prefix)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=EXTRA",
        help="boot with EXTRA appended to the kernel command line (repeatable; default: one "
        "variant 'image', the image as it is)",
    )
    parser.add_argument(
        "--kernel",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="variant LABEL boots this kernel instead of the image's (repeatable)",
    )
    parser.add_argument(
        "--initrd",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="variant LABEL boots this initrd (repeatable)",
    )
    parser.add_argument(
        "--variant-hash",
        action="append",
        default=[],
        metavar="LABEL=PREFIX",
        help="variant LABEL boots this stored version of the image (repeatable)",
    )
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=800)
    parser.add_argument(
        "--boot-timeout",
        type=float,
        default=180.0,
        help="a boot not ready after this long (s) counts as failed; its console is kept",
    )
    parser.add_argument(
        "--stats-timeout", type=float, default=60.0, help="wait for the guest's counters (s)"
    )
    parser.add_argument("--detail", action="store_true", help="print the median boots' detail")
    args = parser.parse_args()

    base = Settings.from_env()
    settings = base.replace(
        state_dir=base.state_dir / f"bench-boot-{secrets.token_hex(3)}",
        images_dir_override=base.images_dir,
        warm_pool="",
    )
    settings.state_dir.mkdir(mode=0o711, parents=True)
    if base.host_file.is_file():
        (settings.state_dir / "host.json").write_bytes(base.host_file.read_bytes())
    name = args.image or base.default_image
    image = find_image(name, settings.images_dir, require_verified=False, content_hash=args.hash)
    images = {
        label: find_image(name, settings.images_dir, require_verified=False, content_hash=prefix)
        for label, prefix in (h.split("=", 1) for h in args.variant_hash)
    }
    variants = [tuple(v.split("=", 1)) for v in args.variant] or [("image", "")]
    if any(len(v) != 2 for v in variants):
        raise SystemExit("--variant wants LABEL=EXTRA")
    print(
        f"{name} {image.content_hash[:12]}  load {os.getloadavg()[0]:.2f}  "
        f"{args.runs} runs x {len(variants)} variants"
    )
    for label, other in images.items():
        print(f"variant {label}: {name} {other.content_hash[:12]}")
    print(f"cmdline: {image.kernel_cmdline}; console logs in {settings.state_dir}")
    header = " ".join(f"{p[:11]:>11}" for p in PHASES)
    print(f"{'variant':14} {'total':>6} {header}")
    boots: list[Boot] = []
    for _ in range(args.runs):
        for label, extra in variants:
            boot = boot_once(settings, images.get(label, image), label, extra, args)
            boots.append(boot)
            if boot.failed:
                continue
            cells = " ".join(
                f"{boot.phases[p]:11.2f}" if p in boot.phases else f"{'-':>11}" for p in PHASES
            )
            print(f"{label:14} {boot.total_s:6.2f} {cells}   load {os.getloadavg()[0]:.2f}")

    print("\np50 (s)")
    print(f"{'variant':14} {'total':>6} {header}")
    for label, extra in variants:
        failed = sum(b.failed for b in boots if b.variant == label)
        mine = [b for b in boots if b.variant == label and not b.failed]
        cells = " ".join(
            f"{p50([b.phases[p] for b in mine if p in b.phases]):11.2f}" for p in PHASES
        )
        note = f"   FAILED {failed} of {failed + len(mine)}" if failed else ""
        print(f"{label:14} {p50([b.total_s for b in mine]):6.2f} {cells}   {extra}{note}")
    if args.detail:
        for label, _ in variants:
            mine = sorted(
                (b for b in boots if b.variant == label and not b.failed), key=lambda b: b.total_s
            )
            if not mine:
                continue
            median = mine[len(mine) // 2]
            print(f"\n== {label}: median boot, {median.total_s:.2f} s")
            print("\n".join(median.detail) or "(no guest counters)")


if __name__ == "__main__":
    run_main(main)
