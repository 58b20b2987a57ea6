"""Adaptive concurrency: how many episodes the orchestrator keeps in flight.

Too few episodes in flight and the engine idles while they wait for tools; too many and
trajectories grow stale, the KV cache fills and every episode waits longer for its turn.
The right number moves with tool latency, reply length and the engine's speed, so instead
of a hand-tuned ``max_concurrent_episodes`` a controller sets it from what the engine
reports, every ``interval_s`` seconds::

    meter = EngineLoadMeter()
    controller = ConcurrencyController(initial=4, minimum=4, maximum=256, target_busy=0.9,
                                       granularity=4)
    while running:
        load = meter.update(await engine.engine_stats())   # one stats dict per replica
        if load is not None:
            budget = controller.update(load.busy_fraction, limit_reached=...,
                                       backpressure=load.saturated or batch_queue_full)

Plain Python, no Ray and no JAX: both classes are fed numbers and return numbers. The
orchestrator applies the budget on top of its admission rules (staleness, batch queue),
which stay as they are: the controller can only lower what they allow, never raise it.
A lower budget cancels nothing: episodes in flight run to their end, and new groups wait
until the episodes in flight fit under it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """The engine fleet over one window between two stats readings.

    Attributes:
      busy_fraction: mean over replicas of (device seconds in prefill/decode) / (wall
        seconds) in the window, in [0, 1].
      saturated: some replica had requests waiting for a running slot at the reading, or
        preempted a request for KV blocks during the window: more episodes would queue in
        the engine, not make it busier.
      window_s: the window's length, seconds (longest over replicas).
    """

    busy_fraction: float
    saturated: bool
    window_s: float


class EngineLoadMeter:
    """Turns successive ``InferenceEngine.stats()`` snapshots into windowed load.

    The engine's counters are cumulative since it started (``busy_s``, ``wall_s``,
    ``preemptions``); the meter keeps the previous snapshot of each replica and reports the
    differences. Windows use the engine's own clock (``wall_s``), so the time a stats call
    spends in transit does not count.
    """

    def __init__(self) -> None:
        self._previous: list[Mapping[str, Any]] | None = None

    def update(self, replicas: Sequence[Mapping[str, Any]]) -> EngineLoad | None:
        """Takes one stats dict per engine replica (keys ``busy_s``, ``wall_s``,
        ``waiting``, ``preemptions``); returns the load since the previous call, or None
        when there is no window yet (first call, a replica count change, a restarted
        replica, or no replica has served a request).

        Raises:
          ValueError: ``replicas`` is empty or a dict lacks one of the keys.
        """
        if not replicas:
            raise ValueError(
                "EngineLoadMeter.update got no replica stats; pass one "
                "InferenceEngine.stats() dict per engine replica."
            )
        for stats in replicas:
            missing = {"busy_s", "wall_s", "waiting", "preemptions"} - set(stats)
            if missing:
                raise ValueError(
                    f"EngineLoadMeter.update: engine stats lack {sorted(missing)};"
                    " pass InferenceEngine.stats() dicts."
                )
        previous, self._previous = self._previous, [dict(s) for s in replicas]
        if previous is None or len(previous) != len(replicas):
            return None
        fractions, window_s, saturated = [], 0.0, False
        for before, now in zip(previous, replicas):
            dwall = now["wall_s"] - before["wall_s"]
            dbusy = now["busy_s"] - before["busy_s"]
            if dwall < 0 or dbusy < 0:  # the replica restarted: its counters began again
                return None
            window_s = max(window_s, dwall)
            # A replica that served nothing yet (wall_s stays 0) is idle, not unknown.
            fractions.append(min(1.0, dbusy / dwall) if dwall > 0 else 0.0)
            saturated |= now["waiting"] > 0 or now["preemptions"] > before["preemptions"]
        if window_s == 0:
            return None
        return EngineLoad(
            busy_fraction=sum(fractions) / len(fractions), saturated=saturated, window_s=window_s
        )


class ConcurrencyController:
    """Sets the episode budget to hold the engine's busy fraction near a target.

    Control law, one ``update`` per window:

    * ``|busy - target| <= dead_band``: hold.
    * ``busy < target - dead_band``: raise to ``budget * target / busy`` (at most
      ``max_step`` times the budget, at least one ``granularity`` more), but only if the
      budget was what held episodes back (``limit_reached``) and nothing downstream pushes
      back (``backpressure``): otherwise more budget would not reach the engine, and the
      budget would only wind up. The step is proportional in log space: if the busy
      fraction were proportional to the episodes in flight it would land on the target in
      one step; since it grows less than proportionally (it saturates), it lands at or
      below the target, so raising does not overshoot on a clean reading.
    * ``busy > target + dead_band``: lower to ``budget * target / busy`` (at most a
      halving, at least one ``granularity`` less).

    Hysteresis against oscillation: a change needs ``patience`` readings in a row on the
    same side of the band, and the reading right after a change is ignored (its window
    straddles the change). The budget is a multiple of ``granularity`` (the GRPO group
    size: groups start whole) within ``[minimum, maximum]``.

    Multiplicative increase on a measured shortfall, as in TCP's slow start, and a
    proportional decrease; the dead band and the skipped reading are standard hysteresis.

    Args:
      initial: starting budget, episodes (``rollout.max_concurrent_episodes``).
      minimum, maximum: bounds of the budget, episodes; ``minimum <= initial <= maximum``.
      target_busy: wanted engine busy fraction, in (0, 1].
      granularity: the budget moves in steps of this many episodes (>= 1).
      dead_band: half-width of the band around the target where the budget holds.
      patience: readings in a row out of the band before a change (>= 1).
      max_step: largest factor of one raise (> 1); one lowering at most halves.

    Raises:
      ValueError: an argument is out of range (the message names it).
    """

    def __init__(
        self,
        *,
        initial: int,
        minimum: int,
        maximum: int,
        target_busy: float = 0.9,
        granularity: int = 1,
        dead_band: float = 0.05,
        patience: int = 2,
        max_step: float = 2.0,
    ):
        for name, value in (
            ("initial", initial),
            ("minimum", minimum),
            ("maximum", maximum),
            ("granularity", granularity),
            ("patience", patience),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ConcurrencyController: {name}={value!r} must be an int >= 1.")
        if not minimum <= initial <= maximum:
            raise ValueError(
                f"ConcurrencyController: need minimum <= initial <= maximum, got minimum="
                f"{minimum}, initial={initial}, maximum={maximum}; widen the bounds or move "
                "the start value inside them."
            )
        if not 0 < target_busy <= 1:
            raise ValueError(
                f"ConcurrencyController: target_busy={target_busy!r} must be in (0, 1], e.g. 0.9."
            )
        if not 0 <= dead_band < target_busy:
            raise ValueError(
                f"ConcurrencyController: dead_band={dead_band!r} must be in "
                f"[0, target_busy={target_busy})."
            )
        if not max_step > 1:
            raise ValueError(f"ConcurrencyController: max_step={max_step!r} must be > 1.")
        self.minimum, self.maximum = minimum, maximum
        self.target_busy, self.dead_band = target_busy, dead_band
        self.granularity, self.patience, self.max_step = granularity, patience, max_step
        self.budget = initial
        self.changes = 0  # how often the budget moved
        self.last_busy_fraction: float | None = None
        self._streak = 0  # readings in a row on one side of the band: > 0 below, < 0 above
        self._skip_next = False

    @classmethod
    def from_config(cls, rollout) -> "ConcurrencyController":
        """The controller a ``RolloutConfig`` asks for: starts at
        ``max_concurrent_episodes``; ``adaptive_min_episodes`` 0 means one group,
        ``adaptive_max_episodes`` 0 means the most the staleness rule can admit,
        ``(max_staleness + 1) * groups_per_batch * group_size`` episodes (but at least the
        start value)."""
        group = rollout.group_size
        minimum = rollout.adaptive_min_episodes or min(group, rollout.max_concurrent_episodes)
        maximum = rollout.adaptive_max_episodes or max(
            rollout.max_concurrent_episodes,
            (rollout.max_staleness + 1) * rollout.groups_per_batch * group,
        )
        return cls(
            initial=rollout.max_concurrent_episodes,
            minimum=minimum,
            maximum=maximum,
            target_busy=rollout.target_engine_busy,
            granularity=group,
        )

    def update(
        self, busy_fraction: float, *, limit_reached: bool = True, backpressure: bool = False
    ) -> int:
        """Feeds one window's reading; returns the (possibly new) budget in episodes.

        Args:
          busy_fraction: the engine's busy fraction over the window, in [0, 1].
          limit_reached: in the window, episodes in flight reached the budget (the
            producer waited for room); if not, the budget did not hold the engine back.
          backpressure: something downstream is full (the learner's batch queue, or the
            engine queues requests): never raise.

        Raises:
          ValueError: ``busy_fraction`` is not a number in [0, 1].
        """
        if not (isinstance(busy_fraction, (int, float)) and 0 <= busy_fraction <= 1):
            raise ValueError(
                f"ConcurrencyController.update: busy_fraction={busy_fraction!r} "
                "must be a number in [0, 1] (device seconds / wall seconds)."
            )
        self.last_busy_fraction = float(busy_fraction)
        if self._skip_next:
            self._skip_next = False
            return self.budget
        low = busy_fraction < self.target_busy - self.dead_band
        high = busy_fraction > self.target_busy + self.dead_band
        if high:
            self._streak = min(self._streak, 0) - 1
        elif low and limit_reached and not backpressure:
            self._streak = max(self._streak, 0) + 1
        else:
            self._streak = 0
        if abs(self._streak) < self.patience:
            return self.budget
        ratio = self.target_busy / max(busy_fraction, 1e-9)
        g = self.granularity
        if self._streak > 0:
            wanted = self.budget * min(ratio, self.max_step)
            new = max(self.budget + g, g * math.ceil(wanted / g))
        else:
            wanted = self.budget * max(ratio, 0.5)
            new = min(self.budget - g, g * math.floor(wanted / g))
        new = max(self.minimum, min(self.maximum, new))
        self._streak = 0
        if new != self.budget:
            self.budget = new
            self.changes += 1
            self._skip_next = True
        return self.budget
