"""Every train and held-out task's first prompt is length-checked in tokens before training,
wherever its row sits: an over-long one stops the run naming it (or, with
data.overlong_prompts=drop, is left out and counted), so it never becomes a group that
ends before its first generation. The env actors are stood in for by an in-process pool
whose first_observation is EnvActor.first_observation's body (build, reset, close)."""

import os
import random

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from raytunix.agents import make_agent  # noqa: E402
from raytunix.config import ConfigError, load_config  # noqa: E402
from raytunix.driver import prepare  # noqa: E402
from raytunix.driver.run_dir import RunError  # noqa: E402
from raytunix.envs import make_env  # noqa: E402
from raytunix.envs.math_envs import MathVerifierEnv  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout import preflight  # noqa: E402
from raytunix.types import Task  # noqa: E402

LONG_QUESTION = "Compute " + "1 + " * 2500 + "1."  # 10,000 bytes


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _Actor:
    def __init__(self, new_env, resets):
        def first_observation(task):  # EnvActor.first_observation
            resets.append(task.task_id)
            env = new_env()
            try:
                return env.reset(task)
            finally:
                env.close()

        self.first_observation = _Method(first_observation)


class _Pool:
    def __init__(self, new_env=lambda: make_env("math_verifier"), name="math_verifier"):
        self.env_name = name
        self.resets = []
        self.actors = [_Actor(new_env, self.resets)]


class DocumentEnv(MathVerifierEnv):
    """First observation: a document from the task's metadata, not the question."""

    def _initial_observation(self, task):
        return task.metadata["document"]


@pytest.fixture(autouse=True)
def _in_process_ray_get(monkeypatch):
    monkeypatch.setattr(preflight.ray, "get", lambda ref, timeout=None: ref)


def _cfg(*overrides):
    return load_config(
        None, ["env.name=math_verifier", "env.max_turns=1", "model.max_seq_len=256", *overrides]
    )


def _tasks(n=500, long_rows=(), split="train"):
    tasks = [
        Task(f"{split}-{i:06d}", f"What is {i} + 1?", str(i + 1), {"row": i}) for i in range(n)
    ]
    for i in long_rows:
        tasks[i] = Task(f"{split}-{i:06d}", LONG_QUESTION, "2501", {"row": i})
    return tasks


def _split(train, heldout=None):
    heldout = heldout if heldout is not None else _tasks(20, split="heldout")
    return prepare.Tasks(train=train, heldout=heldout, dev=train[-8:], source="test")


@pytest.mark.parametrize("row", [1, 137, 250, 498])
def test_an_overlong_training_row_is_refused_wherever_it_sits(row):
    tasks = _split(_tasks(long_rows=[row]))
    with pytest.raises(RunError) as e:
        prepare.check_prompts(_cfg(), _Pool(), tasks, Tokenizer.byte_level())
    message = str(e.value)
    assert f"task 'train-{row:06d}' (row {row}, 10013 tokens)" in message
    assert "1 of 500 train and 0 of 20 held-out tasks" in message
    assert "Raise model.max_seq_len above 10013" in message
    assert "data.overlong_prompts=drop" in message


def test_an_overlong_heldout_row_is_refused_too():
    tasks = _split(_tasks(), _tasks(20, long_rows=[13], split="heldout"))
    with pytest.raises(
        RunError,
        match=r"0 of 500 train and 1 of 20 held-out tasks .* "
        r"task 'heldout-000013' \(row 13, 10013 tokens\)",
    ):
        prepare.check_prompts(_cfg(), _Pool(), tasks, Tokenizer.byte_level())


def test_the_error_names_the_tokenizer_vocabulary():
    with pytest.raises(
        RunError,
        match=r"The run's tokenizer has 266 ids; a small vocabulary "
        r"spends about a token per byte, so a larger "
        r"model.tokenizer_vocab_size",
    ):
        prepare.check_prompts(
            _cfg(), _Pool(), _split(_tasks(long_rows=[9])), Tokenizer.byte_level()
        )


def test_many_overlong_rows_are_counted_and_the_first_ones_named():
    tasks = _split(_tasks(long_rows=range(100, 120)))
    with pytest.raises(
        RunError,
        match=r"20 of 500 train .* task 'train-000100' \(row 100, "
        r"10013 tokens\), .*, and 12 more",
    ):
        prepare.check_prompts(_cfg(), _Pool(), tasks, Tokenizer.byte_level())


def test_drop_leaves_out_the_overlong_rows_and_counts_them():
    train = _tasks(long_rows=[3, 137])
    heldout = _tasks(20, long_rows=[5], split="heldout")
    kept = prepare.check_prompts(
        _cfg("data.overlong_prompts=drop"), _Pool(), _split(train, heldout), Tokenizer.byte_level()
    )
    assert [t.task_id for t in kept.train] == [
        t.task_id for i, t in enumerate(train) if i not in (3, 137)
    ]
    assert len(kept.heldout) == 19 and "heldout-000005" not in {t.task_id for t in kept.heldout}
    assert kept.dropped == {"overlong_prompt_train": 2, "overlong_prompt_heldout": 1}
    assert kept.dev == kept.train[-_cfg().warmup.eval_size :]


