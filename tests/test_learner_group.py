"""A multi-host learner group (issue 9 item 6) on the session's local Ray: two learner
actors, one JAX program over both (``jax.distributed``, CPU collectives through gloo),
the batch's rows split over the two processes' devices. Its updates must equal one
process's ``Learner.train_step``, and a group that lost a host is rebuilt from its last
checkpoint and trains on; so is one whose host is alive but stuck."""

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest
from test_checkpoints import _record_batch  # two groups of two, a new batch per step

# Every test here runs end to end (a Ray session, a train, a benchmark): the slow tier.
pytestmark = pytest.mark.slow

CONFIG_KW = {
    "vocab_size": 16,
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 1,
    "d_ff": 64,
    "max_seq_len": 32,
}


def _assert_params_close(got, want):
    import jax

    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    # Two processes sum the packed rows' gradients in another order than one; Adam at lr
    # 1e-2 turns that float32 rounding into up to ~4e-6 on a near-zero weight (0.04% of a
    # step), far below what a wrong shard or a missing host's gradient would move.
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def _assert_metrics_close(got, want):
    for key in (
        "loss",
        "grad_norm",
        "reward_mean",
        "num_tokens",
        "clip_fraction",
        "policy_version",
    ):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_a_two_host_group_matches_one_process_and_is_rebuilt_after_a_host_dies(
    ray_session, tmp_path
):
    import ray

    from raytunix.learner.group import LearnerGroup, LearnerHostFailure
    from raytunix.learner.learner import Learner, RLHyperparams
    from raytunix.models.llama import ModelConfig
    from raytunix.cluster.placement import LearnerHostsSpec

    config = ModelConfig(**CONFIG_KW)
    hp = RLHyperparams(
        temperature=1.0, top_k=0, top_p=1.0, rl_steps=4, learning_rate=1e-2, weight_decay=0.01
    )
    batches = [_record_batch(step) for step in range(3)]

    single = Learner(config, seed=3, pad_id=0)
    single.start_rl(hp)
    expected = [single.train_step(batch) for batch in batches]
    expected_params = single.weights_numpy()

    # Both hosts on this one node: no TPU worker ids, so ranks follow the bundles.
    group = LearnerGroup(
        LearnerHostsSpec(num_hosts=2, resources={"CPU": 0.1}, strategy="PACK"),
        config,
        seed=3,
        pad_id=0,
        call_timeout_s=300,
    )
    try:
        assert [info["rank"] for info in group.host_infos] == [0, 1]
        assert group.device_count == 2  # one JAX program over both processes' devices
        assert len({info["pid"] for info in group.host_infos}) == 2
        first_coordinator = group.coordinator
        group.start_rl(hp)
        assert group.mesh_shape() == {"data": 2, "fsdp": 1, "tensor": 1}  # rows split in two
        refs = [ray.put(batch) for batch in batches]
        _assert_metrics_close(group.train_step([refs[0]]), expected[0])
        assert group.save(str(tmp_path / "ckpt"), {"data_position": 4}) == 1
        _assert_metrics_close(group.train_step([refs[1]]), expected[1])
        group.finish_checkpoints()  # step 1 is committed: the last checkpoint

        ray.kill(group.hosts[1])  # a host dies
        with pytest.raises(LearnerHostFailure, match="learner host 1 .*died"):
            group.train_step([refs[2]])
        with pytest.raises(LearnerHostFailure, match="group is down"):
            group.policy_version()

        extras = group.rebuild()  # new actors, a new coordinator, the step-1 checkpoint
        assert extras["data_position"] == 4 and extras["policy_version"] == 1
        assert group.coordinator != first_coordinator
        assert group.policy_version() == 1
        for step in (1, 2):  # the lost update again, then on
            _assert_metrics_close(group.train_step([refs[step]]), expected[step])
        weights, version = group.weights()
        assert version == 3
        _assert_params_close(weights, expected_params)
        # Every host gathers the weights, rank 0 alone writes them.
        assert "model.safetensors" in group.export(str(tmp_path / "export"))

        # A host alive but stuck (its event loop blocked, as in a wedged collective or a
        # hung storage read) is named when the deadline passes, killed with the others,
        # and the group is rebuilt from the newest checkpoint both hosts read.
        group.save(str(tmp_path / "ckpt"), {"data_position": 12})
        group.finish_checkpoints()
        stuck_pid = group.host_infos[1]["pid"]
        with pytest.raises(LearnerHostFailure, match=r"learner host 1 \(.*\) alive but stuck"):
            group._on_all_ranked(
                lambda rank, host: (
                    host.__ray_call__.remote(lambda self: time.sleep(600))
                    if rank == 1
                    else host.policy_version.remote()
                ),
                timeout_s=5,
            )
        assert group.hosts == []
        extras = group.rebuild()
        assert extras["data_position"] == 12 and extras["policy_version"] == 3
        assert group.policy_version() == 3 and stuck_pid not in {i["pid"] for i in group.host_infos}
    finally:
        group.shutdown()
