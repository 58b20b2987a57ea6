"""Episodes that are programs (``env.name=agent_program``): a user's unchanged OpenAI-client
program runs through the gateway in front of the real engine on the tiny model; its recorded
calls become the episode's trajectories, token for token; its faults end only its episode."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import json
import threading

import openai
import ray
import numpy as np
import pytest

from raytunix.config import ConfigError, config_from_dict, validate
from raytunix.envs.agent_program import AgentProgramEnv, reward_of
from raytunix.envs.contract import EnvContractError
from raytunix.gateway import Gateway, GatewayThread, make_renderer
from raytunix.inference.engine import InferenceEngine
from raytunix.models.llama import ModelConfig, init_model
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.batch import episode_rows
from raytunix.rollout.env_pool import LocalEnv
from raytunix.rollout.program import run_program_episode
from raytunix.types import EpisodeStatus, Task
from test_gateway import RecordingEngine  # the real engine, with what it was asked kept

TOKENIZER = Tokenizer.byte_level()
CONFIG = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=160,
)
GRAPHDEF, PARAMS = init_model(CONFIG, seed=0)
TASK = Task(task_id="t0", question="Say hi.", answer="hi")


def serve_tiny_engine(max_batch_size: int, **gateway_kwargs):
    """``(GatewayThread, RecordingEngine)``: the tiny model's real engine behind a running
    gateway (the caller stops the thread)."""
    engine = RecordingEngine(
        InferenceEngine(
            GRAPHDEF,
            PARAMS,
            CONFIG,
            TOKENIZER,
            max_batch_size=max_batch_size,
            block_size=16,
            prefill_chunk_tokens=64,
        )
    )
    gateway = Gateway(
        engine, make_renderer(TOKENIZER), vocab_size=TOKENIZER.vocab_size, **gateway_kwargs
    )
    return GatewayThread(gateway), engine


@pytest.fixture(scope="module")
def served():
    thread, engine = serve_tiny_engine(max_batch_size=2)
    yield thread, engine
    thread.stop()


def _chat(base_url, api_key, messages):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=6
    )
    return reply.choices[0].message


# -- the programs the tests run (resolved by import path, as a config names them) ----------


def conversation(task, base_url, api_key):
    """Three calls, each appending to the history: one conversation."""
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(3):
        messages.append(_chat(base_url, api_key, messages).model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Again."})
    return {"reward": 0.5}


def rewriter(task, base_url, api_key):
    """A second call whose history drops the first reply (a summary instead)."""
    _chat(base_url, api_key, [{"role": "user", "content": task["question"]}])
    _chat(base_url, api_key, [{"role": "user", "content": "Summary: said hi. Go on."}])
    return 1


def crasher(task, base_url, api_key):
    _chat(base_url, api_key, [{"role": "user", "content": task["question"]}])
    raise ValueError("the agent's own bug")


def exiter(task, base_url, api_key):
    _chat(base_url, api_key, [{"role": "user", "content": task["question"]}])
    raise SystemExit("not logged in")  # as some client libraries do


def overflower(task, base_url, api_key):
    _chat(base_url, api_key, [{"role": "user", "content": task["question"]}])
    return 1e308  # a Python float; inf in the float32 batch


class InfinitePlay(AgentProgramEnv):
    """An adapter whose own ``play`` skips ``reward_of`` (as the verifiers one computes its
    reward itself): the episode runner's check still holds."""

    def play(self, task, base_url, api_key):
        return float("inf")


HANG = threading.Event()
AFTER_HANG: list = []


def hanger(task, base_url, api_key):
    """One call, then waits past its deadline and tries another call."""
    _chat(base_url, api_key, [{"role": "user", "content": task["question"]}])
    HANG.wait(60)
    try:
        _chat(base_url, api_key, [{"role": "user", "content": "still here"}])
    except openai.AuthenticationError as e:
        AFTER_HANG.append(e)
    return 1.0


async def async_program(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4
    )
    return True


def two_args(task, result):
    return 1.0


def _episode(thread, name, timeout_s=120.0, extend="latest", group="g0", seed=0):
    program = LocalEnv.of(AgentProgramEnv(entrypoint=f"test_agent_program:{name}"))
    return run_program_episode(thread.gateway, program, TASK, group, seed, timeout_s, extend)


# -- tests -----------------------------------------------------------------------------------


