"""Bring your own environment, as a new user would: an environment written here, outside
the package, trains through ``raytunix train env.name=test_byo_env:ParityEnv``; a plain
text gymnasium environment trains through the gymnasium adapter; runs that cannot train
stop before training with one clear error and exit code 2.

This module is imported by the env actors (that is the point), so it must not import JAX:
``raytunix.train`` is imported inside the tests that need it.
"""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys

import gymnasium
import pytest

from raytunix.envs import BaseEnv
from raytunix.types import Action, EpisodeStatus, StepResult, Task

# --- the README's example (section "Bring your own environment"), verbatim -----------------


class ParityEnv(BaseEnv):
    """Is a number even or odd? Reward 1 for the right word."""

    default_agent = "answer"  # the model replies <answer>even</answer>

    def __init__(self, max_number: int = 99, instructions: str = "Reply even or odd."):
        super().__init__()
        if max_number < 1:
            raise ValueError(f"max_number must be >= 1, got {max_number}")
        self.max_number, self.instructions = max_number, instructions

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        rng = random.Random(f"{split}/{seed}")
        numbers = [rng.randint(0, self.max_number) for _ in range(size)]
        questions = [f"Is {n} even or odd? {self.instructions}" for n in numbers]
        parity = ["even" if n % 2 == 0 else "odd" for n in numbers]
        return [Task(f"{split}-{i}", q, a) for i, (q, a) in enumerate(zip(questions, parity))]

    def _initial_observation(self, task: Task) -> str:
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        correct = (action.answer or "").strip().lower() == self.task.answer
        info = {"correct": correct}
        return StepResult("", float(correct), True, EpisodeStatus.COMPLETED, info)


# --- a plain text gymnasium environment ------------------------------------------------------

WORDS = ("apple", "river", "stone", "cloud", "maple", "ember")


class RepeatWordEnv(gymnasium.Env):
    """Shows a word; the reply must repeat it. Reward 1 and done on a match; after two
    misses the episode is truncated."""

    metadata = {"render_modes": []}

    def __init__(self, max_misses: int = 2):
        self.observation_space = gymnasium.spaces.Text(64, charset=string.printable)
        self.action_space = gymnasium.spaces.Text(256, min_length=0, charset=string.printable)
        self.max_misses = max_misses

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.word = WORDS[int(self.np_random.integers(len(WORDS)))]
        self.misses = 0
        return f"Repeat the word: {self.word}", {}

    def step(self, action):
        if action.strip() == self.word:
            return "correct", 1.0, True, False, {}
        self.misses += 1
        return f"no, the word is {self.word}", 0.0, False, self.misses >= self.max_misses, {}


class ImageObservationEnv(gymnasium.Env):
    """Not a text environment: a Box observation space."""

    def __init__(self):
        self.observation_space = gymnasium.spaces.Box(0.0, 1.0, shape=(2,))
        self.action_space = gymnasium.spaces.Text(8)


class NumberObservationEnv(RepeatWordEnv):
    """Declares Text spaces but returns a number from reset."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 42, {}


# --- the runs ----------------------------------------------------------------------------------

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
TINY = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=64",
    "model.max_seq_len=128",
    "model.tokenizer_vocab_size=300",
    "data.train_size=200",
    "data.heldout_size=8",
    "eval.heldout_size=8",
    "rollout.group_size=2",
    "rollout.groups_per_batch=2",
    "rollout.max_concurrent_episodes=8",
    "rollout.max_new_tokens=16",
    "engine.max_batch_size=8",
    "env.num_env_actors=1",
    "learner.checkpoint_every=1",
    "learner.rl_steps=2",
]


def _cli_train(ray_session, tmp_path, *overrides):
    """``python -m raytunix.cli train ...`` in a new process, as a user runs it, joined to
    the test session's Ray cluster (RAY_ADDRESS) so that no second cluster starts."""
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            p for p in (REPO, TESTS_DIR, os.environ.get("PYTHONPATH")) if p
        ),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "raytunix.cli",
            "train",
            *TINY,
            f"run.output_dir={tmp_path}",
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


