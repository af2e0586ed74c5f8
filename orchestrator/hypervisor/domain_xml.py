"""Render a session's libvirt domain XML. Pure: a golden-file test pins the output.

Reference: libvirt "Domain XML format" (https://libvirt.org/formatdomain.html).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import datetime

from orchestrator.hypervisor.base import Accel, NicAttachment, SessionPaths
from orchestrator.spec import MIN_DISPLAY_MEMORY_KIB, DisplaySpec, SessionSpec

__all__ = [
    "CLOCK_PORT",
    "CPU_PERIOD_US",
    "DOMAIN_PREFIX",
    "KEYBOARD_ALIAS",
    "METADATA_NS",
    "NETWORK_CMDLINE",
    "TCG_TB_CACHE_MIB",
    "clone_domain_xml",
    "cpu_quota_us",
    "domain_name",
    "generation_of",
    "hard_limit_mib",
    "metadata_owner",
    "render_domain_xml",
    "session_id_of",
    "vga_memory_kib",
]

DOMAIN_PREFIX = "deskvm-"
NETWORK_CMDLINE = "systemd.wants=systemd-networkd.service systemd.wants=systemd-resolved.service"
"""Appended to the kernel command line of domains with a NIC (see :func:`render_domain_xml`)."""
METADATA_NS = "https://deskvm.dev/xmlns/session/1"
CLOCK_PORT = "dev.deskvm.clock.0"
"""virtio-serial port name of the guest clock (domains of images with a guest helper)."""
KEYBOARD_ALIAS = "ua-deskvm-keyboard"
"""libvirt user alias (``<alias name=...>``) of the session's virtio keyboard."""


TCG_TB_CACHE_MIB = 256
"""TCG translation-block cache of TCG domains (``<features><tcg><tb-cache>``), MiB."""

CPU_PERIOD_US = 100_000
"""CFS bandwidth period of ``<cputune><global_period>``, microseconds."""


def hard_limit_mib(spec: SessionSpec) -> int:
    """The host's memory hard limit for the session's QEMU process, MiB.

    Guest RAM plus ``spec.memory_overhead_mib`` for QEMU itself, plus the display's video
    memory beyond QEMU's default 16 MiB (a 4K display has 64 MiB).
    """
    extra_vga_mib = (spec.display.memory_kib - MIN_DISPLAY_MEMORY_KIB) // 1024
    return spec.memory_mib + spec.memory_overhead_mib + extra_vga_mib


def cpu_quota_us(spec: SessionSpec) -> int:
    """CPU time the domain may use per :data:`CPU_PERIOD_US`, microseconds (-1: no quota)."""
    if spec.cpu_quota_pct is None:
        return -1
    return CPU_PERIOD_US * spec.cpu_quota_pct // 100


def domain_name(session_id: str, generation: int = 0) -> str:
    """The libvirt domain name of a session: ``deskvm-<session_id>``, or
    ``deskvm-<session_id>-r<generation>`` for the domain of its ``generation``-th reset
    (a reset's new domain runs while libvirt still cleans up the old one)."""
    name = DOMAIN_PREFIX + session_id
    return name if generation == 0 else f"{name}-r{generation}"


def session_id_of(name: str) -> str | None:
    """The session id in a deskvm domain name, or ``None`` for other domains."""
    if not name.startswith(DOMAIN_PREFIX):
        return None
    return name[len(DOMAIN_PREFIX) :].split("-r", 1)[0]


def generation_of(name: str) -> int:
    """The reset generation in a deskvm domain name (0: never reset)."""
    _, sep, gen = name.rpartition("-r")
    return int(gen) if sep and gen.isdigit() else 0


def vga_memory_kib(display: DisplaySpec) -> int:
    """Video memory of the stdvga card for ``display``, KiB.

    See :func:`orchestrator.spec.display_memory_kib` (two framebuffers, a power of two).
    """
    return display.memory_kib


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrs)
    if text is not None:
        el.text = text
    return el


