"""Sampling: temperature, top-k and top-p draw only from the allowed tokens, report the
log-probability of the distribution they drew from, keep rows independent, and the
learner scores the engine's tokens with the same numbers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raytunix.inference.engine import InferenceEngine
from raytunix.inference.sampling import (
    check_sampling_settings,
    sample_tokens,
    sampling_logprobs,
    split_seed,
)
from raytunix.learner.train_state import logprobs_fn
from raytunix.models.llama import ModelConfig, forward, init_model
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import GenerationRequest, SamplingParams

VOCAB = 512


def _draws(logits, temperature, top_k, top_p, num_draws, seed=0):
    """``num_draws`` tokens per row (token indices 0..num_draws-1): int32[num_draws, B]
    and their logprobs float32[num_draws, B]."""
    b = logits.shape[0]
    lo, hi = split_seed(seed)
    args = (
        jnp.asarray(logits, jnp.float32),
        jnp.asarray(temperature, jnp.float32),
        jnp.full((b,), lo, jnp.uint32),
        jnp.full((b,), hi, jnp.uint32),
    )
    k = jnp.asarray(top_k, jnp.int32)
    p = jnp.asarray(top_p, jnp.float32)

    @jax.jit
    def one(index):
        return sample_tokens(*args, jnp.full((b,), index, jnp.int32), k, p)

    tokens, logprobs = jax.lax.map(one, jnp.arange(num_draws, dtype=jnp.int32))
    return np.asarray(tokens), np.asarray(logprobs)


def _expected_distribution(logits, temperature, top_k, top_p):
    """The truncated, renormalised distribution, computed independently in float64:
    softmax at temperature, keep top_k, renormalise, keep the shortest prefix with mass
    >= top_p, renormalise. Returns float64[V] (zeros outside the allowed set)."""
    z = np.asarray(logits, np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    kept = order[:top_k] if top_k > 0 else order
    mass = probs[kept] / probs[kept].sum()
    n = len(kept) if top_p >= 1.0 else int(np.searchsorted(np.cumsum(mass), top_p) + 1)
    out = np.zeros_like(probs)
    out[kept[:n]] = probs[kept[:n]]
    return out / out.sum()


def test_hand_computed_truncated_distributions():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    cases = [  # (temperature, top_k, top_p) -> probabilities
        ((1.0, 0, 1.0), [0.4, 0.3, 0.2, 0.1]),
        ((1.0, 2, 1.0), [4 / 7, 3 / 7, 0, 0]),
        ((1.0, 0, 0.6), [4 / 7, 3 / 7, 0, 0]),  # 0.4 < 0.6, 0.4 + 0.3 >= 0.6
        ((1.0, 0, 0.75), [4 / 9, 3 / 9, 2 / 9, 0]),
        ((1.0, 3, 0.5), [4 / 7, 3 / 7, 0, 0]),  # top-p over the renormalised top 3
        ((1.0, 0, 0.3), [1, 0, 0, 0]),  # the most likely token is always kept
        ((0.5, 2, 1.0), [16 / 25, 9 / 25, 0, 0]),  # temperature 0.5 squares the probs
    ]
    for (t, k, p), want in cases:
        got = np.exp(np.asarray(sampling_logprobs(logits, t, k, p)))
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"T={t} k={k} p={p}")


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 5, 1.0), (1.0, 0, 0.5), (0.7, 40, 0.9), (1.3, 0, 0.8)]
)
def test_draws_stay_in_the_allowed_set_with_the_right_frequencies(temperature, top_k, top_p):
    rng = np.random.default_rng(1)
    logits = 2.0 * rng.normal(size=(1, VOCAB)).astype(np.float32)
    expected = _expected_distribution(logits[0], temperature, top_k, top_p)
    allowed = expected > 0
    assert 2 <= allowed.sum() < VOCAB  # the setting truncates, yet leaves a choice
    tokens, logprobs = _draws(logits, [temperature], [top_k], [top_p], num_draws=4000)

    assert allowed[tokens[:, 0]].all()
    # Each draw reports log of its probability under the truncated distribution.
    np.testing.assert_allclose(logprobs[:, 0], np.log(expected[tokens[:, 0]]), atol=1e-4)
    # Frequencies match within 5 binomial standard deviations.
    counts = np.bincount(tokens[:, 0], minlength=VOCAB) / len(tokens)
    sd = np.sqrt(expected * (1 - expected) / len(tokens))
    assert np.all(np.abs(counts - expected) <= 5 * sd + 1e-3)


@pytest.mark.slow
def test_rows_keep_their_own_settings_in_one_batch():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, VOCAB)).astype(np.float32)
    settings = [  # (temperature, top_k, top_p) per row
        (1.0, 3, 1.0),
        (1.0, 0, 0.3),
        (1.0, 0, 1.0),
        (0.0, 0, 1.0),
        (0.5, 10, 0.9),
    ]
    t, k, p = (np.array(col) for col in zip(*settings))
    tokens, logprobs = _draws(logits, t, k, p, num_draws=300, seed=5)

    for row, (rt, rk, rp) in enumerate(settings):
        alone, alone_lp = _draws(logits[row : row + 1], [rt], [rk], [rp], num_draws=300, seed=5)
        # A row's draws and logprobs do not depend on its neighbours' settings.
        np.testing.assert_array_equal(tokens[:, row], alone[:, 0])
        np.testing.assert_allclose(logprobs[:, row], alone_lp[:, 0], atol=1e-6)
        if rt == 0:  # greedy: the argmax, scored at temperature 1
            assert (tokens[:, row] == np.argmax(logits[row])).all()
            want = jax.nn.log_softmax(logits[row])[np.argmax(logits[row])]
            np.testing.assert_allclose(logprobs[:, row], want, atol=1e-6)
        else:
            allowed = _expected_distribution(logits[row], rt, rk, rp) > 0
            assert allowed[tokens[:, row]].all()
    assert len(set(tokens[:, 0])) == 3  # top-3 row uses its whole set
    assert len(set(tokens[:, 2])) > 50  # untruncated row ranges widely


def test_top_p_one_keeps_every_token_even_with_a_long_tail():
    # One dominant token and a tail whose float32 cumulative mass rounds to 1 early.
    logits = np.full((2, VOCAB), -25.0, np.float32)
    logits[:, 0] = 0.0
    logp = sampling_logprobs(logits, jnp.ones(2), jnp.array([0, 0]), jnp.array([1.0, 0.99]))
    assert np.isfinite(np.asarray(logp[0])).all()
    assert np.isfinite(np.asarray(logp[1, 0])) and np.isneginf(np.asarray(logp[1, 1:])).all()


def test_truncation_is_differentiable_and_zero_outside_the_set():
    logits = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1]))

    def logprob_of_first(x):
        return sampling_logprobs(x, 0.7, 2, 1.0)[0]

    grad = np.asarray(jax.grad(logprob_of_first)(logits))
    assert np.isfinite(grad).all()
    np.testing.assert_allclose(grad[2:], 0.0, atol=1e-6)
    assert grad[0] > 0 > grad[1]


def test_settings_are_checked_with_the_bad_value_named():
    check_sampling_settings(0.0, 0, 1.0, allow_greedy=True)
    check_sampling_settings(0.7, 50, 0.95, allow_greedy=False)
    for args, named in [
        ((0.0, 0, 1.0), "temperature=0.0"),
        ((math.inf, 0, 1.0), "inf"),
        ((1.0, -1, 1.0), "top_k=-1"),
        ((1.0, 2.5, 1.0), "top_k=2.5"),
        ((1.0, 0, 0.0), "top_p=0.0"),
        ((1.0, 0, 1.2), "top_p=1.2"),
    ]:
        with pytest.raises(ValueError, match=named):
            check_sampling_settings(*args, allow_greedy=False)


# ---------------------------------------------------------------- sampler vs learner

TOKENIZER = Tokenizer.byte_level()
CONFIG = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=64,
)
GRAPHDEF, PARAMS = init_model(CONFIG, seed=3)
PROMPTS = [
    [(11 + 7 * i + j) % CONFIG.vocab_size for i in range(n)] for j, n in enumerate((3, 9, 17, 5))
]


def _learner_logprobs(prompt, generated, temperature, top_k=0, top_p=1.0):
    """The learner's score of ``generated`` after ``prompt``: the function the GRPO
    update and behaviour-logprob recomputation use, on a right-padded batch row."""
    tokens = np.zeros((1, CONFIG.max_seq_len), np.int32)
    mask = np.zeros((1, CONFIG.max_seq_len), np.float32)
    n, m = len(prompt), len(generated)
    tokens[0, : n + m] = list(prompt) + list(generated)
    mask[0, n : n + m] = 1.0
    score = logprobs_fn(GRAPHDEF, temperature=temperature, top_k=top_k, top_p=top_p)
    return np.asarray(score(PARAMS, tokens, mask))[0, n : n + m]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_learners_recomputed_logprobs(temperature):
    requests = [
        GenerationRequest(
            request_id=f"r{i}",
            prompt_ids=tuple(p),
            seed=100 + i,
            sampling=SamplingParams(max_new_tokens=12, temperature=temperature),
        )
        for i, p in enumerate(PROMPTS)
    ]

    async def main():
        engine = InferenceEngine(GRAPHDEF, PARAMS, CONFIG, TOKENIZER, max_batch_size=4)
        try:
            return await engine.generate_many(requests)
        finally:
            await engine.close()

    results = asyncio.run(main())
    for request, result in zip(requests, results):
        assert len(result.token_ids) == 12
        learner = _learner_logprobs(request.prompt_ids, result.token_ids, temperature)
        assert np.max(np.abs(np.asarray(result.logprobs) - learner)) < 1e-4


@jax.jit
def _model_sample_step(params, tokens, lengths, temperature, seed_lo, seed_hi, index, top_k, top_p):
    """One sampling step as the engine takes it: the model's logits after each row's
    ``lengths`` tokens (``tokens`` right-padded, int32[B, S]) into ``sample_tokens``."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, _ = forward(GRAPHDEF, params, tokens, positions)
    last = logits[jnp.arange(tokens.shape[0]), lengths - 1]
    return sample_tokens(last, temperature, seed_lo, seed_hi, index, top_k, top_p)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 20, 1.0), (0.7, 0, 0.8), (0.7, 30, 0.9)]
)
def test_truncated_sampler_logprobs_equal_the_learners(temperature, top_k, top_p):
    """The sampler that the engine runs, fed the model's next-token logits step by step,
    against the learner's scoring of the same tokens with the same settings."""
    n_new, rows = 10, len(PROMPTS)
    tokens = np.zeros((rows, CONFIG.max_seq_len), np.int32)  # right padding: never attended
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    for r, prompt in enumerate(PROMPTS):
        tokens[r, : len(prompt)] = prompt
    lo, hi = split_seed(7)
    settings = (
        jnp.full((rows,), temperature, jnp.float32),
        jnp.full((rows,), lo, jnp.uint32),
        jnp.full((rows,), hi, jnp.uint32),
    )
    truncation = (jnp.full((rows,), top_k, jnp.int32), jnp.full((rows,), top_p, jnp.float32))
    sampled_logprobs = np.zeros((rows, n_new), np.float32)
    for step in range(n_new):
        new, logprobs = _model_sample_step(
            PARAMS, tokens, lengths, *settings, jnp.full((rows,), step, jnp.int32), *truncation
        )
        tokens[np.arange(rows), lengths] = np.asarray(new)
        lengths += 1
        sampled_logprobs[:, step] = np.asarray(logprobs)

    for r, prompt in enumerate(PROMPTS):
        generated = tokens[r, len(prompt) : len(prompt) + n_new]
        learner = _learner_logprobs(prompt, generated, temperature, top_k, top_p)
        assert np.isfinite(learner).all()
        assert np.max(np.abs(sampled_logprobs[r] - learner)) < 1e-4
