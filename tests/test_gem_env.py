"""GEM's games by name: ``env.name=gem env.kwargs.env_id=game:...`` (raytunix/envs/gem_env.py)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import sys

import numpy as np
import pytest

from guess_by_bisection import BOXED, bisection_episode
from raytunix.envs import make_env
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus

gem = pytest.importorskip(
    "gem", reason="GEM is the gem extra (in hubs on Python 3.11): pip install -e '.[test,hubs]'"
)

HARD = "game:GuessTheNumber-v0-hard"  # 1..50 in 7 turns
EASY = "game:GuessTheNumber-v0-easy"  # 1..10 in 4 turns


def _gem_hint(observation, guess):
    """GEM says "higher than N" when the number is higher, else that it is lower."""
    return "higher" if f"higher than {guess}" in observation else "lower"


def _bisection_episode(env, task, first_reply="I guess \\boxed{25}"):
    """Plays GuessTheNumber 1..50 by bisection from ``first_reply``."""
    return bisection_episode(env, task, first_reply, high=50, syntax=BOXED, hint=_gem_hint)


def test_gem_group_starts_from_one_state_and_pays_the_win_at_the_end():
    env = make_env("gem", env_id=HARD)
    (task,) = env.tasks("train", 1, seed=3)
    assert "Guess The Number" in task.question and task.metadata["seed"] == 3 * 2**21
    group = [_bisection_episode(env, task) for _ in range(4)]
    # The same seed, the same hidden number: every episode of the group sees the same game.
    assert all(episode == group[0] for episode in group)
    observations, results = group[0]
    assert observations[0] == task.question
    # GEM's wrappers show the suffix after each observation the model answers.
    assert all(o.endswith("Enter your next guess.") for o in observations[:-1])
    assert [r.reward for r in results[:-1]] == [0.0] * (len(results) - 1)
    last = results[-1]
    assert last.reward == 1.0 and last.info["correct"] and last.status == EpisodeStatus.COMPLETED
    assert "You guessed the correct number" in last.observation
    assert not any(TOOL_ERRORS_KEY in r.info for r in results)
    # Another task's seed hides (for these seeds) another number.
    env.reset(env.tasks("heldout", 1, seed=3)[0])
    other = env.game.game_number
    env.reset(task)
    assert other != env.game.game_number


def test_gem_reset_seeds_stay_in_numpys_range_for_any_data_seed():
    # GEM's reset calls numpy.random.seed, which refuses seeds of 2**32 and more.
    env = make_env("gem", env_id=EASY)
    for seed in (1, 2047, 2**40):
        tasks = env.tasks("heldout", 3, seed=seed)
        assert all(0 <= t.metadata["seed"] < 2**31 for t in tasks)
        assert len({t.metadata["seed"] for t in tasks}) == 3
        assert env.reset(tasks[-1]) == tasks[-1].question


def test_gem_format_errors_keep_gems_penalty_and_refused_moves_go_on():
    env = make_env("gem", env_id=HARD)
    (task,) = env.tasks("train", 1, seed=0)
    env.reset(task)
    wrong = 1 if env.game.game_number != 1 else 2
    out_of_range = env.step(Action(text="\\boxed{51}"))
    assert not out_of_range.done and out_of_range.reward == 0.0
    assert "outside the range" in out_of_range.observation
    assert TOOL_ERRORS_KEY not in out_of_range.info  # GEM parsed it; the game refused it
    env.step(Action(text=f"\\boxed{{{wrong}}}"))
    again = env.step(Action(text=f"\\boxed{{{wrong}}}"))
    assert not again.done and "already guessed" in again.observation
    # No \boxed{} number: GEM ends the game with its format penalty, which is kept.
    last = env.step(Action(text=f"my guess is {wrong + 1}"))
    assert last.done and last.status == EpisodeStatus.COMPLETED
    assert last.reward == pytest.approx(-0.1) and last.info["format_error"]
    assert last.info[TOOL_ERRORS_KEY] == {"format": 1} and not last.info["correct"]


def test_gem_out_of_turns_pays_the_games_partial_credit():
    env = make_env("gem", env_id=EASY)
    (task,) = env.tasks("train", 1, seed=2)
    env.reset(task)
    hidden = env.game.game_number
    misses = [n for n in range(1, 11) if n != hidden][:4]
    results = [env.step(Action(text=f"\\boxed{{{n}}}")) for n in misses]
    assert [r.done for r in results] == [False, False, False, True]
    last = results[-1]
    assert last.status == EpisodeStatus.TRUNCATED and not last.info["correct"]
    assert last.reward == pytest.approx(1 - abs(misses[-1] - hidden) / 9)


def test_gem_resets_in_threads_start_from_the_seeded_state():
    # GEM seeds the global random; GLOBAL_RNG_LOCK keeps a reset's seeding and draws
    # together while other threads reset other games (without it, this fails).
    tasks = make_env("gem", env_id=HARD).tasks("train", 40, seed=1)

    def hidden(task):
        env = make_env("gem", env_id=HARD)
        numbers = []
        for _ in range(20):
            env.reset(task)
            numbers.append(env.game.game_number)
        return numbers

    expected = [hidden(t)[0] for t in tasks]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(hidden, tasks))
    finally:
        sys.setswitchinterval(interval)
    assert [set(numbers) for numbers in got] == [{n} for n in expected]
    assert len(set(expected)) > 1


def test_gem_episodes_interleaved_draw_as_if_each_ran_alone():
    # 2048 draws a new tile from the global random on every move: each episode keeps its
    # own streams, so two episodes of a group stepped in turn see the same boards as one
    # that runs alone, and the caller's global random and numpy.random are left as they were.
    moves = ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}", "\\boxed{up}"]
    alone = make_env("gem", env_id="game:Game2048-v0-easy")
    (task,) = alone.tasks("train", 1, seed=5)
    alone.reset(task)
    expected = [alone.step(Action(text=m)).observation for m in moves]
    first, second = (make_env("gem", env_id="game:Game2048-v0-easy") for _ in range(2))
    random.seed(123)
    np.random.seed(456)
    before, np_before = random.getstate(), np.random.get_state()
    first.reset(task)
    second.reset(task)
    boards = []
    for move in moves:
        boards.append(
            (first.step(Action(text=move)).observation, second.step(Action(text=move)).observation)
        )
    assert boards == [(board, board) for board in expected]
    assert random.getstate() == before
    assert np.array_equal(np.random.get_state()[1], np_before[1])
    assert len(set(expected)) > 1


def test_the_gem_guess_the_number_expert_wins_against_the_real_game():
    env = make_env("gem", env_id=HARD)
    for task in env.tasks("train", 20, 5):
        messages = env.demonstrate(task)
        # Replayed on a fresh game: every observation is the game's, and the last guess wins.
        judge = make_env("gem", env_id=HARD)
        assert messages[0] == {"role": "user", "content": judge.reset(task)}
        replies = messages[1::2]
        assert len(replies) <= 6  # halving 1..50 takes at most 6 guesses
        for i, reply in enumerate(replies):
            result = judge.step(Action(text=reply["content"]))
            if i + 1 < len(replies):
                assert not result.done and messages[2 + 2 * i]["content"] == result.observation
        assert result.done and result.reward == 1.0 and result.info["correct"]
    mastermind = make_env("gem", env_id="game:Mastermind-v0-easy")
    assert mastermind.demonstrate(mastermind.tasks("train", 1, 0)[0]) is None


def test_gem_refuses_unknown_ids_and_what_is_not_a_game():
    # GEM registers GuessTheNumber by difficulty; the bare id is not one of them.
    with pytest.raises(ValueError, match="'game:GuessTheNumber-v0' is not a GEM id; close ones"):
        make_env("gem", env_id="game:GuessTheNumber-v0")
    with pytest.raises(ValueError, match="'rg:chain_sum' is not a game.*env.name=reasoning_gym"):
        make_env("gem", env_id="rg:chain_sum")
    with pytest.raises(ValueError, match="'math:GSM8K' is not a game"):
        make_env("gem", env_id="math:GSM8K")
    with pytest.raises(TypeError, match="make_kwargs must be a mapping"):
        make_env("gem", env_id=EASY, make_kwargs=[1])


@pytest.mark.slow
def test_gem_trains_by_config(ray_session, tmp_path, capsys):
    from test_byo_env import _rl_steps, _run_dirs, _train

    _train(
        tmp_path,
        "env.name=gem",
        f"env.kwargs.env_id={EASY}",
        "env.max_turns=2",
        "model.max_seq_len=512",
        "warmup.max_steps=1",
        "warmup.min_steps=0",
        "warmup.eval_every=1",
        "warmup.batch_size=4",
    )
    out = capsys.readouterr().out
    assert "tasks: the environment's own" in out
    # The game's expert (binary search) gives the warm start its demonstrations.
    assert "demonstrations from environment 'gem''s expert" in out
    (run_dir,) = _run_dirs(tmp_path)
    assert _rl_steps(run_dir) == [1, 2]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["env"] == "gem"
