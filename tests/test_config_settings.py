"""A setting is declared once, in its field (``setting(default, doc, bounds=, resume=)``):
validation, the resume rule and ``raytunix config --explain`` follow from it, and the
README's key tables agree with it."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Literal

import pytest

from raytunix import cli
from raytunix.config import (
    Config,
    ConfigError,
    explain,
    load_config,
    resumable_keys,
    setting,
    settings,
)
from raytunix.driver.run_dir import RESUME_OVERRIDABLE, load_run_config

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


# A section that exists only in this test: three fields and nothing else anywhere.
@dataclasses.dataclass
class ProbeConfig:
    rate: float = setting(0.5, "a test-only fraction", bounds="(0, 1]", resume=True)
    width: int = setting(4, "a test-only count of things", bounds="> 0", hint="at least one thing")
    mode: Literal["fast", "slow"] = setting("fast", "a test-only choice")


@dataclasses.dataclass
class ProbeRunConfig(Config):
    probe: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)


# A section declared the old way, with a bare default and no doc.
@dataclasses.dataclass
class Plain:
    count: int = 3


@dataclasses.dataclass
class WithPlain(Config):
    plain: Plain = dataclasses.field(default_factory=Plain)


def test_a_new_sections_settings_load_coerce_and_keep_their_defaults():
    cfg = load_config(None, ["probe.rate=0.25", "probe.mode=slow"], schema=ProbeRunConfig)
    assert (cfg.probe.rate, cfg.probe.width, cfg.probe.mode) == (0.25, 4, "slow")
    assert load_config(None, schema=ProbeRunConfig).probe == ProbeConfig()


@pytest.mark.parametrize(
    "override, message",
    [
        ("probe.rate=0", "probe.rate=0.0 must be in (0, 1]"),
        ("probe.rate=1.5", "probe.rate=1.5 must be in (0, 1]"),
        ("probe.rate=nan", "probe.rate=nan must be a number in (0, 1]"),
        ("probe.width=0", "probe.width=0 must be > 0 (at least one thing)."),
        ("probe.width=2.5", "probe.width=2.5 is not an integer"),
        ("probe.mode=medium", "probe.mode='medium' is not one of fast, slow"),
        ("probe.depth=3", "unknown key 'probe.depth'; valid keys in 'probe': rate, width, mode"),
    ],
)
def test_a_new_sections_bounds_and_choices_are_enforced_from_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override], schema=ProbeRunConfig)


def test_a_new_sections_settings_are_explained_from_the_field():
    text = explain("probe.rate", schema=ProbeRunConfig)
    assert text.splitlines() == [
        "probe.rate: float = 0.5",
        "  allowed: (0, 1]",
        "  resume:  may change on --resume",
        "  a test-only fraction",
    ]
    section = explain("probe", schema=ProbeRunConfig)
    assert [line.split(":")[0] for line in section.splitlines() if line.startswith("probe.")] == [
        "probe.rate",
        "probe.width",
        "probe.mode",
    ]
    assert "allowed: one of fast | slow" in section and "fixed once the run starts" in section
    assert "allowed: > 0 (at least one thing)" in section
    assert "| `probe.width` | int | `4` | > 0 | fixed | a test-only count of things |" in explain(
        "probe", schema=ProbeRunConfig, markdown=True
    )
    with pytest.raises(ConfigError, match="did you mean probe.rate"):
        explain("probe.rat", schema=ProbeRunConfig)


def test_a_new_sections_resume_rule_comes_from_the_field(tmp_path):
    cfg = load_config(None, ["probe.width=6"], schema=ProbeRunConfig)
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    assert "probe.rate" in resumable_keys(ProbeRunConfig)
    resumed = load_run_config(str(tmp_path), ["probe.rate=0.75"], schema=ProbeRunConfig)
    assert (resumed.probe.rate, resumed.probe.width) == (0.75, 6)
    with pytest.raises(ConfigError, match="probe.width cannot change when resuming"):
        load_run_config(str(tmp_path), ["probe.width=8"], schema=ProbeRunConfig)
    with pytest.raises(ConfigError, match=re.escape("probe.rate=2.0 must be in (0, 1]")):
        load_run_config(str(tmp_path), ["probe.rate=2"], schema=ProbeRunConfig)


def test_a_field_without_its_doc_or_with_malformed_bounds_is_refused_at_declaration():
    with pytest.raises(TypeError, match="needs its one-line doc"):
        setting(1)
    with pytest.raises(TypeError, match=r"bounds='positive' must look like"):
        setting(1, "a count", bounds="positive")
    with pytest.raises(TypeError, match="Plain.count is not declared with setting"):
        settings(WithPlain)


def test_every_shipped_setting_has_a_doc_and_a_default_within_its_bounds():
    table = settings()
    assert len(table) > 100 and all(s.doc.strip() for s in table.values())
    assert resumable_keys() == RESUME_OVERRIDABLE and "learner.rl_steps" in RESUME_OVERRIDABLE
    assert "model.d_model" not in RESUME_OVERRIDABLE  # the checkpoint's shape
    assert table["rollout.stale_token_policy"].choices == ("drop", "mask", "accept")
    # Config() is valid as it stands (no shipped default breaks its own bounds).
    load_config(None)


def test_the_command_line_explains_a_key_and_names_close_matches_for_a_bad_one(capsys):
    assert cli.main(["config", "--explain", "rollout.group_size"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "rollout.group_size: int = 8\n  allowed: >= 2 (GRPO needs at least 2 samples per task)\n"
    )
    assert cli.main(["config", "--explain", "rollout.grup_size"]) == 2
    assert "did you mean rollout.group_size" in capsys.readouterr().err
    assert cli.main(["config", "--explain", "rollout", "rollout.group_size=4"]) == 2
    assert (
        "takes one SECTION or KEY, not overrides (rollout.group_size=4)" in capsys.readouterr().err
    )
    # More keys, or the key after another option: each suggested command works as given.
    assert cli.main(["config", "--explain", "rollout.top_k", "rollout.top_p"]) == 2
    err = capsys.readouterr().err
    assert "run `raytunix config --explain rollout.top_k`, `raytunix config --explain " in err
    for argv in (
        ["config", "--explain", "rollout.top_k"],
        ["config", "--explain", "rollout.top_p"],
    ):
        assert cli.main(argv) == 0
    assert cli.main(["config", "--explain", "--config", "single_turn", "env.max_turns"]) == 2
    assert "run `raytunix config --explain env.max_turns`" in capsys.readouterr().err
    assert cli.main(["config", "--explain", "--markdown"]) == 0
    tables = capsys.readouterr().out
    assert tables.count("| key | type | default |") == len({k.split(".")[0] for k in settings()})


def _readme_default(text: str):
    """A README table's default cell, as a value: `drop` -> "drop", true, 0.95, `{}` ..."""
    text = re.sub(r"\s*\(.*\)$", "", text.strip()).strip("`")
    if text in ("empty", '""'):
        return ""
    if text in ("true", "false"):
        return text == "true"
    if text == "{}":
        return {}
    try:
        return float(text)
    except ValueError:
        return text


