"""One typed configuration for a run: packaged YAML presets, a user's YAML file and dotted
command-line overrides, validated at start with errors that name the bad key and value.

    cfg = load_config("default", overrides=["rollout.max_concurrent_episodes=64"])
    cfg.rollout.max_concurrent_episodes  # 64

Each section is one dataclass. Each field is one ``setting(default, doc, bounds=...,
resume=...)``: its default, one-line doc, bounds and whether a ``--resume`` may change it
sit in the field, and a choice is a ``Literal`` type. The range checks, the resume rule
(``resumable_keys``) and ``raytunix config --explain`` (``explain``) are read from there,
so a new setting is one field.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import typing
from importlib import resources
from typing import Any, Literal, Sequence

import yaml


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and says what to do."""


# Choices of the settings that pick a behaviour, one Literal each; the modules that own the
# behaviour import them from here (this module imports nothing of raytunix at import time).
EnginePlacement = Literal["colocated", "disaggregated"]
KVOnWeightUpdate = Literal["recompute", "keep"]
ModelDtype = Literal["float32", "bfloat16"]  # raytunix.models.llama.MODEL_DTYPES
KVDtype = Literal["auto", ModelDtype]  # auto: the model's
LossAggregation = Literal["token_mean", "sequence_mean_token_mean", "sequence_mean_token_sum_norm"]
OffPolicyCorrection = Literal["none", "decoupled_ppo"]
ImportanceSampling = Literal["token_tis", "sequence_tis", "geometric_tis"]
OptimizerName = Literal["adamw", "adam", "sgd"]
LRSchedule = Literal["constant", "linear", "cosine"]
AdvantageEstimator = Literal["grpo", "rloo", "reinforce_pp", "gae"]
PolicyLoss = Literal["ppo_clip", "gspo", "cispo"]
KLEstimator = Literal["k1", "k2", "k3"]
SegmentRule = Literal["latest", "any"]  # raytunix.gateway.recorder.EXTEND_RULES
# raytunix.agents.parsers.TOOL_PARSERS (tests/test_config_settings.py keeps the two equal)
ToolParserName = Literal["hermes", "qwen", "llama3_json", "gemma", "react"]
StaleTokenPolicy = Literal["drop", "mask", "accept"]
KeepBestMode = Literal["max", "min"]
PlacementStrategy = Literal["STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"]
FileSource = Literal["parquet", "jsonl", "hf"]  # the data sources read from data.path
DataSource = Literal["auto", "env", "reasoning_gym", FileSource]
OverlongPrompts = Literal["error", "drop"]
SandboxBackendChoice = Literal["auto", "bwrap", "subprocess"]
WarmupSource = Literal[
    "auto", "file", "expert", "arithmetic", "rejection"
]  # raytunix.driver.prepare

# Upper bounds of the sandbox's limits (raytunix.sandbox.types.SandboxLimits reads them from
# here, so the schema stays a leaf): kernel limits are signed 64-bit, a process count cannot
# pass the kernel's PID_MAX_LIMIT, and a bound in seconds keeps deadlines in range.
SANDBOX_MAX_SECONDS = 1e9  # about 31 years
SANDBOX_MAX_BYTES = (1 << 63) - 1
SANDBOX_MAX_PROCESSES = 1 << 22
_FLOAT32_MAX = 3.4028234663852886e38
_INT64 = (-(1 << 63), (1 << 63) - 1)

_BOUNDS = re.compile(r"(>=|>|<=|<) (-?[0-9.]+)|([\[(])(-?[0-9.]+), (-?[0-9.]+)([\])])")


def _parse_bounds(bounds: str) -> typing.Callable[[float], bool]:
    """``"> 0"``, ``">= 0"``, ``"<= 1"``, ``"[0, 1]"``, ``"(0, 1]"``... -> a test of a value
    (False for nan, which fails every comparison).

    Raises:
      ValueError: ``bounds`` is none of these forms.
    """
    m = _BOUNDS.fullmatch(bounds)
    if m is None:
        raise ValueError(
            f"bounds={bounds!r} must look like '> 0', '>= 1', '<= 1', '[0, 1]' or '(0, 1]'."
        )
    if m.group(1):
        op, edge = m.group(1), float(m.group(2))
        return {
            ">": lambda v: v > edge,
            ">=": lambda v: v >= edge,
            "<": lambda v: v < edge,
            "<=": lambda v: v <= edge,
        }[op]
    low, high = float(m.group(4)), float(m.group(5))
    closed_low, closed_high = m.group(3) == "[", m.group(6) == "]"

    def inside(v: float) -> bool:
        above = v >= low if closed_low else v > low
        below = v <= high if closed_high else v < high
        return above and below

    return inside


def setting(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory: typing.Callable[[], Any] | None = None,
    bounds: str | None = None,
    hint: str = "",
    resume: bool = False,
) -> Any:
    """One config field with everything said about it in one place.

    Args:
      default: the value a run gets when nothing sets it (or ``factory`` for a mapping).
      doc: one line: what the setting does, its unit, what 0 or "" means.
      factory: builds a mutable default (``dict``), as ``dataclasses.field``'s.
      bounds: the range ``validate`` holds a number to: ``"> 0"``, ``">= 0"``, ``"[0, 1]"``...;
        a choice needs none (its ``Literal`` type says it).
      hint: why the bounds are what they are, or an example, for the error about them.
      resume: True when a ``--resume`` may change it (it changes how the run is run, not
        what its checkpoint holds).

    Raises:
      TypeError: no doc, or malformed bounds (at class definition, so a bad field never
        loads).
    """
    if not doc:
        raise TypeError("a setting needs its one-line doc: setting(default, \"what it does\").")
    if bounds is not None:
        try:
            _parse_bounds(bounds)
        except ValueError as e:
            raise TypeError(str(e)) from None
    metadata = {"doc": doc, "bounds": bounds, "hint": hint, "resume": resume}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class RunConfig:
    name: str = setting(
        "default",
        "run name; the run directory is output_dir/name-<timestamp> (an env.name override "
        "without one names the run after the environment)",
    )
    output_dir: str = setting("runs", "parent of run directories")
    seed: int = setting(
        0,
        "seeds data order, model init and sampling",
        bounds="[0, 4294967295]",
        hint="a 32-bit seed, as JAX's PRNG keys take",
    )
    log_every: int = setting(
        1, "print a progress line every this many RL steps", bounds="> 0", resume=True
    )
    profile_window_s: float = setting(
        3.0,
        "profiling drains every actor's spans at the end of the first RL step at least this "
        "many seconds after the last drain; shorter steps share one window (their records are "
        "written together, each with its metrics); 0 = after every step",
        bounds=">= 0",
        resume=True,
        hint="e.g. 3: the records of a window wait for it to close",
    )
    compilation_cache_dir: str = setting(
        "~/.cache/raytunix/jax",
        "JAX's persistent compilation cache of the learner and engine processes: a program "
        "compiled once is loaded from here by later runs on this machine instead of "
        "compiled again (a multi-host learner group keeps its own); '' = off",
        resume=True,
    )
    compilation_cache_min_compile_s: float = setting(
        1.0,
        "only programs that took at least this many seconds to compile are cached (JAX's "
        "jax_persistent_cache_min_compile_time_secs); 0 = every program",
        bounds=">= 0",
        resume=True,
    )
    no_signal_fraction: float = setting(
        0.9,
        "an RL step has no learning signal when at least this share of its batch's groups got "
        "equal rewards (zero variance: every group-relative advantage 0); read by the console "
        "warning and the report's learning verdict",
        bounds="(0, 1]",
        resume=True,
        hint="a share of groups, e.g. 0.9",
    )
    samples_per_step: int = setting(
        3,
        "episodes of each RL step's batch written to RUN_DIR/samples.jsonl (decoded messages, "
        "actions, rewards, status): the best, the worst, then random ones; 0 = off",
        bounds=">= 0",
        resume=True,
        hint="e.g. 3 (best, worst, one at random)",
    )
    device_memory_gib: float = setting(
        0.0,
        "memory of one accelerator in GiB that the memory plan (raytunix plan, and the check "
        "before a run starts) holds the run to; 0 = measured: the device's bytes_limit, on "
        "CPU the host's available memory",
        bounds=">= 0",
        resume=True,
        hint="GiB, e.g. 80 for an H100; 0 = measured",
    )
    no_signal_steps: int = setting(
        3,
        "the driver warns once (a console line and a learning_signal record in metrics.jsonl) "
        "when this many RL steps in a row had no learning signal, again only after it came "
        "back; 0 = never",
        bounds=">= 0",
        resume=True,
    )


@dataclasses.dataclass
class ModelConfig:
    path: str = setting(
        "",
        "a Hugging Face Llama / Qwen2 / Qwen3 model folder (config.json, *.safetensors, "
        "tokenizer.json, tokenizer_config.json) to train: its shape, weights, tokenizer and "
        "chat template replace d_model..d_ff and tokenizer_vocab_size (max_seq_len still sets "
        "the context), and the trained policy is exported to RUN_DIR/export/ in the same "
        'layout; "" = a fresh model of the sizes below',
    )
    init_from: str = setting(
        "",
        "an earlier run's directory to start from: its newest checkpoint's policy weights, "
        "its tokenizer and its model shape (model.path and d_model..tokenizer_vocab_size are "
        "taken from its config.yaml); the optimizer, steps and data start fresh, so the run "
        'may train another env; "" = start from model.path or a fresh model',
    )
    d_model: int = setting(128, "residual width", bounds="> 0")
    n_layers: int = setting(3, "transformer blocks", bounds="> 0")
    n_heads: int = setting(4, "query heads", bounds="> 0")
    n_kv_heads: int = setting(2, "key/value heads (grouped-query attention)", bounds="> 0")
    d_ff: int = setting(384, "SwiGLU hidden width", bounds="> 0")
    max_seq_len: int = setting(
        128,
        "context length in tokens (also the KV cache length)",
        bounds=">= 32",
        hint="a conversation needs at least that many tokens",
    )
    tokenizer_vocab_size: int = setting(
        384,
        "byte-level BPE vocabulary, trained on the demonstrations",
        bounds=">= 272",
        hint="256 bytes plus the special tokens",
    )
    dtype: ModelDtype = setting(
        "float32",
        "compute dtype of the model's matmuls and activations, and of the weights published "
        "to engines (bfloat16 halves their bytes); master weights, optimizer state, "
        "checkpoints, attention softmax, logits, logprobs and losses stay float32",
        resume=True,
    )


