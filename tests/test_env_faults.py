"""One bad environment step ends one episode, with the evidence: whatever a user's
environment returns or raises (a dict, list, bytes or None observation, a None, str or
non-finite reward, a gymnasium tuple, an exception in reset, step or close), that episode
ends as env_error with a report naming the kind, the env class, the task and the file:line
of the user's code, and the run goes on.

This module is imported by the env actors of the end-to-end run (its ``FlakyEnv``), so it
must not import JAX at import time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random

import numpy as np
import pytest

from raytunix.envs import BaseEnv
from raytunix.envs.contract import EnvErrorReport, EnvErrorTally, guarded_call
from raytunix.types import Action, EpisodeStatus, StepResult, Task

THIS_FILE = os.path.abspath(__file__)


class ScriptedEnv(BaseEnv):
    """Its step returns ``StepResult(observation, reward, done=True)`` with the values it
    was built with, or raises ``raises`` when set."""

    default_agent = "answer"

    def __init__(
        self,
        observation="fine",
        reward=1.0,
        result=None,
        raises=None,
        reset_value=None,
        close_raises=None,
    ):
        super().__init__()
        self.observation, self.reward, self.result = observation, reward, result
        self.raises, self.reset_value, self.close_raises = raises, reset_value, close_raises

    def _initial_observation(self, task: Task) -> str:
        if self.reset_value is not None:
            return self.reset_value
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        if self.raises is not None:
            raise self.raises
        if self.result is not None:
            return self.result
        return StepResult(
            observation=self.observation,
            reward=self.reward,
            done=True,
            status=EpisodeStatus.COMPLETED,
        )

    def close(self) -> None:
        if self.close_raises is not None:
            raise self.close_raises


class OwnStepEnv(ScriptedEnv):
    """Overrides ``step`` itself, so nothing of raytunix catches what it raises."""

    def step(self, action: Action) -> StepResult:
        return {"not": "a result"}["missing"]


TASK = Task("t-7", "What is 2+2?", "4")


def _step(env, action=Action(text="<answer>4</answer>", answer="4")):
    env.reset(TASK)
    return guarded_call(env, "step", TASK.task_id, action)


@pytest.mark.parametrize(
    "observation, problem",
    [
        ({"board": [1, 2]}, "observation_dict"),
        ([1, 2], "observation_list"),
        (b"bytes", "observation_bytes"),
        (None, "observation_NoneType"),
    ],
)
def test_an_observation_that_is_not_text_is_reported_with_its_kind(observation, problem):
    report = _step(ScriptedEnv(observation=observation))
    assert isinstance(report, EnvErrorReport)
    assert report.kind == f"ScriptedEnv.step:{problem}"
    assert report.env_class == f"{__name__}.ScriptedEnv" and report.task_id == "t-7"
    assert "return a str" in report.message
    path, line = report.location.rsplit(":", 1)
    assert path == THIS_FILE and int(line) == ScriptedEnv._step_impl.__code__.co_firstlineno


@pytest.mark.parametrize(
    "reward, problem",
    [
        (None, "reward_NoneType"),
        ("1.0", "reward_str"),
        (float("nan"), "reward_nan"),
        (float("inf"), "reward_inf"),
        (np.array([1.0, 2.0]), "reward_ndarray"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_is_reported(reward, problem):
    report = _step(ScriptedEnv(reward=reward))
    assert isinstance(report, EnvErrorReport) and report.kind == f"ScriptedEnv.step:{problem}"


@pytest.mark.parametrize("reward", [1e39, -1e308, np.float64(3.5e38)])
def test_a_finite_reward_too_large_for_a_float32_batch_is_reported(reward):
    # Batches hold rewards as float32: a larger float64 reward would turn into inf there
    # and stop the learner's update, so it ends the episode here instead.
    report = _step(ScriptedEnv(reward=reward))
    assert isinstance(report, EnvErrorReport)
    assert report.kind == "ScriptedEnv.step:reward_out_of_range" and "float32" in report.message


def test_the_largest_float32_reward_is_taken():
    result = _step(ScriptedEnv(reward=float(np.finfo(np.float32).max)))
    assert isinstance(result, StepResult) and np.isfinite(np.float32(result.reward))


@pytest.mark.parametrize("reward", [np.float32(0.5), np.int64(1), np.array(0.25), 1, True])
def test_numpy_and_integer_rewards_are_taken_as_floats(reward):
    result = _step(ScriptedEnv(reward=reward))
    assert isinstance(result, StepResult)
    assert type(result.reward) is float and result.reward == float(reward)


def test_a_gymnasium_tuple_from_step_is_named_as_such():
    report = _step(ScriptedEnv(result=("obs", 1.0, True, False, {})))
    assert report.kind == "ScriptedEnv.step:result_tuple"
    assert "BaseEnv.from_gymnasium" in report.message


def test_an_exception_in_step_is_reported_with_the_line_that_raised():
    report = _step(OwnStepEnv())
    assert report.kind == "OwnStepEnv.step:KeyError"
    assert report.location == f"{THIS_FILE}:{OwnStepEnv.step.__code__.co_firstlineno + 1}"
    assert "KeyError: 'missing'" in report.traceback and THIS_FILE in report.traceback
    # Raised inside _step_impl and caught by BaseEnv.step: the same report.
    caught = _step(ScriptedEnv(raises=ZeroDivisionError("division by zero")))
    assert caught.kind == "ScriptedEnv.step:ZeroDivisionError"
    assert caught.location.startswith(THIS_FILE + ":") and "ZeroDivisionError" in caught.traceback


def test_reset_and_close_are_checked_too():
    env = ScriptedEnv(reset_value={"grid": "..."})
    report = guarded_call(env, "reset", TASK.task_id, TASK)
    assert report.kind == "ScriptedEnv.reset:observation_dict"
    env = ScriptedEnv(close_raises=OSError("disk gone"))
    report = guarded_call(env, "close", TASK.task_id)
    assert report.kind == "ScriptedEnv.close:OSError" and "disk gone" in report.message


def test_the_first_report_of_each_kind_is_kept_and_the_others_counted():
    tally = EnvErrorTally()
    for env in (
        ScriptedEnv(reward=None),
        ScriptedEnv(reward=None),
        OwnStepEnv(),
        ScriptedEnv(reward=None),
    ):
        tally.add(_step(env))
    reports, counts = tally.take()
    assert [r["kind"] for r in reports] == [
        "ScriptedEnv.step:reward_NoneType",
        "OwnStepEnv.step:KeyError",
    ]
    assert counts == {"ScriptedEnv.step:reward_NoneType": 3, "OwnStepEnv.step:KeyError": 1}
    tally.add(_step(OwnStepEnv()))
    assert tally.take() == ([], {"OwnStepEnv.step:KeyError": 1})  # seen: counted only
    resumed = EnvErrorTally(tally.counts)
    resumed.add(_step(OwnStepEnv()))
    assert resumed.take()[0] == []


class _Answer:
    """Answers every request with ``<answer>4</answer><|end|>``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, request):
        from raytunix.types import FinishReason, GenerationResult

        ids = (*self.tokenizer.encode("<answer>4</answer>"), self.tokenizer.end_id)
        return GenerationResult(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=(-0.5,) * len(ids),
            policy_versions=(0,) * len(ids),
            finish_reason=FinishReason.STOP,
        )


