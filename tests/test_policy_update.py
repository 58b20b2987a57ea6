"""The policy update's pieces (``raytunix.learner.train_state``), each on its own: rewards,
targets and advantages, micro-batches, the policy and value loss terms, gradient
accumulation, the optimizer apply and the non-finite guard. The composed update is
checked end to end by test_train_state, test_gae, test_off_policy, test_kl_gradients,
test_sequence_packing and test_nonfinite_updates."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from raytunix.learner.advantages import (
    gae_advantages,
    grpo_advantages,
    last_token_rewards,
    overlong_penalty,
)
from raytunix.learner.batch import Batch, PackedBatch, widest_packed_row
from raytunix.learner.losses import clipped_value_loss, policy_gradient_loss, loss_normalizer
from raytunix.learner.train_state import (
    NONFINITE_PARTS,
    RLHyperparams,
    TrainState,
    accumulate_gradients,
    add_value_head,
    apply_policy_gradients,
    create_train_state,
    episode_advantage_targets,
    gae_targets,
    iterate_and_guard,
    keep_if_finite,
    micro_batch_loss,
    micro_batches,
    packed_sequence_index,
    policy_loss_terms,
    shaped_rewards,
    split_micro_batches,
    start_values,
    step_metrics,
    value_estimates,
    value_loss_terms,
)
from raytunix.models.llama import ModelConfig, init_model
from raytunix.rollout.batch import trajectories_to_record_batch
from raytunix.types import EpisodeStatus, Trajectory

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
TINY = ModelConfig(
    vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16
)


def _trajectory(group, prompt, completion, reward):
    return Trajectory(
        task_id=group,
        group_id=group,
        token_ids=prompt + completion,
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        logprobs=[0.0] * len(prompt) + [-2.0 - 0.1 * i for i in range(len(completion))],
        policy_versions=[-1] * len(prompt) + [0] * len(completion),
        reward=reward,
        status=EpisodeStatus.COMPLETED,
        num_turns=1,
    )


def _record_batch():
    return trajectories_to_record_batch(
        [
            _trajectory("a", [1, 2], [5, 6, 7], 1.0),
            _trajectory("a", [1, 2], [8, 9], 0.0),
            _trajectory("b", [3], [4, 4, 4, 4, 4], 0.5),
            _trajectory("b", [3], [10], -0.5),
        ]
    )


# The last trajectory marked failed (``valid`` 0) with its tokens kept, so a test sees
# that the pieces themselves leave it out.
FAILED_LAST = np.array([1, 1, 1, 0], np.float32)


def _padded(invalid_last=False):
    batch = Batch.from_record_batch(_record_batch(), pad_id=0, max_seq_len=TINY.max_seq_len)
    return batch._replace(valid=FAILED_LAST) if invalid_last else batch


def _packed(invalid_last=False):
    batch = PackedBatch.from_record_batch(_record_batch(), pad_id=0, max_seq_len=TINY.max_seq_len)
    return batch._replace(valid=FAILED_LAST) if invalid_last else batch


@pytest.fixture(scope="module")
def model():
    return init_model(TINY, seed=0)


# ------------------------------------------------------------------------ rewards
def test_shaped_rewards_without_a_buffer_are_the_batch_rewards():
    batch = _padded()
    rewards, metrics = shaped_rewards(batch, RLHyperparams(**SAMPLING), jnp.float32(4))
    np.testing.assert_array_equal(rewards, batch.rewards)
    assert metrics == {}


@pytest.mark.parametrize("make", [_padded, _packed], ids=["padded", "packed"])
def test_shaped_rewards_add_the_overlong_penalty_of_each_generated_length(make):
    batch = make()
    hp = RLHyperparams(**SAMPLING, overlong_buffer_tokens=2, overlong_max_tokens=5)
    rewards, metrics = shaped_rewards(batch, hp, jnp.float32(4))
    lengths = np.array([3, 2, 5, 1])  # generated tokens, as the trajectories above
    penalty = np.asarray(overlong_penalty(lengths, max_tokens=5, buffer_tokens=2))
    assert penalty[2] < 0 and penalty[0] == 0  # the test sees a penalty and its absence
    np.testing.assert_allclose(rewards, np.asarray(batch.rewards) + penalty, rtol=1e-6)
    np.testing.assert_allclose(metrics["overlong_penalty_mean"], penalty.mean(), rtol=1e-6)


def test_shaped_rewards_average_the_penalty_over_real_rows_only():
    batch = _padded().pad_rows(8)  # four padding rows, no tokens
    hp = RLHyperparams(**SAMPLING, overlong_buffer_tokens=2, overlong_max_tokens=5)
    _, metrics = shaped_rewards(batch, hp, jnp.float32(4))
    penalty = np.asarray(overlong_penalty(np.array([3, 2, 5, 1]), max_tokens=5, buffer_tokens=2))
    np.testing.assert_allclose(metrics["overlong_penalty_mean"], penalty.sum() / 4, rtol=1e-6)


# ------------------------------------------------------------ targets and advantages
def test_split_micro_batches_keeps_row_order():
    tree = {"a": jnp.arange(12).reshape(6, 2), "b": jnp.arange(6)}
    split = split_micro_batches(tree, 2)
    assert split["a"].shape == (3, 2, 2) and split["b"].shape == (3, 2)
    np.testing.assert_array_equal(split["a"][1], [[4, 5], [6, 7]])
    np.testing.assert_array_equal(split["b"][2], [4, 5])


def test_episode_advantage_targets_are_grpo_per_trajectory_and_gathered_when_packed():
    hp = RLHyperparams(**SAMPLING)
    padded, packed = _padded(invalid_last=True), _packed(invalid_last=True)
    targets, metrics = episode_advantage_targets(padded, padded.rewards, hp, jnp.float32(4))
    want = np.asarray(
        grpo_advantages(
            padded.rewards,
            padded.group_ids,
            4,
            valid=padded.valid,
            normalize_advantages_by_std=True,
        )
    )
    np.testing.assert_allclose(targets["advantages"], want, rtol=1e-6)
    np.testing.assert_allclose(metrics["advantage_abs_mean"], np.abs(want).mean(), rtol=1e-6)
    gathered, _ = episode_advantage_targets(packed, packed.rewards, hp, jnp.float32(4))
    index = np.asarray(packed.trajectory_index)[:, 1:]
    np.testing.assert_allclose(gathered["advantages"], want[index], rtol=1e-6)


@pytest.mark.slow
def test_start_values_are_the_value_head_on_the_hidden_state_whatever_the_micro_batch(model):
    from raytunix.learner.train_state import _next_token_logits

    graphdef, params = model
    head = {
        "kernel": jnp.linspace(-1.0, 1.0, TINY.d_model)[:, None].astype(jnp.float32),
        "bias": jnp.array([0.25], jnp.float32),
    }
    batch = _padded()
    whole = start_values(graphdef, params, head, {"tokens": batch.tokens}, rows=4)
    halves = start_values(graphdef, params, head, {"tokens": batch.tokens}, rows=2)
    _, hidden = _next_token_logits(graphdef, params, batch.tokens, with_hidden=True)
    want = value_estimates(head, hidden)
    assert whole.shape == (4, batch.tokens.shape[1] - 1)
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(halves, want, rtol=1e-5, atol=1e-6)


def test_gae_targets_leave_failed_trajectories_out_and_match_the_estimator():
    batch = _padded(invalid_last=True)
    hp = RLHyperparams(
        **SAMPLING, advantage_estimator="gae", gae_gamma=0.9, gae_lambda=0.8, gae_normalize=False
    )
    values = jnp.asarray(
        np.random.default_rng(0).normal(size=(4, batch.tokens.shape[1] - 1)).astype(np.float32)
    )
    targets, metrics = gae_targets(batch, batch.rewards, values, hp)
    generated = np.asarray(batch.loss_mask)[:, 1:]
    mask = generated * np.array([1, 1, 1, 0], np.float32)[:, None]
    np.testing.assert_array_equal(targets["value_mask"], mask)
    adv, ret = gae_advantages(
        last_token_rewards(batch.rewards, mask), values, mask, gamma=0.9, lam=0.8
    )
    np.testing.assert_allclose(targets["advantages"], adv, rtol=1e-6)
    np.testing.assert_allclose(targets["returns"], ret, rtol=1e-6)
    assert not np.any(np.asarray(targets["advantages"])[3])  # the failed one trains nothing
    on = mask > 0
    np.testing.assert_allclose(metrics["return_mean"], np.asarray(ret)[on].mean(), rtol=1e-5)


def test_gae_targets_whiten_the_advantages_when_asked():
    batch = _padded()
    hp = RLHyperparams(**SAMPLING, advantage_estimator="gae", gae_normalize=True)
    values = jnp.zeros((4, batch.tokens.shape[1] - 1), jnp.float32)
    targets, _ = gae_targets(batch, batch.rewards, values, hp)
    on = np.asarray(targets["value_mask"]) > 0
    adv = np.asarray(targets["advantages"])[on]
    np.testing.assert_allclose([adv.mean(), adv.std()], [0.0, 1.0], atol=1e-5)


def test_micro_batches_split_every_input_and_keep_the_whole_batch_normaliser(model):
    graphdef, params = model
    state = create_train_state(graphdef, params, optax.sgd(0.1), seed=0)
    batch = jax.tree.map(jnp.asarray, _padded())
    hp = RLHyperparams(**SAMPLING, micro_batch_size=2, loss_aggregation="sequence_mean_token_mean")
    mbs, denominator, metrics = micro_batches(
        graphdef, state, batch, hp, jnp.float32(4), max_seq_len=TINY.max_seq_len
    )
    assert set(mbs) == {"tokens", "generated", "old", "weights", "advantages"}
    assert mbs["tokens"].shape == (2, 2, batch.tokens.shape[1])
    assert mbs["advantages"].shape == (2, 2)
    weights, want = loss_normalizer(
        batch.loss_mask[:, 1:], aggregation=hp.loss_aggregation, max_tokens=TINY.max_seq_len
    )
    np.testing.assert_allclose(denominator, want)
    np.testing.assert_allclose(mbs["weights"].reshape(weights.shape), weights)
    assert "advantage_abs_mean" in metrics


def test_packed_sequence_index_gives_every_row_and_segment_its_own_index():
    seg = jnp.array([[1, 1, 2, 2, 0], [1, 1, 1, 0, 0]])
    out = packed_sequence_index(seg)
    index = np.asarray(out["sequence_index"])
    pairs = {(r, int(s)): set() for r in range(2) for s in np.asarray(seg[r])}
    for r in range(2):
        for t in range(5):
            pairs[(r, int(seg[r, t]))].add(int(index[r, t]))
    assert all(len(v) == 1 for v in pairs.values())  # one index per (row, segment)
    assert len({next(iter(v)) for v in pairs.values()}) == len(pairs)  # and no two share
    assert index.max() < out["num_sequences"]


# ----------------------------------------------------------------------- the losses
def _loss_inputs(seed=0, rows=2, width=6):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(rows, width, TINY.vocab_size)).astype(np.float32))
    logprobs = jax.nn.log_softmax(logits)[..., 3]
    generated = jnp.asarray(np.array([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], np.float32))
    old = jnp.where(generated > 0, logprobs + 0.1, 0.0)
    weights, denominator = loss_normalizer(generated, aggregation="token_mean", max_tokens=8)
    mb = {
        "generated": generated,
        "old": old,
        "weights": weights,
        "advantages": jnp.array([1.0, -0.5]),
    }
    return logprobs, logits, mb, denominator


def test_policy_loss_terms_are_the_policy_loss_with_token_sums():
    logprobs, logits, mb, denominator = _loss_inputs()
    hp = RLHyperparams(**SAMPLING)
    loss, sums, (prox, support) = policy_loss_terms(
        logprobs, logits, None, mb, denominator, None, hp, max_seq_len=8, seqs={}
    )
    want, aux = policy_gradient_loss(
        logprobs,
        mb["old"],
        mb["advantages"],
        mb["generated"],
        policy_loss="ppo_clip",
        clip_eps_low=hp.clip_eps_low,
        clip_eps_high=hp.clip_eps_high,
        dual_clip=0.0,
        aggregation="token_mean",
        max_tokens=8,
        normalizer=(mb["weights"], denominator),
    )
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert float(sums["num_tokens"]) == 7.0 == float(sums["generated"])
    np.testing.assert_allclose(sums["clip_fraction"], aux["clip_fraction"] * 7, rtol=1e-6)
    np.testing.assert_array_equal(prox, logprobs)
    assert bool(jnp.all(support))


def test_policy_loss_terms_drop_out_of_support_tokens_and_count_them():
    logprobs, logits, mb, denominator = _loss_inputs()
    logprobs = logprobs.at[0, 2].set(-jnp.inf)  # truncated away by the current policy
    _, sums, (prox, support) = policy_loss_terms(
        logprobs,
        logits,
        None,
        mb,
        denominator,
        None,
        RLHyperparams(**SAMPLING),
        max_seq_len=8,
        seqs={},
    )
    assert float(sums["out_of_support"]) == 1.0 and float(sums["num_tokens"]) == 6.0
    assert not bool(support[0, 2]) and float(prox[0, 2]) == 0.0


def test_policy_loss_terms_anchor_later_iterations_at_the_first_proximal_policy():
    logprobs, logits, mb, denominator = _loss_inputs()
    hp = RLHyperparams(**SAMPLING, off_policy_correction="decoupled_ppo")
    _, _, anchor = policy_loss_terms(
        logprobs, logits, None, mb, denominator, None, hp, max_seq_len=8, seqs={}
    )
    moved = logprobs + 0.05
    _, sums, (prox, _) = policy_loss_terms(
        moved, logits, None, mb, denominator, anchor, hp, max_seq_len=8, seqs={}
    )
    np.testing.assert_array_equal(prox, anchor[0])  # not the moved policy's
    assert float(sums["importance_weight_mean"]) > 0


def test_value_loss_terms_are_the_clipped_value_loss_with_token_sums():
    rng = np.random.default_rng(1)
    mask = jnp.asarray(np.array([[0, 1, 1, 0], [1, 1, 0, 0]], np.float32))
    values, old, returns = (
        jnp.asarray(rng.normal(size=(2, 4)).astype(np.float32)) for _ in range(3)
    )
    weights, denominator = loss_normalizer(mask, aggregation="token_mean", max_tokens=4)
    mb = {"old_values": old, "returns": returns, "value_mask": mask, "weights": weights}
    hp = RLHyperparams(**SAMPLING, value_clip=0.2)
    loss, sums = value_loss_terms(values, mb, denominator, hp)
    want, clipped = clipped_value_loss(
        values, old, returns, mask, value_clip=0.2, normalizer=(weights, denominator)
    )
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert float(sums["value_tokens"]) == 4.0
    assert float(sums["value_clip_fraction"]) == float(np.sum(clipped))
    np.testing.assert_allclose(
        sums["value_mean"], np.asarray(values)[np.asarray(mask) > 0].sum(), rtol=1e-6
    )


def _gae_state(model, optimizer):
    graphdef, params = model
    state = create_train_state(graphdef, params, optimizer, seed=0)
    state = add_value_head(state, optimizer, TINY.d_model)
    head = {
        "kernel": jnp.full((TINY.d_model, 1), 0.01, jnp.float32),
        "bias": jnp.array([0.3], jnp.float32),
    }
    return state.replace(value_head=head, value_opt_state=optimizer.init(head))


def _mbs(model, state, hp, batch=None):
    graphdef, _ = model
    batch = jax.tree.map(jnp.asarray, batch if batch is not None else _padded())
    return micro_batches(graphdef, state, batch, hp, jnp.float32(4), max_seq_len=TINY.max_seq_len)


def test_micro_batch_loss_adds_value_coef_times_the_value_loss(model):
    graphdef, _ = model
    optimizer = optax.sgd(0.1)
    state = _gae_state(model, optimizer)
    losses = {}
    for coef in (0.5, 2.0):
        hp = RLHyperparams(**SAMPLING, advantage_estimator="gae", value_coef=coef)
        mbs, denominator, _ = _mbs(model, state, hp)
        mb = jax.tree.map(lambda x: x[0], mbs)
        losses[coef], (sums, _, _) = micro_batch_loss(
            (state.params, state.value_head),
            None,
            mb,
            denominator,
            None,
            graphdef=graphdef,
            hp=hp,
            max_seq_len=TINY.max_seq_len,
        )
    # The policy part is the same; the difference is 1.5 value losses.
    np.testing.assert_allclose(losses[2.0] - losses[0.5], 1.5 * sums["value_loss"], rtol=1e-5)
    assert float(sums["value_loss"]) > 0


@pytest.mark.slow
def test_accumulated_gradients_of_micro_batches_equal_the_whole_batchs(model):
    graphdef, _ = model
    state = create_train_state(*model, optax.sgd(0.1), seed=0)
    results = {}
    for rows in (0, 2):
        hp = RLHyperparams(**SAMPLING, micro_batch_size=rows, kl_coef=0.0)
        mbs, denominator, _ = _mbs(model, state, hp)
        grad_fn = jax.grad(
            functools.partial(
                micro_batch_loss, graphdef=graphdef, hp=hp, max_seq_len=TINY.max_seq_len
            ),
            has_aux=True,
        )
        # Jitted as the update runs it; eagerly every op of forward and backward dispatches
        # on its own, several times the compile of the whole program.
        results[rows] = jax.jit(functools.partial(accumulate_gradients, grad_fn))(
            (state.params, None), None, mbs, denominator, None
        )
    (whole, _), whole_sums, whole_prox, _ = results[0]
    (split, _), split_sums, split_prox, _ = results[2]
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert optax.tree.norm(whole) > 0
    for key in ("loss", "num_tokens", "clip_fraction"):
        np.testing.assert_allclose(whole_sums[key], split_sums[key], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        whole_sums["mismatch_ratio_max"], split_sums["mismatch_ratio_max"], rtol=1e-6
    )
    assert split_prox.shape[:2] == (2, 2) and whole_prox.shape[:2] == (1, 4)
    np.testing.assert_allclose(split_prox.reshape(whole_prox.shape), whole_prox, rtol=1e-6)


# ------------------------------------------------------------------ apply and guard
def test_step_metrics_are_token_means_and_norms():
    sums = {
        "loss": jnp.float32(2.0),
        "num_tokens": jnp.float32(4.0),
        "clip_fraction": jnp.float32(1.0),
        "generated": jnp.int32(5),
        "out_of_support": jnp.int32(1),
        "mismatch_ratio_max": jnp.float32(1.5),
    }
    grads = {"w": jnp.array([3.0, 4.0])}
    metrics = step_metrics(sums, grads, None)
    assert float(metrics["clip_fraction"]) == 0.25 and float(metrics["loss"]) == 2.0
    assert float(metrics["grad_norm"]) == 5.0
    assert float(metrics["out_of_support_fraction"]) == pytest.approx(0.2)
    assert "value_loss" not in metrics
    with_value = step_metrics(
        {
            **sums,
            "value_loss": jnp.float32(0.5),
            "value_clip_fraction": jnp.float32(1.0),
            "value_mean": jnp.float32(2.0),
            "value_tokens": jnp.float32(4.0),
        },
        grads,
        {"b": jnp.array([0.0, 2.0])},
    )
    assert float(with_value["value_mean"]) == 0.5 and float(with_value["value_grad_norm"]) == 2.0
    assert "value_tokens" not in with_value


def _toy_state(optimizer, value=False):
    params = {"w": jnp.array([1.0, -2.0])}
    state = TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        rng=jnp.zeros((2,), jnp.uint32),
    )
    if value:
        head = {"b": jnp.array([0.5])}
        state = state.replace(value_head=head, value_opt_state=optimizer.init(head))
    return state


def test_apply_policy_gradients_steps_the_policy_and_the_value_head():
    optimizer = optax.sgd(0.5)
    state = _toy_state(optimizer, value=True)
    new, finite = apply_policy_gradients(
        optimizer, state, {"w": jnp.array([2.0, 2.0])}, {"b": jnp.array([1.0])}
    )
    np.testing.assert_allclose(new.params["w"], [0.0, -3.0])
    np.testing.assert_allclose(new.value_head["b"], [0.0])
    assert int(new.step) == 1 and bool(finite)
    _, finite = apply_policy_gradients(optimizer, state, {"w": jnp.array([jnp.nan, 0.0])}, None)
    assert not bool(finite)


def test_keep_if_finite_returns_the_start_bit_for_bit_when_any_check_fails():
    optimizer = optax.adam(0.1)
    start = _toy_state(optimizer)
    new, _ = apply_policy_gradients(optimizer, start, {"w": jnp.array([1.0, 1.0])}, None)
    ok = {k: jnp.asarray(True) for k in NONFINITE_PARTS}
    kept, applied = keep_if_finite(ok, new, start)
    assert bool(applied) and int(kept.step) == 1
    for part in NONFINITE_PARTS:
        kept, applied = keep_if_finite({**ok, part: jnp.asarray(False)}, new, start)
        assert not bool(applied)
        for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(start), strict=True):
            np.testing.assert_array_equal(a, b)


def _sgd_step(optimizer, grads_by_call):
    """An optimizer step on the toy state whose gradient depends on whether it is anchored."""

    def step(state, anchors):
        grads = grads_by_call[0 if anchors is None else 1]
        new, finite = apply_policy_gradients(optimizer, state, grads, None)
        metrics = {
            "loss": jnp.sum(state.params["w"]),
            "clip_fraction": jnp.float32(0),
            "approx_kl": jnp.float32(0),
            "finite_loss": jnp.asarray(True),
            "finite_gradients": jnp.isfinite(optax.tree.norm(grads)),
            "finite_new_state": finite,
        }
        return new, metrics, (jnp.ones(2), jnp.ones(2, bool))

    return step


def test_iterate_and_guard_runs_every_iteration_and_reports_the_last():
    optimizer = optax.sgd(1.0)
    step = _sgd_step(optimizer, [{"w": jnp.array([1.0, 0.0])}, {"w": jnp.array([0.0, 1.0])}])
    state, metrics = iterate_and_guard(step, _toy_state(optimizer), 3)
    np.testing.assert_allclose(state.params["w"], [0.0, -4.0])  # one first, two anchored
    assert int(state.step) == 3
    np.testing.assert_allclose(metrics["loss"], -1.0)
    np.testing.assert_allclose(metrics["loss_last"], -3.0)  # the third step's start
    assert float(metrics["update_skipped"]) == 0.0 == float(metrics["nonfinite_gradients"])


def test_iterate_and_guard_drops_every_iteration_when_a_later_one_is_not_finite():
    optimizer = optax.sgd(1.0)
    step = _sgd_step(optimizer, [{"w": jnp.array([1.0, 0.0])}, {"w": jnp.array([jnp.inf, 0.0])}])
    start = _toy_state(optimizer)
    state, metrics = iterate_and_guard(jax.jit(step), start, 2)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(start), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(metrics["update_skipped"]) == 1.0 == float(metrics["update_nonfinite"])
    assert float(metrics["nonfinite_gradients"]) == 1.0
    assert float(metrics["nonfinite_loss"]) == 0.0


# -------------------------------------------------------------------- pack width
def test_widest_packed_row_is_the_pack_width_bounded_by_the_context():
    assert widest_packed_row(0, 64) == 64
    assert widest_packed_row(32, 64) == 32
    assert widest_packed_row(128, 64) == 64
    with pytest.raises(ValueError, match="pack_width=-1"):
        widest_packed_row(-1, 64)
