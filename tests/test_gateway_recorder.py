"""The gateway's recorder: an episode's calls become segments by the documented rule, and
segments become trajectories with the fields an agent's own trajectory has. Pure: no
engine, no server."""

import dataclasses

import pytest

from raytunix.gateway.recorder import (
    RecordedCall,
    RecordedChoice,
    episode_trajectories,
    segment_calls,
    segment_to_trajectory,
)
from raytunix.types import EpisodeStatus


def _choice(ids, version=0, reason="stop"):
    return RecordedChoice(
        token_ids=tuple(ids),
        logprobs=tuple(-0.5 - i for i in range(len(ids))),
        policy_versions=(version,) * len(ids),
        finish_reason=reason,
    )


def _call(index, prompt, *completions, version=0):
    return RecordedCall(
        index=index,
        endpoint="chat.completions",
        prompt_ids=tuple(prompt),
        choices=tuple(_choice(c, version) for c in completions),
    )


def test_calls_that_extend_one_another_are_one_segment_with_observations_masked():
    calls = [_call(0, [1, 2, 3], [10, 11]), _call(1, [1, 2, 3, 10, 11, 4, 5], [12], version=1)]
    [segment] = segment_calls(calls)
    assert segment.token_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert segment.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert segment.logprobs == [0.0, 0.0, 0.0, -0.5, -1.5, 0.0, 0.0, -0.5]
    assert segment.policy_versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert segment.calls == [(0, 0), (1, 0)] and segment.num_turns == 2


def test_a_call_with_rewritten_history_starts_a_second_segment():
    calls = [
        _call(0, [1, 2, 3], [10, 11]),
        _call(1, [1, 2, 3, 10, 11, 4], [12]),
        _call(2, [1, 2, 3, 9, 4], [13]),
    ]  # the first reply was summarised as [9]
    first, second = segment_calls(calls)
    assert first.token_ids == [1, 2, 3, 10, 11, 4, 12]
    assert second.token_ids == [1, 2, 3, 9, 4, 13]
    assert second.loss_mask == [0, 0, 0, 0, 0, 1]  # the rewritten history is context


def test_calls_are_taken_in_arrival_order_and_a_parallel_sibling_starts_its_own_segment():
    calls = [
        _call(2, [1, 2, 10, 5], [21]),  # recorded out of order
        _call(0, [1, 2], [10]),
        _call(1, [1, 2, 10, 4], [20]),
    ]
    first, second = segment_calls(calls)
    assert first.token_ids == [1, 2, 10, 4, 20]
    assert second.token_ids == [1, 2, 10, 5, 21] and second.loss_mask == [0, 0, 0, 0, 1]


def test_the_other_choices_of_an_n_call_start_segments_that_the_next_call_may_extend():
    calls = [
        _call(0, [1, 2], [10], [11]),
        _call(1, [1, 2, 11, 3], [12]),
    ]  # the program went on with choice 1
    first, second = segment_calls(calls)
    assert first.token_ids == [1, 2, 10] and first.calls == [(0, 0)]
    assert second.token_ids == [1, 2, 11, 3, 12] and second.calls == [(0, 1), (1, 0)]


def test_latest_rule_starts_a_new_segment_when_the_main_agent_resumes_after_a_sub_agent():
    calls = [
        _call(0, [1, 2], [10]),
        _call(1, [7, 8], [20]),  # a sub-agent with its own system prompt
        _call(2, [1, 2, 10, 3], [11]),
    ]  # the main agent goes on
    assert [s.token_ids for s in segment_calls(calls, extend="latest")] == [
        [1, 2, 10],
        [7, 8, 20],
        [1, 2, 10, 3, 11],
    ]
    assert [s.token_ids for s in segment_calls(calls, extend="any")] == [
        [1, 2, 10, 3, 11],
        [7, 8, 20],
    ]


