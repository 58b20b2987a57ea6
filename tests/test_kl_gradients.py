"""The KL penalty pulls the policy along the gradient of KL(pi || pi_ref), whichever
estimator the config accepts and whoever sampled the tokens.

One token position with a 4-way vocabulary and logits theta: the exact expected gradient
of the penalty ``policy_gradient_loss`` adds, ``sum_a mu(a) * grad_theta loss(theta, a)`` over
the distribution mu that sampled the token, against ``grad_theta KL(pi_theta || pi_ref)``
computed from the full distributions. On-policy (mu = pi, the anchor its stop-gradient
copy), off-policy (the anchor is a stale behaviour policy's logprob) and decoupled (the
anchor is a proximal policy, a weight carries it to the behaviour policy).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raytunix.config import _CHOICES, ConfigError, LearnerConfig, load_config  # noqa: E402
from raytunix.learner.losses import (  # noqa: E402
    KL_ESTIMATORS,
    POLICY_LOSSES,
    policy_gradient_loss,
    kl_estimate,
    kl_penalty,
)

THETA = jnp.array([1.0, 0.0, -1.0, 0.5])
REF = jax.nn.log_softmax(jnp.array([0.3, -0.2, 0.4, 0.0]))
BEHAVIOUR = jax.nn.log_softmax(jnp.array([-0.5, 1.2, 0.1, -0.3]))  # a stale policy
PROXIMAL = jax.nn.log_softmax(jnp.array([0.6, 0.4, -0.6, 0.2]))  # between the two
ACCEPTED = _CHOICES["learner.kl_estimator"]


def _penalty(theta, action, estimator, *, anchor=None, kl_weight=None, policy_loss="ppo_clip"):
    """``policy_gradient_loss`` of one sampled token with advantage 0 and kl_coef 1: only the
    KL term. ``anchor``: the logprob the ratio is taken to (None: on-policy, the current
    one without gradient)."""
    logp = jax.nn.log_softmax(theta)[action]
    old = jax.lax.stop_gradient(logp) if anchor is None else anchor[action]
    loss, _ = policy_gradient_loss(
        logp[None, None],
        old[None, None],
        jnp.zeros((1,)),
        jnp.ones((1, 1)),
        policy_loss=policy_loss,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip=0.0,
        aggregation="token_mean",
        max_tokens=1,
        ref_logprobs=REF[action][None, None],
        kl_coef=1.0,
        kl_estimator=estimator,
        kl_importance_weights=None if kl_weight is None else kl_weight[action][None, None],
    )
    return loss


def _expected_gradient(sampler, **kw):
    p = jnp.exp(sampler)
    return sum(p[a] * jax.grad(_penalty)(THETA, a, **kw) for a in range(4))


def _kl(theta):
    return jnp.sum(jax.nn.softmax(theta) * (jax.nn.log_softmax(theta) - REF))


TRUE = jax.grad(_kl)(THETA)
REVERSE = jax.grad(lambda t: jnp.sum(jnp.exp(REF) * (REF - jax.nn.log_softmax(t))))(THETA)


def test_every_estimator_the_config_accepts_is_checked_here_and_the_default_among_them():
    assert tuple(ACCEPTED) == KL_ESTIMATORS
    assert LearnerConfig().kl_estimator in ACCEPTED
    for estimator in ACCEPTED:  # accepted with a penalty on, no warning needed
        assert (
            load_config(
                None, ["learner.kl_coef=0.1", f"learner.kl_estimator={estimator}"]
            ).learner.kl_coef
            == 0.1
        )
    with pytest.raises(ConfigError, match="k4"):
        load_config(None, ["learner.kl_coef=0.1", "learner.kl_estimator=k4"])


@pytest.mark.parametrize("estimator", ACCEPTED)
def test_on_policy_the_penalty_follows_grad_kl_policy_to_reference(estimator):
    got = _expected_gradient(jax.nn.log_softmax(THETA), estimator=estimator)
    np.testing.assert_allclose(got, TRUE, atol=1e-6)
    assert not np.allclose(TRUE, REVERSE, atol=1e-2)  # the two directions differ here


@pytest.mark.parametrize("estimator", ACCEPTED)
def test_off_policy_the_importance_weighted_penalty_follows_the_same_gradient(estimator):
    got = _expected_gradient(BEHAVIOUR, estimator=estimator, anchor=BEHAVIOUR)
    np.testing.assert_allclose(got, TRUE, atol=1e-6)


@pytest.mark.parametrize("estimator", ACCEPTED)
def test_decoupled_the_weight_to_the_behaviour_policy_keeps_the_gradient(estimator):
    weight = jnp.exp(PROXIMAL - BEHAVIOUR)  # pi_prox / pi_behav, below any cap here
    got = _expected_gradient(BEHAVIOUR, estimator=estimator, anchor=PROXIMAL, kl_weight=weight)
    np.testing.assert_allclose(got, TRUE, atol=1e-6)


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_the_kl_gradient_does_not_depend_on_the_surrogate(policy_loss):
    got = _expected_gradient(BEHAVIOUR, estimator="k3", anchor=BEHAVIOUR, policy_loss=policy_loss)
    np.testing.assert_allclose(got, TRUE, atol=1e-6)


def test_the_plain_estimators_as_losses_are_the_known_wrong_gradients():
    """What the weighting fixes: differentiated as they are, k1 gives zero in expectation
    and k3 the gradient of KL(pi_ref || pi); off-policy even k2 is off."""

    def plain(theta, action, estimator):
        logp = jax.nn.log_softmax(theta)[action]
        return kl_estimate(
            logp[None, None], REF[action][None, None], jnp.ones((1, 1)), estimator=estimator
        )[0, 0]

    def expected(sampler, estimator):
        p = jnp.exp(sampler)
        return sum(p[a] * jax.grad(plain)(THETA, a, estimator) for a in range(4))

    on = jax.nn.log_softmax(THETA)
    np.testing.assert_allclose(expected(on, "k1"), 0.0, atol=1e-6)
    np.testing.assert_allclose(expected(on, "k3"), REVERSE, atol=1e-6)
    np.testing.assert_allclose(expected(on, "k2"), TRUE, atol=1e-6)
    assert not np.allclose(expected(BEHAVIOUR, "k2"), TRUE, atol=1e-2)


@pytest.mark.parametrize("estimator", ACCEPTED)
def test_the_reported_value_is_the_estimator_and_on_policy_the_loss_term_equals_it(estimator):
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    ref = jnp.array([[-1.5, -0.7, -0.5]])
    mask = jnp.ones((1, 3))
    value = kl_estimate(logp, ref, mask, estimator=estimator)
    np.testing.assert_allclose(
        kl_penalty(logp, ref, logp, mask, estimator=estimator), value, rtol=1e-6, atol=1e-7
    )
    _, aux = policy_gradient_loss(
        logp,
        logp + 0.3,
        jnp.zeros((1,)),
        mask,
        policy_loss="ppo_clip",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip=0.0,
        aggregation="token_mean",
        max_tokens=3,
        ref_logprobs=ref,
        kl_coef=0.1,
        kl_estimator=estimator,
    )
    np.testing.assert_allclose(aux["kl_ref"], float(jnp.mean(value)), rtol=1e-6)


def test_the_k3_term_keeps_an_exact_gradient_where_the_reference_is_far_more_likely():
    # pi = e^-30, pi_ref = e^-1: exp(ref - logp) ~ 4e12 would swamp float32 in r * k3.
    logp, ref = jnp.array([[-30.0]]), jnp.array([[-1.0]])
    grad = jax.grad(
        lambda lp: kl_penalty(lp, ref, lp - 0.0, jnp.ones((1, 1)), estimator="k3")[0, 0]
    )(logp)
    np.testing.assert_allclose(grad, [[-29.0]], rtol=1e-6)  # r (log pi - log pi_ref), r = 1


def test_masked_junk_gives_a_zero_term_and_zero_gradient():
    logp = jnp.array([[-1.0, jnp.nan]])
    ref = jnp.array([[-0.5, jnp.inf]])
    anchor = jnp.array([[-1.2, -jnp.inf]])
    mask = jnp.array([[1.0, 0.0]])
    for estimator in ACCEPTED:
        term, grad = jax.value_and_grad(
            lambda lp: jnp.sum(kl_penalty(lp, ref, anchor, mask, estimator=estimator))
        )(logp)
        assert np.isfinite(term) and np.all(np.isfinite(grad)) and grad[0, 1] == 0.0


@pytest.mark.slow
def test_the_update_weights_the_kl_term_to_the_behaviour_policy_under_decoupled_ppo():
    """With zero advantages only the KL penalty moves the policy. Its ratio goes to the
    behaviour policy token by token whichever way the update anchors the clip: plain PPO
    (anchor = behaviour) and decoupled PPO (anchor = the learner at the batch's start,
    times the token-level weight pi_prox / pi_behav; also at sequence_tis, whose
    surrogate weight is a sequence's) make the same update."""
    from raytunix.learner.batch import Batch
    from raytunix.learner.train_state import (
        RLHyperparams,
        create_train_state,
        logprobs_fn,
        make_policy_update,
        make_optimizer,
    )
    from raytunix.models.llama import ModelConfig, init_model
    from raytunix.rollout.batch import record_batch_to_arrays, trajectories_to_record_batch
    from raytunix.types import EpisodeStatus, Trajectory

    config = ModelConfig(
        vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
    )
    graphdef, params = init_model(config, seed=0)
    _, ref_params = init_model(config, seed=1)  # a reference the policy is far from
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    rows = [
        Trajectory(
            task_id=g,
            group_id=g,
            token_ids=[1 + i, 2, 3 + i, 5, 7],
            loss_mask=[0, 0, 1, 1, 1],
            logprobs=[0.0] * 5,
            policy_versions=[-1, -1, 0, 0, 0],
            reward=1.0,
            status=EpisodeStatus.COMPLETED,
            num_turns=1,
        )
        for i, g in enumerate("aabb")
    ]
    batch = Batch.from_arrays(
        record_batch_to_arrays(trajectories_to_record_batch(rows), pad_to_multiple=8)
    )
    own = np.asarray(logprobs_fn(graphdef, **sampling)(params, batch.tokens, batch.loss_mask))
    stale = np.array([-0.1, 0.05, -0.2, 0.15] * (own.shape[1] // 4 + 1))[: own.shape[1]]
    batch = batch._replace(  # pi_prox / pi_behav < 2, the cap
        logprobs=(own + stale * batch.loss_mask).astype(np.float32)
    )
    optimizer = make_optimizer(1e-2, optimizer="sgd", max_grad_norm=None)
    results = {}
    for correction, level in [
        ("none", "token_tis"),
        ("decoupled_ppo", "token_tis"),
        ("decoupled_ppo", "sequence_tis"),
    ]:
        hp = RLHyperparams(
            **sampling, kl_coef=0.5, off_policy_correction=correction, importance_sampling=level
        )
        update = make_policy_update(graphdef, optimizer, hp, max_seq_len=config.max_seq_len)
        state, metrics = update(
            create_train_state(graphdef, params, optimizer, seed=0), ref_params, batch
        )
        assert float(metrics["kl_ref"]) > 0.01 and float(metrics["update_skipped"]) == 0.0
        results[correction, level] = jax.tree.leaves(state.params)
    plain = results["none", "token_tis"]
    for key, leaves in results.items():
        for a, b in zip(leaves, plain, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
