"""LoRA adapters out as a Hugging Face ``peft`` folder: ``transformers`` + ``peft`` over the
exported base compute what raytunix computes with the adapters merged, and a run that has
no adapters says so and what to do instead."""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from raytunix.learner.lora import LoraSpec, init_adapters, merge_adapters  # noqa: E402
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
