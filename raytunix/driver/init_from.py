"""``model.init_from=RUN_DIR``: a new run that starts from an earlier run's policy.

The earlier run lends three things and keeps all of its files: its model shape
(``model.path`` and the sizes, from its config.yaml), its tokenizer (copied into the new
run, so the new run stands alone and resumes without it) and the policy weights of its
newest readable checkpoint (RL checkpoints first, else its warm start's). The optimizer,
step count and data position start fresh, so the new run may train another environment.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from raytunix.config import Config, ConfigError, ModelConfig
from raytunix.driver.run_dir import RunDir, has_steps, load_run_config, say

# What the weights depend on: a new run takes these from the run it starts from.
SHAPE_KEYS = (
    "path",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "tokenizer_vocab_size",
)


def source_checkpoints(source: RunDir) -> str:
    """The checkpoint directory of the run ``source`` whose newest policy a new run starts
    from: its RL checkpoints when it has any, else its warm start's; "" for neither."""
    for directory in (source.checkpoints, source.warmup):
        if has_steps(directory):
            return directory
    return ""


def adopt_init_from(cfg: Config) -> Config:
    """``cfg`` with ``model.init_from`` made absolute and the model shape (``SHAPE_KEYS``)
    of the run it names; ``cfg`` itself when ``model.init_from`` is "". A shape key this
    config sets to a value other than its default and the earlier run's is an error, not
    silently replaced; one taken over is said on the console.

    Raises:
      ConfigError: ``model.init_from`` is not a run directory, has no checkpoint or no
        tokenizer, or this config sets a model size the earlier run was not trained with.
    """
    given = cfg.model.init_from
    if not given:
        return cfg
    path = os.path.abspath(os.path.expanduser(given))
    try:
        earlier = load_run_config(path)
    except FileNotFoundError as e:
        raise ConfigError(f"model.init_from={given!r}: {e}") from None
    except ConfigError as e:
        raise ConfigError(
            f"model.init_from={given!r}: its config.yaml cannot be read: {e}"
        ) from None
    source = RunDir(path)
    if not source_checkpoints(source):
        raise ConfigError(
            f"model.init_from={given!r} has no checkpoint (neither {source.checkpoints} nor "
            f"{source.warmup} holds a step): start from a run that saved one "
            "(learner.checkpoint_every), or drop model.init_from."
        )
    if not earlier.model.path and not os.path.exists(source.tokenizer):
        raise ConfigError(
            f"model.init_from={given!r} has no tokenizer.json, so its token ids cannot be "
            "read; start from a run directory that has one."
        )
    defaults = ModelConfig()
    taken = {}
    for key in SHAPE_KEYS:
        mine, theirs = getattr(cfg.model, key), getattr(earlier.model, key)
        if mine == theirs:
            continue
        if mine != getattr(defaults, key):
            raise ConfigError(
                f"model.{key}={mine!r}, but model.init_from={given!r} was trained with "
                f"model.{key}={theirs!r}: its weights fit only their own shape. Drop "
                f"model.{key} (it is taken from that run) or start from another run."
            )
        taken[key] = theirs
    if taken:
        said = ", ".join(f"model.{k}={v!r}" for k, v in taken.items())
        say(f"model.init_from={path}: the model shape is that run's ({said})")
    model = dataclasses.replace(cfg.model, init_from=path, **taken)
    return dataclasses.replace(cfg, model=model)


def copy_tokenizer(cfg: Config, run: RunDir) -> None:
    """Copies the earlier run's tokenizer.json into ``run`` (a ``model.init_from`` run
    without ``model.path``), unless ``run`` has one already (a resumed run)."""
    if cfg.model.init_from and not cfg.model.path and not os.path.exists(run.tokenizer):
        shutil.copyfile(RunDir(cfg.model.init_from).tokenizer, run.tokenizer)


def initial_checkpoints(cfg: Config, run: RunDir) -> str:
    """The checkpoint directory the learner takes its first weights from: the earlier
    run's (``source_checkpoints``) for a ``model.init_from`` run that has saved nothing of
    its own yet; "" otherwise (a resumed run restores its own checkpoints instead)."""
    if not cfg.model.init_from or run.has_rl_checkpoint() or os.path.isdir(run.warmup):
        return ""
    return source_checkpoints(RunDir(cfg.model.init_from))