@dataclasses.dataclass
class DataConfig:
    """Where a run's tasks come from (``raytunix/data/datasets.py``). Nothing is downloaded."""

    source: DataSource = setting(
        "auto",
        "auto: the environment's own tasks, else reasoning-gym data.dataset | env: the "
        "environment's own (error if it brings none) | reasoning_gym: data.dataset | parquet "
        "| jsonl: a file or a folder of shards per split | hf: a save_to_disk folder",
    )
    dataset: str = setting(
        "basic_arithmetic",
        "reasoning-gym dataset name (any of reasoning_gym.factory.DATASETS) for source auto / "
        "reasoning_gym",
    )
    dataset_kwargs: dict[str, Any] = setting(
        factory=dict,
        doc="that dataset's config (basic_arithmetic also takes the min/max keys below)",
    )
    path: str = setting("", "parquet / jsonl / hf: the dataset's file or folder")
    split: str = setting("train", "the training split inside a folder")
    heldout_path: str = setting(
        "",
        'held-out file or folder; "" = data.path when data.heldout_split is set, else '
        "data.heldout_size rows of the training split held out (drawn with data.seed)",
    )
    heldout_split: str = setting(
        "",
        'the held-out split inside a folder (e.g. test); "" = "test" when data.heldout_path '
        "is a folder",
    )
    question_column: str = setting("question", "column holding the question text")
    answer_column: str = setting(
        "answer", "column holding the reference answer (GSM8K's \"... #### 72\" keeps 72)"
    )
    id_column: str = setting("", 'column of unique task ids; "" = <split>-<row number>')
    overlong_prompts: OverlongPrompts = setting(
        "error",
        "a train or held-out task whose first prompt leaves no room for a reply in "
        "model.max_seq_len (every task is checked before training): error (the run stops, "
        "naming them) | drop (left out, counted in summary.json's tasks_dropped)",
    )
    train_size: int = setting(
        20000,
        "training tasks (cycled through in order); a dataset on disk gives at most its rows",
        bounds="> 0",
    )
    heldout_size: int = setting(200, "held-out tasks, never trained on", bounds="> 0")
    seed: int = setting(
        0,
        "generator seed of the training split (held-out uses another); seeds the held-out "
        "draw off a file's training split",
        bounds="[0, 4294967295]",
        hint="a 32-bit seed",
    )
    min_terms: int = setting(2, "basic_arithmetic: fewest terms of a question", bounds=">= 1")
    max_terms: int = setting(
        3, "basic_arithmetic: most terms of a question (>= data.min_terms)", bounds=">= 1"
    )
    min_digits: int = setting(2, "basic_arithmetic: fewest digits of a term", bounds=">= 1")
    max_digits: int = setting(
        3, "basic_arithmetic: most digits of a term (>= data.min_digits)", bounds=">= 1"
    )


@dataclasses.dataclass
class EnvConfig:
    name: str = setting(
        "calculator_math",
        "a registered environment (calculator_math, math_verifier, python_math, "
        "bash_terminal, text_to_sql, web_api, repo_repair, gymnasium, simulated_tool, or a "
        "package's entry point) or an import path package.module:Class",
    )
    kwargs: dict[str, Any] = setting(
        factory=dict,
        doc="the environment's constructor arguments, checked against its signature (e.g. "
        "{max_tool_errors: 2})",
    )
    agent: str = setting(
        "auto",
        "auto = the environment's default agent; or a registered agent (tool, answer, text) "
        "or package.module:Class",
    )
    agent_kwargs: dict[str, Any] = setting(
        factory=dict,
        doc="the agent's constructor arguments besides the tokenizer (e.g. {system_prompt: "
        '"..."})',
    )
    max_turns: int = setting(4, "model turns per episode", bounds="> 0")
    num_env_actors: int = setting(
        2,
        "Ray actors hosting environments (scaled apart from the learner)",
        bounds="> 0",
        resume=True,
    )
    env_actor_max_restarts: int = setting(
        3,
        "a crashed env actor is restarted this often, then replaced by a new one",
        bounds=">= 0",
        resume=True,
    )
    actor_resources: dict[str, float] = setting(
        factory=dict,
        doc="Ray resources each env actor asks for, e.g. {raytunix_env: 1}: a custom resource "
        "only the CPU node pool offers, so env actors scale there and never on TPU hosts "
        "(TPU/GPU refused; they run with JAX_PLATFORMS=cpu); {} = anywhere",
        resume=True,
    )


@dataclasses.dataclass
class RolloutConfig:
    group_size: int = setting(
        8,
        "G trajectories sampled per task (GRPO group)",
        bounds=">= 2",
        hint="GRPO needs at least 2 samples per task",
    )
    groups_per_batch: int = setting(16, "tasks per learner batch", bounds="> 0")
    max_concurrent_episodes: int = setting(
        128,
        "episodes in flight at once (with adaptive_concurrency: the start value)",
        bounds="> 0",
        resume=True,
    )
    adaptive_concurrency: bool = setting(
        True,
        "a controller moves max_concurrent_episodes during the run to hold the engine busy "
        "near target_engine_busy",
        resume=True,
    )
    target_engine_busy: float = setting(
        0.9,
        "wanted engine busy fraction (device seconds / wall seconds)",
        bounds="(0, 1]",
        hint="a fraction of wall time, e.g. 0.9",
        resume=True,
    )
    adaptive_min_episodes: int = setting(
        0,
        "lowest budget the controller may set; 0 = one group (group_size)",
        bounds=">= 0",
        resume=True,
    )
    adaptive_max_episodes: int = setting(
        0,
        "highest budget; 0 = (max_staleness + 1) x groups_per_batch x group_size, the most "
        "admission ever lets in",
        bounds=">= 0",
        resume=True,
    )
    adaptive_interval_s: float = setting(
        2.0, "seconds between two readings of the engine's stats", bounds="> 0", resume=True
    )
    max_staleness: int = setting(
        1, "a group is only started if it will be consumed within this many versions", bounds=">= 0"
    )
    temperature: float = setting(
        1.0,
        "sampling temperature for training rollouts (>= 0.01 in float32, so logprobs stay "
        "finite; eval is always greedy)",
        bounds="> 0",
        hint="e.g. rollout.temperature=1.0: training rollouts must sample; greedy decoding (0) "
        "gives every sampled token probability 1, so the policy gradient has nothing to score",
    )
    top_k: int = setting(0, "sample among the k most likely tokens; 0 = off", bounds=">= 0")
    top_p: float = setting(
        1.0,
        "nucleus sampling: smallest set of tokens with this much mass; 1.0 = off; at most "
        "1/top_k (or 1/vocabulary) is greedy and refused",
        bounds="(0, 1]",
        hint="1.0 turns nucleus sampling off, 0.95 is a common setting",
    )
    max_new_tokens: int = setting(48, "per model turn", bounds="> 0")
    episode_timeout_s: float = setting(120.0, "wall-clock budget per episode", bounds="> 0")
    batch_queue_size: int = setting(
        2, "finished batches waiting for the learner (backpressure)", bounds="> 0"
    )
    drop_failed_groups: bool = setting(
        False, "drop a group with a failed member instead of masking it"
    )
    stale_token_policy: StaleTokenPolicy = setting(
        "drop",
        "a packed group holding tokens older than max_staleness: drop it | mask those tokens "
        "out of the loss | accept them; each counted",
    )
    partial_rollout: bool = setting(
        True,
        "an episode goes on across weight updates; false: it restarts from its prompt "
        "(bounded), so its tokens share one version",
    )
    dynamic_sampling: bool = setting(
        False,
        "DAPO: filter groups whose rewards are all equal (zero advantage) and sample others "
        "until the batch is full",
    )
    dynamic_sampling_max_filtered: int = setting(
        0,
        "at most this many groups filtered per batch, then such groups are kept (counted, "
        "warned); 0 = 4 x groups_per_batch",
        bounds=">= 0",
    )
    batch_timeout_s: float = setting(
        900.0,
        "the run stops (checkpoints kept) if no batch arrives in this time",
        bounds="> 0",
        resume=True,
    )
    # Faults (see raytunix/rollout/orchestrator.py): retries back off exponentially with jitter.
    max_episode_restarts: int = setting(
        2,
        "an episode whose env actor died is re-run on a live actor this often, then ends as "
        "env_error",
        bounds=">= 0",
        resume=True,
    )
    max_group_retries: int = setting(
        3,
        "a group that made no data (engine down, or every member failed by infrastructure) is "
        "retried this often, then its task is filtered",
        bounds=">= 0",
        resume=True,
    )
    max_consecutive_failures: int = setting(
        256,
        "the breaker: this many episodes in a row failed by infrastructure stop the run with "
        "one error (checkpoints kept); 0 = off",
        bounds=">= 0",
        resume=True,
    )
    engine_retry_max_attempts: int = setting(
        8,
        "attempts of one engine call within an episode, the first included",
        bounds="> 0",
        resume=True,
    )
    engine_retry_initial_delay_s: float = setting(
        0.1, "first wait before an engine call is retried, seconds", bounds="> 0", resume=True
    )
    engine_retry_max_delay_s: float = setting(
        5.0,
        "cap on one wait between engine call attempts, seconds (>= "
        "rollout.engine_retry_initial_delay_s)",
        bounds="> 0",
        resume=True,
    )
    engine_retry_multiplier: float = setting(
        2.0,
        "each wait between engine call attempts grows by this factor",
        bounds=">= 1",
        resume=True,
        hint="1: constant waits, 2: each wait doubles",
    )
    engine_retry_jitter: float = setting(
        0.5,
        "random fraction of each such wait (0.5: equal jitter, 1: full jitter)",
        bounds="[0, 1]",
        resume=True,
    )
    retry_initial_delay_s: float = setting(
        0.5,
        "first wait before a group is retried or an episode re-run, seconds",
        bounds="> 0",
        resume=True,
    )
    retry_max_delay_s: float = setting(
        30.0,
        "cap on one wait between group retries or episode re-runs, seconds (>= "
        "rollout.retry_initial_delay_s)",
        bounds="> 0",
        resume=True,
    )
    retry_multiplier: float = setting(
        2.0,
        "each wait between group retries or episode re-runs grows by this factor",
        bounds=">= 1",
        resume=True,
        hint="1: constant waits, 2: each wait doubles",
    )
    retry_jitter: float = setting(
        0.5, "random fraction of each such wait", bounds="[0, 1]", resume=True
    )


