"""Task files in OSWorld's format, validated before anything runs. Pure: no I/O but reading.

A task is OSWorld's JSON object (``evaluation_examples/examples/<app>/<id>.json``)::

    {
      "id": "create-hello-file",
      "instruction": "Create the file ~/hello.txt ...",
      "config": [{"type": "execute", "parameters": {"command": ["rm", "-f", "..."]}}],
      "evaluator": {
        "func": "compare_text_file",
        "result": {"type": "vm_file", "path": "/home/desk/hello.txt", "dest": "hello.txt"},
        "expected": {"type": "local_file", "path": "expected/hello.txt"},
        "options": {}
      }
    }

``config`` lists setup steps ``{"type", "parameters"}`` run in order by ``reset``;
``evaluator`` names a metric (``func``, or a list of them joined by ``conj`` ``and`` /
``or``), the getter of the result state (``result``), of the expected state
(``expected``, optional) and the metric's ``options``; ``postconfig`` steps run before
the getters. OSWorld's other fields (``snapshot``, ``source``, ``related_apps``,
``trajectory``, ``proxy``, ``fixed_ip``, ``possibility_of_env_change``) are accepted and
kept; ``max_steps`` caps the agent's steps.

Every step type, getter type and metric deskvm does not implement is refused here, by
name and place (``config[2]: unsupported setup step 'googledrive'; supported: ...``),
together with unknown or ill-typed parameters, before any session is touched: see
:func:`parse_task`. The parameter models below are the reference for what each step,
getter and metric takes; their names are OSWorld's.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from orchestrator.errors import ConfigError, DeskvmError

__all__ = [
    "GETTER_PARAMS",
    "METRIC_NEEDS_EXPECTED",
    "METRIC_OPTIONS",
    "METRIC_RULES",
    "SETUP_PARAMS",
    "EvaluatorConfig",
    "GetterConfig",
    "SetupStep",
    "TaskConfig",
    "TaskConfigError",
    "TaskSetupError",
    "load_task",
    "parse_task",
]


class TaskConfigError(ConfigError):
    """A task file is malformed or uses a step, getter or metric deskvm does not support.

    Raised before the task starts; the message names the task, the place and the name.
    """

    code = "invalid_task"


class TaskSetupError(DeskvmError):
    """A setup step failed while the task was being set up (the message names the step)."""

    code = "task_setup_failed"


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Command = str | list[str]
"""A command as OSWorld writes it: an argv list, or a string (split like a shell would,
or run by ``sh -c`` with ``shell: true``)."""


# --- setup steps ------------------------------------------------------------------------


class LaunchParams(_Params):
    """``launch``: start a program in the background as the desktop user (not waited for)."""

    command: Command = Field(min_length=1)
    shell: bool = False


class OpenParams(_Params):
    """``open``: open a guest file with its default application (``xdg-open``)."""

    path: str = Field(min_length=1)


class UntilParams(_Params):
    """``execute``'s ``until``: repeat the command until one of these holds."""

    returncode: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class ExecuteParams(_Params):
    """``execute`` / ``command``: run a command to completion.

    A non-zero exit code does not fail the step (as in OSWorld); ``stdout`` / ``stderr``
    name files in the task's cache directory that receive the output. ``timeout_s`` is
    deskvm's addition (seconds per run).
    """

    command: Command = Field(min_length=1)
    shell: bool = False
    stdout: str = ""
    stderr: str = ""
    until: UntilParams | None = None
    timeout_s: float = Field(30.0, gt=0, le=600)

    @model_validator(mode="after")
    def _check(self) -> ExecuteParams:
        for name in (self.stdout, self.stderr):
            if name:
                _plain_name(name)
        return self


class SleepParams(_Params):
    """``sleep``: wait ``seconds`` on the host."""

    seconds: float = Field(ge=0, le=600)


class WindowParams(_Params):
    """``activate_window`` / ``close_window``: the first window whose title contains
    ``window_name`` (equals it with ``strict``; matches the class with ``by_class``)."""

    window_name: str = Field(min_length=1)
    strict: bool = False
    by_class: bool = False