def test_a_program_that_extends_its_history_is_one_trajectory_of_the_engines_own_ids(served):
    thread, engine = served
    engine.seen.clear()
    [t] = thread.run(_episode(thread, "conversation"))
    assert (t.status, t.reward, t.num_turns) == (EpisodeStatus.COMPLETED, 0.5, 3)
    assert len(engine.seen) == 3
    generated = []
    for request, result in engine.seen:  # call for call: prefilled ids, then generated ids
        n = len(request.prompt_ids)
        assert t.token_ids[:n] == list(request.prompt_ids)
        assert t.token_ids[n : n + len(result.token_ids)] == list(result.token_ids)
        assert t.loss_mask[n : n + len(result.token_ids)] == [1] * len(result.token_ids)
        assert t.logprobs[n : n + len(result.token_ids)] == list(result.logprobs)
        generated += list(result.token_ids)
    assert [i for i, m in zip(t.token_ids, t.loss_mask) if m] == generated
    assert t.metrics["generated_tokens"] == len(generated)  # counted like a native episode's


def test_a_program_that_rewrites_its_history_yields_segments_sharing_the_reward(served):
    thread, engine = served
    engine.seen.clear()
    segments = thread.run(_episode(thread, "rewriter"))
    assert len(segments) == 2
    assert [t.reward for t in segments] == [1.0, 1.0]
    assert [t.metrics["segment"] for t in segments] == [0.0, 1.0]
    for t, (request, result) in zip(segments, engine.seen):
        assert t.token_ids == list(request.prompt_ids) + list(result.token_ids)
    assert len(episode_rows([segments, segments[0]])) == 3


def test_a_crashing_program_ends_only_its_episode_with_the_traceback(served):
    thread, _ = served

    async def both():
        return await asyncio.gather(
            _episode(thread, "crasher", group="g1"), _episode(thread, "rewriter", group="g2")
        )

    crashed, fine = thread.run(both())
    assert [t.status for t in crashed] == [EpisodeStatus.ENV_ERROR]
    assert "ValueError: the agent's own bug" in crashed[0].error
    assert "Traceback" in crashed[0].error
    assert crashed[0].reward == 0.0 and sum(crashed[0].loss_mask) > 0  # its call's tokens
    assert {t.status for t in fine} == {EpisodeStatus.COMPLETED}
    # reported by kind, as a native environment's error is (env_errors.jsonl)
    report = crashed[0].error_report
    assert report.kind == "AgentProgramEnv.play:ValueError" and report.task_id == "t0"
    assert report.location.startswith(__file__) and "the agent's own bug" in report.message
    assert fine[0].error_report is None


def test_a_program_that_raises_system_exit_ends_only_its_episode(served):
    thread, _ = served
    [t] = thread.run(_episode(thread, "exiter"))
    assert t.status == EpisodeStatus.ENV_ERROR
    assert "the program raised SystemExit: not logged in" in t.error
    [after] = thread.run(_episode(thread, "rewriter"))[:1]  # the gateway's loop serves on
    assert after.status == EpisodeStatus.COMPLETED


def test_a_reward_beyond_float32_ends_its_episode_not_the_run(served):
    thread, _ = served
    [t] = thread.run(_episode(thread, "overflower"))
    assert t.status == EpisodeStatus.ENV_ERROR and t.reward == 0.0
    assert "returned reward 1e+308" in t.error and "float32" in t.error
    program = LocalEnv.of(InfinitePlay(entrypoint="test_agent_program:overflower"))
    [t] = thread.run(run_program_episode(thread.gateway, program, TASK, "g0", 0, 60.0))
    assert t.status == EpisodeStatus.ENV_ERROR and "InfinitePlay.play returned reward" in t.error


def test_a_hanging_program_times_out_alone_and_its_later_calls_are_refused(served):
    thread, _ = served
    HANG.clear()
    AFTER_HANG.clear()

    async def both():
        return await asyncio.gather(
            _episode(thread, "hanger", timeout_s=2.0, group="g3"),
            _episode(thread, "conversation", group="g4"),
        )

    hung, fine = thread.run(both())
    assert [t.status for t in hung] == [EpisodeStatus.TIMEOUT]
    assert "episode_timeout_s=2" in hung[0].error
    assert fine[0].status == EpisodeStatus.COMPLETED
    HANG.set()  # the abandoned program goes on: its next call is refused (401)
    for _ in range(600):
        if AFTER_HANG:
            break
        threading.Event().wait(0.1)
    assert "ended" in str(AFTER_HANG[0])


def test_an_async_program_returning_a_bool_is_rewarded(served):
    thread, _ = served
    [t] = thread.run(_episode(thread, "async_program"))
    assert (t.status, t.reward, t.num_turns) == (EpisodeStatus.COMPLETED, 1.0, 1)


