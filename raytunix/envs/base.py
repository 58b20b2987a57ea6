"""The environment contract, and a gymnasium adapter for text environments.

An environment turns actions into observations and rewards::

    observation = env.reset(task)      # str shown to the agent as the user message
    step = env.step(action)            # StepResult; never raises
    env.close()

A new environment subclasses ``BaseEnv`` and implements ``_initial_observation`` and
``_step_impl``; it may bring its own tasks (``tasks``). If ``_step_impl`` raises, ``step``
ends the episode with status ``ENV_ERROR`` instead: one bad step ends one episode, never
the run.

Both ways to gymnasium: ``BaseEnv.from_gymnasium(env_or_id)`` runs a text
``gymnasium.Env`` as a raytunix environment, and ``GymTextEnv`` (registered for every
raytunix environment as ``raytunix/<name>``) runs a raytunix environment behind the
gymnasium API.
"""

from __future__ import annotations

import abc
import string
import traceback
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import gymnasium

from raytunix.agents.parsers import parse_action
from raytunix.envs.contract import report_for
from raytunix.types import Action, EpisodeStatus, StepResult, Task

if TYPE_CHECKING:
    from raytunix.envs.gymnasium_env import GymnasiumEnv


class BaseEnv(abc.ABC):
    """One environment instance, one episode at a time.

    Attributes:
      default_agent: name of the agent (``raytunix.agents.make_agent``) that speaks this
        environment's action format.
      uses_sandbox: its tools run code (``raytunix.sandbox``); a run then starts a pool of
        sandbox actors (config section ``sandbox``) that the tools reach by
        ``raytunix.sandbox.connect()``.
      task: the current episode's task (None before ``reset``).
    """

    default_agent: ClassVar[str]
    uses_sandbox: ClassVar[bool] = False

    def __init__(self) -> None:
        self.task: Task | None = None
        self._done = True

    def reset(self, task: Task) -> str:
        """Starts an episode on ``task`` and returns the first observation (the text of
        the user message). Exceptions from ``_initial_observation`` propagate."""
        self.task = task
        self._done = False
        return self._initial_observation(task)

    def step(self, action: Action) -> StepResult:
        """Applies ``action``; never raises.

        Returns:
          the subclass's ``StepResult``; or, if it raised (or the episode is not
          running), ``StepResult(done=True, status=ENV_ERROR, info={"error": ...,
          "traceback": ..., "env_error_report": EnvErrorReport})`` with reward 0
          (``raytunix.envs.contract``).
        """
        try:
            if self._done:
                raise RuntimeError(
                    f"{type(self).__name__}.step called with no episode running; "
                    "call reset(task) first."
                )
            result = self._step_impl(action)
        except Exception as e:  # noqa: BLE001 - any failure ends this episode only
            formatted = traceback.format_exc()
            task_id = self.task.task_id if self.task is not None else ""
            result = StepResult(
                observation="",
                done=True,
                status=EpisodeStatus.ENV_ERROR,
                info={"error": repr(e), "traceback": formatted,
                      "env_error_report": report_for(e, self, "step", task_id, formatted)},
            )
        # A result of the wrong kind (checked by the caller, raytunix.envs.contract) ends it.
        self._done = result.done if isinstance(result, StepResult) else True
        return result

    def close(self) -> None:
        """Releases resources held by the environment (none by default)."""

    def tasks(self, split: str, size: int, seed: int) -> Sequence[Task] | None:
        """The tasks this environment brings, or None to train on the run's dataset.

        Called once per split in the driver, on an instance built with the run's
        ``env.kwargs``. Task ids must be unique within a split (the rollout's exactly-once
        accounting keys on them) and held-out tasks should not appear in train.

        Args:
          split: "train" or "heldout".
          size: how many tasks to return (``data.train_size`` / ``data.heldout_size``).
          seed: ``data.seed``; the same seed must give the same tasks.
        """
        return None

    @staticmethod
    def from_gymnasium(env_or_id: "gymnasium.Env | str",
                       make_kwargs: dict[str, Any] | None = None) -> "GymnasiumEnv":
        """A text ``gymnasium.Env`` (``Text`` observation and action spaces) as a raytunix
        environment; see ``raytunix.envs.gymnasium_env.GymnasiumEnv``.

        Args:
          env_or_id: an environment instance, a registered gymnasium id (``"module:Id-v0"``
            imports ``module`` first, as ``gymnasium.make`` does), or an import path
            ``package.module:EnvClass`` of a ``gymnasium.Env`` subclass.
          make_kwargs: keyword arguments for ``gymnasium.make`` or the class.

        Raises:
          TypeError: it is not a gymnasium environment, or a space is not ``Text``.
          ValueError: the id is not registered or the import path cannot be imported.
        """
        from raytunix.envs.gymnasium_env import GymnasiumEnv

        return GymnasiumEnv(env_or_id, make_kwargs)

    @abc.abstractmethod
    def _initial_observation(self, task: Task) -> str:
        """Sets up the episode for ``task`` and returns the first observation."""

    @abc.abstractmethod
    def _step_impl(self, action: Action) -> StepResult:
        """Applies one action; may raise (``step`` turns that into ``ENV_ERROR``)."""