@dataclasses.dataclass
class EngineConfig:
    max_batch_size: int = setting(
        128, "most requests decoded together (continuous batching)", bounds="> 0", resume=True
    )
    placement: EnginePlacement = setting(
        "colocated", "colocated (engine and learner in one actor) | disaggregated"
    )
    block_size: int = setting(
        16, "tokens per KV-cache block (paged attention)", bounds="> 0", resume=True
    )
    kv_cache_tokens: int = setting(
        0,
        "KV capacity in tokens (running requests, sessions, prefix cache); 0 = 4 x "
        "max_batch_size x model.max_seq_len",
        bounds=">= 0",
        resume=True,
    )
    prefill_chunk_tokens: int = setting(
        256, "most prompt tokens prefilled between two decode steps", bounds=">= 2", resume=True
    )
    kv_on_weight_update: KVOnWeightUpdate = setting(
        "recompute",
        "KV of older weights after a weight update: recomputed, or kept (reused and counted "
        "as stale)",
        resume=True,
    )
    sessions: bool = setting(
        True, "keep an episode's KV in the engine between its turns", resume=True
    )
    kv_dtype: KVDtype = setting(
        "auto",
        "dtype of the KV cache; auto = model.dtype (a bfloat16 model's keys and values are "
        "bfloat16 already, so a float32 cache would hold the same numbers in twice the bytes)",
        resume=True,
    )
    compile_ahead: bool = setting(
        True,
        "compile every step program the engine can reach on a background thread from its "
        "start; meanwhile a step runs on a larger built program (same samples). false = "
        "each is compiled on first use while live requests wait",
        resume=True,
    )
    num_replicas: int = setting(
        1, "engine actors behind the router (disaggregated placement only)", bounds="> 0"
    )
    actor_resources: dict[str, float] = setting(
        factory=dict,
        doc="Ray resources each engine actor asks for (disaggregated placement), e.g. {TPU: "
        "4} for one TPU host of an inference slice; {} = no CPU reserved, anywhere",
        resume=True,
    )
    actor_max_restarts: int = setting(
        3,
        "a crashed engine actor (disaggregated placement) is restarted this often, then the "
        "run stops",
        bounds=">= 0",
        resume=True,
    )

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``InferenceEngine`` that this section sets."""
        return {
            "max_batch_size": self.max_batch_size,
            "block_size": self.block_size,
            "kv_cache_tokens": self.kv_cache_tokens or None,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "kv_on_weight_update": self.kv_on_weight_update,
            "sessions": self.sessions,
            "kv_dtype": self.kv_dtype,
            "compile_ahead": self.compile_ahead,
        }


# The dense layers of raytunix.models.llama by attribute name: what learner.lora_target_modules
# may name (raytunix.learner.lora).
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)


@dataclasses.dataclass
class LearnerConfig:
    rl_steps: int = setting(40, "GRPO updates", bounds=">= 0", resume=True)
    learning_rate: float = setting(1e-4, "the RL update's peak learning rate (optax)", bounds="> 0")
    optimizer: OptimizerName = setting("adamw", "the RL update's optax optimizer")
    lr_schedule: LRSchedule = setting(
        "constant",
        "the learning rate's shape: constant, or a linear or cosine decay to 0 at "
        "rl_steps x num_iterations optimizer steps",
    )
    lr_warmup_steps: int = setting(
        0, "the learning rate rises linearly over this many optimizer steps", bounds=">= 0"
    )
    weight_decay: float = setting(
        0.0, "adamw's decoupled weight decay (matrices only)", bounds=">= 0"
    )
    max_grad_norm: float = setting(
        1.0, "gradients are clipped to this global norm; 0 = no clipping", bounds=">= 0"
    )
    advantage_estimator: AdvantageEstimator = setting(
        "grpo",
        "grpo | rloo (leave-one-out baseline) | reinforce_pp (group mean, then batch "
        "normalisation) | gae (per-token GAE from a value head on the policy: PPO)",
    )
    gae_gamma: float = setting(1.0, "gae: discount per generated token", bounds="[0, 1]")
    gae_lambda: float = setting(0.95, "gae: GAE's lambda", bounds="[0, 1]")
    gae_normalize: bool = setting(
        True, "gae: whiten the advantages over the batch's trained tokens"
    )
    value_coef: float = setting(0.5, "gae: weight of the value head's loss", bounds="> 0")
    value_clip: float = setting(
        0.2, "gae: PPO's value clip, how far a value may move from the batch's start", bounds="> 0"
    )
    normalize_advantages_by_std: bool = setting(
        True, "grpo: divide by the group's std; false is Dr. GRPO's advantage"
    )
    policy_loss: PolicyLoss = setting(
        "ppo_clip",
        "ppo_clip | gspo (clipped sequence-level ratio) | cispo (clipped stop-gradient IS "
        "weight x logprob)",
    )
    clip_eps_low: float = setting(
        0.2,
        "PPO's lower ratio clip: the ratio is kept above 1 - clip_eps_low",
        bounds="[0, 1)",
        hint="a ratio clip range, e.g. 0.2",
    )
    clip_eps_high: float = setting(
        0.28, "asymmetric upper clip (DAPO)", bounds="[0, 1)", hint="a ratio clip range, e.g. 0.28"
    )
    dual_clip: float = setting(
        0.0,
        "ppo_clip: a negative-advantage token's loss is at most dual_clip x |A| (> 1, e.g. "
        "3); 0 = off",
        bounds=">= 0",
    )
    kl_coef: float = setting(0.0, "> 0 adds a KL penalty to the warm-start policy", bounds=">= 0")
    kl_estimator: KLEstimator = setting(
        "k3",
        "Schulman's estimator of KL(policy || reference), the value kl_ref "
        "reports; in the loss each is importance-weighted so its gradient is that of "
        "KL(policy || reference) (README, The RL algorithm)",
    )
    entropy_coef: float = setting(
        0.0,
        "> 0 subtracts this x the token entropy from the loss (exploration bonus)",
        bounds=">= 0",
    )
    loss_aggregation: LossAggregation = setting(
        "token_mean",
        "token_mean | sequence_mean_token_mean | sequence_mean_token_sum_norm (Dr. GRPO: each "
        "sequence's token sum / model.max_seq_len)",
    )
    overlong_buffer_tokens: int = setting(
        0,
        "DAPO's overlong penalty: the reward drops linearly to -1 over the last this many of "
        "env.max_turns x rollout.max_new_tokens generated tokens; 0 = off",
        bounds=">= 0",
    )
    micro_batch_size: int = setting(
        0,
        "trajectories (packed rows with sequence_packing) per forward/backward pass, "
        "gradients summed (same update as the whole batch); 0 = whole batch",
        bounds=">= 0",
    )
    num_iterations: int = setting(
        1, "optimizer steps per batch, the clip anchored at the batch's start", bounds="> 0"
    )
    sequence_packing: bool = setting(
        True,
        "pack several trajectories into each row of pack_width tokens (attention within a "
        "trajectory only; same update as padding each to the longest); micro_batch_size then "
        "counts packed rows",
        resume=True,
    )
    pack_width: int = setting(
        0,
        "tokens of the widest packed row (>= 2); 0 = model.max_seq_len; a narrower padding "
        "width is used when it holds the batch in fewer tokens; a longer trajectory is cut to "
        "it",
    )
    lora_rank: int = setting(
        0,
        "LoRA (Hu et al. 2021): rank of the adapters trained instead of the whole model, "
        "which stays frozen and is the KL reference; 0 = off (full fine-tuning)",
        bounds=">= 0",
    )
    lora_alpha: float = setting(
        16.0, "LoRA: the adapters' update is scaled by lora_alpha / lora_rank", bounds="> 0"
    )
    lora_target_modules: str = setting(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "LoRA: the dense layers that get adapters, comma-separated, among "
        + ", ".join(LORA_TARGET_MODULES),
    )
    off_policy_correction: OffPolicyCorrection = setting(
        "none",
        "none: clip around the behaviour (engine) policy | decoupled_ppo: clip around the "
        "learner's policy at the update's start, behaviour through a truncated importance "
        "weight",
    )
    importance_sampling: ImportanceSampling = setting(
        "token_tis",
        "decoupled_ppo's weight pi_prox/pi_behav: per token (token_tis), per sequence as the "
        "product (sequence_tis) or geometric mean (geometric_tis) of token ratios",
    )
    importance_cap: float = setting(
        2.0,
        "the importance weight is truncated at this",
        bounds=">= 1",
        hint="e.g. 2.0: a cap below 1 down-weights tokens that are exactly on-policy",
    )
    max_consecutive_nonfinite_updates: int = setting(
        3,
        "an update (RL or warm start) whose loss, gradients or new parameters are not "
        "finite is not applied (counted: updates_skipped_nonfinite); this many in a row stop "
        "the run with one error; 0 = never stop",
        bounds=">= 0",
        resume=True,
    )
    checkpoint_every: int = setting(
        10,
        "RL steps between checkpoints (and one at the end); saved asynchronously, while "
        "training goes on",
        bounds="> 0",
        resume=True,
    )
    max_checkpoints: int = setting(
        3,
        "the newest this many checkpoints stay (plus the best one with keep_best_by)",
        bounds="> 0",
        resume=True,
    )
    keep_best_by: str = setting(
        "",
        "a number of the RL step's metrics (e.g. reward_mean: the batch's mean reward); the "
        'checkpoint with the best value is never deleted; "" = off',
        resume=True,
    )
    keep_best_mode: KeepBestMode = setting(
        "max", "whether a higher (max) or a lower (min) keep_best_by is better", resume=True
    )
    num_hosts: int = setting(
        1,
        "learner actors, one per host, running one JAX program (jax.distributed; "
        "raytunix.learner.group); 1 = one learner actor; > 1 needs "
        "engine.placement=disaggregated",
        bounds="> 0",
    )
    resources: dict[str, float] = setting(
        factory=dict,
        doc="Ray resources of each learner host (also of the single learner actor, or the "
        "colocated learner + engine), e.g. {TPU: 4}: all of a TPU VM's chips; {} = one "
        "CPU",
        resume=True,
    )
    placement_strategy: PlacementStrategy = setting(
        "STRICT_SPREAD",
        "how the learner hosts' placement group spreads (Ray's strategies; STRICT_SPREAD: "
        "one host per node)",
        resume=True,
    )
    tpu_topology: str = setting(
        "",
        "the learner slice's TPU topology (e.g. 4x4); with tpu_version the hosts are reserved "
        'as one slice (ray.util.tpu) and ranked by TPU worker id; "" = a plain placement '
        "group",
    )
    tpu_version: str = setting(
        "", "the learner slice's TPU generation (e.g. v6e, v5p, v4); set with tpu_topology"
    )
    mesh_data: int = setting(
        -1,
        "devices of the learner's mesh for data parallelism; -1 = the devices mesh_fsdp x "
        "mesh_tensor leave (raytunix.learner.sharding)",
        resume=True,
    )
    mesh_fsdp: int = setting(
        1,
        "devices each param and optimizer moment is split over (FSDP/ZeRO-3); the batch is "
        "split over data x fsdp; -1 = the rest",
        resume=True,
    )
    mesh_tensor: int = setting(
        1,
        "Megatron tensor parallelism (attention heads, MLP width, vocabulary); -1 = the rest",
        resume=True,
    )
    call_timeout_s: float = setting(
        1800.0,
        "seconds a learner call (an update, the weights) may take before the learner counts "
        "as stuck: a multi-host group kills its hosts and is rebuilt from the newest "
        "checkpoint every host reads; one learner actor stops the run (resume it)",
        bounds="> 0",
        resume=True,
        hint="seconds, e.g. 1800; a stuck learner host would hang",
    )
    slow_call_timeout_s: float = setting(
        3600.0,
        "the same for calls that compile or move the whole state: the first update after a "
        "(re)start, warm-start steps, checkpoint saves and restores, the export; >= "
        "call_timeout_s",
        bounds="> 0",
        resume=True,
    )


@dataclasses.dataclass
class WarmupConfig:
    enabled: bool = setting(
        True, "supervised warm start on demonstrations before RL (warmup.source says which)"
    )
    source: WarmupSource = setting(
        "auto",
        "where demonstrations come from: auto (the file if warmup.demonstrations is set, else "
        "the environment's expert, else arithmetic ones for arithmetic tasks) | file | expert | "
        "arithmetic | rejection (the run's own successful episodes, sampled before RL)",
    )
    rejection_episodes: int = setting(
        512,
        "rejection: episodes sampled before the warm start, one per train task in turn",
        bounds="> 0",
    )
    rejection_temperature: float = setting(
        1.0, "rejection: sampling temperature of those episodes", bounds="> 0"
    )
    demonstrations: str = setting(
        "",
        "chat-format .jsonl or .parquet file with a messages column (lists of {role, content}) "
        '("" = none)',
    )
    max_steps: int = setting(1400, "most supervised steps of the warm start", bounds=">= 0")
    min_steps: int = setting(
        300, "fewest supervised steps before the stop condition is read", bounds=">= 0"
    )
    batch_size: int = setting(32, "demonstrations per supervised step", bounds="> 0")
    learning_rate: float = setting(2e-3, "the warm start's peak learning rate", bounds="> 0")
    warmup_steps: int = setting(
        50, "the warm start's learning rate rises linearly over this many steps", bounds=">= 0"
    )
    tool_use_prob_2_terms: float = setting(
        0.25, "share of demonstrations that call the tool", bounds="[0, 1]"
    )
    tool_use_prob_3_terms: float = setting(
        0.85, "share of 3-term demonstrations that call the tool", bounds="[0, 1]"
    )
    eval_every: int = setting(
        100, "steps between checks of the stop condition (and checkpoints)", bounds="> 0"
    )
    eval_size: int = setting(
        128, "held-out-free dev tasks used for the arithmetic stop condition", bounds="> 0"
    )
    target_tool_accuracy: float = setting(
        0.6,
        "arithmetic: stop once greedy dev tool-path accuracy reaches this (other sources run "
        "warmup.max_steps)",
        bounds="[0, 1]",
    )


@dataclasses.dataclass
class EvalConfig:
    heldout_size: int = setting(
        200, "held-out tasks evaluated greedily before and after RL", bounds="> 0"
    )
    max_new_tokens: int = setting(
        48, "per model turn in the held-out evaluation", bounds="> 0", resume=True
    )
    every: int = setting(
        0,
        "also evaluate the held-out tasks greedily every this many RL steps while training "
        "goes on (logged as phase eval, when during_rl, with the step it started at); one at "
        "a time, a due one is skipped while the last still runs; 0 = only before and after RL",
        bounds=">= 0",
        resume=True,
    )


@dataclasses.dataclass
class SandboxConfig:
    """Where code-running tools (python, bash) execute: ``raytunix.sandbox``. A pool of
    sandbox actors is started when the environment runs sandboxed tools (its class sets
    ``uses_sandbox``)."""

    backend: SandboxBackendChoice = setting(
        "auto",
        "auto (bubblewrap where it works, else subprocess with a warning) | bwrap (or stop) | "
        "subprocess",
    )
    num_actors: int = setting(
        1, "sandbox Ray actors (scaled apart from env actors)", bounds="> 0", resume=True
    )
    num_cpus_per_actor: float = setting(
        0.5, "Ray CPUs each sandbox actor reserves (fractions allowed)", bounds=">= 0", resume=True
    )
    resource: str = setting(
        "",
        'a custom Ray resource each sandbox actor needs one unit of, e.g. sandbox_host ("" = none)',
        resume=True,
    )
    max_concurrent_runs: int = setting(
        32, "commands one sandbox actor runs at once", bounds="> 0", resume=True
    )
    actor_max_restarts: int = setting(
        3, "a crashed sandbox actor is restarted this often", bounds=">= 0", resume=True
    )
    wall_time_s: float = setting(
        10.0, "wall-clock limit of one command; its whole process tree is killed then", bounds="> 0"
    )
    cpu_time_s: float = setting(10.0, "CPU seconds per process", bounds="> 0")
    memory_mb: int = setting(
        1024,
        "address space per process, MiB",
        bounds=">= 16",
        hint="an interpreter needs that much address space to start",
    )
    max_processes: int = setting(64, "processes and threads of one command at once", bounds="> 0")
    max_file_mb: int = setting(64, "largest file a command may write, MiB", bounds=">= 0")
    max_output_kb: int = setting(
        64,
        "stdout (and stderr) kept per command, KiB; the rest is dropped and reported",
        bounds="> 0",
    )
    tmp_mb: int = setting(
        64, "size of the private /tmp (and /dev/shm) of a command, MiB", bounds="> 0"
    )
    max_workdir_mb: int = setting(
        256,
        "disk budget of one work dir, all its files together, MiB (>= 1); enforced where the "
        "sandbox runs as root",
        bounds="> 0",
    )
    allow_weak_isolation: bool = setting(
        False,
        "run tools even where the sandbox cannot keep secrets, loopback and host files out of "
        "reach (it says which at start); false = refuse to start there",
    )
    root_dir: str = setting(
        "", 'absolute directory for work dirs ("" = <temp dir>/raytunix-sandbox-<uid>)'
    )


@dataclasses.dataclass
class GatewayConfig:
    """The OpenAI-compatible endpoint that ``env.name=agent_program`` episodes call
    (``raytunix.gateway``); started in the orchestrator actor, in front of the run's engines."""

    host: str = setting(
        "127.0.0.1", "interface the gateway binds (loopback; the cluster network by choice)"
    )
    port: int = setting(0, "TCP port of the gateway; 0 = any free port", bounds="[0, 65535]")
    call_timeout_s: float = setting(
        300.0, "deadline of one call, seconds; past it the call is answered 504", bounds="> 0"
    )
    segments: SegmentRule = setting(
        "latest",
        "which earlier conversation a call may extend: latest (the previous call's) | any "
        "(any of the episode's); a call that extends none starts a new segment",
    )
    tool_parser: ToolParserName = setting(
        "hermes", "how replies are parsed into OpenAI tool_calls (a raytunix tool-call parser)"
    )


