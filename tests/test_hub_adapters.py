"""Environment hubs by name: TextArena's single-player games through ``env.name=textarena``
(GEM's games through ``env.name=gem``: tests/test_gem_env.py)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import sys

import pytest

from guess_by_bisection import bisection_episode
from raytunix.envs import make_env
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus

textarena = pytest.importorskip(
    "textarena", reason="TextArena is the hubs extra: pip install -e '.[test,hubs]'"
)


def _binary_search_episode(env, task, first_reply="[10]"):
    """Plays GuessTheNumber (1..20) by bisection from ``first_reply``."""
    return bisection_episode(env, task, first_reply, high=20)


def test_textarena_group_starts_from_one_state_and_pays_only_at_the_end():
    env = make_env("textarena", env_id="GuessTheNumber-v0")
    (task,) = env.tasks("train", 1, seed=3)
    assert "Guess The Number" in task.question and task.metadata["seed"] == 3 * 2**21
    group = [_binary_search_episode(env, task) for _ in range(4)]
    # The same seed, the same hidden number: every episode of the group sees the same game.
    assert all(episode == group[0] for episode in group)
    observations, results = group[0]
    assert observations[0] == task.question
    assert [r.reward for r in results[:-1]] == [0.0] * (len(results) - 1)
    last = results[-1]
    assert last.reward == 1.0 and last.info["correct"] and last.status == EpisodeStatus.COMPLETED
    assert "guessed the correct number" in last.observation
    # Another task's seed hides (for these seeds) another number.
    other = env.tasks("heldout", 1, seed=3)[0]
    assert other.metadata["seed"] != task.metadata["seed"]


def test_textarena_invalid_moves_keep_the_games_penalty():
    env = make_env("textarena", env_id="GuessTheNumber-v0")
    (task,) = env.tasks("train", 1, seed=0)
    env.reset(task)
    first = env.step(Action(text="ten"))  # no [number]: TextArena warns once
    assert not first.done and first.reward == 0.0
    assert first.info[TOOL_ERRORS_KEY] == {"format": 1} and "invalid move" in first.observation
    valid = env.step(Action(text="[1]"))
    assert TOOL_ERRORS_KEY not in valid.info
    env.step(Action(text="no brackets"))
    last = env.step(Action(text="still none"))  # a second invalid move in a row ends it
    assert last.done and last.info["invalid_move"] and last.info[TOOL_ERRORS_KEY] == {"format": 1}
    assert not last.info["correct"] and last.reward < 1.0
    # The game's own penalty: its completion score for the last guess, [1].
    hidden = env.game.game_number
    if hidden != 1:
        assert last.reward == pytest.approx(1 - (hidden - 1) / 19)


def test_textarena_resets_in_threads_start_from_the_seeded_state():
    # TextArena seeds the global random; GLOBAL_RNG_LOCK keeps a reset's seeding and draws
    # together while other threads reset other games.
    tasks = make_env("textarena", env_id="GuessTheNumber-v0").tasks("train", 40, seed=1)

    def hidden(task):
        env = make_env("textarena", env_id="GuessTheNumber-v0")
        numbers = []
        for _ in range(20):
            env.reset(task)
            numbers.append(env.game.game_number)
        return numbers

    expected = [hidden(t)[0] for t in tasks]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: without the lock, this fails
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(hidden, tasks))
    finally:
        sys.setswitchinterval(interval)
    assert [set(numbers) for numbers in got] == [{n} for n in expected]
    assert len(set(expected)) > 1


def test_textarena_episodes_interleaved_draw_as_if_each_ran_alone():
    # 2048 draws a new tile from the global random on every move: each episode keeps its
    # own stream, so two episodes of a group stepped in turn see the same boards as one
    # that runs alone, and the caller's global random is left as it was.
    moves = ["[Up]", "[Left]", "[Down]", "[Right]", "[Up]", "[Left]"]
    alone = make_env("textarena", env_id="2048-v0")
    (task,) = alone.tasks("train", 1, seed=5)
    alone.reset(task)
    expected = [alone.step(Action(text=m)).observation for m in moves]
    first, second = (make_env("textarena", env_id="2048-v0") for _ in range(2))
    first.reset(task)
    second.reset(task)
    random.seed(123)
    before = random.getstate()
    boards = []
    for move in moves:
        boards.append(
            (first.step(Action(text=move)).observation, second.step(Action(text=move)).observation)
        )
    assert boards == [(board, board) for board in expected]
    assert random.getstate() == before
    assert len(set(expected)) > 1


def test_textarena_refuses_unknown_and_multiplayer_games():
    with pytest.raises(ValueError, match="close ones: GuessTheNumber-v0"):
        make_env("textarena", env_id="GuessTheNumber-v9")
    with pytest.raises(ValueError, match="not single-player"):
        make_env("textarena", env_id="ConnectFour-v0")
    with pytest.raises(TypeError, match="make_kwargs must be a mapping"):
        make_env("textarena", env_id="GuessTheNumber-v0", make_kwargs=[1])


@pytest.mark.slow
def test_textarena_trains_by_config(ray_session, tmp_path, capsys):
    from test_byo_env import _rl_steps, _run_dirs, _train

    _train(
        tmp_path,
        "env.name=textarena",
        "env.kwargs.env_id=GuessTheNumber-v0",
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
    assert "demonstrations from environment 'textarena''s expert" in out
    (run_dir,) = _run_dirs(tmp_path)
    assert _rl_steps(run_dir) == [1, 2]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["env"] == "textarena"
