"""Fault scenarios, each a small script on local Ray or in-process (issue 6's acceptance):

* async rollouts at ``max_staleness: 0`` with one engine give the same batches and the
  same loss and gradient-norm trace as a synchronous loop with the same seed;
* an env actor whose process exits mid-episode (``os._exit``) is detected before the
  episode's deadline, restarted, and the episode re-run;
* an always-failing environment trips the breaker: ``raytunix train`` exits with code 2
  and one clear error;
* ``raytunix train`` killed with SIGKILL mid-run leaves no process of its run behind
  within 30 s, and ``--resume`` finishes it with every task in the ledger exactly once.

A policy that emits only malformed tool calls is scored, not masked: see
``tests/test_failure_signal.py`` (it stops at the tool-error limit and gets a negative
advantage beside a successful sibling).
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402

from raytunix.agents import TextAgent  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout.batch import record_batch_to_trajectories, trajectories_to_record_batch  # noqa: E402
from raytunix.rollout.faults import Backoff  # noqa: E402
from raytunix.rollout.ledger import TaskLedger  # noqa: E402
from raytunix.rollout.orchestrator import RolloutOrchestrator  # noqa: E402
from raytunix.types import (  # noqa: E402
    EpisodeStatus,
    FinishReason,
    GenerationResult,
    SamplingParams,
    StepResult,
    Task,
)

# Every test here runs end to end (a Ray session, a train, a benchmark): the slow tier.
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = Tokenizer.byte_level()


# -- 1. async at max_staleness 0 == a synchronous loop -----------------------------------------

SEED, GROUP_SIZE, GROUPS_PER_BATCH, STEPS = 7, 2, 2, 3
SYNC_TASKS = [Task(f"t{i}", f"Say something about {i}.", str(i)) for i in range(20)]
SYNC_SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(TOK.end_id,))


class TwoTurnTextEnv:
    """An in-process env client: the reward of a turn is a fixed function of its text (so
    the samples of a group differ in reward and the update has a signal); a good first
    reply ends the episode, otherwise a second turn follows (so lengths differ too). Steps
    take longer for lower task indices, so groups finish in the reverse of their start
    order."""

    def __init__(self, index: int):
        self.index = index
        self.turns = 0

    async def reset(self, task):
        return task.question

    async def step(self, action):
        await asyncio.sleep(0.03 * (3 - self.index % 3))
        self.turns += 1
        reward = (sum(action.text.encode()) % 97) / 96
        done = self.turns >= 2 or reward >= 0.5
        return StepResult(
            "" if done else "Say more.", reward, done, EpisodeStatus.COMPLETED if done else None
        )

    async def close(self):
        pass


def _policy():
    """A learner and an engine holding its weights, both from ``SEED`` (tiny model)."""
    from raytunix.inference.engine import InferenceEngine
    from raytunix.learner.learner import Learner, RLHyperparams
    from raytunix.models.llama import ModelConfig

    config = ModelConfig(
        vocab_size=TOK.vocab_size,
        d_model=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=64,
        max_seq_len=128,
    )
    learner = Learner(config, seed=SEED, pad_id=TOK.pad_id)
    learner.start_rl(RLHyperparams(temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-2))
    engine = InferenceEngine(learner.graphdef, learner.params, config, TOK, max_batch_size=8)
    return learner, engine


async def _update(learner, engine, batch) -> dict:
    """One learner step in a worker thread (as the learner actor runs it), then the new
    weights go to the engine."""
    metrics = await asyncio.get_running_loop().run_in_executor(None, learner.train_step, batch)
    engine.update_weights(learner.params, learner.version)
    return metrics


async def _async_run():
    """The orchestrator, as the driver uses it: next batch, update, mark trained."""
    learner, engine = _policy()
    orchestrator = RolloutOrchestrator(
        tasks=SYNC_TASKS,
        agent_factory=lambda: TextAgent(TOK),
        engine=engine,
        env_provider=lambda group_id: (TwoTurnTextEnv(int(group_id[1:])), lambda: None),
        group_size=GROUP_SIZE,
        groups_per_batch=GROUPS_PER_BATCH,
        max_concurrent_episodes=64,
        max_staleness=0,
        max_turns=3,
        max_context_tokens=128,
        sampling=SYNC_SAMPLING,
        seed=SEED,
    )
    steps = []
    for _ in range(STEPS):
        [batch], info = await orchestrator.next_batch()
        metrics = await _update(learner, engine, batch)
        orchestrator.mark_trained(info["batch_id"], learner.version)
        steps.append((record_batch_to_trajectories(batch), metrics))
    await orchestrator.stop()
    return steps


async def _synchronous_run():
    """The synchronous loop: for each step, the next GROUPS_PER_BATCH tasks in order, all
    their episodes generated at once (each with the seed the orchestrator gives sample j
    of task index i), the batch in task order, one update, the weights published; only
    then the next batch is generated. No orchestrator, no admission control."""
    from raytunix.rollout.episode import run_episode

    learner, engine = _policy()
    steps = []
    for step in range(STEPS):
        episodes = [
            run_episode(
                SYNC_TASKS[index],
                f"g{index}",
                TextAgent(TOK),
                TwoTurnTextEnv(index),
                engine,
                SYNC_SAMPLING,
                max_turns=3,
                max_context_tokens=128,
                seed=(SEED * 1_000_003 + index * GROUP_SIZE + j) % 2**31,
                timeout_s=120,
            )
            for index in range(step * GROUPS_PER_BATCH, (step + 1) * GROUPS_PER_BATCH)
            for j in range(GROUP_SIZE)
        ]
        trajectories = await asyncio.gather(*episodes)
        batch = trajectories_to_record_batch(trajectories)
        steps.append((record_batch_to_trajectories(batch), await _update(learner, engine, batch)))
    return steps


def test_async_at_zero_staleness_with_one_engine_matches_the_synchronous_loop():
    async_steps = asyncio.run(_async_run())
    sync_steps = asyncio.run(_synchronous_run())
    for step, ((a, a_metrics), (s, s_metrics)) in enumerate(zip(async_steps, sync_steps)):
        assert [t.group_id for t in a] == [t.group_id for t in s]  # the same tasks, in order
        assert [t.token_ids for t in a] == [t.token_ids for t in s], f"step {step + 1}"
        assert [t.loss_mask for t in a] == [t.loss_mask for t in s]
        assert [t.reward for t in a] == [t.reward for t in s]
        # Every generated token is on-policy: sampled by the weights of this step.
        assert {v for t in a for v, m in zip(t.policy_versions, t.loss_mask) if m} == {step}
        # The engine's float sums depend on which requests share a decode step, so
        # logprobs (and the loss through them) agree to rounding, not to the bit.
        for ta, ts in zip(a, s):
            np.testing.assert_allclose(ta.logprobs, ts.logprobs, atol=1e-5)
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(
                a_metrics[key],
                s_metrics[key],
                rtol=1e-4,
                atol=1e-6,
                err_msg=f"{key} at step {step + 1}",
            )
    # The trace is not trivially zero: rewards differ within groups, so the update moved.
    # (On-policy the surrogate's value is about 0 whatever the advantages: the ratio is 1
    # and each group's advantages sum to 0; its gradient is what carries them.)
    groups = [
        {t.reward for t in a if t.group_id == g}
        for a, _ in async_steps
        for g in {t.group_id for t in a}
    ]
    assert any(len(rewards) > 1 for rewards in groups)
    assert all(m["grad_norm"] > 1e-3 for _, m in async_steps)


# -- 2. an env actor that exits mid-episode ------------------------------------------------------

CRASH_ONCE_ENV = '''
import os

from raytunix.envs.base import BaseEnv
from raytunix.types import EpisodeStatus, StepResult


class CrashOnceEnv(BaseEnv):
    """Rewards any reply with 1. The first step ever taken (a marker file records it,
    across processes) ends the hosting process on the spot, as a segfault or the OOM
    killer would: no exception, no reply, no cleanup."""

    default_agent = "text"

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    def _initial_observation(self, task):
        return task.question

    def _step_impl(self, action):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return StepResult("", 1.0, True, EpisodeStatus.COMPLETED)
        os._exit(1)
'''


class ReplyEngine:
    """Answers every request with a short reply at once."""

    async def generate(self, request):
        ids = TOK.encode("done") + [TOK.end_id]
        return GenerationResult(
            request.request_id, tuple(ids), (-0.5,) * len(ids), (0,) * len(ids), FinishReason.STOP
        )


def test_an_env_actor_that_exits_mid_episode_is_restarted_and_its_episode_re_run(
    ray_session, tmp_path
):
    from raytunix.rollout.env_pool import EnvPool

    (tmp_path / "crash_once_env.py").write_text(CRASH_ONCE_ENV)
    marker = tmp_path / "crashed"
    pool = EnvPool(
        "crash_once_env:CrashOnceEnv",
        {"marker": str(marker)},
        num_actors=1,
        max_restarts=2,
        import_paths=[str(tmp_path)],
    )
    deadline_s = 60.0  # each episode attempt's budget: a death noticed later is a TIMEOUT
    try:
        pool.wait_ready(timeout_s=120)
        pid_before = ray_session.get(pool.actors[0].pid.remote())

        def env_provider(group_id):
            env, index = pool.lease(group_id)
            return env, lambda: pool.release(index)

        async def main():
            orchestrator = RolloutOrchestrator(
                tasks=SYNC_TASKS,
                agent_factory=lambda: TextAgent(TOK),
                engine=ReplyEngine(),
                env_provider=env_provider,
                group_size=2,
                groups_per_batch=1,
                max_concurrent_episodes=2,
                max_staleness=0,
                max_turns=2,
                max_context_tokens=256,
                sampling=SamplingParams(max_new_tokens=8),
                episode_timeout_s=deadline_s,
                max_episode_restarts=3,
                retry_backoff=Backoff(initial_delay_s=0.5, max_delay_s=4.0),
            )
            [batch], info = await asyncio.wait_for(orchestrator.next_batch(), 4 * deadline_s)
            await orchestrator.stop()
            return info, orchestrator.state()

        info, state = asyncio.run(main())
        pid_after = ray_session.get(pool.actors[0].pid.remote(), timeout=60)
    finally:
        for actor in pool.actors:
            ray_session.kill(actor)
    assert marker.exists()  # the env really took its process down mid-episode
    assert pid_after != pid_before  # Ray restarted the actor in a new process
    assert info["statuses"] == {"completed": 2}  # both episodes re-run to the end, none timed out
    assert state["counters"]["episodes_restarted_env_error"] >= 1
    assert state["counters"].get("episodes_timeout", 0) == 0
    assert state["counters"].get("groups_filtered_env_error", 0) == 0


# -- the CLI as a user runs it ------------------------------------------------------------------

TINY_RUN = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=64",
    "model.max_seq_len=64",
    "model.tokenizer_vocab_size=300",
    "data.train_size=64",
    "data.heldout_size=2",
    "eval.heldout_size=2",
    "eval.max_new_tokens=16",
    "warmup.enabled=false",
    "engine.compile_ahead=false",  # a few steps: compile the programs they run, no more
    "rollout.group_size=2",
    "rollout.groups_per_batch=2",
    "rollout.max_concurrent_episodes=8",
    "rollout.max_new_tokens=16",
    "engine.max_batch_size=4",
    "env.num_env_actors=1",
    "env.max_turns=2",
    "learner.checkpoint_every=1",
]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "raytunix.cli", *args]


def _cli_env() -> dict[str, str]:
    """The environment of a fresh shell: raytunix importable, no cluster to join."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.pop("RAY_ADDRESS", None)
    return env