class UploadItem(_Params):
    """One file of ``upload_file``: ``local_path`` on this host (relative paths are relative
    to the task file), ``path`` in the guest."""

    local_path: str = Field(min_length=1)
    path: str = Field(min_length=1)


class UploadParams(_Params):
    files: list[UploadItem] = Field(min_length=1)


class DownloadItem(_Params):
    """One file of ``download``: fetched by the guest from ``url`` into ``path``."""

    url: str = Field(pattern=r"^https?://[^/\s]+")
    path: str = Field(min_length=1)


class DownloadParams(_Params):
    files: list[DownloadItem] = Field(min_length=1)


SETUP_PARAMS: Mapping[str, type[_Params]] = {
    "launch": LaunchParams,
    "open": OpenParams,
    "execute": ExecuteParams,
    "command": ExecuteParams,
    "sleep": SleepParams,
    "activate_window": WindowParams,
    "close_window": WindowParams,
    "upload_file": UploadParams,
    "download": DownloadParams,
}
"""Every setup step type deskvm runs, with the parameters it takes (OSWorld's names)."""


# --- getters ----------------------------------------------------------------------------


def _plain_name(value: str) -> str:
    if value in ("", ".", "..") or "/" in value or "\\" in value or "\0" in value:
        raise ValueError(f"{value!r} is not a plain file name (it names a file in the cache)")
    return value


class VmFileParams(_Params):
    """``vm_file``: copy guest file(s) into the task's cache directory; the metric gets the
    local path (``None`` if the guest has no such file). With ``multi``, ``path`` and
    ``dest`` are lists and ``gives`` picks which paths the metric gets."""

    path: str | list[str]
    dest: str | list[str]
    multi: bool = False
    gives: list[int] = Field(default_factory=lambda: [0])

    @model_validator(mode="after")
    def _check(self) -> VmFileParams:
        paths = self.path if isinstance(self.path, list) else [self.path]
        dests = self.dest if isinstance(self.dest, list) else [self.dest]
        if self.multi != isinstance(self.path, list) or self.multi != isinstance(self.dest, list):
            raise ValueError("path and dest are lists exactly when multi is true")
        if len(paths) != len(dests) or not paths:
            raise ValueError("path and dest need the same (non-zero) number of entries")
        for d in dests:
            _plain_name(d)
        for g in self.gives:
            if not 0 <= g < len(paths):
                raise ValueError(f"gives index {g} out of range for {len(paths)} file(s)")
        return self


class CommandGetterParams(_Params):
    """``vm_command_line`` (stdout) / ``vm_command_error`` (stderr) of a command."""

    command: Command = Field(min_length=1)
    shell: bool = False
    timeout_s: float = Field(30.0, gt=0, le=600)


class A11yParams(_Params):
    """``accessibility_tree``: the AT-SPI tree (JSON text) of the desktop, or of the first
    window whose title contains ``window_name``."""

    window_name: str | None = None


class WindowListParams(_Params):
    """``window_list``: the guest's windows (``id``, ``title``, ``class``, geometry,
    ``focused``); with ``field`` only that field of each window (e.g. the titles)."""

    field: Literal["id", "title", "class", "focused"] | None = None
    focused_only: bool = False


class NoParams(_Params):
    """Takes no parameters."""


class RuleParams(_Params):
    """``rule``: the literal ``rules`` object, given to the metric as is."""

    rules: Any


class LocalFileParams(_Params):
    """``local_file``: a file on this host (relative to the task file); the metric gets its
    path. Stands in for OSWorld's ``cloud_file`` offline."""

    path: str = Field(min_length=1)


GETTER_PARAMS: Mapping[str, type[_Params]] = {
    "vm_file": VmFileParams,
    "vm_command_line": CommandGetterParams,
    "vm_command_error": CommandGetterParams,
    "accessibility_tree": A11yParams,
    "window_list": WindowListParams,
    "clipboard": NoParams,
    "rule": RuleParams,
    "local_file": LocalFileParams,
}
"""Every getter type deskvm has, with its parameters (OSWorld's names where OSWorld has the
getter; ``window_list``, ``clipboard`` and ``local_file`` are deskvm's)."""


# --- metrics ----------------------------------------------------------------------------


