"""A decoder-only language model of the Llama / Qwen2 family, in Flax NNX.

One forward pass serves training and inference::

    graphdef, state = init_model(ModelConfig(vocab_size=512), seed=0)
    logits, _ = forward(graphdef, state, tokens, positions)               # training
    cache = init_kv_cache(config, batch_size=B)
    logits, cache = forward(graphdef, state, prompt, prompt_pos, cache)   # prefill
    logits, cache = forward(graphdef, state, next_tok, next_pos, cache)   # decode
    pages = init_kv_pages(config, num_blocks=N, block_size=16)            # paged cache
    logits, pages = forward(graphdef, state, chunk, chunk_pos, pages, block_tables)

Each block is pre-norm: ``x + attn(rms_norm(x))`` then ``x + mlp(rms_norm(x))``, with
grouped-query attention, rotary position embeddings and a SwiGLU MLP, as in Llama
(Touvron et al. 2023, arXiv:2302.13971) and the Hugging Face ``LlamaForCausalLM``
reference. ``ModelConfig`` also covers what sets the Qwen2 and Qwen3 families apart:
biases on the query/key/value projections (Qwen2), an RMSNorm over each query and key
head before the rotation (Qwen3), a head width that is not ``d_model // n_heads``, and
RoPE frequency scaling (``RopeScaling``: linear and Llama 3.1). The defaults are the
small model raytunix trains from scratch. Submodules carry the Hugging Face names
(``embed_tokens``, ``layers.i.self_attn.q_proj``, ``self_attn.q_norm``,
``mlp.gate_proj``, ``norm``, ``lm_head``) so that importing a checkpoint is a renaming
plus a kernel transpose (``raytunix.models.hf``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, get_args

import jax
import jax.numpy as jnp
from flax import nnx

from raytunix.config import ModelDtype
from raytunix.models.attention import ATTENTION_KERNELS, dense_attention, paged_decode_attention

MODEL_DTYPES: tuple[str, ...] = get_args(ModelDtype)
"""Compute dtypes ``ModelConfig.dtype`` takes (the config's ``model.dtype``)."""


ROPE_SCALING_KINDS = ("linear", "llama3")
"""RoPE scaling types ``RopeScaling.kind`` takes (Hugging Face's ``rope_type`` names)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are stretched for contexts longer than pretraining's.

    Attributes:
      kind: ``"linear"``: every inverse frequency divided by ``factor`` (position
        interpolation, Chen et al. 2023, arXiv:2306.15595). ``"llama3"``: the Llama 3.1
        rule: frequencies whose wavelength exceeds ``original_max_len / low_freq_factor``
        are divided by ``factor``, those shorter than ``original_max_len /
        high_freq_factor`` are kept, and those between are interpolated smoothly
        (Meta's Llama 3.1 reference code; Hugging Face ``rope_type: llama3``).
      factor: context extension factor, > 0.
      low_freq_factor, high_freq_factor: ``llama3`` only; ``high_freq_factor >
        low_freq_factor > 0``.
      original_max_len: ``llama3`` only: the pretraining context length in tokens
        (Hugging Face ``original_max_position_embeddings``).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"RopeScaling.kind={self.kind!r} is not supported; use one of {ROPE_SCALING_KINDS}."
            )
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be positive, got {self.factor!r}.")
        if self.kind == "llama3" and not (
            self.high_freq_factor > self.low_freq_factor > 0 and self.original_max_len > 0
        ):
            raise ValueError(
                f"RopeScaling llama3 needs high_freq_factor > low_freq_factor > 0 and a "
                f"positive original_max_len, got high_freq_factor={self.high_freq_factor}, "
                f"low_freq_factor={self.low_freq_factor}, "
                f"original_max_len={self.original_max_len}."
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer.

    Attributes:
      vocab_size: number of token ids the embedding and the LM head cover.
      d_model: width of the residual stream.
      n_layers: number of transformer blocks.
      n_heads: number of query heads.
      n_kv_heads: number of key/value heads (grouped-query attention, Ainslie et al. 2023,
        arXiv:2305.13245); must divide ``n_heads``. 1 is multi-query attention,
        ``n_heads`` is ordinary multi-head attention.
      d_ff: hidden width of the SwiGLU MLP.
      max_seq_len: longest sequence (in tokens) the default KV cache holds.
      rope_theta: base of the rotary embedding frequencies.
      norm_eps: epsilon inside every RMSNorm square root (Hugging Face ``rms_norm_eps``).
      tie_embeddings: whether the LM head reuses the token embedding matrix.
      head_dim: width of one attention head (even). None: ``d_model // n_heads``, and then
        ``n_heads`` must divide ``d_model``; after construction it holds the resolved
        width, so pass ``head_dim=None`` to ``dataclasses.replace`` when changing
        ``d_model`` or ``n_heads``.
      qkv_bias: whether the query, key and value projections have biases (Qwen2).
      o_bias: whether the attention output projection has a bias.
      qk_norm: whether each query and key head goes through its own RMSNorm (weights
        shared across heads, over ``head_dim``) before the rotation (Qwen3).
      rope_scaling: how the rotary frequencies are scaled, or None for plain RoPE.
      dtype: the compute dtype, one of ``MODEL_DTYPES``: every layer casts its input and
        its weights to it (Flax's ``dtype``), so activations and the weights an engine
        holds are in it, while parameters are created, trained and checkpointed in
        float32 (``param_dtype``) and gradients come back in float32. Attention scores,
        softmax and the logits are float32 in either (``Transformer.logits``).
      attention_kernels: which attention kernels run, one of ``ATTENTION_KERNELS``:
        ``"auto"`` picks by backend (fused or Pallas kernels on GPU/TPU where the shapes
        fit, plain ``jnp`` on CPU; ``raytunix.models.attention``), ``"reference"`` the CPU
        path everywhere, ``"interpret"`` the GPU's choice with Pallas interpreted (tests).
    """

    vocab_size: int
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 384
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    head_dim: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    dtype: str = "float32"
    attention_kernels: str = "auto"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "d_ff",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}.")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"ModelConfig.d_model={self.d_model} is not divisible by "
                    f"n_heads={self.n_heads}; pick n_heads that divides d_model or give "
                    "head_dim."
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        elif (
            not isinstance(self.head_dim, int)
            or isinstance(self.head_dim, bool)
            or self.head_dim <= 0
        ):
            raise ValueError(
                f"ModelConfig.head_dim must be a positive int or None, got {self.head_dim!r}."
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads}; each key/value head must serve a whole "
                "group of query heads."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim} is odd (d_model={self.d_model}, "
                f"n_heads={self.n_heads}); rotary embeddings rotate pairs of features, so "
                "choose an even head_dim."
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"ModelConfig.rope_scaling must be a RopeScaling or None, got "
                f"{self.rope_scaling!r}."
            )
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(
                f"ModelConfig.dtype={self.dtype!r} is not supported; use one of {MODEL_DTYPES}."
            )
        if self.attention_kernels not in ATTENTION_KERNELS:
            raise ValueError(
                f"ModelConfig.attention_kernels={self.attention_kernels!r} is not one of "
                f"{ATTENTION_KERNELS}."
            )