def render_domain_xml(
    spec: SessionSpec,
    paths: SessionPaths,
    *,
    accel: Accel,
    created: datetime,
    nic: NicAttachment | None = None,
    owner: str = "",
    emulator: str = "/usr/bin/qemu-system-x86_64",
) -> str:
    """The domain XML for one session.

    The domain has: the overlay as its only disk (virtio), direct kernel boot with
    ``deskvm.display=WxH`` (and ``deskvm.autostart=NAME``, ``deskvm.keyboard_layout=NAME`` when
    the spec asks for them) appended to the image's command line (images that boot themselves,
    ``boot`` ``bios`` or ``uefi``, get these options as SMBIOS OEM strings; UEFI without secure
    boot, the variable store in ``paths.nvram``), a VM generation ID ``<genid/>`` (restored
    copies of a saved domain get new ones: the guest reseeds its RNG), a virtio tablet (absolute
    pointer), a virtio keyboard (alias :data:`KEYBOARD_ALIAS`), a stdvga card whose EDID prefers
    the requested size, two file-backed serial ports (console, guest log), a virtio-serial
    channel named ``spec.image.helper_port`` on the unix socket ``paths.helper_socket`` when the
    image has a guest helper (and then the guest clock's channel :data:`CLOCK_PORT` on
    ``paths.clock_socket``), no graphics server, no balloon, and a network interface only when
    ``nic`` is given (then :data:`NETWORK_CMDLINE` is appended to the kernel command line so
    that a systemd guest starts DHCP and its resolver). Every lifecycle event (poweroff, reboot,
    crash) destroys it. Limits: ``<cputune>`` CFS bandwidth when ``spec.cpu_quota_pct`` is set,
    and disk write errors reported to the guest (``error_policy="report"``) instead of pausing
    the domain. The memory hard limit (:func:`hard_limit_mib`) is *not* in this XML: libvirt 9
    also raises ``RLIMIT_MEMLOCK`` to any ``<memtune><hard_limit>`` at launch, which needs
    ``CAP_SYS_RESOURCE``; the hypervisor starts the domain paused, applies the hard limit live
    (the cgroup's memory limit, shown in the live XML) and only then resumes it.

    Args:
        spec: the session.
        paths: where the overlay and logs live.
        accel: ``"kvm"`` (domain type kvm, host CPU model) or ``"tcg"`` (type qemu).
        created: creation time, stored in the metadata (UTC).
        nic: bridge, MAC and tap name of the one NIC, or ``None`` for no network device at all.
        owner: which deskvm installation owns the domain (its sessions directory); the
            reaper of one installation never touches another's domains.
        emulator: QEMU binary.

    Returns:
        The XML document as a string.
    """
    display = spec.display
    dom = ET.Element("domain", type="kvm" if accel == "kvm" else "qemu")
    _sub(dom, "name", domain_name(spec.session_id))
    _sub(dom, "title", f"deskvm session {spec.session_id}")
    # VM generation ID: a restored clone gets a new one and Linux (>= 5.18) reseeds its RNG.
    _sub(dom, "genid")
    meta = _sub(dom, "metadata")
    ET.register_namespace("deskvm", METADATA_NS)
    _sub(
        meta,
        f"{{{METADATA_NS}}}session",
        id=spec.session_id,
        image=spec.image.name,
        image_hash=spec.image.content_hash,
        created=created.isoformat(),
        owner=owner,
    )
    _sub(dom, "memory", str(spec.memory_mib), unit="MiB")
    _sub(dom, "currentMemory", str(spec.memory_mib), unit="MiB")
    _sub(dom, "vcpu", str(spec.vcpus), placement="static")
    if spec.cpu_quota_pct is not None:
        cputune = _sub(dom, "cputune")
        _sub(cputune, "global_period", str(CPU_PERIOD_US))
        _sub(cputune, "global_quota", str(cpu_quota_us(spec)))
    options = [f"deskvm.display={display.width_px}x{display.height_px}"]
    if spec.autostart is not None:
        options.append(f"deskvm.autostart={spec.autostart}")
    if spec.keyboard_layout is not None:
        options.append(f"deskvm.keyboard_layout={spec.keyboard_layout}")
    if nic is not None:
        # With a NIC, ask systemd (systemd-debug-generator) for DHCP and a resolver: the
        # image keeps both disabled so that sessions without network pay nothing for them.
        options.append(NETWORK_CMDLINE)
    if spec.image.boot == "direct":
        os_el = _sub(dom, "os")
        _sub(os_el, "type", "hvm", arch="x86_64", machine="q35")
        _sub(os_el, "kernel", str(spec.image.kernel_path))
        _sub(os_el, "initrd", str(spec.image.initrd_path))
        _sub(os_el, "cmdline", " ".join([spec.image.kernel_cmdline, *options]))
    else:
        # The image boots itself (BIOS or UEFI firmware, its own boot loader): the deskvm.*
        # options reach the guest as SMBIOS type 11 OEM strings, one option per string
        # (the guest session reads /sys/firmware/dmi/entries/11-*/raw).
        sysinfo = _sub(dom, "sysinfo", type="smbios")
        oem = _sub(sysinfo, "oemStrings")
        for option in " ".join(options).split():
            _sub(oem, "entry", option)
        os_el = _sub(dom, "os", firmware="efi") if spec.image.boot == "uefi" else _sub(dom, "os")
        _sub(os_el, "type", "hvm", arch="x86_64", machine="q35")
        if spec.image.boot == "uefi":
            firmware = _sub(os_el, "firmware")
            _sub(firmware, "feature", enabled="no", name="secure-boot")
            _sub(os_el, "nvram", str(paths.nvram))
        _sub(os_el, "boot", dev="hd")
        _sub(os_el, "smbios", mode="sysinfo")
    features = _sub(dom, "features")
    _sub(features, "acpi")
    if accel == "tcg":
        # QEMU's default TCG translation cache is 1 GiB: bound it, it counts against the
        # memory hard limit.
        tcg = _sub(features, "tcg")
        _sub(tcg, "tb-cache", str(TCG_TB_CACHE_MIB), unit="MiB")
    if accel == "kvm":
        _sub(dom, "cpu", mode="host-passthrough", check="none")
    _sub(dom, "clock", offset="utc")
    for event in ("on_poweroff", "on_reboot", "on_crash"):
        _sub(dom, event, "destroy")
    devices = _sub(dom, "devices")
    _sub(devices, "emulator", emulator)
    disk = _sub(devices, "disk", type="file", device="disk")
    _sub(
        disk, "driver", name="qemu", type="qcow2", discard="unmap", cache="writeback",
        error_policy="report",
    )  # fmt: skip
    _sub(disk, "source", file=str(paths.overlay))
    _sub(disk, "target", dev="vda", bus="virtio")
    # The absolute pointer is a virtio tablet: on QEMU 7.2 it carries the back/forward
    # (side/extra) buttons that usb-tablet drops (measured with the input probe). No USB
    # controller at all: one device model less facing the guest.
    _sub(devices, "controller", type="usb", model="none")
    _sub(devices, "input", type="tablet", bus="virtio")
    # The keyboard is virtio too: QEMU's PS/2 queue holds 16 bytes (about three shifted
    # characters) and drops keys when a loaded host stalls the vCPU; the virtio keyboard's
    # event queue lets the host see how many events the guest has taken (key flow control,
    # see orchestrator.display.qmp). The machine's built-in PS/2 keyboard stays (libvirt 9
    # cannot remove it) but receives nothing once the guest's virtio driver is up.
    keyboard = _sub(devices, "input", type="keyboard", bus="virtio")
    _sub(keyboard, "alias", name=KEYBOARD_ALIAS)
    for port, path in ((0, paths.console_log), (1, paths.guest_log)):
        serial = _sub(devices, "serial", type="file")
        _sub(serial, "source", path=str(path), append="off")
        _sub(serial, "target", port=str(port))
    if spec.image.helper_port is not None:
        # The guest helper's port (text with no US key, horizontal wheel): a serial line
        # between QEMU and the host process, never a network path.
        channel = _sub(devices, "channel", type="unix")
        _sub(channel, "source", mode="bind", path=str(paths.helper_socket))
        _sub(channel, "target", type="virtio", name=spec.image.helper_port)
        # The guest clock's port (root's in the guest): the host sets the wall clock of a
        # desktop restored from a saved state.
        clock = _sub(devices, "channel", type="unix")
        _sub(clock, "source", mode="bind", path=str(paths.clock_socket))
        _sub(clock, "target", type="virtio", name=CLOCK_PORT)
    if nic is not None:
        iface = _sub(devices, "interface", type="bridge")
        _sub(iface, "source", bridge=nic.bridge)
        if nic.tap is not None:
            _sub(iface, "target", dev=nic.tap)
        _sub(iface, "mac", address=nic.mac)
        _sub(iface, "model", type="virtio")
    video = _sub(devices, "video")
    model = _sub(
        video, "model", type="vga", vram=str(vga_memory_kib(display)), heads="1", primary="yes"
    )
    _sub(model, "resolution", x=str(display.width_px), y=str(display.height_px))
    # The guest's getrandom()/arc4random block until the kernel RNG is seeded; without a
    # virtio-rng under TCG that took ~13 s of the boot (fontconfig and openbox wait on it).
    rng = _sub(devices, "rng", model="virtio")
    _sub(rng, "rate", bytes="4096", period="1000")
    _sub(rng, "backend", "/dev/urandom", model="random")
    _sub(devices, "memballoon", model="none")
    ET.indent(dom)
    return ET.tostring(dom, encoding="unicode") + "\n"