def test_rewards_are_numbers_or_a_dict_with_one_within_float32():
    assert reward_of(True, "p") == 1.0 and reward_of({"reward": 2}, "p") == 2.0
    assert reward_of(np.float32(0.5), "p") == 0.5 and reward_of(np.int64(1), "p") == 1.0
    with pytest.raises(ValueError, match="without a 'reward' key"):
        reward_of({"score": 1}, "the program p")
    # Finite in Python but inf in the float32 batch: refused here, not in the learner.
    for bad, problem in (
        ("done", "reward_str"),
        (float("nan"), "reward_nan"),
        (1e308, "reward_out_of_range"),
        (10**400, "reward_inf"),
        (-(10**400), "reward_-inf"),
    ):
        with pytest.raises(EnvContractError, match="the program p returned reward") as e:
            reward_of(bad, "the program p")
        assert e.value.problem == problem


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"entrypoint": "no_such_module_xyz:run"}, "no module named 'no_such_module_xyz'"),
        ({"entrypoint": "test_agent_program:nothing"}, "has no attribute 'nothing'"),
        ({"entrypoint": "test_agent_program:TASK"}, "of type Task, not a function"),
        ({"entrypoint": "test_agent_program:two_args"}, "must take 3"),
        ({"entrypoint": "run_without_module"}, "not an import path; write package.module:function"),
        (
            {"entrypoint": "test_agent_program:crasher", "reward": "test_agent_program:crasher"},
            "env.kwargs.reward.*must take 2",
        ),
    ],
)
def test_bad_entrypoints_are_named_when_the_config_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AgentProgramEnv(**kwargs)
    with pytest.raises(ConfigError, match="env.kwargs"):
        validate(config_from_dict({"env": {"name": "agent_program", "kwargs": kwargs}}))


def test_the_gateway_settings_are_config_with_bounds():
    cfg = config_from_dict({"gateway": {"port": 0, "segments": "any"}})
    assert (cfg.gateway.host, cfg.gateway.segments) == ("127.0.0.1", "any")
    with pytest.raises(ConfigError, match="gateway.port"):
        validate(config_from_dict({"gateway": {"port": 70000}}))
    with pytest.raises(ConfigError, match="gateway.segments"):
        config_from_dict({"gateway": {"segments": "newest"}})


def test_a_program_brings_its_tasks_from_a_function():
    env = AgentProgramEnv(
        entrypoint="test_agent_program:crasher", tasks="test_agent_program:some_tasks"
    )
    tasks = env.tasks("train", 2, 0)
    assert [(t.task_id, t.question, t.answer) for t in tasks] == [
        ("train-0", "1+1?", "2"),
        ("train-1", "2+2?", "4"),
    ]
    assert env.reset(tasks[0]) == "1+1?"
    assert json.dumps([t.metadata for t in tasks]) == "[{}, {}]"


def some_tasks(split, size, seed):
    return [{"question": f"{i}+{i}?", "answer": str(2 * i)} for i in range(1, 10)]


@pytest.mark.slow
def test_the_readme_agent_program_trains_two_rl_steps_by_config(ray_session, tmp_path, capsys):
    from test_byo_env import _rl_steps, _run_dirs, _train

    _train(
        tmp_path,
        "env.name=agent_program",
        "env.kwargs.entrypoint=agent_program_example:run",
        "env.kwargs.reward=agent_program_example:score",
        "model.max_seq_len=512",
        "rollout.episode_timeout_s=300",
    )
    [run_dir] = _run_dirs(tmp_path)
    assert _rl_steps(run_dir) == [1, 2]
    assert os.path.basename(run_dir).startswith("agent-program-example-grpo-")
    # arithmetic tasks, but the calculator's demonstrations are not the program's conversation
    out = capsys.readouterr().out
    assert "warm start: skipped; nothing demonstrates these tasks" in out
    assert "an agent program's episodes are its own conversations" in out