@dataclasses.dataclass
class Config:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    warmup: WarmupConfig = dataclasses.field(default_factory=WarmupConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return str(yaml.dump(self.to_dict(), Dumper=_Dumper, sort_keys=False))


@dataclasses.dataclass(frozen=True)
class Setting:
    """What one field of a config section says about itself (read from ``setting``).

    Attributes:
      key: ``section.name``, as overrides spell it.
      type: the field's resolved type (``int``, ``float``, ``str``, ``bool``, a ``Literal``,
        ``dict[str, ...]``).
      default: the default value (shared: read it, do not change it).
      doc: the one-line doc.
      bounds: the range of a number (``"> 0"``, ``"[0, 1]"``...), or None.
      hint: why the bounds are what they are (or an example), said with a value outside.
      choices: the values a ``Literal`` allows, or None.
      resume: whether a ``--resume`` may change it.
    """

    key: str
    type: Any
    default: Any
    doc: str
    bounds: str | None
    hint: str
    choices: tuple[str, ...] | None
    resume: bool

    @property
    def type_name(self) -> str:
        """``int``, ``str`` (for a choice too), ``dict[str, float]``..."""
        if self.choices is not None:
            return "str"
        if typing.get_args(self.type):
            return str(self.type).replace("typing.", "")
        return str(self.type.__name__)


# settings() of each schema, read once: a dict rather than functools.cache, whose wrapper
# wants Hashable arguments, which a dataclass's type object is not to a type checker.
_SETTINGS: dict[type[Config], dict[str, Setting]] = {}


def settings(schema: type[Config] | None = None) -> dict[str, Setting]:
    """Every setting of ``schema`` (default ``Config``; a subclass may add sections), in
    section and field order, keyed ``section.name``; read once per schema (do not change
    the dict returned).

    Raises:
      TypeError: a field was declared without ``setting`` (it has no doc).
    """
    schema = Config if schema is None else schema
    if schema not in _SETTINGS:
        _SETTINGS[schema] = _read_settings(schema)
    return _SETTINGS[schema]


def _read_settings(schema: type[Config]) -> dict[str, Setting]:
    """``settings(schema)``, read from the dataclass fields' metadata."""
    found: dict[str, Setting] = {}
    for section_name, section_type in typing.get_type_hints(schema).items():
        hints = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            key = f"{section_name}.{f.name}"
            if "doc" not in f.metadata:
                raise TypeError(
                    f"{section_type.__qualname__}.{f.name} is not declared with "
                    "setting(default, doc, ...); declare it so it has a doc."
                )
            kind = hints[f.name]
            default = (
                f.default_factory()  # type: ignore[operator]
                if f.default is dataclasses.MISSING
                else f.default
            )
            found[key] = Setting(
                key=key,
                type=kind,
                default=default,
                doc=f.metadata["doc"],
                bounds=f.metadata["bounds"],
                hint=f.metadata["hint"],
                resume=f.metadata["resume"],
                choices=(typing.get_args(kind) if typing.get_origin(kind) is Literal else None),
            )
    return found


def resumable_keys(schema: type[Config] | None = None) -> frozenset[str]:
    """The ``section.key`` a ``--resume`` may override: those declared ``resume=True``
    (how long and how the run is run, never what its checkpoint holds)."""
    return frozenset(key for key, s in settings(schema).items() if s.resume)


def _mappings(schema: type[Config] | None = None) -> frozenset[str]:
    """Mapping-valued keys; an override may set one entry: ``env.kwargs.turns=2``."""
    return frozenset(
        key for key, s in settings(schema).items() if typing.get_origin(s.type) is dict
    )


def explain(key: str = "", schema: type[Config] | None = None, markdown: bool = False) -> str:
    """What ``raytunix config --explain [KEY]`` prints: each setting's key, type, default,
    bounds or choices, resume rule and doc.

    Args:
      key: ``""`` for every setting, a section (``rollout``) for its settings, or one
        ``section.name``.
      schema: the config class (default ``Config``).
      markdown: a table per section (the form of the README's key tables) instead of text.

    Raises:
      ConfigError: ``key`` is neither a section nor a setting; the message names the
        closest ones.
    """
    table = settings(schema)
    sections = list(dict.fromkeys(k.split(".")[0] for k in table))
    if not key:
        chosen = list(table.values())
    elif key in table:
        chosen = [table[key]]
    elif key in sections:
        chosen = [s for k, s in table.items() if k.startswith(key + ".")]
    else:
        close = difflib.get_close_matches(key, list(table) + sections, n=5, cutoff=0.6)
        if not close and "." not in key:  # a bare name: the settings that end with it
            close = [k for k in table if k.endswith("." + key)][:5]
        raise ConfigError(
            f"--explain {key!r} is neither a section ({', '.join(sections)}) nor a setting"
            + (
                f"; did you mean {', '.join(close)}?"
                if close
                else "; `raytunix config --explain` lists them all."
            )
        )
    if markdown:
        return _explain_markdown(chosen)
    blocks = []
    for s in chosen:
        limits = (
            f"one of {' | '.join(s.choices)}" if s.choices is not None else s.bounds or "any"
        ) + (f" ({s.hint})" if s.hint else "")
        blocks.append(
            f"{s.key}: {s.type_name} = {_shown(s.default)}\n"
            f"  allowed: {limits}\n"
            f"  resume:  {'may change on --resume' if s.resume else 'fixed once the run starts'}\n"
            f"  {s.doc}"
        )
    return "\n\n".join(blocks) + "\n"


def _shown(value: Any) -> str:
    """A default as one would write it in YAML (``""``, ``{}``, true)."""
    return (
        json.dumps(value) if isinstance(value, (str, bool, dict)) or value is None else repr(value)
    )


def _explain_markdown(chosen: list[Setting]) -> str:
    out: list[str] = []
    section = None
    for s in chosen:
        if s.key.split(".")[0] != section:
            section = s.key.split(".")[0]
            out += ([""] if out else []) + [
                f"#### `{section}`",
                "",
                "| key | type | default | allowed | on `--resume` | what |",
                "|---|---|---|---|---|---|",
            ]
        limits = ", ".join(f"`{c}`" for c in s.choices) if s.choices is not None else s.bounds or ""
        doc = s.doc.replace("|", "\\|")
        out.append(
            f"| `{s.key}` | {s.type_name} | `{_shown(s.default)}` | {limits} | "
            f"{'may change' if s.resume else 'fixed'} | {doc} |"
        )
    return "\n".join(out) + "\n"


# The choice of every Literal setting (read by tests that walk the choices).
_CHOICES = {k: s.choices for k, s in settings().items() if s.choices is not None}


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Converts a YAML or command-line value to the field's type (a choice to ``str``; it
    is checked in ``validate``), or raises ConfigError."""
    target = str if typing.get_origin(annotation) is Literal else annotation
    if target not in (int, float, str, bool):
        return value
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={value!r} is not a boolean; use true or false.")
    if target is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{key}={value!r} is not an integer; give a whole number.")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not an integer; give a whole number.") from None
    if target is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a number.")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a number.") from None
    if value is None or isinstance(value, (dict, list)):
        raise ConfigError(f"{key}={value!r} is not a string.")
    return str(value)


def _merge(cfg: Config, tree: dict[str, Any], source: str) -> None:
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{source}: the top level must be a mapping of sections, got {type(tree).__name__}."
        )
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    for section_name, values in tree.items():
        if section_name not in sections:
            raise ConfigError(
                f"{source}: unknown section {section_name!r}; valid sections: {', '.join(sections)}."
            )
        section = getattr(cfg, section_name)
        if not isinstance(values, dict):
            raise ConfigError(
                f"{source}: section {section_name!r} must be a mapping, got {values!r}."
            )
        for key, value in values.items():
            _set(section_name, section, key, value, source, type(cfg))


def _set(
    section_name: str, section: Any, key: str, value: Any, source: str, schema: type[Config]
) -> None:
    fields = {f.name: f for f in dataclasses.fields(section)}
    full = f"{section_name}.{key}"
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.75)
        guess = f"did you mean {', '.join(f'{section_name}.{k}' for k in close)}? " if close else ""
        raise ConfigError(
            f"{source}: unknown key {full!r}; {guess}valid keys in {section_name!r}: "
            f"{', '.join(fields)}."
        )
    setattr(section, key, _coerce(full, value, settings(schema)[full].type))


# What a setting is shadowed by: (the setting that decides, whether it decides now, the
# settings it makes of no effect, why).
_SHADOWS: tuple[tuple[str, typing.Callable[[Config], bool], tuple[str, ...], str], ...] = (
    (
        "model.path",
        lambda cfg: bool(cfg.model.path),
        (
            "model.d_model",
            "model.n_layers",
            "model.n_heads",
            "model.n_kv_heads",
            "model.d_ff",
            "model.tokenizer_vocab_size",
        ),
        "the folder's config.json and tokenizer set the model's shape and vocabulary",
    ),
    (
        "warmup.enabled",
        lambda cfg: not cfg.warmup.enabled,
        tuple(f"warmup.{f.name}" for f in dataclasses.fields(WarmupConfig) if f.name != "enabled"),
        "there is no warm start",
    ),
)


def shadowed_settings(cfg: Config) -> list[str]:
    """One line per setting ``cfg`` sets to a value other than its default that has no
    effect because another setting decides instead, naming both (for the driver to print
    at start: a silent override looks like a setting that does nothing)."""
    flat = {f"{s}.{k}": v for s, d in cfg.to_dict().items() for k, v in d.items()}
    table = settings(type(cfg))
    found = []
    for decider, decides, shadowed, why in _SHADOWS:
        if decider not in flat or not decides(cfg):
            continue
        for key in shadowed:
            if key in flat and flat[key] != table[key].default:
                found.append(
                    f"{key}={_spelled(flat[key])} has no effect: "
                    f"{decider}={_spelled(flat[decider])}, so {why}."
                )
    return found


def _spelled(value: object) -> str:
    """A value as an override spells it: ``false``, ``null``, ``'text'``, ``3``."""
    return json.dumps(value) if isinstance(value, bool) or value is None else repr(value)


def _a_number_if_nan(value: object) -> str:
    """ " a number" in a range error about nan (which fails every comparison), else ""."""
    return " a number" if isinstance(value, float) and math.isnan(value) else ""


def validate(cfg: Config) -> Config:
    """Checks each setting's choices and bounds (as its field declares them), then the
    rules between settings; raises ConfigError naming the key and the bad value."""
    flat = {f"{s}.{k}": v for s, d in cfg.to_dict().items() for k, v in d.items()}
    table = settings(type(cfg))
    for key, spec in table.items():
        if spec.choices is not None and flat[key] not in spec.choices:
            raise ConfigError(f"{key}={flat[key]!r} is not one of {', '.join(spec.choices)}.")
    for key, spec in table.items():
        _validate_number(key, spec, flat[key])
    _validate_learner(cfg)
    _validate_placement(cfg)
    _validate_model(cfg.model)
    _validate_engine(cfg.engine, cfg.model)
    _validate_warmup(cfg.warmup)
    if cfg.env.max_turns >= 1 << 16:
        raise ConfigError(
            f"env.max_turns={cfg.env.max_turns} must be below 65536 (one sampling seed per turn)."
        )
    _validate_sampling(cfg.rollout, cfg.model)
    _validate_backoffs(cfg.rollout)
    _validate_adaptive_concurrency(cfg.rollout)
    if cfg.eval.heldout_size > cfg.data.heldout_size:
        raise ConfigError(
            f"eval.heldout_size={cfg.eval.heldout_size} exceeds data.heldout_size="
            f"{cfg.data.heldout_size}; raise data.heldout_size or lower eval.heldout_size."
        )
    _validate_env(cfg.env)
    _validate_data(cfg.data)
    _validate_sandbox(cfg.sandbox)
    return cfg


def _validate_number(key: str, spec: Setting, value: Any) -> None:
    """One setting's value fits the machine types it reaches and its declared bounds;
    raises ConfigError naming ``key`` and ``value``."""
    # Numbers reach float32 math (the learner) and int64 (seeds, counts): beyond
    # those, a value that passes here overflows later, deep in a run.
    if (
        spec.type is float
        and isinstance(value, float)
        and math.isfinite(value)
        and abs(value) > _FLOAT32_MAX
    ):
        raise ConfigError(
            f"{key}={value!r} overflows float32: it must be a finite "
            f"float32 number (|value| <= {_FLOAT32_MAX:.4g})."
        )
    if spec.type is int and isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
        raise ConfigError(
            f"{key}={value!r} must fit in a signed 64-bit integer ({_INT64[0]} to {_INT64[1]})."
        )
    if spec.bounds is None:
        return
    # A declared range is a finite one: inf passes "> 0" but no deadline, rate or size
    # here means "unbounded" by it (it overflowed timers and kernel limits).
    finite = not (isinstance(value, float) and math.isinf(value))
    if not (finite and _parse_bounds(spec.bounds)(value)):
        within = spec.bounds if spec.bounds[0] in "<>" else f"in {spec.bounds}"
        hint = f" ({spec.hint})" if spec.hint else ""
        what = " a finite number" if not finite else _a_number_if_nan(value)
        raise ConfigError(f"{key}={value!r} must be{what} {within}{hint}.")


def _validate_model(m: ModelConfig) -> None:
    """The model folder exists when named, and the heads divide the width evenly."""
    if m.path and not os.path.isfile(os.path.join(m.path, "config.json")):
        raise ConfigError(
            f"model.path={m.path!r} is not a Hugging Face model folder (no config.json in it); "
            "pass the folder save_pretrained wrote, or \"\" to train a fresh model."
        )
    if m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}."
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.n_kv_heads}."
        )


def _validate_engine(e: EngineConfig, m: ModelConfig) -> None:
    """The KV cache and its blocks fit one context; replicas need their own actors."""
    if e.kv_cache_tokens and e.kv_cache_tokens < m.max_seq_len:
        raise ConfigError(
            f"engine.kv_cache_tokens={e.kv_cache_tokens} cannot hold one context of "
            f"model.max_seq_len={m.max_seq_len} tokens; raise it, or use 0 for the default."
        )
    if e.block_size > m.max_seq_len:
        raise ConfigError(
            f"engine.block_size={e.block_size} exceeds model.max_seq_len={m.max_seq_len}: no "
            "KV block would ever fill, so nothing could be shared; use a block of 8-32 tokens."
        )
    if e.num_replicas > 1 and e.placement != "disaggregated":
        raise ConfigError(
            f"engine.num_replicas={e.num_replicas} needs engine.placement=disaggregated (a "
            "colocated engine lives in the learner's process, one per run)."
        )


def _validate_data(data: DataConfig) -> None:
    """The keys a source reads are set, and keys it would ignore are not (a path given
    with source auto would silently train on something else). Files are read, and their
    columns checked, when the run starts (``raytunix.data.datasets``)."""
    files = data.source in typing.get_args(FileSource)
    if files and not data.path:
        raise ConfigError(
            f"data.source={data.source!r} needs data.path, the dataset's file or folder."
        )
    if not files:
        for key in ("path", "heldout_path", "heldout_split"):
            if getattr(data, key):
                raise ConfigError(
                    f"data.{key}={getattr(data, key)!r} is read only when data.source is one "
                    f"of {', '.join(typing.get_args(FileSource))} (it is {data.source!r}); set "
                    "data.source."
                )
    for low, high in (("min_terms", "max_terms"), ("min_digits", "max_digits")):
        if getattr(data, low) > getattr(data, high):
            raise ConfigError(
                f"data.{low}={getattr(data, low)} exceeds data.{high}={getattr(data, high)}; "
                f"lower data.{low} or raise data.{high}."
            )
    for key in ("question_column", "answer_column", "split"):
        if not getattr(data, key):
            raise ConfigError(f"data.{key} is empty; name the column (or split) to read.")
    if data.dataset_kwargs and data.source not in ("auto", "reasoning_gym"):
        raise ConfigError(
            f"data.dataset_kwargs={data.dataset_kwargs} configures a "
            "reasoning-gym dataset; data.source is "
            f"{data.source!r}. Drop it or use data.source=reasoning_gym."
        )
    if data.source in ("auto", "reasoning_gym") and data.dataset != "basic_arithmetic":
        from reasoning_gym.factory import DATASETS

        if data.dataset not in DATASETS:
            import difflib

            close = difflib.get_close_matches(data.dataset, list(DATASETS), n=5, cutoff=0.5)
            raise ConfigError(
                f"data.dataset={data.dataset!r} is not a reasoning-gym dataset"
                + (f"; did you mean {', '.join(close)}?" if close else "")
                + " (all: reasoning_gym.factory.DATASETS)."
            )


def _validate_sandbox(sandbox: SandboxConfig) -> None:
    for key in ("wall_time_s", "cpu_time_s"):
        value = getattr(sandbox, key)
        if not value <= SANDBOX_MAX_SECONDS:  # inf and nan too
            raise ConfigError(
                f"sandbox.{key}={value} must be a number of seconds <= {SANDBOX_MAX_SECONDS:g}."
            )
    mib = SANDBOX_MAX_BYTES >> 20
    for key, high in (
        ("memory_mb", mib),
        ("max_file_mb", mib),
        ("tmp_mb", mib),
        ("max_output_kb", SANDBOX_MAX_BYTES >> 10),
        ("max_workdir_mb", mib),
        ("max_processes", SANDBOX_MAX_PROCESSES),
    ):
        if getattr(sandbox, key) > high:
            raise ConfigError(f"sandbox.{key}={getattr(sandbox, key)} must be <= {high}.")
    if sandbox.resource in ("CPU", "GPU", "TPU", "memory", "object_store_memory"):
        raise ConfigError(
            f"sandbox.resource={sandbox.resource!r} is a built-in Ray resource; give a custom "
            "one (e.g. sandbox_host), and sandbox.num_cpus_per_actor for CPUs."
        )
    if sandbox.root_dir and not os.path.isabs(sandbox.root_dir):
        raise ConfigError(
            f"sandbox.root_dir={sandbox.root_dir!r} must be an absolute path (or "
            "empty for the system temp dir)."
        )


def _validate_env(env: EnvConfig) -> None:
    """env.name and env.agent resolve to classes (importing a user's module here, in the
    driver) and env.kwargs / env.agent_kwargs fit their constructors' signatures."""
    from raytunix.plugins import PluginError, check_kwargs, resolve

    try:
        env_cls = resolve("env", env.name)
    except PluginError as e:
        raise ConfigError(f"env.name={env.name!r}: {e}") from None
    try:
        check_kwargs(env_cls, env.kwargs, key="env.kwargs")
    except PluginError as e:
        raise ConfigError(str(e)) from None
    agent = env.agent
    if agent == "auto":
        declared = getattr(env_cls, "default_agent", None)
        if not isinstance(declared, str):
            raise ConfigError(
                f"env.agent=auto: {env_cls.__qualname__} has no default_agent; set env.agent "
                "(e.g. env.agent=text) or give the class default_agent = \"text\"."
            )
        agent = declared
    try:
        agent_cls = resolve("agent", agent)
    except PluginError as e:
        source = f"env.agent={env.agent!r}" + (
            f" (the default agent of {env_cls.__qualname__})" if env.agent == "auto" else ""
        )
        raise ConfigError(f"{source}: {e}") from None
    try:
        check_kwargs(agent_cls, env.agent_kwargs, key="env.agent_kwargs", provided=("tokenizer",))
    except PluginError as e:
        raise ConfigError(str(e)) from None
    # An agent may check its values too (a chat template that does not load, a tool parser
    # that does not exist) so a bad one stops the run here, not in an actor.
    for cls, kwargs, key in (
        (agent_cls, env.agent_kwargs, "env.agent_kwargs"),
        (env_cls, env.kwargs, "env.kwargs"),
    ):
        validate_kwargs = getattr(cls, "validate_kwargs", None)
        if validate_kwargs is not None:
            try:
                validate_kwargs(kwargs)
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None


