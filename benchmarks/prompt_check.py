"""How long the before-training prompt check takes on every row of a large dataset.

Claim (issue 19 item 5): every dataset row is length-checked in tokens before training,
and the check costs a few seconds on 100k rows. The check (``preflight.check_prompt_lengths``)
measures 32 sampled prompts exactly through the environment and the run's agent, tokenizes
every question in one batch, and measures exactly again only the rows its bound flags.

Setup: ``--rows`` synthetic word problems (20-400 characters, a few rows of 10,000
characters at seeded random places), a BPE tokenizer trained on 3,000 of them
(``--vocab``), the ``answer`` agent and ``math_verifier``, ``model.max_seq_len`` 512. The
environment runs in this process behind the ``first_observation`` call the env actors
answer (``EnvActor.first_observation``'s body: build, reset, close), so the number is the
check's own cost, without Ray's per-call overhead on the ~40 exact measurements.

Run: ``python benchmarks/prompt_check.py --rows 100000`` (``--max-seq-len 160`` makes most
questions too long for the byte bound, so they are tokenized; ``--tokenize-all`` also times
tokenizing every question). Prints one JSON object; ``questions_tokenized`` counts the
questions the byte bound did not clear.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from raytunix.agents import make_agent  # noqa: E402
from raytunix.envs import make_env  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout import preflight  # noqa: E402
from raytunix.types import Task  # noqa: E402

WORDS = (
    "apples",
    "pencils",
    "a train",
    "leaves",
    "the market",
    "every",
    "bag",
    "holds",
    "friend",
    "school",
    "how",
    "many",
    "does",
    "she",
    "have",
    "left",
    "after",
    "buys",
)


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _InProcessActor:
    def __init__(self, name: str):
        def first_observation(task):
            env = make_env(name)
            try:
                return env.reset(task)
            finally:
                env.close()

        self.first_observation = _Method(first_observation)


class _Pool:
    def __init__(self, name: str):
        self.env_name = name
        self.actors = [_InProcessActor(name)]


def _tasks(rows: int, long_rows: int, seed: int) -> tuple[list[Task], list[int]]:
    rng = random.Random(seed)
    tasks = []
    for i in range(rows):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 70)))
        tasks.append(Task(f"train-{i:06d}", f"{rng.randint(2, 99)} {words}?", str(i), {"row": i}))
    long = sorted(rng.sample(range(rows), long_rows))
    for i in long:
        tasks[i] = Task(f"train-{i:06d}", "Compute " + "17 + " * 2000 + "1.", "1", {"row": i})
    return tasks, long


def _python_speed_s() -> float:
    """Seconds for 10M additions in a Python loop: a yardstick of how busy the machine is
    (well under a second on an idle core)."""
    start, total = time.perf_counter(), 0
    for i in range(10_000_000):
        total += i
    return round(time.perf_counter() - start, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--long-rows", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument(
        "--tokenize-all",
        action="store_true",
        help="also time tokenizing every question (the check without the byte bound)",
    )
    args = parser.parse_args()
    tasks, long = _tasks(args.rows, args.long_rows, 0)
    tokenizer = Tokenizer.train((t.question for t in tasks[:3000]), args.vocab)
    preflight.ray.get = lambda ref, timeout=None: ref  # the in-process pool answers values
    samples = preflight.sample_tasks(tasks, 32)
    tokenize_s = None
    if args.tokenize_all:
        start = time.perf_counter()
        tokenizer.count_tokens([t.question for t in tasks])
        tokenize_s = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    check = preflight.check_prompt_lengths(
        _Pool("math_verifier"),
        tasks,
        samples,
        lambda: make_agent("answer", tokenizer),
        tokenizer,
        args.max_seq_len,
    )
    seconds = time.perf_counter() - start
    found = sorted(t.metadata["row"] for t, _ in check.too_long)
    print(
        json.dumps(
            {
                "rows": args.rows,
                "vocab_size": tokenizer.vocab_size,
                "max_seq_len": args.max_seq_len,
                "check_s": round(seconds, 3),
                "tokenize_all_questions_s": tokenize_s,
                "questions_tokenized": check.tokenized,
                "measured_exactly": check.measured_exactly,
                "bound_applies": check.bound_applies,
                "overlong_rows_planted": long,
                "overlong_rows_found": found,
                "all_found": found == long,
                "load_average_1min": os.getloadavg()[0],
                "python_10m_additions_s": _python_speed_s(),
            }
        )
    )


if __name__ == "__main__":
    main()
