"""Sharding of the learner's update (raytunix.learner.sharding).

The rules and their errors are checked here on this process's one device (divisibility
against an ``AbstractMesh``, which needs no devices). The updates run in a subprocess
started with 8 fake CPU devices (``XLA_FLAGS`` must be set before JAX starts, and this
process's JAX already has one device), this file run as a script: a one-device mesh
against the unsharded update (bit for bit), the ``Learner`` on data x fsdp x tensor meshes
2 x 2 x 2 and 1 x 4 x 2 (with micro-batches) against it, the warm start, and orbax
checkpoints of a split state restored onto the same and another mesh.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import json
import logging
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from raytunix.learner.batch import Batch
from raytunix.learner.sharding import (
    MESH_AXES,
    PARAM_RULES,
    MeshConfig,
    partition_spec,
    path_name,
    tree_shardings,
)
from raytunix.learner.train_state import (
    RLHyperparams,
    create_train_state,
    make_optimizer_from,
    make_policy_update,
)
from raytunix.models.llama import ModelConfig, init_model
from raytunix.rollout.batch import trajectories_to_record_batch
from raytunix.types import EpisodeStatus, Trajectory

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
LEARNING_RATE = 1e-3
# Adam divides each gradient by its own running scale, so a float32 rounding difference
# in a near-zero gradient entry moves that parameter by up to a fraction of a whole step:
# parameters agree to 1% of one step (measured: 0.4%); gradients, losses and the
# optimizer's moments, which rounding moves only by float32 epsilons, agree to 1e-5.
PARAMS_ATOL = 1e-2 * LEARNING_RATE
# Qwen3-like: QKV biases and q/k norms, so every rule of the model is exercised.
CONFIG = ModelConfig(
    vocab_size=16,
    d_model=32,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=64,
    qkv_bias=True,
    qk_norm=True,
)
UNTIED = ModelConfig(
    vocab_size=16,
    d_model=32,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=64,
    tie_embeddings=False,
    o_bias=True,
    qkv_bias=True,
)


def _record_batch():
    """Three groups of two (6 rows: not a multiple of the 4 batch shards, so rows are
    padded), rewards varied within each group."""
    rows = []
    for i, (prompt, completion, reward) in enumerate(
        [
            ([1, 2], [5, 6, 7], 1.0),
            ([3], [8, 9, 10, 11], 0.0),
            ([1, 2], [12, 13, 14], 0.0),
            ([3], [4, 4, 4, 4], 1.0),
            ([7, 7], [2, 9], 0.5),
            ([7, 7], [9, 2, 2], 0.0),
        ]
    ):
        group = "abcabc"[i]
        rows.append(
            Trajectory(
                task_id=group,
                group_id=group,
                token_ids=prompt + completion,
                loss_mask=[0] * len(prompt) + [1] * len(completion),
                logprobs=[0.0] * len(prompt) + [-1.5 - 0.1 * j for j in range(len(completion))],
                policy_versions=[-1] * len(prompt) + [0] * len(completion),
                reward=reward,
                status=EpisodeStatus.COMPLETED,
                num_turns=1,
            )
        )
    return trajectories_to_record_batch(rows)


def _hp(**settings):
    return RLHyperparams(**SAMPLING, learning_rate=LEARNING_RATE, weight_decay=0.01, **settings)


# ------------------------------------------------------------------ in this process


def test_mesh_sizes_resolve_the_rest_and_bad_sizes_name_the_key():
    assert MeshConfig().axis_sizes(8) == (8, 1, 1)
    assert MeshConfig(data=-1, fsdp=4, tensor=2).axis_sizes(8) == (1, 4, 2)
    assert MeshConfig(data=2, fsdp=-1, tensor=2).axis_sizes(8) == (2, 2, 2)
    assert MeshConfig(data=1, fsdp=1, tensor=1).axis_sizes(1) == (1, 1, 1)
    for mesh, named in [
        (
            MeshConfig(fsdp=3),
            (
                "learner.mesh_fsdp=3 x learner.mesh_tensor=1 = 3 devices does "
                "not divide the 8 devices"
            ),
        ),
        (MeshConfig(data=2, fsdp=2, tensor=1), "= 4 devices, but this run has 8"),
        (MeshConfig(data=-1, fsdp=-1), "mesh_data and learner.mesh_fsdp are both -1"),
        (MeshConfig(tensor=0), "mesh_tensor=0 must be a positive number"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named)):
            mesh.axis_sizes(8)
    mesh = MeshConfig().build()  # this process: one CPU device
    assert mesh.axis_names == MESH_AXES and dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_config_keys_reach_the_hyperparameters_and_are_checked():
    from raytunix.config import ConfigError, load_config
    from raytunix.learner.train_state import SFTHyperparams

    cfg = load_config(
        None, ["learner.mesh_data=2", "learner.mesh_fsdp=-1", "learner.mesh_tensor=2"]
    )
    assert RLHyperparams.from_config(cfg).mesh == MeshConfig(data=2, fsdp=-1, tensor=2)
    assert SFTHyperparams.from_config(cfg).mesh == MeshConfig(data=2, fsdp=-1, tensor=2)
    assert RLHyperparams.from_config(load_config(None)).mesh == MeshConfig()
    for overrides, named in [
        (["learner.mesh_fsdp=0"], "learner.mesh_fsdp=0 must be a number of devices"),
        (["learner.mesh_tensor=-1"], "at most one may be -1"),
        (
            ["learner.mesh_fsdp=4", "learner.micro_batch_size=6"],
            "learner.micro_batch_size=6 cannot be split over learner.mesh_data x mesh_fsdp = 4",
        ),
    ]:
        with pytest.raises(ConfigError, match=re.escape(named)):
            load_config(None, overrides)


@pytest.mark.parametrize("config", [CONFIG, UNTIED], ids=["qwen3_tied", "untied_biases"])
def test_every_param_of_the_model_has_a_rule_and_moments_follow_their_param(config):
    graphdef, params = init_model(config, seed=0)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = path_name(path)
        assert any(re.search(pattern, name) for pattern, _ in PARAM_RULES), name
    mesh = AbstractMesh((2, 2, 2), MESH_AXES)
    state = create_train_state(graphdef, params, make_optimizer_from(_hp()), seed=0)
    specs = {
        path_name(p): s.spec
        for p, s in jax.tree_util.tree_leaves_with_path(tree_shardings(state, mesh))
    }
    megatron = {
        "embed_tokens/embedding": P("tensor", "fsdp"),
        "layers/0/self_attn/q_proj/kernel": P("fsdp", "tensor"),  # column-parallel
        "layers/0/self_attn/v_proj/bias": P("tensor"),
        "layers/0/self_attn/o_proj/kernel": P("tensor", "fsdp"),  # row-parallel
        "layers/0/mlp/up_proj/kernel": P("fsdp", "tensor"),
        "layers/0/mlp/down_proj/kernel": P("tensor", "fsdp"),
        "layers/0/input_layernorm/scale": P(),
        "norm/scale": P(),
    }
    if config.tie_embeddings:
        megatron["layers/0/self_attn/k_norm/scale"] = P()
    else:
        megatron.update(
            {"lm_head/kernel": P("fsdp", "tensor"), "layers/0/self_attn/o_proj/bias": P()}
        )
    for name, spec in megatron.items():
        assert specs["params/" + name] == spec, name
        assert specs["opt_state/1/0/mu/" + name] == spec  # Adam's moments: as the param
        assert specs["opt_state/1/0/nu/" + name] == spec
    assert specs["step"] == P() and specs["rng"] == P()


def test_a_dimension_the_mesh_does_not_divide_names_param_shape_axis_and_key():
    _, params = init_model(dataclasses.replace(CONFIG, vocab_size=18, head_dim=None), seed=0)
    with pytest.raises(ValueError) as error:
        tree_shardings(params, AbstractMesh((1, 2, 4), MESH_AXES))
    message = str(error.value)
    for part in (
        "embed_tokens/embedding",
        "(18, 32)",
        "dimension 0 (18)",
        "'tensor' of size 4",
        "learner.mesh_tensor",
        "[1, 2, 3, 6, 9, 18]",
    ):
        assert part in message, message


def test_an_unknown_param_is_replicated_and_logged(caplog):
    mesh = AbstractMesh((2, 2, 2), MESH_AXES)
    with caplog.at_level(logging.DEBUG, logger="raytunix.learner.sharding"):
        assert partition_spec("value_head/kernel", (32, 1), mesh) == P()
    assert "No partition rule matches value_head/kernel (32, 1)" in caplog.text
    with pytest.raises(ValueError, match="more dimensions than its shape"):
        partition_spec("layers/0/mlp/up_proj/kernel", (64,), mesh)


def test_a_micro_batch_the_batch_shards_do_not_divide_is_refused():
    graphdef, _ = init_model(CONFIG, seed=0)
    hp = _hp(micro_batch_size=6)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "micro_batch_size=6 cannot be split over the mesh's data x fsdp = 4 devices"
        ),
    ):
        make_policy_update(
            graphdef,
            make_optimizer_from(hp),
            hp,
            max_seq_len=64,
            mesh=AbstractMesh((2, 2, 2), MESH_AXES),
        )


# ------------------------------------------------------------------ 8 fake devices


@pytest.mark.slow
def test_sharded_update_on_8_fake_devices_equals_the_unsharded_one(tmp_path):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip(),
    )
    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    assert set(report["checked"]) == {
        "one device: bit for bit",
        "grpo (2, 2, 2)",
        "grpo (1, 4, 2) micro_batch 4",
        "sft (2, 2, 2)",
        "restore (2, 2, 2)",
        "restore onto (1, 4, 2)",
    }


def _close(a, b, what, atol):
    worst = 0.0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol, err_msg=f"{what}: {path_name(path)}")
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)))
    print(f"{what}: max |difference| {worst:.3g}", file=sys.stderr)


def _assert_split(learner, shape):
    """The learner's state lives on the mesh of ``shape``, its matrices really split."""
    from jax.sharding import NamedSharding

    assert tuple(learner.mesh.shape.values()) == shape
    kernel = learner.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    assert isinstance(kernel.sharding, NamedSharding)
    assert kernel.sharding.spec == P("fsdp", "tensor") and not kernel.sharding.is_fully_replicated
    _, fsdp, tensor = shape
    assert kernel.addressable_shards[0].data.shape == (32 // fsdp, 32 // tensor)
    mu = learner._state.opt_state[1][0].mu["layers"][0]["mlp"]["down_proj"]["kernel"][...]
    assert mu.sharding.spec == P("tensor", "fsdp")
    assert mu.addressable_shards[0].data.shape == (64 // tensor, 32 // fsdp)


def _subprocess_main(directory):
    """Runs in a process with 8 CPU devices: the Learner on two meshes against the
    unsharded update on one device; prints a JSON report."""
    from raytunix.learner.checkpoint import Checkpointer
    from raytunix.learner.learner import Learner
    from raytunix.learner.sharding import shard_train_state
    from raytunix.learner.train_state import SFTHyperparams, make_sft_update

    assert jax.device_count() == 8, jax.devices()
    record_batch = _record_batch()
    batch = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=CONFIG.max_seq_len)
    checked = []

    def unsharded(hp, steps, mesh=None):
        graphdef, params = init_model(CONFIG, seed=0)
        optimizer = make_optimizer_from(hp)
        state = create_train_state(graphdef, params, optimizer, seed=0)
        if mesh is not None:
            state = shard_train_state(state, mesh)
        update = make_policy_update(
            graphdef, optimizer, hp, max_seq_len=CONFIG.max_seq_len, mesh=mesh
        )
        metrics = None
        for _ in range(steps):
            state, metrics = update(state, None, batch)
        return state, metrics

    reference, reference_metrics = unsharded(_hp(), 2)
    # A mesh of one device (what the default config gives a one-device host) is today's
    # unsharded update exactly.
    one, _ = unsharded(_hp(), 2, mesh=MeshConfig(1, 1, 1).build(jax.devices()[:1]))
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    checked.append("one device: bit for bit")
    trained = {}
    for shape, settings in [((2, 2, 2), {}), ((1, 4, 2), {"micro_batch_size": 4})]:
        hp = _hp(mesh=MeshConfig(*shape), **settings)
        learner = Learner(CONFIG, seed=0)
        learner.start_rl(hp)
        _assert_split(learner, shape)
        for _ in range(2):
            metrics = learner.train_step(record_batch)
        _assert_split(learner, shape)  # still split after the updates
        _close(learner.weights_numpy(), reference.params, f"params on {shape}", PARAMS_ATOL)
        _close(learner._state.opt_state, reference.opt_state, f"optimizer state on {shape}", 1e-8)
        for key in ("loss", "reward_mean", "advantage_abs_mean", "num_tokens", "grad_norm"):
            np.testing.assert_allclose(
                metrics[key], float(reference_metrics[key]), rtol=1e-5, atol=1e-6, err_msg=key
            )
        checked.append(f"grpo {shape}" + (" micro_batch 4" if settings else ""))
        trained[shape] = learner

    # Warm start: 6 rows per step padded to 8 with empty rows; the same rows unsharded.
    tokens = np.asarray(batch.tokens)
    mask = np.asarray(batch.loss_mask)
    sft = SFTHyperparams(learning_rate=1e-2, warmup_steps=0, mesh=MeshConfig(2, 2, 2))
    learner = Learner(CONFIG, seed=0)
    learner.start_warmup(sft)
    learner.sft_steps(tokens, mask, num_steps=2, batch_size=6)
    _assert_split(learner, (2, 2, 2))
    graphdef, params = init_model(CONFIG, seed=0)
    state = create_train_state(graphdef, params, sft.optimizer(), seed=0)
    update = make_sft_update(graphdef, sft.optimizer())
    rng = np.random.default_rng(0)
    for _ in range(2):
        rows = rng.integers(0, len(tokens), size=6)
        state, _ = update(state, tokens[rows], mask[rows])
    _close(learner.weights_numpy(), state.params, "warm start on (2, 2, 2)", 1e-2 * 1e-2)
    checked.append("sft (2, 2, 2)")

    # Checkpoints: a split state saved, restored on the same mesh and on another one.
    learner = trained[(2, 2, 2)]
    checkpointer = Checkpointer(os.path.join(directory, "ckpt"))
    learner.save(checkpointer, {"data_position": 1})
    checkpointer.wait_until_finished()
    for shape in ((2, 2, 2), (1, 4, 2)):
        restored = Learner(CONFIG, seed=0)
        restored.start_rl(_hp(mesh=MeshConfig(*shape)))
        extras = restored.restore(checkpointer)
        assert extras["data_position"] == 1 and restored.version == 2
        _assert_split(restored, shape)
        for a, b in zip(
            jax.tree.leaves(restored.weights_numpy()), jax.tree.leaves(learner.weights_numpy())
        ):
            np.testing.assert_array_equal(a, b)
        _close(restored._state.opt_state, learner._state.opt_state, f"restored on {shape}", 0)
        checked.append("restore (2, 2, 2)" if shape == (2, 2, 2) else f"restore onto {shape}")
    checkpointer.close()
    print(json.dumps({"devices": jax.device_count(), "checked": checked}))


if __name__ == "__main__":
    _subprocess_main(sys.argv[1])
