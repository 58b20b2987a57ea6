"""The batch packer: finished groups in, the learner's Arrow record batches out, in order.

A group whose episodes are done is offered to ``BatchPacker.offer``, which filters what
teaches nothing (dynamic sampling, ``drop_failed_groups``) and zeroes the loss of failed
members; every ``groups_per_batch`` kept groups are packed (``pack_ready``) into one record
batch, stored with ``put`` and queued for the learner, after the staleness rule below.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable, Sequence, get_args

import numpy as np

from raytunix import profiling
from raytunix.config import StaleTokenPolicy
from raytunix.rollout.admission import GroupAdmission
from raytunix.rollout.batch import trajectories_to_record_batch
from raytunix.rollout.faults import RateLimitedLog
from raytunix.rollout.recorder import EpisodeRecorder
from raytunix.samples import batch_samples
from raytunix.types import (
    TOOL_ERRORS_KEY,
    EpisodeStatus,
    ToolErrorKind,
    Trajectory,
    is_infrastructure_failure,
)

logger = logging.getLogger(__name__)

STALE_TOKEN_POLICIES: tuple[str, ...] = get_args(StaleTokenPolicy)  # rollout.stale_token_policy


class BatchPacker:
    """Packs finished groups into batches for the learner, in task order, after the
    staleness rule and the filters.

    Owns: the finished groups waiting for a batch, the count of batches formed, which task
    indices each batch holds (until ``take_members``), the stale-token policy, the
    ``drop_failed_groups`` rule and dynamic sampling with its cap.

    Args:
      stale_token_policy: what packing does with a group holding generated tokens older
        than ``consume_version - max_staleness``: ``"drop"`` the group
        (``groups_filtered_stale``), ``"mask"`` those tokens out of the loss
        (``stale_tokens_masked``; a group left with no token to train on is dropped), or
        ``"accept"`` them (``stale_tokens_accepted``).
      drop_failed_groups: filter a group with a member failed by infrastructure
        (``groups_filtered_failed_episode``) instead of training on its valid members.
      dynamic_sampling: filter groups whose valid members' rewards are all equal (DAPO).
      dynamic_sampling_max_filtered: at most this many groups are filtered while one batch
        fills; past it a zero-variance group is kept (``groups_kept_zero_variance``, a
        warning), so a run whose every group is degenerate trains on instead of sampling
        forever. 0 means ``4 * groups_per_batch``.
      samples_per_step, seed: episodes of each batch put in its info's ``samples`` for the
        sample log (``raytunix.samples``), chosen by ``seed``; 0 = none.
      put: stores a record batch and returns a handle for the learner (``ray.put`` in an
        actor; identity in tests).
      admission: where the packer's filtered groups are settled, and the owner of
        ``groups_per_batch``, ``max_staleness`` and ``v0``, the version at start.
      recorder: where counts and dropped tokens go.

    Packing rule: batch k (counted from 0 since start) is consumed at version ``v0 + k``;
    a group whose oldest generated token is older than ``v0 + k - max_staleness`` is
    dropped, masked or accepted (``stale_token_policy``).

    Raises:
      ValueError: an unknown ``stale_token_policy``.
    """

    def __init__(
        self,
        *,
        stale_token_policy: str,
        drop_failed_groups: bool,
        dynamic_sampling: bool,
        dynamic_sampling_max_filtered: int,
        samples_per_step: int,
        seed: int,
        put: Callable[[Any], Any],
        admission: GroupAdmission,
        recorder: EpisodeRecorder,
    ):
        if stale_token_policy not in STALE_TOKEN_POLICIES:
            raise ValueError(
                f"stale_token_policy={stale_token_policy!r} is not one of "
                f"{', '.join(STALE_TOKEN_POLICIES)}."
            )
        self.stale_token_policy = stale_token_policy
        self.drop_failed_groups = drop_failed_groups
        self.dynamic_sampling = dynamic_sampling
        self.dynamic_sampling_max_filtered = (
            dynamic_sampling_max_filtered or 4 * admission.groups_per_batch
        )
        self.samples_per_step = samples_per_step
        self.seed = seed
        self._put = put
        self._admission = admission
        self._recorder = recorder
        self._log = RateLimitedLog(logger)
        self.batches_formed = 0
        self._finished: list[tuple[int, list[Trajectory]]] = []
        self._batch_members: dict[int, list[int]] = {}  # batch id -> task indices
        self._zero_variance_batch = 0  # the batch being filled when the count below began
        self._zero_variance_filtered = 0

    def offer(self, index: int, trajectories: list[Trajectory]) -> bool:
        """A finished group of task ``index`` with at least one valid member. Returns
        whether it waits for a batch (``pack_ready``); if not, it was filtered (dynamic
        sampling, ``drop_failed_groups``). A kept group's failed members keep their place
        with a zero loss mask: the group's shape stays, the failed member teaches nothing."""
        infra_failed = [t for t in trajectories if is_infrastructure_failure(t.status)]
        if self.dynamic_sampling and self._filter_zero_variance(index, trajectories):
            return False
        if infra_failed and self.drop_failed_groups:
            self._recorder.count_dropped("failed_group_dropped", trajectories)
            self._admission.filter(index, "failed_episode")
            return False
        for t in infra_failed:
            self._recorder.count_dropped(f"failed_{t.status.value}", [t])
            t.loss_mask = [0] * len(t.loss_mask)
        self._finished.append((index, list(trajectories)))
        return True

    def _filter_zero_variance(self, index: int, trajectories: list[Trajectory]) -> bool:
        """Dynamic sampling (DAPO: Yu et al. 2025, arXiv:2503.14476, section 3.2): when the
        group's valid members all got the same reward, every advantage is 0 and the group
        teaches nothing; it is filtered (counted ``groups_filtered_zero_variance``) and
        admission starts another task in its place. Returns whether it was filtered.

        Bounded: past ``dynamic_sampling_max_filtered`` filtered groups while one batch
        fills, the group is kept and counted ``groups_kept_zero_variance``, with a warning."""
        rewards = [t.reward for t in trajectories if not is_infrastructure_failure(t.status)]
        if max(rewards) != min(rewards):
            return False
        if self._zero_variance_batch != self.batches_formed:  # a new batch is filling
            self._zero_variance_batch, self._zero_variance_filtered = self.batches_formed, 0
        if self._zero_variance_filtered >= self.dynamic_sampling_max_filtered:
            self._recorder.counters["groups_kept_zero_variance"] += 1
            self._log.log(
                logging.WARNING,
                "dynamic_sampling_cap",
                "dynamic sampling: %d groups filtered while batch %d fills, all with "
                "equal rewards (last: %r); past dynamic_sampling_max_filtered such "
                "groups are kept (zero advantage) until the batch forms. Rewards that "
                "never differ within a group mean the tasks are too easy or too hard "
                "for the policy, or the reward is broken.",
                self._zero_variance_filtered,
                self.batches_formed,
                rewards[0],
            )
            return False
        self._zero_variance_filtered += 1
        self._recorder.count_dropped("zero_variance", trajectories)
        self._admission.filter(index, "zero_variance")
        return True

    def sampling_info(self) -> dict[str, int]:
        """Dynamic sampling's counts for a batch's info (none when it is off)."""
        if not self.dynamic_sampling:
            return {}
        counters = self._recorder.counters
        return {
            "groups_filtered_zero_variance": counters["groups_filtered_zero_variance"],
            "groups_kept_zero_variance": counters["groups_kept_zero_variance"],
        }

    async def pack_ready(self, queue: asyncio.Queue) -> None:
        """Packs every full batch the finished groups make and puts ``(handle, info)`` of
        each on ``queue`` (waiting while it is full). One caller at a time: batch k must
        reach the learner k-th (it is checked against version ``v0 + k``)."""
        groups_per_batch = self._admission.groups_per_batch
        while len(self._finished) >= groups_per_batch:
            consume_version = self._admission.version0 + self.batches_formed
            oldest_allowed = consume_version - self._admission.max_staleness
            fresh = []
            for index, group in self._finished:
                if self._apply_stale_token_policy(group, oldest_allowed):
                    fresh.append((index, group))
                else:
                    self._recorder.count_dropped("stale_group", group)
                    self._admission.filter(index, "stale")
            self._finished = fresh
            if len(fresh) < groups_per_batch:
                return
            chosen, self._finished = fresh[:groups_per_batch], fresh[groups_per_batch:]
            chosen.sort(key=lambda item: item[0])  # task order: timing must not reorder rows
            batch_id = self.batches_formed
            self.batches_formed += 1
            trajectories = [t for _, group in chosen for t in group]
            if self.stale_token_policy == "accept":
                for t in trajectories:  # counted once, in the batch that trains on them
                    t.metrics["stale_tokens_accepted"] = float(_count_stale(t, oldest_allowed))
                    self._recorder.counters["stale_tokens_accepted"] += int(
                        t.metrics["stale_tokens_accepted"]
                    )
            self._batch_members[batch_id] = [index for index, _ in chosen]
            with profiling.span(
                "batch_pack", "batches", {"batch_id": batch_id, "trajectories": len(trajectories)}
            ):
                record_batch = trajectories_to_record_batch(trajectories)
                info = batch_info(
                    batch_id,
                    consume_version,
                    [g for _, g in chosen],
                    self.samples_per_step,
                    self.seed,
                )
            with profiling.span(
                "object_store_put", "batches", {"batch_id": batch_id, "bytes": record_batch.nbytes}
            ):
                handle = self._put(record_batch)
            await queue.put((handle, info))

    def _apply_stale_token_policy(self, group: list[Trajectory], oldest_allowed: int) -> bool:
        """False if the group must be dropped as stale; under ``"mask"``, zeroes the loss
        mask of its tokens older than ``oldest_allowed`` first (a group left with nothing
        to train on is dropped too). ``"accept"`` keeps everything (counted when packed)."""
        stale = sum(_count_stale(t, oldest_allowed) for t in group)
        if not stale or self.stale_token_policy == "accept":
            return True
        if self.stale_token_policy == "drop":
            return False
        self._recorder.count_dropped_tokens("stale_masked", stale)
        for t in group:
            masked = _count_stale(t, oldest_allowed)
            if masked:
                t.loss_mask = [
                    0 if m and v < oldest_allowed else m
                    for v, m in zip(t.policy_versions, t.loss_mask)
                ]
                t.metrics["stale_tokens_masked"] = (
                    t.metrics.get("stale_tokens_masked", 0.0) + masked
                )
        self._recorder.counters["stale_tokens_masked"] += stale
        return any(any(t.loss_mask) for t in group)

    def take_members(self, batch_id: int) -> list[int]:
        """The task indices of batch ``batch_id``, once (the learner trained on it)."""
        return self._batch_members.pop(batch_id, [])


