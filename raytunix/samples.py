"""The sample log: a few whole episodes of every RL step, for people to read.

Each RL step's batch gives ``run.samples_per_step`` episodes (``choose_samples``: the best,
the worst, then random ones), written as one JSON line of ``RUN_DIR/samples.jsonl``::

    {"step": 3, "consume_version": 2, "batch_trajectories": 8, "time": 1764680000.0,
     "episodes": [{"pick": "best", "task_id": "train-17", "group_id": "...", "reward": 1.0,
                   "status": "completed", "num_turns": 1, "policy_versions": [2],
                   "generated_tokens": 9, "error": "",
                   "messages": [{"role": "user", "content": "Is 4 even or odd? ..."},
                                {"role": "assistant", "content": "<answer>even</answer><|end|>",
                                 "action": {"answer": "even"}}]}, ...]}

``messages`` is ``Trajectory.transcript``: what the model was shown (system, user, and
each observation under the template's tool role) and what it said (``assistant``, decoded
with the run's tokenizer, special tokens kept, with the ``action`` the agent parsed from
it). ``raytunix samples RUN_DIR [--step N]`` prints them (``format_step``).

The orchestrator chooses and builds the records when it packs a batch (so only those few
episodes travel to the driver); the driver appends them (``SampleLog``), and a file that
cannot be written never stops training.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Sequence
from typing import Any

from raytunix.types import Trajectory

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"


def choose_samples(rewards: Sequence[float], n: int, seed: int) -> list[tuple[str, int]]:
    """Which episodes of a batch to show: ``[(pick, index into rewards)]``, at most ``n``.

    The first is ``"best"`` (the highest reward; the first such in batch order), the second
    ``"worst"`` (the lowest among the others; the last such), the rest ``"random"``: drawn
    without replacement from the remaining episodes by ``random.Random(seed)``, in the
    order drawn. The same rewards, ``n`` and ``seed`` give the same picks.

    Raises:
      ValueError: ``n`` < 0.
    """
    if n < 0:
        raise ValueError(f"samples per step n={n} must be >= 0 (0 = none)")
    if not rewards or n == 0:
        return []
    order = list(range(len(rewards)))
    best = max(order, key=lambda i: (rewards[i], -i))
    picks = [("best", best)]
    rest = [i for i in order if i != best]
    if n >= 2 and rest:
        worst = min(rest, key=lambda i: (rewards[i], -i))
        picks.append(("worst", worst))
        rest.remove(worst)
    drawn = random.Random(seed).sample(rest, min(n - len(picks), len(rest)))
    return picks + [("random", i) for i in drawn]


def episode_sample(trajectory: Trajectory, pick: str) -> dict[str, Any]:
    """One episode of the sample log as JSON (see the module docstring); ``pick`` says why
    it was chosen. ``policy_versions`` are the distinct versions of its generated tokens."""
    versions = sorted({v for v in trajectory.policy_versions if v >= 0})
    return {
        "pick": pick,
        "task_id": trajectory.task_id,
        "group_id": trajectory.group_id,
        "reward": float(trajectory.reward),
        "status": trajectory.status.value,
        "num_turns": trajectory.num_turns,
        "policy_versions": versions,
        "generated_tokens": sum(1 for v in trajectory.policy_versions if v >= 0),
        "error": trajectory.error,
        "messages": list(trajectory.transcript),
    }


def batch_samples(trajectories: Sequence[Trajectory], n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` episodes of one batch (``choose_samples`` by reward) as sample-log records."""
    picks = choose_samples([t.reward for t in trajectories], n, seed)
    return [episode_sample(trajectories[i], pick) for pick, i in picks]


class SampleLog:
    """Appends each RL step's samples to ``RUN_DIR/samples.jsonl``, flushed per step.

    Writing never stops a run: the first error (disk full, no permission) is logged once
    with what was lost, and later steps try again silently."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, SAMPLES_FILE)
        self._warned = False

    def write(self, step: int, episodes: Sequence[dict[str, Any]], **extra: Any) -> bool:
        """Appends RL step ``step``'s line (``episodes`` and ``extra`` fields such as
        ``consume_version``); nothing for no episodes. Returns whether it was written."""
        if not episodes:
            return False
        line = json.dumps({"step": step, **extra, "time": time.time(), "episodes": list(episodes)})
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
                f.flush()
        except OSError as e:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "samples of RL step %d not written to %s (%s); training goes on, "
                    "later steps try again without this warning",
                    step,
                    self.path,
                    e,
                )
            return False
        return True


class SamplesError(ValueError):
    """The run's sample log cannot answer the request; the message says what to do."""


def read_samples(run_dir: str) -> dict[int, dict[str, Any]]:
    """``{step: its line}`` of ``RUN_DIR/samples.jsonl`` in step order; a step written
    twice (steps retrained after a resume) keeps its last line, and a torn last line (a
    run killed while writing) is skipped.

    Raises:
      SamplesError: ``run_dir`` has no samples.jsonl (named, with why that may be).
    """
    path = os.path.join(run_dir, SAMPLES_FILE)
    if not os.path.exists(path):
        raise SamplesError(
            f"{run_dir!r} has no {SAMPLES_FILE}: it is not a run directory, its run "
            "stopped before its first RL step, or it ran with run.samples_per_step=0."
        )
    steps: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            steps[int(record["step"])] = record
    return dict(sorted(steps.items()))


def step_samples(run_dir: str, step: int | None = None) -> dict[str, Any]:
    """RL step ``step``'s line of the sample log (None: the last step logged).

    Raises:
      SamplesError: no samples.jsonl, none in it, or no line of ``step`` (the message
        names the steps there are).
    """
    steps = read_samples(run_dir)
    if not steps:
        raise SamplesError(f"{os.path.join(run_dir, SAMPLES_FILE)} holds no samples yet.")
    if step is None:
        return steps[max(steps)]
    if step not in steps:
        raise SamplesError(
            f"RL step {step} has no samples in {run_dir!r}; steps with samples: "
            f"{_ranges(list(steps))}."
        )
    return steps[step]


def _ranges(numbers: list[int]) -> str:
    """Sorted ``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def format_step(record: dict[str, Any]) -> str:
    """One RL step's samples as text to read: a header per episode (pick, task, reward,
    status, turns, policy versions), then each message under its role, indented."""
    lines = [
        f"RL step {record['step']}: {len(record['episodes'])} of "
        f"{record.get('batch_trajectories', '?')} trajectories of its batch"
    ]
    for episode in record["episodes"]:
        lines.append("")
        lines.append(
            f"== {episode['pick']}: task {episode['task_id']}  reward {episode['reward']:g}  "
            f"{episode['status']}  {episode['num_turns']} turn(s)  policy version(s) "
            f"{', '.join(map(str, episode['policy_versions'])) or '-'}"
        )
        if episode.get("error"):
            lines.append(f"   error: {episode['error']}")
        if not episode["messages"]:
            lines.append("   (no transcript: its calls sent token ids, not text)")
        for message in episode["messages"]:
            lines.append(f"-- {message['role']}:")
            text = _printable(str(message["content"]))
            lines.extend(f"   {line}" for line in text.splitlines() or [""])
            if message.get("action"):
                lines.append(f"   => action: {json.dumps(message['action'])}")
    return "\n".join(lines) + "\n"


def _printable(text: str) -> str:
    """``text`` with control characters other than newline and tab escaped (``\\x1b``), so
    a reply of stray bytes cannot move the terminal's cursor or change its colours."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)
