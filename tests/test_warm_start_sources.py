"""The warm start's sources beyond arithmetic: a chat-format demonstrations file
(``warmup.demonstrations``) and an environment's ``demonstrate(task)`` expert, rendered
through the agent's token path with the loss on the assistant's tokens only."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from raytunix.config import ConfigError, load_config
from raytunix.data.demonstration_file import DemonstrationError, read_demonstrations
from raytunix.driver import prepare
from raytunix.driver.run_dir import RunError
from raytunix.models.tokenizer import Tokenizer
from raytunix.envs.base import BaseEnv
from raytunix.types import Action, EpisodeStatus, StepResult, Task

GAME = [
    {"role": "user", "content": "Guess a number between 1 and 20."},
    {"role": "assistant", "content": "[10]"},
    {"role": "user", "content": "The target number is higher."},
    {"role": "assistant", "content": "[15]"},
    {"role": "user", "content": "You won!"},
]


def _jsonl(tmp_path, rows, name="demos.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# -- the file --------------------------------------------------------------------------


def test_a_jsonl_game_reads_as_alternating_replies_and_observations(tmp_path):
    system = [{"role": "system", "content": "Play well."}]
    path = _jsonl(tmp_path, [{"messages": GAME}, {"messages": system + GAME[:2]}])
    found = read_demonstrations(path)
    assert found.rows == [0, 1] and found.system_replaced == 1
    # The trailing "You won!" carries no loss and is left out; later user messages are
    # observations (what render_demonstration sends through on_observation).
    assert [m["role"] for m in found.conversations[0]] == ["user", "assistant", "tool", "assistant"]
    assert found.conversations[0][2]["content"] == "The target number is higher."
    assert found.conversations[1] == GAME[:2]


def test_a_parquet_messages_column_reads_as_the_jsonl_does(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "demos.parquet")
    pq.write_table(pa.table({"messages": [GAME, GAME[:2]], "id": [7, 8]}), path)
    jsonl = read_demonstrations(_jsonl(tmp_path, [{"messages": GAME}, {"messages": GAME[:2]}]))
    assert read_demonstrations(path).conversations == jsonl.conversations


def test_a_parquet_file_without_messages_names_its_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "demos.parquet")
    pq.write_table(pa.table({"prompt": ["a"], "completion": ["b"]}), path)
    with pytest.raises(DemonstrationError, match="no messages column .*prompt, completion"):
        read_demonstrations(path)


@pytest.mark.parametrize(
    "row, fragment",
    [
        ({"prompt": "hi"}, "row 1: no messages"),
        ({"messages": []}, "row 1: no messages"),
        ({"messages": "hello"}, "row 1: no messages"),
        (
            {"messages": [{"role": "human", "content": "x"}]},
            "row 1 message 0: unknown role 'human'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": None},
                ]
            },
            r"row 1 message 1 \(assistant\): content is None, not text",
        ),
        (
            {"messages": [GAME[0], {"role": "system", "content": "late"}, GAME[1]]},
            "row 1 message 1: a system message only comes first",
        ),
        ({"messages": [GAME[0]]}, "row 1: no assistant message"),
        ({"messages": [GAME[1], GAME[0]]}, "row 1: the first message must be the user's"),
        (
            {"messages": [GAME[0], GAME[1], GAME[1]]},
            "row 1 message 2: two assistant messages in a row",
        ),
        (
            {"messages": [GAME[0], GAME[2], GAME[1]]},
            r"row 1 message 1: two observation \(user or tool\) messages in a row",
        ),
    ],
)
def test_a_bad_row_is_named_with_what_is_wrong(tmp_path, row, fragment):
    path = _jsonl(tmp_path, [{"messages": GAME}, row])
    with pytest.raises(DemonstrationError, match=f"demos.jsonl {fragment}"):
        read_demonstrations(path)


def test_files_that_cannot_be_demonstrations_say_so(tmp_path):
    with pytest.raises(DemonstrationError, match="no such file"):
        read_demonstrations(str(tmp_path / "missing.jsonl"))
    (tmp_path / "demos.csv").write_text("messages\n")
    with pytest.raises(DemonstrationError, match=r"ends in \.jsonl .* or \.parquet"):
        read_demonstrations(str(tmp_path / "demos.csv"))
    with pytest.raises(DemonstrationError, match="holds no row"):
        read_demonstrations(_jsonl(tmp_path, [], "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": GAME}) + "\n{oops\n")
    with pytest.raises(DemonstrationError, match=r"bad.jsonl row 1 \(line 2\) is not JSON"):
        read_demonstrations(str(tmp_path / "bad.jsonl"))


def test_the_file_and_its_source_come_together_in_config():
    assert load_config(None, ["warmup.demonstrations=d.jsonl"]).warmup.source == "auto"
    load_config(None, ["warmup.source=file", "warmup.demonstrations=d.jsonl"])
    with pytest.raises(ConfigError, match="warmup.source=file with warmup.demonstrations=''"):
        load_config(None, ["warmup.source=file"])
    with pytest.raises(ConfigError, match="warmup.source=expert with warmup.demonstrations="):
        load_config(None, ["warmup.source=expert", "warmup.demonstrations=d.jsonl"])


# -- rendering: the loss is on the assistant's tokens ----------------------------------


def _cfg(*overrides):
    return load_config(
        None, ["env.name=textarena", "env.kwargs.env_id=GuessTheNumber-v0", *overrides]
    )


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.byte_level()


def test_the_file_renders_with_the_loss_on_exactly_the_assistant_tokens(tmp_path, tokenizer):
    cfg = _cfg(f"warmup.demonstrations={_jsonl(tmp_path, [{'messages': GAME}])}")
    demos = prepare.warm_start_demonstrations(cfg, [], env_pool=None)  # the file comes first
    assert demos.kind == "file" and demos.rows[0][0].task_id == "demonstration-0"
    tokens, mask, dropped = prepare.demonstration_arrays(cfg, demos, tokenizer)
    assert tokens.shape[1] % 16 == 0 and dropped == {"too_long": 0, "unparseable": 0}
    n = int((tokens[0] != tokenizer.pad_id).sum())
    ids, m = tokens[0, :n].tolist(), mask[0, :n]
    learned = tokenizer.decode([i for i, k in zip(ids, m) if k == 1], skip_special_tokens=False)
    assert learned == "[10]<|end|>[15]<|end|>"  # each reply and the end-of-turn closing it
    context = tokenizer.decode([i for i, k in zip(ids, m) if k == 0], skip_special_tokens=False)
    assert "Guess a number" in context and "The target number is higher." in context
    assert not mask[0, n:].any()


def test_overlong_and_unparseable_rows_are_counted_and_none_left_is_an_error(tmp_path, tokenizer):
    long_game = [GAME[0], {"role": "assistant", "content": f"<answer>{'7' * 300}</answer>"}]
    answer = [GAME[0], {"role": "assistant", "content": "<answer>7</answer>"}]
    no_answer = [GAME[0], {"role": "assistant", "content": "seven"}]
    path = _jsonl(tmp_path, [{"messages": m} for m in (long_game, answer, no_answer)])
    # The answer agent reads only <answer>...</answer>: "seven" would be a format error.
    cfg = _cfg(f"warmup.demonstrations={path}", "env.agent=answer", "model.max_seq_len=256")
    demos = prepare.warm_start_demonstrations(cfg, [], env_pool=None)
    tokens, _, dropped = prepare.demonstration_arrays(cfg, demos, tokenizer)
    assert len(tokens) == 1 and dropped == {"too_long": 1, "unparseable": 1}
    demos.rows[1:2] = []
    with pytest.raises(RunError) as e:
        prepare.demonstration_arrays(cfg, demos, tokenizer)
    assert f"from {path} is usable: of 2" in str(e.value)
    assert "1 are longer than model.max_seq_len=256" in str(e.value)
    assert "the agent ('answer') cannot parse (first: demonstration-2: 'seven')" in str(e.value)


def test_a_bad_file_or_a_source_with_nothing_stops_the_run_with_the_reason(tmp_path):
    bad = _jsonl(tmp_path, [{"messages": [GAME[1]]}])
    with pytest.raises(RunError, match="demos.jsonl row 0: the first message must be"):
        prepare.warm_start_demonstrations(_cfg(f"warmup.demonstrations={bad}"), [], None)
    cfg = load_config(None, ["warmup.source=arithmetic"])
    tasks = [Task("t0", "Who?", "me")]
    with pytest.raises(RunError, match="warmup.source=arithmetic but the tasks are not"):
        prepare.warm_start_demonstrations(cfg, tasks, None)
    assert prepare.warm_start_demonstrations(_cfg("warmup.enabled=false"), tasks, None) is None


# -- the environments' experts ---------------------------------------------------------


def test_the_reasoning_gym_expert_answers_what_the_scorer_accepts():
    from raytunix.agents import make_agent
    from raytunix.envs import make_env

    env = make_env("reasoning_gym", task="chain_sum")
    tasks = env.tasks("train", 20, 3)
    agent = make_agent("answer", Tokenizer.byte_level())
    for task in tasks:
        messages = env.demonstrate(task)
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[0]["content"] == task.question
        action = agent.parse(messages[1]["content"])  # the answer agent's own format
        assert action.answer == task.metadata["entry"]["answer"]
        judge = make_env("reasoning_gym")  # a fresh instance scores the expert's reply
        judge.reset(task)
        assert judge.step(action).reward == 1.0


def test_the_reasoning_gym_expert_has_nothing_for_an_entry_without_an_answer():
    from raytunix.envs import make_env

    env = make_env("reasoning_gym", task="chain_sum")
    (task,) = env.tasks("train", 1, 0)
    task.metadata["entry"]["answer"] = "  "
    assert env.demonstrate(task) is None


def test_the_guess_the_number_expert_wins_against_the_real_game():
    pytest.importorskip("textarena", reason="TextArena is the hubs extra")
    from raytunix.envs import make_env

    env = make_env("textarena", env_id="GuessTheNumber-v0")
    tasks = env.tasks("train", 30, 5)
    for task in tasks:
        messages = env.demonstrate(task)
        # Replayed on a fresh game: every observation is the game's, and the last guess wins.
        judge = make_env("textarena", env_id="GuessTheNumber-v0")
        assert messages[0] == {"role": "user", "content": judge.reset(task)}
        replies = messages[1::2]
        assert len(replies) <= 5  # halving 1..20 takes at most 5 guesses
        for i, reply in enumerate(replies):
            result = judge.step(Action(text=reply["content"]))
            if i + 1 < len(replies):
                assert not result.done and messages[2 + 2 * i]["content"] == result.observation
        assert result.done and result.reward == 1.0 and result.info["correct"]


def test_other_textarena_games_have_no_expert():
    pytest.importorskip("textarena", reason="TextArena is the hubs extra")
    from raytunix.envs import make_env

    env = make_env("textarena", env_id="TowerOfHanoi-v0")
    assert env.demonstrate(env.tasks("train", 1, 0)[0]) is None


def test_the_sql_expert_answers_the_gold_query_and_it_scores():
    from raytunix.envs import make_env

    env = make_env("text_to_sql")
    for task in env.tasks("train", 4, 0):
        messages = env.demonstrate(task)
        assert messages[1]["content"] == f"<answer>{task.metadata['gold_sql']}</answer>"
        judge = make_env("text_to_sql")
        judge.reset(task)
        assert judge.step(Action(text="", answer=task.metadata["gold_sql"])).reward == 1.0


# -- a run -----------------------------------------------------------------------------


def _train(tmp_path, capsys, *overrides):
    """test_byo_env's tiny run in this process (on the session's Ray) with no RL step:
    the warm start is what these runs are for. Returns its directory and what its driver
    printed."""
    from test_byo_env import TINY

    from raytunix.train import train

    cfg = load_config(
        None,
        TINY
        + [
            f"run.output_dir={tmp_path / 'runs'}",
            "learner.rl_steps=0",
            "data.heldout_size=4",
            "eval.heldout_size=4",
            "eval.max_new_tokens=16",
            *overrides,
        ],
    )
    summary = train(cfg)
    return summary["run_dir"], capsys.readouterr().out


@pytest.mark.slow
def test_a_reasoning_gym_run_warm_starts_from_the_expert(ray_session, tmp_path, capsys):
    run_dir, stdout = _train(
        tmp_path,
        capsys,
        "env.name=reasoning_gym",
        "env.kwargs.task=chain_sum",
        "env.kwargs.dataset_kwargs={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
        "env.max_turns=1",
        "model.max_seq_len=192",
        "warmup.max_steps=4",
        "warmup.min_steps=0",
        "warmup.eval_every=2",
        "warmup.batch_size=8",
    )
    assert "demonstrations from environment 'reasoning_gym''s expert" in stdout
    assert "(the step budget: no dev check for this source)" in stdout
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = list(map(json.loads, f))
    (source,) = [r for r in records if r["phase"] == "warmup_source"]
    assert source["source"] == "expert" and source["rows"] == 200  # data.train_size
    warm = [r for r in records if r["phase"] == "warmup"]
    assert [r["step"] for r in warm] == [2, 4]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in warm)
    assert not any(k.startswith("dev_") for r in warm for k in r)
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["warm_start_steps"] == 4


class EvenReplyEnv(BaseEnv):
    """Pays 1.0 for a reply of an even number of characters, 0.0 otherwise: a random
    model earns it about half the time, so rejection sampling keeps some episodes."""

    default_agent = "text"

    def tasks(self, split, size, seed):
        return [Task(f"{split}-{i}", f"Say anything ({seed}, {i}).", "") for i in range(size)]

    def _initial_observation(self, task):
        return task.question

    def _step_impl(self, action):
        reward = 1.0 if len(action.text) % 2 == 0 else 0.0
        return StepResult(observation="", reward=reward, done=True, status=EpisodeStatus.COMPLETED)


@pytest.mark.slow
def test_rejection_sampling_warm_starts_from_the_runs_own_successes(ray_session, tmp_path, capsys):
    run_dir, stdout = _train(
        tmp_path,
        capsys,
        "env.name=test_warm_start_sources:EvenReplyEnv",
        "env.max_turns=1",
        "warmup.source=rejection",
        "warmup.rejection_episodes=32",
        "warmup.max_steps=2",
        "warmup.min_steps=0",
        "warmup.eval_every=2",
        "warmup.batch_size=4",
    )
    kept = re.search(r"rejection sampling kept (\d+) of 32 episodes", stdout)
    assert kept is not None, stdout[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = list(map(json.loads, f))
    (source,) = [r for r in records if r["phase"] == "warmup_source"]
    assert source["source"] == "rejection" and source["rows"] == int(kept.group(1)) > 0
    assert [r["step"] for r in records if r["phase"] == "warmup"] == [2]


def test_rejection_keeps_only_completed_episodes_that_succeeded():
    from raytunix.rollout.orchestrator import successful_episodes
    from raytunix.types import Trajectory

    def episode(reward, status, ids):
        n = len(ids)
        return Trajectory(
            task_id="t",
            group_id="g",
            token_ids=ids,
            loss_mask=[0] + [1] * (n - 1),
            logprobs=[0.0] * n,
            policy_versions=[0] * n,
            reward=reward,
            status=status,
            num_turns=1,
        )

    kept = successful_episodes(
        [
            episode(1.0, EpisodeStatus.COMPLETED, [5, 6, 7]),
            episode(0.5, EpisodeStatus.COMPLETED, [5, 6]),  # partial credit is no success
            episode(1.0, EpisodeStatus.TRUNCATED, [5, 8]),
            episode(2.0, EpisodeStatus.COMPLETED, [9, 9]),
        ]
    )
    assert kept == [([5, 6, 7], [0, 1, 1]), ([9, 9], [0, 1])]


@pytest.mark.slow
def test_a_run_warm_starts_from_a_demonstrations_file(tiny_run):
    # The shared tiny run's warm start: 20 steps on shared_runs.write_demonstrations' file,
    # 36 parity answers, each after a system message, and one reply with no <answer> tag.
    path, stdout = tiny_run.demonstrations, tiny_run.stdout
    assert "36 rows of" in stdout and "start with a system message" in stdout
    assert f"warm start: 36 demonstrations from {path}" in stdout
    assert "(1 unparseable left out)" in stdout  # "odd" is no <answer> for the agent
    with open(os.path.join(tiny_run.path, "metrics.jsonl")) as f:
        records = list(map(json.loads, f))
    (source,) = [r for r in records if r["phase"] == "warmup_source"]
    counts = {k: source[k] for k in ("source", "rows", "too_long", "unparseable")}
    assert counts == {"source": "file", "rows": 36, "too_long": 0, "unparseable": 1}
    assert [r["step"] for r in records if r["phase"] == "warmup"] == [20]
