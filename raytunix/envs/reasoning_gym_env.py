"""Any reasoning-gym task as a single-turn environment, scored by reasoning-gym itself.

Source: reasoning-gym (github.com/open-thought/reasoning-gym). Each of its datasets has a
generator (``reasoning_gym.create_dataset(name, size=..., seed=...)``) and a scorer
(``reasoning_gym.get_score_answer_fn(name)(answer, entry) -> float in [0, 1]``); the
scorer is the dataset's own notion of right (some give partial credit).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from raytunix.data.answers import blank_answer
from raytunix.envs.base import BaseEnv
from raytunix.types import Action, EpisodeStatus, StepResult, Task

# Held-out entries are drawn from seeds this far above the run's seed, away from any train
# range (reasoning-gym draws entry i from Random(seed + i)). A dataset with few distinct
# questions can still repeat a train question there; data.source=reasoning_gym (which
# sees both splits) drops those.
HELDOUT_SEED_OFFSET = 1 << 32


class ReasoningGymEnv(BaseEnv):
    """One reasoning-gym question, one answer, reward = reasoning-gym's score for it.

    The task's ``metadata["entry"]`` (the generator's entry, as ``data.source:
    reasoning_gym`` or this env's own tasks make it) says which dataset's scorer decides.
    Per episode: the question is the observation; the answer (``<answer>...</answer>``)
    gets ``reward = score_answer(answer, entry)`` in [0, 1], ``info["correct"]`` is
    ``score == 1``, status ``COMPLETED``. No answer scores 0 with ``info["parse_error"]``;
    an entry whose reference answer is blank text (``raytunix.data.answers.blank_answer``)
    scores 0 whatever the answer, with ``info["empty_reference"]`` (an answer of None is
    the scorer's own verification, as in ``rubiks_cube``).

    Args:
      task: a reasoning-gym dataset name (e.g. ``"leg_counting"``): the environment then
        brings its own tasks (``tasks``); None: it scores the run's dataset
        (``data.source: reasoning_gym``).
      dataset_kwargs: that dataset's config (e.g. ``{min_animals: 2}``); only with ``task``.

    Raises:
      ValueError: ``task`` is not a reasoning-gym dataset (close names listed), or
        ``dataset_kwargs`` without ``task``.
    """

    default_agent = "answer"

    def __init__(self, task: str | None = None,
                 dataset_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if task is not None:
            from raytunix.data.datasets import reasoning_gym_splits

            reasoning_gym_splits(task, 1, 0, 0, **(dataset_kwargs or {}))  # checks both
        elif dataset_kwargs:
            raise ValueError(f"dataset_kwargs={dataset_kwargs} needs task (the reasoning-gym "
                             "dataset they configure); set env.kwargs.task.")
        self.task_name = task
        self.dataset_kwargs = dict(dataset_kwargs or {})

    def tasks(self, split: str, size: int, seed: int) -> list[Task] | None:
        """``size`` tasks of ``self.task_name`` (train from ``seed``, held-out from
        ``seed + HELDOUT_SEED_OFFSET``), or None without a task name."""
        if self.task_name is None:
            return None
        from raytunix.data.datasets import reasoning_gym_splits

        if split == "train":
            return reasoning_gym_splits(self.task_name, size, 0, seed, **self.dataset_kwargs)[0]
        return reasoning_gym_splits(self.task_name, 0, size, seed + HELDOUT_SEED_OFFSET,
                                    **self.dataset_kwargs)[1]

    def _initial_observation(self, task: Task) -> str:
        entry = task.metadata.get("entry")
        if not isinstance(entry, dict) or "source_dataset" not in entry.get("metadata", {}):
            raise ValueError(
                f"task {task.task_id!r} has no reasoning-gym entry in metadata['entry'], so no "
                "scorer; give the run reasoning-gym tasks (env.kwargs.task=<name> or "
                "data.source=reasoning_gym data.dataset=<name>).")
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        info: dict[str, Any] = {}
        entry = self.task.metadata["entry"]
        if action.answer is None:
            info["parse_error"] = action.parse_error or "no answer found"
            score = 0.0
        elif isinstance(entry.get("answer"), str) and blank_answer(entry["answer"]):
            # A blank reference would pay a blank answer; None means the scorer verifies.
            info["empty_reference"] = True
            score = 0.0
        else:
            score = float(_scorer(entry["metadata"]["source_dataset"])(action.answer, entry))
        info["correct"] = score >= 1.0
        return StepResult(observation="", reward=score, done=True,
                          status=EpisodeStatus.COMPLETED, info=info)


@functools.cache
def _scorer(dataset_name: str) -> Callable[[str | None, dict[str, Any]], float]:
    # Building a dataset object is not free; one per dataset name serves every call.
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset_name)