def test_nothing_is_dropped_from_tasks_that_fit():
    tasks = _split(_tasks())
    assert (
        prepare.check_prompts(
            _cfg("data.overlong_prompts=drop"), _Pool(), tasks, Tokenizer.byte_level()
        )
        is tasks
    )
    assert tasks.dropped == {"overlong_prompt_train": 0, "overlong_prompt_heldout": 0}


def test_drop_that_would_empty_a_split_is_refused():
    train = [Task(f"train-{i}", LONG_QUESTION, "1", {"row": i}) for i in range(30)]
    with pytest.raises(RunError, match="every train task would be dropped"):
        prepare.check_prompts(
            _cfg("data.overlong_prompts=drop"), _Pool(), _split(train), Tokenizer.byte_level()
        )


def test_the_policy_key_is_checked():
    with pytest.raises(ConfigError, match="data.overlong_prompts='skip' is not one of error, drop"):
        _cfg("data.overlong_prompts=skip")


def test_only_the_samples_and_the_flagged_rows_go_through_the_environment():
    train = _tasks(2000, long_rows=[777])
    pool = _Pool()
    samples = preflight.sample_tasks(train, 24)
    check = preflight.check_prompt_lengths(
        pool,
        train,
        samples,
        lambda: make_agent("answer", Tokenizer.byte_level()),
        Tokenizer.byte_level(),
        256,
    )
    assert check.bound_applies
    assert [t.task_id for t, _ in check.too_long] == ["train-000777"]
    assert sorted(pool.resets) == sorted([t.task_id for t in samples] + ["train-000777"])


def test_a_row_the_bound_flags_but_that_fits_is_kept():
    tokenizer = Tokenizer.byte_level()
    agent = make_agent("answer", tokenizer)
    agent.reset(Task("x", "", ""), "")
    overhead = len(agent.token_ids)
    # Two tokens short of the limit: inside the bound's slack, so measured exactly, and kept.
    near = Task("near", "9" * (256 - overhead - 2), "1", {"row": 50})
    train = _tasks(100)
    train[50] = near
    pool = _Pool()
    check = preflight.check_prompt_lengths(
        pool,
        train,
        preflight.sample_tasks(train, 8),
        lambda: make_agent("answer", tokenizer),
        tokenizer,
        256,
    )
    assert "near" in pool.resets and check.too_long == []
    over = Task("over", "9" * (256 - overhead), "1", {"row": 50})  # leaves no token
    train[50] = over
    check = preflight.check_prompt_lengths(
        _Pool(),
        train,
        preflight.sample_tasks(train, 8),
        lambda: make_agent("answer", tokenizer),
        tokenizer,
        256,
    )
    assert [(t.task_id, n) for t, n in check.too_long] == [("over", 256)]


def test_an_env_whose_first_observation_is_not_the_question_is_measured_row_by_row():
    train = [
        Task(f"train-{i}", f"question {i}", "1", {"row": i, "document": "short document"})
        for i in range(60)
    ]
    train[41] = Task("train-41", "question 41", "1", {"row": 41, "document": "x " * 400})
    pool = _Pool(DocumentEnv, name="document")
    tokenizer = Tokenizer.byte_level()
    check = preflight.check_prompt_lengths(
        pool,
        train,
        preflight.sample_tasks(train, 4),
        lambda: make_agent("answer", tokenizer),
        tokenizer,
        256,
    )
    assert not check.bound_applies and check.measured_exactly == 60
    assert [t.task_id for t, _ in check.too_long] == ["train-41"]


@pytest.mark.parametrize(
    "tokenizer",
    [
        Tokenizer.byte_level(),
        Tokenizer.train(
            [f"What is {i} plus {i * 7}? Tom has {i} apples." for i in range(300)], 400
        ),
    ],
    ids=["byte_level", "trained"],
)
def test_the_byte_bound_is_never_below_the_token_count(tokenizer):
    rng = random.Random(0)
    alphabet = "ab 12+\n\t.?<|end|>\u00e9\u4e2d\U0001f600\u200b\ud800"
    texts = [
        "",
        " ",
        "<|end|><|user|>",
        *("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(300)),
    ]
    counts = tokenizer.count_tokens(texts)
    bounds = tokenizer.token_count_bounds(texts)
    assert counts == [
        len(tokenizer.encode(t.encode("utf-8", "replace").decode("utf-8"), special_tokens=False))
        for t in texts
    ]
    assert all(c <= b for c, b in zip(counts, bounds))
