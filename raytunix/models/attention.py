"""The model's attention and the choice of kernel that computes it.

Two entry points, both returning ``float32[B, T, H * D]``:

* ``dense_attention`` (training, prefill, and decode wherever no paged kernel fits): queries
  over a contiguous span of keys and values under a boolean mask. On CPU it is
  ``reference_attention`` (plain ``jnp``, the numbers every CPU test pins); on GPU it is
  ``jax.nn.dot_product_attention`` with cuDNN's fused flash attention where the dtype and
  head width allow it, else its XLA implementation; elsewhere XLA's.
* ``paged_decode_attention`` (decode over a ``KVPages`` cache): one query token per row
  over the blocks its table names. On GPU and TPU, where the layout fits, a Pallas paged
  attention kernel reads the blocks where they lie; otherwise the blocks are gathered into
  a contiguous span (``gather_pages``) for ``dense_attention``.

Which one runs is a pure function of the backend's name, the dtypes and the shapes
(``dense_attention_impl``, ``paged_decode_impl``), so a test can ask what a GPU or TPU would
run; ``ModelConfig.attention_kernels`` overrides the backend (``ATTENTION_KERNELS``).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

# Added to masked attention scores. Finite, so that a query that may see nothing (a padding
# row with a negative position) yields uniform, NaN-free garbage instead of NaNs.
MASK_VALUE = -1e30

ATTENTION_KERNELS = ("auto", "reference", "interpret")
"""Values of ``ModelConfig.attention_kernels``: ``"auto"`` picks by ``jax.default_backend()``;
``"reference"`` runs the CPU path (``jnp`` attention, gathered pages) on every backend;
``"interpret"`` makes the GPU's choices, with Pallas kernels in interpret mode and XLA in
place of cuDNN, so that CPU tests can run them."""

DENSE_IMPLS = ("reference", "xla", "cudnn")
PAGED_IMPLS = ("gather", "pallas_gpu", "pallas_tpu")

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TRITON_DTYPES = (jnp.dtype(jnp.float32), *_HALF)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def dense_attention_impl(
    backend: str, dtype, kv_dtype, head_dim: int, q_len: int, kv_len: int
) -> str:
    """Which implementation ``dense_attention`` runs (one of ``DENSE_IMPLS``).

    Args:
      backend: a ``jax.default_backend()`` name (``"cpu"``, ``"gpu"``, ``"cuda"``,
        ``"rocm"``, ``"tpu"``), or ``"interpret"`` (the GPU's choice, cuDNN excepted).
      dtype, kv_dtype: dtypes of the queries and of the keys/values.
      head_dim: width of one head D.
      q_len, kv_len: query positions T and key positions S.

    Returns:
      ``"reference"`` on CPU (and any backend not named below), so that CPU numbers stay
      those of ``reference_attention``; ``"cudnn"`` on an NVIDIA GPU for bfloat16/float16
      queries and keys of one dtype, ``D`` a multiple of 8 up to 128 and even ``T`` and
      ``S`` (cuDNN's flash attention limits, ``check_is_flash_attention`` in JAX, with a
      mask); ``"xla"`` on other GPU, TPU or interpret cases.
    """
    if backend not in ("gpu", "cuda", "rocm", "tpu", "interpret"):
        return "reference"
    cudnn_fits = (
        backend in ("gpu", "cuda")
        and jnp.dtype(dtype) in _HALF
        and jnp.dtype(kv_dtype) == jnp.dtype(dtype)
        and head_dim % 8 == 0
        and head_dim <= 128
        and q_len % 2 == 0
        and kv_len % 2 == 0
    )
    return "cudnn" if cudnn_fits else "xla"


def paged_decode_impl(
    backend: str,
    kv_dtype,
    q_len: int,
    head_dim: int,
    block_size: int,
) -> str:
    """Which implementation ``paged_decode_attention`` runs (one of ``PAGED_IMPLS``).

    Args:
      backend: as for ``dense_attention_impl``.
      kv_dtype: dtype of the cached keys and values (the queries are cast to it).
      q_len: query tokens per row T; the kernels take one (decode), prefill chunks gather.
      head_dim: width of one head D.
      block_size: positions per KV block.

    Returns:
      ``"pallas_gpu"`` on a GPU (or ``"interpret"``) for one query token, float32, bfloat16
      or float16 pages, and ``D`` and ``block_size`` powers of two of at least 16 (Triton's
      block shapes); ``"pallas_tpu"`` on TPU for one query token, float32 or bfloat16
      pages, ``D`` a multiple of 128 and ``block_size`` a multiple of 16 (the TPU's lanes
      and sublanes); ``"gather"`` otherwise, and always on CPU.
    """
    dtype = jnp.dtype(kv_dtype)
    if q_len != 1:
        return "gather"
    if backend in ("gpu", "cuda", "rocm", "interpret"):
        fits = dtype in _TRITON_DTYPES and head_dim >= 16 and block_size >= 16
        if fits and _power_of_two(head_dim) and _power_of_two(block_size):
            return "pallas_gpu"
    if backend == "tpu" and dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        if head_dim % 128 == 0 and block_size % 16 == 0:
            return "pallas_tpu"
    return "gather"


def reference_attention(q, keys, values, mask):
    """Softmax attention of queries ``q`` ``[B, T, H, D]`` over ``keys`` and ``values``
    ``[B, KVH, S, D]`` where ``mask`` ``bool[B, T, S]`` allows it; query head h uses
    key/value head ``h // (H / KVH)``, the Hugging Face ``repeat_kv`` layout.

    The products take their inputs as they come (bfloat16 under a bfloat16 model) and sum
    in float32 (``preferred_element_type``); scores and softmax are float32, and the
    probabilities are cast to the values' dtype for the second product, as mixed-precision
    training does (Micikevicius et al. 2018, arXiv:1710.03740). With float32 inputs it is
    plain float32 attention. Returns ``float32[B, T, H * D]``."""
    batch, length, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    q = q.reshape(batch, length, kv_heads, groups, head_dim)
    q = q.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * length, head_dim)
    scores = jnp.einsum("bkqd,bksd->bkqs", q, keys, preferred_element_type=jnp.float32) / math.sqrt(
        head_dim
    )
    scores = scores.reshape(batch, kv_heads, groups, length, -1)
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).reshape(batch, kv_heads, groups * length, -1)
    out = jnp.einsum(
        "bkqs,bksd->bkqd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
    out = out.reshape(batch, kv_heads, groups, length, head_dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads * head_dim)


def dense_attention(q, keys, values, mask, backend: str, causal: bool = False):
    """``reference_attention``'s contract (same shapes, ``float32[B, T, H * D]`` back),
    computed by the implementation ``dense_attention_impl`` picks for ``backend``.

    ``causal``: ``mask`` is exactly the causal mask of ``T == S`` positions (a cache-free
    forward without packing), which cuDNN then applies without reading a mask."""
    batch, length, heads, head_dim = q.shape
    impl = dense_attention_impl(backend, q.dtype, keys.dtype, head_dim, length, keys.shape[2])
    if impl == "reference":
        return reference_attention(q, keys, values, mask)
    fused: Literal["xla", "cudnn"] = "cudnn" if impl == "cudnn" else "xla"
    dtype = jnp.promote_types(q.dtype, keys.dtype)  # the function wants one dtype
    out = jax.nn.dot_product_attention(
        q.astype(dtype),
        keys.transpose(0, 2, 1, 3).astype(dtype),  # [B, S, KVH, D]
        values.transpose(0, 2, 1, 3).astype(dtype),
        mask=None if causal and fused == "cudnn" else mask[:, None],  # [B, 1, T, S]
        is_causal=causal and fused == "cudnn",
        implementation=fused,
    )
    return out.reshape(batch, length, heads * head_dim).astype(jnp.float32)


def gather_pages(pages, block_tables):
    """The blocks ``block_tables`` (``int32[B, NB]``) names, as one contiguous span each:
    ``pages`` ``[KVH, num_blocks, block_size, D]`` (one layer of ``KVPages``) ->
    ``[B, KVH, NB * block_size, D]``, position ``j`` of row b at index ``j``."""
    kv_heads, _, block_size, head_dim = pages.shape
    batch, blocks = block_tables.shape
    rows = pages[:, block_tables].transpose(1, 0, 2, 3, 4)  # [B, KVH, NB, BS, D]
    return rows.reshape(batch, kv_heads, blocks * block_size, head_dim)


def _largest_divisor(n: int, at_most: int, power_of_two: bool = False) -> int:
    return max(
        d
        for d in range(1, min(n, at_most) + 1)
        if n % d == 0 and (_power_of_two(d) or not power_of_two)
    )


def _pallas_gpu(q, pages_k, pages_v, block_tables, lengths, interpret: bool):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    blocks = block_tables.shape[1]
    splits = _largest_divisor(blocks, 16)  # the kernel splits each row's blocks evenly
    per_step = _largest_divisor(blocks // splits, 8, power_of_two=True)
    return paged_attention(
        q,
        pages_k,
        pages_v,
        block_tables,
        lengths,
        k_splits=splits,
        pages_per_compute_block=per_step,
        interpret=interpret,
    )


def _pallas_tpu(q, pages_k, pages_v, block_tables, lengths):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    per_step = _largest_divisor(block_tables.shape[1], 8)
    return paged_attention(
        q, pages_k, pages_v, lengths, block_tables, pages_per_compute_block=per_step
    )


def paged_decode_attention(q, pages_k, pages_v, block_tables, positions, backend: str):
    """Attention of each row's query over the positions ``j <= positions[b, t]`` of the
    blocks its table names; ``float32[B, T, H * D]``.

    Args:
      q: ``[B, T, H, D]`` queries (rotary embedding applied).
      pages_k, pages_v: one layer of ``KVPages``, ``[KVH, num_blocks, block_size, D]``,
        with this step's keys and values already written.
      block_tables: ``int32[B, NB]``; entries past a row's last block may be any valid id.
      positions: ``int[B, T]``; negative marks a padding row, whose output is garbage.
      backend: as for ``paged_decode_impl``, which picks the implementation.

    The Pallas kernels (JAX's ``pallas.ops.gpu.paged_attention`` and
    ``pallas.ops.tpu.paged_attention``) take the pages in this layout, one query token per
    row, GQA heads grouped as ``reference_attention`` groups them, and a length per row
    (``positions + 1``: they keep positions ``< length``); they do not scale the scores, so
    the queries come scaled by ``1 / sqrt(D)``. A padding row has length 0 and gets zeros.
    """
    batch, length, heads, head_dim = q.shape
    impl = paged_decode_impl(backend, pages_k.dtype, length, head_dim, pages_k.shape[2])
    if impl == "gather":
        keys, values = gather_pages(pages_k, block_tables), gather_pages(pages_v, block_tables)
        span = keys.shape[2]
        mask = jnp.arange(span)[None, None, :] <= positions[:, :, None]  # [B, T, span]
        return dense_attention(q, keys, values, mask, backend)
    scaled = (q[:, 0] / math.sqrt(head_dim)).astype(pages_k.dtype)  # [B, H, D]
    lengths = jnp.maximum(positions[:, 0] + 1, 0).astype(jnp.int32)
    tables = block_tables.astype(jnp.int32)
    if impl == "pallas_gpu":
        out = _pallas_gpu(scaled, pages_k, pages_v, tables, lengths, backend == "interpret")
    else:
        out = _pallas_tpu(scaled, pages_k, pages_v, tables, lengths)
    return out.reshape(batch, 1, heads * head_dim).astype(jnp.float32)