def batch_info(
    batch_id: int,
    consume_version: int,
    groups: list[list[Trajectory]],
    samples_per_step: int = 0,
    seed: int = 0,
) -> dict:
    """The numbers of one batch (``next_batch``'s info before the orchestrator adds its
    own), and under ``samples`` its ``samples_per_step`` episodes for the sample log
    (``raytunix.samples.batch_samples``, chosen by ``seed`` and ``consume_version``)."""
    trajectories = [t for group in groups for t in group]
    statuses = collections.Counter(t.status.value for t in trajectories)
    infra_failed = sum(is_infrastructure_failure(t.status) for t in trajectories)
    staleness = [
        consume_version - v
        for t in trajectories
        for v, m in zip(t.policy_versions, t.loss_mask)
        if m
    ]
    used_tool = [t.metrics.get("tool_calls", 0) > 0 for t in trajectories]
    return {
        "batch_id": batch_id,
        "consume_version": consume_version,
        "num_trajectories": len(trajectories),
        **learning_signal_metrics(groups),
        "tool_use_rate": float(np.mean(used_tool)),
        "turns_mean": float(np.mean([t.num_turns for t in trajectories])),
        "generated_tokens_mean": float(
            np.mean([t.metrics.get("generated_tokens", 0.0) for t in trajectories])
        ),
        "episode_generate_s_mean": float(
            np.mean([t.metrics.get("generate_s", 0.0) for t in trajectories])
        ),
        "episode_env_s_mean": float(np.mean([t.metrics.get("env_s", 0.0) for t in trajectories])),
        "staleness_min": int(min(staleness, default=0)),
        "staleness_max": int(max(staleness, default=0)),
        "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
        "stale_tokens_masked": int(
            sum(t.metrics.get("stale_tokens_masked", 0) for t in trajectories)
        ),
        "stale_tokens_accepted": int(
            sum(t.metrics.get("stale_tokens_accepted", 0) for t in trajectories)
        ),
        "valid_trajectories": len(trajectories) - infra_failed,
        "trainable_tokens": int(sum(sum(t.loss_mask) for t in trajectories)),  # loss mask 1
        "tool_errors_mean": float(
            np.mean([t.metrics.get(TOOL_ERRORS_KEY, 0.0) for t in trajectories])
        ),
        "statuses": dict(statuses),
        "samples": batch_samples(trajectories, samples_per_step, (seed << 32) + consume_version),
    }


