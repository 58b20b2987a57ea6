"""The environment contract, and a gymnasium adapter for text environments.

An environment turns actions into observations and rewards::

    observation = env.reset(task)      # str shown to the agent as the user message
    step = env.step(action)            # StepResult; never raises
    env.close()

A new environment subclasses ``BaseEnv`` and implements ``_initial_observation`` and
``_step_impl``. If ``_step_impl`` raises, ``step`` ends the episode with status
``ENV_ERROR`` instead: one bad step ends one episode, never the run.
"""

from __future__ import annotations

import abc
import string
import traceback
from typing import Any, Callable, ClassVar, Sequence

import gymnasium

from raytunix.agents.parsers import parse_action
from raytunix.types import Action, EpisodeStatus, StepResult, Task


class BaseEnv(abc.ABC):
    """One environment instance, one episode at a time.

    Attributes:
      default_agent: name of the agent (``raytunix.agents.make_agent``) that speaks this
        environment's action format.
      task: the current episode's task (None before ``reset``).
    """

    default_agent: ClassVar[str]

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
          "traceback": ...})`` with reward 0.
        """
        try:
            if self._done:
                raise RuntimeError(
                    f"{type(self).__name__}.step called with no episode running; "
                    "call reset(task) first."
                )
            result = self._step_impl(action)
        except Exception as e:  # noqa: BLE001 - any failure ends this episode only
            result = StepResult(
                observation="",
                done=True,
                status=EpisodeStatus.ENV_ERROR,
                info={"error": repr(e), "traceback": traceback.format_exc()},
            )
        self._done = result.done
        return result

    def close(self) -> None:
        """Releases resources held by the environment (none by default)."""

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
    ``EpisodeStatus`` value.

    Args:
      env: the environment to wrap.
      tasks: tasks to draw from on reset.
      parse: model text -> Action (default: tool calls or an answer).
      max_length: longest observation/action text, characters.
      charset: characters allowed in observations and actions (default printable ASCII).

    Raises:
      ValueError: ``tasks`` is empty.
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
        if not tasks:
            raise ValueError("GymTextEnv needs at least one task to draw from on reset; got none.")
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
        return self.env.reset(task), {"task_id": task.task_id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        result = self.env.step(self.parse(action))
        truncated = result.status in (EpisodeStatus.TRUNCATED, EpisodeStatus.TIMEOUT)
        info = dict(result.info)
        if result.status is not None:
            info["status"] = result.status.value
        return result.observation, result.reward, result.done and not truncated, truncated, info

    def close(self) -> None:
        self.env.close()
