"""Mixed precision (``model.dtype=bfloat16``): the model computes in bfloat16 while the
learner keeps float32 master weights and optimizer state, engines get bfloat16 weights and
a bfloat16 KV cache, and logits, logprobs and losses stay float32.

How far bfloat16 logprobs may stray, ``BF16_LOGPROB_BOUND``: 0.05 nats on any one token.
bfloat16 keeps 8 significant bits, so each rounding moves a value by up to 2^-9 of itself
(0.2%). A token's logprob is its logit minus the log-sum-exp of all logits, and every
logit is a sum over the width of products that passed through a few such roundings per
layer; for logits of a few units that is a few hundredths of a nat at worst. On this
module's model (2 blocks, weights scaled so that logits reach about +-4, as a trained
model's do, instead of the near-uniform ones of a fresh init) the measured gap to float32
is at most 0.008 nats and 0.002 on average; the engine's bfloat16 logprobs are within
0.004 of the learner's bfloat16 ones (the same numbers rounded in another order), and a
bfloat16 KV cache under a float32 model within 0.002.
A run watches the same gap per RL step as ``mismatch_logprob_abs_mean``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raytunix.config import ConfigError, load_config
from raytunix.driver.prepare import model_config
from raytunix.inference.engine import InferenceEngine
from raytunix.learner.learner import Learner
from raytunix.learner.train_state import (
    create_train_state,
    logprobs_fn,
    make_optimizer,
    make_sft_update,
)
from raytunix.models.hf import hf_config_from_model
from raytunix.models.llama import ModelConfig, cast_params, init_model
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import GenerationRequest, SamplingParams

BF16_LOGPROB_BOUND = 0.05  # nats, any one token; why: the module docstring
SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
TOKENIZER = Tokenizer.byte_level()
FP32 = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=64,
)
BF16 = dataclasses.replace(FP32, dtype="bfloat16")
GRAPH_FP32, _PARAMS = init_model(FP32, seed=0)
GRAPH_BF16, _ = init_model(BF16, seed=0)
# Every matrix x4: logits up to about +-4 instead of the near-uniform ones of a fresh init,
# where rounding would hardly show.
PARAMS = jax.tree.map(lambda x: x * 4 if x.ndim == 2 else x, _PARAMS)


def _tokens(rows=4, length=48, seed=1):
    return jax.random.randint(jax.random.key(seed), (rows, length), 0, FP32.vocab_size)


def _float_dtypes(tree):
    return {
        jnp.dtype(x.dtype).name
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    }


def test_bf16_logprobs_of_the_same_weights_stay_within_the_bound_of_fp32():
    tokens = _tokens()
    mask = jnp.ones(tokens.shape, jnp.float32)
    fp32 = logprobs_fn(GRAPH_FP32, **SAMPLING)(PARAMS, tokens, mask)
    bf16 = logprobs_fn(GRAPH_BF16, **SAMPLING)(PARAMS, tokens, mask)
    gap = np.abs(np.asarray(fp32) - np.asarray(bf16))[:, 1:]

    assert bf16.dtype == jnp.float32  # logprobs come back float32 under bfloat16 compute
    assert gap.max() <= BF16_LOGPROB_BOUND
    assert 0 < gap.mean() <= BF16_LOGPROB_BOUND / 5  # bfloat16 did round something


@pytest.mark.slow
def test_bf16_learner_keeps_fp32_master_weights_and_optimizer_state_and_learns():
    optimizer = make_optimizer(3e-3)
    state = create_train_state(GRAPH_BF16, PARAMS, optimizer, seed=0)
    update = make_sft_update(GRAPH_BF16, optimizer)
    tokens = _tokens(rows=2, length=16, seed=2)
    mask = jnp.ones(tokens.shape, jnp.float32)

    losses = []
    for _ in range(3):
        state, metrics = update(state, tokens, mask)
        losses.append(float(metrics["loss"]))

    assert _float_dtypes(state.params) == {"float32"}
    assert _float_dtypes(state.opt_state) == {"float32"}  # AdamW's moments
    assert metrics["update_nonfinite"] == 0.0 and np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.1


def test_the_learner_publishes_bf16_weights_and_exports_its_fp32_master():
    learner = Learner(BF16, seed=0)
    published, version = learner.policy()
    shipped = learner.weights_numpy()
    master = learner.weights_numpy(master=True)

    assert version == 0
    assert _float_dtypes(published) == _float_dtypes(shipped) == {"bfloat16"}
    assert _float_dtypes(master) == _float_dtypes(learner.params) == {"float32"}
    shipped_bytes = sum(x.nbytes for x in jax.tree.leaves(shipped))
    assert shipped_bytes * 2 == sum(x.nbytes for x in jax.tree.leaves(master))


def _generate_and_score(config, graphdef, kv_dtype):
    """Samples from an engine of ``config``, then scores the same tokens with the learner's
    ``logprobs_fn`` of ``graphdef``; returns ``(|engine - learner| per generated token,
    engine stats)``."""
    requests = [
        GenerationRequest(
            request_id=f"r{i}",
            prompt_ids=tuple((11 + 7 * j + i) % config.vocab_size for j in range(8)),
            seed=i,
            sampling=SamplingParams(max_new_tokens=12, temperature=1.0),
        )
        for i in range(2)
    ]

    async def main():
        engine = InferenceEngine(
            graphdef,
            PARAMS,
            config,
            TOKENIZER,
            max_batch_size=2,
            block_size=8,
            prefill_chunk_tokens=32,
            kv_dtype=kv_dtype,
        )
        results = await engine.generate_many(requests)
        stats = engine.stats()
        await engine.close()
        return results, stats

    results, stats = asyncio.run(main())
    score = logprobs_fn(graphdef, **SAMPLING)
    gaps = []
    for request, result in zip(requests, results):
        assert len(result.token_ids) == 12
        prompt = len(request.prompt_ids)
        tokens = jnp.asarray([list(request.prompt_ids) + list(result.token_ids)])
        mask = jnp.asarray([[0.0] * prompt + [1.0] * len(result.token_ids)])
        learner = np.asarray(score(PARAMS, tokens, mask))[0, prompt:]
        gaps.append(np.abs(learner - np.asarray(result.logprobs)))
    return np.concatenate(gaps), stats


@pytest.mark.slow
def test_a_bf16_engine_generates_and_matches_the_bf16_learner_within_the_bound():
    gap, stats = _generate_and_score(BF16, GRAPH_BF16, "auto")

    assert np.isfinite(gap).all() and gap.max() <= BF16_LOGPROB_BOUND
    # kv_dtype auto follows the model: bfloat16 keys and values, 2 bytes each.
    token_bytes = 2 * FP32.n_layers * FP32.n_kv_heads * FP32.head_dim * 2
    assert stats["kv_bytes_capacity"] == stats["kv_blocks_total"] * 8 * token_bytes


@pytest.mark.slow
def test_a_bf16_kv_cache_under_an_fp32_model_stays_within_the_bound():
    gap, stats = _generate_and_score(FP32, GRAPH_FP32, "bfloat16")

    assert np.isfinite(gap).all() and gap.max() <= BF16_LOGPROB_BOUND
    token_bytes = 2 * FP32.n_layers * FP32.n_kv_heads * FP32.head_dim * 2
    assert stats["kv_bytes_capacity"] == stats["kv_blocks_total"] * 8 * token_bytes


def test_cast_params_casts_floats_only_and_passes_through_what_is_already_cast():
    tree = {"w": jnp.ones((2, 2), jnp.float32), "ids": jnp.arange(3)}
    cast = cast_params(tree, "bfloat16")
    assert cast["w"].dtype == jnp.bfloat16 and cast["ids"].dtype == tree["ids"].dtype
    assert cast_params(cast, jnp.bfloat16)["w"] is cast["w"]


def test_model_dtype_and_kv_dtype_are_settings_and_reach_the_model():
    cfg = load_config(None, ["model.dtype=bfloat16", "engine.kv_dtype=float32"])
    assert model_config(cfg, TOKENIZER).dtype == "bfloat16"
    assert cfg.engine.engine_kwargs()["kv_dtype"] == "float32"
    assert load_config(None).model.dtype == "float32"  # the default run is unchanged
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(None, ["model.dtype=float16"])
    with pytest.raises(ValueError, match="ModelConfig.dtype='float16'"):
        dataclasses.replace(FP32, dtype="float16")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        InferenceEngine(GRAPH_FP32, PARAMS, FP32, TOKENIZER, kv_dtype="int8")


def test_a_bf16_run_exports_against_its_source_folders_config():
    source = hf_config_from_model(FP32)  # the config.json of the folder a run started from
    exported = hf_config_from_model(BF16, base=source, dtype="float32")
    assert exported == source  # written as the float32 master weights, shape unchanged
