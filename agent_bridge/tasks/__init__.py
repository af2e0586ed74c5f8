"""Task suites in OSWorld's format: an OSWorld-shaped environment, setup, evaluation, runner.

- :mod:`~agent_bridge.tasks.model`: task files validated before anything runs.
- :mod:`~agent_bridge.tasks.metrics`: comparators (pure).
- :mod:`~agent_bridge.tasks.guest`: the session seam and its in-package fake.
- :mod:`~agent_bridge.tasks.ops`: setup steps and getters over the guest control plane.
- :mod:`~agent_bridge.tasks.env`: :class:`DesktopEnv` (``reset`` / ``step`` / ``evaluate``).
- :mod:`~agent_bridge.tasks.runner`: ``deskvm task run`` without the CLI.

See ``docs/tasks.md``.
"""

from __future__ import annotations

from agent_bridge.tasks.env import ACTION_SPACES, DesktopEnv, action_schema
from agent_bridge.tasks.guest import ClientTaskSession, FakeTaskSession, TaskSession
from agent_bridge.tasks.metrics import METRICS, MetricError
from agent_bridge.tasks.model import (
    GETTER_PARAMS,
    METRIC_OPTIONS,
    SETUP_PARAMS,
    TaskConfig,
    TaskConfigError,
    TaskSetupError,
    load_task,
    parse_task,
)
from agent_bridge.tasks.runner import (
    DoneAgent,
    RunReport,
    TaskOutcome,
    collect_tasks,
    load_agent,
    run_tasks,
)

__all__ = [
    "ACTION_SPACES",
    "GETTER_PARAMS",
    "METRICS",
    "METRIC_OPTIONS",
    "SETUP_PARAMS",
    "ClientTaskSession",
    "DesktopEnv",
    "DoneAgent",
    "FakeTaskSession",
    "MetricError",
    "RunReport",
    "TaskConfig",
    "TaskConfigError",
    "TaskOutcome",
    "TaskSession",
    "TaskSetupError",
    "action_schema",
    "collect_tasks",
    "load_agent",
    "load_task",
    "parse_task",
    "run_tasks",
]
