"""Arithmetic tasks from reasoning-gym's ``basic_arithmetic`` generator, and their scorer.

Source: reasoning-gym (github.com/open-thought/reasoning-gym),
``reasoning_gym/arithmetic/basic_arithmetic.py``. Its answers use floor division for
``/``; its ``score_answer`` gives 1.0 for the exact answer string and partial credit
``len(answer) / len(reply)`` when the answer is a substring of the reply (so ``"-74"``
earns 2/3 for ``"74"``). We pay 1.0 only for a full score: a wrong sign is wrong.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Callable

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


def score_answer(task: Task, answer: str | None) -> float:
    """Reward of ``answer`` for ``task``: 1.0 if correct, else 0.0.

    With ``task.metadata["entry"]`` (a reasoning-gym entry), the entry's dataset scorer
    decides and only a full score counts; otherwise the answer is compared with
    ``task.answer`` as numbers (relative/absolute tolerance 1e-9), or as stripped text
    when either is not a number. Surrounding whitespace is ignored; None scores 0.0.
    """
    if answer is None:
        return 0.0
    answer = answer.strip()
    entry = task.metadata.get("entry")
    if entry is not None:
        score = _scorer(entry["metadata"]["source_dataset"])(answer, entry)
        return 1.0 if score >= 1.0 else 0.0
    expected, given = _as_number(task.answer), _as_number(answer)
    if expected is None or given is None:
        return 1.0 if answer == task.answer.strip() else 0.0
    return 1.0 if math.isclose(given, expected, rel_tol=1e-9, abs_tol=1e-9) else 0.0


@functools.cache
def _scorer(dataset_name: str) -> Callable[[str | None, dict[str, Any]], float]:
    # Building a dataset object is not free; one per dataset name serves every call.
    return reasoning_gym.get_score_answer_fn(dataset_name)


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


def _as_number(text: str) -> float | None:
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None
