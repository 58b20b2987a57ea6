"""Arithmetic tasks from reasoning-gym's ``basic_arithmetic`` generator.

Source: reasoning-gym (github.com/open-thought/reasoning-gym),
``reasoning_gym/arithmetic/basic_arithmetic.py``. Its answers use floor division for
``/``. They are scored like every math answer, by ``raytunix.data.answers.score_answer``
(exact numbers: ``"-74"`` is wrong for ``"74"``, where reasoning-gym's own scorer gives
partial credit to a reply containing the answer).
"""

from __future__ import annotations

import json
from typing import Any

import reasoning_gym

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
    config = dict(
        min_terms=min_terms, max_terms=max_terms, min_digits=min_digits, max_digits=max_digits
    )
    attempts = 10 * heldout_size + 1000
    train_data = reasoning_gym.create_dataset(DATASET_NAME, size=train_size, seed=seed, **config)
    heldout_data = reasoning_gym.create_dataset(
        DATASET_NAME, size=attempts, seed=seed + train_size, **config
    )
    train = [_task(f"train-{i:06d}", train_data[i]) for i in range(train_size)]
    seen = {task.question for task in train}
    heldout: list[Task] = []
    for i in range(attempts):
        if len(heldout) == heldout_size:
            break
        entry = heldout_data[i]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        heldout.append(_task(f"heldout-{len(heldout):06d}", entry))
    if len(heldout) < heldout_size:
        raise ValueError(
            f"found only {len(heldout)} held-out questions not in train after {attempts} draws "
            f"(wanted {heldout_size}) with {config}; allow more digits or terms, or ask for "
            "fewer tasks."
        )
    return train, heldout


def _task(task_id: str, entry: dict[str, Any]) -> Task:
    # A JSON round trip turns the generator's tuples into lists, so tasks serialize.
    entry = json.loads(json.dumps({key: entry[key] for key in ("question", "answer", "metadata")}))
    return Task(
        task_id=task_id,
        question=entry["question"],
        answer=entry["answer"],
        metadata={
            "entry": entry,
            "expression": entry["metadata"]["expression"],
            "num_terms": entry["metadata"]["num_terms"],
        },
    )
