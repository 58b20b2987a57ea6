"""An environment whose every action is one slow tool call: for overlap benchmarks.

Each step sleeps ``tool_latency_s`` seconds (jittered) as a remote tool or sandbox would,
and answers with a short observation; the episode ends after ``turns`` steps with reward
1. Steps run in a thread of the ``EnvActor``, so the sleep blocks no other episode.
"""

from __future__ import annotations

import random
import time

from raytunix.envs.base import BaseEnv
from raytunix.types import Action, EpisodeStatus, StepResult, Task


class SimulatedToolEnv(BaseEnv):
    """Multi-turn environment in which each action costs one tool call of fixed latency.

    Per step: sleeps ``tool_latency_s * u`` seconds with ``u`` uniform in
    ``[1 - jitter, 1 + jitter]``; the observation is ``"tool result <k>"`` (k counts
    steps from 1). Step ``turns`` ends the episode: reward 1.0, status ``COMPLETED``.
    ``info["tool_latency_s"]`` is the seconds slept.

    Args:
      tool_latency_s: mean tool latency per step, seconds (>= 0).
      turns: steps per episode (>= 1).
      jitter: relative half-width of the latency's uniform jitter, in ``[0, 1]``.
      seed: seeds the jitter; each ``reset`` reseeds it from ``seed`` and the task id, so
        an episode's latencies do not depend on which actor or thread runs it.

    Raises:
      ValueError: an argument is out of range.
    """

    default_agent = "text"

    def __init__(self, tool_latency_s: float = 0.1, turns: int = 3, jitter: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__()
        if not tool_latency_s >= 0:
            raise ValueError(f"tool_latency_s must be >= 0 seconds, got {tool_latency_s!r}")
        if not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an int >= 1, got {turns!r}")
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {jitter!r}")
        self.tool_latency_s = float(tool_latency_s)
        self.turns = turns
        self.jitter = float(jitter)
        self.seed = seed
        self.steps = 0
        self._rng = random.Random(seed)

    def _initial_observation(self, task: Task) -> str:
        self.steps = 0
        self._rng = random.Random(f"{self.seed}/{task.task_id}")
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        latency_s = self.tool_latency_s * self._rng.uniform(1 - self.jitter, 1 + self.jitter)
        time.sleep(latency_s)
        self.steps += 1
        info = {"tool_latency_s": latency_s}
        if self.steps >= self.turns:
            return StepResult(observation="", reward=1.0, done=True,
                              status=EpisodeStatus.COMPLETED, info=info)
        return StepResult(observation=f"tool result {self.steps}", info=info)
