"""Environments: the ``BaseEnv`` contract, gymnasium adapters both ways, math environments
(calculator and Python tools, single-turn verifier), a bash terminal, text-to-SQL, a
web-API shop, repository repair, TextArena's single-player games, GEM's games, OpenEnv
environments (each served on 127.0.0.1), verifiers environments and agent programs (run
through the gateway), and a simulated slow-tool environment for benchmarks.

Each environment registers itself by name (``@register("env", name)``,
``raytunix.registry``); ``make_env`` builds one from a registered name, a package's entry
point (group ``raytunix.envs``) or an import path ``package.module:Class``. Every
environment can also be a gymnasium id, ``raytunix/<name>``, once
``register_gymnasium_ids`` ran (importing this package registers none)::

    register_gymnasium_ids()
    env = gymnasium.make("raytunix/math_verifier")      # tasks: the env's own or arithmetic
"""

from __future__ import annotations

from typing import Any

from raytunix import registry
from raytunix.envs.agent_program import AgentProgramEnv
from raytunix.envs.base import BaseEnv
from raytunix.envs.bash_env import BashTerminalEnv
from raytunix.envs.gem_env import GEMEnv
from raytunix.envs.gym_text import (
    GYMNASIUM_NAMESPACE,
    GymTextEnv,
    make_gym_env,
    register_gymnasium_ids,
)
from raytunix.envs.gymnasium_env import GymnasiumEnv
from raytunix.envs.math_envs import CalculatorMathEnv, MathVerifierEnv
from raytunix.envs.openenv_env import OpenEnvEnv
from raytunix.envs.python_math import PythonMathEnv
from raytunix.envs.reasoning_gym_env import ReasoningGymEnv
from raytunix.envs.repo_repair import RepoRepairEnv
from raytunix.envs.simulated_tool import SimulatedToolEnv
from raytunix.envs.sql_env import TextToSQLEnv
from raytunix.envs.textarena_env import TextArenaEnv
from raytunix.envs.verifiers_env import VerifiersEnv
from raytunix.envs.web_api_env import WebAPIEnv

# The live registry: each environment registers itself on import (the modules above).
ENVS: dict[str, type[BaseEnv]] = registry.entries("env")


def make_env(name: str, **kwargs: Any) -> BaseEnv:
    """Builds the environment ``name`` (registered name, entry point or
    ``package.module:Class``) with ``kwargs`` for its constructor.

    Raises:
      raytunix.registry.PluginError (a ValueError): ``name`` does not resolve to a
        ``BaseEnv`` subclass (the message lists the registered names).
      Exception: whatever the constructor raises for bad arguments.
    """
    return registry.resolve("env", name, BaseEnv)(**kwargs)


__all__ = [
    "AgentProgramEnv",
    "BaseEnv",
    "BashTerminalEnv",
    "CalculatorMathEnv",
    "ENVS",
    "GEMEnv",
    "GYMNASIUM_NAMESPACE",
    "GymTextEnv",
    "GymnasiumEnv",
    "MathVerifierEnv",
    "OpenEnvEnv",
    "PythonMathEnv",
    "ReasoningGymEnv",
    "RepoRepairEnv",
    "SimulatedToolEnv",
    "TextArenaEnv",
    "VerifiersEnv",
    "TextToSQLEnv",
    "WebAPIEnv",
    "make_env",
    "make_gym_env",
    "register_gymnasium_ids",
]
