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
from typing import Any, Iterator

import numpy as np

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
