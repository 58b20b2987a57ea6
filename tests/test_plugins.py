"""Names in config: registered names, entry points of installed packages, import paths;
constructor arguments checked against signatures; the checks that stop a run that would
train on nothing."""

from __future__ import annotations

import sys
import textwrap

import gymnasium
import pytest

from raytunix import plugins
from raytunix.envs import ENVS, BaseEnv, MathVerifierEnv, make_env, register_gymnasium_ids
from raytunix.rollout.preflight import PreflightError, check_batch, sample_tasks
from raytunix.tools import Calculator
from raytunix.types import Task


class NeedsSecret(BaseEnv):
    default_agent = "text"

    def __init__(self, secret: str, rounds: int = 1, scale: float | None = None, *, tag="x"):
        super().__init__()

    def _initial_observation(self, task):
        return task.question

    def _step_impl(self, action):
        raise NotImplementedError


@pytest.fixture
def installed_package(tmp_path, monkeypatch):
    """A package installed the way pip leaves one: a module plus a .dist-info folder whose
    entry_points.txt registers an environment, an agent and a tool."""
    (tmp_path / "tinyplug.py").write_text(
        textwrap.dedent("""
        from raytunix.agents import TextAgent
        from raytunix.envs import MathVerifierEnv
        from raytunix.tools import Calculator

        class PlugEnv(MathVerifierEnv):
            pass

        class PlugAgent(TextAgent):
            pass

        class PlugCalculator(Calculator):
            name = "plug_calculator"
    """)
    )
    dist = tmp_path / "tinyplug-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyplug\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[raytunix.envs]\nplug = tinyplug:PlugEnv\nbroken = tinyplug_missing:Env\n"
        "calculator_math = tinyplug:PlugEnv\n\n"
        "[raytunix.agents]\nplug_agent = tinyplug:PlugAgent\n\n"
        "[raytunix.tools]\nplug_calculator = tinyplug:PlugCalculator\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("tinyplug", None)


def test_registered_names_resolve_to_the_package_registry():
    assert plugins.resolve("env", "simulated_tool") is ENVS["simulated_tool"]
    assert plugins.resolve("tool", "calculator") is Calculator
    assert plugins.resolve("env", "raytunix.envs:MathVerifierEnv") is MathVerifierEnv
    with pytest.raises(
        plugins.PluginError,
        match="unknown environment 'chess'; registered: agent_program, bash_terminal, calculator_math",
    ):
        plugins.resolve("env", "chess")
    with pytest.raises(plugins.PluginError, match="not a subclass of raytunix.envs.base.BaseEnv"):
        plugins.resolve("env", "raytunix.tools:Calculator")
    with pytest.raises(plugins.PluginError, match="is abstract; implement _initial_observation"):
        plugins.resolve("env", "raytunix.envs:BaseEnv")
    with pytest.raises(
        plugins.PluginError, match="no module named 'no_such_pkg.agents' on this process's path"
    ):
        plugins.resolve("agent", "no_such_pkg.agents:Agent")


def test_entry_points_of_installed_packages(installed_package):
    env_cls = plugins.resolve("env", "plug")
    assert env_cls.__name__ == "PlugEnv" and issubclass(env_cls, MathVerifierEnv)
    assert isinstance(make_env("plug"), env_cls)
    assert plugins.resolve("agent", "plug_agent").__name__ == "PlugAgent"
    assert plugins.resolve("tool", "plug_calculator")().name == "plug_calculator"
    # A built-in name wins over a package that claims it too.
    assert plugins.resolve("env", "calculator_math") is ENVS["calculator_math"]
    names = plugins.registered_names("env")
    assert (
        names.index("plug") > names.index("simulated_tool") and names.count("calculator_math") == 1
    )
    with pytest.raises(
        plugins.PluginError,
        match="entry point 'tinyplug_missing:Env'.*package 'tinyplug'.*fails to load",
    ):
        plugins.resolve("env", "broken")
    # ... and gymnasium knows it as raytunix/plug.
    assert "raytunix/plug" in register_gymnasium_ids() or "raytunix/plug" in gymnasium.registry
    assert gymnasium.make("raytunix/plug", num_tasks=2).reset(seed=0)[0].startswith("Calculate")


