"""The engine's weights on its device, and the checks a weight update passes before the
engine queues it (``InferenceEngine.update_weights``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from raytunix.models.llama import cast_params


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