def metadata_owner(metadata_xml: str) -> str | None:
    """The ``owner`` attribute of a domain's deskvm metadata element, if present."""
    try:
        return ET.fromstring(metadata_xml).get("owner")
    except ET.ParseError:
        return None


def saved_nic_mac(saved_xml: str) -> str | None:
    """The MAC of a saved domain's one NIC (``None``: it has none)."""
    devices = ET.fromstring(saved_xml).find("devices")
    ifaces = [] if devices is None else devices.findall("interface")
    mac = ifaces[0].find("mac") if len(ifaces) == 1 else None
    return None if mac is None else mac.get("address")


def _replug_nic(devices: ET.Element, nic: NicAttachment | None) -> None:
    """Point the saved ``<interface>`` at ``nic`` (see :func:`clone_domain_xml`)."""
    ifaces = devices.findall("interface")
    if nic is None:
        if ifaces:
            raise ValueError("the saved domain has a NIC: its restore needs a network attachment")
        return
    if len(ifaces) != 1 or ifaces[0].get("type") != "bridge":
        raise ValueError("the saved domain has no NIC on a bridge to plug into the session's")
    iface = ifaces[0]
    mac = iface.find("mac")
    saved_mac = None if mac is None else mac.get("address")
    if saved_mac != nic.mac:
        raise ValueError(f"the saved NIC's MAC is {saved_mac}, the attachment's {nic.mac}")
    for tag in ("source", "target", "link"):
        for el in iface.findall(tag):
            iface.remove(el)
    source = ET.Element("source", bridge=nic.bridge)
    iface.insert(0, source)
    if nic.tap is not None:
        iface.insert(1, ET.Element("target", dev=nic.tap))


