"""Games that seed and draw from the process's global random generators, made safe to run
as interleaved episodes in one env actor.

TextArena's and GEM's games call ``random.seed(seed)`` on reset (GEM also
``numpy.random.seed(seed)``) and draw from the global generators while they reset and
step. An env actor runs episodes in threads, so the adapters wrap every call into such a
game in ``EpisodeRandom.use()``: it holds ``GLOBAL_RNG_LOCK`` (one per process, shared by
all adapters, since they share the generators) and swaps in the episode's own streams::

    streams = EpisodeRandom()
    with streams.use():          # lock held; the global generators are this episode's
        game.reset(seed=seed)
    with streams.use():          # the draws go on where this episode's left off
        game.step(move)

Episodes of one group then play as if each ran alone (same seed and moves, same game),
and the caller's global generators are left as they were.
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any, Callable, Iterator

import numpy as np

from raytunix.types import Action, Task

GLOBAL_RNG_LOCK = threading.Lock()
# Reset seeds of hub tasks: data seed s trains on seeds from 2*s*SEEDS_PER_SPLIT and holds
# out the next SEEDS_PER_SPLIT, modulo 2**31 (numpy.random.seed takes seeds below 2**32).
SEEDS_PER_SPLIT = 1 << 20
SEED_MODULUS = 1 << 31
_SPLIT_INDEX = {"train": 0, "heldout": 1}


class EpisodeRandom:
    """One episode's streams of Python's ``random`` and numpy's global ``numpy.random``.

    Until the first ``use`` ends (or after ``restart``) there is no stream yet: the next
    ``use`` runs on the global generators as they are, which a seeded reset overwrites.
    """

    def __init__(self) -> None:
        self._state: tuple[Any, Any] | None = None

    def restart(self) -> None:
        """Forgets the stream, for a reset that seeds the generators itself."""
        self._state = None

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Holds ``GLOBAL_RNG_LOCK`` with this episode's streams swapped in; on exit saves
        them and puts the caller's back."""
        with GLOBAL_RNG_LOCK:
            outer = (random.getstate(), np.random.get_state())
            if self._state is not None:
                random.setstate(self._state[0])
                np.random.set_state(self._state[1])
            try:
                yield
            finally:
                self._state = (random.getstate(), np.random.get_state())
                random.setstate(outer[0])
                np.random.set_state(outer[1])


def reset_seeds(split: str, size: int, seed: int) -> list[int]:
    """The reset seeds of ``size`` tasks: ``seed * 2 * SEEDS_PER_SPLIT`` onwards for
    "train", ``SEEDS_PER_SPLIT`` further for "heldout", each modulo ``SEED_MODULUS``.

    Raises:
      ValueError: ``split`` is not "train" or "heldout", or ``size`` exceeds
        ``SEEDS_PER_SPLIT``.
    """
    if split not in _SPLIT_INDEX:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if size > SEEDS_PER_SPLIT:
        raise ValueError(f"size={size} is over the {SEEDS_PER_SPLIT} tasks a split holds.")
    first = (int(seed) * 2 + _SPLIT_INDEX[split]) * SEEDS_PER_SPLIT
    return [(first + i) % SEED_MODULUS for i in range(size)]


def seeded_tasks(
    split: str, size: int, seed: int, first_observation: Callable[[int], str], **metadata: Any
) -> list[Task]:
    """``size`` tasks of a seeded game, one reset seed each (``reset_seeds``): ids
    ``<split>-000000`` onwards, the question the game's first observation under that seed
    (``first_observation(seed)``), metadata ``{"seed": ..., **metadata}``.

    Raises:
      ValueError: as ``reset_seeds``.
    """
    return [
        Task(
            task_id=f"{split}-{i:06d}",
            question=first_observation(reset_seed),
            answer="",
            metadata={"seed": reset_seed, **metadata},
        )
        for i, reset_seed in enumerate(reset_seeds(split, size, seed))
    ]


def binary_search_game(
    env: Any,
    task: Task,
    low: int,
    high: int,
    reply_for: Callable[[int], str],
    direction: Callable[[str, int], int],
    won: Callable[[Any], bool],
) -> list[dict[str, str]] | None:
    """An expert's GuessTheNumber game on ``task`` against ``env``: halves ``[low, high]``
    on each hint, never reading the secret. ``reply_for(guess)`` is the move in the game's
    syntax; ``direction(observation, guess)`` is +1 (the number is higher), -1 (lower) or
    0 (a message the expert does not understand: it gives up); ``won(result)`` reads the
    final ``StepResult``. The game's messages if it was won, else None."""
    messages = [{"role": "user", "content": env.reset(task)}]
    while low <= high:
        guess = (low + high) // 2
        reply = reply_for(guess)
        messages.append({"role": "assistant", "content": reply})
        result = env.step(Action(text=reply))
        if result.done:
            return messages if won(result) else None
        step = direction(result.observation, guess)
        if step == 0:
            return None
        low, high = (guess + 1, high) if step > 0 else (low, guess - 1)
        messages.append({"role": "tool", "content": result.observation})
    return None
