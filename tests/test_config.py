import random

import pytest

from raytunix.config import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    load_yaml,
    preset_names,
)


def test_every_preset_loads_and_validates():
    names = preset_names()
    assert {"default", "single_turn"} <= set(names)
    for name in names:
        assert isinstance(load_config(name), Config)
    single = load_config("single_turn")
    assert single.env.name == "math_verifier"
    assert single.env.max_turns == 1


def test_no_config_gives_the_defaults():
    assert load_config(None) == Config()


def test_yaml_file_then_overrides_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  group_size: 4\n  max_staleness: 0\nrun:\n  name: mine\n")
    cfg = load_config(
        str(path),
        overrides=[
            "rollout.group_size=6",
            "rollout.temperature=0.7",
            "rollout.drop_failed_groups=true",
            "rollout.group_size=5",
        ],
    )
    assert cfg.rollout.group_size == 5  # the last override wins
    assert cfg.rollout.max_staleness == 0  # from the file
    assert cfg.rollout.temperature == 0.7
    assert cfg.rollout.drop_failed_groups is True
    assert cfg.run.name == "mine"
    assert cfg.learner.rl_steps == Config().learner.rl_steps  # untouched keys keep defaults


def test_override_values_are_coerced_to_the_field_type():
    cfg = load_config(None, ["rollout.episode_timeout_s=5", "run.name=123", "learner.rl_steps=7.0"])
    assert cfg.rollout.episode_timeout_s == 5.0 and isinstance(cfg.rollout.episode_timeout_s, float)
    assert cfg.run.name == "123"
    assert cfg.learner.rl_steps == 7 and isinstance(cfg.learner.rl_steps, int)


@pytest.mark.parametrize(
    "override, named",
    [
        ("rollout.grup_size=4", "rollout.grup_size"),  # unknown key
        ("rolout.group_size=4", "rolout"),  # unknown section
        ("rollout.group_size=abc", "'abc'"),  # not an integer
        ("rollout.group_size=2.5", "2.5"),  # not a whole number
        ("rollout.group_size=true", "True"),  # a bool is not an integer
        ("rollout.temperature=hot", "'hot'"),  # not a number
        ("rollout.temperature=-0.5", "rollout.temperature=-0.5"),  # negative
        ("rollout.temperature=.inf", "rollout.temperature=inf"),  # not finite
        ("rollout.top_k=-1", "rollout.top_k=-1"),  # negative
        ("rollout.top_k=1", "rollout.top_k=1"),  # greedy in disguise
        ("rollout.top_k=2.5", "2.5"),  # not a whole number
        ("rollout.top_p=0", "rollout.top_p=0.0"),  # empty nucleus
        ("rollout.top_p=1.5", "rollout.top_p=1.5"),  # not a probability
        ("rollout.drop_failed_groups=maybe", "'maybe'"),  # not a boolean
        ("run.name=null", "None"),  # not a string
        ("rollout.group_size=1", "rollout.group_size=1"),  # GRPO needs two samples
        ("rollout.max_staleness=-1", "rollout.max_staleness=-1"),  # negative
        ("rollout.max_concurrent_episodes=0", "rollout.max_concurrent_episodes=0"),  # not positive
        ("env.name=chess", "'chess'"),  # not a choice
        ("warmup.target_tool_accuracy=1.5", "warmup.target_tool_accuracy=1.5"),  # not a probability
        ("model.n_heads=3", "model.n_heads=3"),  # d_model not divisible
        ("eval.heldout_size=500", "eval.heldout_size=500"),  # more than the held-out split
        ("run.profile_window_s=-1", "run.profile_window_s=-1.0"),  # negative
        ("run.profile_window_s=inf", "run.profile_window_s=inf"),  # a window that never closes
        ("run.profile_window_s=nan", "profile_window_s=nan must be a number >= 0"),  # not a number
        ("learner.learning_rate=nan", "learning_rate=nan must be a number > 0"),
        ("data.min_terms=-1", "data.min_terms=-1 must be >= 1"),  # arithmetic's own bounds
        ("data.max_digits=0", "data.max_digits=0 must be >= 1"),
        ("data.min_terms=5", "data.min_terms=5 exceeds data.max_terms=3"),  # an empty range
        ("data.min_digits=4", "data.min_digits=4 exceeds data.max_digits=3"),
        ("rollout.group_size", "rollout.group_size"),  # no '='
        ("group_size=4", "group_size"),  # no section
    ],
)
def test_bad_overrides_name_the_key_and_value(override, named):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert named in str(e.value)


def test_an_unknown_key_names_the_close_ones():
    with pytest.raises(ConfigError, match="did you mean learner.rl_steps"):
        load_config(None, ["learner.rl_step=5"])