@pytest.mark.slow
def test_the_program_orchestrator_packs_every_segment_of_a_group_into_its_batch():
    from raytunix.rollout.program import ProgramOrchestrator
    from raytunix.types import EnvFailure, SamplingParams

    class HostLostOnce:
        """Each episode's first host dies under it (as an env actor a program ended)."""

        def __init__(self):
            self.local = LocalEnv.of(AgentProgramEnv(entrypoint="test_agent_program:rewriter"))
            self.lost = 0

        async def play(self, *args):
            if self.lost < 2:
                self.lost += 1
                raise EnvFailure("play failed: the env actor died", retryable=True)
            return await self.local.play(*args)

    program = HostLostOnce()
    engine = InferenceEngine(GRAPHDEF, PARAMS, CONFIG, TOKENIZER, max_batch_size=2, block_size=16)
    orchestrator = ProgramOrchestrator(
        make_gateway=lambda client: Gateway(client, make_renderer(TOKENIZER)),
        tasks=[TASK],
        agent_factory=lambda: None,
        engine=engine,
        env_provider=lambda group_id: (program, lambda: None),
        group_size=2,
        groups_per_batch=1,
        max_concurrent_episodes=2,
        max_staleness=0,
        max_turns=1,
        max_context_tokens=CONFIG.max_seq_len,
        sampling=SamplingParams(max_new_tokens=6),
    )

    async def one_batch():
        orchestrator.start()
        try:
            return await orchestrator.next_batch()
        finally:
            await orchestrator.stop()

    [batch], info = asyncio.run(one_batch())
    # Two episodes of two segments each (the rewritten history), all with the reward 1.
    assert batch.num_rows == 4
    assert batch.column("group_id").to_pylist() == ["g0"] * 4
    assert batch.column("reward").to_pylist() == [1.0] * 4
    assert orchestrator.counters["episodes_completed"] == 4  # counted per row (segment)
    assert orchestrator.counters["episodes_restarted_env_error"] == 2  # re-run elsewhere


EXITS = Task(task_id="t-exit", question="Bye.", answer="", metadata={"exit": True})


def _faults_pool(thread, num_actors, max_restarts):
    """``(EnvPool of program_faults_example, on_the_pool(task, group))``: a ready pool, and
    a coroutine running one episode on an env actor it leases."""
    from raytunix.rollout.env_pool import EnvPool

    pool = EnvPool(
        "agent_program",
        {"entrypoint": "program_faults_example:run"},
        num_actors=num_actors,
        max_restarts=max_restarts,
        import_paths=[os.path.dirname(__file__)],
    )
    pool.wait_ready()

    async def on_the_pool(task, group):
        env, index = pool.lease(group)
        try:
            return await run_program_episode(thread.gateway, env, task, group, 0, 120.0)
        finally:
            pool.release(index)

    return pool, on_the_pool


@pytest.mark.slow
def test_a_program_that_ends_its_process_ends_only_the_episodes_of_its_env_actor(
    ray_session, served
):
    thread, _ = served
    pool, on_the_pool = _faults_pool(thread, num_actors=2, max_restarts=1)

    async def both():
        return await asyncio.gather(on_the_pool(EXITS, "g5"), on_the_pool(TASK, "g6"))

    try:
        [crashed], fine = thread.run(both())
        assert crashed.status == EpisodeStatus.ENV_ERROR
        assert "play failed: the env actor" in crashed.error  # died, or restarting
        assert crashed.metrics["env_failure_retryable"] == 1.0  # re-run by the orchestrator
        assert crashed.reward == 0.0 and sum(crashed.loss_mask) > 0  # the call it made
        assert [t.status for t in fine] == [EpisodeStatus.COMPLETED]
        # The actor that died restarts and serves the next episodes; the gateway serves on.
        for _ in range(600):
            try:
                ray.get([a.num_envs.remote() for a in pool.actors], timeout=5)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                threading.Event().wait(0.1)

        async def two_more():
            return await asyncio.gather(*(on_the_pool(TASK, f"g{7 + i}") for i in range(2)))

        again = thread.run(two_more())
        assert [t.status for [t] in again] == [EpisodeStatus.COMPLETED] * 2
        assert pool.num_alive == 2
        # A gateway on loopback of another node cannot be reached: named, not a refusal.
        env, index = pool.lease("g9")
        outcome = thread.run(env.play(TASK, "http://127.0.0.1:1/v1", "k", 10.0, "ab" * 28))
        pool.release(index)
        assert outcome.status == EpisodeStatus.ENV_ERROR and "gateway.host=0.0.0.0" in outcome.error
    finally:
        for actor in pool.actors:
            ray.kill(actor)


@pytest.mark.slow
def test_an_env_actor_a_program_ended_for_good_is_replaced_and_the_episodes_go_on(
    ray_session, served
):
    thread, _ = served
    pool, on_the_pool = _faults_pool(thread, num_actors=1, max_restarts=0)  # dies for good

    try:
        [crashed] = thread.run(on_the_pool(EXITS, "r0"))
        assert crashed.status == EpisodeStatus.ENV_ERROR
        assert (pool.replaced, pool.membership()["dead"], pool.num_alive) == (1, [0], 1)
        [t] = thread.run(on_the_pool(TASK, "r1"))  # on the replacement, once it is up
        assert t.status == EpisodeStatus.COMPLETED
        assert pool.membership()["leases"] == [1, 1]
    finally:
        for actor in pool.actors:
            ray.kill(actor)