def test_a_segment_becomes_a_trajectory_with_the_fields_an_agent_builds():
    [segment] = segment_calls([_call(0, [1, 2], [10, 11], version=3)])
    trajectory = segment_to_trajectory(segment, "t1", "g0", 1.5, "completed", {"env_s": 0.25})
    assert trajectory.token_ids == [1, 2, 10, 11] and trajectory.loss_mask == [0, 0, 1, 1]
    assert trajectory.logprobs == [0.0, 0.0, -0.5, -1.5]
    assert trajectory.policy_versions == [-1, -1, 3, 3]
    assert (trajectory.task_id, trajectory.group_id, trajectory.reward) == ("t1", "g0", 1.5)
    assert trajectory.status is EpisodeStatus.COMPLETED and trajectory.num_turns == 1
    assert trajectory.metrics == {"env_s": 0.25, "tool_calls": 0.0}
    trajectory.token_ids.append(99)  # a copy: the segment is unchanged
    assert segment.token_ids == [1, 2, 10, 11]


def test_every_segment_of_an_episode_shares_its_reward_and_status():
    calls = [_call(0, [1, 2], [10]), _call(1, [5], [11])]
    trajectories = episode_trajectories(calls, "t1", "g0", 2.0, EpisodeStatus.TRUNCATED)
    assert [t.token_ids for t in trajectories] == [[1, 2, 10], [5, 11]]
    assert {t.reward for t in trajectories} == {2.0}
    assert {t.status for t in trajectories} == {EpisodeStatus.TRUNCATED}
    assert [t.metrics for t in trajectories] == [
        {"segment": 0.0, "segments": 2.0, "tool_calls": 0.0},
        {"segment": 1.0, "segments": 2.0, "tool_calls": 0.0},
    ]


def test_bad_rules_statuses_and_choices_are_refused_by_name():
    with pytest.raises(ValueError, match="extend='first'"):
        segment_calls([], extend="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'won'"):
        episode_trajectories([_call(0, [1], [2])], "t", "g", 0.0, "won")
    with pytest.raises(ValueError, match="2 token_ids, 1 logprobs"):
        RecordedChoice(
            token_ids=(1, 2), logprobs=(0.0,), policy_versions=(0, 0), finish_reason="stop"
        )
    with pytest.raises(ValueError, match="'done'"):
        RecordedChoice(token_ids=(), logprobs=(), policy_versions=(), finish_reason="done")


def test_a_trajectory_reads_as_its_newest_calls_messages_and_reply():
    ask = ({"role": "user", "content": "2+3?"},)
    first = RecordedCall(
        index=0,
        endpoint="chat.completions",
        prompt_ids=(1, 2),
        choices=(dataclasses.replace(_choice([3, 4]), text="add(2, 3)"),),
        messages=ask,
    )
    follow = ask + ({"role": "assistant", "content": "add(2, 3)"}, {"role": "tool", "content": "5"})
    second = RecordedCall(
        index=1,
        endpoint="chat.completions",
        prompt_ids=(1, 2, 3, 4, 9),
        choices=(dataclasses.replace(_choice([5]), text="5"),),
        messages=follow,
    )
    (trajectory,) = episode_trajectories([first, second], "t", "g", 1.0, "completed")
    assert trajectory.transcript == [*follow, {"role": "assistant", "content": "5"}]
    # Id prompts with no text leave it empty rather than inventing one.
    (bare,) = episode_trajectories([_call(0, [1], [2])], "t", "g", 0.0, "completed")
    assert bare.transcript == []


def test_a_segment_counts_the_tool_calls_of_its_replies_as_a_native_episode_does():
    with_calls = dataclasses.replace(_choice([10, 11]), tool_calls=2)
    calls = [
        RecordedCall(0, "chat.completions", (1, 2), (with_calls,)),
        _call(1, [1, 2, 10, 11, 4], [12]),  # extends it, no call in this reply
        _call(2, [7], [13]),  # a rewritten history: a segment of its own
    ]
    first, second = episode_trajectories(calls, "t", "g", 1.0, EpisodeStatus.COMPLETED)
    assert (first.metrics["tool_calls"], second.metrics["tool_calls"]) == (2.0, 0.0)
