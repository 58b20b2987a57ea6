"""What an environment must return, checked where its values leave its code, and the
report of one that did not (or raised).

An environment is user code: its ``reset`` may return a dict, its ``step`` a ``None``
reward or a gymnasium 5-tuple, and any of ``reset``, ``step`` and ``close`` may raise.
``guarded_call`` runs one such call and either returns the checked value or an
``EnvErrorReport``: the episode ends as ``env_error`` with that report (kind, env class,
task id, file:line of the user's code, traceback), and the run goes on. The checks run in
the env actor, so a bad value never reaches serialisation or the orchestrator.

This module does not import JAX or Ray.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os
import traceback
from typing import Any, Callable

import numpy as np

from raytunix.types import EpisodeStatus, StepResult

# The largest reward in size a step may return: batches hold rewards as float32, and a
# larger float64 value turns into inf there (and stops the update as non-finite).
MAX_REWARD = float(np.finfo(np.float32).max)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TRACEBACK_CHARS = 20_000  # of one report; a deep recursion's traceback is cut


class EnvContractError(TypeError):
    """An environment returned a value raytunix cannot use (wrong type, non-finite
    reward).

    Attributes:
      problem: short id of what was wrong, for the error's kind (``observation_dict``,
        ``reward_None``, ``reward_nan``, ``result_tuple``, ...).
    """

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class EnvErrorReport:
    """One environment call that raised or returned a value of the wrong kind.

    Attributes:
      kind: ``"<EnvClass>.<method>:<ExceptionType or problem>"``, e.g.
        ``"MyEnv.step:KeyError"`` or ``"MyEnv.step:reward_None"``; errors of one kind are
        reported once in full and counted after.
      env_class: the environment's class, ``module.QualName``.
      method: ``reset``, ``step`` or ``close``.
      task_id: the episode's task.
      message: what went wrong and what to do, one paragraph.
      location: ``file:line`` in the environment's code: where it raised (the innermost
        frame outside raytunix), or the method that returned the bad value.
      traceback: the formatted traceback ("" for a bad value: nothing raised).
    """

    kind: str
    env_class: str
    method: str
    task_id: str
    message: str
    location: str
    traceback: str = ""

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line: the message, where and which task."""
        return f"{self.message} [{self.kind} at {self.location}, task {self.task_id!r}]"


def check_observation(value: Any, env: Any, method: str) -> str:
    """``value`` if it is a ``str`` (the text the agent sees).

    Raises:
      EnvContractError: it is anything else (dict, list, bytes, None, ...), named with a
        hint how to turn it into text.
    """
    if isinstance(value, str):
        return value
    kind = type(value).__name__
    hint = {
        "dict": "json.dumps(...) it",
        "list": "json.dumps(...) it",
        "bytes": "decode it (.decode())",
        "NoneType": "return \"\" for no text",
    }.get(kind, "render it as text")
    raise EnvContractError(
        f"{type(env).__qualname__}.{method} returned a {kind} observation ({value!r:.80}); "
        f"an observation is the text the agent sees: return a str ({hint}).",
        f"observation_{kind}",
    )


def check_reward(value: Any, source: str) -> float:
    """``value`` as a reward: a finite real number (numpy scalars taken) of magnitude at
    most ``MAX_REWARD``, as a float. One rule for every place a reward comes from (an env's
    step, an agent program, a reward function).

    Args:
      source: who returned it, for the message (``"MyEnv.step"``, ``"the program m:run"``).

    Raises:
      EnvContractError: not a real number (``reward_<type>``), not finite
        (``reward_nan`` / ``reward_inf``), or beyond float32 (``reward_out_of_range``).
    """
    real = isinstance(value, numbers.Real) or (
        isinstance(value, np.ndarray)
        and value.ndim == 0
        and (np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating))
    )
    if not real:
        raise EnvContractError(
            f"{source} returned reward {value!r:.80} ({type(value).__name__}); a reward "
            "is a finite real number: return float(...).",
            f"reward_{type(value).__name__}",
        )
    try:
        reward = float(value)
    except OverflowError:  # an int past float64 (10**400)
        reward = math.inf if value > 0 else -math.inf
    if not math.isfinite(reward):
        raise EnvContractError(
            f"{source} returned reward {value!r:.80}; rewards must be finite numbers (a bug "
            "in its verifier).",
            f"reward_{reward!r}",
        )
    if abs(reward) > MAX_REWARD:
        raise EnvContractError(
            f"{source} returned reward {reward!r}; rewards must be at most {MAX_REWARD:g} "
            "in size (batches hold them as float32, where a larger one is inf): scale the "
            "reward down.",
            "reward_out_of_range",
        )
    return reward


