"""The memory plan (issue 23, item 5): its params and optimizer bytes are those of the
learner's real train state, its KV bytes what the engine allocates, `raytunix plan` prints
the table (or JSON) and refuses a run that cannot fit, and `raytunix train` stops such a run
before anything starts."""

import json

import jax
import jax.numpy as jnp
import pytest

from raytunix.cli import main
from raytunix.config import ConfigError, load_config
from raytunix.driver import steps
from raytunix.driver.memory_plan import (
    ITEMS,
    Capacity,
    MemoryPlanError,
    activation_bytes,
    memory_plan,
    model_shape,
)
from raytunix.inference.engine import InferenceEngine
from raytunix.learner.learner import Learner, RLHyperparams, SFTHyperparams
from raytunix.learner.train_state import create_train_state, make_sft_update
from raytunix.models.llama import init_model
from raytunix.models.tokenizer import Tokenizer

GIB = 2**30


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _plan(overrides, capacity_gib=64.0, devices=1):
    cfg = load_config("default", overrides)
    return cfg, memory_plan(cfg, Capacity(int(capacity_gib * GIB), "test", devices))


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_params_and_optimizer_bytes_are_those_of_the_real_train_state(estimator):
    cfg, plan = _plan([f"learner.advantage_estimator={estimator}", "warmup.enabled=false"])
    learner = Learner(model_shape(cfg), seed=cfg.run.seed)
    learner.start_rl(RLHyperparams.from_config(cfg))
    state = learner._state
    items = plan.devices[0].items
    assert items["params"] == _nbytes((state.params, state.value_head))
    assert items["optimizer_state"] == _nbytes((state.opt_state, state.value_opt_state))
    assert items["new_state"] == items["params"] + items["optimizer_state"]
    assert items["engine_weights"] == 0  # a colocated engine reads the learner's arrays


def test_with_a_warm_start_the_larger_optimizer_state_of_the_two_phases_counts():
    cfg, plan = _plan(["learner.optimizer=sgd"])  # RL without moments, the warm start's AdamW
    learner = Learner(model_shape(cfg), seed=cfg.run.seed)
    learner.start_warmup(SFTHyperparams.from_config(cfg))
    warm = _nbytes(learner._state.opt_state)
    assert warm > 2 * _nbytes(learner._state.params)  # two moments
    assert plan.devices[0].items["optimizer_state"] == warm
    assert "warm start" in plan.how["optimizer_state"]


def _engine_kv_bytes(cfg):
    """Bytes of the KV pages the engine of ``cfg`` allocates (the tiny model, 300 ids)."""
    model = model_shape(cfg, vocab_size=300)
    graphdef, params = init_model(model, 0)
    engine = InferenceEngine(
        graphdef,
        params,
        model,
        Tokenizer.byte_level(),
        **{**cfg.engine.engine_kwargs(), "compile_ahead": False},
    )
    engine._ensure_buffers()
    return _nbytes(engine._pages)


def test_kv_bytes_are_what_the_engine_allocates():
    for kv_tokens in (0, 1000):  # the default pool, and 1000 tokens: 63 blocks of 16
        cfg, plan = _plan([f"engine.kv_cache_tokens={kv_tokens}", "engine.max_batch_size=8"])
        assert plan.devices[0].items["kv_cache"] == _engine_kv_bytes(cfg)
    assert plan.devices[0].items["kv_cache"] == 2 * 3 * 63 * 2 * 16 * 32 * 4  # k+v, layers...


def test_fsdp_splits_every_matrix_and_keeps_the_norms_whole():
    _, one = _plan([])
    _, two = _plan(["learner.mesh_fsdp=2", "learner.mesh_data=1"], devices=2)
    norms = (3 * 2 * 128 + 128) * 4  # two per block and the final one, float32
    full = one.devices[0].items["params"]
    assert two.devices[0].items["params"] == (full - norms) // 2 + norms
    # A colocated engine no longer finds whole weights on device 0: it keeps its own copy,
    # and another while a new version is swapped in.
    assert one.devices[0].items["engine_weights"] == 0
    assert two.devices[0].items["engine_weights"] == 2 * full