def test_config_takes_entry_point_names(installed_package):
    from raytunix.config import load_config

    cfg = load_config(None, ["env.name=plug", "env.agent=plug_agent"])
    assert (cfg.env.name, cfg.env.agent) == ("plug", "plug_agent")


def test_check_kwargs_against_the_signature():
    check = plugins.check_kwargs
    check(NeedsSecret, {"secret": "s", "rounds": 2, "scale": 1, "tag": "y"}, key="env.kwargs")
    check(NeedsSecret, {"secret": "s", "scale": None}, key="env.kwargs")
    with pytest.raises(
        plugins.PluginError,
        match="env.kwargs.round: NeedsSecret takes no "
        "argument 'round'; it accepts secret, rounds, "
        "scale, tag",
    ):
        check(NeedsSecret, {"secret": "s", "round": 2}, key="env.kwargs")
    with pytest.raises(
        plugins.PluginError, match="NeedsSecret needs secret, which env.kwargs does not give"
    ):
        check(NeedsSecret, {}, key="env.kwargs")
    with pytest.raises(plugins.PluginError, match=r"env.kwargs.rounds='2' must be int"):
        check(NeedsSecret, {"secret": "s", "rounds": "2"}, key="env.kwargs")
    with pytest.raises(plugins.PluginError, match=r"env.kwargs.rounds=True must be int"):
        check(NeedsSecret, {"secret": "s", "rounds": True}, key="env.kwargs")
    with pytest.raises(plugins.PluginError, match=r"env.kwargs.scale=False must be float"):
        check(NeedsSecret, {"secret": "s", "scale": False}, key="env.kwargs")
    with pytest.raises(
        plugins.PluginError, match=r"env.kwargs.scale='big' must be float or NoneType"
    ):
        check(NeedsSecret, {"secret": "s", "scale": "big"}, key="env.kwargs")
    with pytest.raises(plugins.PluginError, match="must be a mapping"):
        check(NeedsSecret, ["secret"], key="env.kwargs")
    with pytest.raises(plugins.PluginError, match="set by raytunix itself"):
        check(
            plugins.resolve("agent", "text"),
            {"tokenizer": 1},
            key="env.agent_kwargs",
            provided=("tokenizer",),
        )


def test_tools_are_named_like_envs():
    assert list(make_env("calculator_math", tools=["raytunix.tools:Calculator"]).tools) == [
        "calculator"
    ]
    assert list(make_env("calculator_math", tools="calculator").tools) == ["calculator"]
    with pytest.raises(ValueError, match="tool names must be unique"):
        make_env("calculator_math", tools=["calculator", "raytunix.tools:Calculator"])
    with pytest.raises(plugins.PluginError, match="unknown tool 'abacus'"):
        make_env("calculator_math", tools=["abacus"])


def test_where_actors_find_modules_named_in_config(tmp_path, monkeypatch):
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    value = {
        "env_id": "pkg.sub.envs:Game-v0",
        "tools": ["pkg.sub:Tool", "calculator"],
        "url": "http://example.com:80",
        "own": "raytunix.tools:Calculator",
        "missing": "no_such_pkg:Thing",
    }
    assert plugins.module_roots(value) == [str(tmp_path)]
    assert "pkg.sub.envs" not in sys.modules  # found, not imported
    assert plugins.import_root(Calculator) is None  # raytunix's own: importable anyway
    plugins.add_import_paths(["/nonexistent/a", "/nonexistent/b"])
    try:
        assert sys.path[:2] == ["/nonexistent/a", "/nonexistent/b"]
    finally:
        sys.path.remove("/nonexistent/a")
        sys.path.remove("/nonexistent/b")
    for name in ("pkg", "pkg.sub"):
        sys.modules.pop(name, None)


