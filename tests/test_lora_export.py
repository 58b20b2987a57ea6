"""LoRA adapters out as a Hugging Face ``peft`` folder: ``transformers`` + ``peft`` over the
exported base compute what raytunix computes with the adapters merged, and a run that has
no adapters says so and what to do instead."""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from raytunix.cli import main  # noqa: E402
from raytunix.config import load_config  # noqa: E402
from raytunix.driver.run_dir import RunDir  # noqa: E402
from raytunix.learner.checkpoint import Checkpointer  # noqa: E402
from raytunix.learner.lora import LoraSpec, init_adapters, merge_adapters  # noqa: E402
from raytunix.learner.train_state import create_train_state  # noqa: E402
from raytunix.models.hf import CheckpointError, export_adapters, export_checkpoint  # noqa: E402
from raytunix.models.llama import ModelConfig, forward, init_model  # noqa: E402

CONFIG = ModelConfig(
    vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
)
# Every dense layer, the LM head included, so that each HF name is checked.
SPEC = LoraSpec(
    rank=4,
    alpha=8.0,
    target_modules="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head",
)


def _nonzero_b(adapters):
    """Adapters with B drawn at random: a zero B would make any export pass."""
    keys = jax.random.split(jax.random.key(7), len(adapters))
    return {
        k: {**v, "lora_B": 0.2 * jax.random.normal(r, v["lora_B"].shape)}
        for r, (k, v) in zip(keys, adapters.items())
    }


@pytest.mark.slow  # transformers and peft load a model: about 25 s on 2 cores
def test_peft_over_the_exported_base_computes_the_merged_logits(tmp_path):
    graphdef, params = init_model(CONFIG, seed=3)
    adapters = _nonzero_b(init_adapters(params, SPEC, seed=0))
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    export_checkpoint(base_dir, CONFIG, params)
    written = export_adapters(adapter_dir, adapters, alpha=SPEC.alpha, base_model=base_dir)
    assert sorted(written) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["base_model_name_or_path"] == base_dir

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    tokens = np.random.default_rng(0).integers(0, 61, size=(2, 9), dtype=np.int32)
    positions = np.broadcast_to(np.arange(9, dtype=np.int32), tokens.shape)
    with torch.no_grad():
        theirs = model(
            input_ids=torch.tensor(tokens), position_ids=torch.tensor(positions)
        ).logits.numpy()
    merged = merge_adapters(params, adapters, SPEC.scale)
    ours, _ = forward(graphdef, merged, jnp.asarray(tokens), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=2e-5)
    # The adapters matter: the base alone is far from it.
    plain, _ = forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions))
    assert np.max(np.abs(np.asarray(plain) - theirs)) > 1e-2


def test_adapters_of_another_shape_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="without LoRA"):
        export_adapters(str(tmp_path), {}, alpha=8.0, base_model="base")
    bad = {"layers.0.self_attn.q_proj": {"lora_A": np.zeros((4, 32)), "lora_B": np.zeros((32, 2))}}
    with pytest.raises(CheckpointError, match=r"\[rank, d_in\]"):
        export_adapters(str(tmp_path), bad, alpha=8.0, base_model="base")


def _lora_run(tmp_path, *overrides, rank=4, checkpoint=True):
    """A run directory as a LoRA run over ``model.path`` leaves it: config.yaml and an RL
    checkpoint of its adapters (B nonzero); returns ``(run_dir, base_dir, adapters)``."""
    graphdef, params = init_model(CONFIG, seed=3)
    base_dir = str(tmp_path / "base")
    export_checkpoint(base_dir, CONFIG, params)
    spec = LoraSpec(rank, 8.0, "q_proj,v_proj,down_proj")
    cfg = load_config(
        "default",
        overrides=[
            f"model.path={base_dir}",
            f"model.max_seq_len={CONFIG.max_seq_len}",
            f"learner.lora_rank={rank}",
            "learner.lora_alpha=8.0",
            f"learner.lora_target_modules={spec.target_modules}",
            *overrides,
        ],
    )
    run = RunDir(str(tmp_path / "run"))
    run.write_config(cfg)
    state = create_train_state(graphdef, params, optax.adam(1e-3), 0, spec if rank else None)
    state = state.replace(params=_nonzero_b(state.params)) if rank else state
    if checkpoint:
        ck = Checkpointer(run.checkpoints)
        ck.save(5, state.replace(base=None), {"rl_step": 5})
        ck.wait_until_finished()
        ck.close()
    return run.path, base_dir, state.params


@pytest.mark.slow  # an orbax save and restore: about 17 s on 2 cores
def test_export_adapter_writes_the_checkpoints_adapters_for_peft(tmp_path, capsys):
    run_dir, base_dir, adapters = _lora_run(tmp_path)
    assert main(["export-adapter", run_dir]) == 0
    assert "RL step 5" in capsys.readouterr().out
    out = os.path.join(run_dir, "adapter")
    with open(os.path.join(out, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["base_model_name_or_path"] == base_dir
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    np.testing.assert_array_equal(tensors[name], adapters["layers.1.mlp.down_proj"]["lora_B"])
    assert tensors[name].shape == (32, 4)


@pytest.mark.parametrize(
    "what, match",
    [
        ("full_fine_tuning", "lora_rank=0.*so it has no LoRA adapters.*learner.lora_rank > 0"),
        ("no_checkpoint", "no RL checkpoint yet.*train it first"),
        ("not_a_run", "no config.yaml"),
    ],
)
def test_a_run_without_adapters_says_what_to_do(tmp_path, capsys, what, match):
    if what == "not_a_run":
        os.makedirs(tmp_path / "run")
        run_dir = str(tmp_path / "run")
    else:
        rank = 0 if what == "full_fine_tuning" else 4
        run_dir = _lora_run(tmp_path, rank=rank, checkpoint=what != "no_checkpoint")[0]
    assert main(["export-adapter", run_dir]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not os.path.exists(os.path.join(run_dir, "adapter"))


@pytest.mark.slow  # two learners start their RL phase: about 13 s on 2 cores
def test_the_learner_hands_out_its_adapters_only_with_lora():
    from raytunix.learner.learner import Learner
    from raytunix.learner.train_state import RLHyperparams

    hp = dict(temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-2)
    learner = Learner(CONFIG, seed=0, model=init_model(CONFIG, seed=3))
    learner.start_rl(RLHyperparams(**hp, lora_rank=4, lora_target_modules="q_proj"))
    adapters = learner.adapters_numpy()
    assert set(adapters) == {"layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj"}
    assert isinstance(adapters["layers.0.self_attn.q_proj"]["lora_A"], np.ndarray)
    full = Learner(CONFIG, seed=0, model=init_model(CONFIG, seed=3))
    full.start_rl(RLHyperparams(**hp))
    with pytest.raises(RuntimeError, match="lora_rank=0 trains the whole model"):
        full.adapters_numpy()
