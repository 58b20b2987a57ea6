"""Nothing blocks forever, nothing spins: engine outages are retried with exponential
backoff and jitter (a short one costs time, not tasks), bugs are raised instead of
retried, an env actor that dies has its episodes re-run, and a pool with no live
environment stops the run with one clear error. Repeated failures log rate-limited."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time

import pytest

from raytunix.agents import ToolAgent
from raytunix.envs.math_envs import CalculatorMathEnv
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.env_pool import EnvPool, EnvPoolExhausted, LocalEnv
from raytunix.rollout.episode import run_episode
from raytunix.rollout.faults import Backoff, FailureBreaker, RateLimitedLog, retry_async
from raytunix.rollout.orchestrator import RolloutOrchestrator
from raytunix.types import (
    EngineFailure,
    EnvFailure,
    EpisodeStatus,
    FinishReason,
    GenerationResult,
    RolloutHalted,
    SamplingParams,
    Task,
)

TOK = Tokenizer.byte_level()
TASKS = [Task(f"t{i}", "Calculate 1 + 1.", "2") for i in range(50)]
FAST = Backoff(initial_delay_s=0.001, max_delay_s=0.004, max_attempts=3)


def _answer(request, text="<answer>2</answer>"):
    ids = TOK.encode(text) + [TOK.end_id]
    return GenerationResult(
        request.request_id, tuple(ids), (-0.1,) * len(ids), (0,) * len(ids), FinishReason.STOP
    )


# -- the schedule ------------------------------------------------------------------------------


def test_backoff_grows_exponentially_with_jitter_and_is_capped():
    backoff = Backoff(initial_delay_s=0.1, max_delay_s=1.0, multiplier=2.0, max_attempts=6)
    rng = random.Random(0)
    for attempt, ceiling in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]):
        delays = [backoff.delay_s(attempt, rng) for _ in range(200)]
        assert all(0.5 * ceiling <= d <= ceiling for d in delays)
        assert len(set(delays)) > 100  # jittered: retries of many episodes spread out
    assert backoff.max_total_delay_s() == pytest.approx(0.1 + 0.2 + 0.4 + 0.8 + 1.0)


def test_jitter_sets_the_random_fraction_of_each_delay():
    rng = random.Random(0)
    none = Backoff(initial_delay_s=0.2, max_delay_s=1.0, jitter=0.0)
    assert [none.delay_s(k, rng) for k in range(4)] == [0.2, 0.4, 0.8, 1.0]
    full = Backoff(initial_delay_s=0.2, max_delay_s=1.0, jitter=1.0)
    delays = [full.delay_s(3, rng) for _ in range(500)]
    assert 0.0 <= min(delays) < 0.1 and 0.9 < max(delays) <= 1.0  # "full jitter": [0, cap]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"initial_delay_s": 0}, "initial_delay_s"),
        ({"max_delay_s": 0.01}, "max_delay_s"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"jitter": 1.5}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
    ],
)
def test_backoff_rejects_bad_settings_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Backoff(**kwargs)


def test_retry_async_retries_only_the_named_errors_and_gives_up_after_max_attempts():
    calls = []

    async def flaky():
        calls.append(1)
        raise ConnectionError("down")

    async def buggy():
        calls.append(1)
        raise KeyError("bug")

    retries = []
    with pytest.raises(ConnectionError):
        asyncio.run(
            retry_async(
                flaky,
                FAST,
                retry_on=(ConnectionError,),
                rng=random.Random(0),
                on_retry=lambda a, e, d: retries.append((a, d)),
            )
        )
    assert len(calls) == FAST.max_attempts and [a for a, _ in retries] == [0, 1]
    calls.clear()
    with pytest.raises(KeyError):
        asyncio.run(retry_async(buggy, FAST, retry_on=(ConnectionError,), rng=random.Random(0)))
    assert len(calls) == 1


def test_repeated_failures_are_logged_at_most_once_per_interval(caplog):
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("test.faults"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.faults"):
        written = []
        for t in [0.0, 1.0, 2.0, 9.9, 10.5, 11.0]:
            now[0] = t
            written.append(log.log(logging.WARNING, "engine", "engine down: %s", "x"))
        assert log.log(logging.WARNING, "other", "another kind")  # keys are limited apart
    assert written == [True, False, False, False, True, False]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "engine down: x"
    assert lines[1] == "engine down: x (3 more like this in the last 10 s)"


def test_breaker_trips_after_consecutive_failures_only():
    breaker = FailureBreaker(3)
    assert not breaker.record(False) and not breaker.record(False)
    assert not breaker.record(True)  # a valid episode resets the count
    assert [breaker.record(False, "env") for _ in range(3)] == [False, False, True]
    assert breaker.tripped and breaker.last_failure == "env"
    off = FailureBreaker(0)
    assert not any(off.record(False) for _ in range(100))
    with pytest.raises(ValueError, match="threshold"):
        FailureBreaker(-1)


# -- engine outages ------------------------------------------------------------------------


class FlakyEngine:
    """Down (raises ConnectionError, as a restarting engine actor does) for ``outage_s``."""

    def __init__(self, outage_s: float):
        self.outage_s = outage_s
        self.t0 = time.monotonic()
        self.failed_calls = 0

    async def generate(self, request):
        await asyncio.sleep(0.001)
        if time.monotonic() - self.t0 < self.outage_s:
            self.failed_calls += 1
            raise ConnectionError("engine restarting")
        return _answer(request)


def _orchestrator(engine, **kwargs):
    args = dict(
        tasks=TASKS,
        agent_factory=lambda: ToolAgent(TOK),
        engine=engine,
        env_provider=lambda g: (LocalEnv("calculator_math", {}), lambda: None),
        group_size=2,
        groups_per_batch=2,
        max_concurrent_episodes=8,
        max_staleness=1,
        max_turns=2,
        max_context_tokens=256,
        sampling=SamplingParams(max_new_tokens=32),
    )
    args.update(kwargs)
    return RolloutOrchestrator(**args)


def test_half_second_outage_loses_no_task():
    async def main():
        orch = _orchestrator(FlakyEngine(0.5))
        await asyncio.wait_for(orch.next_batch(), 30)
        await orch.stop()
        return orch.counters

    counters = asyncio.run(main())
    assert counters.get("groups_filtered_engine_error", 0) == 0


def test_an_outage_longer_than_the_call_retries_retries_groups_with_backoff_and_loses_no_task():
    async def main():
        engine = FlakyEngine(0.3)
        orch = _orchestrator(
            engine,
            engine_backoff=Backoff(0.001, 0.002, max_attempts=2),
            retry_backoff=Backoff(0.05, 0.2),
            max_group_retries=8,
        )
        [_], info = await asyncio.wait_for(orch.next_batch(), 30)
        await orch.stop()
        return engine, orch.state(), info

    engine, state, info = asyncio.run(main())
    counters = state["counters"]
    assert counters["groups_retried_engine_error"] >= 1
    assert counters.get("groups_filtered_engine_error", 0) == 0
    assert info["statuses"] == {"completed": 4}
    # Backoff, not a tight loop: each group try costs 2 calls per episode, and a task's
    # retries wait 25-50 ms, 50-100 ms, ... so a 0.3 s outage costs a few tries per task.
    assert engine.failed_calls <= 8 * 2 * 2 * 5
    assert set(state["pending"]) <= set(range(state["next_index"]))


def test_an_engine_bug_is_raised_from_the_episode_not_retried():
    class BadRequestEngine:
        calls = 0

        async def generate(self, request):
            BadRequestEngine.calls += 1
            raise ValueError(f"Request {request.request_id!r} has an empty prompt")

    with pytest.raises(ValueError, match="empty prompt"):
        asyncio.run(
            run_episode(
                TASKS[0],
                "g",
                ToolAgent(TOK),
                LocalEnv("calculator_math", {}),
                BadRequestEngine(),
                SamplingParams(max_new_tokens=16),
                max_turns=2,
                max_context_tokens=256,
                seed=0,
                timeout_s=10,
                engine_backoff=FAST,
            )
        )
    assert BadRequestEngine.calls == 1


def test_an_engine_down_for_good_raises_engine_failure_after_bounded_retries():
    class DeadEngine:
        calls = 0

        async def generate(self, request):
            DeadEngine.calls += 1
            raise ConnectionError("refused")

    with pytest.raises(EngineFailure, match="refused"):
        asyncio.run(
            run_episode(
                TASKS[0],
                "g",
                ToolAgent(TOK),
                LocalEnv("calculator_math", {}),
                DeadEngine(),
                SamplingParams(max_new_tokens=16),
                max_turns=2,
                max_context_tokens=256,
                seed=0,
                timeout_s=10,
                engine_backoff=FAST,
            )
        )
    assert DeadEngine.calls == FAST.max_attempts


class NanRewardEnv(LocalEnv):
    async def step(self, action):
        step = await super().step(action)
        return type(step)(step.observation, float("nan"), step.done, step.status, step.info)


def test_a_non_finite_reward_ends_the_episode_as_env_error_before_the_learner_sees_it():
    class Engine:
        async def generate(self, request):
            return _answer(request)

    trajectory = asyncio.run(
        run_episode(
            TASKS[0],
            "g",
            ToolAgent(TOK),
            NanRewardEnv("calculator_math", {}),
            Engine(),
            SamplingParams(max_new_tokens=32),
            max_turns=2,
            max_context_tokens=256,
            seed=0,
            timeout_s=10,
        )
    )
    assert trajectory.status == EpisodeStatus.ENV_ERROR and trajectory.reward == 0.0
    assert "returned reward nan" in trajectory.error  # the user sees what failed


def test_an_env_error_episode_carries_the_environment_s_exception():
    class Engine:
        async def generate(self, request):
            return _answer(request)

    class RaisingStep(LocalEnv):  # raises past BaseEnv.step: EnvFailure
        async def step(self, action):
            raise EnvFailure("step failed: RuntimeError('step always fails')")

    for env in (RaisingStep("calculator_math", {}), LocalEnv("calculator_math", {})):
        if type(env) is LocalEnv:  # BaseEnv.step catches the raise: status ENV_ERROR
            env._env._step_impl = lambda action: 1 / 0
        trajectory = asyncio.run(
            run_episode(
                TASKS[0],
                "g",
                ToolAgent(TOK),
                env,
                Engine(),
                SamplingParams(max_new_tokens=32),
                max_turns=2,
                max_context_tokens=256,
                seed=0,
                timeout_s=10,
            )
        )
        assert trajectory.status == EpisodeStatus.ENV_ERROR
        assert (
            "step always fails" if type(env) is RaisingStep else "ZeroDivisionError"
        ) in trajectory.error


# -- env actors (local Ray) ------------------------------------------------------------------


class Engine:
    """Calls the calculator, then answers; runs ``before_answer`` once, before the first
    answer of the run."""

    def __init__(self, before_answer=None):
        self.before_answer = before_answer

    async def generate(self, request):
        turn = int(request.request_id.rsplit("/", 1)[1])
        if turn == 0:
            return _answer(
                request,
                '<tool_call>{"name": "calculator", "arguments": '
                '{"expression": "1 + 1"}}</tool_call>',
            )
        if self.before_answer is not None:
            hook, self.before_answer = self.before_answer, None
            await hook()
        return _answer(request)


@pytest.mark.slow
def test_an_env_actor_killed_mid_episode_is_restarted_and_its_episodes_re_run(ray_session):
    pool = EnvPool("calculator_math", {}, num_actors=2, max_restarts=2, probe_timeout_s=60)
    pool.wait_ready(timeout_s=120)
    pids_before = ray_session.get([a.pid.remote() for a in pool.actors])

    async def kill_every_env_process():
        for pid in pids_before:  # the process dies as with os._exit: no cleanup, no reply
            os.kill(pid, signal.SIGKILL)

    async def main():
        def env_provider(group_id):
            env, index = pool.lease(group_id)
            return env, lambda: pool.release(index)

        orch = _orchestrator(
            Engine(before_answer=kill_every_env_process),
            env_provider=env_provider,
            groups_per_batch=1,
            max_concurrent_episodes=2,
            retry_backoff=Backoff(0.2, 1.0),
            episode_timeout_s=60.0,
        )
        [batch], info = await asyncio.wait_for(orch.next_batch(), 120)
        await orch.stop()
        return info, orch.state()

    try:
        info, state = asyncio.run(main())
    finally:
        for actor in pool.actors:
            ray_session.kill(actor)
    assert info["statuses"] == {"completed": 2}  # the episodes were re-run, not lost
    assert state["counters"]["episodes_restarted_env_error"] >= 1
    assert state["counters"].get("groups_filtered_env_error", 0) == 0


class FragileEnv(CalculatorMathEnv):
    """The calculator env, which cannot be built once its ``broken`` file exists."""

    def __init__(self, broken: str, **kwargs):
        if os.path.exists(broken):
            raise RuntimeError(f"{broken} exists")
        super().__init__(**kwargs)


def _fragile_pool(tmp_path, num_actors):
    """A ready pool of ``FragileEnv`` actors that Ray does not restart, and the file whose
    existence breaks them."""
    broken = tmp_path / "broken"
    pool = EnvPool(
        "test_rollout_faults:FragileEnv",
        {"broken": str(broken)},
        num_actors=num_actors,
        max_restarts=0,
        import_paths=[os.path.dirname(__file__)],
    )
    pool.wait_ready(timeout_s=120)
    return broken, pool


@pytest.mark.slow
def test_a_dead_env_pool_stops_the_rollout_with_one_clear_error(ray_session, tmp_path):
    broken, pool = _fragile_pool(tmp_path, num_actors=2)
    broken.touch()  # the actors that replace the killed ones cannot start
    for actor in pool.actors:
        ray_session.kill(actor, no_restart=True)

    async def main():
        orch = _orchestrator(
            Engine(),
            env_provider=lambda g: (pool.lease(g)[0], lambda: None),
            tasks=TASKS[:8],
            retry_backoff=FAST,
        )
        with pytest.raises(EnvPoolExhausted) as halted:
            await asyncio.wait_for(orch.next_batch(), 60)
        await orch.stop()
        return halted.value, orch.state()

    error, state = asyncio.run(main())
    assert isinstance(error, RolloutHalted)
    assert "all 4 env actors are dead" in str(error) and "resume" in str(error)
    assert (pool.num_alive, pool.replaced) == (0, 2)
    assert state["counters"].get("groups_trained", 0) == 0
    assert state["pending"]  # the tasks handed out stay in the ledger for a resumed run


@pytest.mark.slow
def test_the_halt_reaches_the_driver_as_rollout_halted_and_a_dead_engine_as_engine_failure(
    ray_session, tmp_path
):
    """What train.py relies on: the error crosses the actor boundary with its type (the
    driver turns it into one RunError and a non-zero exit)."""
    import sys

    from ray import cloudpickle

    from raytunix.rollout.actor import OrchestratorActor, RayEngineClient

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on workers' path
    engine = ray_session.remote(Engine).options(num_cpus=0, max_concurrency=100).remote()
    broken, pool = _fragile_pool(tmp_path, num_actors=1)
    broken.touch()  # the actor that replaces the killed one cannot start
    ray_session.kill(pool.actors[0], no_restart=True)
    orchestrator = (
        ray_session.remote(OrchestratorActor)
        .options(num_cpus=0, max_concurrency=100)
        .remote(
            tasks=TASKS[:4],
            tokenizer=TOK,
            agent_name="tool",
            env_pool=pool,
            engine=engine,
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=4,
            max_staleness=0,
            max_turns=2,
            max_context_tokens=256,
            sampling=SamplingParams(max_new_tokens=64),
            retry_backoff=FAST,
        )
    )
    try:
        with pytest.raises(RolloutHalted, match="env actors are dead"):
            ray_session.get(orchestrator.next_batch.remote(), timeout=120)
        request = type("Request", (), {"request_id": "g0/0/0"})()
        ray_session.kill(engine, no_restart=True)
        with pytest.raises(EngineFailure, match="engine actor failed on g0/0/0"):
            asyncio.run(RayEngineClient(engine).generate(request))
    finally:
        ray_session.kill(orchestrator)