def test_env_tasks_are_checked():
    from raytunix.data.tasks import env_tasks, make_tasks

    class Brings(BaseEnv):
        default_agent = "answer"

        def __init__(self, tasks):
            super().__init__()
            self._tasks = tasks

        def tasks(self, split, size, seed):
            return self._tasks

        def _initial_observation(self, task):
            return task.question

        def _step_impl(self, action):
            raise NotImplementedError

    two = [Task("a", "q", "1"), Task("b", "q", "2")]
    assert env_tasks(Brings(two), "train", 2, 0) == two
    assert env_tasks(MathVerifierEnv(), "train", 2, 0) is None
    assert len(make_tasks(MathVerifierEnv(), "heldout", 3, 0)) == 3  # arithmetic
    with pytest.raises(ValueError, match="returned 2 tasks; return exactly size"):
        env_tasks(Brings(two), "train", 3, 0)
    with pytest.raises(ValueError, match=r"repeats task ids \['a'\]"):
        env_tasks(Brings([Task("a", "q", "1")] * 2), "train", 2, 0)
    with pytest.raises(TypeError, match=r"\[1\] is str"):
        env_tasks(Brings([two[0], "q"]), "train", 2, 0)


def test_a_batch_with_nothing_to_learn_from_is_an_error():
    ok = {
        "num_trajectories": 4,
        "valid_trajectories": 3,
        "trainable_tokens": 40,
        "statuses": {"completed": 3, "env_error": 1},
    }
    check_batch(ok, step=1)
    with pytest.raises(
        PreflightError, match="RL step 5: every one of the batch's 4 episodes failed"
    ):
        check_batch({**ok, "valid_trajectories": 0, "statuses": {"env_error": 4}}, step=5)
    with pytest.raises(PreflightError, match="hold no generated token .*model.max_seq_len"):
        check_batch({**ok, "trainable_tokens": 0, "statuses": {"truncated": 4}}, step=2)


def test_sample_tasks_spreads_over_the_dataset():
    tasks = [Task(str(i), "q", "a") for i in range(10)]
    assert [t.task_id for t in sample_tasks(tasks, 4)] == ["0", "3", "6", "9"]
    assert sample_tasks(tasks, 20) == tasks and sample_tasks(tasks, 0) == []


def test_register_names_a_class_for_make_env_and_gymnasium():
    from raytunix.registry import PluginError as RegistryError, register

    class CoinEnv(MathVerifierEnv):
        """A class of the test's own, named by the decorator."""

    try:
        assert register("env", "coin_test")(CoinEnv) is CoinEnv
        assert ENVS["coin_test"] is CoinEnv  # ENVS is the registry itself
        assert plugins.resolve("env", "coin_test") is CoinEnv
        assert isinstance(make_env("coin_test"), CoinEnv)
        assert "coin_test" in plugins.registered_names("env")
        register("env", "coin_test")(CoinEnv)  # the same class again (a reload): kept
        with pytest.raises(
            RegistryError,
            match="'coin_test' is taken by .*CoinEnv; register "
            ".*MathVerifierEnv under another name",
        ):
            register("env", "coin_test")(MathVerifierEnv)
        assert "raytunix/coin_test" in register_gymnasium_ids()
        assert gymnasium.make("raytunix/coin_test", num_tasks=2).reset(seed=0)[0]
    finally:
        ENVS.pop("coin_test", None)
        gymnasium.registry.pop("raytunix/coin_test", None)
    with pytest.raises(RegistryError, match="name 'a:b' must be a non-empty string without ':'"):
        register("agent", "a:b")
    with pytest.raises(ValueError, match="kind 'model' is not one of env, agent, tool"):
        register("model", "m")
