"""The one exception root of deskvm, and its branches.

Every error deskvm raises on purpose derives from :class:`DeskvmError`. Errors of
the systems behind the seams (``libvirt.libvirtError``, ``subprocess.CalledProcessError``,
``websockets.ConnectionClosed``...) are translated where they enter, with the original
kept as ``__cause__``::

    DeskvmError
    ├── ConfigError              bad settings, spec or request (the caller can fix it)
    │   └── ImageNotFound        no built image of that name
    ├── HostSetupError           the host lacks a package, a daemon, a permission
    ├── ImageBuildError          an image recipe failed to build
    ├── ProtocolError            a malformed or unsupported message/action (pure layer)
    │   └── ActionError          well-formed but not executable here (e.g. off-screen)
    ├── HypervisorError          libvirt refused or failed (define, start, destroy)
    │   ├── AccelFailed          QEMU stopped the guest: its accelerator failed (KVM)
    │   └── BootTimeout          the desktop was not drawn before the deadline
    ├── DisplayError             screendump or input injection failed
    │   └── GuestHelperError     the in-guest helper failed or timed out
    ├── EgressError              bridge / nftables / resolver set-up or teardown failed
    ├── RecorderError            the recording could not be written
    ├── StorageError             recording storage (directory, S3) refused or failed
    ├── StoreError               a session record (for bridge restarts) could not be kept
    ├── SessionNotFound          no such session id
    ├── SessionClosed            the session has ended (or is ending)
    │   └── SessionLost          the session's cluster node died (scale-out)
    └── CapacityError            the server is at its limit of sessions or memory

Each error has a stable machine-readable ``code`` (used in WebSocket and REST error
bodies) and a human message.
"""

from __future__ import annotations

__all__ = [
    "AccelFailed",
    "ActionError",
    "BootTimeout",
    "CapacityError",
    "ConfigError",
    "DeskvmError",
    "DisplayError",
    "EgressError",
    "GuestHelperError",
    "HostSetupError",
    "HypervisorError",
    "ImageBuildError",
    "ImageNotFound",
    "ProtocolError",
    "RecorderError",
    "SessionClosed",
    "SessionLost",
    "SessionNotFound",
    "StorageError",
    "StoreError",
]


class DeskvmError(Exception):
    """Root of every deskvm error.

    Attributes:
        code: stable snake_case identifier sent to clients (``"boot_timeout"``...).
    """

    code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(DeskvmError):
    code = "invalid_config"


class ImageNotFound(ConfigError):
    code = "image_not_found"


class HostSetupError(DeskvmError):
    code = "host_setup"


class ImageBuildError(DeskvmError):
    code = "image_build_failed"


class ProtocolError(DeskvmError):
    """A message that cannot be parsed or names no supported action."""

    code = "invalid_message"


class ActionError(ProtocolError):
    """A well-formed action that cannot be carried out (e.g. off-screen coordinates)."""

    code = "invalid_action"


class HypervisorError(DeskvmError):
    code = "hypervisor_error"


class AccelFailed(HypervisorError):
    """QEMU stopped the guest on its own: its run state is ``internal-error`` (e.g. ``KVM
    internal error ... emulation failure``, a host whose ``/dev/kvm`` runs a boot sector but
    not a Linux kernel). The guest never runs again."""

    code = "accel_failed"


class BootTimeout(HypervisorError):
    """The desktop was not ready before the boot deadline.

    Attributes:
        console_tail: the last lines the guest printed on its console, for diagnosis.
    """

    code = "boot_timeout"

    def __init__(self, message: str, *, console_tail: str = "") -> None:
        super().__init__(message)
        self.console_tail = console_tail


class DisplayError(DeskvmError):
    code = "display_error"


class GuestHelperError(DisplayError):
    """The in-guest helper failed or did not answer a request in time (the action stopped)."""

    code = "guest_helper_error"


class EgressError(DeskvmError):
    code = "egress_error"


class RecorderError(DeskvmError):
    code = "recorder_error"


class SessionNotFound(DeskvmError):
    code = "session_not_found"


class SessionClosed(DeskvmError):
    code = "session_closed"


class SessionLost(SessionClosed):
    """The session ended because the cluster node running it died (``deskvm serve --ray``)."""

    code = "session_lost"


class StorageError(DeskvmError):
    """Recording storage (a directory or S3-compatible object storage) failed."""

    code = "storage_error"


class StoreError(DeskvmError):
    """A session record (what a restarted bridge re-adopts from) could not be written."""

    code = "store_error"


class CapacityError(DeskvmError):
    code = "over_capacity"
