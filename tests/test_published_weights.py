"""Weights published to engines carry the policy version they belong to: the learner's
update runs in a worker thread while engine actors ask for weights, and a read in between
the new parameters and the new version would label one policy's tokens with another's
version (and so misjudge their staleness)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from raytunix.learner.learner import RLHyperparams, Learner  # noqa: E402
from raytunix.models.llama import ModelConfig  # noqa: E402
from raytunix.rollout.batch import trajectories_to_record_batch  # noqa: E402
from raytunix.types import EpisodeStatus, Trajectory  # noqa: E402

CONFIG = ModelConfig(
    vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32
)


def _batch():
    rows = [
        Trajectory(
            task_id=g,
            group_id=g,
            token_ids=[1 + i, 2, 3 + i, 5, 7],
            loss_mask=[0, 0, 1, 1, 1],
            logprobs=[0.0, 0.0, -1.0, -1.0, -1.0],
            policy_versions=[-1, -1, 0, 0, 0],
            reward=r,
            status=EpisodeStatus.COMPLETED,
            num_turns=1,
        )
        for i, (g, r) in enumerate([("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 1.0)])
    ]
    return trajectories_to_record_batch(rows)


def _same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_weights_read_while_an_update_finishes_are_those_of_the_version_they_carry(monkeypatch):
    learner = Learner(CONFIG, seed=0)
    learner.start_rl(RLHyperparams(temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-2))
    before, version_before = learner.versioned_weights_numpy()
    seen = []
    real_device_get = jax.device_get

    def device_get_then_read(tree):
        # The update has been computed and its metrics are being fetched: an engine's
        # request for weights arrives now.
        out = real_device_get(tree)
        if isinstance(tree, dict) and not seen:
            seen.append(learner.versioned_weights_numpy())
        return out

    monkeypatch.setattr(jax, "device_get", device_get_then_read)
    metrics = learner.train_step(_batch())
    monkeypatch.setattr(jax, "device_get", real_device_get)

    assert metrics["policy_version"] == version_before + 1
    ((tree, version),) = seen
    after, version_after = learner.versioned_weights_numpy()
    assert version_after == version_before + 1 and not _same(after, before)
    # Whatever the read saw, parameters and version are of one and the same update.
    assert (version, _same(tree, before)) in {(version_before, True)}, (
        f"weights read mid-update were labelled version {version} but are "
        f"{'the old' if _same(tree, before) else 'the new'} parameters"
    )


def test_the_colocated_publish_and_the_actor_read_use_the_same_pair():
    learner = Learner(CONFIG, seed=0)
    learner.start_rl(RLHyperparams(temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-2))
    learner.train_step(_batch())
    params, version = learner.policy()
    tree, numpy_version = learner.versioned_weights_numpy()
    assert version == numpy_version == learner.version == 1
    assert _same(tree, params)