class TextOptions(_Params):
    """``compare_text_file``: ``ignore_blanks`` collapses whitespace runs, ``ignore_case``."""

    ignore_blanks: bool = False
    ignore_case: bool = False


class CsvOptions(_Params):
    """``compare_csv``: cells compared as parsed by :mod:`csv`; ``strict: false`` strips
    cells, ``ignore_case`` lower-cases them."""

    strict: bool = True
    ignore_case: bool = False


class TableRule(_Params):
    """One ``compare_table`` rule: ``sheet_name`` (same sheet names in order) or
    ``sheet_data`` (same cell values of sheet ``sheet_idx0`` of the result and
    ``sheet_idx1`` of the expected file: a 0-based index or a sheet name)."""

    type: Literal["sheet_name", "sheet_data"]
    sheet_idx0: int | str = 0
    sheet_idx1: int | str = 0


class TableOptions(_Params):
    """``compare_table`` (XLSX through openpyxl, or CSV): no ``rules`` compares every
    sheet's values and the sheet names."""

    rules: list[TableRule] | None = None


class LiteralOptions(_Params):
    """``literal_match``: compare as ``str`` or as a ``list`` of strings."""

    type: Literal["str", "list"] = "str"
    ignore_case: bool = False


class JsonFileOptions(_Params):
    """``check_json`` takes its ``expect`` / ``unexpect`` rules from the expected getter."""


class NoOptions(_Params):
    """Takes no options."""


# The rule objects metrics take from a ``rule`` getter, checked before the task starts.