def test_a_gateway_on_every_interface_gives_programs_an_address_they_can_reach():
    gateway = Gateway(None, make_renderer(TOKENIZER), host="0.0.0.0", port=8000)
    assert gateway.url.startswith("http://") and "0.0.0.0" not in gateway.url
    assert Gateway(None, make_renderer(TOKENIZER), host="::1", port=1).url == "http://[::1]:1"


def test_a_program_episode_leaves_the_trace_spans_of_a_native_one(served):
    from raytunix import profiling

    thread, engine = served
    engine.seen.clear()
    profiling.recorder().drain()  # this process's spans of earlier tests
    [t] = thread.run(_episode(thread, "conversation", group="spans"))
    spans = [s for s in profiling.recorder().drain()["spans"] if s[5] == "spans/0"]
    turns = [args for name, _, _, _, args, _ in spans if name == "turn"]
    [episode] = [args for name, _, _, _, args, _ in spans if name == "episode"]
    assert [a["tokens"] for a in turns] == [len(r.token_ids) for _, r in engine.seen]
    assert sum(a["tokens"] for a in turns) == t.metrics["generated_tokens"]
    assert (episode["status"], episode["turns"], episode["reward"]) == ("completed", 3, 0.5)
    assert episode["generate_s"] + episode["env_s"] == pytest.approx(t.metrics["program_s"])
    assert 0 < episode["generate_s"] <= t.metrics["program_s"]


def test_a_long_error_keeps_both_ends_of_its_traceback():
    from raytunix.envs.agent_program import clip_error

    assert clip_error("short") == "short"
    text = "Traceback (most recent call last):\n  File x.py, line 3\nValueError: " + "x" * 100_000
    clipped = clip_error(text)
    assert len(clipped) < 2100 and clipped.startswith("Traceback") and "ValueError" in clipped
    assert clipped.endswith("x" * 1000) and f"[... {len(text) - 2000} characters ...]" in clipped


def test_a_gateway_that_cannot_listen_is_a_config_error_naming_the_key(monkeypatch):
    import socket

    from raytunix.config import load_config
    from raytunix.driver.prepare import check_gateway

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    program = ["env.name=agent_program", "env.kwargs.entrypoint=agent_program_example:run"]
    check_gateway(load_config("default", program))  # loopback, any port: fine
    with pytest.raises(ConfigError, match=r"gateway.host='nonsense.invalid' does not resolve"):
        check_gateway(load_config("default", [*program, "gateway.host=nonsense.invalid"]))
    with pytest.raises(ConfigError, match=r"'203.0.113.77' is not local"):
        check_gateway(load_config("default", [*program, "gateway.host=203.0.113.77"]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"gateway.port={port} is in use"):
            check_gateway(load_config("default", [*program, f"gateway.port={port}"]))
    check_gateway(load_config("default", ["gateway.host=nonsense.invalid"]))  # no program


def cut_short(task, base_url, api_key):
    """A reply cut at max_tokens, kept in the history, then one more call."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(2):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=3
        )
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Go on."})
    return 1.0


def test_a_reply_cut_at_max_tokens_is_extended_by_the_next_call_of_its_history(served, monkeypatch):
    thread, engine = served
    engine.seen.clear()
    renderer, seen_known = thread.gateway.renderer, []
    real = renderer.chat_prompt

    def chat_prompt(messages, tools, known):
        seen_known.append(dict(known))
        return real(messages, tools, known)

    monkeypatch.setattr(renderer, "chat_prompt", chat_prompt)
    [t] = thread.run(_episode(thread, "cut_short"))
    # the second call rendered the cut reply from its exact ids, not from its text
    assert [len(k) for k in seen_known] == [0, 1]
    [ids] = seen_known[1].values()
    assert ids[: len(engine.seen[0][1].token_ids)] == list(engine.seen[0][1].token_ids)
    (first, cut), (second, _) = engine.seen
    assert cut.finish_reason.value == "length" and len(cut.token_ids) == 3
    # the cut reply's own ids, closed as any message is, then the new user turn
    n = len(first.prompt_ids) + len(cut.token_ids)
    assert list(second.prompt_ids[:n]) == list(first.prompt_ids) + list(cut.token_ids)
    assert second.prompt_ids[n] == thread.gateway.renderer.stop_token_ids[0]
    assert t.num_turns == 2 and t.token_ids[: len(second.prompt_ids)] == list(second.prompt_ids)
