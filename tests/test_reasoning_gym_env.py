"""The reasoning-gym environment: any of its tasks by name (env.kwargs.task) or through the
run's dataset (data.source=reasoning_gym), scored by reasoning-gym's own scorer."""

import gymnasium
import pytest
import reasoning_gym

from raytunix.config import load_config
from raytunix.data.tasks import dataset_splits
from raytunix.envs import ReasoningGymEnv, make_env, register_gymnasium_ids
from raytunix.types import Action, EpisodeStatus, Task


def _answer(env, task, text):
    env.reset(task)
    return env.step(Action(text=f"<answer>{text}</answer>", answer=text))


@pytest.mark.parametrize("name", ["leg_counting", "spell_backward"])
def test_env_brings_tasks_and_scores_with_reasoning_gyms_scorer(name):
    env = make_env("reasoning_gym", task=name)
    train, heldout = env.tasks("train", 6, 3), env.tasks("heldout", 4, 3)
    assert (len(train), len(heldout)) == (6, 4)
    assert env.tasks("train", 6, 3) == train  # the same seed, the same tasks
    assert not {t.question for t in train} & {t.question for t in heldout}
    scorer = reasoning_gym.get_score_answer_fn(name)
    for task in train[:3]:
        right = _answer(env, task, task.answer)
        assert (right.reward, right.info["correct"], right.done) == (1.0, True, True)
        assert right.status is EpisodeStatus.COMPLETED
        wrong_text = task.answer + "x"
        wrong = _answer(env, task, wrong_text)
        assert wrong.info["score"] == scorer(wrong_text, task.metadata["entry"]) < 1.0
        assert wrong.reward == 0.0 and wrong.info["correct"] is False
    partial = make_env("reasoning_gym", task=name, partial_credit=True)
    wrong_text = train[0].answer + "x"
    assert _answer(partial, train[0], wrong_text).reward == scorer(
        wrong_text, train[0].metadata["entry"]
    )
    env.reset(train[0])
    missing = env.step(Action(text="no tags", parse_error="no <answer> tag"))
    assert (missing.reward, missing.info["parse_error"]) == (0.0, "no <answer> tag")


def test_env_scores_the_runs_reasoning_gym_dataset():
    cfg = load_config(
        "reasoning_gym",
        [
            "env.kwargs={}",
            "data.source=reasoning_gym",
            "data.dataset=spell_backward",
            "data.train_size=5",
            "data.heldout_size=2",
            "eval.heldout_size=2",
        ],
    )
    train, heldout = dataset_splits(cfg.data)
    assert (len(train), len(heldout)) == (5, 2)
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    assert env.tasks("train", 5, 0) is None  # no task name: the run's dataset
    assert _answer(env, heldout[0], heldout[0].answer).reward == 1.0


def test_clear_errors():
    with pytest.raises(
        ValueError, match="'leg_count' is not a reasoning-gym dataset; did you mean leg_counting"
    ):
        ReasoningGymEnv(task="leg_count")
    with pytest.raises(ValueError, match="refuses its settings"):
        ReasoningGymEnv(task="leg_counting", dataset_kwargs={"bogus": 1})
    with pytest.raises(ValueError, match="needs task"):
        ReasoningGymEnv(dataset_kwargs={"min_animals": 2})
    with pytest.raises(ValueError, match="no reasoning-gym entry"):
        ReasoningGymEnv().reset(Task(task_id="t", question="2+2?", answer="4"))


def test_preset_and_gymnasium_id():
    cfg = load_config("reasoning_gym", ["env.kwargs.task=spell_backward"])
    # The warm start is on: the environment's expert gives it demonstrations.
    assert (cfg.env.name, cfg.env.kwargs, cfg.warmup.enabled, cfg.warmup.max_steps) == (
        "reasoning_gym",
        {"task": "spell_backward"},
        True,
        300,
    )
    register_gymnasium_ids()
    env = gymnasium.make("raytunix/reasoning_gym", task="leg_counting", num_tasks=4)
    observation, info = env.reset(seed=0)
    task = next(t for t in env.unwrapped.tasks if t.task_id == info["task_id"])
    assert observation == task.question
    _, reward, terminated, _, _ = env.step(f"<answer>{task.answer}</answer>")
    assert (reward, terminated) == (1.0, True)