def _validate_learner(cfg: Config) -> None:
    """Settings of the update that only make sense together."""
    learner = cfg.learner
    if learner.dual_clip and not learner.dual_clip > 1.0:
        raise ConfigError(
            f"learner.dual_clip={learner.dual_clip!r} must be > 1 (e.g. 3.0), or 0 "
            "for no dual clip."
        )
    if learner.dual_clip and learner.policy_loss != "ppo_clip":
        raise ConfigError(
            f"learner.dual_clip={learner.dual_clip!r} applies to "
            f"learner.policy_loss=ppo_clip only (it is {learner.policy_loss!r})."
        )
    if not learner.normalize_advantages_by_std and learner.advantage_estimator != "grpo":
        raise ConfigError(
            "learner.normalize_advantages_by_std=false applies to learner.advantage_estimator="
            f"grpo only (it is {learner.advantage_estimator!r}, which sets its own scale)."
        )
    if learner.weight_decay and learner.optimizer != "adamw":
        raise ConfigError(
            f"learner.weight_decay={learner.weight_decay!r} is applied by adamw "
            f"only; use learner.optimizer=adamw or learner.weight_decay=0."
        )
    steps = learner.rl_steps * learner.num_iterations
    if learner.lr_schedule != "constant" and steps <= learner.lr_warmup_steps:
        raise ConfigError(
            f"learner.lr_schedule={learner.lr_schedule!r} decays over the run's {steps} optimizer "
            f"steps (rl_steps x num_iterations), which must exceed learner.lr_warmup_steps="
            f"{learner.lr_warmup_steps}."
        )
    mesh = {k: getattr(learner, f"mesh_{k}") for k in ("data", "fsdp", "tensor")}
    for name, size in mesh.items():
        if size < 1 and size != -1:
            raise ConfigError(
                f"learner.mesh_{name}={size!r} must be a number of devices >= 1, "
                "or -1 for the devices the other mesh axes leave."
            )
    if sum(size == -1 for size in mesh.values()) > 1:
        raise ConfigError(
            "learner.mesh_data, mesh_fsdp, mesh_tensor: at most one may be -1 (the rest of the "
            f"devices), got {mesh}."
        )
    batch_split = math.prod(s for k, s in mesh.items() if k != "tensor" and s > 0)
    if learner.micro_batch_size % batch_split:
        raise ConfigError(
            f"learner.micro_batch_size={learner.micro_batch_size} cannot be split over "
            f"learner.mesh_data x mesh_fsdp = {batch_split} devices; use a multiple of "
            f"{batch_split} (or 0, the whole batch)."
        )
    if learner.pack_width == 1 or learner.pack_width < 0:
        raise ConfigError(
            f"learner.pack_width={learner.pack_width!r} must be >= 2 tokens per "
            "packed row, or 0 for model.max_seq_len."
        )
    targets = [n.strip() for n in learner.lora_target_modules.split(",") if n.strip()]
    unknown = [n for n in targets if n not in LORA_TARGET_MODULES]
    if unknown or not targets:
        raise ConfigError(
            f"learner.lora_target_modules={learner.lora_target_modules!r}: "
            f"{', '.join(map(repr, unknown)) or 'no layer named'}; name some of "
            f"{', '.join(LORA_TARGET_MODULES)}, comma-separated."
        )
    longest = cfg.env.max_turns * cfg.rollout.max_new_tokens
    if learner.overlong_buffer_tokens > longest:
        raise ConfigError(
            f"learner.overlong_buffer_tokens={learner.overlong_buffer_tokens} exceeds the most "
            f"tokens an episode can generate (env.max_turns x rollout.max_new_tokens = {longest})."
        )