class _Rules(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExpectedRule(_Rules):
    """``{"expected": value}`` (``exact_match``, ``match_in_list``, ``is_in_list``,
    ``check_direct_json_object``)."""

    expected: Any


class IncludeExcludeRule(_Rules):
    """``check_include_exclude``: what must and must not be in the result."""

    include: list[Any] = Field(default_factory=list)
    exclude: list[Any] = Field(default_factory=list)


class JsonRule(_Rules):
    """One ``check_json`` rule: the value at ``key`` (a path) compared to ``ref``."""

    key: list[str | int] = Field(min_length=1)
    method: Literal["eq", "ne", "lt", "le", "gt", "ge", "re"] = "eq"
    ref: Any = None


class JsonRules(_Rules):
    """``check_json``: every ``expect`` rule holds and no ``unexpect`` rule does."""

    expect: list[JsonRule] = Field(default_factory=list)
    unexpect: list[JsonRule] = Field(default_factory=list)


class A11yRule(_Rules):
    """One ``check_accessibility_tree`` rule: elements found by ``xpath`` (ElementTree's
    XPath subset over OSWorld's XML form of the tree); with ``text``, the best element text
    must equal it (``exact``) or score its similarity."""

    xpath: str = Field(min_length=1)
    text: str | None = None
    exact: bool = True


METRIC_RULES: Mapping[str, Any] = {
    "exact_match": ExpectedRule,
    "match_in_list": ExpectedRule,
    "is_in_list": ExpectedRule,
    "check_direct_json_object": ExpectedRule,
    "check_include_exclude": IncludeExcludeRule,
    "check_json": JsonRules,
    "check_accessibility_tree": list[A11yRule],
}
"""The shape of the ``rules`` a metric takes when its expected getter is ``rule``."""


METRIC_OPTIONS: Mapping[str, type[_Params]] = {
    "exact_match": NoOptions,
    "match_in_list": NoOptions,
    "is_in_list": NoOptions,
    "check_include_exclude": NoOptions,
    "literal_match": LiteralOptions,
    "compare_text_file": TextOptions,
    "compare_csv": CsvOptions,
    "compare_table": TableOptions,
    "check_json": JsonFileOptions,
    "check_direct_json_object": NoOptions,
    "check_accessibility_tree": NoOptions,
    "infeasible": NoOptions,
}
"""Every metric (``func``) deskvm evaluates, with its options (OSWorld's names)."""

METRIC_NEEDS_EXPECTED: frozenset[str] = frozenset(METRIC_OPTIONS) - {"infeasible"}
"""Metrics called as ``metric(result, expected, **options)``: they need an ``expected``."""


# --- task -------------------------------------------------------------------------------


def _supported(names: Mapping[str, object]) -> str:
    return ", ".join(sorted(names))


class SetupStep(BaseModel):
    """One setup step ``{"type", "parameters"}``; ``params`` is the validated parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    _params: _Params = PrivateAttr()

    @model_validator(mode="after")
    def _check(self) -> SetupStep:
        model = SETUP_PARAMS.get(self.type)
        if model is None:
            raise ValueError(
                f"unsupported setup step {self.type!r}; supported: {_supported(SETUP_PARAMS)}"
            )
        self._params = _nested(model, self.parameters, f"setup step {self.type!r}")
        return self

    @property
    def params(self) -> Any:
        """The parameters as their model (e.g. :class:`LaunchParams`)."""
        return self._params


class GetterConfig(BaseModel):
    """One getter ``{"type": ..., ...parameters}`` (flat, as OSWorld writes it)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str
    _params: _Params = PrivateAttr()

    @model_validator(mode="after")
    def _check(self) -> GetterConfig:
        model = GETTER_PARAMS.get(self.type)
        if model is None:
            raise ValueError(
                f"unsupported getter {self.type!r}; supported: {_supported(GETTER_PARAMS)}"
            )
        self._params = _nested(model, dict(self.model_extra or {}), f"getter {self.type!r}")
        return self

    @property
    def params(self) -> Any:
        """The parameters as their model (e.g. :class:`VmFileParams`)."""
        return self._params


def _nested(model: type[_Params], data: dict[str, Any], what: str) -> _Params:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{what}: {_describe(exc)}") from None


def _as_list(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, list) else [value] * n


class EvaluatorConfig(BaseModel):
    """``evaluator``: metric(s), getters, options, postconfig (OSWorld's fields).

    With a list ``func``, ``result``, ``expected`` (if present) and ``options`` (if a list)
    are lists of the same length, entry ``i`` for metric ``i``; ``null`` entries are
    allowed where a metric takes no expected state or options.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    func: str | list[str] = Field(min_length=1)
    conj: Literal["and", "or"] = "and"
    result: GetterConfig | list[GetterConfig | None] | None = None
    expected: GetterConfig | list[GetterConfig | None] | None = None
    options: dict[str, Any] | list[dict[str, Any] | None] | None = None
    postconfig: list[SetupStep] = Field(default_factory=list)
    _options: list[_Params] = PrivateAttr()

    @model_validator(mode="after")
    def _check(self) -> EvaluatorConfig:
        funcs = self.funcs
        n = len(funcs)
        for name in funcs:
            if name not in METRIC_OPTIONS:
                raise ValueError(
                    f"unsupported evaluator func {name!r}; supported: {_supported(METRIC_OPTIONS)}"
                )
        for field in ("result", "expected", "options"):
            value = getattr(self, field)
            if isinstance(value, list) and len(value) != n:
                raise ValueError(f"{field} has {len(value)} entries for {n} func(s)")
        if isinstance(self.func, str) and any(
            isinstance(getattr(self, f), list) for f in ("result", "expected", "options")
        ):
            raise ValueError("result, expected and options are lists only when func is a list")
        results = _as_list(self.result, n)
        expecteds = _as_list(self.expected, n)
        options = _as_list(self.options, n)
        parsed: list[_Params] = []
        for i, name in enumerate(funcs):
            where = f"func {name!r}" if n == 1 else f"func[{i}] {name!r}"
            if name != "infeasible" and results[i] is None:
                raise ValueError(f"{where} needs a result getter")
            if name in METRIC_NEEDS_EXPECTED and expecteds[i] is None:
                raise ValueError(f"{where} needs an expected getter")
            parsed.append(_nested(METRIC_OPTIONS[name], options[i] or {}, f"{where} options"))
            exp = expecteds[i]
            if name in METRIC_RULES and exp is not None and exp.type == "rule":
                try:
                    TypeAdapter(METRIC_RULES[name]).validate_python(exp.params.rules)
                except ValidationError as exc:
                    raise ValueError(f"{where} rules: {_describe(exc)}") from None
        self._options = parsed
        return self

    @property
    def funcs(self) -> list[str]:
        """The metric names, as a list."""
        return [self.func] if isinstance(self.func, str) else list(self.func)

    def getters(self, field: Literal["result", "expected"]) -> list[GetterConfig | None]:
        """The result or expected getters, one per metric."""
        return _as_list(getattr(self, field), len(self.funcs))

    def metric_options(self) -> list[_Params]:
        """The validated options, one per metric."""
        return list(self._options)


class TaskConfig(BaseModel):
    """One task in OSWorld's format (see the module docstring). Unknown OSWorld fields are
    kept; ``path`` is the file it came from (for relative local paths), if any."""

    model_config = ConfigDict(extra="allow", frozen=True)

    id: str = Field(min_length=1, max_length=200)
    instruction: str = Field(min_length=1)
    config: list[SetupStep] = Field(default_factory=list)
    evaluator: EvaluatorConfig
    snapshot: str | None = None
    source: str | None = None
    related_apps: list[str] = Field(default_factory=list)
    max_steps: int | None = Field(None, ge=1, le=1000)
    path: str | None = Field(None, exclude=True)

    @property
    def base_dir(self) -> Path:
        """Where relative local paths of this task resolve: its file's directory, else the
        current directory."""
        return Path(self.path).parent if self.path else Path.cwd()

    def local(self, path: str) -> Path:
        """A local path of this task (``upload_file``'s ``local_path``, ``local_file``)."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.base_dir / p

    def steps(self) -> list[tuple[str, SetupStep]]:
        """Every setup step with its place (``config[i]``, ``postconfig[i]``)."""
        out = [(f"config[{i}]", s) for i, s in enumerate(self.config)]
        out += [(f"postconfig[{i}]", s) for i, s in enumerate(self.evaluator.postconfig)]
        return out


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown parameter"
        elif err["type"] == "missing":
            msg = "missing"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_task(data: Mapping[str, Any], *, path: str | Path | None = None) -> TaskConfig:
    """Validate one task object, including every step, getter, metric and local file.

    Args:
        data: the task's JSON object.
        path: the file it came from (relative local paths resolve against its directory).

    Returns:
        The validated task.

    Raises:
        TaskConfigError: the object is not a task, a step / getter / metric is unsupported
            or has bad parameters, or a local file it names does not exist. The message
            starts with the task id (or file) and names the place.
    """
    label = str(data.get("id") or path or "task") if isinstance(data, Mapping) else str(path)
    if not isinstance(data, Mapping):
        raise TaskConfigError(f"{label}: a task is a JSON object, got {type(data).__name__}")
    try:
        task = TaskConfig.model_validate({**data, "path": str(path) if path else None})
    except ValidationError as exc:
        raise TaskConfigError(f"{label}: {_describe(exc)}") from None
    for where, step in task.steps():
        if isinstance(step.params, UploadParams):
            for j, item in enumerate(step.params.files):
                local = task.local(item.local_path)
                if not local.is_file():
                    raise TaskConfigError(
                        f"{label}: {where} upload_file files[{j}]: no local file {local}"
                    )
        for j, item in enumerate(getattr(step.params, "files", []) or []):
            if not posixpath.isabs(item.path) and not item.path.startswith("~"):
                raise TaskConfigError(
                    f"{label}: {where} {step.type} files[{j}]: guest path {item.path!r} must be"
                    " absolute (or start with ~)"
                )
    field: Literal["result", "expected"]
    for field in ("result", "expected"):
        for getter in task.evaluator.getters(field):
            if getter is not None and isinstance(getter.params, LocalFileParams):
                local = task.local(getter.params.path)
                if not local.is_file():
                    raise TaskConfigError(f"{label}: evaluator {field} local_file: no file {local}")
    return task


def load_task(path: str | Path) -> TaskConfig:
    """Read and validate one task file (JSON).

    Raises:
        TaskConfigError: unreadable, not JSON, or invalid (see :func:`parse_task`).
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TaskConfigError(f"{p}: cannot read the task file: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise TaskConfigError(f"{p}: not JSON: {exc}") from exc
    return parse_task(data, path=p)
