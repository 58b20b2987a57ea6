"""Where a run's tasks come from: the environment's own (``BaseEnv.tasks``), else the
arithmetic generator (``data.dataset: basic_arithmetic``).

Dataset files (parquet, JSONL, Hugging Face-style folders) are a later source; an
environment that brings tasks is asked first.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from raytunix.data.arithmetic import make_arithmetic_splits
from raytunix.types import Task

SPLITS = ("train", "heldout")


def env_tasks(env: Any, split: str, size: int, seed: int) -> list[Task] | None:
    """``env.tasks(split, size, seed)`` checked, or None when the env brings no tasks.

    Raises:
      ValueError: the env returned the wrong number of tasks, or repeated task ids.
      TypeError: it returned something other than a sequence of ``Task``.
    """
    hook = getattr(env, "tasks", None)
    tasks = hook(split, size, seed) if callable(hook) else None
    if tasks is None:
        return None
    name = type(env).__qualname__
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence):
        raise TypeError(f"{name}.tasks({split!r}, {size}, {seed}) returned "
                        f"{type(tasks).__qualname__}; return a list of raytunix.types.Task.")
    tasks = list(tasks)
    for i, task in enumerate(tasks):
        if not isinstance(task, Task):
            raise TypeError(f"{name}.tasks({split!r}, ...)[{i}] is {type(task).__qualname__} "
                            f"({task!r:.80}), not a raytunix.types.Task.")
    if len(tasks) != size:
        raise ValueError(f"{name}.tasks({split!r}, size={size}, seed={seed}) returned "
                         f"{len(tasks)} tasks; return exactly size (data.{split}_size).")
    counts = collections.Counter(t.task_id for t in tasks)
    if len(counts) != len(tasks):
        repeated = sorted(i for i, n in counts.items() if n > 1)[:5]
        raise ValueError(f"{name}.tasks({split!r}, ...) repeats task ids {repeated}; each task "
                         "of a split needs its own id (exactly-once accounting keys on it).")
    return tasks


def make_tasks(env: Any, split: str, size: int, seed: int) -> list[Task]:
    """``size`` tasks of ``split`` for ``env``: its own, else arithmetic ones.

    Raises:
      ValueError: ``split`` is not "train" or "heldout", or see ``env_tasks``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    tasks = env_tasks(env, split, size, seed)
    if tasks is not None:
        return tasks
    train, heldout = make_arithmetic_splits(size if split == "train" else 0,
                                            size if split == "heldout" else 0, seed)
    return train if split == "train" else heldout

