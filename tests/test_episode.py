"""Token exactness with the real engine: a multi-turn calculator episode's trajectory is
exactly the tokens the engine was given plus what it generated, turn after turn, and the
loss mask is 1 only on generated tokens."""

import asyncio
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raytunix.agents import make_agent  # noqa: E402
from raytunix.data.arithmetic import make_arithmetic_splits  # noqa: E402
from raytunix.data.demonstrations import make_demonstration  # noqa: E402
from raytunix.inference.engine import InferenceEngine  # noqa: E402
from raytunix.learner.learner import Learner, SFTHyperparams  # noqa: E402
from raytunix.models.llama import ModelConfig  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout.env_pool import LocalEnv  # noqa: E402
from raytunix.rollout.episode import run_episode  # noqa: E402
from raytunix.types import EpisodeStatus, SamplingParams  # noqa: E402


class RecordingEngine:
    """Passes requests to a real engine and keeps every (prompt, result) pair."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []
        self.sessions = []
        self.ended = []

    async def generate(self, request):
        result = await self.engine.generate(request)
        self.calls.append((list(request.prompt_ids), result))
        self.sessions.append(request.session_id)
        return result

    def end_session(self, session_id):
        self.ended.append(session_id)
        self.engine.end_session(session_id)


def _memorized_engine(tokenizer, task):
    """A tiny model trained until it reproduces one tool-using demonstration greedily."""
    agent = make_agent("tool", tokenizer)
    ids, mask = agent.render_demonstration(task, make_demonstration(task, use_tool=True))
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        max_seq_len=128,
    )
    learner = Learner(config, seed=0, pad_id=tokenizer.pad_id)
    learner.start_warmup(SFTHyperparams(learning_rate=3e-3, warmup_steps=0))
    tokens = np.array([ids], np.int32)
    loss_mask = np.array([mask], np.float32)
    learner.sft_steps(tokens, loss_mask, num_steps=150, batch_size=1)
    return InferenceEngine(learner.graphdef, learner.params, config, tokenizer, max_batch_size=4)


@pytest.mark.slow
def test_multi_turn_trajectory_is_exactly_engine_inputs_plus_outputs():
    train, _ = make_arithmetic_splits(8, 2, seed=3)
    task = train[0]
    tokenizer = Tokenizer.byte_level()
    engine = RecordingEngine(_memorized_engine(tokenizer, task))
    sampling = SamplingParams(
        max_new_tokens=80, temperature=0.0, stop_token_ids=(tokenizer.end_id,)
    )

    trajectory = asyncio.run(
        run_episode(
            task,
            "g0",
            make_agent("tool", tokenizer),
            LocalEnv("calculator_math", {}),
            engine,
            sampling,
            max_turns=3,
            max_context_tokens=128,
            seed=0,
            timeout_s=60.0,
        )
    )

    assert trajectory.status == EpisodeStatus.COMPLETED and trajectory.reward == 1.0
    assert len(engine.calls) == 2  # a tool call, then the answer
    # Each prompt extends the previous prompt + generation (plus the tool observation).
    (prompt1, result1), (prompt2, result2) = engine.calls
    assert prompt2[: len(prompt1) + len(result1.token_ids)] == prompt1 + list(result1.token_ids)
    observation = prompt2[len(prompt1) + len(result1.token_ids) :]
    assert tokenizer.decode(observation) == f"<|tool|>{task.answer}<|end|><|assistant|>"
    # The trajectory is the last prompt plus the last generation, token for token.
    assert trajectory.token_ids == prompt2 + list(result2.token_ids)
    # Loss mask 1 exactly on generated tokens, with their logprobs and versions.
    generated = set(range(len(prompt1), len(prompt1) + len(result1.token_ids))) | set(
        range(len(prompt2), len(trajectory.token_ids))
    )
    assert [i for i, m in enumerate(trajectory.loss_mask) if m] == sorted(generated)
    expected_logprobs = list(result1.logprobs) + list(result2.logprobs)
    got = [lp for lp, m in zip(trajectory.logprobs, trajectory.loss_mask) if m]
    np.testing.assert_allclose(got, expected_logprobs, rtol=1e-6)
    assert all(v == 0 for v, m in zip(trajectory.policy_versions, trajectory.loss_mask) if m)
    assert all(v == -1 for v, m in zip(trajectory.policy_versions, trajectory.loss_mask) if not m)
    assert tokenizer.decode(result2.token_ids) == f"<answer>{task.answer}</answer><|end|>"
    # Both turns ran in one engine session: the second reused all KV of the first, and
    # the episode freed the session when it ended. The first turn's last token (its stop
    # token) has KV only if the engine fed it: the engine runs one step ahead of the
    # host, so a request that stops is usually decoded once more, and that KV is kept.
    assert engine.sessions[0] == engine.sessions[1] == engine.ended[0] is not None
    assert result1.num_cached_tokens == 0
    first_turn = len(prompt1) + len(result1.token_ids)
    assert result2.num_cached_tokens in (first_turn - 1, first_turn)
    assert engine.engine.stats()["sessions_held"] == 0


class AnsweringEngine:
    """Answers every request with ``<answer>{answer}</answer><|end|>``; keeps the requests."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer = tokenizer, answer
        self.requests = []

    async def generate(self, request):
        from raytunix.types import FinishReason, GenerationResult

        self.requests.append(request)
        ids = tuple(self.tokenizer.encode(f"<answer>{self.answer}</answer>")) + (
            self.tokenizer.end_id,
        )
        return GenerationResult(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=(-0.5,) * len(ids),
            policy_versions=(0,) * len(ids),
            finish_reason=FinishReason.STOP,
        )


def test_every_sampling_setting_reaches_the_engine():
    """The episode only cuts max_new_tokens to the context left; temperature, top-k and
    top-p arrive as given, so the learner scores tokens as they were sampled."""
    train, _ = make_arithmetic_splits(4, 2, seed=3)
    tokenizer = Tokenizer.byte_level()
    engine = AnsweringEngine(tokenizer, train[0].answer)
    sampling = SamplingParams(
        max_new_tokens=4096,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        stop_token_ids=(tokenizer.end_id,),
        stop_strings=("</answer>",),
    )

    trajectory = asyncio.run(
        run_episode(
            train[0],
            "g0",
            make_agent("answer", tokenizer),
            LocalEnv("math_verifier", {}),
            engine,
            sampling,
            max_turns=1,
            max_context_tokens=256,
            seed=0,
            timeout_s=60.0,
        )
    )

    assert trajectory.status == EpisodeStatus.COMPLETED
    (request,) = engine.requests
    got = request.sampling
    assert (got.temperature, got.top_k, got.top_p) == (0.7, 40, 0.9)
    assert got.stop_strings == ("</answer>",) and tokenizer.end_id in got.stop_token_ids
    assert got.max_new_tokens == 256 - len(request.prompt_ids) - 1  # cut to the context left
