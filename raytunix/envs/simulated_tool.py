"""An environment whose every action is one slow tool call: for overlap benchmarks.

Each step sleeps as a remote tool or sandbox would, and answers with a short observation;
the episode ends after ``turns`` steps with reward 1. Steps run in a thread of the
``EnvActor``, so the sleep blocks no other episode.

Tool latency is drawn per step, seeded per task, from one of two distributions around a
median ``tool_latency_s``: ``uniform`` (``jitter`` sets the relative half-width) or
``lognormal`` (``latency_sigma`` is the standard deviation of the log latency), the
heavy-tailed shape measured for web, sandbox and API calls. A fraction of episodes can be
*stragglers* whose every call takes ``straggler_factor`` times as long.
"""

from __future__ import annotations

import math
import random
import time

from raytunix.envs.base import BaseEnv
from raytunix.registry import register
from raytunix.types import Action, EpisodeStatus, StepResult, Task

LATENCY_DISTRIBUTIONS = ("uniform", "lognormal")


@register("env", "simulated_tool")
class SimulatedToolEnv(BaseEnv):
    """Multi-turn environment in which each action costs one tool call of random latency.

    Per step: sleeps ``tool_latency_s * u * s`` seconds, where ``s`` is
    ``straggler_factor`` in a straggler episode and 1 otherwise, and ``u`` is

    * ``latency_dist="uniform"``: uniform in ``[1 - jitter, 1 + jitter]`` (mean and median
      1);
    * ``latency_dist="lognormal"``: ``exp(latency_sigma * z)``, ``z`` standard normal
      (median 1, mean ``exp(latency_sigma**2 / 2)``).

    The observation is ``"tool result <k>"`` (k counts steps from 1). Step ``turns`` ends
    the episode: reward 1.0, status ``COMPLETED``. ``info["tool_latency_s"]`` is the
    seconds slept, ``info["straggler"]`` whether the episode is a straggler.

    Args:
      tool_latency_s: median tool latency of one step outside stragglers, seconds (>= 0).
      turns: steps per episode (>= 1).
      jitter: relative half-width of the uniform distribution, in ``[0, 1]``; only with
        ``latency_dist="uniform"``.
      seed: seeds the draws; each ``reset`` reseeds from ``seed`` and the task id, so an
        episode's latencies and straggler draw do not depend on which actor or thread runs
        it (the G samples of one task share them).
      latency_dist: ``"uniform"`` or ``"lognormal"``.
      latency_sigma: standard deviation of the log latency (>= 0); only with
        ``latency_dist="lognormal"``.
      straggler_fraction: probability that an episode is a straggler, in ``[0, 1]``.
      straggler_factor: latency multiplier of a straggler episode (>= 1).

    Raises:
      ValueError: an argument is out of range, or set for the other distribution.
    """

    default_agent = "text"

    def __init__(
        self,
        tool_latency_s: float = 0.1,
        turns: int = 3,
        jitter: float = 0.0,
        seed: int = 0,
        latency_dist: str = "uniform",
        latency_sigma: float = 0.0,
        straggler_fraction: float = 0.0,
        straggler_factor: float = 20.0,
    ) -> None:
        super().__init__()
        if not tool_latency_s >= 0:
            raise ValueError(f"tool_latency_s must be >= 0 seconds, got {tool_latency_s!r}")
        if not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an int >= 1, got {turns!r}")
        if latency_dist not in LATENCY_DISTRIBUTIONS:
            raise ValueError(
                f"latency_dist must be one of {LATENCY_DISTRIBUTIONS}, got {latency_dist!r}"
            )
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {jitter!r}")
        if not 0 <= latency_sigma < math.inf:
            raise ValueError(f"latency_sigma must be a finite number >= 0, got {latency_sigma!r}")
        if jitter and latency_dist != "uniform":
            raise ValueError(
                f"jitter={jitter!r} applies to latency_dist='uniform' only; for "
                f"{latency_dist!r} set latency_sigma instead"
            )
        if latency_sigma and latency_dist != "lognormal":
            raise ValueError(
                f"latency_sigma={latency_sigma!r} applies to "
                "latency_dist='lognormal' only; for 'uniform' set jitter instead"
            )
        if not 0 <= straggler_fraction <= 1:
            raise ValueError(f"straggler_fraction must be in [0, 1], got {straggler_fraction!r}")
        if not 1 <= straggler_factor < math.inf:
            raise ValueError(
                f"straggler_factor must be a finite number >= 1, got {straggler_factor!r}"
            )
        self.tool_latency_s = float(tool_latency_s)
        self.turns = turns
        self.jitter = float(jitter)
        self.seed = seed
        self.latency_dist = latency_dist
        self.latency_sigma = float(latency_sigma)
        self.straggler_fraction = float(straggler_fraction)
        self.straggler_factor = float(straggler_factor)
        self.steps = 0
        self.straggler = False
        self._rng = random.Random(seed)

    @property
    def mean_latency_s(self) -> float:
        """Expected seconds of one step over all episodes, stragglers included."""
        spread = math.exp(self.latency_sigma**2 / 2) if self.latency_dist == "lognormal" else 1.0
        stragglers = 1 + self.straggler_fraction * (self.straggler_factor - 1)
        return self.tool_latency_s * spread * stragglers

    def _initial_observation(self, task: Task) -> str:
        self.steps = 0
        self._rng = random.Random(f"{self.seed}/{task.task_id}")
        # Drawn first, so the straggler draw does not depend on the latency settings.
        self.straggler = self._rng.random() < self.straggler_fraction
        return task.question

    def _draw_latency_s(self) -> float:
        if self.latency_dist == "lognormal":
            u = math.exp(self.latency_sigma * self._rng.gauss(0.0, 1.0))
        else:
            u = self._rng.uniform(1 - self.jitter, 1 + self.jitter)
        return self.tool_latency_s * u * (self.straggler_factor if self.straggler else 1.0)

    def _step_impl(self, action: Action) -> StepResult:
        latency_s = self._draw_latency_s()
        if latency_s > 0:  # sleep(0) would still give the CPU away
            time.sleep(latency_s)
        self.steps += 1
        info = {"tool_latency_s": latency_s, "straggler": self.straggler}
        if self.steps >= self.turns:
            return StepResult(
                observation="", reward=1.0, done=True, status=EpisodeStatus.COMPLETED, info=info
            )
        return StepResult(observation=f"tool result {self.steps}", info=info)