def check_step_result(value: Any, env: Any) -> StepResult:
    """``value`` as a clean ``StepResult``: observation ``str``, reward a finite
    ``float`` (numpy scalars taken), ``done`` a ``bool``, ``status`` an ``EpisodeStatus``
    or None, ``info`` a dict.

    Raises:
      EnvContractError: any of these is of another kind, or ``value`` is no
        ``StepResult`` (a gymnasium 5-tuple is named as such).
    """
    name = type(env).__qualname__
    if not isinstance(value, StepResult):
        kind = type(value).__name__
        hint = (
            " (that looks like gymnasium's (observation, reward, terminated, truncated, "
            "info): wrap a gymnasium env with BaseEnv.from_gymnasium)"
            if isinstance(value, tuple) and len(value) == 5
            else ""
        )
        raise EnvContractError(
            f"{name}.step returned a {kind} ({value!r:.80}), not a raytunix.types.StepResult"
            f"{hint}; return StepResult(observation, reward, done, status, info).",
            f"result_{kind}",
        )
    observation = check_observation(value.observation, env, "step")
    reward = check_reward(value.reward, f"{type(env).__qualname__}.step")
    if not isinstance(value.done, (bool, np.bool_)):
        raise EnvContractError(
            f"{name}.step returned done={value.done!r:.80}; it must be a bool.",
            f"done_{type(value.done).__name__}",
        )
    status = value.status
    if status is not None and not isinstance(status, EpisodeStatus):
        try:
            status = EpisodeStatus(status)
        except ValueError:
            raise EnvContractError(
                f"{name}.step returned status={status!r:.80}; it must be None or an "
                f"EpisodeStatus ({', '.join(s.value for s in EpisodeStatus)}).",
                "status",
            ) from None
    if not isinstance(value.info, dict):
        raise EnvContractError(
            f"{name}.step returned info={value.info!r:.80}; it must be a dict.",
            f"info_{type(value.info).__name__}",
        )
    return StepResult(
        observation=observation,
        reward=reward,
        done=bool(value.done),
        status=status,
        info=value.info,
    )


def _user_method(env: Any, method: str) -> Callable | None:
    """The environment's own code behind ``method``: ``BaseEnv.reset``/``step`` call
    ``_initial_observation``/``_step_impl``, unless the class overrides them."""
    cls = type(env)
    inner = {"reset": "_initial_observation", "step": "_step_impl"}.get(method)
    # BaseEnv is found by its shape, not imported (base.py imports this module): the class
    # that defines ``method`` and declares ``inner`` abstract.
    owner = next((k for k in cls.__mro__ if method in vars(k)), None)
    declared = vars(owner).get(inner) if inner and owner is not None else None
    if inner is not None and getattr(declared, "__isabstractmethod__", False):
        method = inner
    return getattr(cls, method, None)


def _definition(env: Any, method: str) -> str:
    fn = _user_method(env, method)
    try:
        fn = inspect.unwrap(fn)
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return f"{type(env).__module__}.{type(env).__qualname__}.{method}"