def test_disaggregated_puts_the_engine_on_its_own_device():
    _, plan = _plan(["engine.placement=disaggregated", "learner.kl_coef=0.1"])
    learner, engine = plan.devices
    assert learner.items["kv_cache"] == learner.items["engine_weights"] == 0
    assert learner.items["reference_params"] == learner.items["params"]
    assert engine.items["engine_weights"] == 2 * learner.items["params"]
    assert engine.total == engine.items["engine_weights"] + engine.items["kv_cache"]
    # The update's new state and the activations never live at once.
    assert learner.total == sum(learner.items.values()) - learner.items["new_state"]


@pytest.mark.slow  # compiles the warm-start update
def test_the_activation_estimate_is_near_xlas_own_count():
    cfg = load_config("default", [])
    model = model_shape(cfg)
    graphdef, params = init_model(model, 0)
    optimizer = SFTHyperparams().optimizer()
    state = create_train_state(graphdef, params, optimizer, 0)
    rows, width = 16, 128
    tokens = jax.ShapeDtypeStruct((rows, width), jnp.int32)
    mask = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    compiled = make_sft_update(graphdef, optimizer).lower(state, tokens, mask, tokens, tokens)
    xla = compiled.compile().memory_analysis().temp_size_in_bytes
    estimate = activation_bytes(model, rows=rows, width=width - 1)
    assert 0.7 < estimate / xla < 1.3, (estimate, xla)


