"""`raytunix train` on a user's dataset: a JSONL file of word problems in GSM8K's layout,
scored by the math answer rule, with a tokenizer trained on those problems and the
(arithmetic-only) warm start switched off, one over-long row left out and counted; a bad
column stops the run before Ray."""

import json
import os
import random

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from raytunix.config import ConfigError, load_config  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.train import train  # noqa: E402

NAMES = ("Mia", "Omar", "Lena", "Kofi", "Ines", "Ravi", "Zoe", "Tomas")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "stamps")


def _word_problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, bags, per_bag, given = (
        rng.randint(5, 40),
        rng.randint(2, 9),
        rng.randint(2, 12),
        rng.randint(1, 5),
    )
    total = start + bags * per_bag - given
    question = (
        f"{name} has {start} {item} in a drawer at home. On Saturday {name} buys "
        f"{bags} bags of {item} at the market, and every bag holds {per_bag} {item}. "
        f"Later that day {name} gives {given} {item} to a friend from school. How "
        f"many {item} does {name} have at the end of the day?"
    )
    solution = (
        f"{name} buys {bags} * {per_bag} = <<{bags}*{per_bag}={bags * per_bag}>>"
        f"{bags * per_bag} {item}.\n{start} + {bags * per_bag} - {given} = {total}\n"
        f"#### {total:,}"
    )  # "1,234": the answer rule reads thousands separators
    return {"question": question, "answer": solution}


@pytest.fixture(scope="module")
def word_problems(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "word_problems.jsonl"
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(120):
            f.write(json.dumps(_word_problem(rng)) + "\n")
        # One row whose prompt cannot fit model.max_seq_len, left out by data.overlong_prompts.
        long = {
            "question": " ".join(_word_problem(rng)["question"] for _ in range(40)),
            "answer": "#### 7",
        }
        f.write(json.dumps(long) + "\n")
    return str(path)


TINY = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=64",
    "model.max_seq_len=160",
    "model.tokenizer_vocab_size=512",
    "data.heldout_size=2",
    "eval.heldout_size=2",
    "rollout.group_size=2",
    "rollout.groups_per_batch=2",
    "rollout.max_concurrent_episodes=8",
    "rollout.max_new_tokens=16",
    "eval.max_new_tokens=16",
    "engine.max_batch_size=8",
    "env.num_env_actors=1",
    "learner.checkpoint_every=2",
    "learner.rl_steps=2",
    "engine.compile_ahead=false",  # compile only the programs two steps run
    "env.name=math_verifier",
    "env.max_turns=1",
    "data.source=jsonl",
]


@pytest.mark.slow
def test_trains_on_a_jsonl_dataset_of_word_problems(ray_session, tmp_path, word_problems):
    cfg = load_config(
        None,
        TINY
        + [
            f"run.output_dir={tmp_path}",
            f"data.path={word_problems}",
            "data.overlong_prompts=drop",
        ],
    )
    assert cfg.warmup.enabled  # on by default, and skipped: the tasks are not arithmetic
    summary = train(cfg)
    assert summary["warm_start_steps"] == 0
    dropped = summary["tasks_dropped"]
    assert dropped["overlong_prompt_train"] + dropped["overlong_prompt_heldout"] == 1
    assert summary["heldout_tasks"] == 2 - dropped["overlong_prompt_heldout"]
    with open(os.path.join(summary["run_dir"], "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if r["phase"] == "rl"]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["num_trajectories"] == 4 for r in records)
    assert 0.0 <= summary["heldout_success_after_rl"] <= 1.0
    # The tokenizer learned these problems: a ~250-character one is far fewer tokens than
    # characters (a tokenizer trained on arithmetic only gave about one per character).
    tokenizer = Tokenizer.load(os.path.join(summary["run_dir"], "tokenizer.json"))
    with open(word_problems) as f:
        question = json.loads(f.readline())["question"]
    assert 200 <= len(question) <= 320
    assert len(tokenizer.encode(question)) < 0.6 * len(question)


def test_a_missing_column_stops_before_training(tmp_path, word_problems):
    cfg = load_config(
        None,
        TINY
        + [
            f"run.output_dir={tmp_path}",
            f"data.path={word_problems}",
            "data.question_column=problem",
        ],
    )
    with pytest.raises(
        ConfigError,
        match=r"data.question_column='problem' is not a column .* "
        r"its columns are \['question', 'answer'\]",
    ):
        train(cfg)
