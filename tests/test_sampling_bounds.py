"""Sampling settings are bounded so that logprobs stay finite and sampling is never greedy
by accident: a temperature that float32 cannot divide by (1e-50 becomes 0.0, 1e-40 is a
subnormal that makes the logits inf) is refused by the config, the engine and the learner,
naming the floor; a top_p that keeps one token of every distribution is refused like
top_k=1; at the floor, engine and learner give the same finite logprobs."""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raytunix.config import ConfigError, load_config  # noqa: E402
from raytunix.inference.sampling import (  # noqa: E402
    MIN_TEMPERATURE,
    check_sampling_settings,
    greedy_top_p_bound,
    sample_tokens,
    sampling_logprobs,
)
from raytunix.learner.losses import token_logprobs  # noqa: E402

TINY_TEMPERATURES = [1e-50, 1e-40, 2.0**-126, 5e-324, 1e-8, 0.0099999]


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_the_config_refuses_a_temperature_below_the_floor_naming_key_and_floor(temperature):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"rollout.temperature={temperature!r}"])
    message = str(e.value)
    assert message.startswith(f"rollout.temperature={temperature!r}")
    assert "floor 0.01" in message and "float32" in message


def test_the_config_refuses_a_temperature_float32_cannot_hold_and_accepts_the_floor():
    with pytest.raises(ConfigError, match=r"rollout.temperature=1e\+39 overflows float32"):
        load_config(None, ["rollout.temperature=1e39"])
    assert load_config(None, [f"rollout.temperature={MIN_TEMPERATURE}"]).rollout.temperature == 0.01


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_engine_and_learner_entry_points_refuse_it_too(temperature):
    from raytunix.learner.learner import Learner
    from raytunix.learner.train_state import RLHyperparams
    from raytunix.models.llama import ModelConfig

    for allow_greedy in (True, False):  # the engine's requests, the learner's scoring
        with pytest.raises(ValueError, match="below the floor 0.01"):
            check_sampling_settings(temperature, 0, 1.0, allow_greedy=allow_greedy)
    hp = RLHyperparams(temperature=temperature, top_k=0, top_p=1.0)
    with pytest.raises(ValueError, match="below the floor 0.01"):
        hp.check()
    learner = Learner(
        ModelConfig(
            vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
        )
    )
    with pytest.raises(ValueError, match="below the floor 0.01"):
        learner.start_rl(hp)
    check_sampling_settings(0.0, 0, 1.0, allow_greedy=True)  # exact 0: greedy generation


@pytest.mark.slow
def test_at_the_floor_engine_and_learner_logprobs_are_finite_and_equal():
    logits = jnp.array([[2.0e4, -1.5e4, 1.99e4, 0.0], [3.0, 3.0 + 1e-2, -7.0, 2.99]], jnp.float32)
    t = jnp.full((2,), MIN_TEMPERATURE, jnp.float32)
    zero = jnp.zeros((2,), jnp.uint32)
    tokens, engine_lp = sample_tokens(logits, t, zero, zero, jnp.zeros((2,), jnp.int32))
    learner_lp = token_logprobs(
        logits[:, None, :], tokens[:, None], temperature=MIN_TEMPERATURE, top_k=0, top_p=1.0
    )[:, 0]
    assert np.isfinite(np.asarray(engine_lp)).all()
    np.testing.assert_allclose(learner_lp, engine_lp, rtol=1e-5, atol=1e-6)
    grad = jax.grad(
        lambda x: jnp.sum(
            token_logprobs(
                x[:, None, :], tokens[:, None], temperature=MIN_TEMPERATURE, top_k=0, top_p=1.0
            )
        )
    )(logits)
    assert np.isfinite(np.asarray(grad)).all()


def test_a_top_p_that_keeps_one_token_of_every_distribution_is_refused_like_top_k_1():
    vocab = load_config(None, []).model.tokenizer_vocab_size
    for overrides in (
        ["rollout.top_p=1e-9"],
        [f"rollout.top_p={1 / vocab!r}"],
        ["rollout.top_k=40", "rollout.top_p=0.025"],
        ["rollout.top_k=2", "rollout.top_p=0.5"],
    ):
        with pytest.raises(ConfigError, match=r"rollout.top_p=.* is greedy decoding"):
            load_config(None, overrides)
    # Just above the bound some distribution keeps a second token: accepted.
    load_config(None, [f"rollout.top_p={1.01 / vocab!r}"])
    load_config(None, ["rollout.top_k=40", "rollout.top_p=0.026"])
    # The engine may still generate greedily that way (evaluation); training may not.
    check_sampling_settings(1.0, 0, 1e-9, allow_greedy=True, vocab_size=vocab)
    with pytest.raises(ValueError, match="top_k=1 is greedy"):
        check_sampling_settings(1.0, 1, 1.0, allow_greedy=False)


def test_the_greedy_bound_is_where_the_sampler_stops_keeping_a_second_token():
    vocab = 300
    logits = jax.random.normal(jax.random.key(0), (64, vocab)) * 1e-3  # nearly flat, no ties
    bound = greedy_top_p_bound(0, vocab)

    def kept(top_p, top_k=0):
        logp = sampling_logprobs(logits, 1.0, top_k, top_p)
        return np.asarray(jnp.sum(jnp.isfinite(logp), axis=-1))

    assert kept(bound).max() == 1 and kept(bound / 10).max() == 1
    assert kept(bound * 1.01).max() >= 2  # a near-flat row keeps two
    assert kept(greedy_top_p_bound(8, vocab), top_k=8).max() == 1
    assert kept(greedy_top_p_bound(8, vocab) * 1.01, top_k=8).max() >= 2


def test_the_learner_bounds_top_p_by_its_model_vocabulary():
    from raytunix.learner.learner import Learner
    from raytunix.learner.train_state import RLHyperparams
    from raytunix.models.llama import ModelConfig

    learner = Learner(
        ModelConfig(
            vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
        )
    )
    with pytest.raises(ValueError, match=r"top_p=0.06 is greedy decoding.*1/16"):
        learner.start_rl(RLHyperparams(temperature=1.0, top_k=0, top_p=0.06))
    learner.start_rl(RLHyperparams(temperature=1.0, top_k=0, top_p=0.07))


def test_a_hugging_face_model_bounds_top_p_by_its_config_vocabulary(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.01 is greedy decoding.*1/100"):
        load_config(None, [f"model.path={tmp_path}", "rollout.top_p=0.01"])
    accepted = load_config(None, [f"model.path={tmp_path}", "rollout.top_p=0.011"])
    assert accepted.rollout.top_p == 0.011