def _episode(**env_kwargs):
    from raytunix.agents import make_agent
    from raytunix.models.tokenizer import Tokenizer
    from raytunix.rollout.env_pool import LocalEnv
    from raytunix.rollout.episode import run_episode
    from raytunix.types import SamplingParams

    tokenizer = Tokenizer.byte_level()
    return asyncio.run(
        run_episode(
            TASK,
            "g0",
            make_agent("answer", tokenizer),
            LocalEnv(f"{__name__}:ScriptedEnv", env_kwargs),
            _Answer(tokenizer),
            SamplingParams(max_new_tokens=32),
            max_turns=1,
            max_context_tokens=256,
            seed=0,
            timeout_s=30.0,
        )
    )


@pytest.mark.parametrize(
    "env_kwargs, kind",
    [
        ({"observation": {"a": 1}}, "ScriptedEnv.step:observation_dict"),
        ({"reward": None}, "ScriptedEnv.step:reward_NoneType"),
        ({"reward": float("nan")}, "ScriptedEnv.step:reward_nan"),
        ({"raises": RuntimeError("boom")}, "ScriptedEnv.step:RuntimeError"),
        ({"reset_value": ["a", "list"]}, "ScriptedEnv.reset:observation_list"),
        ({"close_raises": ValueError("leak")}, "ScriptedEnv.close:ValueError"),
    ],
)
def test_an_episode_whose_env_fails_ends_as_env_error_with_the_report(env_kwargs, kind):
    trajectory = _episode(**env_kwargs)
    assert trajectory.status == EpisodeStatus.ENV_ERROR and trajectory.reward == 0.0
    assert trajectory.error_report.kind == kind and kind in trajectory.error


class _TwoHugeStepsEnv(ScriptedEnv):
    """Two steps of 3e38 each: every step is in float32's range, their sum is not."""

    def _step_impl(self, action: Action) -> StepResult:
        self.steps = getattr(self, "steps", 0) + 1
        return StepResult(
            observation="more",
            reward=3e38,
            done=self.steps >= 2,
            status=EpisodeStatus.COMPLETED if self.steps >= 2 else None,
        )


def test_an_episode_whose_rewards_sum_past_float32_ends_as_env_error():
    from raytunix.agents import make_agent
    from raytunix.models.tokenizer import Tokenizer
    from raytunix.rollout.env_pool import LocalEnv
    from raytunix.rollout.episode import run_episode
    from raytunix.types import SamplingParams

    tokenizer = Tokenizer.byte_level()
    trajectory = asyncio.run(
        run_episode(
            TASK,
            "g0",
            make_agent("answer", tokenizer),
            LocalEnv(f"{__name__}:_TwoHugeStepsEnv", {}),
            _Answer(tokenizer),
            SamplingParams(max_new_tokens=32),
            max_turns=2,
            max_context_tokens=256,
            seed=0,
            timeout_s=30.0,
        )
    )
    assert trajectory.status == EpisodeStatus.ENV_ERROR and trajectory.reward == 0.0
    assert "float32" in trajectory.error


