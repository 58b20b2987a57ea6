"""Group-relative advantages: pure functions of arrays, jit-safe.

GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300) scores each of the G
trajectories of one task against the others in its group::

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) drops the division by the standard
deviation, which otherwise up-weights groups whose rewards barely differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """Per-trajectory advantage relative to the trajectory's group.

    Groups need not be contiguous: ``group_ids`` may interleave. Statistics use segment
    sums, so the function is jit-safe as long as ``num_groups`` is static.

    Args:
      rewards: float32[B], episode rewards.
      group_ids: int32[B], group of each trajectory, each in ``[0, num_groups)``.
      num_groups: static upper bound on the number of groups (``B`` always works).
      normalize_by_std: divide by the group's population std plus ``eps`` (GRPO); when
        False only subtract the group mean (Dr. GRPO).
      eps: added to the std so a group of equal rewards gets advantage 0, not NaN.

    Returns:
      float32[B]: ``(r - mean_group) / (std_group + eps)``, or ``r - mean_group``.
      A group of one trajectory has advantage 0.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids, jnp.int32)
    counts = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_segments=num_groups)
    counts = jnp.maximum(counts, 1.0)  # empty groups are never gathered; avoid 0/0
    means = jax.ops.segment_sum(rewards, group_ids, num_segments=num_groups) / counts
    centered = rewards - means[group_ids]
    if not normalize_by_std:
        return centered
    variances = jax.ops.segment_sum(centered**2, group_ids, num_segments=num_groups) / counts
    return centered / (jnp.sqrt(variances)[group_ids] + eps)