class GymTextEnv(gymnasium.Env):
    """A ``BaseEnv`` behind the gymnasium API, with text observations and actions.

    ``reset(seed, options)`` picks a task (``options["task"]``, or one of ``tasks``
    drawn with ``self.np_random``); ``step(text)`` parses the model text into an
    ``Action`` and returns ``(observation, reward, terminated, truncated, info)``, with
    ``truncated`` for episodes that ran out of turns or time and ``info["status"]`` the
    ``EpisodeStatus`` value. ``gymnasium.make("raytunix/<name>")`` builds one for every
    registered raytunix environment (``raytunix.envs.make_gym_env``).

    Args:
      env: the environment instance to wrap.
      tasks: tasks to draw from on reset.
      parse: model text -> Action (default: tool calls or an answer).
      max_length: longest observation/action text, characters (> 0).
      charset: characters allowed in observations and actions (default printable ASCII).

    Raises:
      TypeError: ``env`` is not a ``BaseEnv`` instance (a class, a gymnasium env...), a
        task is not a ``raytunix.types.Task``, or ``parse`` is not callable.
      ValueError: ``tasks`` is empty or ``max_length`` is not positive.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        env: BaseEnv,
        tasks: Sequence[Task],
        parse: Callable[[str], Action] = parse_action,
        max_length: int = 8192,
        charset: str = string.printable,
    ) -> None:
        if isinstance(env, type) and issubclass(env, BaseEnv):
            raise TypeError(f"GymTextEnv needs an environment instance, got the class "
                            f"{env.__qualname__}; pass {env.__qualname__}(...) instead.")
        if not isinstance(env, BaseEnv):
            hint = (" It already is a gymnasium environment; to run it in raytunix use "
                    "BaseEnv.from_gymnasium(env)." if isinstance(env, gymnasium.Env) else "")
            raise TypeError(f"GymTextEnv wraps a raytunix BaseEnv instance, got "
                            f"{type(env).__qualname__}.{hint}")
        if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence):
            raise TypeError(f"tasks must be a sequence of raytunix.types.Task, got "
                            f"{type(tasks).__qualname__}.")
        if not tasks:
            raise ValueError("GymTextEnv needs at least one task to draw from on reset; got none.")
        for i, task in enumerate(tasks):
            _check_task(task, f"tasks[{i}]")
        if not callable(parse):
            raise TypeError(f"parse must be a callable str -> Action, got {parse!r}.")
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int (characters), got {max_length!r}.")
        self.env = env
        self.tasks = list(tasks)
        self.parse = parse
        self.observation_space = gymnasium.spaces.Text(max_length, min_length=0, charset=charset)
        self.action_space = gymnasium.spaces.Text(max_length, min_length=0, charset=charset)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is None:
            task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        _check_task(task, 'options["task"]')
        observation = self.env.reset(task)
        if not isinstance(observation, str):
            raise TypeError(f"{type(self.env).__qualname__}.reset returned "
                            f"{type(observation).__qualname__}, not str; "
                            "_initial_observation must return the text shown to the agent.")
        return observation, {"task_id": task.task_id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"GymTextEnv.step takes the model's text (str), got "
                            f"{type(action).__qualname__}: {action!r:.80}.")
        result = self.env.step(self.parse(action))
        truncated = result.status in (EpisodeStatus.TRUNCATED, EpisodeStatus.TIMEOUT)
        info = dict(result.info)
        if result.status is not None:
            info["status"] = result.status.value
        return result.observation, result.reward, result.done and not truncated, truncated, info

    def close(self) -> None:
        self.env.close()


def _check_task(task: Any, where: str) -> None:
    if not isinstance(task, Task):
        raise TypeError(f"{where} is {type(task).__qualname__} ({task!r:.80}), not a "
                        "raytunix.types.Task; build tasks as Task(task_id, question, answer).")
