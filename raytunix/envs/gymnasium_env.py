"""A text ``gymnasium.Env`` run as a raytunix environment.

The wrapped environment's observations are the messages the agent sees and the model's
reply (its text, ``Action.text``) is the gymnasium action::

    env = BaseEnv.from_gymnasium("my_pkg.games:WordGuess-v0")   # or an instance
    observation = env.reset(task)        # gym_env.reset(seed=task.metadata["seed"])
    step = env.step(Action(text=reply))  # gym_env.step(reply) -> StepResult

A raytunix task of such an environment is a reset seed: ``tasks`` draws one seed per task
and records the first observation as the question, so the G episodes of a group start
from the same state. In a config it is the registered environment ``gymnasium``::

    env:
      name: gymnasium
      kwargs: {env_id: "my_pkg.games:WordGuess-v0", make_kwargs: {max_guesses: 6}}
"""

from __future__ import annotations

import collections.abc
import importlib
import inspect
import math
import numbers
from typing import Any

import gymnasium
import numpy as np

from raytunix.envs.base import BaseEnv
from raytunix.registry import register
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus, StepResult, Task, ToolErrorKind

# Train and held-out seeds come from disjoint ranges of one 63-bit space per data seed.
_SPLIT_OFFSET = {"train": 0, "heldout": 1 << 31}


@register("env", "gymnasium")
class GymnasiumEnv(BaseEnv):
    """Runs one text ``gymnasium.Env`` episode per raytunix episode.

    Per step: the action text must lie in the wrapped env's action space
    (``action_space.contains``: length and charset); otherwise the observation is
    ``error: ...`` saying why, the wrapped env is not stepped and one ``format`` tool
    error is counted (the policy's mistake, not the environment's). Otherwise
    ``gym_env.step(text)`` gives the observation and reward; ``terminated`` ends the
    episode as ``COMPLETED``, ``truncated`` as ``TRUNCATED``. The episode's reward is the
    sum of step rewards (``raytunix.rollout.episode.run_episode``).

    Args:
      env_id: a ``gymnasium.Env`` instance; a registered gymnasium id (``"Id-v0"``, or
        ``"module:Id-v0"``, which imports ``module`` first); or an import path
        ``package.module:EnvClass`` of a ``gymnasium.Env`` subclass.
      make_kwargs: keyword arguments for ``gymnasium.make`` or the class (not allowed
        with an instance).

    Raises:
      TypeError: ``env_id`` is not a gymnasium environment (or id/path to one), or its
        observation or action space is not ``gymnasium.spaces.Text``.
      ValueError: the id is not registered or the import path does not resolve.

    During an episode (each ends that episode as ``ENV_ERROR`` with the reason):
      TypeError: ``reset`` or ``step`` returned an observation that is not a string, a
        reward that is not a real number, or flags that are not booleans.
    """

    default_agent = "text"

    def __init__(
        self, env_id: gymnasium.Env | str, make_kwargs: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        if make_kwargs is not None and not isinstance(make_kwargs, collections.abc.Mapping):
            raise TypeError(f"make_kwargs must be a mapping, got {make_kwargs!r}.")
        make_kwargs = dict(make_kwargs or {})
        if isinstance(env_id, gymnasium.Env):
            if make_kwargs:
                raise ValueError(
                    "make_kwargs apply when the environment is built here; "
                    "an instance is already built, so pass none."
                )
            self.gym_env = env_id
            self.env_id = type(env_id.unwrapped).__qualname__
        elif isinstance(env_id, str):
            self.gym_env = _make(env_id, make_kwargs)
            self.env_id = env_id
        else:
            raise TypeError(
                f"from_gymnasium takes a gymnasium.Env instance, a gymnasium id or "
                f"package.module:EnvClass, got {type(env_id).__qualname__} ({env_id!r:.80})."
            )
        for name in ("observation_space", "action_space"):
            space = getattr(self.gym_env, name, None)
            if not isinstance(space, gymnasium.spaces.Text):
                raise TypeError(
                    f"{self.env_id}: {name} is {space!r}, not gymnasium.spaces.Text. raytunix "
                    "runs text environments (string observations and actions); wrap this one "
                    "in a gymnasium ObservationWrapper/ActionWrapper that renders and parses "
                    "text, with Text spaces."
                )

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        """``size`` tasks, one reset seed each; the question is the first observation
        under that seed (so the tokenizer and the prompt-length check see real prompts).

        Raises:
          ValueError: ``split`` is not "train" or "heldout".
          TypeError: the wrapped env's reset returns a non-string observation.
        """
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        first = (int(seed) << 32) + _SPLIT_OFFSET[split]
        tasks = []
        for i in range(size):
            reset_seed = first + i
            observation = self._reset(reset_seed)
            tasks.append(
                Task(
                    task_id=f"{split}-{i:06d}",
                    question=observation,
                    answer="",
                    metadata={"seed": reset_seed, "gymnasium_id": self.env_id},
                )
            )
        return tasks

    def _initial_observation(self, task: Task) -> str:
        seed = task.metadata.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise TypeError(f"task {task.task_id!r}: metadata['seed'] is {seed!r}, not an int.")
        return self._reset(seed, task.metadata.get("options"))

    def _step_impl(self, action: Action) -> StepResult:
        text = action.text
        if not self.gym_env.action_space.contains(text):
            return StepResult(
                observation=f"error: {_why_not_contained(text, self.gym_env.action_space)}",
                info={TOOL_ERRORS_KEY: {ToolErrorKind.FORMAT.value: 1}},
            )
        result = self.gym_env.step(text)
        if not (isinstance(result, tuple) and len(result) == 5):
            raise TypeError(
                f"{self.env_id}: step returned {result!r:.120}; gymnasium envs "
                "return (observation, reward, terminated, truncated, info)."
            )
        observation, reward, terminated, truncated, info = result
        _check_observation(observation, self.env_id, "step")
        if (
            isinstance(reward, bool)
            or not isinstance(reward, numbers.Real)
            or not math.isfinite(reward)
        ):
            raise TypeError(
                f"{self.env_id}: step returned reward {reward!r}; it must be a finite real number."
            )
        for name, flag in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{self.env_id}: step returned {name}={flag!r}; it must be a bool.")
        done = bool(terminated) or bool(truncated)
        status = None
        if done:
            status = EpisodeStatus.COMPLETED if terminated else EpisodeStatus.TRUNCATED
        return StepResult(
            observation=observation,
            reward=float(reward),
            done=done,
            status=status,
            info=dict(info or {}),
        )

    def close(self) -> None:
        self.gym_env.close()

    def _reset(self, seed: int | None, options: dict[str, Any] | None = None) -> str:
        result = self.gym_env.reset(seed=seed, options=options)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"{self.env_id}: reset returned {result!r:.120}; gymnasium envs "
                "return (observation, info)."
            )
        _check_observation(result[0], self.env_id, "reset")
        return result[0]


