"""The sampler's draws: each row's tokens follow softmax(logits / T) restricted to its
top-k/top-p set and renormalised (a chi-square goodness-of-fit test), no token outside
that set is ever drawn, the reported logprob is ``sampling_logprobs``' for the token, and
a row costs one random number, not one per vocabulary entry."""

import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raytunix.inference.sampling import (  # noqa: E402
    _inverse_cdf,
    sample_tokens,
    sampling_logprobs,
)

# Ten tokens, most likely not first, so the cumulative sum in vocabulary order is tested
# against a distribution in another order.
PROBS = np.array([0.09, 0.02, 0.25, 0.06, 0.14, 0.03, 0.18, 0.05, 0.11, 0.07])
LOGITS = np.log(PROBS).astype(np.float32)
DRAWS = 20_000  # per setting: every expected count is >= 400, so chi-square holds
# The significance level of each goodness-of-fit test. The seed is fixed, so a run is
# deterministic; ALPHA is the chance that a correct sampler fails for some seed, per
# setting (six settings: < 1e-3 for the test). A wrong distribution fails by far.
ALPHA = 1e-4


def _reference(z, temperature, top_k, top_p):
    """float64[V]: the truncated, renormalised distribution by the definition, with a sort:
    softmax at temperature; keep the top_k most likely and renormalise; keep the shortest
    run whose mass reaches top_p, plus every token tied with its last; renormalise."""
    z = np.asarray(z, np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    ranked = np.sort(probs)[::-1]
    k = len(probs) if top_k <= 0 else min(top_k, len(probs))
    mass = ranked[:k] / ranked[:k].sum()
    before = np.cumsum(mass) - mass
    n = k if top_p >= 1.0 else max(1, int(np.sum(before < top_p)))
    out = np.where(probs >= ranked[n - 1], probs, 0.0)
    return out / out.sum()


def _chi2_sf(x: float, df: int) -> float:
    """P(chi-square with ``df`` degrees of freedom > x): one minus the regularised lower
    incomplete gamma P(df/2, x/2), summed as its Poisson-weighted series (Abramowitz &
    Stegun 6.5.29), each term in logs so that a large ``x`` neither overflows nor
    underflows."""
    if x <= 0:
        return 1.0
    a, h = df / 2, x / 2
    total, n = 0.0, 0
    while True:
        term = math.exp((a + n) * math.log(h) - h - math.lgamma(a + n + 1))
        total += term
        n += 1
        if n > h and term < 1e-17 * total:
            return max(0.0, 1.0 - total)


def _goodness_of_fit(counts, expected_probs) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``expected_probs`` over the
    tokens of positive probability (a count outside them is a failure of its own)."""
    support = expected_probs > 0
    expected = expected_probs[support] * counts.sum()
    stat = float(np.sum((counts[support] - expected) ** 2 / expected))
    return _chi2_sf(stat, int(support.sum()) - 1)


def _sample(logits, temperature, top_k, top_p, seeds, token_index=0):
    """``sample_tokens`` for rows ``logits`` (float32[B, V]) with per-row settings and
    seeds; returns numpy ``(tokens, logprobs)``."""
    b = len(seeds)
    tokens, logprobs = jax.jit(sample_tokens)(
        jnp.asarray(logits, jnp.float32),
        jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,)),
        jnp.asarray(seeds, jnp.uint32),
        jnp.zeros((b,), jnp.uint32),
        jnp.full((b,), token_index, jnp.int32),
        jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,)),
        jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,)),
    )
    return np.asarray(tokens), np.asarray(logprobs)


SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),  # plain softmax
    (1.0, 4, 1.0),  # top-k only
    (1.0, 0, 0.7),  # top-p only
    (1.0, 5, 0.9),  # both
    (0.6, 6, 0.8),  # both, sharpened
    (1.8, 0, 1.0),  # temperature only, flattened
]


def test_draws_fit_the_truncated_softmax_in_every_setting_of_one_batch():
    t, k, p = (np.repeat(np.array(col), DRAWS) for col in zip(*SETTINGS))
    seeds = np.arange(len(t))  # every row its own stream
    tokens, _ = _sample(np.tile(LOGITS, (len(t), 1)), t, k, p, seeds)
    for i, setting in enumerate(SETTINGS):
        drawn = tokens[i * DRAWS : (i + 1) * DRAWS]
        expected = _reference(LOGITS, *setting)
        counts = np.bincount(drawn, minlength=len(PROBS)).astype(np.float64)
        assert counts[expected == 0].sum() == 0, f"a token outside the kept set at {setting}"
        assert _goodness_of_fit(counts, expected) > ALPHA, f"{setting}: counts {counts}"
        # The test has power: the same counts reject the distribution at temperature 1.
        if setting[0] != 1.0:
            wrong = _reference(LOGITS, 1.0, *setting[1:])
            assert _goodness_of_fit(counts, wrong) < ALPHA * 1e-3


def test_kept_sets_and_probabilities_match_the_sorted_definition_ties_included():
    rng = np.random.default_rng(4)
    rows, vocab = 96, 300  # three blocks of the two-level running sum, the last padded
    logits = rng.normal(scale=2.0, size=(rows, vocab)).astype(np.float32)
    logits[::2] = rng.integers(0, 5, size=(rows // 2, vocab))  # many exact ties
    t = rng.choice([0.5, 1.0, 1.7], rows)
    k = rng.choice([0, 1, 2, 7, 30, vocab, vocab + 5], rows)
    p = np.where(rng.random(rows) < 0.3, 1.0, rng.uniform(0.05, 1.0, rows))
    got = np.asarray(
        sampling_logprobs(logits, jnp.asarray(t), jnp.asarray(k), jnp.asarray(p, jnp.float32))
    )
    for r in range(rows):
        want = _reference(logits[r], t[r], k[r], p[r])
        np.testing.assert_array_equal(np.isfinite(got[r]), want > 0, err_msg=f"row {r}")
        np.testing.assert_allclose(np.exp(got[r]), want, atol=1e-6, err_msg=f"row {r}")

    tokens, logprobs = _sample(logits, t, k, p, seeds=np.arange(rows))
    assert np.isfinite(got[np.arange(rows), tokens]).all()  # drawn from the kept set
    # The reported logprob is the learner's score of the token.
    np.testing.assert_allclose(logprobs, got[np.arange(rows), tokens], rtol=0, atol=1e-6)


def test_the_most_likely_token_alone_when_top_p_is_below_its_probability():
    logits = np.tile(LOGITS, (64, 1))
    tokens, logprobs = _sample(logits, 1.0, 0, 0.2, seeds=np.arange(64))
    assert (tokens == np.argmax(PROBS)).all() and (logprobs == 0.0).all()


def test_the_inverse_cdf_gives_each_token_its_share_of_evenly_spaced_uniforms():
    # Zeros at block edges and a last block that is mostly padding (blocks of 4 over 10).
    weights = np.array([0.0, 3.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 4.0, 0.5], np.float32)
    n = 10_500  # a multiple of 10.5, the total, so every share is a whole count
    u = (np.arange(n) + 0.5) / n
    tokens = np.asarray(_inverse_cdf(jnp.tile(weights, (n, 1)), jnp.asarray(u, jnp.float32), 4))
    counts = np.bincount(tokens, minlength=len(weights))
    np.testing.assert_allclose(counts, n * weights / weights.sum(), atol=1)
    # In vocabulary order: u sorted gives tokens sorted.
    assert (np.diff(tokens) >= 0).all()


def _random_draw_shapes(jaxpr) -> list[tuple[int, ...]]:
    """The output shapes of every random-bits operation in ``jaxpr`` and the programs
    nested in it (jit, cond, loops)."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("random_bits", "threefry2x32"):
            shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes += _random_draw_shapes(inner)
    return shapes


@pytest.mark.parametrize("truncate", [False, True])
def test_a_row_costs_one_random_number_not_one_per_vocabulary_entry(truncate):
    b, vocab = 3, 50
    args = [
        jnp.zeros((b, vocab)),
        jnp.ones(b),
        jnp.zeros(b, jnp.uint32),
        jnp.zeros(b, jnp.uint32),
        jnp.zeros(b, jnp.int32),
    ]
    if truncate:
        args += [jnp.full(b, 5, jnp.int32), jnp.full(b, 0.9)]
    shapes = _random_draw_shapes(jax.make_jaxpr(sample_tokens)(*args).jaxpr)
    assert shapes == [(b,)]  # one 32-bit word per row, from which its uniform is made

    # The check sees per-token noise: a Gumbel-max draw makes a [B, V] array of bits.
    keys = jax.random.split(jax.random.key(0), b)
    noisy = jax.make_jaxpr(jax.vmap(jax.random.categorical))(keys, args[0]).jaxpr
    assert (b, vocab) in _random_draw_shapes(noisy)