def test_an_episode_whose_env_returns_a_numpy_reward_completes():
    trajectory = _episode(reward=np.float64(1.0))
    assert trajectory.status == EpisodeStatus.COMPLETED and trajectory.reward == 1.0
    assert trajectory.error_report is None


# --- end to end: `raytunix train` with an environment that fails in three ways ----------

_STEPS = itertools.count()  # per env actor process: the kind of each step comes in turn


class FlakyEnv(BaseEnv):
    """Parity questions; of every four steps one returns a dict observation, one a None
    reward, one raises, one is a correct step. Its agent takes any reply as the action,
    so an untrained policy's replies reach ``step`` too."""

    default_agent = "text"

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        rng = random.Random(f"{split}/{seed}")
        numbers = [rng.randint(0, 50) for _ in range(size)]
        return [
            Task(
                f"{split}-{i}",
                f"Is {n} even or odd? Reply even or odd.",
                "even" if n % 2 == 0 else "odd",
            )
            for i, n in enumerate(numbers)
        ]

    def _initial_observation(self, task: Task) -> str:
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        turn = next(_STEPS) % 4
        if turn == 1:
            return StepResult(observation={"board": self.task.question}, reward=0.0)
        if turn == 2:
            return StepResult(observation="", reward=None, done=True)
        if turn == 3:
            return {"even": 0, "odd": 1}[action.text]  # KeyError for any other reply
        correct = action.text.strip().lower() == self.task.answer
        return StepResult(
            observation="", reward=float(correct), done=True, status=EpisodeStatus.COMPLETED
        )


@pytest.mark.slow
def test_a_run_whose_env_returns_bad_values_and_raises_finishes_with_the_evidence(
    ray_session, tmp_path, capsys
):
    from test_byo_env import _rl_steps, _run_dirs, _train

    _train(tmp_path, f"env.name={__name__}:FlakyEnv", "env.max_turns=2")
    (run_dir,) = _run_dirs(tmp_path)
    assert _rl_steps(run_dir) == [1, 2]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    kinds = {
        "FlakyEnv.step:observation_dict",
        "FlakyEnv.step:reward_NoneType",
        "FlakyEnv.step:KeyError",
    }
    by_kind = summary["env_errors_by_kind"]
    assert set(by_kind) == kinds
    assert summary["orchestrator"]["episodes_env_error"] >= 3
    assert sum(by_kind.values()) >= summary["orchestrator"]["episodes_env_error"]
    with open(os.path.join(run_dir, "env_errors.jsonl")) as f:
        reports = [json.loads(line) for line in f]
    assert sorted(r["kind"] for r in reports) == sorted(kinds)  # the first of each, once
    for r in reports:
        assert r["env_class"] == f"{__name__}.FlakyEnv" and r["task_id"]
        assert r["location"].startswith(THIS_FILE + ":")
    (raised,) = [r for r in reports if r["kind"] == "FlakyEnv.step:KeyError"]
    assert "KeyError" in raised["traceback"] and THIS_FILE in raised["traceback"]
    assert "env error FlakyEnv.step:KeyError (first of its kind" in capsys.readouterr().out
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    counted = {}
    for r in records:
        for kind, n in (r.get("env_errors") or {}).items():
            counted[kind] = counted.get(kind, 0) + n
    assert counted == by_kind
    assert not math.isnan(summary["heldout_success_after_rl"])


# --- the start-up prompt check resets sampled tasks through EnvActor.first_observation ---


def test_the_prompt_check_names_a_reset_that_returns_no_text():
    # Before: the list reached the agent's template and the run died with a raw
    # "TypeError: message content must be a str" traceback, exit 1.
    from raytunix.envs.contract import EnvContractError
    from raytunix.rollout.env_pool import EnvActor

    actor = EnvActor(f"{__name__}:ScriptedEnv", {"reset_value": ["a", "list"]}, max_threads=1)
    with pytest.raises(EnvContractError, match="ScriptedEnv.reset returned a list observation"):
        actor.first_observation(TASK)


def test_the_prompt_check_measures_a_task_whose_close_raises():
    # The episode's close is reported (env_error, with its traceback) when the episode
    # runs; measuring the prompt must not stop the run over it.
    from raytunix.rollout.env_pool import EnvActor

    actor = EnvActor(f"{__name__}:_CloseRaisesAfterResetEnv", {}, max_threads=1)
    assert actor.first_observation(TASK) == TASK.question


class _CloseRaisesAfterResetEnv(ScriptedEnv):
    """Builds and closes cleanly; its close raises once it has been reset on a task."""

    def close(self) -> None:
        if self.task is not None:
            raise OSError("close failed after a reset")