def _raise_site(error: BaseException, env: Any) -> str:
    """file:line where ``error`` was raised in the environment's code: the innermost frame
    in the env class's file, else the innermost outside raytunix, else the innermost. An
    env whose class says ``runs_outside_code`` (an adapter that runs a user's program)
    looks outside raytunix first: the program's line, not the adapter's call of it."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown"
    try:
        env_file = os.path.abspath(inspect.getsourcefile(type(env)) or "")
    except (TypeError, OSError):
        env_file = ""

    def in_env_file(f: traceback.FrameSummary) -> bool:
        return os.path.abspath(f.filename) == env_file

    def outside(f: traceback.FrameSummary) -> bool:
        return not os.path.abspath(f.filename).startswith(_PACKAGE_DIR + os.sep)

    first, second = (
        (outside, in_env_file)
        if getattr(env, "runs_outside_code", False)
        else (in_env_file, outside)
    )
    for test in (first, second, lambda f: True):
        chosen = [f for f in frames if test(f)]
        if chosen:
            return f"{chosen[-1].filename}:{chosen[-1].lineno}"
    return "unknown"


def report_for(
    error: BaseException, env: Any, method: str, task_id: str, formatted: str | None = None
) -> EnvErrorReport:
    """The report of ``error``, raised by (or, as ``EnvContractError``, found in what was
    returned by) ``env``'s ``method`` during task ``task_id``. ``formatted``: the
    traceback text when the caller already formatted it."""
    cls = type(env)
    env_class = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(error, EnvContractError):
        return EnvErrorReport(
            kind=f"{cls.__qualname__}.{method}:{error.problem}",
            env_class=env_class,
            method=method,
            task_id=task_id,
            message=str(error),
            location=_definition(env, method),
        )
    text = (
        formatted
        if formatted is not None
        else "".join(traceback.format_exception(type(error), error, error.__traceback__))
    )
    return EnvErrorReport(
        kind=f"{cls.__qualname__}.{method}:{type(error).__qualname__}",
        env_class=env_class,
        method=method,
        task_id=task_id,
        message=f"{cls.__qualname__}.{method} raised {type(error).__qualname__}: {error}",
        location=_raise_site(error, env),
        traceback=text[-MAX_TRACEBACK_CHARS:],
    )


def guarded_call(env: Any, method: str, task_id: str, *args: Any) -> Any:
    """Calls ``env.<method>(*args)`` and checks what it returns: the value (``reset``: a
    str; ``step``: a clean ``StepResult``; ``close``: None), or an ``EnvErrorReport`` when
    the call raised, returned a value of the wrong kind, or (``step``) returned status
    ``ENV_ERROR`` (``BaseEnv.step`` catches what ``_step_impl`` raises and keeps its
    report in ``info["env_error_report"]``). Never raises an ``Exception``."""
    try:
        value = getattr(env, method)(*args)
        if method == "reset":
            return check_observation(value, env, "reset")
        if method == "step":
            result = check_step_result(value, env)
            if result.status is EpisodeStatus.ENV_ERROR:
                report = result.info.get("env_error_report")
                if isinstance(report, EnvErrorReport):
                    return report
                cls = type(env)
                said = result.info.get("error") or 'no info["error"] given'
                return EnvErrorReport(
                    kind=f"{cls.__qualname__}.step:status_env_error",
                    env_class=f"{cls.__module__}.{cls.__qualname__}",
                    method="step",
                    task_id=task_id,
                    location=_definition(env, "step"),
                    message=f"{cls.__qualname__}.step returned status env_error: {said}",
                )
            return result
        return None
    except Exception as error:  # noqa: BLE001 - the environment's code: ends this episode
        return report_for(error, env, method, task_id)


class EnvErrorTally:
    """Environment errors by kind: the first report of each kind is kept to be shown in
    full, later ones are counted.

    Args:
      counts: ``{kind: count}`` of a resumed run (``counts``); those kinds are not
        reported again.
    """

    def __init__(self, counts: dict[str, int] | None = None):
        self.counts: dict[str, int] = dict(counts or {})
        self._new: list[EnvErrorReport] = []
        self._since: dict[str, int] = {}

    def add(self, report: EnvErrorReport) -> None:
        if report.kind not in self.counts:
            self._new.append(report)
        self.counts[report.kind] = self.counts.get(report.kind, 0) + 1
        self._since[report.kind] = self._since.get(report.kind, 0) + 1

    def take(self) -> tuple[list[dict[str, str]], dict[str, int]]:
        """``(first reports of kinds not seen before, as JSON; {kind: errors})`` since the
        last ``take``."""
        new, since = [r.to_json() for r in self._new], self._since
        self._new, self._since = [], {}
        return new, since