def _validate_placement(cfg: Config) -> None:
    """Resources of learner hosts and env actors (``raytunix.cluster.placement``)."""
    from raytunix.cluster.placement import check_resources

    learner = cfg.learner
    if learner.slow_call_timeout_s < learner.call_timeout_s:
        raise ConfigError(
            f"learner.slow_call_timeout_s={learner.slow_call_timeout_s!r} is below "
            f"learner.call_timeout_s={learner.call_timeout_s!r}; it covers the calls that "
            "take longest (compiling, checkpoints), so set it >= learner.call_timeout_s."
        )
    for key, wanted, accelerators in (
        ("learner.resources", learner.resources, True),
        ("engine.actor_resources", cfg.engine.actor_resources, True),
        ("env.actor_resources", cfg.env.actor_resources, False),
    ):
        try:
            check_resources(key, wanted, allow_accelerators=accelerators)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
    if cfg.engine.actor_resources and cfg.engine.placement == "colocated":
        raise ConfigError(
            f"engine.actor_resources={cfg.engine.actor_resources} places engine actors of "
            "engine.placement=disaggregated; a colocated engine runs in the learner's process "
            "(placed by learner.resources)."
        )
    if learner.num_hosts > 1 and cfg.engine.placement == "colocated":
        raise ConfigError(
            f"learner.num_hosts={learner.num_hosts} needs engine.placement=disaggregated: a "
            "colocated engine lives in the one learner process."
        )
    if bool(learner.tpu_topology) != bool(learner.tpu_version):
        raise ConfigError(
            f"learner.tpu_topology={learner.tpu_topology!r} and learner.tpu_version="
            f"{learner.tpu_version!r}: set both (e.g. 4x4 and v6e) to reserve the learner's TPU "
            "slice, or neither."
        )
    if learner.tpu_topology:
        _validate_tpu_slice(learner)