def _run_dir(output_dir: str) -> str:
    found = glob.glob(os.path.join(output_dir, "*", "config.yaml"))
    assert len(found) == 1, found
    return os.path.dirname(found[0])


# -- 3. an always-failing environment trips the breaker ----------------------------------------

ALWAYS_FAILING_ENV = '''
from raytunix.envs.base import BaseEnv


class AlwaysFailingEnv(BaseEnv):
    """Starts episodes, then every step fails (a tool service that is down for good)."""

    default_agent = "text"

    def _initial_observation(self, task):
        return task.question

    def _step_impl(self, action):
        raise ConnectionError("the tool service refused the connection")
'''


def test_an_always_failing_environment_stops_raytunix_train_with_one_clear_error(
    ray_session, tmp_path
):
    (tmp_path / "failing_env.py").write_text(ALWAYS_FAILING_ENV)
    output_dir = tmp_path / "runs"
    # Joins the session's cluster (RAY_ADDRESS, as on a cluster a user submits to) rather
    # than starting one of its own: what is checked is how the run ends.
    env = dict(_cli_env(), RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    proc = subprocess.run(
        _cli(
            "train",
            *TINY_RUN,
            f"run.output_dir={output_dir}",
            "learner.rl_steps=3",
            "env.name=failing_env:AlwaysFailingEnv",
            "rollout.max_consecutive_failures=4",
        ),
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("raytunix: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]  # one error, not one per failed episode
    message = errors[0]
    assert "rollout halted at RL step 1" in message
    assert "4 episodes in a row failed: the environment raised" in message
    assert "env_error" in message  # what failed
    assert "the tool service refused the connection" in message  # the env's own error
    assert "rollout.max_consecutive_failures" in message and "resume" in message  # what to do
    assert "Traceback" not in proc.stderr
    # The run's checkpoint (taken before RL) and its ledger stay for a resume.
    from raytunix.learner.checkpoint import Checkpointer

    checkpoints = Checkpointer(os.path.join(_run_dir(str(output_dir)), "checkpoints"))
    try:
        extras = checkpoints.read_extras()
    finally:
        checkpoints.close()
    orchestrator = extras["orchestrator"]
    TaskLedger.from_json(orchestrator["ledger"]).check(
        orchestrator["next_index"], orchestrator["pending"]
    )


# -- 5 and 6. SIGKILL of the driver, then --resume ----------------------------------------------

KILL_RUN_STEPS = 6
KILL_AFTER_CHECKPOINT = 2


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running; a zombie (dead, not yet reaped by its new parent) is not."""
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """Starts ``raytunix train``, waits for its checkpoint at RL step 2, snapshots its
    process tree (Ray's GCS server, raylet, agents, the actors' workers...) and SIGKILLs
    the driver. Then polls (no fixed sleep) for up to 30 s until no process of the tree
    runs."""
    root = tmp_path_factory.mktemp("killed")
    output_dir = root / "runs"
    log = open(root / "driver.log", "w")
    driver = subprocess.Popen(
        _cli(
            "train", *TINY_RUN, f"run.output_dir={output_dir}", f"learner.rl_steps={KILL_RUN_STEPS}"
        ),
        cwd=str(root),
        env=_cli_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 480
        checkpoint_step = 0
        while checkpoint_step < KILL_AFTER_CHECKPOINT:
            assert driver.poll() is None, (root / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint at RL step 2 in 480 s"
            time.sleep(0.05)
            state_files = glob.glob(os.path.join(output_dir, "*", "state.json"))
            if state_files:
                try:
                    with open(state_files[0]) as f:
                        checkpoint_step = json.load(f).get("checkpoint_step", 0)
                except (json.JSONDecodeError, OSError):  # being replaced right now
                    pass
        tree = psutil.Process(driver.pid).children(recursive=True)
        names = {p.pid: p.name() for p in tree}
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        log.close()
    killed_at = time.monotonic()
    left = _alive(tree)
    while left and time.monotonic() - killed_at < 30.0:
        time.sleep(0.2)
        left = _alive(left)
    # The driver may have finished a later checkpoint between the poll and the kill; the
    # resume starts from the newest complete one (state.json can lag it).
    from raytunix.learner.checkpoint import Checkpointer

    checkpoints = Checkpointer(os.path.join(_run_dir(str(output_dir)), "checkpoints"))
    try:
        checkpoint_step = checkpoints.latest_step()
    finally:
        checkpoints.close()
    return {
        "run_dir": _run_dir(str(output_dir)),
        "checkpoint_step_at_kill": checkpoint_step,
        "tree": names,
        "left": {p.pid: names[p.pid] for p in left},
        "log": str(root / "driver.log"),
    }


def test_after_sigkill_of_the_driver_no_process_of_the_run_is_left_within_30_s(killed_run):
    tree = killed_run["tree"]
    # The tree held the cluster the driver started and the run's actors.
    assert {"raylet", "gcs_server"} <= set(tree.values()), tree
    assert any(name.startswith("ray::") for name in tree.values()), tree
    assert killed_run["left"] == {}, f"still running 30 s after the kill: {killed_run['left']}"


def test_a_run_killed_mid_run_resumes_and_its_ledger_holds_every_task_exactly_once(
    ray_session, killed_run
):
    from raytunix.learner.checkpoint import Checkpointer

    run_dir = killed_run["run_dir"]
    checkpoints = Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        at_kill = checkpoints.read_extras(killed_run["checkpoint_step_at_kill"])
    finally:
        checkpoints.close()
    # The resume joins the session's cluster (the killed run's went with its driver).
    env = dict(_cli_env(), RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    proc = subprocess.run(
        _cli("train", "--resume", run_dir),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed at RL step {killed_run['checkpoint_step_at_kill']}" in proc.stdout

    checkpoints = Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        final = checkpoints.read_extras()
    finally:
        checkpoints.close()
    assert final["rl_step"] == KILL_RUN_STEPS
    # metrics.jsonl marks the resume; the steps logged after it are the run's steps.
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    resume = next(i for i, r in enumerate(records) if r["phase"] == "resume")
    assert records[resume]["rl_step"] == killed_run["checkpoint_step_at_kill"]
    assert [r["step"] for r in records[resume:] if r["phase"] == "rl"] == list(
        range(killed_run["checkpoint_step_at_kill"] + 1, KILL_RUN_STEPS + 1)
    )
    orchestrator = final["orchestrator"]
    ledger = TaskLedger.from_json(orchestrator["ledger"])
    # Every task handed out is trained, filtered or pending, exactly one of them.
    ledger.check(orchestrator["next_index"], orchestrator["pending"])
    # The weights of the final checkpoint were trained on these tasks, each once: one
    # batch of groups_per_batch tasks per RL step, before the kill and after the resume.
    trained = list(ledger.trained)
    assert len(trained) == len(set(trained)) == KILL_RUN_STEPS * 2
    assert orchestrator["counters"]["groups_trained"] == len(trained)
    # What the checkpoint before the kill had settled stays settled, the same way.
    before = TaskLedger.from_json(at_kill["orchestrator"]["ledger"])
    assert set(before.trained) <= set(trained)
    for reason, indices in before.filtered.items():
        assert set(indices) <= set(ledger.filtered[reason])
