"""The engine's weights on its device, the checks a weight update passes before the
engine queues it (``InferenceEngine.update_weights``), and the LoRA base an engine in its
own process merges published adapters onto (``LoraBase``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from raytunix.learner.lora import PublishedAdapters, merge_adapters
from raytunix.models.llama import cast_params

# One program per model shape: the merge runs on the engine's device, base and adapters in.
_merge_on_device = jax.jit(merge_adapters)


def on_engine_device(params: Any, dtype: Any = None) -> Any:
    """``params`` on the engine's one device, ``jax.devices()[0]``: weights a learner split
    over a mesh (even a one-device mesh) have another array type than plain ones, and
    every step program would compile again for them at the first weight update. Arrays
    some other process holds a part of stay as they are. With ``dtype`` (the model's
    compute dtype), floating-point weights are cast to it first (``cast_params``: a no-op
    for weights a learner published in it)."""
    if dtype is not None:
        params = cast_params(params, dtype)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    leaves = jax.tree.leaves(params)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_put(params, device)
    return jax.device_put(params)


def signature(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
    """A weights tree's structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]


def check_weight_update(params: Any, version: int, current: Any, latest_version: int) -> int:
    """``version`` as an int, once ``params`` may replace the ``current`` weights.

    Raises:
      ValueError: ``version`` is lower than ``latest_version`` (the engine's, or the one
        already queued), or ``params`` does not have the tree structure, shapes and
        dtypes of ``current``.
    """
    version = int(version)
    if version < latest_version:
        raise ValueError(
            f"update_weights: version {version} is older than the engine's "
            f"version {latest_version}; policy versions must not decrease."
        )
    if signature(params) != signature(current):
        raise ValueError(
            "update_weights: params do not match the engine's model "
            "(tree structure, shapes or dtypes differ); pass the state of "
            "the same ModelConfig."
        )
    return version


class LoraBase:
    """The frozen LoRA base an engine keeps on its device (in the compute dtype ``dtype``),
    fetched from the learner once per base, and the merge of each published version's
    adapters onto it: ``W + scale (B A)^T`` per adapted kernel (``merge_adapters``, jitted),
    the same weights the learner serves a colocated engine up to rounding in ``dtype``.
    """

    def __init__(self, dtype: Any):
        self.dtype = dtype
        self.base_id = ""  # "": no base yet
        self._base: Any = None

    def set(self, base_id: str, base: Any) -> None:
        """Keeps ``base`` (the params' tree of numpy or jax arrays, as
        ``LearnerActor.base_weights`` returns it) on the engine's device as the base named
        ``base_id``, in place of the previous one."""
        self._base = None  # the old base's memory is free before the new one arrives
        self._base = on_engine_device(base, self.dtype)
        self.base_id = base_id

    def merged(self, published: PublishedAdapters) -> Any:
        """The params of ``published``'s policy version: its adapters merged onto the base,
        on the engine's device in ``dtype``.

        Raises:
          RuntimeError: the adapters were trained over another base than the one held
            (none yet, or the learner started a new phase since it was fetched).
        """
        if published.base_id != self.base_id or self._base is None:
            raise RuntimeError(
                f"the adapters of policy version {published.version} belong to LoRA base "
                f"{published.base_id!r} but this engine holds base {self.base_id or None!r}; "
                "fetch the learner's base_weights() first (EngineActor does when it has a "
                "weights_source), then publish again."
            )
        adapters = on_engine_device(published.adapters)  # float32, as the learner's
        return _merge_on_device(self._base, adapters, published.scale)
