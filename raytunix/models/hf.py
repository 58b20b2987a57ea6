"""Hugging Face checkpoints in and out: Llama, Qwen2 and Qwen3 folders.

A model folder as ``save_pretrained`` writes it::

    config.json                     architecture (model_type llama / qwen2 / qwen3)
    model.safetensors               weights; or model-0000i-of-0000n.safetensors shards
                                    and model.safetensors.index.json (tensor -> shard)
    tokenizer.json                  vocabulary and special tokens
    tokenizer_config.json           eos/pad/bos tokens, the chat template
    generation_config.json          (optional) end-of-sequence ids

is read into the Flax model of ``raytunix.models.llama`` and written back::

    checkpoint = load_checkpoint("/models/Qwen3-0.6B", max_seq_len=4096)
    logits, _ = forward(checkpoint.graphdef, checkpoint.params, tokens, positions)
    export_checkpoint("/runs/x/export", checkpoint.config, trained_params,
                      source="/models/Qwen3-0.6B")

Weights are renamed (``model.layers.3.self_attn.q_proj.weight`` is
``layers.3.self_attn.q_proj.kernel``) and linear weights transposed (PyTorch stores
``[out, in]``, Flax ``[in, out]``); nothing else changes, so export then import gives the
same bits. Files are read with ``safetensors`` and ``tokenizers``; the chat template with
``raytunix.models.chat_template``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from raytunix.models.chat_template import ChatTemplate, ChatTemplateError, chat_template_from_folder
from raytunix.models.llama import ModelConfig, RopeScaling, Transformer
from raytunix.models.tokenizer import Tokenizer

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""Supported ``model_type`` values of ``config.json`` and their model classes."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
"""Files an export copies from the source folder, when there."""

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The two files of a PEFT LoRA adapter folder (``export_adapters``)."""
# Tensors a checkpoint may hold that the model computes instead of storing.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A model folder cannot be read or written; the message names the file, the key and
    what to do."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A model folder, loaded.

    Attributes:
      path: the folder.
      config: the model's shape.
      graphdef, params: the model, as ``raytunix.models.llama.init_model`` returns it
        (``params`` an ``nnx.State`` of jax arrays).
      tokenizer: the folder's tokenizer (``Tokenizer.from_folder``).
      chat_template: the folder's chat template, or None when it has none (a base model).
      hf_config: ``config.json`` as read.
    """

    path: str
    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    hf_config: dict[str, Any]


# -- config.json <-> ModelConfig ------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} does not exist; a Hugging Face model folder needs it "
            "(save the model with save_pretrained)."
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path} as JSON ({e}); fix or replace it.") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def _rope_settings(hf: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta``
    and ``rope_scaling`` (transformers 4)."""
    params = dict(hf.get("rope_parameters") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise CheckpointError(
            f"{where}: rope_parameters differ per layer type "
            f"({sorted(params)}); only one RoPE for all layers is supported."
        )
    params = {**(hf.get("rope_scaling") or {}), **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(
            f"{where}: partial_rotary_factor is not supported (RoPE must rotate the whole head)."
        )
    if kind in (None, "default"):
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise CheckpointError(
            f"{where}: rope type {kind!r} is not supported; raytunix reads "
            "'default', 'linear' and 'llama3' RoPE."
        )
    try:
        if kind == "linear":
            return float(theta), RopeScaling("linear", float(params["factor"]))
        original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        return float(theta), RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(original),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: rope type {kind!r} needs the key {e.args[0]!r}.") from None
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


def model_config_from_hf(
    hf: Mapping[str, Any], max_seq_len: int | None = None, where: str = "config.json"
) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` (a dict).

    Args:
      hf: the parsed ``config.json``.
      max_seq_len: the longest context (tokens) raytunix will run the model at; None:
        the checkpoint's ``max_position_embeddings`` (the engine's KV cache is sized by
        it, so pass the context you need).
      where: the file, for error messages.

    Raises:
      CheckpointError: an unsupported architecture or setting (sliding-window attention,
        MLP biases, an activation other than SiLU, an unknown RoPE type), or a missing
        key, naming it.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; raytunix loads "
            f"{', '.join(sorted(ARCHITECTURES))} checkpoints."
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"{where}: hidden_act {hf['hidden_act']!r} is not supported "
            "(the MLP is SwiGLU with SiLU)."
        )
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported (the MLP has no biases).")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise CheckpointError(
            f"{where}: sliding-window attention is not supported; set "
            "use_sliding_window to false if the model was trained without it."
        )
    try:
        d_model = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        fields = dict(
            vocab_size=int(hf["vocab_size"]),
            d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            d_ff=int(hf["intermediate_size"]),
            max_seq_len=int(max_seq_len or hf.get("max_position_embeddings") or 2048),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            head_dim=int(hf.get("head_dim") or d_model // n_heads),
        )
    except KeyError as e:
        raise CheckpointError(
            f"{where} lacks {e.args[0]!r}; it is not a complete {model_type} config."
        ) from None
    theta, scaling = _rope_settings(hf, where)
    attention_bias = bool(hf.get("attention_bias", False))
    if model_type == "qwen2":  # Qwen2 always has q/k/v biases and none on o_proj
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attention_bias
    try:
        return ModelConfig(
            **fields,
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=model_type == "qwen3",
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


def read_model_config(folder: str, max_seq_len: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a model folder's ``config.json`` (see
    ``model_config_from_hf``).

    Raises:
      CheckpointError: no readable ``config.json``, or an unsupported model.
    """
    path = os.path.join(folder, "config.json")
    return model_config_from_hf(_read_json(path), max_seq_len, path)


def hf_config_from_model(
    config: ModelConfig, base: Mapping[str, Any] | None = None, dtype: str = "float32"
) -> dict[str, Any]:
    """A ``config.json`` dict for ``config``.

    With ``base`` (the source folder's ``config.json``), that dict with only its dtype
    changed; it must describe the same model. Without, a new one: ``qwen3`` if the
    model has q/k norms, ``qwen2`` for q/k/v biases without an output bias, else
    ``llama``.

    Raises:
      CheckpointError: ``base`` describes another model than ``config``.
    """
    if base is not None:
        described = model_config_from_hf(base, config.max_seq_len, "the source config.json")
        # The compute dtype (model.dtype) is the run's choice, not the folder's.
        if dataclasses.replace(described, dtype=config.dtype) != config:
            raise CheckpointError(
                f"the source config.json describes {described}, not the exported model "
                f"{config}; export without a source or from the folder the model came from."
            )
        out = dict(base)
        # transformers 4 names the dtype torch_dtype, 5 names it dtype; keep the base's.
        for key in [k for k in ("torch_dtype", "dtype") if k in base] or ["dtype"]:
            out[key] = dtype
        return out
    if config.qk_norm:
        model_type = "qwen3"
    elif config.qkv_bias and not config.o_bias:
        model_type = "qwen2"
    elif config.qkv_bias != config.o_bias:
        raise CheckpointError(
            f"no Hugging Face architecture has o_bias={config.o_bias} with "
            f"qkv_bias={config.qkv_bias}; it cannot be exported."
        )
    else:
        model_type = "llama"
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_theta": config.rope_theta,
        "dtype": dtype,
    }
    if model_type != "qwen2":
        out["attention_bias"] = config.qkv_bias
    scaling = config.rope_scaling
    if scaling is not None:
        out["rope_scaling"] = {"rope_type": scaling.kind, "factor": scaling.factor}
        if scaling.kind == "llama3":
            out["rope_scaling"].update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_len,
            )
    return out


# -- weights ---------------------------------------------------------------------------

# The last element of a Flax parameter path -> the Hugging Face tensor suffix.
_LEAF_NAMES = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}


def _hf_name(path: tuple) -> str:
    """``("layers", 0, "self_attn", "q_proj", "kernel")`` ->
    ``"model.layers.0.self_attn.q_proj.weight"``; the LM head sits outside ``model.``."""
    *module, leaf = (str(p) for p in path)
    name = ".".join([*module, _LEAF_NAMES[leaf]])
    return name if module[0] == "lm_head" else "model." + name


def _weight_files(folder: str) -> dict[str, str]:
    """Tensor name -> the safetensors file (full path) that holds it."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(
                f"{index_path} has no 'weight_map' of tensor names to "
                "files; rewrite it with save_pretrained."
            )
        files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"{index_path} names the shard {os.path.basename(path)}, "
                    f"which is not in {folder}; copy the missing shard."
                )
        return files
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="np") as f:
            return {name: single for name in f.keys()}
    legacy = [
        n
        for n in ("pytorch_model.bin", "model.pt", "flax_model.msgpack")
        if os.path.isfile(os.path.join(folder, n))
    ]
    raise CheckpointError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}"
        + (
            f" (found {', '.join(legacy)}: convert it to safetensors, e.g. "
            "save_pretrained(folder, safe_serialization=True))"
            if legacy
            else ""
        )
        + "; raytunix reads safetensors weights only."
    )


def abstract_model(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and parameter shapes, without initialising any weight."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def load_weights(
    folder: str, config: ModelConfig, dtype=jnp.float32
) -> tuple[nnx.GraphDef, nnx.State]:
    """Reads a folder's safetensors weights into the Flax model of ``config``.

    Args:
      folder: the model folder (``model.safetensors`` or shards with their index).
      config: the model the weights are for (``model_config_from_hf``).
      dtype: the parameters' dtype (float32 for training; the files' values are cast).

    Returns:
      ``(graphdef, params)`` as ``init_model`` returns them.

    Raises:
      CheckpointError: no safetensors weights, a tensor the model needs is missing, has
        the wrong shape, or the files hold tensors the model has no place for (the
        message names the tensor and the file).
    """
    files = _weight_files(folder)
    graphdef, abstract = abstract_model(config)
    flat = {path: var.get_value() for path, var in nnx.to_flat_state(abstract)}
    values: dict[tuple, jax.Array] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for path, shape_dtype in flat.items():
            name = _hf_name(path)
            if name not in files:
                raise CheckpointError(
                    f"tensor {name!r} is missing from the weights in {folder}; the config "
                    "(n_layers, tie_word_embeddings, attention_bias, model_type) must match "
                    "the checkpoint's tensors."
                )
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="np"))
            array = handles[file].get_tensor(name)
            if path[-1] == "kernel":
                array = array.T
            if array.shape != shape_dtype.shape:
                stored, wanted = array.shape, shape_dtype.shape
                if path[-1] == "kernel":  # report both as the file stores them
                    stored, wanted = stored[::-1], wanted[::-1]
                raise CheckpointError(
                    f"tensor {name!r} in {os.path.basename(file)} has shape {tuple(stored)}; "
                    f"the model config.json describes needs {tuple(wanted)}; config.json and "
                    "the weights disagree."
                )
            values[path] = jnp.asarray(array.astype(np.dtype(dtype), copy=False))
    used = {_hf_name(path) for path in flat}
    if config.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    unused = sorted(n for n in files if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise CheckpointError(
            f"the weights in {folder} hold tensors the model has no place for: "
            f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}; the checkpoint's "
            "architecture differs from what config.json says."
        )
    params = nnx.from_flat_state(
        [(path, var.replace(values[path])) for path, var in nnx.to_flat_state(abstract)]
    )
    return graphdef, params


def load_checkpoint(path: str, max_seq_len: int | None = None, dtype=jnp.float32) -> Checkpoint:
    """Loads a Hugging Face Llama / Qwen2 / Qwen3 model folder (see the module docstring).

    Args:
      path: the folder.
      max_seq_len: the longest context in tokens the model will run at (the engine's KV
        cache is sized by it); None: the checkpoint's ``max_position_embeddings``.
      dtype: the parameters' dtype.

    Raises:
      CheckpointError: ``path`` is not a folder, or a file in it is missing or does not
        fit (see ``model_config_from_hf`` and ``load_weights``); the message names it.
      FileNotFoundError, ValueError: the tokenizer files (``Tokenizer.from_folder``).
    """
    if not os.path.isdir(path):
        raise CheckpointError(
            f"model path {path!r} is not a folder; pass the folder that "
            "holds config.json, the safetensors weights and tokenizer.json."
        )
    hf_config = _read_json(os.path.join(path, "config.json"))
    config = read_model_config(path, max_seq_len)
    graphdef, params = load_weights(path, config, dtype)
    tokenizer = Tokenizer.from_folder(path)
    try:
        template = chat_template_from_folder(path)
    except ChatTemplateError:
        template = None
    return Checkpoint(path, config, graphdef, params, tokenizer, template, hf_config)


def export_checkpoint(
    out_dir: str,
    config: ModelConfig,
    params: nnx.State,
    *,
    source: str | None = None,
    dtype=None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Writes ``params`` as a Hugging Face model folder that ``load_checkpoint`` and
    ``transformers``' ``from_pretrained`` read.

    Args:
      out_dir: the folder to write (created; files of the same names are replaced).
      config: the model's shape.
      params: its parameters (``nnx.State``), on any device.
      source: the folder the model was loaded from: its ``config.json`` is kept (dtype
        updated) and its tokenizer files (``TOKENIZER_FILES``) are copied. None: a new
        ``config.json`` (``hf_config_from_model``) and no tokenizer.
      dtype: the dtype written (e.g. ``jnp.bfloat16``); None keeps each parameter's.
      max_shard_bytes: above this many bytes of weights, shards
        ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.

    Returns:
      The names of the files written.

    Raises:
      CheckpointError: ``source``'s config.json describes another model.
    """
    tensors = _hf_tensors(params, dtype)
    dtype_name = np.dtype(next(iter(tensors.values())).dtype).name
    base = _read_json(os.path.join(source, "config.json")) if source else None
    hf_config = hf_config_from_model(config, base, dtype_name)
    os.makedirs(out_dir, exist_ok=True)
    _remove_weight_files(out_dir)
    written = _write_weights(out_dir, shard_tensors(tensors, max_shard_bytes))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    written.append("config.json")
    if source:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
                written.append(name)
    return written


def export_adapters(
    out_dir: str,
    adapters: Mapping[str, Mapping[str, Any]],
    *,
    alpha: float,
    base_model: str,
    dropout: float = 0.0,
) -> list[str]:
    """Writes LoRA adapters (``raytunix.learner.lora``) as a folder that Hugging Face
    ``peft`` loads over the base model (``PeftModel.from_pretrained(base, out_dir)``):
    ``adapter_config.json`` (peft's ``LoraConfig``) and ``adapter_model.safetensors``.

    Tensors are named as ``export_checkpoint`` names the adapted layer (``_hf_name``),
    under peft's prefix: ``layers.3.self_attn.q_proj`` becomes
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` float32[rank, d_in]
    and ``...lora_B.weight`` float32[d_out, rank]. Our adapters are already in peft's
    orientation (``W' = W + (alpha / rank) * (B @ A).T`` on our ``[in, out]`` kernel is
    ``W + (alpha / rank) * B @ A`` on torch's ``[out, in]`` weight), so no transpose.

    Args:
      out_dir: the folder to write (created; the two files are replaced).
      adapters: ``{layer path: {"lora_A": [rank, d_in], "lora_B": [d_out, rank]}}``, on
        any device.
      alpha: ``learner.lora_alpha``; peft scales by ``alpha / rank`` as we do.
      base_model: the base model's folder or hub id (``model.path``), which peft loads.
      dropout: ``learner.lora_dropout``, recorded for further training with peft.

    Returns:
      The names of the files written.

    Raises:
      CheckpointError: no adapters, ranks that differ, or a factor of the wrong shape.
    """
    tensors, rank = _peft_tensors(adapters)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({key.rpartition(".")[2] for key in adapters}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def _peft_tensors(
    adapters: Mapping[str, Mapping[str, Any]],
) -> tuple[dict[str, np.ndarray], int]:
    """``(peft's tensors, rank)`` of ``adapters`` (see ``export_adapters``)."""
    if not adapters:
        raise CheckpointError("no adapters to export; this model was trained without LoRA.")
    tensors: dict[str, np.ndarray] = {}
    ranks = set()
    for key, adapter in adapters.items():
        a, b = (np.asarray(jax.device_get(adapter[n]), np.float32) for n in ("lora_A", "lora_B"))
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError(
                f"adapter {key!r}: lora_A {a.shape} and lora_B {b.shape} are not "
                "[rank, d_in] and [d_out, rank]."
            )
        ranks.add(a.shape[0])
        module = _hf_name((*key.split("."), "kernel")).removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b)
    if len(ranks) != 1:
        raise CheckpointError(f"the adapters have different ranks {sorted(ranks)}; peft needs one.")
    return tensors, ranks.pop()


def _hf_tensors(params: nnx.State, dtype=None) -> dict[str, np.ndarray]:
    """``params`` as host arrays under their Hugging Face names (``_hf_name``), cast to
    ``dtype`` when given, kernels transposed to ``[out, in]`` as ``torch.nn.Linear`` keeps
    them, each C-contiguous (what safetensors writes)."""
    tensors: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(params):
        array = np.asarray(jax.device_get(var.get_value()))
        if dtype is not None:
            array = array.astype(np.dtype(dtype))
        tensors[_hf_name(path)] = np.ascontiguousarray(array.T if path[-1] == "kernel" else array)
    return tensors


def shard_tensors(
    tensors: dict[str, np.ndarray], max_shard_bytes: int
) -> list[dict[str, np.ndarray]]:
    """``tensors`` in name order, cut into shards of at most ``max_shard_bytes`` bytes
    each (a tensor larger than that gets a shard of its own); one shard when all fit."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def _remove_weight_files(out_dir: str) -> None:
    """Deletes the weight files of an earlier export from ``out_dir``: its shards would
    confuse a reader of the new ones."""
    for stale in os.listdir(out_dir):
        if (
            stale == SINGLE_FILE
            or stale == INDEX_FILE
            or (stale.startswith("model-") and stale.endswith(".safetensors"))
        ):
            os.remove(os.path.join(out_dir, stale))


def _write_weights(out_dir: str, shards: list[dict[str, np.ndarray]]) -> list[str]:
    """Writes ``shards`` (``shard_tensors``) into ``out_dir``: one ``SINGLE_FILE``, or
    ``model-0000i-of-0000n.safetensors`` files and their ``INDEX_FILE``; returns the names
    written."""
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    written, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        written.append(file)
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    written.append(INDEX_FILE)
    return written
