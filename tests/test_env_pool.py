"""Environments hosted by Ray actors: episodes through ``RemoteEnv``, and an env actor that
dies mid-episode (the episode ends as ENV_ERROR; the restarted actor serves new ones)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from raytunix.agents import ToolAgent
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.env_pool import EnvPool
from raytunix.rollout.episode import EnvFailure, run_episode
from raytunix.types import (
    Action,
    EpisodeStatus,
    FinishReason,
    GenerationResult,
    SamplingParams,
    Task,
    ToolCall,
)

# Every test here runs end to end (a Ray session, a train, a benchmark): the slow tier.
pytestmark = pytest.mark.slow

TOKENIZER = Tokenizer.byte_level()
TASK = Task("t0", "Calculate 95 - 21.", "74")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "95 - 21"}}</tool_call>'


class TwoTurnEngine:
    """Calls the calculator on turn 0, answers 74 on turn 1; ``before_answer`` runs just
    before the answer is returned (to break things mid-episode)."""

    def __init__(self, before_answer=lambda: None):
        self.before_answer = before_answer

    async def generate(self, request):
        turn = int(request.request_id.rsplit("/", 1)[1])
        if turn == 1:
            self.before_answer()
        text = CALL if turn == 0 else "<answer>74</answer>"
        ids = tuple(TOKENIZER.encode(text) + [TOKENIZER.end_id])
        return GenerationResult(
            request.request_id,
            ids,
            (-0.5,) * len(ids),
            (0,) * len(ids),
            FinishReason.STOP,
            text + "<|end|>",
        )


async def episode(env, engine):
    return await run_episode(
        TASK,
        "g0",
        ToolAgent(TOKENIZER),
        env,
        engine,
        SamplingParams(max_new_tokens=128),
        max_turns=4,
        max_context_tokens=1024,
        seed=0,
        timeout_s=120.0,
    )


@pytest.fixture(scope="module")
def pool(ray_session):
    pool = EnvPool("calculator_math", {"max_tool_errors": 2}, num_actors=2, max_restarts=2)
    pool.wait_ready(timeout_s=120)
    yield pool
    for actor in pool.actors:
        ray_session.kill(actor)


def test_reset_and_step_through_remote_env(pool):
    env, index = pool.lease("g0")

    actor = pool.actors[index]

    async def main():
        hosted_before = await actor.num_envs.remote()
        observation = await env.reset(TASK)
        hosted_during = await actor.num_envs.remote()
        tool = await env.step(
            Action(text=CALL, tool_calls=(ToolCall("calculator", {"expression": "95 - 21"}),))
        )
        answer = await env.step(Action(text="<answer>74</answer>", answer="74"))
        await env.close()
        hosted_after = await actor.num_envs.remote()
        return observation, tool, answer, (hosted_before, hosted_during, hosted_after)

    try:
        observation, tool, answer, hosted = asyncio.run(main())
    finally:
        pool.release(index)
    assert observation == TASK.question
    assert tool.observation == "74" and not tool.done
    assert answer.done and answer.reward == 1.0 and answer.status == EpisodeStatus.COMPLETED
    assert hosted[1] == hosted[0] + 1 and hosted[2] == hosted[0]  # close frees the env


def test_a_step_for_an_unknown_episode_is_an_env_failure(pool):
    env, index = pool.lease("never-reset")
    try:
        with pytest.raises(EnvFailure, match="no environment"):
            asyncio.run(env.step(Action(text="<answer>1</answer>", answer="1")))
    finally:
        pool.release(index)


def test_leases_go_to_the_least_loaded_actor(pool):
    leases = [pool.lease(f"g{i}") for i in range(4)]
    try:
        assert sorted(index for _, index in leases) == [0, 0, 1, 1]
    finally:
        for _, index in leases:
            pool.release(index)


def test_a_full_episode_on_an_env_actor_completes(pool):
    env, index = pool.lease("g0")
    try:
        trajectory = asyncio.run(episode(env, TwoTurnEngine()))
    finally:
        pool.release(index)
    assert trajectory.status == EpisodeStatus.COMPLETED
    assert trajectory.reward == 1.0 and trajectory.num_turns == 2


def test_an_env_actor_killed_mid_episode_ends_it_as_env_error_and_restarts(pool, ray_session):
    env, index = pool.lease("g-killed")
    actor = pool.actors[index]
    pid_before = ray_session.get(actor.pid.remote())

    def kill():
        # ray.kill is asynchronous: wait until the old process is gone, so that the answer
        # step cannot still reach it.
        ray_session.kill(actor, no_restart=False)
        for _ in range(600):
            try:
                if ray_session.get(actor.pid.remote(), timeout=60) != pid_before:
                    return
            except (
                ray_session.exceptions.RayActorError,
                ray_session.exceptions.ActorUnavailableError,
            ):
                pass
            time.sleep(0.1)
        raise AssertionError("the killed env actor did not restart")

    try:
        trajectory = asyncio.run(episode(env, TwoTurnEngine(before_answer=kill)))
    finally:
        pool.release(index)
    assert trajectory.status == EpisodeStatus.ENV_ERROR
    assert trajectory.reward == 0.0
    assert trajectory.num_turns == 2  # it got as far as the answer

    # The actor comes back (a new process) and the pool serves new episodes on it.
    pool.wait_ready(timeout_s=120)
    assert ray_session.get(actor.pid.remote()) != pid_before
    leases = [pool.lease(f"g-after{i}") for i in range(2)]
    try:
        assert sorted(i for _, i in leases) == [0, 1]
        trajectories = asyncio.run(_both(leases))
    finally:
        for _, i in leases:
            pool.release(i)
    assert [t.status for t in trajectories] == [EpisodeStatus.COMPLETED] * 2


async def _both(leases):
    return await asyncio.gather(*[episode(env, TwoTurnEngine()) for env, _ in leases])


def test_orchestrator_actor_streams_batches_it_owns_to_the_learner(pool, ray_session):
    """The wiring ``train.py`` uses: OrchestratorActor -> engine actor, env actors; the
    batch comes back as an ObjectRef inside a list, readable after the call returns."""
    from ray import cloudpickle

    from raytunix.rollout.actor import OrchestratorActor
    from raytunix.rollout.batch import record_batch_to_trajectories

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on workers' path
    engine = ray_session.remote(TwoTurnEngine).options(num_cpus=0, max_concurrency=100).remote()
    orchestrator = (
        ray_session.remote(OrchestratorActor)
        .options(num_cpus=0, max_concurrency=100)
        .remote(
            tasks=[TASK],
            tokenizer=TOKENIZER,
            agent_name="tool",
            env_pool=pool,
            engine=engine,
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=4,
            max_staleness=0,
            max_turns=4,
            max_context_tokens=1024,
            sampling=SamplingParams(max_new_tokens=128),
        )
    )
    try:
        refs, info = ray_session.get(orchestrator.next_batch.remote(), timeout=120)
        assert isinstance(refs[0], ray_session.ObjectRef)
        trajectories = record_batch_to_trajectories(ray_session.get(refs[0], timeout=60))
        assert [t.status for t in trajectories] == [EpisodeStatus.COMPLETED] * 2
        assert [t.reward for t in trajectories] == [1.0, 1.0]
        assert info["batch_id"] == 0 and info["consume_version"] == 0
        ray_session.get(orchestrator.mark_trained.remote(info["batch_id"], 1))
        state = ray_session.get(orchestrator.state.remote())
        assert state["counters"]["groups_trained"] == 1
        assert 0 not in state["pending"]
        ray_session.get(orchestrator.stop.remote(), timeout=60)
    finally:
        ray_session.kill(orchestrator)
        ray_session.kill(engine)