def _validate_tpu_slice(learner: LearnerConfig) -> None:
    """``learner.tpu_version`` and ``learner.tpu_topology`` name a slice Ray knows, and
    ``learner.resources`` and ``learner.num_hosts`` match the hosts that slice has."""
    from ray._private.accelerators import TPUAcceleratorManager
    from ray.util.tpu import get_tpu_version_from_type, get_tpu_worker_resources

    try:
        version = get_tpu_version_from_type(learner.tpu_version)
    except ValueError as e:
        hint = (
            " (Ray names TPU v5e 'v5litepod': set learner.tpu_version=v5litepod)"
            if learner.tpu_version.lower().replace("tpu-", "") == "v5e"
            else ""
        )
        raise ConfigError(f"learner.tpu_version={learner.tpu_version!r}: {e}{hint}") from None
    if not TPUAcceleratorManager.is_valid_tpu_accelerator_topology(
        tpu_accelerator_version=version, tpu_topology=learner.tpu_topology
    ):
        raise ConfigError(
            f"learner.tpu_topology={learner.tpu_topology!r} is not a topology "
            f"of TPU {version} (e.g. 2x4, 4x4, 4x8 for v6e)."
        )
    try:
        hosts, bundle = get_tpu_worker_resources(
            learner.tpu_topology,
            learner.tpu_version,
            resources_per_worker=dict(learner.resources) or None,
        )
    except ValueError as e:
        raise ConfigError(
            f"learner.tpu_topology={learner.tpu_topology!r}, "
            f"learner.tpu_version={learner.tpu_version!r}: {e}"
        ) from None
    _, host = get_tpu_worker_resources(learner.tpu_topology, learner.tpu_version)
    asked = dict(learner.resources).get("TPU")
    if asked is not None and asked != host["TPU"]:
        raise ConfigError(
            f"learner.resources asks for TPU: {asked:g} per host, but a {learner.tpu_version} "
            f"host of topology {learner.tpu_topology} has {host['TPU']} chips; set "
            f"learner.resources={{TPU: {host['TPU']}}} (or leave it empty)."
        )
    if hosts != learner.num_hosts:
        raise ConfigError(
            f"a {learner.tpu_version} slice of topology {learner.tpu_topology} makes {hosts} "
            f"learner hosts of {bundle}, but learner.num_hosts={learner.num_hosts}; set "
            f"learner.num_hosts={hosts}."
        )


def _validate_adaptive_concurrency(rollout: RolloutConfig) -> None:
    """The controller's bounds must hold its start value; checked even when it is off, so
    that switching it on later cannot fail."""
    start = rollout.max_concurrent_episodes
    low, high = rollout.adaptive_min_episodes, rollout.adaptive_max_episodes
    if low and low > start:
        raise ConfigError(
            f"rollout.adaptive_min_episodes={low} exceeds rollout.max_concurrent_episodes="
            f"{start}, the controller's start value; lower the first or raise the second."
        )
    if high and high < start:
        raise ConfigError(
            f"rollout.adaptive_max_episodes={high} is below rollout.max_concurrent_episodes="
            f"{start}, the controller's start value; raise the first or lower the second."
        )


