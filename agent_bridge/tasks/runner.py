"""Run task files with an agent: OSWorld's ``lib_run_single`` loop, results on disk.

An agent is OSWorld's shape: an object with ``predict(instruction, obs) -> (response,
actions)`` and optionally ``reset()``; ``--agent MODULE:CALLABLE`` names a callable that
returns one (a class, or a factory), ``MODULE`` being a dotted module or a ``.py`` file.
For each task the runner resets the env, then asks the agent for actions and steps them
until ``done`` or ``max_steps`` predictions, then evaluates. Everything is validated
before the first session starts.

Output (``out_dir``): ``results.json`` (``{"agent", "started_at", "tasks": [...],
"summary": {...}}``), ``summary.txt``, and ``<task id>/final.png`` (the last screen).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from agent_bridge.client import BridgeConnectionError, RemoteError
from agent_bridge.tasks.env import DesktopEnv
from agent_bridge.tasks.model import TaskConfig, TaskConfigError, load_task
from orchestrator.errors import ConfigError, DeskvmError, SessionClosed

__all__ = [
    "DEFAULT_MAX_STEPS",
    "Agent",
    "DoneAgent",
    "RunReport",
    "TaskOutcome",
    "collect_tasks",
    "load_agent",
    "run_tasks",
]

DEFAULT_MAX_STEPS = 15
"""OSWorld's default number of agent predictions per task."""


class Agent(Protocol):
    """OSWorld's agent shape."""

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[Any, list[Any]]:
        """The model's response and the actions to run (strings or dicts)."""
        ...


class DoneAgent:
    """The default agent: does nothing and says ``DONE`` (a task it passes is a broken task)."""

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[Any, list[Any]]:
        return "nothing to do", ["DONE"]


@dataclass
class TaskOutcome:
    """One task's result (a row of ``results.json``)."""

    id: str
    instruction: str
    path: str | None
    score: float = 0.0
    passed: bool = False
    steps: int = 0
    done: bool = False
    agent_failed: bool = False
    error: dict[str, str] | None = None
    duration_s: float = 0.0
    session_id: str | None = None
    recording: str | None = None
    screenshot: str | None = None
    evaluation: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RunReport:
    """All tasks' outcomes and where they were written."""

    agent: str
    started_at: str
    outcomes: list[TaskOutcome]
    results_path: Path | None = None

    @property
    def summary(self) -> dict[str, Any]:
        """``total``, ``passed``, ``failed``, ``errors``, ``mean_score``, ``duration_s``."""
        n = len(self.outcomes)
        return {
            "total": n,
            "passed": sum(o.passed for o in self.outcomes),
            "failed": sum(not o.passed and o.error is None for o in self.outcomes),
            "errors": sum(o.error is not None for o in self.outcomes),
            "mean_score": round(sum(o.score for o in self.outcomes) / n, 4) if n else 0.0,
            "duration_s": round(sum(o.duration_s for o in self.outcomes), 1),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "started_at": self.started_at,
            "tasks": [asdict(o) for o in self.outcomes],
            "summary": self.summary,
        }


