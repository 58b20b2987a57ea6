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
import numpy as np


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Per-trajectory advantage relative to the valid members of the trajectory's group.

    Groups need not be contiguous: ``group_ids`` may interleave. Statistics use segment
    sums, so the function is jit-safe as long as ``num_groups`` is static.

    A trajectory whose episode failed by infrastructure (env error, timeout, abort) says
    nothing about the policy; with ``valid`` 0 it is left out of its group's mean and std
    (so it neither shifts the baseline nor hands its siblings an advantage) and gets
    advantage 0. A group whose valid rewards are all equal (any value, any scale, a
    single member included) gets advantage exactly 0: its std is 0 in exact arithmetic,
    and dividing float32 rounding noise by ``std + eps`` would otherwise give it
    advantages of order 1 at large reward values.

    Args:
      rewards: float32[B], episode rewards; must be finite.
      group_ids: int32[B], group of each trajectory, each in ``[0, num_groups)``.
      num_groups: static upper bound on the number of groups (``B`` always works).
      normalize_by_std: divide by the group's population std plus ``eps`` (GRPO); when
        False only subtract the group mean (Dr. GRPO).
      eps: added to the std; keeps groups whose rewards differ by very little finite.
      valid: float or bool[B], nonzero for trajectories that count; None: all count.

    Returns:
      float32[B]: ``(r - mean_group) / (std_group + eps)``, or ``r - mean_group``, over
      valid members; 0 for invalid members and for groups with equal valid rewards.

    Raises:
      ValueError: a reward is NaN or infinite (checked when ``rewards`` is concrete; under
        ``jit`` the caller checks, as ``make_grpo_update`` does).
    """
    if not isinstance(rewards, jax.core.Tracer):
        check_finite_rewards(rewards)
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids, jnp.int32)
    on = jnp.ones_like(rewards) if valid is None else (jnp.asarray(valid) > 0).astype(jnp.float32)
    counts = jax.ops.segment_sum(on, group_ids, num_segments=num_groups)
    counts = jnp.maximum(counts, 1.0)  # empty groups are never gathered; avoid 0/0
    # Statistics of rewards shifted by the group's smallest valid reward: the shift makes
    # an all-equal group exactly 0 and keeps large offsets from eating float32 precision.
    big = jnp.finfo(jnp.float32).max
    low = jax.ops.segment_min(jnp.where(on > 0, rewards, big), group_ids, num_segments=num_groups)
    high = jax.ops.segment_max(jnp.where(on > 0, rewards, -big), group_ids, num_segments=num_groups)
    shifted = jnp.where(on > 0, rewards - low[group_ids], 0.0)
    means = jax.ops.segment_sum(shifted, group_ids, num_segments=num_groups) / counts
    centered = jnp.where(on > 0, shifted - means[group_ids], 0.0)
    equal = (high <= low)[group_ids]  # also true for groups with no valid member
    if normalize_by_std:
        variances = jax.ops.segment_sum(centered**2, group_ids, num_segments=num_groups) / counts
        centered = centered / (jnp.sqrt(variances)[group_ids] + eps)
    return jnp.where(equal | (on == 0), 0.0, centered)


def check_finite_rewards(rewards) -> None:
    """Raises ValueError naming the positions and values of non-finite ``rewards``
    (float[B], concrete), so a NaN from a verifier never reaches an update."""
    values = np.asarray(rewards, np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        shown = ", ".join(f"[{i}]={values[i]!r}" for i in bad[:5])
        raise ValueError(
            f"{bad.size} of {values.size} rewards are not finite ({shown}); a reward must be a "
            "finite number. Fix the environment's verifier (episodes with a non-finite "
            "reward end as env_error in run_episode)."
        )
