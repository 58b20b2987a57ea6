"""Advantages stay finite and correct for every finite float32 reward: a group's reward
spread above ~1.8e19 overflowed the square inside GRPO's std (advantages NaN), one of
-3e38 and 3e38 overflowed the shift by the group's smallest reward."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from raytunix.learner.advantages import grpo_advantages, reinforce_pp_advantages, rloo_advantages

BIG = float(np.finfo(np.float32).max)
GROUPS = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
BASE = np.array([0.0, 1.0, 3.0, 0.0, 2.0, 2.0, 5.0, -1.0], np.float32)


def _normalised(rewards):
    return {
        "grpo": np.asarray(
            grpo_advantages(rewards, GROUPS, 2, normalize_advantages_by_std=True, eps=0.0)
        ),
        "reinforce_pp": np.asarray(reinforce_pp_advantages(rewards, GROUPS, 2, eps=0.0)),
    }


@pytest.mark.parametrize("scale", [1e-20, 1e10, 1e19, 1e20, 1e30, 5e37])
def test_std_normalised_advantages_do_not_depend_on_the_reward_scale(scale):
    expected = _normalised(BASE)
    for name, got in _normalised((BASE * np.float32(scale)).astype(np.float32)).items():
        assert np.all(np.isfinite(got)), (name, scale, got)
        np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "rewards",
    [
        [-BIG, BIG, -BIG, BIG, 0.0, 0.0, BIG, BIG],
        [BIG, BIG, BIG, -BIG, -BIG, -BIG, -BIG, BIG],
        [-BIG, -BIG / 2, 0.0, BIG, 1.0, 2.0, 3.0, 4.0],
    ],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_extreme_rewards_give_finite_advantages_of_the_right_sign(rewards, jit):
    rewards = np.array(rewards, np.float32)
    wrap = (lambda f: jax.jit(f, static_argnums=2)) if jit else (lambda f: f)
    results = {
        "grpo": wrap(lambda r, g, n: grpo_advantages(r, g, n, normalize_advantages_by_std=True))(
            rewards, GROUPS, 2
        ),
        "dr_grpo": wrap(
            lambda r, g, n: grpo_advantages(r, g, n, normalize_advantages_by_std=False)
        )(rewards, GROUPS, 2),
        "rloo": wrap(rloo_advantages)(rewards, GROUPS, 2),
        "reinforce_pp": wrap(reinforce_pp_advantages)(rewards, GROUPS, 2),
    }
    for name, adv in results.items():
        adv = np.asarray(adv)
        assert np.all(np.isfinite(adv)), (name, adv)
        for g in (0, 1):
            member = GROUPS == g
            r = rewards[member].astype(np.float64)
            mean = r.mean()
            # A member above its group's mean gets a positive advantage, below a negative one.
            above, below = r > mean, r < mean
            if name != "reinforce_pp":  # the batch mean shifts reinforce_pp's zero
                assert np.all(adv[member][above] > 0), (name, g, adv)
                assert np.all(adv[member][below] < 0), (name, g, adv)
            else:  # >=: a group 1e38 times narrower than the batch's widest rounds to 0
                assert adv[member][above].min(initial=np.inf) >= adv[member][below].max(
                    initial=-np.inf
                ), (name, g, adv)


def test_unnormalised_advantages_match_float64_where_float32_holds_them():
    rewards = np.array([1e19, -1e19, 3e19, 0.0, 5.0, 6.0, 7.0, 8.0], np.float32)
    r = rewards.astype(np.float64)
    expected = np.concatenate([r[:4] - r[:4].mean(), r[4:] - r[4:].mean()])
    got = np.asarray(grpo_advantages(rewards, GROUPS, 2, normalize_advantages_by_std=False))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    loo = np.asarray(rloo_advantages(rewards, GROUPS, 2))
    np.testing.assert_allclose(loo, expected * 4 / 3, rtol=1e-5, atol=1e-5)


def test_equal_extreme_groups_get_exactly_zero():
    rewards = np.array([BIG] * 4 + [-BIG] * 4, np.float32)
    for adv in (
        grpo_advantages(rewards, GROUPS, 2, normalize_advantages_by_std=True),
        rloo_advantages(rewards, GROUPS, 2),
        reinforce_pp_advantages(rewards, GROUPS, 2),
    ):
        assert np.all(np.asarray(adv) == 0.0)


@pytest.mark.parametrize("reward", [3.5e38, -1e39, float("inf"), float("nan")])
def test_rewards_past_float32_are_refused_by_position(reward):
    rewards = np.array([0.0, 1.0, reward, 2.0], np.float64)
    for estimator in (
        lambda r: grpo_advantages(r, GROUPS[:4], 1, normalize_advantages_by_std=True),
        lambda r: rloo_advantages(r, GROUPS[:4], 1),
        lambda r: reinforce_pp_advantages(r, GROUPS[:4], 1),
    ):
        with pytest.raises(ValueError, match=r"1 of 4 rewards are not finite \(\[2\]="):
            estimator(rewards)


@pytest.mark.parametrize("bad", [-1, 2])
def test_group_ids_outside_the_groups_are_refused(bad):
    # -1 wrapped into the last group: rloo([1, 2, 4], [0, 0, -1]) gave [-1, 1, 5].
    for estimator in (rloo_advantages, reinforce_pp_advantages):
        with pytest.raises(
            ValueError,
            match=rf"group_ids\[2\]={bad} is outside \[0, "
            r"num_groups=2\)",
        ):
            estimator(np.array([1.0, 2.0, 4.0], np.float32), np.array([0, 0, bad]), 2)