class KVCache(NamedTuple):
    """Keys and values of every layer, indexed by sequence position.

    Attributes:
      k: ``[n_layers, B, n_kv_heads, S, head_dim]``, the cache dtype (float32 by default).
        Heads before positions, so that attention over the cache is a plain batched matmul.
      v: same shape and dtype as ``k``.

    Entry ``[:, b, :, j]`` holds the token of row ``b`` at position ``j``; entries never
    written are zeros and are masked out as long as queries only use positions that
    were written before.
    """

    k: jax.Array
    v: jax.Array


def init_kv_cache(
    config: ModelConfig, batch_size: int, max_len: int | None = None, dtype=jnp.float32
) -> KVCache:
    """Returns an all-zero KV cache.

    Args:
      config: the model the cache is for.
      batch_size: number of rows (sequences) B.
      max_len: number of positions S; defaults to ``config.max_seq_len``.
      dtype: dtype of the keys and values.

    Returns:
      ``KVCache`` with ``k`` and ``v`` of shape
      ``[n_layers, batch_size, n_kv_heads, S, head_dim]``.

    Raises:
      ValueError: if ``batch_size`` or ``max_len`` is not positive.
    """
    max_len = config.max_seq_len if max_len is None else max_len
    if batch_size <= 0:
        raise ValueError(f"init_kv_cache: batch_size must be positive, got {batch_size}.")
    if max_len <= 0:
        raise ValueError(f"init_kv_cache: max_len must be positive, got {max_len}.")
    shape = (config.n_layers, batch_size, config.n_kv_heads, max_len, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


class KVPages(NamedTuple):
    """A paged KV cache: fixed-size blocks of positions, shared by all sequences.

    Attributes:
      k: ``[n_layers, n_kv_heads, num_blocks, block_size, head_dim]``, the cache dtype.
        Heads before blocks: one layer is the pages layout of the Pallas paged attention
        kernels, which then read it in place; a gathered span is a batched matmul operand
        after one transpose.
      v: same shape and dtype as ``k``.

    A sequence owns a list of block ids, its *block table*: position ``p`` of the
    sequence lives at ``[:, :, table[p // block_size], p % block_size]``. Blocks can be
    shared by several sequences (a common prompt prefix) as long as none rewrites them.
    This is the layout of vLLM's PagedAttention (Kwon et al., SOSP 2023,
    arXiv:2309.06180); attention gathers only the blocks a batch's tables name, so its
    cost follows the tokens that exist rather than a fixed cache length.
    """

    k: jax.Array
    v: jax.Array

    @property
    def block_size(self) -> int:
        """Positions per block."""
        return self.k.shape[3]

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.k.shape[2]


def init_kv_pages(
    config: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32
) -> KVPages:
    """Returns an all-zero paged KV cache of ``num_blocks`` blocks of ``block_size``
    positions (see ``KVPages``); ``num_blocks * block_size`` tokens in all.

    Raises:
      ValueError: if ``num_blocks`` or ``block_size`` is not positive.
    """
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(
            f"init_kv_pages: num_blocks={num_blocks} and block_size={block_size} "
            "must both be positive."
        )
    shape = (config.n_layers, config.n_kv_heads, num_blocks, block_size, config.head_dim)
    return KVPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def kv_bytes_per_token(config: ModelConfig, dtype=jnp.float32) -> int:
    """Bytes of keys and values one token occupies across all layers."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Inverse frequencies of the rotary embedding: ``float32[head_dim / 2]``, radians per
    position; ``theta ** (-2i / head_dim)``, then scaled as ``scaling`` says (see
    ``RopeScaling``; the formulas of Hugging Face ``modeling_rope_utils``)."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: keep short wavelengths, divide long ones by the factor, blend in between.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_len / scaling.high_freq_factor
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(
        wavelen > low_freq_wavelen,
        inv_freq / scaling.factor,
        jnp.where(wavelen < high_freq_wavelen, inv_freq, blended),
    )


def apply_rope(
    x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """Rotates feature pairs of ``x`` by angles proportional to the token position.

    Rotary position embedding (Su et al. 2021, arXiv:2104.09864) in the "rotate half"
    layout of the Hugging Face Llama code: feature ``i`` is paired with ``i + D/2`` and
    ``out = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``
    and angle ``position * inv_freq[i]`` (``rope_inv_freq``).

    Args:
      x: ``float[B, T, H, D]`` queries or keys, D even.
      positions: ``int[B, T]`` position of each token.
      theta: frequency base (``ModelConfig.rope_theta``).
      scaling: frequency scaling (``ModelConfig.rope_scaling``) or None.

    Returns:
      An array of the shape and dtype of ``x``.
    """
    inv_freq = rope_inv_freq(x.shape[-1], theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def _normal(std: float):
    return nnx.initializers.normal(stddev=std)


def _linear(config: ModelConfig, d_in: int, d_out: int, init, rngs: nnx.Rngs, bias=False):
    """A float32-parameter dense layer that computes in ``config.dtype``."""
    dtype = jnp.dtype(config.dtype)
    return nnx.Linear(d_in, d_out, use_bias=bias, kernel_init=init, dtype=dtype, rngs=rngs)


def _rms_norm(config: ModelConfig, width: int, rngs: nnx.Rngs):
    """An RMSNorm with float32 scale and statistics whose output is ``config.dtype``."""
    return nnx.RMSNorm(width, epsilon=config.norm_eps, dtype=jnp.dtype(config.dtype), rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings and an optional KV cache;
    optional projection biases and per-head q/k RMSNorm (see ``ModelConfig``)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, h, kv, hd = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        init = _normal(0.02)
        out_init = _normal(0.02 / math.sqrt(2 * config.n_layers))
        qkv_bias = config.qkv_bias
        self.q_proj = _linear(config, d, h * hd, init, rngs, bias=qkv_bias)
        self.k_proj = _linear(config, d, kv * hd, init, rngs, bias=qkv_bias)
        self.v_proj = _linear(config, d, kv * hd, init, rngs, bias=qkv_bias)
        self.o_proj = _linear(config, h * hd, d, out_init, rngs, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = _rms_norm(config, hd, rngs)
            self.k_norm = _rms_norm(config, hd, rngs)
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self,
        x,
        positions,
        cache: tuple[jax.Array, jax.Array] | None,
        layer: int,
        block_tables: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ):
        """``x: float[B, T, d_model]``; ``cache``: the whole ``(k, v)`` of the model, each
        ``[n_layers, B, n_kv_heads, S, head_dim]``, or None; ``layer``: this layer's index.
        Returns the output ``[B, T, d_model]`` and the updated ``(k, v)`` (None without a
        cache). The cache is written in place at ``[layer, b, :, positions[b, t]]`` so that
        a decode step moves no more than one token per row (no per-layer copies).

        With ``block_tables`` (``int32[B, NB]``), ``cache`` is paged instead (``KVPages``
        arrays ``[n_layers, n_kv_heads, num_blocks, block_size, head_dim]``): each token's
        key/value is written at its row's block for its position, and attention reads the
        ``NB * block_size`` positions the row's table names.

        ``segment_ids`` (``int[B, T]``, no cache only): a token attends only to earlier
        tokens of its own segment (sequence packing)."""
        cfg = self.config
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(batch, length, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(batch, length, cfg.n_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, cfg.rope_theta, cfg.rope_scaling)
        k = apply_rope(k, positions, cfg.rope_theta, cfg.rope_scaling)
        k = k.transpose(0, 2, 1, 3)  # [B, KVH, T, D]
        v = v.transpose(0, 2, 1, 3)

        if block_tables is not None:
            return self._paged(q, k, v, positions, cache, layer, block_tables, x.dtype)
        causal = cache is None and segment_ids is None
        if cache is None:
            keys, values = k, v
            idx = jnp.arange(length)
            mask = jnp.broadcast_to(
                idx[None, :, None] >= idx[None, None, :], (batch, length, length)
            )  # [B, T, S=T]
            if segment_ids is not None:
                mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        else:
            cache_k, cache_v = cache
            cache_len = cache_k.shape[3]
            # jnp scatter wraps negative indices even with mode="drop", so padding
            # (negative positions) is sent to the out-of-range index cache_len instead.
            write_at = jnp.where(positions >= 0, positions, cache_len)[:, None, :]  # [B, 1, T]
            rows = jnp.arange(batch)[:, None, None]
            heads = jnp.arange(cfg.n_kv_heads)[None, :, None]
            cache_k = cache_k.at[layer, rows, heads, write_at].set(
                k.astype(cache_k.dtype), mode="drop"
            )
            cache_v = cache_v.at[layer, rows, heads, write_at].set(
                v.astype(cache_v.dtype), mode="drop"
            )
            cache = (cache_k, cache_v)
            keys, values = cache_k[layer], cache_v[layer]  # [B, KVH, S, D]
            mask = jnp.arange(cache_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]

        out = dense_attention(q, keys, values, mask, _backend(cfg), causal)
        return self.o_proj(out.astype(x.dtype)), cache

    def _paged(self, q, k, v, positions, cache, layer, block_tables, dtype):
        """Attention over a paged cache; q ``[B, T, H, D]``, k/v ``[B, KVH, T, D]``."""
        pages_k, pages_v = cache
        num_blocks, block_size = pages_k.shape[2], pages_k.shape[3]
        safe = jnp.maximum(positions, 0)
        block = jnp.take_along_axis(block_tables, safe // block_size, axis=1)  # [B, T]
        # Padding (negative positions) goes to the out-of-range block id and is dropped.
        block = jnp.where(positions >= 0, block, num_blocks)
        offset = safe % block_size
        # Indexed [layer, :, block[b, t], offset[b, t]]: the advanced indices are apart, so
        # the written slice is [B, T, KVH, D].
        pages_k = pages_k.at[layer, :, block, offset].set(
            k.transpose(0, 2, 1, 3).astype(pages_k.dtype), mode="drop"
        )
        pages_v = pages_v.at[layer, :, block, offset].set(
            v.transpose(0, 2, 1, 3).astype(pages_v.dtype), mode="drop"
        )
        out = paged_decode_attention(
            q, pages_k[layer], pages_v[layer], block_tables, positions, _backend(self.config)
        )
        return self.o_proj(out.astype(dtype)), (pages_k, pages_v)


def _backend(config: ModelConfig) -> str:
    """The backend name the attention kernels are chosen for (``ATTENTION_KERNELS``)."""
    if config.attention_kernels == "auto":
        return jax.default_backend()
    return "cpu" if config.attention_kernels == "reference" else "interpret"


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020,
    arXiv:2002.05202)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f = config.d_model, config.d_ff
        init = _normal(0.02)
        out_init = _normal(0.02 / math.sqrt(2 * config.n_layers))
        self.gate_proj = _linear(config, d, f, init, rngs)
        self.up_proj = _linear(config, d, f, init, rngs)
        self.down_proj = _linear(config, f, d, out_init, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """One pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = _rms_norm(config, config.d_model, rngs)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = _rms_norm(config, config.d_model, rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, positions, cache, layer: int, block_tables=None, segment_ids=None):
        attn_out, cache = self.self_attn(
            self.input_layernorm(x), positions, cache, layer, block_tables, segment_ids
        )
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class Transformer(nnx.Module):
    """Decoder-only language model; see the module docstring for the architecture."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.d_model,
            embedding_init=_normal(0.02),
            dtype=jnp.dtype(config.dtype),
            rngs=rngs,
        )
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.norm = _rms_norm(config, config.d_model, rngs)
        if config.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _linear(config, config.d_model, config.vocab_size, _normal(0.02), rngs)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache | KVPages | None = None,
        block_tables: jax.Array | None = None,
        logit_index: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | KVPages | None]:
        """Computes next-token logits for every input token (or one per row).

        Args:
          tokens: ``int32[B, T]`` token ids.
          positions: ``int32[B, T]`` position of each token in its sequence, used for the
            rotary embedding and, with a cache, as the cache index. With a cache, a
            negative position marks padding: nothing is written for it and its logits
            are garbage to be ignored.
          kv_cache: None for a full causal forward over the T tokens (training; right
            padding is harmless). Otherwise each token's key/value is written at
            ``positions[b, t]`` of row b, and the token attends to the entries
            ``j <= positions[b, t]`` of its row: T = prompt length for prefill, T = 1
            for decode. Positions ``>= S`` are not written either. A ``KVPages`` cache
            needs ``block_tables``.
          block_tables: ``int32[B, NB]``, with a ``KVPages`` cache only: row b's logical
            block i is physical block ``block_tables[b, i]``; the tokens attend to the
            positions ``j <= positions[b, t]`` among the ``NB * block_size`` the table
            covers. Entries past a row's last block may hold any valid block id.
          logit_index: ``int32[B]`` or None: only compute the logits of token
            ``logit_index[b]`` of each row (what sampling after a prefill needs; skips
            the LM head for the other ``T - 1`` tokens).
          segment_ids: ``int[B, T]`` or None, without a cache only: several sequences
            packed in a row (``raytunix.learner.batch.PackedBatch``); a token attends
            only to earlier tokens with its segment id, and ``positions`` should restart
            at 0 in each segment. None: one sequence per row.

        Returns:
          ``(logits, new_cache)``: ``float32[B, T, vocab_size]`` logits
          (``[B, 1, vocab_size]`` with ``logit_index``) and the updated cache, of the
          type passed in (None when ``kv_cache`` is None).

        Raises:
          ValueError: if ``tokens`` and ``positions`` differ in shape, the cache does not
            match the model or the batch, or a ``KVPages`` cache comes without
            ``block_tables`` (or block tables without one), or ``segment_ids`` come with
            a cache or in another shape than ``tokens``.
        """
        _check_forward_args(self.config, tokens, positions, kv_cache, block_tables, segment_ids)
        paged = isinstance(kv_cache, KVPages)
        cache = None if kv_cache is None else (kv_cache.k, kv_cache.v)
        x, cache = self.hidden(tokens, positions, cache, block_tables, logit_index, segment_ids)
        if cache is None:
            new_cache = None
        else:
            new_cache = (KVPages if paged else KVCache)(k=cache[0], v=cache[1])
        return self.logits(x), new_cache

    def hidden(
        self, tokens, positions, cache=None, block_tables=None, logit_index=None, segment_ids=None
    ):
        """The blocks and the final norm, unchecked (``__call__`` checks the arguments):
        ``(hidden [B, T, d_model], cache as (k, v) arrays or None)``, ``hidden`` being what
        the LM head reads (only row b's token ``logit_index[b]`` with it: ``[B, 1, ...]``)."""
        x = self.embed_tokens(tokens)
        for i, block in enumerate(self.layers):
            x, cache = block(x, positions, cache, i, block_tables, segment_ids)
        if logit_index is not None:
            x = x[jnp.arange(x.shape[0]), logit_index][:, None]
        return self.norm(x), cache

    def logits(self, hidden):
        """``float32[..., vocab_size]`` logits of the final hidden state (tied embeddings
        or the LM head). The product's inputs are in the compute dtype, its sums and
        output float32: rounding bfloat16 logits would move logprobs by up to about
        ``|logit| / 256`` nats, more than the rest of the model's rounding does."""
        if self.lm_head is None:
            weight = self.embed_tokens.embedding[...].T
        else:
            weight = self.lm_head.kernel[...]
        return jnp.dot(hidden, weight.astype(hidden.dtype), preferred_element_type=jnp.float32)


def _check_forward_args(
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache | KVPages | None,
    block_tables: jax.Array | None,
    segment_ids: jax.Array | None,
) -> None:
    """Raises the ``ValueError`` of ``Transformer.__call__`` for arguments that do not fit
    together or the model (shapes only: it runs once per trace under ``jax.jit``)."""
    if tokens.shape != positions.shape or tokens.ndim != 2:
        raise ValueError(
            f"tokens {tokens.shape} and positions {positions.shape} must both be [B, T]."
        )
    if segment_ids is not None and (kv_cache is not None or segment_ids.shape != tokens.shape):
        raise ValueError(
            f"segment_ids {segment_ids.shape} go with a cache-free forward over tokens "
            f"{tokens.shape} of the same shape; drop them for cached inference."
        )
    _check_cache(cfg, kv_cache, block_tables, batch=tokens.shape[0])


def _check_cache(
    cfg: ModelConfig,
    kv_cache: KVCache | KVPages | None,
    block_tables: jax.Array | None,
    batch: int,
) -> None:
    """Raises ``ValueError`` unless ``kv_cache`` is None or fits ``cfg`` and a batch of
    ``batch`` rows: a ``KVCache`` ``[n_layers, batch, n_kv_heads, S, head_dim]``, or a
    ``KVPages`` ``[n_layers, n_kv_heads, blocks, block_size, head_dim]`` with
    ``block_tables`` ``[batch, NB]`` (and block tables only with one)."""
    paged = isinstance(kv_cache, KVPages)
    if paged != (block_tables is not None):
        raise ValueError(
            "A KVPages cache and block_tables go together: pass both (paged attention) or neither."
        )
    if paged:
        expected = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        got = (kv_cache.k.shape[0], kv_cache.k.shape[1], kv_cache.k.shape[4])
        if (
            kv_cache.k.ndim != 5
            or got != expected
            or kv_cache.v.shape != kv_cache.k.shape
            or block_tables.ndim != 2
            or block_tables.shape[0] != batch
        ):
            raise ValueError(
                f"KVPages k {kv_cache.k.shape} / block_tables {block_tables.shape} do not "
                f"fit [n_layers={cfg.n_layers}, n_kv_heads={cfg.n_kv_heads}, blocks, "
                f"block_size, head_dim={cfg.head_dim}] and "
                f"[B={batch}, NB]; build the cache with init_kv_pages(config, ...)."
            )
    elif kv_cache is not None:
        expected = (cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim)
        got = (*kv_cache.k.shape[:3], kv_cache.k.shape[4])
        if kv_cache.k.ndim != 5 or got != expected or kv_cache.v.shape != kv_cache.k.shape:
            raise ValueError(
                f"KV cache k {kv_cache.k.shape} / v {kv_cache.v.shape} does not fit "
                f"[n_layers={cfg.n_layers}, B={batch}, "
                f"n_kv_heads={cfg.n_kv_heads}, S, head_dim={cfg.head_dim}]; build it with "
                "init_kv_cache(config, batch_size)."
            )


def init_model(config: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds a freshly initialised model and splits it for functional use.

    Returns:
      ``(graphdef, state)`` from ``nnx.split``; ``state`` holds float32 parameters (the
      model computes in ``config.dtype`` whatever its parameters' dtype) and is a pytree
      that can be passed through ``jax.jit``.
    """
    return nnx.split(Transformer(config, rngs=nnx.Rngs(seed)))


def cast_params(state: nnx.State, dtype) -> nnx.State:
    """``state`` with every floating-point array in ``dtype`` (a name or numpy/jax dtype);
    arrays already in it are passed through, not copied. What a learner publishes to its
    engines: weights in the compute dtype (``ModelConfig.dtype``), half the bytes of
    float32 ones in bfloat16."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(dtype) if floating and x.dtype != dtype else x

    return jax.tree.map(cast, state)


def forward(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache | KVPages | None = None,
    block_tables: jax.Array | None = None,
    logit_index: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | KVPages | None]:
    """Functional ``Transformer.__call__``: merges ``graphdef`` and ``state`` and runs the
    model. Pure, so it can be wrapped in ``jax.jit`` (with ``graphdef`` static or closed
    over). Arguments and return value are those of ``Transformer.__call__``."""
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, kv_cache, block_tables, logit_index, segment_ids)


def forward_with_hidden(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Cache-free ``forward`` that also returns the final hidden state: ``(logits
    float32[B, T, vocab_size], hidden [B, T, d_model])``, ``hidden`` being the output of
    the final norm, what the LM head reads (a PPO value head reads it too,
    ``raytunix.learner.train_state``). Arguments as for ``Transformer.__call__``
    (training use: no cache, no ``logit_index``); the logits equal ``forward``'s."""
    model = nnx.merge(graphdef, state)
    hidden, _ = model.hidden(tokens, positions, segment_ids=segment_ids)
    return model.logits(hidden), hidden


def count_params(state: nnx.State) -> int:
    """Number of scalar parameters (``nnx.Param`` entries) in ``state``."""
    params = nnx.filter_state(state, nnx.Param)
    return sum(int(leaf.size) for leaf in jax.tree.leaves(params))