def test_bad_value_in_a_file_names_the_file_key_and_value(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("learner:\n  rl_steps: many\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "learner.rl_steps" in str(e.value) and "'many'" in str(e.value)


@pytest.mark.parametrize(
    "text, named",
    [
        (
            "learner:\n  rl_steps: 5\nlearner:\n  kl_coef: 0.1\n",
            "'learner' appears twice, on lines 1 and 3",
        ),
        ("learner:\n  rl_steps: 5\n  rl_steps: 7\n", "'rl_steps' appears twice, on lines 2 and 3"),
    ],
)
def test_a_key_given_twice_in_a_file_is_refused_not_silently_dropped(tmp_path, text, named):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named) as e:
        load_config(str(path))
    assert str(path) in str(e.value)


def test_text_values_that_read_as_numbers_survive_a_save_and_reload():
    # The loader reads 1e3 as a number (YAML 1.2); the saved config.yaml must quote the
    # text "1e3", or a resumed run would get the float 1000.0 in its place.
    cfg = load_config(None, ['run.name="1e3"', 'data.dataset_kwargs.tag="5E-2"'])
    again = load_yaml(cfg.to_yaml())
    assert again["run"]["name"] == "1e3" and again["data"]["dataset_kwargs"]["tag"] == "5E-2"
    assert load_yaml("x: 1e3")["x"] == 1000.0  # the number itself still reads as one


@pytest.mark.parametrize(
    "text, named",
    [
        ("rollout: [1, 2\n", "not valid YAML"),
        ("- rollout\n- env\n", "top level must be a mapping"),
        ("[]\n", "top level must be a mapping of sections, got list"),  # empty, not a mapping
        ("0\n", "mapping of sections, got int"),
        ("false\n", "mapping of sections, got bool"),
        ("rollout: 3\n", "'rollout'"),
        ("training:\n  steps: 3\n", "'training'"),
        ("env:\n  nme: x\n", "env.nme"),
    ],
)
def test_malformed_files_raise_config_error(tmp_path, text, named):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert named in str(e.value)
    assert str(path) in str(e.value)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError) as e:
        load_config("no_such_preset")
    assert "'no_such_preset'" in str(e.value) and "default" in str(e.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_round_trip_through_yaml_and_dict(tmp_path):
    cfg = load_config(
        "default",
        [
            "rollout.max_staleness=0",
            "learner.kl_coef=0.01",
            "env.agent=tool",
            "rollout.drop_failed_groups=true",
        ],
    )
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(str(path)) == cfg
    assert config_from_dict(cfg.to_dict()) == cfg


def test_greedy_training_rollouts_are_refused_with_what_to_do():
    """Greedy rollouts (temperature 0) leave the policy gradient nothing to score: the
    config refuses them, naming the key and a working value."""
    with pytest.raises(ConfigError) as e:
        load_config("default", ["rollout.temperature=0"])
    message = str(e.value)
    assert "rollout.temperature=0.0" in message and "rollout.temperature=1.0" in message
    assert "greedy" in message


def test_rollout_sampling_settings_reach_the_learner_unchanged():
    from raytunix.learner.learner import RLHyperparams

    cfg = load_config(
        "default",
        [
            "rollout.temperature=0.7",
            "rollout.top_k=40",
            "rollout.top_p=0.9",
            "learner.kl_coef=0.01",
        ],
    )
    hp = RLHyperparams.from_config(cfg)
    assert (hp.temperature, hp.top_k, hp.top_p) == (0.7, 40, 0.9)
    assert hp.kl_coef == 0.01 and hp.clip_eps_high == cfg.learner.clip_eps_high
    defaults = RLHyperparams.from_config(load_config("default"))
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (1.0, 0, 1.0)


@pytest.mark.parametrize(
    "override, named",
    [
        ("rollout.max_consecutive_failures=-1", "rollout.max_consecutive_failures=-1"),
        ("rollout.max_episode_restarts=-2", "rollout.max_episode_restarts=-2"),
        ("rollout.max_group_retries=1.5", "1.5"),
        ("rollout.engine_retry_max_attempts=0", "rollout.engine_retry_max_attempts=0"),
        ("rollout.engine_retry_initial_delay_s=0", "rollout.engine_retry_initial_delay_s=0"),
        ("rollout.engine_retry_max_delay_s=0.01", "rollout.engine_retry_max_delay_s=0.01"),
        ("rollout.engine_retry_multiplier=0.5", "rollout.engine_retry_multiplier=0.5"),
        ("rollout.engine_retry_jitter=2", "rollout.engine_retry_jitter=2.0"),
        ("rollout.retry_initial_delay_s=-1", "rollout.retry_initial_delay_s=-1"),
        ("rollout.retry_initial_delay_s=.inf", "rollout.retry_initial_delay_s=inf"),
        ("rollout.retry_max_delay_s=.inf", "rollout.retry_max_delay_s=inf"),
        ("rollout.retry_multiplier=.nan", "rollout.retry_multiplier=nan"),
        ("rollout.retry_jitter=-0.1", "rollout.retry_jitter=-0.1"),
    ],
)
def test_bad_fault_settings_name_the_key_and_value(override, named):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert named in str(e.value)


def test_fault_settings_reach_the_orchestrator_as_backoff_schedules():
    from raytunix.driver.job import fault_kwargs as _fault_kwargs
    from raytunix.train import RESUME_OVERRIDABLE

    cfg = load_config(
        None,
        [
            "rollout.max_consecutive_failures=0",
            "rollout.max_episode_restarts=5",
            "rollout.max_group_retries=1",
            "rollout.engine_retry_max_attempts=3",
            "rollout.engine_retry_initial_delay_s=0.2",
            "rollout.engine_retry_max_delay_s=0.8",
            "rollout.engine_retry_multiplier=4",
            "rollout.engine_retry_jitter=0",
            "rollout.retry_initial_delay_s=1",
            "rollout.retry_max_delay_s=2",
            "rollout.retry_multiplier=1.5",
            "rollout.retry_jitter=1",
        ],
    )
    kwargs = _fault_kwargs(cfg.rollout)
    assert (
        kwargs["max_consecutive_failures"],
        kwargs["max_episode_restarts"],
        kwargs["max_group_retries"],
    ) == (0, 5, 1)
    engine = kwargs["engine_backoff"]
    assert engine.max_attempts == 3 and engine.jitter == 0.0
    rng = random.Random(0)
    assert [engine.delay_s(k, rng) for k in range(3)] == [0.2, 0.8, 0.8]  # x4, capped
    retry = kwargs["retry_backoff"]
    assert (retry.initial_delay_s, retry.max_delay_s, retry.multiplier, retry.jitter) == (
        1.0,
        2.0,
        1.5,
        1.0,
    )
    # None of them changes what a checkpoint holds: a resume may change each.
    fault_keys = {
        f"rollout.{k}"
        for k in vars(cfg.rollout)
        if k.startswith(("max_episode", "max_group", "max_consecutive", "engine_retry", "retry_"))
    }
    assert len(fault_keys) == 12 and fault_keys <= RESUME_OVERRIDABLE


def test_scientific_notation_is_a_number_in_files_and_overrides(tmp_path):
    from raytunix.config import load_yaml, parse_override

    # YAML 1.1 reads 1e1 as text; configs read it as YAML 1.2 and JSON do.
    assert load_yaml("a: 1e1\nb: -2E-3\nc: 1.5e+2\nd: 1e\ne: 12\nf: v1e1\n") == {
        "a": 10.0,
        "b": -0.002,
        "c": 150.0,
        "d": "1e",
        "e": 12,
        "f": "v1e1",
    }
    assert parse_override("env.kwargs.scale=1e1") == ("env", "kwargs.scale", 10.0)
    assert load_config(None, ["learner.learning_rate=3e-5"]).learner.learning_rate == 3e-5
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  learning_rate: 2e-4\n")
    assert load_config(str(path)).learner.learning_rate == 2e-4


def test_an_empty_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert load_config(str(path)) == load_config(None)


def test_dotted_overrides_reach_into_nested_mappings_and_keep_their_neighbours():
    from raytunix.config import Config, apply_override

    cfg = Config()
    for item in (
        "env.kwargs.make_kwargs.gem_id=abc",
        "env.kwargs.make_kwargs.n=3",
        "env.kwargs.x=1",
    ):
        assert apply_override(cfg, item) == "env.kwargs"
    assert cfg.env.kwargs == {"make_kwargs": {"gem_id": "abc", "n": 3}, "x": 1}
    apply_override(cfg, "env.kwargs.make_kwargs.n=4")
    assert cfg.env.kwargs == {"make_kwargs": {"gem_id": "abc", "n": 4}, "x": 1}
    with pytest.raises(ConfigError, match=r"env.kwargs.x is 1, not a mapping.*'env.kwargs.x=\{y"):
        apply_override(cfg, "env.kwargs.x.y=2")
    with pytest.raises(ConfigError, match="must be section.key"):
        apply_override(cfg, "env.kwargs..y=2")  # an empty name on the way


def test_a_setting_another_one_makes_of_no_effect_is_named_with_the_one_that_decides():
    from raytunix.config import shadowed_settings

    cfg = load_config(None, ["warmup.enabled=false", "warmup.max_steps=500"])
    assert shadowed_settings(cfg) == [
        "warmup.max_steps=500 has no effect: warmup.enabled=false, so there is no warm start."
    ]
    assert shadowed_settings(load_config(None, ["warmup.max_steps=500"])) == []
    cfg.model.path, cfg.model.d_model = "/models/qwen", 64  # unvalidated: no folder needed
    assert any(
        line.startswith("model.d_model=64 has no effect: model.path='/models/qwen'")
        for line in shadowed_settings(cfg)
    )
    from raytunix.config import preset_names

    for name in preset_names():  # the shipped presets say nothing twice
        assert shadowed_settings(load_config(name)) == [], name


def test_a_run_whose_env_is_overridden_is_named_after_that_env_unless_a_name_is_given(tmp_path):
    assert load_config("default").run.name == "calculator-grpo"
    assert load_config("default", ["env.name=python_math"]).run.name == "python-math-grpo"
    named = ["env.name=python_math", "run.name=mine"]
    assert load_config("default", named).run.name == "mine"
    # the preset's own env, set again, keeps the preset's name
    assert load_config("default", ["env.name=calculator_math"]).run.name == "calculator-grpo"
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  name: my-experiment\n")
    assert load_config(str(path), ["env.name=python_math"]).run.name == "my-experiment"
