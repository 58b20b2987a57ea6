"""verifiers environments through the gateway (``env.name=verifiers``): a verifiers 0.4
environment defined in code (``verifiers_example``) drives the tiny model itself through the
gateway; each episode's reward is the environment's own score and its tokens are the ids the
engine prefilled and generated; a rubric that raises or hangs ends only its episode."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio

import pytest

pytest.importorskip(
    "verifiers.v1", reason="verifiers is an optional extra: pip install -e '.[verifiers]'"
)

from raytunix.config import ConfigError, config_from_dict, validate
from raytunix.envs.verifiers_env import VerifiersEnv
from raytunix.rollout.env_pool import LocalEnv
from raytunix.rollout.program import run_program_episode
from raytunix.types import EpisodeStatus
from test_agent_program import TOKENIZER, serve_tiny_engine
from verifiers_example import SUMS, score


@pytest.fixture(scope="module")
def served():
    thread, engine = serve_tiny_engine(max_batch_size=4, default_max_tokens=8)
    yield thread, engine
    thread.stop()


def _episode(thread, env, task, group="g0", seed=0, timeout_s=120.0):
    return run_program_episode(thread.gateway, LocalEnv.of(env), task, group, seed, timeout_s)


def test_a_group_is_scored_by_the_environments_rubric_on_the_engines_own_tokens(served):
    thread, engine = served
    env = VerifiersEnv(env_id="verifiers_example:make_env")
    [task] = env.tasks("train", 1, seed=3)
    for seed in range(3):  # one group: the same task, three episodes
        engine.seen.clear()
        [t] = thread.run(_episode(thread, env, task, seed=seed))
        assert (t.status, t.num_turns) == (EpisodeStatus.COMPLETED, 1), t.error
        [(request, result)] = engine.seen
        generated = list(result.token_ids)
        assert t.token_ids == list(request.prompt_ids) + generated
        assert t.loss_mask == [0] * len(request.prompt_ids) + [1] * len(generated)
        assert t.logprobs[len(request.prompt_ids) :] == list(result.logprobs)
        reply = TOKENIZER.decode(generated)
        assert t.reward == pytest.approx(score(task.answer, reply))
        assert TOKENIZER.decode(list(request.prompt_ids)).count(task.question) == 1


def test_a_multi_turn_environment_resumes_the_conversation_through_the_gateway(served):
    thread, engine = served
    env = VerifiersEnv(env_id="verifiers_example:make_two_turn_env")
    [task] = env.tasks("train", 1, seed=5)
    engine.seen.clear()
    segments = thread.run(_episode(thread, env, task))
    (first, first_out), (second, second_out) = engine.seen
    # The tiny model's first reply is cut short at the gateway's 8 tokens; the resumed call
    # puts it back as its own ids (closed as any message is), so the conversation stays one
    # trajectory: the second call's prompt extends the first call's prompt and reply.
    assert first_out.finish_reason.name == "LENGTH"
    [t] = segments
    assert t.status == EpisodeStatus.COMPLETED, t.error
    n = len(first.prompt_ids) + len(first_out.token_ids)
    assert list(second.prompt_ids[:n]) == list(first.prompt_ids) + list(first_out.token_ids)
    assert t.token_ids == list(second.prompt_ids) + list(second_out.token_ids)
    assert t.num_turns == 2
    prompt = TOKENIZER.decode(list(second.prompt_ids))
    assert prompt.index(task.question) < prompt.index("Check it and answer again.")
    last_reply = TOKENIZER.decode(list(second_out.token_ids))
    assert t.reward == pytest.approx(score(task.answer, last_reply))


def test_a_taskset_loads_by_id_played_offline_by_raytunix_chat(served):
    thread, _ = served
    env = VerifiersEnv(env_id="verifiers_example")
    [seat] = [env.env.config.agent]
    assert (seat.harness.id, seat.runtime.type) == ("raytunix_chat", "subprocess")
    train, heldout = env.tasks("train", 10, 0), env.tasks("heldout", 8, 0)
    assert len({t.task_id for t in train} | {t.task_id for t in heldout}) == len(SUMS)
    assert env.tasks("train", 10, 0) == train  # the same seed, the same tasks
    a, b = map(int, train[0].question.rstrip("=").split("+"))
    assert train[0].answer == str(a + b)
    [t] = thread.run(_episode(thread, env, train[0]))
    assert t.status == EpisodeStatus.COMPLETED and t.reward > 0, t.error
    with pytest.raises(ValueError, match="has 18 tasks; data.train_size=19"):
        env.tasks("train", 19, 0)


def test_a_rubric_that_raises_ends_only_its_episode(served):
    thread, _ = served
    bad = VerifiersEnv(env_id="verifiers_example:make_env", env_args={"explode": True})
    good = VerifiersEnv(env_id="verifiers_example:make_env")
    [task] = good.tasks("train", 1, 0)

    async def both():
        return await asyncio.gather(
            _episode(thread, bad, task, group="g1"), _episode(thread, good, task, group="g2")
        )

    [crashed], [fine] = thread.run(both())
    assert crashed.status == EpisodeStatus.ENV_ERROR
    assert "the rubric's own bug" in crashed.error and crashed.reward == 0.0
    assert sum(crashed.loss_mask) > 0  # the tokens of its call are kept, with no reward
    assert fine.status == EpisodeStatus.COMPLETED


@pytest.mark.slow
def test_a_hanging_rubric_times_out_alone(served):
    thread, _ = served
    hung = VerifiersEnv(env_id="verifiers_example:make_env", env_args={"stall_s": 60.0})
    good = VerifiersEnv(env_id="verifiers_example:make_env")
    [task] = good.tasks("train", 1, 0)

    async def both():
        return await asyncio.gather(
            _episode(thread, hung, task, group="g3", timeout_s=3.0),
            _episode(thread, good, task, group="g4"),
        )

    [timed_out], [fine] = thread.run(both())
    assert timed_out.status == EpisodeStatus.TIMEOUT
    assert "episode_timeout_s=3" in timed_out.error
    assert fine.status == EpisodeStatus.COMPLETED


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"env_id": ""}, "name a verifiers environment"),
        ({"env_id": "verifiers_example:SUMS"}, "is an object of type list, not a function"),
        ({"env_id": "verifiers_example:score"}, "must take 0"),
        ({"env_id": "no_such_vf_env_xyz"}, "does not load.*no_such_vf_env_xyz"),
    ],
)
def test_bad_env_ids_are_named_when_the_config_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VerifiersEnv(**kwargs)
    with pytest.raises(ConfigError, match="env.kwargs"):
        validate(config_from_dict({"env": {"name": "verifiers", "kwargs": kwargs}}))


@pytest.mark.slow
def test_a_verifiers_environment_trains_two_rl_steps_by_config(ray_session, tmp_path):
    from test_byo_env import _rl_steps, _run_dirs, _train

    _train(
        tmp_path,
        "env.name=verifiers",
        "env.kwargs.env_id=verifiers_example:make_env",
        "data.train_size=10",
        "model.max_seq_len=256",
        "rollout.episode_timeout_s=300",
        "warmup.enabled=false",
    )
    [run_dir] = _run_dirs(tmp_path)
    assert _rl_steps(run_dir) == [1, 2]