def collect_tasks(paths: Iterable[str | Path]) -> list[TaskConfig]:
    """Load every task file (a directory means its ``*.json`` files, sorted), all validated.

    Raises:
        TaskConfigError: one line per invalid file (all of them, not just the first), or
            no task at all, or two tasks with one id.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    tasks, problems = [], []
    for f in files:
        try:
            tasks.append(load_task(f))
        except TaskConfigError as exc:
            problems.append(exc.message)
    seen: dict[str, str | None] = {}
    for t in tasks:
        if t.id in seen:
            problems.append(f"{t.path}: task id {t.id!r} is also the id of {seen[t.id]}")
        seen[t.id] = t.path
    if problems:
        raise TaskConfigError("\n".join(problems))
    if not tasks:
        raise TaskConfigError("no task files found")
    return tasks


def load_agent(spec: str) -> Callable[[], Any]:
    """The agent factory named ``MODULE:CALLABLE`` (``MODULE`` dotted, or a ``.py`` path).

    Raises:
        ConfigError: malformed spec, module not importable, no such callable.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--agent {spec!r}: expected MODULE:CALLABLE (or path/file.py:CALLABLE)")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            name = f"deskvm_agent_{path.stem}"
            loader_spec = importlib.util.spec_from_file_location(name, path)
            if loader_spec is None or loader_spec.loader is None or not path.is_file():
                raise ConfigError(f"--agent {spec!r}: no Python file {path}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--agent {spec!r}: cannot import {module_name}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"--agent {spec!r}: {module_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


class AgentError(Exception):
    """The agent's own code raised (the cause is the agent's exception)."""


def _agent_call(func: Callable[..., Any], *args: Any) -> Any:
    try:
        return func(*args)
    except Exception as exc:  # whatever the agent's code raises
        raise AgentError(str(exc)) from exc


def _error(exc: BaseException) -> dict[str, str]:
    code = getattr(exc, "code", None) or type(exc).__name__
    message = exc.message if isinstance(exc, DeskvmError) else str(exc)
    return {"code": str(code), "message": message}


def run_one(
    env: DesktopEnv, agent: Any, task: TaskConfig, *, max_steps: int, out_dir: Path | None
) -> TaskOutcome:
    """Run one task in ``env`` with ``agent`` (see the module docstring)."""
    outcome = TaskOutcome(id=task.id, instruction=task.instruction, path=task.path)
    t0 = time.monotonic()
    obs: dict[str, Any] | None = None
    try:
        obs = env.reset(task_config=task)
        outcome.session_id = env.session.id if env.session is not None else None
        outcome.recording = env.recording
        if hasattr(agent, "reset"):
            _agent_call(agent.reset)
        predictions = 0
        limit = task.max_steps or max_steps
        while not outcome.done and predictions < limit:
            predictions += 1
            _response, actions = _agent_call(agent.predict, task.instruction, obs)
            for action in actions or []:
                obs, _reward, done, info = env.step(action)
                outcome.steps += 1
                if info.get("fail"):
                    outcome.agent_failed = True
                if done:
                    outcome.done = True
                    break
        outcome.score = float(env.evaluate())
        outcome.evaluation = env.evaluation
        outcome.passed = outcome.score >= 1.0
    except (SessionClosed, BridgeConnectionError) as exc:
        outcome.error = _error(exc)
        env.close()  # the next task starts a new session
        env.session = None
    except (DeskvmError, RemoteError) as exc:
        outcome.error = _error(exc)
    except AgentError as exc:  # the agent's own code: report it, go on with the next task
        cause = exc.__cause__
        outcome.error = {"code": "agent_error", "message": f"{type(cause).__name__}: {cause}"}
    outcome.duration_s = round(time.monotonic() - t0, 2)
    if out_dir is not None and obs is not None and isinstance(obs.get("screenshot"), bytes):
        shot = out_dir / task.id / "final.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        shot.write_bytes(obs["screenshot"])
        outcome.screenshot = str(shot)
    return outcome


def run_tasks(
    tasks: Sequence[TaskConfig],
    agent_factory: Callable[[], Any],
    *,
    env: DesktopEnv,
    agent_name: str = "agent",
    max_steps: int = DEFAULT_MAX_STEPS,
    out_dir: Path | None = None,
    on_task: Callable[[TaskConfig], None] | None = None,
    on_outcome: Callable[[TaskOutcome], None] | None = None,
) -> RunReport:
    """Run every task in order in ``env``; write ``results.json`` and ``summary.txt``.

    Args:
        tasks: validated tasks (:func:`collect_tasks`).
        agent_factory: called once; returns the agent.
        env: the environment (its session policy: fresh per task or reused).
        agent_name: for the results file.
        max_steps: predictions per task unless the task sets ``max_steps``.
        out_dir: where results go; ``None``: nowhere.
        on_task, on_outcome: progress callbacks (before and after each task).

    Returns:
        The report (``results_path`` set when written).
    """
    agent = agent_factory()
    report = RunReport(agent_name, datetime.now(UTC).isoformat(timespec="seconds"), [])
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        if on_task is not None:
            on_task(task)
        outcome = run_one(env, agent, task, max_steps=max_steps, out_dir=out_dir)
        report.outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    if out_dir is not None:
        report.results_path = out_dir / "results.json"
        report.results_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        (out_dir / "summary.txt").write_text(summary_text(report))
    return report


def summary_text(report: RunReport) -> str:
    """A plain-text table of the outcomes and the totals."""
    lines = [f"agent: {report.agent}  started: {report.started_at}", ""]
    for o in report.outcomes:
        status = "PASS" if o.passed else ("ERROR" if o.error else "FAIL")
        why = f"  {o.error['code']}: {o.error['message']}" if o.error else ""
        lines.append(
            f"{status:<6} {o.score:4.2f}  {o.id}  ({o.steps} steps, {o.duration_s} s){why}"
        )
        if o.recording:
            lines.append(f"       recording: {o.recording}")
    s: Mapping[str, Any] = report.summary
    lines += ["", f"{s['passed']}/{s['total']} passed, {s['failed']} failed, {s['errors']} errors,"
              f" mean score {s['mean_score']}, {s['duration_s']} s"]  # fmt: skip
    return "\n".join(lines) + "\n"
