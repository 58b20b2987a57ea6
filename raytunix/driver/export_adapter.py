"""``raytunix export-adapter RUN_DIR``: a LoRA run's adapters, from its newest RL
checkpoint, as a Hugging Face ``peft`` folder over the run's ``model.path``::

    raytunix export-adapter runs/2025-06-01_12-00-00
    # then, in PyTorch:
    base = AutoModelForCausalLM.from_pretrained(model_path)
    model = PeftModel.from_pretrained(base, "runs/2025-06-01_12-00-00/adapter")

A finished LoRA run has written ``RUN_DIR/adapter`` already (``steps.export_policy``); this
makes it from a checkpoint: of a run that stopped early, or into another folder. Only the
checkpoint's adapters are read (``Checkpointer.restore_params``), never the base model's
weights, so it runs on a CPU in seconds.
"""

from __future__ import annotations

import os

import jax

from raytunix.config import Config
from raytunix.driver.run_dir import RunDir, RunError, load_run_config
from raytunix.learner.checkpoint import Checkpointer
from raytunix.learner.lora import LoraSpec, init_adapters
from raytunix.models.hf import CheckpointError, abstract_model, export_adapters, read_model_config


def _lora_run_config(run_dir: str) -> Config:
    """The config of ``run_dir``, once it is known to be a LoRA run over ``model.path``
    with an RL checkpoint.

    Raises:
      FileNotFoundError: ``run_dir`` is not a run directory.
      RunError: the run trained the whole model, has no ``model.path`` or no RL
        checkpoint; the message says what to do instead.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(
            f"run directory {run_dir!r} does not exist; pass the directory `raytunix train` "
            "printed at start."
        )
    cfg = load_run_config(run_dir)
    if cfg.learner.lora_rank == 0:
        raise RunError(
            f"{run_dir!r} trained the whole model (learner.lora_rank=0), so it has no LoRA "
            f"adapters; its trained policy is the Hugging Face folder "
            f"{os.path.join(run_dir, 'export')} (runs with model.path). Train with "
            "learner.lora_rank > 0 (e.g. 8) to get adapters."
        )
    if not cfg.model.path:
        raise RunError(
            f"{run_dir!r} has no model.path: its base model is raytunix's own fresh init, "
            "which peft cannot load; train LoRA over a Hugging Face folder (model.path=DIR) "
            "to export adapters."
        )
    if not RunDir(run_dir).has_rl_checkpoint():
        raise RunError(
            f"{run_dir!r} has no RL checkpoint yet (none in "
            f"{os.path.join(run_dir, 'checkpoints')}), so no trained adapters; train it "
            "first, or --resume it."
        )
    return cfg


def export_run_adapters(run_dir: str, out_dir: str | None = None) -> tuple[str, int]:
    """Writes the adapters of ``run_dir``'s newest readable RL checkpoint to ``out_dir``
    (default ``RUN_DIR/adapter``) as a ``peft`` folder (``hf.export_adapters``).

    Returns:
      ``(the folder written, the RL step its adapters come from)``.

    Raises:
      FileNotFoundError, RunError: as ``_lora_run_config``; RunError also when the base
        model's config.json cannot be read or the checkpoint does not hold these
        adapters (``CheckpointMismatch``).
    """
    cfg = _lora_run_config(run_dir)
    learner = cfg.learner
    spec = LoraSpec(learner.lora_rank, learner.lora_alpha, learner.lora_target_modules)
    try:
        config = read_model_config(cfg.model.path, cfg.model.max_seq_len)
    except CheckpointError as e:
        raise RunError(f"model.path of {run_dir!r}: {e}") from None
    base = abstract_model(config)[1]
    wanted = jax.eval_shape(lambda: init_adapters(base, spec, seed=0))
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        adapters, step = checkpointer.restore_params(wanted)
    except ValueError as e:  # CheckpointMismatch: other adapters than the config names
        raise RunError(f"{run_dir!r}: {e}") from None
    finally:
        checkpointer.close()
    out = out_dir or os.path.join(run_dir, "adapter")
    export_adapters(out, adapters, alpha=spec.alpha, base_model=cfg.model.path)
    return out, step