def test_raytunix_plan_prints_every_item_of_the_default_config_and_it_fits(capsys):
    assert main(["plan", "--device-memory", "16"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert set(ITEMS) | {"total", "capacity", "fits:"} <= set(lines)
    assert "16.0 GiB" in lines["capacity"] and "--device-memory=16" in lines["capacity"]
    assert lines["fits:"].startswith("fits: yes")
    assert "4096 blocks x 16 tokens" in lines["kv_cache"]  # 4 x 128 rows x 128 tokens / 16


def test_raytunix_plan_json(capsys):
    assert main(["plan", "--json", "--device-memory", "16", "engine.placement=disaggregated"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in plan["devices"]] == ["learner device", "engine device"]
    assert list(plan["devices"][0]["items"]) == list(ITEMS)
    assert plan["capacity_bytes"] == 16 * GIB and plan["fits"] is True
    assert plan["largest"]["item"] == "activations"


def test_raytunix_plan_refuses_a_run_that_cannot_fit_naming_the_largest_item(capsys):
    assert main(["plan", "--device-memory", "0.05"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "largest item is activations" in err
    assert "51.2 MiB" in err and "learner.micro_batch_size" in err
    huge = ["model.d_model=8192", "model.n_layers=8", "model.n_heads=64", "model.d_ff=28672"]
    assert main(["plan", "--device-memory", "80", "learner.micro_batch_size=8", *huge]) == 2
    err = capsys.readouterr().err
    assert "largest item is new_state" in err and "learner.mesh_fsdp" in err


def test_a_mesh_the_devices_do_not_fit_is_a_config_error(capsys):
    assert main(["plan", "--devices", "3", "learner.mesh_fsdp=2"]) == 2
    assert "learner.mesh_fsdp=2" in capsys.readouterr().err


def test_train_stops_before_anything_starts_when_the_run_cannot_fit(tmp_path, capsys):
    out = tmp_path / "runs"
    cfg = load_config("default", [f"run.output_dir={out}", "run.device_memory_gib=0.05"])
    with pytest.raises(MemoryPlanError, match="largest item is activations") as error:
        steps.open_run(cfg, None)
    assert isinstance(error.value, ConfigError) and not out.exists()  # no run directory
    assert main(["train", f"run.output_dir={out}", "run.device_memory_gib=0.05"]) == 2
    assert "config error: the run does not fit" in capsys.readouterr().err
    assert not out.exists()


def test_a_run_that_fits_says_how_full_its_fullest_device_is(tmp_path, capsys):
    cfg = load_config("default", [f"run.output_dir={tmp_path}", "run.device_memory_gib=16"])
    _, run, _ = steps.open_run(cfg, None)
    run.unlock()
    assert "memory plan: the policy device (learner + engine) needs" in capsys.readouterr().out


@pytest.mark.slow  # starts a Python process that imports JAX
def test_the_driver_measures_the_devices_in_a_child_process():
    from raytunix.driver.memory_plan import probe_devices, probe_devices_elsewhere

    child, here = probe_devices_elsewhere(), probe_devices()
    assert child is not None
    assert (child.platform, child.count, child.bytes_limit) == (
        here.platform,
        here.count,
        here.bytes_limit,
    )
    assert child.host_available is None or child.host_available > 0


def test_a_bfloat16_run_plans_its_kv_pages_and_engine_copy_in_bfloat16():
    cfg, plan = _plan(["model.dtype=bfloat16", "engine.max_batch_size=8"])
    _, fp32 = _plan(["engine.max_batch_size=8"])
    items, fp32_items = plan.devices[0].items, fp32.devices[0].items
    assert items["kv_cache"] == _engine_kv_bytes(cfg) == fp32_items["kv_cache"] // 2
    # the learner keeps float32 params (the master weights) and optimizer state ...
    assert (items["params"], items["optimizer_state"], items["master_weights"]) == (
        fp32_items["params"],
        fp32_items["optimizer_state"],
        0,
    )
    # ... and the colocated engine holds a bfloat16 copy, twice while one is swapped in
    assert fp32_items["engine_weights"] == 0
    assert items["engine_weights"] == 2 * (fp32_items["params"] // 2)


def test_with_lora_the_optimizer_state_and_gradients_are_the_adapters_and_the_base_is_free():
    overrides = ["learner.lora_rank=8", "warmup.enabled=false", "learner.kl_coef=0.05"]
    cfg, plan = _plan(overrides)
    _, full = _plan(["warmup.enabled=false", "learner.kl_coef=0.05"])
    learner = Learner(model_shape(cfg), seed=cfg.run.seed)
    learner.start_rl(RLHyperparams.from_config(cfg))
    state = learner._state
    items, whole = plan.devices[0].items, full.devices[0].items
    adapters = _nbytes(state.params)
    assert 0 < adapters < _nbytes(state.base) // 4
    assert items["optimizer_state"] == _nbytes(state.opt_state) < whole["optimizer_state"] // 4
    twice = "twice" in plan.how["gradients"]
    assert items["gradients"] == adapters * (2 if twice else 1)
    assert items["new_state"] == adapters + items["optimizer_state"]
    assert items["reference_params"] == 0 < whole["reference_params"]  # the base is the reference
    merged = sum(  # each adapted kernel, as the forward builds it
        a["lora_A"].shape[1] * a["lora_B"].shape[0] * 4 for a in state.params.values()
    )
    assert items["params"] == _nbytes(state.base) + adapters + merged
    assert items["engine_weights"] > 0 == whole["engine_weights"]  # merged weights: a copy
    assert plan.devices[0].total < full.devices[0].total


def test_a_separate_lora_engine_holds_the_base_beside_the_merged_weights():
    # It is sent the adapters only and merges them onto the learner's base, kept on its device.
    overrides = ["engine.placement=disaggregated", "learner.lora_rank=8", "model.dtype=bfloat16"]
    _, lora = _plan(overrides)
    _, whole = _plan(overrides[:1] + overrides[2:])
    engine, engine_whole = lora.devices[1].items, whole.devices[1].items
    assert engine_whole["engine_weights"] % 2 == 0
    assert engine["engine_weights"] == 3 * (engine_whole["engine_weights"] // 2)
    assert "LoRA base in bfloat16" in lora.how["engine_weights"]
    assert "base" not in whole.how["engine_weights"]
