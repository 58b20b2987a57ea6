"""Advantage estimators and reward shaping: pure functions of arrays, jit-safe.

Shapes: B trajectories of T tokens. Episode-level estimators take ``rewards`` float32[B]
and ``group_ids`` int32[B] (the G trajectories sampled for one task share a group id;
groups need not be contiguous) and return one advantage per trajectory, float32[B],
broadcast over its tokens by the loss. ``valid`` float[B] is 0 for a trajectory whose
episode failed by infrastructure (env error, timeout, abort): it says nothing about the
policy, so it is left out of every statistic and gets advantage 0.

* ``grpo_advantages``: GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300),
  ``(r - mean_group) / (std_group + eps)``; without the std it is the advantage of
  Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).
* ``rloo_advantages``: REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics",
  arXiv:2402.14740), ``r_i - mean_{j != i} r_j``.
* ``reinforce_pp_advantages``: the REINFORCE++ baseline (Hu 2025, arXiv:2501.03262):
  the group mean subtracted, then normalised over the whole batch.
* ``gae_advantages``: token-level GAE (Schulman et al. 2016, arXiv:1506.02438) from
  per-token rewards and a value estimate, for PPO with a value head.
* ``overlong_penalty``: DAPO's soft overlong punishment (Yu et al. 2025,
  arXiv:2503.14476), a reward term for responses near or past the length limit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

EPISODE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
# ``gae`` is token-level (``gae_advantages``) and needs the value head of PPO.
ADVANTAGE_ESTIMATORS = EPISODE_ESTIMATORS + ("gae",)


def _centered_by_group(rewards, group_ids, num_groups, valid):
    """``(centered, unit, on, counts, equal)``, per trajectory: its reward minus its group's
    mean over valid members, divided by its group's valid reward spread ``2 * unit`` (0 for
    invalid members); ``unit``, half that spread (1 where it is 0); the valid indicator; its
    group's count of valid members; and whether that group's valid rewards are all equal.

    Rewards are shifted by the group's smallest valid reward (so an all-equal group is
    exactly 0 at any value, and large offsets keep their float32 precision) and divided by
    the spread, so ``centered`` lies in [-1, 1]: nothing overflows for any finite float32
    rewards (a spread above ~1.8e19 overflowed the square in the std, one above ~3.4e38 the
    shift itself). Halving before subtracting keeps ``unit`` finite."""
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids, jnp.int32)
    on = jnp.ones_like(rewards) if valid is None else (jnp.asarray(valid) > 0).astype(jnp.float32)
    counts = jax.ops.segment_sum(on, group_ids, num_segments=num_groups)
    counts = jnp.maximum(counts, 1.0)  # empty groups are never gathered; avoid 0/0
    big = jnp.finfo(jnp.float32).max
    low = jax.ops.segment_min(jnp.where(on > 0, rewards, big), group_ids, num_segments=num_groups)
    high = jax.ops.segment_max(jnp.where(on > 0, rewards, -big), group_ids, num_segments=num_groups)
    half_spread = high * 0.5 - low * 0.5
    unit = jnp.where(half_spread > 0, half_spread, 1.0)[group_ids]
    shifted = jnp.where(on > 0, (rewards * 0.5 - low[group_ids] * 0.5) / unit, 0.0)
    means = jax.ops.segment_sum(shifted, group_ids, num_segments=num_groups) / counts
    centered = jnp.where(on > 0, shifted - means[group_ids], 0.0)
    equal = (high <= low)[group_ids]  # also true for groups with no valid member
    return centered, unit, on, counts[group_ids], equal


def _in_reward_units(centered, unit):
    """``centered * 2 * unit`` (reward units), saturated at float32's largest value: an
    unnormalised advantage is as large as the rewards' spread, which can pass float32's
    range (rewards of -3e38 and 3e38); saturating keeps it finite, of the right sign."""
    big = jnp.finfo(jnp.float32).max
    return jnp.clip(centered * unit * 2.0, -big, big)  # * 2 may overflow to inf: clipped


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    normalize_advantages_by_std: bool,
    eps: float = 1e-6,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Per-trajectory advantage relative to the valid members of the trajectory's group.

    GRPO (Shao et al. 2024, arXiv:2402.03300)::

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    and, with ``normalize_advantages_by_std=False``, ``A_i = r_i - mean(r_group)``: the
    advantage of Dr. GRPO (Liu et al. 2025, arXiv:2503.20783), which drops the std
    because it up-weights groups whose rewards barely differ. (Dr. GRPO's other half,
    the constant-length loss normalisation, is the loss aggregation
    ``sequence_mean_token_sum_norm``.)

    A group whose valid rewards are all equal (a single member included) gets advantage
    exactly 0: its std is 0 in exact arithmetic, and dividing float32 rounding noise by
    ``std + eps`` would otherwise give it advantages of order 1 at large reward values.

    Args:
      rewards: float32[B], episode rewards; must be finite.
      group_ids: int32[B], group of each trajectory, each in ``[0, num_groups)``.
      num_groups: static upper bound on the number of groups (``B`` always works); the
        function is jit-safe with it static.
      normalize_advantages_by_std: divide by the group's population std plus ``eps``.
      eps: added to the std; keeps groups whose rewards differ by very little finite.
      valid: float or bool[B], nonzero for trajectories that count; None: all count.

    Returns:
      float32[B]; 0 for invalid members and for groups with equal valid rewards.

    Raises:
      ValueError: a reward is NaN or infinite (checked when ``rewards`` is concrete; under
        ``jit`` the caller checks, as ``make_policy_update`` does).
    """
    if not isinstance(rewards, jax.core.Tracer):
        check_finite_rewards(rewards)
    if not isinstance(group_ids, jax.core.Tracer):
        check_group_ids(group_ids, num_groups)
    centered, unit, on, counts, equal = _centered_by_group(rewards, group_ids, num_groups, valid)
    if normalize_advantages_by_std:
        group_ids = jnp.asarray(group_ids, jnp.int32)
        variances = jax.ops.segment_sum(centered**2, group_ids, num_segments=num_groups)
        variances = variances[group_ids] / counts
        # (r - mean) / (std + eps), numerator and denominator divided by the spread 2 * unit.
        advantages = centered / (jnp.sqrt(variances) + eps / (2.0 * unit))
    else:
        advantages = _in_reward_units(centered, unit)
    return jnp.where(equal | (on == 0), 0.0, advantages)


