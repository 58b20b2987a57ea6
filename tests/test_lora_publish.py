"""Under LoRA a weight publish to an engine in another process ships only the adapters:
the engine merges them onto the learner's frozen base, fetched once per base (and again
after a restart), and serves what the learner's merged weights serve."""

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_engine_restart import (  # noqa: E402 - the tiny model and its greedy probe
    CONFIG as ENGINE_CONFIG,
    LEARNER_SEED,
    TOKENIZER,
    _driver_job,
    _engine,
    _greedy,
)
from test_lora import CONFIG, SPEC, _lora_hp, _random_b, _record_batch  # noqa: E402

from raytunix.driver.job import Job  # noqa: E402
from raytunix.inference.weights import LoraBase  # noqa: E402
from raytunix.learner.actor import LearnerActor  # noqa: E402
from raytunix.learner.learner import Learner  # noqa: E402
from raytunix.learner.lora import PublishedAdapters  # noqa: E402
from raytunix.models.llama import ModelConfig  # noqa: E402


def _nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def _trained_lora_learner(config: ModelConfig) -> Learner:
    """A LoRA learner whose adapters moved off zero (as after some updates)."""
    learner = Learner(config, seed=3)
    learner.start_rl(_lora_hp())
    learner._state = learner._state.replace(params=_random_b(learner._state.params))
    return learner


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_a_lora_publish_is_the_adapters_and_merges_on_the_base_into_the_policy(dtype, tolerance):
    config = dataclasses.replace(CONFIG, dtype=dtype)
    learner = _trained_lora_learner(config)
    published = learner.versioned_adapters_numpy()
    params, version = learner.policy()

    assert isinstance(published, PublishedAdapters)
    assert (published.version, published.scale) == (version, SPEC.scale)
    assert {x.dtype for x in jax.tree.leaves(published.adapters)} == {np.dtype(np.float32)}
    assert published.nbytes == _nbytes(learner._state.params)
    assert published.nbytes < _nbytes(params) / 4  # rank 4 of d_model 32: more so in a big model

    base_id, base = learner.base_weights_numpy()
    assert base_id == published.base_id != ""
    assert {x.dtype for x in jax.tree.leaves(base)} == {np.dtype(dtype)}  # the compute dtype
    engine_side = LoraBase(config.dtype)
    engine_side.set(base_id, base)
    merged = engine_side.merged(published)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(merged), jax.tree.leaves(params)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(want, np.float32),
            rtol=tolerance,
            atol=tolerance,
        )


def test_adapters_of_another_base_are_refused_not_merged_onto_the_wrong_weights():
    learner = _trained_lora_learner(CONFIG)
    published = learner.versioned_adapters_numpy()
    engine_side = LoraBase(CONFIG.dtype)
    with pytest.raises(RuntimeError, match="base_weights"):
        engine_side.merged(published)  # no base yet
    engine_side.set(*learner.base_weights_numpy())
    learner.start_rl(_lora_hp())  # a new phase: a new base (the adapters merged in)
    assert learner.base_id != published.base_id
    with pytest.raises(RuntimeError, match=f"policy version {learner.version} belong to LoRA"):
        engine_side.merged(learner.versioned_adapters_numpy())


def test_without_lora_the_learner_has_no_adapters_to_publish():
    learner = Learner(CONFIG, seed=3)
    learner.start_rl(_lora_hp(lora_rank=0))
    assert not learner.has_adapters and learner.base_id == ""
    with pytest.raises(RuntimeError, match="versioned_weights_numpy"):
        learner.versioned_adapters_numpy()
    with pytest.raises(RuntimeError, match="no LoRA base"):
        learner.base_weights_numpy()


def _same_reply(got, want):
    """Greedy tokens equal, logprobs equal up to the merge's float32 rounding (jitted on
    the engine, op by op on the learner)."""
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=2e-4)


@pytest.mark.slow  # a Ray learner and two engine actors, an RL update compiled: ~1 min
def test_a_disaggregated_lora_engine_serves_the_learners_merged_weights_after_publishes(
    ray_session,
):
    ray = ray_session
    learner = (
        ray.remote(LearnerActor)
        .options(num_cpus=0, max_concurrency=10)
        .remote(ENGINE_CONFIG, LEARNER_SEED, TOKENIZER.pad_id)
    )
    engine = _engine(ray, learner, max_restarts=1)  # its own first weights: another seed
    reference = _engine(ray, None, max_restarts=0)  # served the learner's merged weights
    try:
        ray.get(learner.start_rl.remote(_lora_hp()))
        whole = ray.get(learner.weights.remote(whole=True))[0]
        replies = []
        for step in range(2):
            ray.get(learner.train_step.remote([ray.put(_record_batch(step))]))
            published = ray.get(learner.weights.remote())
            assert isinstance(published, PublishedAdapters)
            assert (published.version, 10 * published.nbytes < _nbytes(whole)) == (step + 1, True)
            Job.publish_weights(_driver_job(learner, [engine]))
            ray.get(reference.update_weights.remote(learner.weights.remote(whole=True)))
            replies.append(_greedy(ray, reference))
            _same_reply(_greedy(ray, engine), replies[-1])
        assert replies[0] != replies[1]  # the second publish changed what is served

        # A crash: Ray restarts the actor, which fetches the adapters and the base again
        # (its own first weights differ from the learner's base).
        ray.kill(engine, no_restart=False)
        _same_reply(_greedy(ray, engine), replies[-1])

        # An engine with nowhere to fetch the base from says so.
        with pytest.raises(RuntimeError, match="built without weights_source"):
            ray.get(reference.update_weights.remote(learner.weights.remote()))
    finally:
        for actor in (engine, reference, learner):
            ray.kill(actor)