def _make(env_id: str, make_kwargs: dict[str, Any]) -> gymnasium.Env:
    module_name, sep, attr = env_id.partition(":")
    if sep and module_name and attr:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"cannot import {module_name!r} for gymnasium env {env_id!r}: {e}. "
                "It must be importable in every env actor (see raytunix.plugins)."
            ) from e
        target = getattr(module, attr, None)
        if inspect.isclass(target):
            if not issubclass(target, gymnasium.Env):
                raise TypeError(
                    f"{env_id!r} is the class {target.__qualname__}, not a gymnasium.Env subclass."
                )
            return target(**make_kwargs)
    try:
        return gymnasium.make(env_id, **make_kwargs)
    except gymnasium.error.Error as e:
        raise ValueError(f"gymnasium cannot make {env_id!r}: {e}") from e


def _check_observation(observation: Any, env_id: str, where: str) -> None:
    if not isinstance(observation, str):
        raise TypeError(
            f"{env_id}: {where} returned a {type(observation).__qualname__} "
            f"observation ({observation!r:.80}); raytunix needs text (str)."
        )


def _why_not_contained(text: Any, space: gymnasium.spaces.Text) -> str:
    if not isinstance(text, str):
        return f"the reply is {type(text).__qualname__}, not text"
    if len(text) < space.min_length:
        return f"the reply has {len(text)} characters; at least {space.min_length} are needed"
    if len(text) > space.max_length:
        return f"the reply has {len(text)} characters; at most {space.max_length} are allowed"
    bad = sorted(set(text) - set(space.character_set))
    return f"the reply uses characters the environment does not accept: {''.join(bad[:20])!r}"