def rloo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    valid: jax.Array | None = None,
) -> jax.Array:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al.
    2019): each trajectory's baseline is the mean reward of the *other* valid members
    of its group::

        A_i = r_i - (sum_{j != i} r_j) / (n - 1) = n / (n - 1) * (r_i - mean(r_group))

    with ``n`` the group's valid members. No std normalisation.

    Args:
      rewards: float32[B], finite. group_ids: int32[B] in ``[0, num_groups)``.
      num_groups: static bound on the groups. valid: float or bool[B], None: all count.

    Returns:
      float32[B]; 0 for invalid members, groups with one valid member and groups whose
      valid rewards are all equal.

    Raises:
      ValueError: a non-finite reward (when ``rewards`` is concrete).
    """
    if not isinstance(rewards, jax.core.Tracer):
        check_finite_rewards(rewards)
    if not isinstance(group_ids, jax.core.Tracer):
        check_group_ids(group_ids, num_groups)
    centered, unit, on, counts, equal = _centered_by_group(rewards, group_ids, num_groups, valid)
    scale = counts / jnp.maximum(counts - 1.0, 1.0)
    advantages = _in_reward_units(centered * scale, unit)
    return jnp.where(equal | (on == 0) | (counts < 2), 0.0, advantages)


def reinforce_pp_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    eps: float = 1e-6,
    valid: jax.Array | None = None,
) -> jax.Array:
    """REINFORCE++ with a group baseline (Hu 2025, "REINFORCE++", arXiv:2501.03262):
    subtract the group mean, then normalise over the batch's valid trajectories::

        a_i = r_i - mean(r_group);   A_i = (a_i - mean_batch(a)) / (std_batch(a) + eps)

    Normalising by the batch's std rather than each group's keeps the scale of a group
    whose rewards barely differ small (GRPO's per-group std inflates it).

    Args:
      rewards: float32[B], finite. group_ids: int32[B] in ``[0, num_groups)``.
      num_groups: static bound on the groups. eps: added to the batch std.
      valid: float or bool[B], None: all count.

    Returns:
      float32[B]; 0 for invalid members; all 0 when every group's rewards are equal.

    Raises:
      ValueError: a non-finite reward (when ``rewards`` is concrete).
    """
    if not isinstance(rewards, jax.core.Tracer):
        check_finite_rewards(rewards)
    if not isinstance(group_ids, jax.core.Tracer):
        check_group_ids(group_ids, num_groups)
    centered, unit, on, _, equal = _centered_by_group(rewards, group_ids, num_groups, valid)
    # In units of the batch's largest half-spread, so every group's a_i is in [-1, 1].
    largest = jnp.max(jnp.where((on > 0) & ~equal, unit, 0.0))
    largest = jnp.where(largest > 0, largest, 1.0)
    # XLA turns a division by a scalar into a product with its reciprocal, which for a
    # divisor above ~8.5e37 is subnormal and flushed to 0 on CPU: both sides scaled by 2^-64.
    down = jnp.where(largest > 2.0**64, 2.0**-64, 1.0)
    centered = jnp.where(equal, 0.0, centered * ((unit * down) / (largest * down)))
    n = jnp.maximum(jnp.sum(on), 1.0)
    mean = jnp.sum(centered * on) / n
    deviation = jnp.where(on > 0, centered - mean, 0.0)
    std = jnp.sqrt(jnp.sum(deviation**2) / n)
    return jnp.where(on > 0, deviation / (std + eps / (2.0 * largest)), 0.0)


def episode_advantages(
    estimator: str,
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    normalize_advantages_by_std: bool,
    valid: jax.Array | None = None,
) -> jax.Array:
    """The advantage ``estimator`` names (one of ``ADVANTAGE_ESTIMATORS``: ``grpo``,
    ``rloo``, ``reinforce_pp``) of each trajectory: float32[B]. Arguments as for
    ``grpo_advantages``; ``normalize_advantages_by_std`` applies to ``grpo`` only.

    Raises:
      ValueError: an unknown ``estimator``, or a non-finite reward.
    """
    if estimator == "grpo":
        return grpo_advantages(
            rewards,
            group_ids,
            num_groups,
            valid=valid,
            normalize_advantages_by_std=normalize_advantages_by_std,
        )
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids, num_groups, valid=valid)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_ids, num_groups, valid=valid)
    if estimator == "gae":
        raise ValueError(
            "advantage_estimator='gae' is token-level, not per episode; compute it "
            "with gae_advantages from a value estimate."
        )
    raise ValueError(
        f"advantage_estimator={estimator!r} is not supported; use one of "
        f"{', '.join(ADVANTAGE_ESTIMATORS)}."
    )


def gae_advantages(
    rewards: jax.Array,
    values: jax.Array,
    loss_mask: jax.Array,
    *,
    gamma: float,
    lam: float,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over the
    policy's tokens, for PPO with a learned value function.

    Each token the policy generated (``loss_mask`` nonzero) is one step; the other tokens
    (prompt, tool results) are skipped, so a multi-turn episode is one chain of steps.
    With ``t'`` the next generated token after ``t`` (none after the last one, whose next
    value is 0: the episode ended)::

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t               (the value head's regression target)

    Args:
      rewards: float32[B, T], reward of each step (usually the episode reward on the last
        generated token, 0 elsewhere).
      values: float32[B, T], the value estimate at each token.
      loss_mask: float[B, T], nonzero on generated tokens.
      gamma: discount per step, in [0, 1]. lam: GAE's lambda, in [0, 1].
      segment_ids: int[B, T] or None: packed rows (``raytunix.learner.batch.PackedBatch``),
        several episodes to a row; the recursion restarts at each change of segment, so
        each episode is its own chain. None: a row is one episode.

    Returns:
      ``(advantages, returns)``, both float32[B, T] and 0 off the mask.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    on = jnp.asarray(loss_mask) > 0
    segments = (
        jnp.zeros(rewards.shape, jnp.int32)
        if segment_ids is None
        else jnp.asarray(segment_ids, jnp.int32)
    )

    def step(carry, xs):
        next_value, next_advantage, next_segment = carry
        r, v, m, seg = xs
        same = seg == next_segment  # a later segment's chain never leaks into this one
        next_value = jnp.where(same, next_value, 0.0)
        next_advantage = jnp.where(same, next_advantage, 0.0)
        advantage = r + gamma * next_value - v + gamma * lam * next_advantage
        carry = (jnp.where(m, v, next_value), jnp.where(m, advantage, next_advantage), seg)
        return carry, jnp.where(m, advantage, 0.0)

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    # Scan over time, last token first; arrays are [T, B] inside the scan.
    _, advantages = jax.lax.scan(
        step, (zeros, zeros, segments[:, -1]), (rewards.T, values.T, on.T, segments.T), reverse=True
    )
    advantages = advantages.T
    return advantages, jnp.where(on, advantages + values, 0.0)


def last_token_rewards(
    rewards: jax.Array, loss_mask: jax.Array, trajectory_index: jax.Array | None = None
) -> jax.Array:
    """Episode rewards placed on each episode's last generated token, the per-token
    rewards of ``gae_advantages`` (an LLM episode is rewarded once, at its end).

    Args:
      rewards: float32[N], one per episode.
      loss_mask: float[B, T], nonzero on generated tokens.
      trajectory_index: int32[B, T], the episode of each token (packed rows,
        ``PackedBatch.trajectory_index``); None: row b is episode b (then N == B).

    Returns:
      float32[B, T]: ``rewards[n]`` at episode n's last generated token, 0 elsewhere (an
      episode without a generated token gets no reward anywhere).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    on = jnp.asarray(loss_mask) > 0
    columns = jnp.broadcast_to(jnp.arange(on.shape[1]), on.shape)
    marked = jnp.where(on, columns, -1)
    if trajectory_index is None:
        last = jnp.max(marked, axis=-1, keepdims=True)
        return jnp.where(on & (columns == last), rewards[:, None], 0.0)
    index = jnp.asarray(trajectory_index, jnp.int32)
    # A trajectory lies in one row, so its largest column is its last token.
    last = jax.ops.segment_max(marked.reshape(-1), index.reshape(-1), num_segments=rewards.shape[0])
    return jnp.where(on & (columns == last[index]), rewards[index], 0.0)


