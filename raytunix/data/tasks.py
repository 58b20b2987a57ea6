"""Where a run's tasks come from (``data.source``): the environment's own
(``BaseEnv.tasks``), a reasoning-gym generator (``data.dataset``, by default the
arithmetic one), or a dataset on disk (``raytunix.data.datasets``).
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from raytunix.data.arithmetic import make_arithmetic_splits
from raytunix.data.datasets import FILE_SOURCES, DatasetSpec, file_splits, reasoning_gym_splits
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
        raise TypeError(
            f"{name}.tasks({split!r}, {size}, {seed}) returned "
            f"{type(tasks).__qualname__}; return a list of raytunix.types.Task."
        )
    tasks = list(tasks)
    for i, task in enumerate(tasks):
        if not isinstance(task, Task):
            raise TypeError(
                f"{name}.tasks({split!r}, ...)[{i}] is {type(task).__qualname__} "
                f"({task!r:.80}), not a raytunix.types.Task."
            )
    if len(tasks) != size:
        raise ValueError(
            f"{name}.tasks({split!r}, size={size}, seed={seed}) returned "
            f"{len(tasks)} tasks; return exactly size (data.{split}_size)."
        )
    counts = collections.Counter(t.task_id for t in tasks)
    if len(counts) != len(tasks):
        repeated = sorted(i for i, n in counts.items() if n > 1)[:5]
        raise ValueError(
            f"{name}.tasks({split!r}, ...) repeats task ids {repeated}; each task "
            "of a split needs its own id (exactly-once accounting keys on it)."
        )
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
    train, heldout = make_arithmetic_splits(
        size if split == "train" else 0, size if split == "heldout" else 0, seed
    )
    return train if split == "train" else heldout


def dataset_splits(data: Any) -> tuple[list[Task], list[Task]] | None:
    """``(train, heldout)`` from the ``data.*`` keys (a ``raytunix.config.DataConfig``)
    when ``data.source`` names a dataset (a file source or ``reasoning_gym``); None when
    the environment is asked first (``auto``, ``env``). Held-out tasks whose question is
    in train are dropped.

    Raises:
      raytunix.data.datasets.DatasetError: a file, split or column is missing (see
        ``raytunix.data.datasets``), or the reasoning-gym dataset refuses its settings.
    """
    if data.source in FILE_SOURCES:
        columns = dict(
            question_column=data.question_column,
            answer_column=data.answer_column,
            id_column=data.id_column,
        )
        train = DatasetSpec(data.source, data.path, data.split, **columns)
        heldout = None
        if data.heldout_path or data.heldout_split:
            heldout = DatasetSpec(
                data.source,
                data.heldout_path or data.path,
                data.heldout_split or "test",
                **columns,
                key="data.heldout_path" if data.heldout_path else "data.path",
            )
        return file_splits(train, heldout, data.train_size, data.heldout_size, data.seed)
    if data.source == "reasoning_gym":
        return generator_splits(data)
    return None


def generator_splits(data: Any) -> tuple[list[Task], list[Task]]:
    """reasoning-gym ``data.dataset``: arithmetic with the ``data.min_*``/``max_*`` keys
    (tasks keep the expression the warm start's tool demonstrations need), any other
    dataset with ``data.dataset_kwargs``."""
    if data.dataset == "basic_arithmetic" and not data.dataset_kwargs:
        return make_arithmetic_splits(
            data.train_size,
            data.heldout_size,
            data.seed,
            min_terms=data.min_terms,
            max_terms=data.max_terms,
            min_digits=data.min_digits,
            max_digits=data.max_digits,
        )
    return reasoning_gym_splits(
        data.dataset, data.train_size, data.heldout_size, data.seed, **data.dataset_kwargs
    )


def is_arithmetic(tasks: Sequence[Task]) -> bool:
    """Every task is an arithmetic one (a string ``metadata["expression"]``), the only
    kind the warm start has demonstrations for."""
    return bool(tasks) and all(isinstance(t.metadata.get("expression"), str) for t in tasks)
