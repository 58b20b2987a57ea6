"""Environments: the ``BaseEnv`` contract, gymnasium adapters both ways, math environments
(calculator and Python tools, single-turn verifier), a bash terminal, text-to-SQL, a
web-API shop, repository repair, and a simulated slow-tool environment for benchmarks.

``make_env`` builds an environment from a registered name, a package's entry point
(group ``raytunix.envs``) or an import path ``package.module:Class`` (see
``raytunix.plugins``). Every registered environment is also a gymnasium id,
``raytunix/<name>``::

    env = gymnasium.make("raytunix/math_verifier")      # tasks: the env's own or arithmetic
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import gymnasium

from raytunix.agents.parsers import parse_action, parse_answer_action
from raytunix.envs.base import BaseEnv, GymTextEnv
from raytunix.envs.bash_env import BashTerminalEnv
from raytunix.envs.gymnasium_env import GymnasiumEnv
from raytunix.envs.math_envs import CalculatorMathEnv, MathVerifierEnv
from raytunix.envs.python_math import PythonMathEnv
from raytunix.envs.reasoning_gym_env import ReasoningGymEnv
from raytunix.envs.repo_repair import RepoRepairEnv
from raytunix.envs.simulated_tool import SimulatedToolEnv
from raytunix.envs.sql_env import TextToSQLEnv
from raytunix.envs.web_api_env import WebAPIEnv
from raytunix.types import Action, Task

ENVS: dict[str, type[BaseEnv]] = {
    "bash_terminal": BashTerminalEnv,
    "calculator_math": CalculatorMathEnv,
    "gymnasium": GymnasiumEnv,
    "math_verifier": MathVerifierEnv,
    "python_math": PythonMathEnv,
    "reasoning_gym": ReasoningGymEnv,
    "repo_repair": RepoRepairEnv,
    "simulated_tool": SimulatedToolEnv,
    "text_to_sql": TextToSQLEnv,
    "web_api": WebAPIEnv,
}

GYMNASIUM_NAMESPACE = "raytunix"
logger = logging.getLogger(__name__)


def make_env(name: str, **kwargs: Any) -> BaseEnv:
    """Builds the environment ``name`` (registered name, entry point or
    ``package.module:Class``) with ``kwargs`` for its constructor.

    Raises:
      raytunix.plugins.PluginError (a ValueError): ``name`` does not resolve to a
        ``BaseEnv`` subclass (the message lists the registered names).
      Exception: whatever the constructor raises for bad arguments.
    """
    from raytunix.plugins import resolve

    return resolve("env", name)(**kwargs)


def _text_action(text: str) -> Action:
    return Action(text=text)


# How GymTextEnv turns text into an Action for an env, by its default agent's format.
_PARSERS: dict[str, Callable[[str], Action]] = {
    "tool": parse_action, "answer": parse_answer_action, "text": _text_action}


def make_gym_env(name: str, tasks: Sequence[Task] | None = None, num_tasks: int = 256,
                 seed: int = 0, parse: Callable[[str], Action] | None = None,
                 max_length: int = 8192, **env_kwargs: Any) -> GymTextEnv:
    """The raytunix environment ``name`` behind the gymnasium API (what
    ``gymnasium.make("raytunix/<name>", ...)`` calls).

    Args:
      name: a registered environment name or import path.
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
    from raytunix.data.tasks import make_tasks

    env = make_env(name, **env_kwargs)
    if tasks is None:
        tasks = make_tasks(env, "train", num_tasks, seed)
    if parse is None:
        parse = _PARSERS.get(getattr(env, "default_agent", ""), parse_action)
    return GymTextEnv(env, tasks, parse=parse, max_length=max_length)


def register_gymnasium_ids() -> list[str]:
    """Registers ``raytunix/<name>`` with gymnasium for every built-in and entry-point
    environment not registered yet; returns the ids registered now."""
    from raytunix.plugins import registered_names

    added = []
    for name in registered_names("env"):
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


register_gymnasium_ids()

__all__ = [
    "BaseEnv",
    "BashTerminalEnv",
    "CalculatorMathEnv",
    "ENVS",
    "GymTextEnv",
    "GymnasiumEnv",
    "MathVerifierEnv",
    "PythonMathEnv",
    "ReasoningGymEnv",
    "RepoRepairEnv",
    "SimulatedToolEnv",
    "TextToSQLEnv",
    "WebAPIEnv",
    "make_env",
    "make_gym_env",
    "register_gymnasium_ids",
]
