"""A raytunix environment behind the gymnasium API, with text observations and actions,
and the ``raytunix/<name>`` gymnasium ids that build one::

    import gymnasium
    from raytunix.envs import register_gymnasium_ids

    register_gymnasium_ids()                                   # once per process
    env = gymnasium.make("raytunix/math_verifier", num_tasks=100)

The ids are registered by that call, not on import: importing ``raytunix.envs`` leaves
gymnasium's registry as it was.
"""

from __future__ import annotations

import functools
import logging
import string
from typing import Any, Callable, Sequence

import gymnasium

from raytunix import registry
from raytunix.agents.parsers import parse_action, parse_answer_action
from raytunix.data.tasks import make_tasks
from raytunix.envs.base import BaseEnv
from raytunix.types import Action, EpisodeStatus, Task

GYMNASIUM_NAMESPACE = "raytunix"
logger = logging.getLogger(__name__)


class GymTextEnv(gymnasium.Env):
    """A ``BaseEnv`` behind the gymnasium API, with text observations and actions.

    ``reset(seed, options)`` picks a task (``options["task"]``, or one of ``tasks``
    drawn with ``self.np_random``); ``step(text)`` parses the model text into an
    ``Action`` and returns ``(observation, reward, terminated, truncated, info)``, with
    ``truncated`` for episodes that ran out of turns or time and ``info["status"]`` the
    ``EpisodeStatus`` value. ``gymnasium.make("raytunix/<name>")`` builds one for every
    registered raytunix environment once ``register_gymnasium_ids`` ran (``make_gym_env``).

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
            raise TypeError(
                f"GymTextEnv needs an environment instance, got the class "
                f"{env.__qualname__}; pass {env.__qualname__}(...) instead."
            )
        if not isinstance(env, BaseEnv):
            hint = (
                " It already is a gymnasium environment; to run it in raytunix use "
                "BaseEnv.from_gymnasium(env)."
                if isinstance(env, gymnasium.Env)
                else ""
            )
            raise TypeError(
                f"GymTextEnv wraps a raytunix BaseEnv instance, got {type(env).__qualname__}.{hint}"
            )
        if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence):
            raise TypeError(
                f"tasks must be a sequence of raytunix.types.Task, got {type(tasks).__qualname__}."
            )
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
            raise TypeError(
                f"{type(self.env).__qualname__}.reset returned "
                f"{type(observation).__qualname__}, not str; "
                "_initial_observation must return the text shown to the agent."
            )
        return observation, {"task_id": task.task_id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(
                f"GymTextEnv.step takes the model's text (str), got "
                f"{type(action).__qualname__}: {action!r:.80}."
            )
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
        raise TypeError(
            f"{where} is {type(task).__qualname__} ({task!r:.80}), not a "
            "raytunix.types.Task; build tasks as Task(task_id, question, answer)."
        )


def _text_action(text: str) -> Action:
    return Action(text=text)


# How GymTextEnv turns text into an Action for an env, by its default agent's format.
_PARSERS: dict[str, Callable[[str], Action]] = {
    "tool": parse_action,
    "answer": parse_answer_action,
    "text": _text_action,
}


def make_gym_env(
    name: str,
    tasks: Sequence[Task] | None = None,
    num_tasks: int = 256,
    seed: int = 0,
    parse: Callable[[str], Action] | None = None,
    max_length: int = 8192,
    **env_kwargs: Any,
) -> GymTextEnv:
    """The raytunix environment ``name`` behind the gymnasium API (what
    ``gymnasium.make("raytunix/<name>", ...)`` calls).

    Args:
      name: a registered environment name, an entry point or an import path.
      tasks: tasks to draw from on reset; default: ``num_tasks`` of the environment's own
        (``BaseEnv.tasks``), or arithmetic tasks for one that brings none.
      seed: seed of those default tasks.
      parse: model text -> Action; default: the format of the env's default agent (tool
        calls or an answer, an answer only, or the raw text).
      max_length: longest observation/action text, characters.
      env_kwargs: the environment's constructor arguments.

    Raises:
      ValueError: unknown environment, bad arguments, or no tasks.
    """
    env = registry.resolve("env", name, BaseEnv)(**env_kwargs)
    if tasks is None:
        tasks = make_tasks(env, "train", num_tasks, seed)
    if parse is None:
        parse = _PARSERS.get(getattr(env, "default_agent", ""), parse_action)
    return GymTextEnv(env, tasks, parse=parse, max_length=max_length)


def register_gymnasium_ids() -> list[str]:
    """Registers ``raytunix/<name>`` with gymnasium for every registered and entry-point
    environment not registered there yet; returns the ids registered now. Call it again
    after registering more environments; ids already there are kept."""
    added = []
    for name in registry.registered_names("env"):
        env_id = f"{GYMNASIUM_NAMESPACE}/{name}"
        if env_id in gymnasium.registry:
            continue
        try:
            gymnasium.register(id=env_id, entry_point=functools.partial(make_gym_env, name))
        except gymnasium.error.Error as e:  # a third party's name gymnasium cannot take
            logger.warning("environment %r is not registered with gymnasium: %s", name, e)
            continue
        added.append(env_id)
    return added
