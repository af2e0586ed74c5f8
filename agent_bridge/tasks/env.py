"""``DesktopEnv``: OSWorld's environment shape over a deskvm session.

An agent written for OSWorld's ``desktop_env.DesktopEnv`` runs with the provider swapped::

    from agent_bridge import Client
    from agent_bridge.tasks import DesktopEnv

    env = DesktopEnv(client=Client(url, token), action_space="pyautogui")
    obs = env.reset(task_config=task)          # a dict in OSWorld's task format, or a file
    response, actions = agent.predict(task["instruction"], obs)
    for action in actions:
        obs, reward, done, info = env.step(action)
        if done:
            break
    score = env.evaluate()                     # 0.0 .. 1.0
    env.close()

``step`` takes an action in any deskvm vocabulary: pyautogui code (a string, or
``{"command": code}`` as OSWorld also accepts), OSWorld's ``computer_13`` dicts
(``{"action_type": ...}``), deskvm's own (``{"action": "click", ...}``), and OSWorld's
special strings ``WAIT``, ``DONE``, ``FAIL``. Actions go to the bridge in their own
vocabulary (the bridge parses them, never runs them, and records them); a refused action
is reported in ``info["error"]`` and the episode goes on.

The observation is OSWorld's: ``{"screenshot": PNG bytes, "accessibility_tree": JSON text
or None, "terminal": None, "instruction": str}``.
"""

from __future__ import annotations

import base64
import binascii
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent_bridge.client import Client, RemoteError
from agent_bridge.tasks.guest import ClientTaskSession, TaskSession
from agent_bridge.tasks.metrics import METRICS
from agent_bridge.tasks.model import TaskConfig, TaskConfigError, load_task, parse_task
from agent_bridge.tasks.ops import TaskOps
from orchestrator.errors import ConfigError, DeskvmError

__all__ = ["ACTION_SPACES", "DesktopEnv", "action_schema"]

log = logging.getLogger("deskvm.tasks")

ACTION_SPACES = ("pyautogui", "computer_13", "deskvm")
_SPECIAL = ("WAIT", "DONE", "FAIL")


def action_schema(action: Any, action_space: str = "pyautogui") -> tuple[str, dict[str, Any]]:
    """The vocabulary (``schema``) and request body of one agent action.

    Strings are pyautogui code (``WAIT`` / ``DONE`` / ``FAIL`` too; under ``computer_13``
    they become ``{"action_type": ...}``); dicts with ``action_type`` are computer_13, with
    ``command`` or ``code`` pyautogui, with ``action`` deskvm.

    Raises:
        ConfigError: an action of no known shape (code ``invalid_action``).
    """
    if isinstance(action, str):
        if action_space == "computer_13" and action.strip() in _SPECIAL:
            return "computer_13", {"action_type": action.strip()}
        return "pyautogui", {"code": action}
    if isinstance(action, Mapping):
        if "action_type" in action:
            return "computer_13", dict(action)
        if "command" in action and isinstance(action["command"], str):
            return "pyautogui", {"code": action["command"]}
        if "code" in action:
            return "pyautogui", {"code": action["code"]}
        if "action" in action:
            return "deskvm", dict(action)
    raise ConfigError(
        f"an action is pyautogui code (str), or a dict with 'action_type' (computer_13), "
        f"'command'/'code' (pyautogui) or 'action' (deskvm); got {action!r:.80}",
        code="invalid_action",
    )


def _is_special(action: Any, name: str) -> bool:
    if isinstance(action, str):
        return action.strip() == name
    return isinstance(action, Mapping) and action.get("action_type") == name


