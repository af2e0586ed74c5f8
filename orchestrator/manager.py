"""The sessions of one server: create (blocking until ready), look up, delete, reap.

The manager owns the concurrency limit and the mapping from ids to sessions. It keeps
ended sessions in a bounded history so that clients can still read their state, guest
log and recording path after deletion.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from orchestrator.clock import Clock, SystemClock
from orchestrator.errors import CapacityError, DeskvmError, SessionNotFound
from orchestrator.hypervisor.base import Hypervisor
from orchestrator.input_plan import Pacing
from orchestrator.recorder import FileRecorder
from orchestrator.session import Session
from orchestrator.spec import BootImage, DisplaySpec, SessionSpec, new_session_id

__all__ = ["SessionManager"]

_HISTORY = 256


class SessionManager:
    """Creates and tracks sessions.

    Args:
        hypervisor: the hypervisor seam.
        resolve_image: image name -> built image (raises ``ImageNotFound``).
        recordings_dir: each session records into ``recordings_dir/<id>``.
        max_sessions: concurrent live sessions (starting or ready).
        clock: time source.
        pacing: input pacing for every session.
        capture_fps: continuous capture rate of every session (``None`` or 0: off).
    """

    def __init__(
        self,
        *,
        hypervisor: Hypervisor,
        resolve_image: Callable[[str], BootImage],
        recordings_dir: Path,
        max_sessions: int = 4,
        clock: Clock | None = None,
        pacing: Pacing | None = None,
        ready_poll_s: float = 0.5,
        capture_fps: float | None = None,
    ) -> None:
        self.hypervisor = hypervisor
        self._resolve_image = resolve_image
        self._recordings_dir = recordings_dir
        self._max_sessions = max_sessions
        self._clock = clock or SystemClock()
        self._pacing = pacing
        self._ready_poll_s = ready_poll_s
        self._capture_fps = capture_fps or None
        self._live: dict[str, Session] = {}
        self._ended: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def create(
        self,
        *,
        image: str,
        display: DisplaySpec,
        memory_mib: int = 2048,
        vcpus: int = 2,
        boot_timeout_s: float = 180.0,
        on_started: Callable[[Session], None] | None = None,
    ) -> Session:
        """Start a session and block until its desktop is drawn.

        Args:
            on_started: called with the session as soon as it is registered (before the
                boot wait), e.g. to let a caller cancel it.

        Raises:
            CapacityError: ``max_sessions`` are live already.
            ConfigError, ImageNotFound: bad request.
            HypervisorError, BootTimeout: could not start (nothing is left behind).
        """
        boot_image = self._resolve_image(image)
        spec = SessionSpec(
            session_id=new_session_id(),
            image=boot_image,
            display=display,
            memory_mib=memory_mib,
            vcpus=vcpus,
            boot_timeout_s=boot_timeout_s,
        )
        with self._lock:
            if len(self._live) >= self._max_sessions:
                raise CapacityError(
                    f"{len(self._live)} of {self._max_sessions} sessions are running; "
                    "delete one or raise --max-sessions"
                )
            recorder = FileRecorder(
                self._recordings_dir / spec.session_id,
                self._clock,
                {
                    "session_id": spec.session_id,
                    "image": {"name": boot_image.name, "content_hash": boot_image.content_hash},
                    "display": {"width": display.width_px, "height": display.height_px},
                    "memory_mib": memory_mib,
                    "vcpus": vcpus,
                    "accel": self.hypervisor.accel,
                },
            )
            session = Session(
                spec,
                hypervisor=self.hypervisor,
                recorder=recorder,
                clock=self._clock,
                pacing=self._pacing,
                ready_poll_s=self._ready_poll_s,
                capture_fps=self._capture_fps,
            )
            self._live[spec.session_id] = session
        if on_started is not None:
            on_started(session)
        try:
            session.start()
        except BaseException:
            self._retire(session)
            raise
        return session

    def _retire(self, session: Session) -> None:
        with self._lock:
            self._live.pop(session.id, None)
            self._ended[session.id] = session
            while len(self._ended) > _HISTORY:
                self._ended.popitem(last=False)

    def resolve_image(self, name: str) -> BootImage:
        """The built image called ``name`` (with its content hash).

        Raises:
            ImageNotFound: no such image is built.
        """
        return self._resolve_image(name)

    @property
    def recordings_dir(self) -> Path:
        """Where each session's recording directory is created."""
        return self._recordings_dir

    def get(self, session_id: str) -> Session:
        """The live or recently ended session with this id.

        Raises:
            SessionNotFound: unknown id.
        """
        with self._lock:
            session = self._live.get(session_id) or self._ended.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return session

    def live(self) -> list[Session]:
        with self._lock:
            return list(self._live.values())

    def all(self) -> list[Session]:
        with self._lock:
            return [*self._live.values(), *self._ended.values()]

    def delete(self, session_id: str, *, reason: str = "deleted") -> Session:
        """Close a session (idempotent for ended ones) and return it.

        Raises:
            SessionNotFound: unknown id.
            HypervisorError: teardown incomplete (the session is still retired).
        """
        session = self.get(session_id)
        try:
            session.close(reason=reason)
        finally:
            self._retire(session)
        return session

    def close_all(self, *, reason: str = "server shutdown") -> list[str]:
        """Close every live session; returns error messages of failed teardowns."""
        errors: list[str] = []
        for session in self.live():
            try:
                self.delete(session.id, reason=reason)
            except DeskvmError as exc:
                errors.append(f"{session.id}: {exc.message}")
        return errors

    def reap(self) -> list[str]:
        """Destroy hypervisor leftovers of sessions this manager does not know.

        Returns:
            The session ids removed.
        """
        with self._lock:
            known = set(self._live)
        removed = []
        for session_id in sorted(self.hypervisor.list_sessions() - known):
            with contextlib.suppress(DeskvmError):
                self.hypervisor.destroy(session_id)
                removed.append(session_id)
        return removed
