"""Hugging Face checkpoints in and out: the Flax model computes what ``transformers``
computes, export then import gives the same bits, and a folder's tokenizer and chat
template give the ids ``transformers`` gives.

Every checkpoint is written here, tiny and random, with ``transformers`` (PyTorch on CPU,
float32): a Llama with tied embeddings and Llama 3.1 RoPE scaling, a Llama with linear
RoPE scaling and attention biases, a Qwen2 (q/k/v biases), a Qwen3 (q/k norm, a head width
that is not hidden_size / heads) saved in shards. Weights are redrawn so that biases and
norm scales are not their initial zeros and ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer as RawTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from raytunix.inference.engine import InferenceEngine  # noqa: E402
from raytunix.models.chat_template import BUILTIN_TEMPLATES  # noqa: E402
from raytunix.models.hf import (  # noqa: E402
    CheckpointError,
    export_checkpoint,
    load_checkpoint,
)
from raytunix.models.llama import ModelConfig, forward, init_model  # noqa: E402
from raytunix.types import GenerationRequest, SamplingParams  # noqa: E402

VOCAB = 320  # the tokenizer's ids; the models' embeddings are padded past it

CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|end_of_text|>",
)

SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

FAMILIES = {
    # GQA, tied embeddings, Llama 3.1 RoPE: with head_dim 8 and theta 10^4 the four
    # wavelengths (6, 63, 628, 6283 positions) fall on all three sides of the rule's
    # bounds (16 and 64 positions).
    "llama3-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            SMALL,
            vocab_size=336,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama-linear-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            SMALL,
            vocab_size=320,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(SMALL, vocab_size=352, tie_word_embeddings=False, rope_theta=1000000.0),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(SMALL, vocab_size=336, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-6),
    ),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "required": ["expression"],
                "properties": {"expression": {"type": "string"}},
            },
        },
    }
]
CALL = {
    "type": "function",
    "function": {"name": "calculator", "arguments": {"expression": "95 - 21 * 3"}},
}
CONVERSATION = [
    {"role": "system", "content": "Use the calculator, then answer in <answer> tags."},
    {"role": "user", "content": "What is 95 - 21 * 3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "32"},
    {"role": "assistant", "content": "<answer>32</answer>"},
    {"role": "user", "content": "And 7 * 6? <|im_end|> is just text here."},
]


def _tokenizer_folder(folder, family: str) -> None:
    """A byte-level BPE tokenizer with merges learned here, the family's special tokens
    and chat template, saved as ``transformers`` saves a fast tokenizer."""
    llama = family.startswith("llama")
    special = LLAMA3_TOKENS if llama else CHATML_TOKENS
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = [
        json.dumps(TOOLS),
        *(m["content"] for m in CONVERSATION),
        "system user assistant tool calculator answer expression function",
    ] * 4
    raw.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=list(special),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    template = BUILTIN_TEMPLATES["llama3" if llama else "chatml"].source
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        chat_template=template,
        eos_token="<|eot_id|>" if llama else "<|im_end|>",
        bos_token="<|begin_of_text|>" if llama else None,
        pad_token=None if llama else "<|endoftext|>",
    )
    fast.save_pretrained(str(folder))


def _write_checkpoint(folder, family: str, seed: int = 0, **save_kwargs):
    """Saves a random ``family`` model and its tokenizer into ``folder``; returns the
    PyTorch model."""
    config_class, model_class, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**kwargs)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    _tokenizer_folder(folder, family)
    eos = (
        ["<|eot_id|>", "<|end_of_text|>"]
        if family.startswith("llama")
        else ["<|im_end|>", "<|endoftext|>"]
    )
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in eos]
    model.save_pretrained(str(folder), safe_serialization=True, **save_kwargs)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (folder, PyTorch model); the Qwen3 one in several shards."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        shards = {"max_shard_size": "40KB"} if family == "qwen3" else {}
        out[family] = (str(folder), _write_checkpoint(folder, family, **shards))
    return out


def _torch_logits(model, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


def _tokens(vocab: int, rows: int = 2, length: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(rows, length), dtype=np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(checkpoints, family):
    folder, model = checkpoints[family]
    sharded = os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert sharded == (family == "qwen3")  # both layouts are read
    ckpt = load_checkpoint(folder, max_seq_len=128)
    config = ckpt.config
    assert config.vocab_size == model.config.vocab_size
    assert config.tie_embeddings == (family in ("llama3-tied", "qwen3"))
    assert config.qk_norm == (family == "qwen3")
    assert config.head_dim == (16 if family == "qwen3" else 8)
    tokens = _tokens(config.vocab_size, length=16)
    # The second row starts at position 40: RoPE scaling shows at long wavelengths.
    positions = np.arange(16, dtype=np.int32)[None] + np.array([[0], [40]], np.int32)
    ours, _ = forward(ckpt.graphdef, ckpt.params, jnp.asarray(tokens), jnp.asarray(positions))
    theirs = _torch_logits(model, tokens, positions)
    assert np.abs(theirs).max() > 1.0  # logits large enough that a wrong weight shows
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=2e-5)


def test_a_wrong_feature_changes_the_logits(checkpoints):
    """The comparison above can fail: the same Qwen2 weights without the q/k/v biases,
    or a Llama 3.1 model without its RoPE scaling, give other logits."""
    import dataclasses

    for family, change in (("qwen2", {"qkv_bias": False}), ("llama3-tied", {"rope_scaling": None})):
        folder, model = checkpoints[family]
        ckpt = load_checkpoint(folder, max_seq_len=128)
        config = dataclasses.replace(ckpt.config, **change)
        graphdef, _ = init_model(config, 0)
        params = nnx.from_flat_state(
            [(path, var) for path, var in nnx.to_flat_state(ckpt.params) if path[-1] != "bias"]
        )
        tokens = _tokens(config.vocab_size, length=16)
        positions = np.arange(16, dtype=np.int32)[None] + np.array([[0], [40]], np.int32)
        ours, _ = forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions))
        assert np.abs(np.asarray(ours) - _torch_logits(model, tokens, positions)).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3-tied", "qwen2", "qwen3"])
def test_paged_engine_greedy_equals_plain_forward(checkpoints, family):
    """Prefill and decode through the paged KV cache, continuous batching, pick the
    tokens a full forward over the growing sequence picks."""
    folder, _ = checkpoints[family]
    ckpt = load_checkpoint(folder, max_seq_len=32)
    prompts = [list(range(5, 17)), [30, 31, 32, 7, 9]]
    new_tokens = 10
    # A full causal forward over a fixed-width row: what follows a token does not change
    # its logits, so one compiled shape serves every length.
    full = jax.jit(
        lambda tokens: forward(
            ckpt.graphdef, ckpt.params, tokens, jnp.arange(32, dtype=jnp.int32)[None]
        )[0]
    )

    expected = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new_tokens):
            logits = full(jnp.asarray([seq + [0] * (32 - len(seq))], jnp.int32))
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        expected.append(seq[len(prompt) :])

    async def generate():
        engine = InferenceEngine(
            ckpt.graphdef,
            ckpt.params,
            ckpt.config,
            ckpt.tokenizer,
            max_batch_size=2,
            block_size=4,
            prefill_chunk_tokens=8,
        )
        requests = [
            GenerationRequest(
                request_id=f"r{i}",
                prompt_ids=tuple(p),
                seed=0,
                sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.0),
            )
            for i, p in enumerate(prompts)
        ]
        results = await engine.generate_many(requests)
        await engine.close()
        return results

    results = asyncio.run(generate())
    assert [list(r.token_ids) for r in results] == expected


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_export_then_import_is_bit_exact_and_transformers_reads_it(checkpoints, tmp_path, family):
    folder, model = checkpoints[family]
    ckpt = load_checkpoint(folder, max_seq_len=128)
    written = export_checkpoint(
        str(tmp_path), ckpt.config, ckpt.params, source=folder, max_shard_bytes=50_000
    )
    assert "model.safetensors.index.json" in written and "tokenizer.json" in written
    again = load_checkpoint(str(tmp_path), max_seq_len=128)
    assert again.config == ckpt.config
    before = nnx_flat(ckpt.params)
    after = nnx_flat(again.params)
    assert before.keys() == after.keys()
    for path in before:
        assert before[path].dtype == after[path].dtype
        assert np.array_equal(before[path], after[path]), path

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = _tokens(ckpt.config.vocab_size, length=10, seed=3)
    positions = np.broadcast_to(np.arange(10, dtype=np.int32), tokens.shape)
    np.testing.assert_array_equal(
        _torch_logits(reloaded, tokens, positions), _torch_logits(model, tokens, positions)
    )
    ids = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False
    )
    assert ids == ckpt.chat_template.render(CONVERSATION, tools=TOOLS)


def nnx_flat(params) -> dict:
    return {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(params)}


def test_bfloat16_export_round_trips(checkpoints, tmp_path):
    folder, _ = checkpoints["llama3-tied"]
    ckpt = load_checkpoint(folder, max_seq_len=64, dtype=jnp.bfloat16)
    export_checkpoint(str(tmp_path), ckpt.config, ckpt.params, source=folder)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    again = load_checkpoint(str(tmp_path), max_seq_len=64, dtype=jnp.bfloat16)
    for path, value in nnx_flat(ckpt.params).items():
        assert value.dtype == jnp.bfloat16
        assert np.array_equal(value, nnx_flat(again.params)[path])


def test_raytunix_model_exports_as_a_llama_transformers_runs(tmp_path):
    """A model raytunix made itself (no source folder) becomes a Llama checkpoint."""
    config = ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
    )
    graphdef, params = init_model(config, seed=3)
    export_checkpoint(str(tmp_path), config, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    tokens = _tokens(61, length=9)
    positions = np.broadcast_to(np.arange(9, dtype=np.int32), tokens.shape)
    ours, _ = forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions))
    np.testing.assert_allclose(
        np.asarray(ours), _torch_logits(model, tokens, positions), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("family", ["llama3-tied", "qwen3"])
def test_folder_tokenizer_and_template_give_transformers_ids(checkpoints, family):
    """A multi-turn tool conversation: raytunix renders the folder's template and encodes
    the text with the folder's tokenizer; the ids are transformers' apply_chat_template's."""
    folder, _ = checkpoints[family]
    ckpt = load_checkpoint(folder, max_seq_len=64)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for add_generation_prompt in (False, True):
        text = ckpt.chat_template.render(
            CONVERSATION, tools=TOOLS, add_generation_prompt=add_generation_prompt
        )
        theirs = hf.apply_chat_template(
            CONVERSATION,
            tools=TOOLS,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
        )
        assert ckpt.tokenizer.encode(text) == list(theirs)
        assert ckpt.tokenizer.decode(theirs) == text
    assert len(set(ckpt.tokenizer.encode(text))) > 20  # the BPE merges are in use
    eos = (
        ["<|eot_id|>", "<|end_of_text|>"]
        if family.startswith("llama")
        else ["<|im_end|>", "<|endoftext|>"]
    )
    assert ckpt.tokenizer.end_id == hf.convert_tokens_to_ids(eos[0])
    assert ckpt.tokenizer.stop_ids == tuple(hf.convert_tokens_to_ids(t) for t in eos)
    pad = eos[0] if family.startswith("llama") else "<|endoftext|>"  # no pad token: eos pads
    assert ckpt.tokenizer.pad_id == hf.convert_tokens_to_ids(pad)
    # Environment text is encoded as plain text: a special-token string in it stays bytes.
    plain = ckpt.tokenizer.encode("<|im_end|><|eot_id|>", special_tokens=False)
    assert not set(plain) & set(ckpt.tokenizer.stop_ids)
    # Ray ships the tokenizer to actors by pickling it.
    shipped = pickle.loads(pickle.dumps(ckpt.tokenizer))
    assert (shipped.pad_id, shipped.end_id, shipped.stop_ids) == (
        ckpt.tokenizer.pad_id,
        ckpt.tokenizer.end_id,
        ckpt.tokenizer.stop_ids,
    )
    assert shipped.encode("<|im_end|>", special_tokens=False) == ckpt.tokenizer.encode(
        "<|im_end|>", special_tokens=False
    )