def test_the_readme_names_only_settings_that_exist_with_their_real_defaults():
    table = settings()
    sections = {k.split(".")[0] for k in table}
    readme = open(README).read()
    mapping_keys = {k for k, s in table.items() if isinstance(s.default, dict)}
    for dotted in set(re.findall(r"`([a-z_]+\.[a-z_0-9.]+)", readme)):
        section = dotted.split(".")[0]
        if section not in sections or dotted.endswith((".py", ".yaml", ".json", ".jsonl")):
            continue
        key = ".".join(dotted.split(".")[:2])
        assert key in table, f"README names {dotted!r}, which is no setting"
        assert dotted == key or key in mapping_keys, f"README names {dotted!r}"
    # Rows of the "| key | default | ..." tables: `a` / `b` | 1 / 2 (or `a`, `b` | 1, 2).
    checked, in_table, lines = 0, False, readme.splitlines()
    for number, line in enumerate(lines):
        if line.startswith("| key | default |"):
            # The prose above a table of bare keys names their section ("`engine.*` keys"),
            # and may say they all may change on --resume.
            above = " ".join(lines[max(0, number - 4) : number])
            named = re.findall(r"`([a-z]+)\.\*`", above)
            all_resume = bool(re.search(r"(all|each) may change on `--resume`", above))
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
        if not in_table or line.startswith("|---"):
            continue
        keys_cell, default_cell = line.split(" | ")[:2]
        keys = re.findall(r"`([a-z_.]+)`", keys_cell)
        defaults = re.split(r" / |, ", default_cell.strip())
        if len(defaults) != len(keys):
            defaults = [default_cell] * len(keys)  # one default said for all ("empty")
        section = named[-1] if named else None
        for name, default in zip(keys, defaults):
            if "." in name:
                section = name.split(".")[0]
            full = name if "." in name else f"{section}.{name}"
            assert full in table, f"README line {number + 1} names {full!r}, which is no setting"
            assert _readme_default(default) == table[full].default, (
                f"README line {number + 1} says {full} defaults to {default.strip()!r}; the "
                f"field says {table[full].default!r}"
            )
            assert table[full].resume or not all_resume, (
                f"README line {number + 1}: {full} cannot change on --resume, but the text "
                "above its table says every key there may"
            )
            checked += 1
    assert checked > 30


