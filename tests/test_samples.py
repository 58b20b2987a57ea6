"""The sample log (issue 21, item 5): which episodes of a batch are kept, what an episode's
record says, that writing it never stops a run, `raytunix samples`, and a tiny run that
leaves the episodes of each of its RL steps in samples.jsonl."""

import json
import logging
import os

import pytest

from raytunix.agents import ToolAgent
from raytunix.cli import main
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.packer import batch_info
from raytunix.samples import (
    SampleLog,
    SamplesError,
    choose_samples,
    format_step,
    step_samples,
)
from raytunix.types import EpisodeStatus, FinishReason, GenerationResult, Task, Trajectory

# --- which episodes --------------------------------------------------------------------------


def test_the_best_the_worst_then_random_ones_the_same_for_the_same_seed():
    rewards = [0.5, 1.0, 0.0, 0.25, 1.0, 0.0, 0.75, 0.5]
    picks = choose_samples(rewards, 4, seed=7)
    assert picks[:2] == [("best", 1), ("worst", 5)]  # first of the best, last of the worst
    assert [pick for pick, _ in picks[2:]] == ["random", "random"]
    drawn = [i for _, i in picks[2:]]
    assert len(set(drawn)) == 2 and not set(drawn) & {1, 5}
    assert choose_samples(rewards, 4, seed=7) == picks
    other_seeds = {tuple(choose_samples(rewards, 4, seed=s)[2:]) for s in range(20)}
    assert len(other_seeds) > 1  # the seed, not the rewards alone, picks the random ones


def test_fewer_episodes_than_asked_gives_each_once_and_zero_gives_none():
    assert choose_samples([0.0, 1.0], 5, seed=0) == [("best", 1), ("worst", 0)]
    assert choose_samples([3.0], 3, seed=0) == [("best", 0)]
    assert choose_samples([1.0, 0.0, 0.5], 1, seed=0) == [("best", 0)]
    assert choose_samples([1.0, 0.0, 0.5], 0, seed=0) == []
    assert choose_samples([], 3, seed=0) == []
    with pytest.raises(ValueError, match="n=-1"):
        choose_samples([1.0], -1, seed=0)


def test_equal_rewards_still_show_two_different_episodes():
    picks = choose_samples([0.0, 0.0, 0.0, 0.0], 2, seed=0)
    assert picks == [("best", 0), ("worst", 3)]


# --- what an episode's record holds ----------------------------------------------------------


def _reply(tokenizer, text, version):
    ids = tuple(tokenizer.encode(text))
    return GenerationResult("r", ids, (-0.1,) * len(ids), (version,) * len(ids), FinishReason.STOP)


def test_the_agent_keeps_the_conversation_as_text_with_each_parsed_action():
    tokenizer = Tokenizer.byte_level()
    agent = ToolAgent(tokenizer, system_prompt="Use the calculator.")
    task = Task("t0", "Calculate 95 - 21.", "74")
    agent.reset(task, task.question)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "95 - 21"}}</tool_call>'
    agent.on_generation(_reply(tokenizer, call + "<|end|>", version=3))
    agent.on_observation("74")
    agent.on_generation(_reply(tokenizer, "<answer>74</answer><|end|>", version=4))
    trajectory = agent.to_trajectory("t0", "g0", 1.0, EpisodeStatus.COMPLETED)
    assert trajectory.transcript == [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "Calculate 95 - 21."},
        {
            "role": "assistant",
            "content": call + "<|end|>",
            "action": {
                "tool_calls": [{"name": "calculator", "arguments": {"expression": "95 - 21"}}]
            },
        },
        {"role": "tool", "content": "74"},
        {"role": "assistant", "content": "<answer>74</answer><|end|>", "action": {"answer": "74"}},
    ]
    agent.reset(task, task.question)  # a new episode starts a new transcript
    assert [m["role"] for m in agent.transcript] == ["system", "user"]


def _trajectory(task_id, group, reward, status=EpisodeStatus.COMPLETED, versions=(2, 2)):
    return Trajectory(
        task_id=task_id,
        group_id=group,
        token_ids=[5, 6, 7, 8],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0.0, 0.0, -0.5, -0.5],
        policy_versions=[-1, -1, *versions],
        reward=reward,
        status=status,
        num_turns=1,
        transcript=[
            {"role": "user", "content": f"question {task_id}"},
            {"role": "assistant", "content": "<answer>x</answer>", "action": {"answer": "x"}},
        ],
    )


def test_a_batch_carries_its_chosen_episodes_whole():
    groups = [
        [_trajectory("a", "g0", 1.0), _trajectory("a", "g0", 0.0, versions=(1, 2))],
        [_trajectory("b", "g1", 0.5), _trajectory("b", "g1", 0.0, EpisodeStatus.TRUNCATED)],
    ]
    info = batch_info(4, 3, groups, samples_per_step=3, seed=1)
    best, worst, drawn = info["samples"]
    assert (best["pick"], best["task_id"], best["reward"]) == ("best", "a", 1.0)
    assert (worst["pick"], worst["task_id"], worst["status"]) == ("worst", "b", "truncated")
    assert drawn["pick"] == "random" and drawn["task_id"] in ("a", "b")
    assert best["policy_versions"] == [2] and best["generated_tokens"] == 2
    assert best["messages"][1]["action"] == {"answer": "x"}
    assert batch_info(4, 3, groups, samples_per_step=3, seed=1)["samples"] == info["samples"]
    assert batch_info(4, 3, groups)["samples"] == []  # off by default
    json.dumps(info)  # the line the driver writes


