"""Any reasoning-gym task as a single-turn environment, scored by reasoning-gym itself.

Source: reasoning-gym (github.com/open-thought/reasoning-gym). Each of its datasets has a
generator (``reasoning_gym.create_dataset(name, size=..., seed=...)``) and a scorer
(``reasoning_gym.get_score_answer_fn(name)(answer, entry) -> float in [0, 1]``); the
scorer is the dataset's own notion of right.

Its scorers also pay for answers that are not right: the default one gives
``len(oracle) / len(answer)`` to any answer that contains the right one (so a reply that
lists candidates earns reward), and many give 0.01 or 0.05 to any answer at all, an empty
one included. So by default the reward is 1 only when the scorer says 1, an empty answer
scores 0 without asking it, and so does one much longer than the reference (a list of
candidates); ``partial_credit=True`` pays the scorer's fractions. Right means a score of
exactly 1 (``spell_backward`` sums per-letter fractions that can round past 1 for a wrong
answer). Datasets whose scorer pays any answer (``UNSCORABLE``) are refused.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from raytunix.data.answers import blank_answer
from raytunix.data.datasets import reasoning_gym_splits
from raytunix.envs.base import BaseEnv, answered_demonstration
from raytunix.registry import register
from raytunix.types import Action, EpisodeStatus, StepResult, Task

# Held-out entries are drawn from seeds this far above the run's seed, away from any train
# range (reasoning-gym draws entry i from Random(seed + i)). A dataset with few distinct
# questions can still repeat a train question there; data.source=reasoning_gym (which
# sees both splits) drops those.
HELDOUT_SEED_OFFSET = 1 << 32
# An answer longer than this many times the reference (and than MIN_LENGTH_CAP) scores 0.
LENGTH_FACTOR = 4
MIN_LENGTH_CAP = 256
# Datasets whose scorer pays for answers that do not solve the task at all.
UNSCORABLE = {
    "game_of_life_halting": "its scorer gives 1.0 to every non-empty answer "
    "(bool(answer) == bool(entry['answer']))",
    "coin_flip": "its scorer gives 1.0 to any answer that is a prefix of the probability's "
    "digits, so the constant answer 0 scores 1.0 on every probability below 1",
}


@register("env", "reasoning_gym")
class ReasoningGymEnv(BaseEnv):
    """One reasoning-gym question, one answer, reward = reasoning-gym's score for it.

    The task's ``metadata["entry"]`` (the generator's entry, as ``data.source:
    reasoning_gym`` or this env's own tasks make it) says which dataset's scorer decides.
    Per episode: the question is the observation; the answer (``<answer>...</answer>``)
    gets ``score = score_answer(answer, entry)`` in [0, 1] (``info["score"]``) and
    ``reward = 1.0 if score == 1 else 0.0`` (``score`` itself with ``partial_credit``);
    ``info["correct"]`` is ``score == 1`` exactly, status ``COMPLETED``. No answer scores 0 with
    ``info["parse_error"]``; an empty or whitespace answer, or one longer than
    ``max(MIN_LENGTH_CAP, LENGTH_FACTOR * len(reference))`` characters, scores 0 without
    the scorer, with the reason in ``info["refused"]``. An entry whose reference answer is
    blank text (``raytunix.data.answers.blank_answer``) scores 0 whatever the answer, with
    ``info["empty_reference"]`` (an answer of None is the scorer's own verification, as in
    ``rubiks_cube``).

    Args:
      task: a reasoning-gym dataset name (e.g. ``"leg_counting"``): the environment then
        brings its own tasks (``tasks``); None: it scores the run's dataset
        (``data.source: reasoning_gym``).
      dataset_kwargs: that dataset's config (e.g. ``{min_animals: 2}``); only with ``task``.
      partial_credit: reward the scorer's fractional scores (which it also gives to
        answers that merely contain the right one, or to any answer); default off.

    Raises:
      ValueError: ``task`` is not a reasoning-gym dataset (close names listed), is in
        ``UNSCORABLE``, or ``dataset_kwargs`` without ``task``; ``reset`` on a task whose
        entry is from an ``UNSCORABLE`` dataset.
    """

    default_agent = "answer"

    def __init__(
        self,
        task: str | None = None,
        dataset_kwargs: dict[str, Any] | None = None,
        partial_credit: bool = False,
    ) -> None:
        super().__init__()
        if task in UNSCORABLE:
            raise ValueError(_unscorable(task))
        if not isinstance(partial_credit, bool):
            raise ValueError(f"partial_credit={partial_credit!r} must be true or false")
        self.partial_credit = partial_credit
        if task is not None:
            reasoning_gym_splits(task, 1, 0, 0, **(dataset_kwargs or {}))  # checks both
        elif dataset_kwargs:
            raise ValueError(
                f"dataset_kwargs={dataset_kwargs} needs task (the reasoning-gym "
                "dataset they configure); set env.kwargs.task."
            )
        self.task_name = task
        self.dataset_kwargs = dict(dataset_kwargs or {})

    def tasks(self, split: str, size: int, seed: int) -> list[Task] | None:
        """``size`` tasks of ``self.task_name`` (train from ``seed``, held-out from
        ``seed + HELDOUT_SEED_OFFSET``), or None without a task name."""
        if self.task_name is None:
            return None
        if split == "train":
            return reasoning_gym_splits(self.task_name, size, 0, seed, **self.dataset_kwargs)[0]
        return reasoning_gym_splits(
            self.task_name, 0, size, seed + HELDOUT_SEED_OFFSET, **self.dataset_kwargs
        )[1]

    def demonstrate(self, task: Task) -> list[dict[str, str]] | None:
        """The expert answers the entry's reference answer (``<answer>...</answer>``);
        None when the entry has no text answer or this environment does not score it 1
        (``answered_demonstration``)."""
        entry = task.metadata.get("entry")
        answer = entry.get("answer") if isinstance(entry, dict) else None
        if not isinstance(answer, str) or blank_answer(answer):
            return None
        return answered_demonstration(self, task, answer)

    def _initial_observation(self, task: Task) -> str:
        entry = task.metadata.get("entry")
        if not isinstance(entry, dict) or "source_dataset" not in entry.get("metadata", {}):
            raise ValueError(
                f"task {task.task_id!r} has no reasoning-gym entry in metadata['entry'], so no "
                "scorer; give the run reasoning-gym tasks (env.kwargs.task=<name> or "
                "data.source=reasoning_gym data.dataset=<name>)."
            )
        if entry["metadata"]["source_dataset"] in UNSCORABLE:
            raise ValueError(_unscorable(entry["metadata"]["source_dataset"]))
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        info: dict[str, Any] = {}
        entry = self.task.metadata["entry"]
        cap = max(MIN_LENGTH_CAP, LENGTH_FACTOR * len(str(entry.get("answer", ""))))
        score = 0.0
        if action.answer is None:
            info["parse_error"] = action.parse_error or "no answer found"
        elif isinstance(entry.get("answer"), str) and blank_answer(entry["answer"]):
            # A blank reference would pay a blank answer; None means the scorer verifies.
            info["empty_reference"] = True
        elif not action.answer.strip():
            info["refused"] = "the answer is empty"
        elif len(action.answer) > cap:
            info["refused"] = (
                f"the answer is {len(action.answer)} characters, over the {cap} "
                "accepted for this task; give one answer, not a list"
            )
        else:
            score = float(_scorer(entry["metadata"]["source_dataset"])(action.answer, entry))
        info["score"] = score
        info["correct"] = score == 1.0
        reward = score if self.partial_credit else (1.0 if score == 1.0 else 0.0)
        return StepResult(
            observation="", reward=reward, done=True, status=EpisodeStatus.COMPLETED, info=info
        )


def _unscorable(name: str) -> str:
    return (
        f"reasoning-gym dataset {name!r} cannot be trained on: {UNSCORABLE[name]}, so the "
        "reward would not say whether the task was solved; pick another dataset."
    )


@functools.cache
def _scorer(dataset_name: str) -> Callable[[str | None, dict[str, Any]], float]:
    # Building a dataset object is not free; one per dataset name serves every call.
    # Deferred: importing reasoning_gym takes seconds, paid only by runs that score with it.
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset_name)
