"""OpenEnv environments by name: ``env.name=openenv env.kwargs.env_id=...``
(raytunix/envs/openenv_env.py), against the small environments of tests/openenv_example.py
served on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import sys
import textwrap

import pytest

pytest.importorskip(
    "openenv.core.env_server.http_server",
    reason="OpenEnv is the openenv extra (in hubs): pip install -e '.[test,openenv]'",
)

from guess_by_bisection import bisection_episode  # noqa: E402
from raytunix.envs import make_env  # noqa: E402
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus  # noqa: E402

GUESS = "openenv_example:GuessEnvironment"


def _bisection_episode(env, task, first_reply="[10]"):
    """Plays GuessEnvironment (1..20) by bisection from ``first_reply``."""
    return bisection_episode(env, task, first_reply, high=20)


def test_openenv_group_starts_from_one_state_and_pays_only_at_the_end():
    env = make_env("openenv", env_id=GUESS)
    try:
        (task,) = env.tasks("train", 1, seed=3)
        assert task.question == "Guess my number in 1..20; reply [n]."
        assert task.metadata == {"seed": 3 * 2**21, "openenv_id": GUESS}
        group = [_bisection_episode(env, task) for _ in range(4)]
    finally:
        env.close()
    # The same seed, the same hidden number: every episode of the group plays one game.
    assert all(episode == group[0] for episode in group)
    observations, results = group[0]
    assert observations[0] == task.question
    assert [r.reward for r in results[:-1]] == [0.0] * (len(results) - 1)
    assert results[-1].reward == 1.0 and results[-1].status == EpisodeStatus.COMPLETED
    assert results[-1].observation == "Correct!" and len(results) > 1


def test_openenv_format_penalty_is_the_environments_and_the_game_goes_on():
    env = make_env("openenv", env_id=GUESS)
    try:
        (task,) = env.tasks("train", 1, seed=0)
        assert env.action_field == "message"  # the one text field takes the reply as is
        observations, results = _bisection_episode(env, task, first_reply="ten")
    finally:
        env.close()
    assert results[0].reward == -0.1 and not results[0].done
    assert observations[1] == "Invalid move: reply [n]."
    # The episode's reward is the sum: the penalty stays beside the win at the end.
    assert sum(r.reward for r in results) == pytest.approx(0.9)
    assert results[-1].reward == 1.0


def test_openenv_json_actions_a_bad_reply_is_a_format_error_not_sent():
    env = make_env("openenv", env_id="openenv_example:PointEnvironment")
    try:
        assert env.action_field is None
        (task,) = env.tasks("train", 1, seed=0)
        assert env.reset(task) == task.question == "board: ...\n...\n...\nmoves: 0"
        no_json = env.step(Action(text="the middle row"))
        wrong = env.step(Action(text='{"row": "one", "col": 2}'))
        hit = env.step(Action(text='Here:\n```json\n{"row": 1, "col": 2}\n```'))
    finally:
        env.close()
    for result in (no_json, wrong):
        assert result.info[TOOL_ERRORS_KEY] == {"format": 1} and result.reward == 0.0
        assert not result.done and "PointAction: row (int), col (int)" in result.observation
    assert "no JSON object" in no_json.observation and "row: Input should be" in wrong.observation
    # Neither bad reply reached the environment: the hit is its first move.
    assert hit.observation == "board: hit\nmoves: 1" and hit.reward == 1.0 and hit.done


def test_openenv_episodes_interleaved_draw_as_if_each_ran_alone():
    # GuessEnvironment seeds and draws from the global random, in this process (thread
    # mode): each episode keeps its own stream, and the caller's random is left alone.
    moves = ["[10]", "[5]", "[15]", "[3]"]
    alone = make_env("openenv", env_id=GUESS)
    first, second = (make_env("openenv", env_id=GUESS) for _ in range(2))
    try:
        (task,) = alone.tasks("train", 1, seed=5)
        alone.reset(task)
        expected = [alone.step(Action(text=m)).observation for m in moves]
        first.reset(task)
        second.reset(task)
        random.seed(123)
        before = random.getstate()
        steps = [
            (first.step(Action(text=m)).observation, second.step(Action(text=m)).observation)
            for m in moves
        ]
        assert random.getstate() == before
    finally:
        for env in (alone, first, second):
            env.close()
    assert steps == [(obs, obs) for obs in expected]


def test_openenv_resets_in_threads_start_from_the_seeded_state():
    tasks = []
    probe = make_env("openenv", env_id=GUESS)
    try:
        tasks = probe.tasks("train", 6, seed=1)
    finally:
        probe.close()

    def first_hints(task):
        env = make_env("openenv", env_id=GUESS)
        try:
            return [_bisection_episode(env, task)[0] for _ in range(3)]
        finally:
            env.close()

    expected = [first_hints(t)[0] for t in tasks]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(first_hints, tasks))
    finally:
        sys.setswitchinterval(interval)
    assert got == [[game] * 3 for game in expected]
    assert len({tuple(game) for game in expected}) > 1


def test_openenv_environment_that_ignores_its_seed_is_refused_unless_allowed(caplog):
    env = make_env("openenv", env_id="openenv_example:UnseededEnvironment")
    try:
        with pytest.raises(ValueError, match="does not start from its seed's state") as e:
            env.tasks("train", 2, seed=0)
        assert "env.kwargs.require_seed=false" in str(e.value)
    finally:
        env.close()
    lax = make_env("openenv", env_id="openenv_example:UnseededEnvironment", require_seed=False)
    try:
        (task,) = lax.tasks("train", 1, seed=0)
        assert lax.reset(task) != task.question  # the group would start apart: warned
    finally:
        lax.close()
    assert "does not start from its seed's state" in caplog.text


def test_openenv_installed_package_layout_runs_by_name(tmp_path, monkeypatch):
    # An OpenEnv package: <name>_env/server/app.py defines app = create_app(...).
    server = tmp_path / "dice_env" / "server"
    server.mkdir(parents=True)
    (tmp_path / "dice_env" / "__init__.py").write_text("")
    (server / "__init__.py").write_text("")
    (server / "app.py").write_text(
        textwrap.dedent(
            """
            from openenv.core.env_server.http_server import create_app
            from openenv_example import GuessAction, GuessEnvironment, GuessObservation

            app = create_app(GuessEnvironment, GuessAction, GuessObservation)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("openenv", env_id="dice")
    try:
        assert env.server_mode == "process" and env.action_cls.__name__ == "GuessAction"
        child = None
        (task,) = env.tasks("train", 1, seed=3)
        child = env._server._child
        observations, results = _bisection_episode(env, task)
    finally:
        env.close()
    assert results[-1].reward == 1.0 and observations[0] == task.question
    # Closing the environment stopped its server process.
    assert child is not None and child.poll() is not None


