import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import time

import numpy as np
import pytest

from raytunix.agents import AGENTS, TextAgent, ToolAgent, make_agent
from raytunix.envs import SimulatedToolEnv, make_env
from raytunix.inference.engine import InferenceEngine
from raytunix.models.llama import ModelConfig, init_model
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.env_pool import LocalEnv
from raytunix.rollout.episode import run_episode
from raytunix.types import (
    Action,
    EpisodeStatus,
    FinishReason,
    GenerationResult,
    SamplingParams,
    Task,
)

TOKENIZER = Tokenizer.byte_level()
TASK = Task(task_id="t0", question="Look it up.", answer="")


def generation(text, finish_reason=FinishReason.STOP):
    ids = TOKENIZER.encode(text)
    return GenerationResult(
        request_id="r",
        token_ids=tuple(ids),
        logprobs=(-0.5,) * len(ids),
        policy_versions=(3,) * len(ids),
        finish_reason=finish_reason,
    )


def test_env_sleeps_per_step_and_ends_after_turns():
    env = SimulatedToolEnv(tool_latency_s=0.02, turns=3)
    assert env.reset(TASK) == TASK.question
    for k in (1, 2):
        start = time.perf_counter()
        step = env.step(Action(text="anything"))
        assert time.perf_counter() - start >= 0.02
        assert (step.observation, step.done, step.reward) == (f"tool result {k}", False, 0.0)
        assert step.info["tool_latency_s"] == pytest.approx(0.02)
    step = env.step(Action(text="anything"))
    assert (step.done, step.reward, step.status) == (True, 1.0, EpisodeStatus.COMPLETED)
    assert env.step(Action(text="late")).status == EpisodeStatus.ENV_ERROR  # no episode running


def test_jitter_stays_in_range_and_is_seeded_per_task():
    def latencies(seed, task_id):
        env = SimulatedToolEnv(tool_latency_s=0.001, turns=20, jitter=0.5, seed=seed)
        env.reset(Task(task_id=task_id, question="q", answer=""))
        return [env.step(Action(text="x")).info["tool_latency_s"] for _ in range(20)]

    first = latencies(0, "a")
    assert all(0.0005 <= s <= 0.0015 for s in first)
    assert len(set(first)) > 1
    assert latencies(0, "a") == first  # same seed and task: same latencies, on any actor
    assert latencies(0, "b") != first and latencies(1, "a") != first


def _latencies(env, task_id, steps):
    env.reset(Task(task_id=task_id, question="q", answer=""))
    return [env.step(Action(text="x")).info["tool_latency_s"] for _ in range(steps)]


def test_lognormal_latency_has_the_given_median_and_log_spread():
    median, sigma = 1e-6, 0.8
    env = SimulatedToolEnv(
        tool_latency_s=median, turns=2000, latency_dist="lognormal", latency_sigma=sigma, seed=3
    )
    logs = np.log(np.array(_latencies(env, "t", 2000)) / median)
    # 2000 draws: the standard error of the mean log is 0.8 / sqrt(2000) = 0.018
    assert abs(np.median(logs)) < 0.08 and abs(logs.std() - sigma) < 0.06
    assert logs.max() > 2 * sigma  # a heavy tail: draws beyond e^1.6 = 5x the median occur
    assert env.mean_latency_s == pytest.approx(median * np.exp(sigma**2 / 2))
    assert _latencies(env, "t", 50) == _latencies(env, "t", 50)  # seeded per task


def test_stragglers_are_a_seeded_fraction_of_episodes_and_factor_times_slower():
    def episode(task_id, fraction):
        env = SimulatedToolEnv(
            tool_latency_s=1e-6,
            turns=3,
            jitter=0.5,
            seed=0,
            straggler_fraction=fraction,
            straggler_factor=20.0,
        )
        return _latencies(env, task_id, 3), env.straggler

    runs = [episode(f"t{i}", 0.1) for i in range(1000)]
    stragglers = [i for i, (_, straggler) in enumerate(runs) if straggler]
    assert 70 <= len(stragglers) <= 130  # binomial(1000, 0.1): sd 9.5
    for i in stragglers[:20]:
        plain, straggler = episode(f"t{i}", 0.0)[0], runs[i][0]
        assert not episode(f"t{i}", 0.0)[1]
        # the same task draws the same noise; a straggler's calls are 20x as long
        assert straggler == pytest.approx([20 * s for s in plain])
    assert [episode(f"t{i}", 0.1)[1] for i in range(100)] == [s for _, s in runs[:100]]
    env = SimulatedToolEnv(tool_latency_s=0.1, straggler_fraction=0.1, straggler_factor=20.0)
    assert env.mean_latency_s == pytest.approx(0.1 * (0.9 + 0.1 * 20))


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"tool_latency_s": -1.0}, "tool_latency_s"),
        ({"turns": 0}, "turns"),
        ({"jitter": 1.5}, "jitter"),
        ({"latency_dist": "pareto"}, "latency_dist"),
        ({"latency_dist": "lognormal", "latency_sigma": -0.1}, "latency_sigma"),
        ({"latency_dist": "lognormal", "latency_sigma": float("inf")}, "latency_sigma"),
        ({"latency_dist": "lognormal", "jitter": 0.5}, "jitter=0.5 applies to"),
        ({"latency_sigma": 1.0}, "latency_sigma=1.0 applies to"),
        ({"straggler_fraction": 1.5}, "straggler_fraction"),
        ({"straggler_factor": 0.5}, "straggler_factor"),
    ],
)
def test_bad_arguments_are_rejected_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SimulatedToolEnv(**kwargs)