# What a run that shows "this environment trains by config" needs on top of TINY: few tasks
# (the tokenizer trains on them, an expert demonstrates each, the prompt check resets some),
# two held-out ones evaluated before and after RL, one checkpoint, and the engine compiling
# only the programs it runs (compiling every reachable one ahead costs more than two steps).
SMALL = [
    "data.train_size=32",
    "data.heldout_size=2",
    "eval.heldout_size=2",
    "learner.checkpoint_every=2",
    "engine.compile_ahead=false",
]


def _train(tmp_path, *overrides):
    """``train(cfg)`` of the TINY + SMALL run in this process, on the test session's Ray
    (the caller asks for ``ray_session``): where the command line is not the point, a run
    needs no process of its own, whose start and imports cost seconds. The driver's lines
    go to this process's stdout (``capsys``); returns the summary."""
    from raytunix.config import load_config
    from raytunix.train import train

    overrides = [*TINY, *SMALL, f"run.output_dir={tmp_path}", *overrides]
    return train(load_config("default", overrides))  # the preset `raytunix train` starts from


def _run_dirs(tmp_path):
    return [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]


def _rl_steps(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r["step"] for r in map(json.loads, f) if r["phase"] == "rl"]


@pytest.mark.slow
def test_own_env_trains_by_import_path_from_the_command_line(ray_session, tmp_path):
    result = _cli_train(
        ray_session,
        tmp_path,
        "env.name=test_byo_env:ParityEnv",
        "env.kwargs.max_number=50",
        "env.max_turns=1",
        *SMALL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warm start: skipped" in result.stdout
    # ...once, naming the three ways to get one (the env has no expert, the tasks no file).
    assert result.stdout.count("warm start: skipped") == 1
    for way in ("warmup.demonstrations=FILE", "demonstrate(task) expert", "arithmetic tasks"):
        assert way in result.stdout
    assert "tasks: the environment's own" in result.stdout
    (run_dir,) = _run_dirs(tmp_path)
    assert _rl_steps(run_dir) == [1, 2]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["env"] == "test_byo_env:ParityEnv" and summary["heldout_tasks"] == 2
    assert summary["warm_start_steps"] == 0
    with open(os.path.join(run_dir, "config.yaml")) as f:
        assert "max_number: 50" in f.read()


@pytest.mark.slow
def test_env_that_cannot_be_built_in_the_actors_stops_before_training(ray_session, tmp_path):
    # The signature accepts max_number, so the config passes; the constructor refuses the
    # value in the env actor, and that is the one error the run ends with.
    result = _cli_train(
        ray_session, tmp_path, "env.name=test_byo_env:ParityEnv", "env.kwargs.max_number=0"
    )
    assert result.returncode == 2
    (message,) = [line for line in result.stderr.splitlines() if line.startswith("raytunix: ")]
    assert "env actors are not ready" in message
    assert "ValueError: max_number must be >= 1, got 0" in message
    assert _run_dirs(tmp_path) == []  # stopped before training: no run directory is left


@pytest.mark.slow
def test_prompts_longer_than_the_context_stop_before_training(ray_session, tmp_path):
    # In this process: the command line's exit 2 with one `raytunix: <RunError>` line is
    # the test above's; this one is about the check and its message.
    from raytunix.train import RunError

    long_instructions = " ".join(str(i) for i in range(200))  # ~700 characters
    with pytest.raises(RunError) as e:
        _train(
            tmp_path,
            "env.name=test_byo_env:ParityEnv",
            f"env.kwargs.instructions={long_instructions}",
        )
    message = str(e.value)
    assert "have a first prompt that leaves no room for a reply in model.max_seq_len=128" in message
    assert "Raise model.max_seq_len above" in message
    assert _run_dirs(tmp_path) == []  # stopped before training: no run directory is left


def test_bad_env_kwargs_are_refused_at_config_time_naming_the_key():
    from raytunix.config import ConfigError, load_config

    with pytest.raises(
        ConfigError,
        match="env.kwargs.max_numbr: ParityEnv takes no argument "
        "'max_numbr'; it accepts max_number, instructions",
    ):
        load_config(None, ["env.name=test_byo_env:ParityEnv", "env.kwargs.max_numbr=5"])
    with pytest.raises(ConfigError, match="env.kwargs.max_number='many' must be int"):
        load_config(None, ["env.name=test_byo_env:ParityEnv", "env.kwargs.max_number=many"])
    with pytest.raises(
        ConfigError,
        match="env.agent_kwargs.temperature: AnswerAgent takes no argument 'temperature'",
    ):
        load_config(None, ["env.name=test_byo_env:ParityEnv", "env.agent_kwargs.temperature=1"])
    with pytest.raises(ConfigError, match="has no attribute 'Parity'; it defines: .*ParityEnv"):
        load_config(None, ["env.name=test_byo_env:Parity"])
    cfg = load_config(
        None,
        [
            "env.name=test_byo_env:ParityEnv",
            "env.kwargs.max_number=5",
            "env.agent=text",
            "env.agent_kwargs.system_prompt=Be brief.",
        ],
    )
    assert cfg.env.kwargs == {"max_number": 5}
    assert cfg.env.agent_kwargs == {"system_prompt": "Be brief."}


@pytest.mark.slow
def test_text_gymnasium_env_trains_through_the_adapter(ray_session, tmp_path):
    summary = _train(
        tmp_path,
        "env.name=gymnasium",
        "env.kwargs.env_id=test_byo_env:RepeatWordEnv",
        "env.kwargs.make_kwargs={max_misses: 1}",
        "env.max_turns=2",
    )
    assert _rl_steps(summary["run_dir"]) == [1, 2]
    assert summary["warm_start_steps"] == 0  # the adapter brings its own tasks: reset seeds
    statuses = summary["orchestrator"]
    assert statuses["episodes_env_error"] == 0  # every episode ran in the env actors
    assert statuses["episodes_completed"] + statuses["episodes_truncated"] > 0


@pytest.mark.slow
def test_env_actors_import_the_users_module_and_keep_jax_out(ray_session):
    from raytunix import plugins
    from raytunix.rollout.env_pool import EnvPool

    roots = [plugins.import_root(ParityEnv)]
    assert roots == [TESTS_DIR]
    pool = EnvPool("test_byo_env:ParityEnv", {"max_number": 7}, num_actors=1, import_paths=roots)
    try:
        pool.wait_ready(timeout_s=120)
        actor = pool.actors[0]
        task = ray_session.get(actor.tasks.remote("train", 3, 0))[1]
        assert task == ParityEnv(max_number=7).tasks("train", 3, 0)[1]
        assert ray_session.get(actor.first_observation.remote(task)) == task.question
        # Tools and sandboxes fork from env actors; JAX's threads would make that unsafe.
        assert ray_session.get(actor.jax_loaded.remote()) is False
    finally:
        ray_session.kill(pool.actors[0])


# --- the gymnasium adapter, in process ---------------------------------------------------------


def test_from_gymnasium_runs_a_text_env_episode():
    env = BaseEnv.from_gymnasium(RepeatWordEnv())
    (task,) = env.tasks("train", 1, seed=3)
    assert task.question.startswith("Repeat the word: ")
    word = task.question.rsplit(" ", 1)[1]
    # The same task (reset seed) gives the same start, so a group's episodes agree.
    assert env.reset(task) == task.question == env.reset(task)
    miss = env.step(Action(text="banana"))
    assert (miss.observation, miss.reward, miss.done) == (f"no, the word is {word}", 0.0, False)
    hit = env.step(Action(text=word))
    assert (hit.reward, hit.done, hit.status) == (1.0, True, EpisodeStatus.COMPLETED)
    env.reset(task)
    env.step(Action(text="x"))
    last = env.step(Action(text="y"))
    assert (last.done, last.status) == (True, EpisodeStatus.TRUNCATED)
    heldout = env.tasks("heldout", 4, seed=3)
    assert {t.metadata["seed"] for t in heldout}.isdisjoint(
        {t.metadata["seed"] for t in env.tasks("train", 4, seed=3)}
    )


def test_from_gymnasium_takes_ids_and_import_paths():
    gymnasium.register(id="RepeatWordTest-v0", entry_point=RepeatWordEnv, kwargs={"max_misses": 5})
    by_id = BaseEnv.from_gymnasium("RepeatWordTest-v0")
    assert by_id.gym_env.unwrapped.max_misses == 5
    by_path = BaseEnv.from_gymnasium("test_byo_env:RepeatWordEnv", {"max_misses": 3})
    assert by_path.gym_env.max_misses == 3


def test_from_gymnasium_says_what_is_wrong():
    with pytest.raises(TypeError, match=r"observation_space is Box.*not gymnasium.spaces.Text"):
        BaseEnv.from_gymnasium(ImageObservationEnv())
    with pytest.raises(TypeError, match="got int"):
        BaseEnv.from_gymnasium(3)
    with pytest.raises(ValueError, match="gymnasium cannot make 'NoSuchEnv-v0'"):
        BaseEnv.from_gymnasium("NoSuchEnv-v0")
    with pytest.raises(TypeError, match="not a gymnasium.Env subclass"):
        BaseEnv.from_gymnasium("test_byo_env:ParityEnv")
    # A wrong observation at run time ends that episode as ENV_ERROR with the reason.
    env = BaseEnv.from_gymnasium(NumberObservationEnv())
    with pytest.raises(TypeError, match="reset returned a int observation"):
        env.reset(Task("t", "", "", {"seed": 1}))
    # A reply outside the action space is the policy's mistake: an error observation.
    env = BaseEnv.from_gymnasium(RepeatWordEnv())
    env.reset(Task("t", "", "", {"seed": 1}))
    step = env.step(Action(text="é" * 3))
    assert step.observation.startswith("error: the reply uses characters") and not step.done
    assert step.info["tool_errors"] == {"format": 1}
    step = env.step(Action(text="a" * 300))
    assert "at most 256 are allowed" in step.observation


# --- raytunix environments as gymnasium ids ------------------------------------------------------


def test_gymnasium_make_knows_every_registered_raytunix_env():
    from gymnasium.utils.env_checker import check_env

    from raytunix.envs import ENVS, register_gymnasium_ids

    register_gymnasium_ids()
    assert {f"raytunix/{name}" for name in ENVS} <= set(gymnasium.registry)
    env = gymnasium.make("raytunix/math_verifier", num_tasks=8, seed=1)
    observation, info = env.reset(seed=0)
    assert observation.startswith("Calculate") and info["task_id"].startswith("train-")
    _, reward, terminated, truncated, info = env.step("<answer>1</answer>")
    assert terminated and not truncated and info["status"] == "completed"
    assert reward in (0.0, 1.0)
    check_env(
        gymnasium.make("raytunix/calculator_math", num_tasks=4).unwrapped, skip_render_check=True
    )
    tool_env = gymnasium.make("raytunix/simulated_tool", num_tasks=2, tool_latency_s=0.0, turns=1)
    tool_env.reset(seed=0)
    assert tool_env.step("anything")[1] == 1.0  # the simulated tool env's text format


def test_gym_text_env_refuses_the_wrong_kinds():
    from raytunix.envs import GymTextEnv, MathVerifierEnv

    with pytest.raises(TypeError, match="got the class MathVerifierEnv; pass MathVerifierEnv"):
        GymTextEnv(MathVerifierEnv, [Task("t", "q", "1")])
    with pytest.raises(TypeError, match="already is a gymnasium environment.*from_gymnasium"):
        GymTextEnv(RepeatWordEnv(), [Task("t", "q", "1")])
    with pytest.raises(TypeError, match=r"tasks\[1\] is dict"):
        GymTextEnv(MathVerifierEnv(), [Task("t", "q", "1"), {"question": "q"}])
    env = GymTextEnv(MathVerifierEnv(), [Task("t", "q", "1")])
    with pytest.raises(TypeError, match='options\\["task"\\] is str'):
        env.reset(options={"task": "q"})
    env.reset(seed=0)
    with pytest.raises(TypeError, match="takes the model's text"):
        env.step(7)


def test_the_readme_example_is_the_environment_tested_here():
    import inspect

    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    section = readme.split("## Bring your own environment", 1)[1].split("\n## ", 1)[0]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert inspect.getsource(ParityEnv) in example
    assert len(inspect.getsource(ParityEnv).splitlines()) < 30
    assert "raytunix train env.name=my_envs:ParityEnv" in section