def clone_domain_xml(
    saved_xml: str,
    *,
    session_id: str,
    paths: SessionPaths,
    created: datetime,
    owner: str,
    uuid: str,
    genid: str,
    nic: NicAttachment | None = None,
) -> str:
    """The XML a restored copy of a saved session domain runs under.

    Same devices as ``saved_xml`` (a saved domain's XML, see
    :mod:`orchestrator.hypervisor.save_image`), but the clone's own name
    (``deskvm-<session_id>``, ``-r<N>`` added for ``paths.generation`` N), UUID, VM
    generation ID (a new one: the guest reseeds its RNG), metadata, overlay, serial log
    files and guest helper socket, and no
    ``<memtune>`` (the hard limit is applied live, as for a cold start). A saved NIC is
    plugged into ``nic``'s bridge under ``nic``'s tap name; its MAC stays the saved one
    (part of the guest's saved device state).

    Raises:
        ValueError: ``saved_xml`` is not a deskvm domain, or the saved NIC and ``nic``
            do not match (one without the other, more than one NIC, another MAC).
    """
    dom = ET.fromstring(saved_xml)
    ET.register_namespace("deskvm", METADATA_NS)
    name = dom.find("name")
    meta = dom.find(f"metadata/{{{METADATA_NS}}}session")
    if dom.tag != "domain" or name is None or meta is None:
        raise ValueError("not a deskvm domain XML")
    name.text = domain_name(session_id, paths.generation)
    for tag, value in (("uuid", uuid), ("genid", genid), ("title", f"deskvm session {session_id}")):
        el = dom.find(tag)
        if el is None:
            el = ET.Element(tag)
            dom.insert(1, el)
        el.text = value
    meta.set("id", session_id)
    meta.set("created", created.isoformat())
    meta.set("owner", owner)
    for memtune in dom.findall("memtune"):
        dom.remove(memtune)
    devices = dom.find("devices")
    if devices is None:
        raise ValueError("saved domain XML has no devices")
    for disk in devices.findall("disk"):
        source = disk.find("source")
        if disk.get("device") == "disk" and source is not None:
            source.set("file", str(paths.overlay))
            for backing in disk.findall("backingStore"):
                disk.remove(backing)
    logs = {"0": paths.console_log, "1": paths.guest_log}
    for tag in ("serial", "console"):
        for el in devices.findall(tag):
            source, target = el.find("source"), el.find("target")
            port = target.get("port", "0") if target is not None else "0"
            if source is not None and port in logs:
                source.set("path", str(logs[port]))
    for channel in devices.findall("channel"):
        source, target = channel.find("source"), channel.find("target")
        if channel.get("type") == "unix" and source is not None and target is not None:
            port = target.get("name")
            source.set(
                "path", str(paths.clock_socket if port == CLOCK_PORT else paths.helper_socket)
            )
    _replug_nic(devices, nic)
    ET.indent(dom)
    return ET.tostring(dom, encoding="unicode") + "\n"
