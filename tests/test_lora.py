"""LoRA on the learner: only the adapters train, engines get merged weights, the base
model is frozen and is the KL reference, checkpoints hold the adapters."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from raytunix.config import ConfigError, load_config
from raytunix.learner.checkpoint import Checkpointer
from raytunix.learner.learner import Learner
from raytunix.learner.lora import LoraSpec, init_adapters, merge_adapters
from raytunix.learner.train_state import (
    RLHyperparams,
    create_train_state,
    make_optimizer,
    make_sft_update,
    policy_params,
)
from raytunix.models.llama import ModelConfig, forward, init_model
from raytunix.rollout.batch import trajectories_to_record_batch
from raytunix.types import EpisodeStatus, Trajectory

CONFIG = ModelConfig(
    vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32
)
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules="q_proj,v_proj,down_proj")
Q = "layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=0)


def _kernel(params, key):
    layer, attn_or_mlp, name = key.split(".")[1:]
    return np.asarray(params["layers"][int(layer)][attn_or_mlp][name]["kernel"][...])


def _random_b(adapters, seed=1):
    """The adapters with a nonzero B, so that both factors get a gradient."""
    keys = jax.random.split(jax.random.key(seed), len(adapters))
    return {
        k: {**v, "lora_B": 0.1 * jax.random.normal(r, v["lora_B"].shape)}
        for r, (k, v) in zip(keys, adapters.items())
    }


def test_only_the_adapters_carry_optimizer_state(model):
    graphdef, params = model
    state = create_train_state(graphdef, params, optax.adam(1e-3), seed=0, lora=SPEC)
    assert set(state.params) == {Q, "layers.0.self_attn.v_proj", "layers.0.mlp.down_proj"}
    adapter_shapes = {x.shape for x in jax.tree.leaves(state.params)}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert moments and {x.shape for x in moments} == adapter_shapes
    # Adam's two moments of the adapters, nothing of the base model's 10k parameters.
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(state.params))
    assert state.params[Q]["lora_A"].shape == (4, 32) and state.params[Q]["lora_B"].shape == (
        32,
        4,
    )


@pytest.mark.slow
def test_b_starts_at_zero_so_the_first_forward_is_the_base_models(model):
    graphdef, params = model
    adapters = init_adapters(params, SPEC, seed=0)
    assert all(not np.any(a["lora_B"]) and np.any(a["lora_A"]) for a in adapters.values())
    tokens = jnp.array([[1, 5, 3, 7, 2]])
    positions = jnp.arange(5)[None]
    base_logits, _ = forward(graphdef, params, tokens, positions)
    lora_logits, _ = forward(
        graphdef, merge_adapters(params, adapters, SPEC.scale), tokens, positions
    )
    np.testing.assert_array_equal(np.asarray(lora_logits), np.asarray(base_logits))


@pytest.mark.slow  # two updates compile: about 30 s on 2 cores
def test_a_lora_sgd_step_is_the_full_gradient_chained_into_the_adapters(model):
    """With W' = W + s (B A)^T (kernel layout) and G = dL/dW', the chain rule gives
    dL/dA = s B^T G^T and dL/dB = s G^T A^T; one SGD step moves each adapter by -lr x its
    gradient, so the merged weight becomes W + s ((B - lr gB)(A - lr gA))^T."""
    graphdef, params = model
    lr, s = 0.5, SPEC.scale
    sgd = make_optimizer(lr, optimizer="sgd", max_grad_norm=None)
    state = create_train_state(graphdef, params, sgd, seed=0, lora=SPEC)
    state = state.replace(params=_random_b(state.params))
    tokens = jnp.array([[1, 5, 3, 7, 2, 9], [4, 4, 8, 1, 6, 3]])
    loss_mask = jnp.array([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]], jnp.float32)

    # The full model's gradient at the merged weights, by the update's own SFT loss.
    full = make_sft_update(graphdef, optax.sgd(1.0))
    merged = policy_params(state)
    full_state = create_train_state(graphdef, merged, optax.sgd(1.0), seed=0)
    stepped, _ = full(full_state, tokens, loss_mask)
    grads = jax.tree.map(lambda a, b: a - b, merged, stepped.params)  # sgd(1): W - W' = G

    new, metrics = make_sft_update(graphdef, sgd)(state, tokens, loss_mask)
    assert float(metrics["update_nonfinite"]) == 0.0
    for key, adapter in state.params.items():
        a, b = np.asarray(adapter["lora_A"]), np.asarray(adapter["lora_B"])
        g = _kernel(grads, key)
        g_a, g_b = s * b.T @ g.T, s * g.T @ a.T
        np.testing.assert_allclose(new.params[key]["lora_A"], a - lr * g_a, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(new.params[key]["lora_B"], b - lr * g_b, rtol=1e-4, atol=1e-6)
        expected = _kernel(params, key) + s * ((b - lr * g_b) @ (a - lr * g_a)).T
        np.testing.assert_allclose(_kernel(policy_params(new), key), expected, rtol=1e-5, atol=1e-6)
    # The base never moves; layers without adapters are the base's.
    jax.tree.map(np.testing.assert_array_equal, new.base, params)
    np.testing.assert_array_equal(
        _kernel(policy_params(new), "layers.0.self_attn.k_proj"),
        _kernel(params, "layers.0.self_attn.k_proj"),
    )


def _record_batch(step: int):
    """Two groups of two with rewards that differ within each group."""
    rows = []
    for i, (group, reward) in enumerate([("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 1.0)]):
        prompt = [1 + (step + i) % 5, 2]
        completion = [(3 + step * 3 + i * 5 + t) % 14 + 1 for t in range(3 + i % 2)]
        rows.append(
            Trajectory(
                task_id=group,
                group_id=f"{group}{step}",
                token_ids=prompt + completion,
                loss_mask=[0] * len(prompt) + [1] * len(completion),
                logprobs=[0.0] * len(prompt) + [-1.5] * len(completion),
                policy_versions=[-1] * len(prompt) + [step] * len(completion),
                reward=reward,
                status=EpisodeStatus.COMPLETED,
                num_turns=1,
            )
        )
    return trajectories_to_record_batch(rows)


def _lora_hp(**settings):
    lora = {"lora_rank": SPEC.rank, "lora_alpha": SPEC.alpha}
    return RLHyperparams(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        learning_rate=1e-2,
        kl_coef=0.05,
        lora_target_modules=SPEC.target_modules,
        **{**lora, **settings},
    )


@pytest.mark.slow  # an RL update compiles twice, with a checkpoint: 15 s or more on 2 cores
def test_rl_steps_train_the_adapters_and_serve_base_plus_scaled_b_a(tmp_path, model):
    graphdef, params = model
    base = jax.tree.map(np.asarray, params)
    learner = Learner(CONFIG, seed=3, model=(graphdef, params))
    learner.start_rl(_lora_hp())
    assert learner._ref_params is learner._state.base  # the KL reference: the base, no copy
    for step in range(2):
        metrics = learner.train_step(_record_batch(step))
        assert metrics["update_skipped"] == 0.0
        assert (metrics["kl_ref"] > 0.0) == (step > 0)  # the first step starts at the base
    adapters = learner._state.params
    assert np.any(np.asarray(adapters[Q]["lora_B"]))  # the adapters moved
    jax.tree.map(np.testing.assert_array_equal, learner._state.base, base)  # the base did not

    served, version = learner.versioned_weights_numpy()
    assert version == 2
    a, b = np.asarray(adapters[Q]["lora_A"]), np.asarray(adapters[Q]["lora_B"])
    np.testing.assert_allclose(
        _kernel(learner.weights_numpy(master=True), Q),
        _kernel(base, Q) + SPEC.scale * (b @ a).T,
        rtol=1e-6,
        atol=1e-7,
    )
    np.testing.assert_array_equal(
        served["embed_tokens"]["embedding"][...], base["embed_tokens"]["embedding"][...]
    )
    assert _kernel(served, Q).dtype == jnp.dtype(CONFIG.dtype)

    # A checkpoint holds the adapters and their optimizer state, not the base.
    ckpt = Checkpointer(str(tmp_path))
    learner.save(ckpt, {})
    ckpt.close()
    resumed = Learner(CONFIG, seed=11, model=(graphdef, params))
    resumed.start_rl(_lora_hp())
    resumed.restore(Checkpointer(str(tmp_path)), reference=None)
    jax.tree.map(np.testing.assert_array_equal, resumed._state.params, adapters)
    jax.tree.map(np.testing.assert_array_equal, resumed._state.opt_state, learner._state.opt_state)
    assert resumed._ref_params is resumed._state.base
    assert resumed._state.lora_scale == SPEC.scale
    for name in ("step", "rng", "base", "value_head"):
        jax.tree.map(
            np.testing.assert_array_equal,
            getattr(resumed._state, name),
            getattr(learner._state, name),
        )
    assert (resumed.version, resumed.rl_step) == (learner.version, learner.rl_step)
    resumed.train_step(_record_batch(2))
    learner.train_step(_record_batch(2))
    jax.tree.map(np.testing.assert_array_equal, resumed._state.params, learner._state.params)


@pytest.mark.parametrize(
    "override, message",
    [
        ("learner.lora_rank=-1", "lora_rank"),
        ("learner.lora_alpha=0", "lora_alpha"),
        ("learner.lora_target_modules=q_proj,qkv", "'qkv'"),
    ],
)
def test_the_config_rejects_bad_lora_settings(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_the_update_rejects_bad_lora_settings():
    with pytest.raises(ValueError, match="lora_rank=-2"):
        _lora_hp(lora_rank=-2).check()
    with pytest.raises(ValueError, match="'mlp'"):
        LoraSpec(4, 8.0, "q_proj,mlp").check()
    assert load_config(None).learner.lora_rank == 0  # off by default