FLOAT_SETTINGS = [key for key, spec in settings(Config).items() if spec.type is float]


@pytest.mark.parametrize("value", ["inf", "-inf", ".inf", "1e400"])
def test_every_float_setting_refuses_an_infinite_value_by_name(value):
    # A declared range is a finite one: inf passed "> 0" and then overflowed a timer or a
    # kernel limit deep in a run. Floats without bounds must be refused by their own rule.
    assert len(FLOAT_SETTINGS) > 30
    for key in FLOAT_SETTINGS:
        with pytest.raises(ConfigError, match=re.escape(key + "=")):
            load_config(None, [f"{key}={value}"])


def test_a_bounded_float_names_finite_in_its_error():
    with pytest.raises(
        ConfigError,
        match=r"rollout.episode_timeout_s=inf must be a finite "
        r"number > 0",
    ):
        load_config(None, ["rollout.episode_timeout_s=inf"])
    with pytest.raises(
        ConfigError,
        match=r"rollout.top_p=-inf must be a finite number in "
        r"\(0, 1\]",
    ):
        load_config(None, ["rollout.top_p=-inf"])


INT_SETTINGS = [key for key, spec in settings(Config).items() if spec.type is int]


def test_every_int_setting_refuses_a_value_past_int64_by_name():
    # A seed of 2^63 passed and crashed the model's init with a traceback.
    assert len(INT_SETTINGS) > 30
    for key in INT_SETTINGS:
        for value in (2**63, -(2**63) - 1, 10**30):
            with pytest.raises(ConfigError, match=re.escape(f"{key}={value}")):
                load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("value", ["1e39", "-1e39", "3.5e38"])
def test_every_float_setting_refuses_a_value_past_float32(value):
    # learner.learning_rate=1e39 passed and every update came back NaN.
    for key in FLOAT_SETTINGS:
        with pytest.raises(ConfigError, match=re.escape(key + "=")):
            load_config(None, [f"{key}={value}"])


def test_seeds_are_32_bit():
    for key in ("run.seed", "data.seed"):
        with pytest.raises(ConfigError, match=re.escape(f"{key}=-1 must be in [0, 4294967295]")):
            load_config(None, [f"{key}=-1"])
        with pytest.raises(ConfigError, match=re.escape(f"{key}=4294967296")):
            load_config(None, [f"{key}=4294967296"])
        assert load_config(None, [f"{key}=4294967295"]) is not None


def test_choice_lists_kept_beside_the_schema_equal_the_behaviours_own():
    import typing

    from raytunix import config
    from raytunix.agents.parsers import TOOL_PARSERS
    from raytunix.gateway.recorder import EXTEND_RULES

    assert set(typing.get_args(config.ToolParserName)) == set(TOOL_PARSERS)
    assert set(typing.get_args(config.SegmentRule)) == set(EXTEND_RULES)
    with pytest.raises(ConfigError, match="gateway.tool_parser='nonsense' is not one of"):
        load_config(None, ["gateway.tool_parser=nonsense"])
