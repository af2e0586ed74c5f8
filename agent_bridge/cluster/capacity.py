"""What a node offers and what a session asks for, as Ray resources and node labels.

Pure: no Ray, no I/O except :func:`host_memory_mib` / :func:`host_cpus` (read the host).
See docs/scale-out.md, "Resources and labels a node declares".

Resources are quantities Ray subtracts while a session's placement group holds them:
``deskvm_desktop`` (slots) and ``deskvm_memory_mib`` (host memory for session hard limits).
Labels are facts a session selects on: the node's name, acceleration, backend, egress, and
one ``image.deskvm.io/<image>: "yes"`` per built image.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.errors import ConfigError

__all__ = [
    "DESKTOPS_PER_CORE",
    "IMAGE_LABEL_PREFIX",
    "LABEL_ACCEL",
    "LABEL_BACKEND",
    "LABEL_EGRESS",
    "LABEL_NODE",
    "RESERVE_MIB",
    "RESOURCE_DESKTOP",
    "RESOURCE_MEMORY",
    "NodeCapacity",
    "Placement",
    "host_cpus",
    "host_memory_mib",
    "image_label",
    "node_capacity",
    "placement_request",
]

RESOURCE_DESKTOP = "deskvm_desktop"
"""Ray resource: desktop slots of a node; each session holds 1."""
RESOURCE_MEMORY = "deskvm_memory_mib"
"""Ray resource: MiB of host memory for session hard limits; a session holds its own."""
LABEL_NODE = "deskvm.io/node"
LABEL_ACCEL = "deskvm.io/accel"
LABEL_BACKEND = "deskvm.io/backend"
LABEL_EGRESS = "deskvm.io/egress"
IMAGE_LABEL_PREFIX = "image.deskvm.io/"
RESERVE_MIB = 2048
"""Host memory kept for the host itself (libvirt, the node agent, page cache), MiB."""
DESKTOPS_PER_CORE: dict[str, int] = {"kvm": 4, "tcg": 2}
"""CPU slots per host core: TCG emulates the guest CPU, so its desktops cost more."""

Backend = Literal["libvirt", "fake"]
_LABEL_NAME_RE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?$")


def image_label(image: str) -> str:
    """The label key that says a node has ``image`` built.

    Raises:
        ConfigError: the image name cannot be a label name (63 characters at most,
            starting and ending with a letter or digit).
    """
    if not _LABEL_NAME_RE.match(image):
        raise ConfigError(
            f"image name {image!r} cannot be a Ray node label (at most 63 characters, "
            "starting and ending with a letter or digit)"
        )
    return IMAGE_LABEL_PREFIX + image


def host_memory_mib() -> int:
    """This host's memory (``MemTotal`` of ``/proc/meminfo``), MiB.

    Raises:
        ConfigError: ``/proc/meminfo`` cannot be read.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError) as exc:
        raise ConfigError(f"cannot read the host's memory from /proc/meminfo: {exc}") from exc
    raise ConfigError("no MemTotal in /proc/meminfo")