class DesktopEnv:
    """OSWorld's ``DesktopEnv`` over deskvm (see the module docstring).

    Either give a ready ``session`` (guest control enabled; the env never deletes it), or a
    ``client``: the env then creates a session on the first ``reset`` (with
    ``guest_control=True`` and ``session_options``), a fresh one on every later ``reset``
    unless ``reuse_session``, and deletes it in :meth:`close`.

    Args:
        session: a ready :class:`~agent_bridge.tasks.guest.TaskSession` (or a client
            :class:`~agent_bridge.client.Session`).
        client: a :class:`~agent_bridge.client.Client` to create sessions with.
        action_space: how plain strings are read: ``pyautogui`` (default) or
            ``computer_13`` (``DONE`` etc. become computer_13 actions); dicts say their
            own vocabulary.
        require_a11y_tree: put the accessibility tree into each observation (a guest
            round trip per step).
        cache_dir: where each task's fetched files go (``<cache_dir>/<task id>/``).
        reuse_session: keep one session across resets.
        reset_desktop: with a kept session, return its desktop to the start state before
            each task (OSWorld's snapshot revert; a warm session restores its saved state in
            about a second). A session that cannot (it booted cold) is used as it is: the
            tasks' setup steps must then clear what earlier tasks left.
        session_options: keyword arguments for ``client.create_session``.
        sleep: the host's sleep (tests inject a fake).
    """

    def __init__(
        self,
        session: Any = None,
        *,
        client: Client | None = None,
        action_space: str = "pyautogui",
        require_a11y_tree: bool = False,
        cache_dir: str | Path = "cache",
        reuse_session: bool = False,
        reset_desktop: bool = True,
        session_options: Mapping[str, Any] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if action_space not in ACTION_SPACES:
            raise ConfigError(
                f"action_space {action_space!r}; supported: {', '.join(ACTION_SPACES)}"
            )
        if session is None and client is None:
            raise ConfigError("DesktopEnv needs a session or a client to create one")
        self.action_space = action_space
        self.require_a11y_tree = require_a11y_tree
        self.cache_dir_base = Path(cache_dir)
        self.reuse_session = reuse_session
        self.reset_desktop = reset_desktop
        self.desktop_restored: bool | None = None
        """Whether the last :meth:`reset` restored the desktop's start state (``None``: a
        new session, nothing to restore)."""
        self.session_options = dict(session_options or {})
        self.sleep = sleep
        self.client = client
        self._owned = session is None
        self.session: TaskSession | None = _adapt(session) if session is not None else None
        self.task: TaskConfig | None = None
        self.instruction: str | None = None
        self.ops: TaskOps | None = None
        self.action_history: list[Any] = []
        self.step_no = 0
        self.evaluation: list[dict[str, Any]] = []
        """Per metric of the last :meth:`evaluate`: func, score, result/expected (short),
        and error."""

    # --- lifecycle ----------------------------------------------------------------------

    def _new_session(self) -> TaskSession:
        if self.client is None:
            raise ConfigError("the given session is gone and the env has no client to create one")
        opts = {"guest_control": True, **self.session_options}
        return ClientTaskSession(self.client.create_session(**opts))

    def _drop_session(self) -> None:
        if self.session is not None and self._owned:
            session, self.session = self.session, None
            if isinstance(session, ClientTaskSession):
                session.close()
                session.session.delete()

    def close(self) -> None:
        """Delete the session the env created; a given session stays (only the env's
        connections to it close)."""
        if self.session is not None and not self._owned:
            if isinstance(self.session, ClientTaskSession):
                self.session.close()
                self.session.session.close()
            return
        self._drop_session()

    def __enter__(self) -> DesktopEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- OSWorld's interface -------------------------------------------------------------

    def reset(
        self,
        task_config: Mapping[str, Any] | TaskConfig | str | Path | None = None,
        seed: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Validate the task, (re)start the session as configured, run its setup steps.

        Args:
            task_config: a task (OSWorld's dict, a :class:`TaskConfig`, or a file path);
                ``None`` only resets the episode counters.
            seed, options: accepted for gymnasium's signature; unused.

        Returns:
            The first observation.

        Raises:
            TaskConfigError: the task is invalid or needs what the session cannot do (before
                anything runs in the guest).
            TaskSetupError: a setup step failed (the message names it).
        """
        task = _task(task_config) if task_config is not None else None
        self.step_no = 0
        self.action_history = []
        self.evaluation = []
        if task is not None:
            if self.session is not None and self._owned and not self.reuse_session:
                self._drop_session()
            self.desktop_restored = None
            if self.session is None:
                self.session = self._new_session()
            elif self.task is not None and self.reset_desktop:
                # A kept session that already ran a task: back to its start state.
                self.desktop_restored = self.session.reset_desktop()
                if not self.desktop_restored:
                    self.reset_desktop = False  # cold: it never will be; don't ask again
            cache = self.cache_dir_base / task.id
            if cache.exists():
                shutil.rmtree(cache)
            cache.mkdir(parents=True)
            self.task = task
            self.instruction = task.instruction
            self.ops = TaskOps(self.session, task, cache, sleep=self.sleep)
            self.ops.check_before_start()
            for where, step in [(f"config[{i}]", s) for i, s in enumerate(task.config)]:
                log.info("task %s: %s %s", task.id, where, step.type)
                self.ops.run_step(where, step)
        return self._observation()

    def _observation(self, screenshot_png: bytes | None = None) -> dict[str, Any]:
        session = self._live()
        tree = None
        if self.require_a11y_tree:
            raw = session.a11y_tree()
            tree = raw.get("tree", raw) if isinstance(raw, Mapping) else raw
            import json

            tree = json.dumps(tree, ensure_ascii=False)
        return {
            "screenshot": screenshot_png
            if screenshot_png is not None
            else session.screenshot_png(),
            "accessibility_tree": tree,
            "terminal": None,
            "instruction": self.instruction,
        }

    def _live(self) -> TaskSession:
        if self.session is None:
            raise ConfigError("call reset(task_config) first: the env has no session yet")
        return self.session

    def step(
        self, action: Any, pause: float = 0.0
    ) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        """Carry out one action; then wait ``pause`` seconds and observe.

        Returns:
            ``(observation, reward, done, info)`` as OSWorld: ``reward`` is always 0 (call
            :meth:`evaluate`), ``done`` after ``DONE`` or ``FAIL`` (``info`` ``{"done":
            true}`` / ``{"fail": true}``); a refused action gives ``info["error"]`` =
            ``{"code", "message"}`` and ``done`` false.

        Raises:
            ConfigError: the action has no known shape.
            SessionClosed, BridgeConnectionError: the session or the bridge went away.
        """
        session = self._live()
        self.step_no += 1
        self.action_history.append(action)
        schema, body = action_schema(action, self.action_space)
        info: dict[str, Any] = {}
        done = False
        shot: bytes | None = None
        try:
            result = session.channel(schema).request(body)
        except RemoteError as exc:
            info["error"] = {"code": exc.code, "message": str(exc)}
            result = None
        if isinstance(result, Mapping) and schema != "deskvm":
            done = bool(result.get("done", False))
            info.update(result.get("info") or {})
            encoded = (result.get("observation") or {}).get("screenshot")
            if isinstance(encoded, str):
                try:
                    shot = base64.b64decode(encoded, validate=True)
                except (binascii.Error, ValueError):
                    shot = None
        if pause > 0:
            self.sleep(pause)
            shot = None
        return self._observation(shot), 0.0, done, info

    def evaluate(self) -> float:
        """Score the task: run ``postconfig``, the getters, then the metric(s).

        OSWorld's rules: ``infeasible`` scores 1 exactly when the agent's last action was
        ``FAIL``; otherwise a last ``FAIL`` scores 0; several metrics combine with ``conj``
        (``and``: 0 if any is 0, else the mean; ``or``: 1 if any is 1, else the best).
        A getter or metric that fails scores that metric 0; :attr:`evaluation` says why.

        Raises:
            ConfigError: no task was reset.
            TaskSetupError: a postconfig step failed.
        """
        task, ops = self.task, self.ops
        if task is None or ops is None:
            raise ConfigError("call reset(task_config) before evaluate()")
        ev = task.evaluator
        for i, step in enumerate(ev.postconfig):
            ops.run_step(f"postconfig[{i}]", step)
        last_fail = bool(self.action_history) and _is_special(self.action_history[-1], "FAIL")
        self.evaluation = []
        if ev.funcs == ["infeasible"]:
            score = 1.0 if last_fail else 0.0
            self.evaluation.append({"func": "infeasible", "score": score})
            return score
        if last_fail:
            self.evaluation.append({"func": "FAIL", "score": 0.0, "error": "the agent gave up"})
            return 0.0
        results, expecteds, options = (
            ev.getters("result"),
            ev.getters("expected"),
            ev.metric_options(),
        )
        scores: list[float] = []
        for i, func in enumerate(ev.funcs):
            entry: dict[str, Any] = {"func": func}
            ops.notes = []
            try:
                result_getter, expected_getter = results[i], expecteds[i]
                result = ops.get(result_getter) if result_getter is not None else None
                entry["result"] = _short(result)
                args = [result]
                if expected_getter is not None:
                    expected = ops.get(expected_getter)
                    entry["expected"] = _short(expected)
                    args.append(expected)
                score = float(METRICS[func](*args, **options[i].model_dump(exclude_unset=True)))
            except (DeskvmError, OSError) as exc:  # MetricError too: scored 0, said why
                score = 0.0
                entry["error"] = exc.message if isinstance(exc, DeskvmError) else str(exc)
            if ops.notes:
                entry["notes"] = list(ops.notes)
            entry["score"] = score
            self.evaluation.append(entry)
            scores.append(score)
            if ev.conj == "and" and score == 0.0:
                return 0.0
            if ev.conj == "or" and score == 1.0:
                return 1.0
        return sum(scores) / len(scores) if ev.conj == "and" else max(scores)

    def render(self, mode: str = "rgb_array") -> bytes:
        """The current screen as PNG bytes (OSWorld's ``render``)."""
        if mode != "rgb_array":
            raise ConfigError(f"render mode {mode!r}; supported: rgb_array")
        return self._live().screenshot_png()

    @property
    def recording(self) -> str | None:
        """The session's recording directory (on the server host)."""
        return self.session.recording() if self.session is not None else None


def _adapt(session: Any) -> TaskSession:
    from agent_bridge.client import Session

    if isinstance(session, Session):
        return ClientTaskSession(session)
    return session  # type: ignore[no-any-return]


def _task(task_config: Mapping[str, Any] | TaskConfig | str | Path) -> TaskConfig:
    if isinstance(task_config, TaskConfig):
        return task_config
    if isinstance(task_config, str | Path):
        return load_task(task_config)
    if isinstance(task_config, Mapping):
        return parse_task(task_config)
    raise TaskConfigError(
        f"a task is a dict, a TaskConfig or a path; got {type(task_config).__name__}"
    )


def _short(value: Any, limit: int = 300) -> Any:
    """A value for the results file: short strings and lists, paths as they are."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"... ({len(value)} chars)"
    if isinstance(value, list | tuple):
        return [_short(v, limit // 4 or 20) for v in value[:20]]
    if isinstance(value, Mapping):
        text = repr(dict(value))
        return value if len(text) <= limit else text[:limit] + "..."
    return value