# --- the file and `raytunix samples` ---------------------------------------------------------


def _episode(task_id, reward, pick="best"):
    return {
        "pick": pick,
        "task_id": task_id,
        "group_id": "g0",
        "reward": reward,
        "status": "completed",
        "num_turns": 1,
        "policy_versions": [0],
        "generated_tokens": 3,
        "error": "",
        "messages": [
            {"role": "user", "content": "Is 4 even or odd?"},
            {"role": "assistant", "content": "<answer>even</answer>", "action": {"answer": "even"}},
        ],
    }


def test_steps_are_read_back_the_last_line_of_a_retrained_step_kept(tmp_path):
    log = SampleLog(str(tmp_path))
    assert log.write(1, [_episode("t1", 0.0)], batch_trajectories=4)
    assert log.write(2, [_episode("t2", 0.0)], batch_trajectories=4)
    assert log.write(2, [_episode("t2-again", 1.0)], batch_trajectories=4)  # after a resume
    assert not log.write(3, [])  # nothing to write: no line
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"step": 4, "epis')  # a run killed mid-line
    assert step_samples(str(tmp_path))["episodes"][0]["task_id"] == "t2-again"
    assert step_samples(str(tmp_path), 1)["episodes"][0]["task_id"] == "t1"
    with pytest.raises(SamplesError, match=r"RL step 7 has no samples.*steps with samples: 1-2"):
        step_samples(str(tmp_path), 7)


def test_a_log_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path, caplog):
    (tmp_path / "samples.jsonl").mkdir()  # in the way of the file
    log = SampleLog(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="raytunix.samples"):
        assert not log.write(1, [_episode("t1", 1.0)])
        assert not log.write(2, [_episode("t2", 1.0)])
    warnings = [r for r in caplog.records if "not written" in r.getMessage()]
    assert len(warnings) == 1 and "RL step 1" in warnings[0].getMessage()


def test_the_command_prints_a_step_and_names_what_is_missing(tmp_path, capsys):
    assert main(["samples", str(tmp_path)]) == 2
    assert "has no samples.jsonl" in capsys.readouterr().err
    log = SampleLog(str(tmp_path))
    log.write(3, [_episode("t3", 1.0), _episode("t4", 0.0, "worst")], batch_trajectories=4)
    log.write(5, [_episode("t5", 1.0)], batch_trajectories=4)
    assert main(["samples", str(tmp_path), "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "RL step 3: 2 of 4 trajectories" in out
    assert "== best: task t3  reward 1  completed" in out and "== worst: task t4" in out
    assert "-- assistant:\n   <answer>even</answer>\n   => action: " in out
    assert main(["samples", str(tmp_path)]) == 0
    assert "RL step 5" in capsys.readouterr().out
    assert main(["samples", str(tmp_path), "--step", "4"]) == 2
    assert "steps with samples: 3, 5" in capsys.readouterr().err
    assert main(["samples", str(tmp_path), "--step", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"][0]["task_id"] == "t5"


def test_format_says_when_an_episode_has_no_transcript():
    episode = dict(_episode("p", 0.0), messages=[], error="boom")
    text = format_step({"step": 1, "episodes": [episode]})
    assert "error: boom" in text and "no transcript" in text


# --- end to end ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_tiny_run_leaves_the_episodes_of_each_rl_step(tiny_run, capsys):
    # 5 RL steps of 2 groups of 2 episodes, all 4 kept (run.samples_per_step=4).
    run_dir = tiny_run.path
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rl = {r["step"]: r for r in map(json.loads, f) if r["phase"] == "rl"}
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [line["step"] for line in lines] == sorted(rl) == [1, 2, 3, 4, 5]
    for line in lines:
        record, episodes = rl[line["step"]], line["episodes"]
        assert line["batch_trajectories"] == record["num_trajectories"] == 4
        assert [e["pick"] for e in episodes] == ["best", "worst", "random", "random"]
        assert sum(e["reward"] for e in episodes) / 4 == pytest.approx(record["reward_mean"])
        statuses = {}
        for e in episodes:
            statuses[e["status"]] = statuses.get(e["status"], 0) + 1
        assert statuses == record["statuses"]
        by_group = {}
        for e in episodes:
            by_group.setdefault(e["group_id"], set()).add(e["task_id"])
        assert len(by_group) == 2 and all(len(ids) == 1 for ids in by_group.values())
        for e in episodes:
            assert (
                e["messages"][0]["role"] == "user" and "even or odd" in e["messages"][0]["content"]
            )
            assert e["messages"][1]["role"] == "assistant" and "action" in e["messages"][1]
            assert max(e["policy_versions"]) <= line["consume_version"]
    capsys.readouterr()
    assert main(["samples", run_dir]) == 0
    out = capsys.readouterr().out
    assert "RL step 5: 4 of 4 trajectories" in out and "even or odd" in out
    assert main(["samples", run_dir, "--step", "9"]) == 2
    assert "steps with samples: 1-5" in capsys.readouterr().err


def test_control_characters_of_a_reply_are_escaped_not_sent_to_the_terminal():
    episode = _episode("t", 0.0)
    episode["messages"][1]["content"] = "a\x1b[2Jb\nc\td"
    text = format_step({"step": 1, "episodes": [episode]})
    assert "\x1b" not in text and "a\\x1b[2Jb\n   c\td" in text
