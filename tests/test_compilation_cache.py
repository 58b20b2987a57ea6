"""JAX's persistent compilation cache is on by default for the processes that compile (the
learner and the engines), so a second run on the same machine compiles nothing the first
one compiled; ``run.compilation_cache_dir=""`` turns it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import ray
import pytest

from raytunix.config import load_config
from raytunix.driver.prepare import compilation_cache_env, jit_actor_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh process: a real Learner's warm-start steps on a tiny model, counting JAX's cache
# events (each compile asks the cache first: a hit loads, a miss compiles and stores).
LEARNER_PROCESS = textwrap.dedent("""
    import json, os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    from jax import monitoring
    counts = {}
    monitoring.register_event_listener(
        lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
    from raytunix.learner.learner import Learner, SFTHyperparams
    from raytunix.models.llama import ModelConfig
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                         d_ff=64, max_seq_len=32)
    learner = Learner(config, seed=0)
    learner.start_warmup(SFTHyperparams(learning_rate=1e-3, warmup_steps=0))
    tokens = np.arange(4 * 32, dtype=np.int32).reshape(4, 32) % 64
    mask = np.ones((4, 32), np.float32)
    mask[:, 0] = 0
    learner.sft_steps(tokens, mask, num_steps=2, batch_size=4)
    print(json.dumps({k.rsplit("/", 1)[-1]: v for k, v in counts.items()
                      if "compilation_cache" in k}))
""")


def _run_learner(env_vars: dict[str, str]) -> dict[str, int]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAX_COMPILATION_CACHE") and not k.startswith("JAX_PERSISTENT_CACHE")
    }
    env.update(env_vars, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", LEARNER_PROCESS],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_default_cache_is_under_the_users_cache_dir():
    env = compilation_cache_env(load_config(None, []))
    assert env["JAX_COMPILATION_CACHE_DIR"] == os.path.join(
        os.path.expanduser("~"), ".cache", "raytunix", "jax"
    )
    assert float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == 1.0


def test_an_empty_dir_turns_the_cache_off():
    cfg = load_config(None, ["run.compilation_cache_dir="])
    assert compilation_cache_env(cfg) == {}
    assert jit_actor_options(cfg) == {}


@pytest.mark.slow
def test_a_second_process_with_the_same_cache_dir_compiles_nothing(tmp_path):
    cfg = load_config(
        None,
        [
            f"run.compilation_cache_dir={tmp_path / 'cache'}",
            "run.compilation_cache_min_compile_s=0",
        ],
    )
    env = compilation_cache_env(cfg)
    first = _run_learner(env)
    assert first.get("cache_misses", 0) > 0  # it compiled, and stored what it compiled
    assert os.listdir(tmp_path / "cache")
    second = _run_learner(env)
    assert second.get("cache_misses", 0) == 0, second
    assert second.get("cache_hits", 0) >= first["cache_misses"] - first.get("cache_hits", 0)


@pytest.mark.slow
def test_without_the_cache_every_process_compiles_again(tmp_path):
    off = compilation_cache_env(load_config(None, ["run.compilation_cache_dir="]))
    counts = _run_learner(off)
    assert counts.get("cache_hits", 0) == 0


@ray.remote(num_cpus=0)
class _Compiler:
    def compile_once(self) -> str:
        import jax
        import jax.numpy as jnp

        jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((8, 8))).block_until_ready()
        return os.environ.get("JAX_COMPILATION_CACHE_DIR", "")


def test_actors_started_with_the_jit_options_use_the_cache(ray_session, tmp_path):
    cfg = load_config(
        None,
        [
            f"run.compilation_cache_dir={tmp_path / 'cache'}",
            "run.compilation_cache_min_compile_s=0",
        ],
    )
    actor = _Compiler.options(**jit_actor_options(cfg)).remote()
    try:
        assert ray.get(actor.compile_once.remote(), timeout=300) == str(tmp_path / "cache")
    finally:
        ray.kill(actor)
    assert any("jit" in name for name in os.listdir(tmp_path / "cache"))