def whiten(values: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``(x - mean) / (std + eps)`` over the entries where ``mask`` is nonzero (population
    std), 0 elsewhere: PPO's advantage normalisation over a batch's trained tokens
    (as in OpenAI baselines' ppo2). float[B, T] -> float32[B, T]."""
    on = jnp.asarray(mask) > 0
    values = jnp.asarray(values, jnp.float32)
    n = jnp.maximum(jnp.sum(on), 1)
    mean = jnp.sum(jnp.where(on, values, 0.0)) / n
    centered = jnp.where(on, values - mean, 0.0)
    std = jnp.sqrt(jnp.sum(centered**2) / n)
    return centered / (std + eps)


def overlong_penalty(lengths: jax.Array, *, max_tokens: int, buffer_tokens: int) -> jax.Array:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), added
    to the reward of a response of ``lengths`` tokens::

        0                                       if L <= max_tokens - buffer_tokens
        (max_tokens - buffer_tokens - L) / buffer_tokens   if in the last buffer_tokens
        -1                                      if L > max_tokens

    a penalty that grows linearly from 0 to -1 over the last ``buffer_tokens`` tokens
    before the limit, so a truncated answer is not scored like a finished one.

    Args:
      lengths: int or float[B], generated tokens per response.
      max_tokens: the generation limit L_max (> 0).
      buffer_tokens: the soft zone L_cache, in ``(0, max_tokens]``.

    Returns:
      float32[B] in [-1, 0].

    Raises:
      ValueError: ``buffer_tokens`` outside ``(0, max_tokens]``.
    """
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError(
            f"overlong buffer_tokens={buffer_tokens!r} must be in (0, max_tokens="
            f"{max_tokens!r}]; it is the length of the soft penalty zone."
        )
    lengths = jnp.asarray(lengths, jnp.float32)
    start = max_tokens - buffer_tokens
    soft = jnp.minimum(0.0, (start - lengths) / buffer_tokens)
    return jnp.where(lengths > max_tokens, -1.0, soft)


def check_finite_rewards(rewards) -> None:
    """Raises ValueError naming the positions and values of non-finite ``rewards``
    (float[B], concrete), so a NaN from a verifier never reaches an update. Finite means
    finite in float32, the dtype the estimators compute in (3.5e38 is inf there)."""
    values = np.asarray(rewards, np.float64)
    bad = np.flatnonzero(~np.isfinite(values) | (np.abs(values) > np.finfo(np.float32).max))
    if bad.size:
        shown = ", ".join(f"[{i}]={float(values[i])!r}" for i in bad[:5])
        raise ValueError(
            f"{bad.size} of {values.size} rewards are not finite ({shown}) in float32; a "
            "reward must be a finite number of magnitude <= 3.4e38. Fix the environment's "
            "verifier (episodes with such a reward end as env_error in run_episode)."
        )


def check_group_ids(group_ids, num_groups: int) -> None:
    """Raises ValueError naming the first ``group_ids`` (int[B], concrete) outside
    ``[0, num_groups)``: a segment op would wrap -1 into the last group or drop it."""
    ids = np.asarray(group_ids)
    bad = np.flatnonzero((ids < 0) | (ids >= num_groups))
    if bad.size:
        raise ValueError(
            f"group_ids[{bad[0]}]={int(ids[bad[0]])} is outside [0, num_groups="
            f"{num_groups}); give each trajectory its group's index."
        )
