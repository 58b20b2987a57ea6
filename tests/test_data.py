import json
import random

import pytest
import reasoning_gym

from raytunix.agents import ToolAgent
from raytunix.data import (
    DEFAULT_TOOL_USE_PROB,
    make_arithmetic_splits,
    make_demonstration,
    sample_demonstrations,
    score_answer,
    tokenizer_corpus,
)
from raytunix.envs import CalculatorMathEnv
from raytunix.models.chat_template import render_chat
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import EpisodeStatus, Task


@pytest.fixture(scope="module")
def splits():
    return make_arithmetic_splits(300, 100, seed=0)


def test_splits_have_stable_ids_and_plain_metadata(splits):
    train, heldout = splits
    assert [t.task_id for t in train[:2]] == ["train-000000", "train-000001"]
    assert [t.task_id for t in heldout[-1:]] == ["heldout-000099"]
    assert (len(train), len(heldout)) == (300, 100)
    task = train[0]
    assert json.loads(json.dumps(task.metadata)) == task.metadata
    assert task.metadata["entry"]["question"] == task.question
    assert task.metadata["entry"]["answer"] == task.answer
    assert task.metadata["num_terms"] in (2, 3)
    assert make_arithmetic_splits(300, 100, seed=0) == splits
    assert make_arithmetic_splits(300, 100, seed=1)[0] != train


def test_heldout_is_disjoint_from_train_and_topped_up():
    # One-digit two-term expressions collide often, so dropping duplicates needs top-ups.
    settings = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    train, heldout = make_arithmetic_splits(800, 200, seed=0, **settings)
    train_questions = {t.question for t in train}
    assert len(heldout) == 200
    assert not train_questions & {t.question for t in heldout}
    assert len({t.question for t in heldout}) == 200
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=200, seed=800, **settings)
    # There was something to drop.
    assert sum(entry["question"] in train_questions for entry in dataset) > 0


def test_impossible_heldout_size_raises():
    # One one-digit term allows only 19 distinct questions.
    with pytest.raises(ValueError, match="held-out"):
        make_arithmetic_splits(5, 30, seed=0, min_terms=1, max_terms=1, min_digits=1, max_digits=1)


def test_score_answer_pays_only_exact_answers(splits):
    task = splits[0][0]
    assert score_answer(task, task.answer) == 1.0
    assert score_answer(task, f" {task.answer}\n") == 1.0
    assert score_answer(task, None) == 0.0
    assert score_answer(task, "") == 0.0
    # reasoning-gym gives partial credit to a reply that contains the answer; we do not.
    near_miss = "1" + task.answer
    reasoning_gym_score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    assert reasoning_gym_score(near_miss, task.metadata["entry"]) > 0
    assert score_answer(task, near_miss) == 0.0


def test_score_answer_without_entry_compares_numbers():
    task = Task(task_id="x", question="?", answer="-1130")
    assert score_answer(task, "-1130.0") == 1.0
    assert score_answer(task, "1130") == 0.0
    assert score_answer(Task(task_id="y", question="?", answer="yes"), "yes") == 1.0
    assert score_answer(Task(task_id="y", question="?", answer="yes"), "no") == 0.0


def test_demonstration_format_matches_the_contract():
    task = Task("t", "Calculate 95 - 21.", "74", {"expression": "95 - 21", "num_terms": 2})
    assert render_chat(make_demonstration(task, use_tool=True)) == (
        "<|user|>Calculate 95 - 21.<|end|>"
        '<|assistant|><tool_call>{"name": "calculator", "arguments": '
        '{"expression": "95 - 21"}}</tool_call><|end|>'
        "<|tool|>74<|end|>"
        "<|assistant|><answer>74</answer><|end|>"
    )
    assert render_chat(make_demonstration(task, use_tool=False)) == (
        "<|user|>Calculate 95 - 21.<|end|><|assistant|><answer>74</answer><|end|>"
    )
    with pytest.raises(ValueError, match="calculator gives"):
        make_demonstration(Task("bad", "?", "75", {"expression": "95 - 21"}), use_tool=True)
    with pytest.raises(ValueError, match="expression"):
        make_demonstration(Task("bad", "?", "74"), use_tool=True)


def test_demonstrations_replayed_in_the_env_earn_full_reward(splits):
    """Each demonstration's assistant turns, fed to the environment, solve the task."""
    tokenizer = Tokenizer.byte_level()
    train = splits[0][:60]
    demonstrations = sample_demonstrations(train, random.Random(0))
    for task, messages in zip(train, demonstrations):
        env, agent = CalculatorMathEnv(), ToolAgent(tokenizer)
        assert env.reset(task) == messages[0]["content"]
        for index, message in enumerate(messages[1:], start=1):
            if message["role"] != "assistant":
                continue
            step = env.step(agent.parse(message["content"] + "<|end|>"))
            if not step.done:
                assert step.observation == messages[index + 1]["content"]
        assert (step.reward, step.status) == (1.0, EpisodeStatus.COMPLETED), messages
        token_ids, _ = agent.render_demonstration(task, messages)
        assert token_ids == tokenizer.encode(render_chat(messages))


def test_tool_use_follows_the_probability_per_num_terms(splits):
    train = splits[0]
    rng = random.Random(1)
    uses = {2: [], 3: []}
    for _ in range(5):
        for task, messages in zip(train, sample_demonstrations(train, rng)):
            uses[task.metadata["num_terms"]].append(len(messages) == 4)
    for num_terms, flags in uses.items():
        assert sum(flags) / len(flags) == pytest.approx(DEFAULT_TOOL_USE_PROB[num_terms], abs=0.06)
    assert all(len(m) == 4 for m in sample_demonstrations(train[:20], rng, {2: 1.0, 3: 1.0}))
    with pytest.raises(ValueError, match="num_terms=3"):
        sample_demonstrations(train, rng, {2: 0.5})


def test_trained_tokenizer_keeps_demonstrations_token_exact(splits):
    train, heldout = splits
    tokenizer = Tokenizer.train(tokenizer_corpus(train), vocab_size=400)
    for task in heldout[:20]:
        messages = make_demonstration(task, use_tool=True)
        token_ids, loss_mask = ToolAgent(tokenizer).render_demonstration(task, messages)
        assert token_ids == tokenizer.encode(render_chat(messages))
        assert tokenizer.decode([t for t, m in zip(token_ids, loss_mask) if m]) == (
            messages[1]["content"] + "<|end|>" + messages[3]["content"] + "<|end|>"
        )


def test_tokenizer_corpus_renders_both_variants(splits):
    texts = list(tokenizer_corpus(splits[0][:3]))
    assert len(texts) == 6
    assert all(text.startswith("<|user|>") and text.endswith("</answer><|end|>") for text in texts)
    assert sum("<tool_call>" in text for text in texts) == 3
