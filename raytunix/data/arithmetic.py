"""Arithmetic tasks from reasoning-gym's ``basic_arithmetic`` generator.

Source: reasoning-gym (github.com/open-thought/reasoning-gym),
``reasoning_gym/arithmetic/basic_arithmetic.py``. Its answers use floor division for
``/``. They are scored like every math answer, by ``raytunix.data.answers.score_answer``
(exact numbers: ``"-74"`` is wrong for ``"74"``, where reasoning-gym's own scorer gives
partial credit to a reply containing the answer).
"""

from __future__ import annotations

import dataclasses

from raytunix.data.answers import score_answer  # noqa: F401  (its home before the shared math answer rule)
from raytunix.data.datasets import reasoning_gym_splits
from raytunix.types import Task

DATASET_NAME = "basic_arithmetic"


def make_arithmetic_splits(
    train_size: int,
    heldout_size: int,
    seed: int,
    min_terms: int = 2,
    max_terms: int = 3,
    min_digits: int = 2,
    max_digits: int = 3,
) -> tuple[list[Task], list[Task]]:
    """Generates train and held-out arithmetic tasks with no held-out question in train.

    reasoning-gym draws entry ``i`` from ``Random(seed + i)``, so the held-out split uses
    seeds after the train split's range; held-out questions seen in train (or earlier in
    held-out) are skipped and more are generated until ``heldout_size`` are found.

    Returns:
      ``(train, heldout)``: ``train_size`` tasks with ids ``"train-000000"``, ... and
      ``heldout_size`` tasks with ids ``"heldout-000000"``, ...; ``metadata`` holds
      ``entry`` (the generator's question/answer/metadata as plain JSON data, what the
      scorer needs), ``expression`` and ``num_terms``.

    Raises:
      ValueError: a size is negative, or the settings allow too few distinct questions
        to fill the held-out split (widen digits/terms or shrink the sizes).
    """
    if train_size < 0 or heldout_size < 0:
        raise ValueError(
            f"sizes must be >= 0, got train_size={train_size}, heldout_size={heldout_size}"
        )
    train, heldout = reasoning_gym_splits(
        DATASET_NAME,
        train_size,
        heldout_size,
        seed,
        min_terms=min_terms,
        max_terms=max_terms,
        min_digits=min_digits,
        max_digits=max_digits,
    )
    return [_with_expression(t) for t in train], [_with_expression(t) for t in heldout]


def _with_expression(task: Task) -> Task:
    meta = task.metadata["entry"]["metadata"]
    return dataclasses.replace(
        task,
        metadata={
            **task.metadata,
            "expression": meta["expression"],
            "num_terms": meta["num_terms"],
        },
    )
