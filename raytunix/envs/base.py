"""The environment contract.

An environment turns actions into observations and rewards::

    observation = env.reset(task)      # str shown to the agent as the user message
    step = env.step(action)            # StepResult; never raises
    env.close()

A new environment subclasses ``BaseEnv`` and implements ``_initial_observation`` and
``_step_impl``; it may bring its own tasks (``tasks``) and an expert (``demonstrate``)
that the run's supervised warm start learns from. If ``_step_impl`` raises, ``step``
ends the episode with status ``ENV_ERROR`` instead: one bad step ends one episode, never
the run.

Both ways to gymnasium live beside it: ``BaseEnv.from_gymnasium(env_or_id)``
(``raytunix.envs.gymnasium_env``) runs a text ``gymnasium.Env`` as a raytunix environment,
and ``raytunix.envs.gym_text.GymTextEnv`` runs a raytunix environment behind the gymnasium
API.
"""

from __future__ import annotations

import abc
import traceback
from typing import Any, ClassVar, Sequence

from raytunix import registry
from raytunix.envs.contract import report_for
from raytunix.types import Action, EpisodeStatus, StepResult, Task


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
                info={
                    "error": repr(e),
                    "traceback": formatted,
                    "env_error_report": report_for(e, self, "step", task_id, formatted),
                },
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

    def demonstrate(self, task: Task) -> list[dict[str, str]] | None:
        """An expert's episode on ``task``, for the warm start; None when there is no
        expert for it (the default: the environment has none).

        Called in an env actor on an instance of its own, one task after another, before
        RL; the expert may ``reset`` and ``step`` this instance to play the episode (as
        ``answered_demonstration`` does), and should return only episodes it won.

        Returns:
          ``[{"role": "user", "content": first observation}, {"role": "assistant",
          "content": reply}, ({"role": "tool", "content": observation}, {"role":
          "assistant", ...})*]``: the replies in the action format of the environment's
          ``default_agent`` (``<answer>...</answer>`` for the answer and tool agents); the
          driver renders them through the run's agent, drops those the agent cannot parse
          (counted) and trains on the assistant tokens only.
        """
        return None

    @staticmethod
    def from_gymnasium(env_or_id: Any, make_kwargs: dict[str, Any] | None = None) -> "BaseEnv":
        """A text ``gymnasium.Env`` (``Text`` observation and action spaces) as a raytunix
        environment: the registered environment ``gymnasium``,
        ``raytunix.envs.gymnasium_env.GymnasiumEnv``.

        Args:
          env_or_id: an environment instance, a registered gymnasium id (``"module:Id-v0"``
            imports ``module`` first, as ``gymnasium.make`` does), or an import path
            ``package.module:EnvClass`` of a ``gymnasium.Env`` subclass.
          make_kwargs: keyword arguments for ``gymnasium.make`` or the class.

        Raises:
          TypeError: it is not a gymnasium environment, or a space is not ``Text``.
          ValueError: the id is not registered or the import path cannot be imported.
        """
        # Looked up by name: the contract does not import its own subclasses.
        return registry.resolve("env", "gymnasium", BaseEnv)(env_or_id, make_kwargs)

    @abc.abstractmethod
    def _initial_observation(self, task: Task) -> str:
        """Sets up the episode for ``task`` and returns the first observation."""

    @abc.abstractmethod
    def _step_impl(self, action: Action) -> StepResult:
        """Applies one action; may raise (``step`` turns that into ``ENV_ERROR``)."""


def answered_demonstration(env: BaseEnv, task: Task, answer: str) -> list[dict[str, str]] | None:
    """A one-turn expert's episode for ``BaseEnv.demonstrate``: resets ``env`` on
    ``task``, answers ``<answer>answer</answer>`` and returns the two messages if the
    environment scored it right (``info["correct"]``, else a reward of at least 1), None
    otherwise (a reference answer the environment's own check does not accept teaches
    nothing)."""
    if not isinstance(answer, str) or not answer.strip() or "<answer>" in answer:
        return None
    observation = env.reset(task)
    reply = f"<answer>{answer.strip()}</answer>"
    result = env.step(Action(text=reply, answer=answer.strip()))
    if not result.done or not result.info.get("correct", result.reward >= 1.0):
        return None
    return [{"role": "user", "content": observation}, {"role": "assistant", "content": reply}]
