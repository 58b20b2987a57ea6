"""Environments: the ``BaseEnv`` contract, a gymnasium adapter, math environments, and a
simulated slow-tool environment for benchmarks."""

from __future__ import annotations

from typing import Any

from raytunix.envs.base import BaseEnv, GymTextEnv
from raytunix.envs.math_envs import CalculatorMathEnv, MathVerifierEnv
from raytunix.envs.simulated_tool import SimulatedToolEnv

ENVS: dict[str, type[BaseEnv]] = {
    "calculator_math": CalculatorMathEnv,
    "math_verifier": MathVerifierEnv,
    "simulated_tool": SimulatedToolEnv,
}


def make_env(name: str, **kwargs: Any) -> BaseEnv:
    """Builds the environment registered as ``name`` with ``kwargs`` for its constructor.

    Raises:
      ValueError: ``name`` is not registered (the message lists the valid names).
    """
    try:
        cls = ENVS[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; valid names: {sorted(ENVS)}") from None
    return cls(**kwargs)


__all__ = [
    "BaseEnv",
    "CalculatorMathEnv",
    "ENVS",
    "GymTextEnv",
    "MathVerifierEnv",
    "SimulatedToolEnv",
    "make_env",
]