def rewards_all_equal(group: Sequence[Trajectory]) -> bool:
    """Whether the valid members of ``group`` (those not ended by an infrastructure
    failure) all got the same reward: then every group-relative advantage is 0 (GRPO,
    RLOO) and the group gives no policy gradient. True for a group with no valid member."""
    rewards = [t.reward for t in group if not is_infrastructure_failure(t.status)]
    return not rewards or max(rewards) == min(rewards)


def learning_signal_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    """The learning signal of one batch (``raytunix.profiling.learning`` judges it).

    Returns (floats; shares in [0, 1], 0.0 for an empty batch):
      ``reward_mean``: mean episode reward over the batch's trajectories.
      ``zero_variance_group_fraction``: share of groups whose rewards were all equal
        (``rewards_all_equal``).
      ``format_error_fraction``: share of trajectories with at least one
        ``ToolErrorKind.FORMAT`` error (a turn with no call and no answer, both, or several).
      ``tool_error_fraction``: share with at least one tool error of any kind (format,
        malformed or failing tool calls: ``TOOL_ERRORS_KEY``).
      ``truncated_fraction``: share that ended ``truncated`` (turns, tokens or context ran out).
    """
    trajectories = [t for group in groups for t in group]
    n = max(len(trajectories), 1)
    format_key = f"{TOOL_ERRORS_KEY}/{ToolErrorKind.FORMAT.value}"
    return {
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "zero_variance_group_fraction": (
            sum(map(rewards_all_equal, groups)) / len(groups) if groups else 0.0
        ),
        "format_error_fraction": sum(t.metrics.get(format_key, 0) > 0 for t in trajectories) / n,
        "tool_error_fraction": sum(t.metrics.get(TOOL_ERRORS_KEY, 0) > 0 for t in trajectories) / n,
        "truncated_fraction": sum(t.status == EpisodeStatus.TRUNCATED for t in trajectories) / n,
    }


def _count_stale(t: Trajectory, oldest_allowed: int) -> int:
    """Loss-mask tokens of ``t`` generated by a version older than ``oldest_allowed``."""
    return sum(1 for v, m in zip(t.policy_versions, t.loss_mask) if m and v < oldest_allowed)
