"""Fault handling for the rollout: retries that back off, a breaker that stops a run that
can no longer produce data, and log lines that do not flood when a failure repeats.

    backoff = Backoff(initial_delay_s=0.1, max_delay_s=5.0, max_attempts=8)
    result = await retry_async(lambda: engine.generate(request), backoff,
                               retry_on=(EngineFailure,), rng=random.Random(seed))

Nothing here imports Ray or JAX.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter, bounded in attempts and in delay.

    The delay after failed attempt ``k`` (0-based) is ``u * min(max_delay_s,
    initial_delay_s * multiplier**k)`` seconds with ``u`` uniform in ``[1 - jitter, 1]``
    (M. Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015: ``jitter``
    0.5 is its "equal jitter", 1 its "full jitter", 0 no jitter): the delay grows, so an
    outage of ``D`` seconds costs about ``log2(D / initial)`` retries, not ``D / initial``,
    and the jitter spreads the retries of many episodes that failed at the same moment.

    Attributes:
      initial_delay_s: first delay before jitter, seconds (> 0).
      max_delay_s: cap on one delay before jitter, seconds (>= initial_delay_s).
      multiplier: growth factor per attempt (>= 1).
      max_attempts: attempts in all, the first included (>= 1).
      jitter: the fraction of each delay that is random, in ``[0, 1]``.

    Raises:
      ValueError: a field is out of range.
    """

    initial_delay_s: float = 0.1
    max_delay_s: float = 5.0
    multiplier: float = 2.0
    max_attempts: int = 8
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not self.initial_delay_s > 0:
            raise ValueError(
                f"Backoff.initial_delay_s must be > 0 seconds, got {self.initial_delay_s!r}"
            )
        if not self.max_delay_s >= self.initial_delay_s:
            raise ValueError(
                f"Backoff.max_delay_s={self.max_delay_s!r} must be >= initial_delay_s="
                f"{self.initial_delay_s!r}"
            )
        if not self.multiplier >= 1:
            raise ValueError(f"Backoff.multiplier must be >= 1, got {self.multiplier!r}")
        if not (isinstance(self.max_attempts, int) and self.max_attempts >= 1):
            raise ValueError(f"Backoff.max_attempts must be an int >= 1, got {self.max_attempts!r}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"Backoff.jitter must be in [0, 1], got {self.jitter!r}")

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based)."""
        ceiling = min(self.max_delay_s, self.initial_delay_s * self.multiplier ** min(attempt, 64))
        return ceiling * rng.uniform(1.0 - self.jitter, 1.0)

    def max_total_delay_s(self) -> float:
        """Longest total wait over all retries (jitter at its maximum), seconds."""
        return sum(
            min(self.max_delay_s, self.initial_delay_s * self.multiplier**k)
            for k in range(self.max_attempts - 1)
        )


async def retry_async(
    call: Callable[[], Awaitable[T]],
    backoff: Backoff,
    *,
    retry_on: tuple[type[BaseException], ...],
    rng: random.Random,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Awaits ``call()``; when it raises one of ``retry_on``, waits ``backoff.delay_s`` and
    tries again, up to ``backoff.max_attempts`` attempts in all.

    Args:
      on_retry: called as ``on_retry(attempt, error, delay_s)`` before each wait.

    Raises:
      the last error of ``retry_on`` once the attempts are spent; any other exception (and
      cancellation) at once, unretried.
    """
    for attempt in range(backoff.max_attempts):
        try:
            return await call()
        except retry_on as error:
            if attempt + 1 >= backoff.max_attempts:
                raise
            delay = backoff.delay_s(attempt, rng)
            if on_retry is not None:
                on_retry(attempt, error, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable: the loop returns or raises")


class RateLimitedLog:
    """Logs a repeating message at most once per ``interval_s`` per key, saying how many
    were held back since the last line.

    Args:
      logger: where lines go.
      interval_s: least time between two lines of one key, seconds.
      clock: monotonic seconds (a parameter so tests can drive it).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: int, key: str, message: str, *args) -> bool:
        """Logs ``message % args`` unless ``key`` was logged within ``interval_s``; returns
        whether a line was written."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        suffix = f" ({held} more like this in the last {now - last:.0f} s)" if held else ""
        self._logger.log(level, message + suffix, *args)
        self._last[key] = now
        return True


class FailureBreaker:
    """Trips after ``threshold`` consecutive failed episodes; any valid episode resets it.

    A run whose environments or engine are gone for good otherwise goes on forever: each
    task is retried, then filtered, and the next one fails the same way, burning the
    dataset. The breaker turns that into one error.

    Args:
      threshold: consecutive failures that trip it (>= 1), or 0 to never trip.

    Raises:
      ValueError: a negative ``threshold``.
    """

    def __init__(self, threshold: int):
        if threshold < 0:
            raise ValueError(f"breaker threshold must be >= 0 (0 turns it off), got {threshold!r}")
        self.threshold = threshold
        self.consecutive = 0
        self.last_failure: str | None = None

    def record(self, ok: bool, failure: str | None = None) -> bool:
        """Records one episode; returns True when the breaker is (now) tripped."""
        if ok:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.last_failure = failure
        return self.tripped

    @property
    def tripped(self) -> bool:
        return self.threshold > 0 and self.consecutive >= self.threshold