# -- errors name the file, the key and what to do -------------------------------------


def _copy(folder, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def test_unsupported_architecture_is_named(checkpoints, tmp_path):
    target = _copy(checkpoints["qwen2"][0], tmp_path)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(config, model_type="gpt2")))
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'gpt2' is not supported"):
        load_checkpoint(str(target))
    (target / "config.json").write_text(
        json.dumps(
            dict(config, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
        )
    )
    with pytest.raises(CheckpointError, match="rope type 'yarn' is not supported"):
        load_checkpoint(str(target))


def test_missing_tensor_and_shape_mismatch_are_named(checkpoints, tmp_path):
    target = _copy(checkpoints["qwen2"][0], tmp_path)
    weights = load_file(str(target / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.bias"
    save_file(
        {k: v for k, v in weights.items() if k != name},
        str(target / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        load_checkpoint(str(target))

    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(config, intermediate_size=40)))
    with pytest.raises(
        CheckpointError,
        match=r"mlp.down_proj.weight' in model.safetensors has "
        r"shape \(32, 48\); .* needs \(32, 40\)",
    ):
        load_checkpoint(str(target))


def test_folder_without_safetensors_says_to_convert(checkpoints, tmp_path):
    target = _copy(checkpoints["qwen2"][0], tmp_path)
    os.rename(target / "model.safetensors", target / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin: convert it to safetensors"):
        load_checkpoint(str(target))


# -- raytunix train model.path=DIR ------------------------------------------------------


@pytest.mark.slow
def test_train_with_model_path_trains_the_checkpoint_and_exports_it(ray_session, tmp_path):
    """A Qwen3-style folder is all the config names: the run takes the folder's shape,
    weights, tokenizer and chat template, trains, and leaves RUN_DIR/export/ that
    transformers and raytunix load to the same logits."""
    from raytunix.config import load_config
    from raytunix.train import train

    folder = tmp_path / "qwen3"
    _write_checkpoint(folder, "qwen3", seed=5)
    cfg = load_config(
        None,
        [
            f"model.path={folder}",
            "model.max_seq_len=128",
            f"run.output_dir={tmp_path / 'runs'}",
            "env.name=math_verifier",
            "env.max_turns=1",
            "warmup.enabled=false",
            "data.train_size=64",
            "data.heldout_size=4",
            "eval.heldout_size=4",
            "eval.max_new_tokens=8",
            "rollout.group_size=2",
            "rollout.groups_per_batch=2",
            "rollout.max_concurrent_episodes=4",
            "rollout.max_new_tokens=8",
            "rollout.adaptive_concurrency=false",
            "engine.max_batch_size=4",
            "env.num_env_actors=1",
            "learner.rl_steps=2",
            "learner.checkpoint_every=2",
            # A random policy seldom earns a reward; weight decay moves the weights anyway, so
            # the export shows whether it holds the trained policy or the folder's.
            "learner.weight_decay=0.5",
        ],
    )
    summary = train(cfg)

    run_dir = summary["run_dir"]
    assert not os.path.exists(os.path.join(run_dir, "tokenizer.json"))  # none was trained
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["policy_version"] for r in records if r["phase"] == "rl"] == [1, 2]
    export = summary["export_dir"]
    assert export == os.path.join(run_dir, "export")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(export, name)), name
    exported = load_checkpoint(export, max_seq_len=64)
    original = load_checkpoint(str(folder), max_seq_len=64)
    assert exported.config == original.config and exported.config.qk_norm
    assert exported.chat_template.source == original.chat_template.source
    trained, initial = nnx_flat(exported.params), nnx_flat(original.params)
    q_proj = ("layers", 0, "self_attn", "q_proj", "kernel")
    assert trained[q_proj].dtype == np.float32
    assert not np.array_equal(trained[q_proj], initial[q_proj])
    np.testing.assert_allclose(trained[q_proj], initial[q_proj], rtol=1e-2, atol=1e-3)
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    tokens = _tokens(exported.config.vocab_size, length=8, seed=1)
    positions = np.broadcast_to(np.arange(8, dtype=np.int32), tokens.shape)
    ours, _ = forward(
        exported.graphdef, exported.params, jnp.asarray(tokens), jnp.asarray(positions)
    )
    np.testing.assert_allclose(
        np.asarray(ours), _torch_logits(model, tokens, positions), rtol=1e-5, atol=2e-5
    )