def test_registered_with_the_text_agent():
    env = make_env("simulated_tool", tool_latency_s=0.0, turns=2)
    assert isinstance(env, SimulatedToolEnv) and env.default_agent == "text"
    assert AGENTS["text"] is TextAgent
    assert isinstance(make_agent("text", TOKENIZER), TextAgent)


def test_text_agent_passes_text_through_and_closes_cut_replies():
    agent = TextAgent(TOKENIZER)
    agent.reset(TASK, TASK.question)
    prompt_len = len(agent.token_ids)
    action = agent.on_generation(generation("no tags here", FinishReason.LENGTH))
    assert action == Action(text="no tags here")
    n = len(TOKENIZER.encode("no tags here"))
    # the closing <|end|> is context, not a generated token
    assert agent.token_ids[prompt_len + n] == agent.end_id
    assert agent.loss_mask[prompt_len:] == [1] * n + [0]
    assert agent.turn_finished and agent.num_generated_tokens == n
    agent.on_observation("tool result 1")  # the conversation goes on

    agent.on_generation(generation("cut", FinishReason.ABORT))
    assert not agent.turn_finished  # an aborted reply is not a whole action


class ScriptedEngine:
    """Replies with the same 5 tokens, cut at max_new_tokens, every turn."""

    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        return generation("abcde", FinishReason.LENGTH)


def _episode(agent, env, engine, max_new_tokens=5):
    return asyncio.run(
        run_episode(
            TASK,
            "g0",
            agent,
            env,
            engine,
            SamplingParams(max_new_tokens=max_new_tokens),
            max_turns=10,
            max_context_tokens=256,
            seed=0,
            timeout_s=30.0,
        )
    )


def test_cut_replies_still_truncate_a_tool_agent_episode():
    engine = ScriptedEngine()
    trajectory = _episode(
        ToolAgent(TOKENIZER),
        LocalEnv("simulated_tool", {"turns": 3, "tool_latency_s": 0.0}),
        engine,
    )
    assert trajectory.status == EpisodeStatus.TRUNCATED and trajectory.num_turns == 1
    assert len(engine.requests) == 1


def test_text_agent_episode_on_a_real_engine_runs_every_turn():
    config = ModelConfig(
        vocab_size=TOKENIZER.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=128,
    )
    graphdef, params = init_model(config, seed=0)

    async def main():
        engine = InferenceEngine(
            graphdef, params, config, TOKENIZER, max_batch_size=4, block_size=16
        )
        env = LocalEnv("simulated_tool", {"turns": 3, "tool_latency_s": 0.001})
        agent = TextAgent(TOKENIZER)
        # a random model almost never emits <|end|>: without it every turn is cut at 6 tokens
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=())
        trajectory = await run_episode(
            TASK,
            "g0",
            agent,
            env,
            engine,
            sampling,
            max_turns=5,
            max_context_tokens=128,
            seed=1,
            timeout_s=60.0,
        )
        await engine.close()
        return trajectory

    trajectory = asyncio.run(main())
    assert trajectory.status == EpisodeStatus.COMPLETED and trajectory.reward == 1.0
    assert trajectory.num_turns == 3
    assert 3 <= trajectory.metrics["generated_tokens"] <= 18
    assert trajectory.metrics["env_s"] >= 0.002


class BarrierEnv(SimulatedToolEnv):
    """Each step blocks until ``parties`` steps are blocked at once (or 10 s pass)."""

    barrier = None

    def _step_impl(self, action):
        BarrierEnv.barrier.wait(timeout=10.0)
        return super()._step_impl(action)


def test_env_actor_runs_more_blocking_steps_at_once_than_asyncio_default(monkeypatch):
    import threading

    from raytunix.envs import ENVS
    from raytunix.rollout.env_pool import EnvActor

    parties = (os.cpu_count() or 1) + 4 + 8  # more than asyncio's default executor holds
    BarrierEnv.barrier = threading.Barrier(parties)
    monkeypatch.setitem(ENVS, "barrier", BarrierEnv)

    async def main():
        actor = EnvActor("barrier", {"tool_latency_s": 0.0, "turns": 1})
        await asyncio.gather(*(actor.reset(f"e{i}", TASK) for i in range(parties)))
        return await asyncio.gather(
            *(actor.step(f"e{i}", Action(text="x")) for i in range(parties))
        )

    steps = asyncio.run(main())
    # a broken barrier (too few threads) would end every step as ENV_ERROR
    assert all(step.status == EpisodeStatus.COMPLETED for step in steps)
