"""LoRA: low-rank adapters on the model's dense layers (Hu et al. 2021, arXiv:2106.09685).

A target layer's kernel ``W`` (flax layout float32[d_in, d_out], ``y = x @ W``) is used as

    W' = W + (alpha / rank) * (B @ A).T,   A float32[rank, d_in], B float32[d_out, rank]

with ``A`` drawn at random and ``B`` zero, so training starts at the base model. ``A`` and
``B`` are stored in the paper's (and PEFT's ``lora_A`` / ``lora_B``) orientation. Only the
adapters train; the base parameters stay frozen::

    spec = LoraSpec(rank=8, alpha=16.0)
    adapters = init_adapters(base, spec, seed=0)
    logits, _ = forward(graphdef, merge_adapters(base, adapters, spec.scale), tokens, positions)

The learner's ``TrainState`` holds the adapters as its ``params`` and the base beside
them (``raytunix.learner.train_state``); engines are served the merged weights. An engine
in its own process is sent only the adapters each version (``PublishedAdapters``) and
merges them onto the base it fetched once (``raytunix.inference.actor.EngineActor``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from raytunix.config import LORA_TARGET_MODULES
from raytunix.learner.sharding import path_name, tree_nbytes

# The adapters: one entry per adapted layer, keyed by its path (``layers.0.self_attn.q_proj``),
# each {"lora_A": float32[rank, d_in], "lora_B": float32[d_out, rank]}.
Adapters = dict[str, dict[str, jax.Array]]


def parse_target_modules(names: str) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` -> ``("q_proj", "v_proj")``: the comma-separated layer names of
    ``learner.lora_target_modules``.

    Raises:
      ValueError: no name, or a name that is not one of ``LORA_TARGET_MODULES``.
    """
    parsed = tuple(n.strip() for n in names.split(",") if n.strip())
    unknown = [n for n in parsed if n not in LORA_TARGET_MODULES]
    if unknown or not parsed:
        raise ValueError(
            f"lora_target_modules={names!r}: {', '.join(map(repr, unknown)) or 'no name'} "
            f"is not a dense layer of the model; name some of {', '.join(LORA_TARGET_MODULES)}."
        )
    return parsed


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which layers get adapters and how large: ``rank`` (0 = LoRA off), ``alpha`` (the
    update is scaled by ``alpha / rank``) and ``target_modules``, a comma-separated list
    of ``LORA_TARGET_MODULES`` (the config's ``learner.lora_*`` keys)."""

    rank: int
    alpha: float
    target_modules: str

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``B @ A``."""
        return self.alpha / self.rank

    def check(self) -> None:
        """Raises ValueError for a negative rank, an alpha that is not > 0 with LoRA on,
        or an unknown target module (``parse_target_modules``)."""
        if self.rank < 0:
            raise ValueError(f"lora_rank={self.rank!r} must be >= 0 (0: LoRA off).")
        if self.enabled and not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(
                f"lora_alpha={self.alpha!r} must be a finite number > 0 (e.g. 2 x lora_rank)."
            )
        parse_target_modules(self.target_modules)


def _target(path: tuple, targets: tuple[str, ...]) -> str | None:
    """The adapter key of a kernel leaf at ``path`` whose layer is one of ``targets``, else
    None."""
    name = path_name(path)
    layer, _, leaf = name.rpartition("/")
    if leaf != "kernel" or layer.rpartition("/")[2] not in targets:
        return None
    return layer.replace("/", ".")  # no "/": a checkpoint would read it as a folder


def init_adapters(base: nnx.State, spec: LoraSpec, seed: int) -> Adapters:
    """Fresh adapters for every target kernel of ``base``: ``lora_A`` uniform in
    ``±1/sqrt(d_in)`` (a dense layer's default init, as in the paper's reference code),
    ``lora_B`` zeros, both float32, so that the adapted model equals the base one.

    Raises:
      ValueError: ``spec`` is invalid (``LoraSpec.check``), LoRA is off, or no kernel of
        ``base`` is a target (e.g. ``lm_head`` with tied embeddings).
    """
    spec.check()
    if not spec.enabled:
        raise ValueError("init_adapters needs lora_rank > 0.")
    targets = parse_target_modules(spec.target_modules)
    kernels = [
        (key, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(base)[0]
        if (key := _target(path, targets)) is not None
    ]
    if not kernels:
        raise ValueError(
            f"lora_target_modules={spec.target_modules!r} names no dense layer of this "
            "model; name some of its projections (q_proj, v_proj, ...)."
        )
    keys = jax.random.split(jax.random.key(seed), len(kernels))
    adapters = {}
    for rng, (key, kernel) in zip(keys, kernels):
        d_in, d_out = kernel.shape
        bound = 1.0 / math.sqrt(d_in)
        adapters[key] = {
            "lora_A": jax.random.uniform(rng, (spec.rank, d_in), jnp.float32, -bound, bound),
            "lora_B": jnp.zeros((d_out, spec.rank), jnp.float32),
        }
    return adapters


def adapter_delta(adapter: dict[str, jax.Array], scale: float) -> jax.Array:
    """One layer's weight update in the kernel's layout: ``scale * (B @ A).T``,
    float32[d_in, d_out]."""
    return scale * (adapter["lora_B"] @ adapter["lora_A"]).T


def merge_adapters(base: nnx.State, adapters: Adapters, scale: float) -> Any:
    """``base`` with each adapted kernel replaced by ``W + scale * (B @ A).T`` in ``W``'s
    dtype; every other leaf is ``base``'s own. Differentiable in ``adapters``: the
    learner's forward pass and the weights an engine is served."""

    def merged(path, leaf):
        key = _target(path, tuple(k.rpartition(".")[2] for k in adapters))
        if key is None or key not in adapters:
            return leaf
        return (leaf + adapter_delta(adapters[key], scale)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(merged, base)


@dataclasses.dataclass(frozen=True)
class PublishedAdapters:
    """What a LoRA learner publishes to an engine in another process: the adapters of one
    policy version, to merge onto the base as ``merge_adapters(base, adapters, scale)``.

    ``adapters``: ``{layer path: {"lora_A": float32[rank, d_in], "lora_B":
    float32[d_out, rank]}}`` as numpy arrays; ``scale``: ``alpha / rank``; ``version``:
    the policy version; ``base_id``: names the base they were trained over (a new one for
    each phase's ``TrainState``: a warm start's adapters are merged into the RL phase's
    base), so an engine fetches a base only when it changes.
    """

    adapters: dict[str, dict[str, np.ndarray]]
    scale: float
    version: int
    base_id: str

    @property
    def nbytes(self) -> int:
        """Bytes of the adapters' arrays (what a publish ships)."""
        return tree_nbytes(self.adapters)
