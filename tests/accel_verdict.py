"""A stand-in :class:`~orchestrator.hypervisor.base.AccelVerdict` for the fake hypervisor."""

from __future__ import annotations


class Verdict:
    """An :class:`~orchestrator.hypervisor.base.AccelVerdict` that remembers its calls."""

    def __init__(self, *, pinned: bool = False, kvm_proven: bool = False) -> None:
        self.pinned, self.kvm_proven = pinned, kvm_proven
        self.failed: list[str] = []
        self.ran = 0

    def kvm_failed(self, reason: str) -> None:
        self.failed.append(reason)

    def kvm_ran_linux(self) -> None:
        self.ran += 1
        self.kvm_proven = True