def _validate_backoffs(rollout: RolloutConfig) -> None:
    """The two retry schedules (engine calls; group retries and episode re-runs) must grow
    from a finite first wait to a cap no smaller than it."""
    for prefix in ("engine_retry", "retry"):
        initial = getattr(rollout, f"{prefix}_initial_delay_s")
        cap = getattr(rollout, f"{prefix}_max_delay_s")
        if not (cap >= initial and math.isfinite(cap)):
            raise ConfigError(
                f"rollout.{prefix}_max_delay_s={cap!r} must be finite and >= "
                f"rollout.{prefix}_initial_delay_s={initial!r}; it caps each wait."
            )


def _validate_warmup(w: WarmupConfig) -> None:
    """``warmup.*`` against each other: the file and ``warmup.source=file`` come together,
    and the step bounds are ordered."""
    if w.source != "auto" and (w.source == "file") != bool(w.demonstrations):
        raise ConfigError(
            f"warmup.source={w.source} with warmup.demonstrations={w.demonstrations!r}: the "
            "file is what warmup.source=file reads, and only it; set both, or neither "
            "(warmup.source=auto uses the file when one is given)."
        )
    if w.min_steps > w.max_steps:
        raise ConfigError(f"warmup.min_steps={w.min_steps} exceeds warmup.max_steps={w.max_steps}.")


def _validate_sampling(rollout: RolloutConfig, model: ModelConfig) -> None:
    """Training rollouts must sample from a distribution the learner can score finitely
    (``raytunix.inference.sampling_checks``: the bounds the engine and learner check too)."""
    from raytunix.inference.sampling_checks import check_sampling_settings

    if rollout.top_k == 1:
        raise ConfigError(
            "rollout.top_k=1 is greedy decoding: every sampled token has probability 1 and "
            "the policy gradient is zero. Use 0 (off) or a value >= 2, e.g. rollout.top_k=50."
        )
    try:
        check_sampling_settings(
            rollout.temperature,
            rollout.top_k,
            rollout.top_p,
            allow_greedy=False,
            vocab_size=_vocab_size(model),
        )
    except ValueError as e:  # its message starts with the setting: temperature=..., top_p=...
        raise ConfigError(f"rollout.{e}") from None


def _vocab_size(model: ModelConfig) -> int | None:
    """The policy's vocabulary as far as the config knows it: the Hugging Face model's
    ``vocab_size``, else ``model.tokenizer_vocab_size`` (the trained tokenizer's at
    most); None when config.json does not say."""
    if not model.path:
        return model.tokenizer_vocab_size
    try:
        with open(os.path.join(model.path, "config.json")) as f:
            size = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # the model loader reports a bad config.json
    return size if isinstance(size, int) and size > 0 else None


def preset_names() -> list[str]:
    return sorted(
        p.name[:-5]
        for p in resources.files("raytunix.configs").iterdir()
        if p.name.endswith(".yaml")
    )


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, but ``1e1`` and ``2E-3`` are numbers as in YAML 1.2 and JSON
    (YAML 1.1 wants a dot, ``1.0e1``, and reads ``1e1`` as text): a float written in
    scientific notation reaches a free mapping such as ``env.kwargs`` as a float."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # PyYAML keeps the last of two equal keys: a second `learner:` section would
        # silently drop the first one's settings.
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, typing.Hashable):
                continue  # the base class names an unhashable key
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    problem=f"the key {key!r} appears twice, on lines {first_line[key]} and "
                    f"{line}; keep one"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper that quotes what ``_Loader`` would read as a number (a text
    value ``1e3`` written bare would come back as the float 1000.0)."""


_SCIENTIFIC = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _yaml_class in (_Loader, _Dumper):
    _yaml_class.add_implicit_resolver("tag:yaml.org,2002:float", _SCIENTIFIC, list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """``text`` parsed as a config's YAML (``_Loader``). Raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _read_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        tree = load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {e}") from None
    return {} if tree is None else tree  # an empty file; [] or a scalar is refused by name


def parse_override(item: str, schema: type[Config] | None = None) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, YAML-parsed value); for a mapping-valued key
    of ``schema`` (default ``Config``), 'env.kwargs.turns=2' -> ("env", "kwargs.turns", 2)
    and, into nested mappings, 'env.kwargs.make_kwargs.n=2' -> ("env",
    "kwargs.make_kwargs.n", 2)."""
    mappings = _mappings(schema)
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} must look like section.key=value, e.g. learner.rl_steps=20."
        )
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) >= 3 and ".".join(parts[:2]) in mappings and all(parts[2:]):
        parts = [parts[0], ".".join(parts[1:])]  # env.kwargs.make_kwargs.seed: a nested entry
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"override key {dotted!r} must be section.key, e.g. rollout.group_size "
            f"(or {' / '.join(sorted(mappings))}.name for one entry of a mapping)."
        )
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts[0], parts[1], value


def load_config(
    config: str | None = None, overrides: Sequence[str] = (), schema: type[Config] | None = None
) -> Config:
    """Builds the run config.

    Args:
      config: a packaged preset name (see ``preset_names()``), a path to a YAML file, or
        None for the defaults.
      overrides: ``section.key=value`` strings applied last, in order.
      schema: the config class to build (default ``Config``; a subclass may add sections).

    Raises:
      ConfigError: unknown preset or file, bad YAML, unknown section/key, bad value.
    """
    cfg = (schema or Config)()
    file_names_run = False  # a user's YAML file that sets run.name keeps it
    if config:
        if os.path.isdir(config):
            raise ConfigError(
                f"config {config!r} is a directory; pass a YAML file or a preset name."
            )
        if os.path.exists(config):
            with open(config) as f:
                data = _read_yaml(f.read(), config)
            _merge(cfg, data, config)
            file_names_run = isinstance(data.get("run"), dict) and "name" in data["run"]
        elif config in preset_names():
            text = resources.files("raytunix.configs").joinpath(f"{config}.yaml").read_text()
            _merge(cfg, _read_yaml(text, f"preset {config}"), f"preset {config}")
        elif config.endswith((".yaml", ".yml")) or os.sep in config:
            raise ConfigError(f"config file {config!r} does not exist; check the path.")
        else:
            raise ConfigError(
                f"config {config!r} is neither a YAML file nor a preset; presets: "
                f"{', '.join(preset_names())}."
            )
    preset_env = cfg.env.name
    overridden = {apply_override(cfg, item) for item in overrides}
    renamed_env = "env.name" in overridden and cfg.env.name != preset_env
    if renamed_env and "run.name" not in overridden and not file_names_run:
        cfg.run.name = run_name_for_env(cfg)
    return validate(cfg)


def run_name_for_env(cfg: Config) -> str:
    """``<environment>-<advantage estimator>``, the run name of a run whose ``env.name``
    was overridden without a ``run.name`` (so ``env.name=agent_program`` on the default
    preset does not write ``runs/calculator-grpo-*``). The environment is the agent
    program's or verifiers environment's module for those two, else the env's registered
    name or class: ``my_agent-grpo``, ``parityenv-grpo``, ``reasoning-gym-grpo``.
    """
    env = cfg.env
    source = str(
        env.kwargs.get({"agent_program": "entrypoint", "verifiers": "env_id"}.get(env.name, ""), "")
    )
    if source:
        base = source.split(":")[0].split(".")[-1]
    else:
        base = env.name.split(":")[-1].split(".")[-1]
    slug = re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-") or "env"
    return f"{slug}-{cfg.learner.advantage_estimator}"


def apply_override(cfg: Config, item: str) -> str:
    """Sets one ``section.key=value`` override on ``cfg`` in place, unvalidated (call
    ``validate`` once all are set); returns the ``section.key`` it set (``env.kwargs``
    for ``env.kwargs.turns=2``).

    Raises:
      ConfigError: a malformed override, an unknown section or key (naming the valid
        ones), or a value of the wrong type.
    """
    section, key, value = parse_override(item, type(cfg))
    if "." in key:  # one entry of a mapping: env.kwargs.turns=2, env.kwargs.make_kwargs.n=2
        key, *names = key.split(".")
        mapping = getattr(getattr(cfg, section), key)
        value = _with_entry(mapping, names, value, item, f"{section}.{key}")
    _merge(cfg, {section: {key: value}}, f"override {item!r}")
    return f"{section}.{key}"


def _with_entry(
    mapping: dict[str, Any], names: list[str], value: Any, item: str, where: str
) -> dict[str, Any]:
    """A copy of ``mapping`` (the setting ``where``, e.g. ``env.kwargs``) with ``value`` at
    the nested entry ``names`` (mappings on the way are made where missing; the others'
    entries are kept).

    Raises:
      ConfigError: an entry on the way holds something other than a mapping.
    """
    head, *rest = names
    if not rest:
        return {**mapping, head: value}
    inner = mapping.get(head, {})
    if not isinstance(inner, dict):
        raise ConfigError(
            f"override {item!r}: {where}.{head} is {inner!r}, not a mapping, so it has no "
            f"entry {rest[0]!r}; set {where}.{head} as a whole, e.g. "
            f"'{where}.{head}={{{rest[0]}: ...}}'."
        )
    return {**mapping, head: _with_entry(inner, rest, value, item, f"{where}.{head}")}


def config_from_dict(tree: dict[str, Any], schema: type[Config] | None = None) -> Config:
    """Rebuilds a Config (or a ``schema`` instance) saved with ``to_dict`` (e.g. from a run
    directory)."""
    cfg = (schema or Config)()
    _merge(cfg, tree, "saved config")
    return validate(cfg)