def host_cpus() -> int:
    """CPUs this process may run on (the affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """What one node declares.

    Attributes:
        name: the node's name (label ``deskvm.io/node``).
        slots: desktop slots (resource ``deskvm_desktop``).
        memory_mib: MiB for session hard limits (resource ``deskvm_memory_mib``).
        accel: ``kvm`` or ``tcg``.
        backend: ``libvirt``, or ``fake`` (tests and benchmarks).
        images: built images offered (one label each).
        egress: whether an egress upstream is configured.
        skipped_images: images whose names cannot be labels (not offered).
    """

    name: str
    slots: int
    memory_mib: int
    accel: str
    backend: Backend
    images: tuple[str, ...]
    egress: bool = False
    skipped_images: tuple[str, ...] = field(default=())

    def resources(self) -> dict[str, float]:
        """Ray custom resources (``ray start --resources``)."""
        return {RESOURCE_DESKTOP: float(self.slots), RESOURCE_MEMORY: float(self.memory_mib)}

    def labels(self) -> dict[str, str]:
        """Ray node labels (``ray start --labels``)."""
        labels = {
            LABEL_NODE: self.name,
            LABEL_ACCEL: self.accel,
            LABEL_BACKEND: self.backend,
            LABEL_EGRESS: "yes" if self.egress else "no",
        }
        labels.update({image_label(image): "yes" for image in self.images})
        return labels


def node_capacity(
    *,
    name: str,
    host_memory_mib: int,
    host_cpus: int,
    accel: str,
    backend: Backend,
    images: tuple[str, ...] | list[str],
    egress: bool = False,
    session_memory_mib: int = 2048,
    memory_overhead_mib: int = 768,
    reserve_mib: int = RESERVE_MIB,
    slots: int | None = None,
) -> NodeCapacity:
    """Derive a node's declaration from its host.

    Memory slots are ``(host_memory_mib - reserve_mib) // (session_memory_mib +
    memory_overhead_mib)`` (a default session's hard limit); CPU slots are ``host_cpus *
    DESKTOPS_PER_CORE[accel]``; the node offers the smaller, or ``slots`` if given.

    Args:
        name: node name (must be a valid label value).
        host_memory_mib: the host's memory, MiB.
        host_cpus: the host's CPUs.
        accel: ``kvm`` or ``tcg``.
        backend: ``libvirt`` or ``fake``.
        images: images built on the node.
        egress: an egress upstream is configured.
        session_memory_mib: guest RAM of a default session, MiB.
        memory_overhead_mib: QEMU overhead per session, MiB.
        reserve_mib: memory kept for the host, MiB.
        slots: override of the derived slot count.

    Raises:
        ConfigError: bad name, accel, or no room for a single session.
    """
    if not _LABEL_NAME_RE.match(name):
        raise ConfigError(
            f"node name {name!r} must be a valid label value (letters, digits, '-', '_', '.';"
            " at most 63 characters)"
        )
    if accel not in DESKTOPS_PER_CORE:
        raise ConfigError(f"accel must be kvm or tcg, not {accel!r}")
    memory_mib = host_memory_mib - reserve_mib
    per_session = session_memory_mib + memory_overhead_mib
    derived = min(memory_mib // per_session, host_cpus * DESKTOPS_PER_CORE[accel])
    count = derived if slots is None else slots
    if count < 1 or memory_mib < per_session:
        raise ConfigError(
            f"this host offers no desktop slot: {host_memory_mib} MiB memory "
            f"(- {reserve_mib} MiB reserve) and {host_cpus} CPUs for sessions of {per_session}"
            " MiB; give --slots and a smaller default session, or use a larger host"
        )
    offered: list[str] = []
    skipped: list[str] = []
    for image in sorted(set(images)):
        (offered if _LABEL_NAME_RE.match(image) else skipped).append(image)
    return NodeCapacity(
        name=name,
        slots=count,
        memory_mib=memory_mib,
        accel=accel,
        backend=backend,
        images=tuple(offered),
        egress=egress,
        skipped_images=tuple(skipped),
    )


@dataclass(frozen=True, slots=True)
class Placement:
    """One session's placement request: a single placement-group bundle and its selector."""

    bundle: dict[str, float]
    label_selector: dict[str, str]


def placement_request(
    *,
    image: str,
    memory_mib: int,
    memory_overhead_mib: int,
    accel: str | None = None,
    egress: bool = False,
) -> Placement:
    """What a session asks Ray for.

    Args:
        image: the image it boots (selects nodes that have it).
        memory_mib: guest RAM, MiB.
        memory_overhead_mib: QEMU overhead, MiB (the hard limit is the sum).
        accel: ``kvm``/``tcg`` to require one, ``None`` for any.
        egress: the session has an egress policy (needs a node with an upstream).

    Raises:
        ConfigError: the image name cannot be a label.
    """
    selector = {image_label(image): "yes"}
    if accel is not None:
        selector[LABEL_ACCEL] = accel
    if egress:
        selector[LABEL_EGRESS] = "yes"
    return Placement(
        bundle={RESOURCE_DESKTOP: 1.0, RESOURCE_MEMORY: float(memory_mib + memory_overhead_mib)},
        label_selector=selector,
    )