def test_openenv_bad_ids_and_servers_that_fail_say_what_to_do():
    with pytest.raises(
        ValueError, match=r"not an installed OpenEnv environment \(no module 'nope_env'\)"
    ):
        make_env("openenv", env_id="nope")
    with pytest.raises(ValueError, match="module 'no_such_module' cannot be imported"):
        make_env("openenv", env_id="no_such_module:Env")
    with pytest.raises(
        ValueError, match="neither an openenv Environment subclass nor a server app"
    ):
        make_env("openenv", env_id="openenv_example:FORMAT_PENALTY")
    with pytest.raises(ValueError, match="found 2 Action classes .* env.kwargs.action_cls"):
        make_env("openenv", env_id="openenv_example:app")
    with pytest.raises(ValueError, match="action_field='prompt' is not a text field"):
        make_env("openenv", env_id=GUESS, action_field="prompt")
    with pytest.raises(ValueError, match="env.kwargs.server='docker'"):
        make_env("openenv", env_id=GUESS, server="docker")
    broken = make_env("openenv", env_id="openenv_example:BrokenEnvironment")
    try:
        with pytest.raises(RuntimeError, match="constructor raised"):
            broken.tasks("train", 1, seed=0)
    finally:
        broken.close()


def test_openenv_server_process_that_fails_to_start_reports_its_stderr(tmp_path, monkeypatch):
    # Importable here, fails in the child: the server process exits before it listens.
    (tmp_path / "flaky_env_module.py").write_text(
        "import os\n"
        "if os.environ.get('OPENENV_TEST_CHILD'):\n"
        "    raise ImportError('the server side of this environment is not installed')\n"
        "from openenv_example import GuessEnvironment as Flaky\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("openenv", env_id="flaky_env_module:Flaky", server="process")
    monkeypatch.setenv("OPENENV_TEST_CHILD", "1")
    try:
        with pytest.raises(RuntimeError, match="exited with code 1") as e:
            env.tasks("train", 1, seed=0)
    finally:
        env.close()
    message = str(e.value)
    assert "server=process" in message and "not installed" in message


@pytest.mark.slow
def test_openenv_trains_by_config(ray_session, tmp_path, capsys):
    from test_byo_env import _rl_steps, _run_dirs, _train

    _train(
        tmp_path,
        "env.name=openenv",
        f"env.kwargs.env_id={GUESS}",
        "env.max_turns=2",
        "model.max_seq_len=256",
    )
    assert "tasks: the environment's own" in capsys.readouterr().out
    (run_dir,) = _run_dirs(tmp_path)
    assert _rl_steps(run_dir) == [1, 2]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["env"] == "openenv"
