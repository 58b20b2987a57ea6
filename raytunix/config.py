"""One typed configuration for a run: packaged YAML presets, a user's YAML file and dotted
command-line overrides, validated at start with errors that name the bad key and value.

    cfg = load_config("default", overrides=["rollout.max_concurrent_episodes=64"])
    cfg.rollout.max_concurrent_episodes  # 64

Each section is one dataclass; every field has a default and a comment saying what it is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from importlib import resources
from typing import Any, Sequence

import yaml


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and says what to do."""


@dataclasses.dataclass
class RunConfig:
    name: str = "default"  # run name; the run directory is output_dir/name-<timestamp>
    output_dir: str = "runs"  # parent of run directories
    seed: int = 0  # seeds data order, model init and sampling
    log_every: int = 1  # print a progress line every this many RL steps
    profile_window_s: float = 3.0  # profiling drains every actor's spans at the end of the first RL step at least this many seconds after the last drain; shorter steps share one window (their records are written together, each with its metrics); 0 = after every step


@dataclasses.dataclass
class ModelConfig:
    path: str = ""  # a Hugging Face Llama / Qwen2 / Qwen3 model folder (config.json, *.safetensors, tokenizer.json, tokenizer_config.json) to train: its shape, weights, tokenizer and chat template replace d_model..d_ff and tokenizer_vocab_size (max_seq_len still sets the context), and the trained policy is exported to RUN_DIR/export/ in the same layout; "" = a fresh model of the sizes below
    d_model: int = 128  # residual width
    n_layers: int = 3  # transformer blocks
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention)
    d_ff: int = 384  # SwiGLU hidden width
    max_seq_len: int = 128  # context length in tokens (also the KV cache length)
    tokenizer_vocab_size: int = 384  # byte-level BPE vocabulary, trained on the demonstrations


@dataclasses.dataclass
class DataConfig:
    """Where a run's tasks come from (``raytunix/data/datasets.py``). Nothing is downloaded."""

    source: str = "auto"  # auto: the environment's own tasks, else reasoning-gym data.dataset | env: the environment's own (error if it brings none) | reasoning_gym: data.dataset | parquet | jsonl: a file or a folder of shards per split | hf: a save_to_disk folder
    dataset: str = "basic_arithmetic"  # reasoning-gym dataset name (any of reasoning_gym.factory.DATASETS) for source auto / reasoning_gym
    dataset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # that dataset's config (basic_arithmetic also takes the min/max keys below)
    path: str = ""  # parquet / jsonl / hf: the dataset's file or folder
    split: str = "train"  # the training split inside a folder
    heldout_path: str = ""  # held-out file or folder; "" = data.path when data.heldout_split is set, else data.heldout_size rows of the training split held out (drawn with data.seed)
    heldout_split: str = ""  # the held-out split inside a folder (e.g. test); "" = "test" when data.heldout_path is a folder
    question_column: str = "question"  # column holding the question text
    answer_column: str = "answer"  # column holding the reference answer (GSM8K's "... #### 72" keeps 72)
    id_column: str = ""  # column of unique task ids; "" = <split>-<row number>
    overlong_prompts: str = "error"  # a train or held-out task whose first prompt leaves no room for a reply in model.max_seq_len (every task is checked before training): error (the run stops, naming them) | drop (left out, counted in summary.json's tasks_dropped)
    train_size: int = 20000  # training tasks (cycled through in order); a dataset on disk gives at most its rows
    heldout_size: int = 200  # held-out tasks, never trained on
    seed: int = 0  # generator seed of the training split (held-out uses another); seeds the held-out draw off a file's training split
    min_terms: int = 2
    max_terms: int = 3
    min_digits: int = 2
    max_digits: int = 3


@dataclasses.dataclass
class EnvConfig:
    name: str = "calculator_math"  # a registered environment (calculator_math, math_verifier, python_math, bash_terminal, text_to_sql, web_api, repo_repair, gymnasium, simulated_tool, or a package's entry point) or an import path package.module:Class
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # the environment's constructor arguments, checked against its signature (e.g. {max_tool_errors: 2})
    agent: str = "auto"  # auto = the environment's default agent; or a registered agent (tool, answer, text) or package.module:Class
    agent_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # the agent's constructor arguments besides the tokenizer (e.g. {system_prompt: "..."})
    max_turns: int = 4  # model turns per episode
    num_env_actors: int = 2  # Ray actors hosting environments (scaled apart from the learner)
    env_actor_max_restarts: int = 3  # a crashed env actor is restarted this often
    actor_resources: dict[str, float] = dataclasses.field(default_factory=dict)  # Ray resources each env actor asks for, e.g. {raytunix_env: 1}: a custom resource only the CPU node pool offers, so env actors scale there and never on TPU hosts (TPU/GPU refused; they run with JAX_PLATFORMS=cpu); {} = anywhere


@dataclasses.dataclass
class RolloutConfig:
    group_size: int = 8  # G trajectories sampled per task (GRPO group)
    groups_per_batch: int = 16  # tasks per learner batch
    max_concurrent_episodes: int = 128  # episodes in flight at once (with adaptive_concurrency: the start value)
    adaptive_concurrency: bool = True  # a controller moves max_concurrent_episodes during the run to hold the engine busy near target_engine_busy
    target_engine_busy: float = 0.9  # wanted engine busy fraction (device seconds / wall seconds), in (0, 1]
    adaptive_min_episodes: int = 0  # lowest budget the controller may set; 0 = one group (group_size)
    adaptive_max_episodes: int = 0  # highest budget; 0 = (max_staleness + 1) x groups_per_batch x group_size, the most admission ever lets in
    adaptive_interval_s: float = 2.0  # seconds between two readings of the engine's stats
    max_staleness: int = 1  # a group is only started if it will be consumed within this many versions
    temperature: float = 1.0  # sampling temperature for training rollouts (>= 0.01 in float32, so logprobs stay finite; eval is always greedy)
    top_k: int = 0  # sample among the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling: smallest set of tokens with this much mass; 1.0 = off; at most 1/top_k (or 1/vocabulary) is greedy and refused
    max_new_tokens: int = 48  # per model turn
    episode_timeout_s: float = 120.0  # wall-clock budget per episode
    batch_queue_size: int = 2  # finished batches waiting for the learner (backpressure)
    drop_failed_groups: bool = False  # drop a group with a failed member instead of masking it
    stale_token_policy: str = "drop"  # a packed group holding tokens older than max_staleness: drop it | mask those tokens out of the loss | accept them; each counted
    partial_rollout: bool = True  # an episode goes on across weight updates; false: it restarts from its prompt (bounded), so its tokens share one version
    dynamic_sampling: bool = False  # DAPO: filter groups whose rewards are all equal (zero advantage) and sample others until the batch is full
    dynamic_sampling_max_filtered: int = 0  # at most this many groups filtered per batch, then such groups are kept (counted, warned); 0 = 4 x groups_per_batch
    batch_timeout_s: float = 900.0  # the run stops (checkpoints kept) if no batch arrives in this time
    # Faults (see raytunix/rollout/orchestrator.py): retries back off exponentially with jitter.
    max_episode_restarts: int = 2  # an episode whose env actor died is re-run on a live actor this often, then ends as env_error
    max_group_retries: int = 3  # a group that made no data (engine down, or every member failed by infrastructure) is retried this often, then its task is filtered
    max_consecutive_failures: int = 256  # the breaker: this many episodes in a row failed by infrastructure stop the run with one error (checkpoints kept); 0 = off
    engine_retry_max_attempts: int = 8  # attempts of one engine call within an episode, the first included
    engine_retry_initial_delay_s: float = 0.1  # first wait before an engine call is retried, seconds
    engine_retry_max_delay_s: float = 5.0  # cap on one wait between engine call attempts, seconds
    engine_retry_multiplier: float = 2.0  # each wait between engine call attempts grows by this factor (>= 1)
    engine_retry_jitter: float = 0.5  # random fraction of each such wait, in [0, 1] (0.5: equal jitter, 1: full jitter)
    retry_initial_delay_s: float = 0.5  # first wait before a group is retried or an episode re-run, seconds
    retry_max_delay_s: float = 30.0  # cap on one wait between group retries or episode re-runs, seconds
    retry_multiplier: float = 2.0  # each wait between group retries or episode re-runs grows by this factor (>= 1)
    retry_jitter: float = 0.5  # random fraction of each such wait, in [0, 1]


@dataclasses.dataclass
class EngineConfig:
    max_batch_size: int = 128  # most requests decoded together (continuous batching)
    placement: str = "colocated"  # colocated (engine and learner in one actor) | disaggregated
    block_size: int = 16  # tokens per KV-cache block (paged attention)
    kv_cache_tokens: int = 0  # KV capacity in tokens (running requests, sessions, prefix cache); 0 = 4 x max_batch_size x model.max_seq_len
    prefill_chunk_tokens: int = 256  # most prompt tokens prefilled between two decode steps
    kv_on_weight_update: str = "recompute"  # recompute | keep (KV of older weights is reused and counted as stale)
    sessions: bool = True  # keep an episode's KV in the engine between its turns
    num_replicas: int = 1  # engine actors behind the router (disaggregated placement only)
    actor_resources: dict[str, float] = dataclasses.field(default_factory=dict)  # Ray resources each engine actor asks for (disaggregated placement), e.g. {TPU: 4} for one TPU host of an inference slice; {} = no CPU reserved, anywhere
    actor_max_restarts: int = 3  # a crashed engine actor (disaggregated placement) is restarted this often, then the run stops

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``InferenceEngine`` that this section sets."""
        return {"max_batch_size": self.max_batch_size, "block_size": self.block_size,
                "kv_cache_tokens": self.kv_cache_tokens or None,
                "prefill_chunk_tokens": self.prefill_chunk_tokens,
                "kv_on_weight_update": self.kv_on_weight_update, "sessions": self.sessions}


@dataclasses.dataclass
class LearnerConfig:
    rl_steps: int = 40  # GRPO updates
    learning_rate: float = 1e-4
    optimizer: str = "adamw"  # adamw | adam | sgd (optax)
    lr_schedule: str = "constant"  # constant | linear | cosine: decay to 0 at rl_steps x num_iterations optimizer steps
    lr_warmup_steps: int = 0  # the learning rate rises linearly over this many optimizer steps
    weight_decay: float = 0.0  # adamw's decoupled weight decay (matrices only)
    max_grad_norm: float = 1.0
    advantage_estimator: str = "grpo"  # grpo | rloo (leave-one-out baseline) | reinforce_pp (group mean, then batch normalisation) | gae (per-token GAE from a value head on the policy: PPO)
    gae_gamma: float = 1.0  # gae: discount per generated token, in [0, 1]
    gae_lambda: float = 0.95  # gae: GAE's lambda, in [0, 1]
    gae_normalize: bool = True  # gae: whiten the advantages over the batch's trained tokens
    value_coef: float = 0.5  # gae: weight of the value head's loss (> 0)
    value_clip: float = 0.2  # gae: PPO's value clip, how far a value may move from the batch's start (> 0)
    normalize_advantages_by_std: bool = True  # grpo: divide by the group's std; false is Dr. GRPO's advantage
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo (clipped sequence-level ratio) | cispo (clipped stop-gradient IS weight x logprob)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28  # asymmetric upper clip (DAPO)
    dual_clip: float = 0.0  # ppo_clip: a negative-advantage token's loss is at most dual_clip x |A| (> 1, e.g. 3); 0 = off
    kl_coef: float = 0.0  # > 0 adds a KL penalty to the warm-start policy
    kl_estimator: str = "k3"  # k1 | k2 | k3: Schulman's estimators of KL(policy || reference), the value kl_ref reports; in the loss each is importance-weighted so its gradient is that of KL(policy || reference) (README, The RL algorithm)
    entropy_coef: float = 0.0  # > 0 subtracts this x the token entropy from the loss (exploration bonus)
    loss_aggregation: str = "token_mean"  # token_mean | sequence_mean_token_mean | sequence_mean_token_sum_norm (Dr. GRPO: each sequence's token sum / model.max_seq_len)
    overlong_buffer_tokens: int = 0  # DAPO's overlong penalty: the reward drops linearly to -1 over the last this many of env.max_turns x rollout.max_new_tokens generated tokens; 0 = off
    micro_batch_size: int = 0  # trajectories (packed rows with sequence_packing) per forward/backward pass, gradients summed (same update as the whole batch); 0 = whole batch
    num_iterations: int = 1  # optimizer steps per batch, the clip anchored at the batch's start
    sequence_packing: bool = True  # pack several trajectories into each row of pack_width tokens (attention within a trajectory only; same update as padding each to the longest); micro_batch_size then counts packed rows
    pack_width: int = 0  # tokens of the widest packed row (>= 2); 0 = model.max_seq_len; a narrower padding width is used when it holds the batch in fewer tokens; a longer trajectory is cut to it
    off_policy_correction: str = "none"  # none: clip around the behaviour (engine) policy | decoupled_ppo: clip around the learner's policy at the update's start, behaviour through a truncated importance weight
    importance_sampling: str = "token_tis"  # decoupled_ppo's weight pi_prox/pi_behav: per token (token_tis), per sequence as the product (sequence_tis) or geometric mean (geometric_tis) of token ratios
    importance_cap: float = 2.0  # the importance weight is truncated at this (>= 1)
    max_consecutive_nonfinite_updates: int = 3  # an update whose loss, gradients or new parameters are not finite is not applied (counted: updates_skipped_nonfinite); this many in a row stop the run with one error; 0 = never stop
    checkpoint_every: int = 10  # RL steps between checkpoints (and one at the end); saved asynchronously, while training goes on
    max_checkpoints: int = 3  # the newest this many checkpoints stay (plus the best one with keep_best_by)
    keep_best_by: str = ""  # a number of the RL step's metrics (e.g. reward_mean: the batch's mean reward); the checkpoint with the best value is never deleted; "" = off
    keep_best_mode: str = "max"  # max | min: whether a higher or a lower keep_best_by is better
    num_hosts: int = 1  # learner actors, one per host, running one JAX program (jax.distributed; raytunix.learner.group); 1 = one learner actor; > 1 needs engine.placement=disaggregated
    resources: dict[str, float] = dataclasses.field(default_factory=dict)  # Ray resources of each learner host (also of the single learner actor, or the colocated learner + engine), e.g. {TPU: 4}: all of a TPU VM's chips; {} = one CPU
    placement_strategy: str = "STRICT_SPREAD"  # how the learner hosts' placement group spreads: STRICT_SPREAD (one per node) | SPREAD | PACK | STRICT_PACK
    tpu_topology: str = ""  # the learner slice's TPU topology (e.g. 4x4); with tpu_version the hosts are reserved as one slice (ray.util.tpu) and ranked by TPU worker id; "" = a plain placement group
    tpu_version: str = ""  # the learner slice's TPU generation (e.g. v6e, v5p, v4); set with tpu_topology
    mesh_data: int = -1  # devices of the learner's mesh for data parallelism; -1 = the devices mesh_fsdp x mesh_tensor leave (raytunix.learner.sharding)
    mesh_fsdp: int = 1  # devices each param and optimizer moment is split over (FSDP/ZeRO-3); the batch is split over data x fsdp; -1 = the rest
    mesh_tensor: int = 1  # Megatron tensor parallelism (attention heads, MLP width, vocabulary); -1 = the rest
    call_timeout_s: float = 1800.0  # seconds a learner call (an update, the weights) may take before the learner counts as stuck: a multi-host group kills its hosts and is rebuilt from the newest checkpoint every host reads; one learner actor stops the run (resume it)
    slow_call_timeout_s: float = 3600.0  # the same for calls that compile or move the whole state: the first update after a (re)start, warm-start steps, checkpoint saves and restores, the export; >= call_timeout_s


@dataclasses.dataclass
class WarmupConfig:
    enabled: bool = True  # supervised warm start on synthetic tool-use demonstrations
    max_steps: int = 1400
    min_steps: int = 300
    batch_size: int = 32
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    tool_use_prob_2_terms: float = 0.25  # share of demonstrations that call the tool
    tool_use_prob_3_terms: float = 0.85
    eval_every: int = 100  # steps between checks of the stop condition
    eval_size: int = 128  # held-out-free dev tasks used for the stop condition
    target_tool_accuracy: float = 0.6  # stop once greedy tool-path accuracy reaches this


@dataclasses.dataclass
class EvalConfig:
    heldout_size: int = 200  # held-out tasks evaluated greedily before and after RL
    max_new_tokens: int = 48


@dataclasses.dataclass
class SandboxConfig:
    """Where code-running tools (python, bash) execute: ``raytunix.sandbox``. A pool of
    sandbox actors is started when the environment runs sandboxed tools (its class sets
    ``uses_sandbox``)."""

    backend: str = "auto"  # auto (bubblewrap where it works, else subprocess with a warning) | bwrap (or stop) | subprocess
    num_actors: int = 1  # sandbox Ray actors (scaled apart from env actors)
    num_cpus_per_actor: float = 0.5  # Ray CPUs each sandbox actor reserves (fractions allowed)
    resource: str = ""  # a custom Ray resource each sandbox actor needs one unit of, e.g. sandbox_host ("" = none)
    max_concurrent_runs: int = 32  # commands one sandbox actor runs at once
    actor_max_restarts: int = 3  # a crashed sandbox actor is restarted this often
    wall_time_s: float = 10.0  # wall-clock limit of one command; its whole process tree is killed then
    cpu_time_s: float = 10.0  # CPU seconds per process
    memory_mb: int = 1024  # address space per process, MiB (>= 16)
    max_processes: int = 64  # processes and threads of one command at once
    max_file_mb: int = 64  # largest file a command may write, MiB
    max_output_kb: int = 64  # stdout (and stderr) kept per command, KiB; the rest is dropped and reported
    tmp_mb: int = 64  # size of the private /tmp (and /dev/shm) of a command, MiB
    max_workdir_mb: int = 256  # disk budget of one work dir, all its files together, MiB (>= 1); enforced where the sandbox runs as root
    allow_weak_isolation: bool = False  # run tools even where the sandbox cannot keep secrets, loopback and host files out of reach (it says which at start); false = refuse to start there
    root_dir: str = ""  # absolute directory for work dirs ("" = <temp dir>/raytunix-sandbox-<uid>)


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_CHOICES = {
    "engine.placement": ("colocated", "disaggregated"),
    "engine.kv_on_weight_update": ("recompute", "keep"),
    "learner.loss_aggregation": ("token_mean", "sequence_mean_token_mean",
                                 "sequence_mean_token_sum_norm"),
    "learner.off_policy_correction": ("none", "decoupled_ppo"),
    "learner.importance_sampling": ("token_tis", "sequence_tis", "geometric_tis"),
    "learner.optimizer": ("adamw", "adam", "sgd"),
    "learner.lr_schedule": ("constant", "linear", "cosine"),
    "learner.advantage_estimator": ("grpo", "rloo", "reinforce_pp", "gae"),
    "learner.policy_loss": ("ppo_clip", "gspo", "cispo"),
    "learner.kl_estimator": ("k1", "k2", "k3"),
    "rollout.stale_token_policy": ("drop", "mask", "accept"),
    "learner.keep_best_mode": ("max", "min"),
    "learner.placement_strategy": ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"),
    "data.source": ("auto", "env", "reasoning_gym", "parquet", "jsonl", "hf"),
    "data.overlong_prompts": ("error", "drop"),
    "sandbox.backend": ("auto", "bwrap", "subprocess"),
}
_POSITIVE = {
    "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.d_ff",
    "model.max_seq_len", "data.train_size", "data.heldout_size", "env.max_turns",
    "env.num_env_actors", "rollout.group_size", "rollout.groups_per_batch",
    "rollout.max_concurrent_episodes", "rollout.target_engine_busy",
    "rollout.adaptive_interval_s", "rollout.max_new_tokens", "rollout.episode_timeout_s",
    "rollout.batch_queue_size", "rollout.batch_timeout_s", "rollout.engine_retry_max_attempts",
    "rollout.engine_retry_initial_delay_s", "rollout.retry_initial_delay_s", "engine.max_batch_size", "engine.block_size", "engine.num_replicas", "learner.learning_rate",
    "learner.checkpoint_every", "learner.max_checkpoints", "learner.num_iterations",
    "learner.num_hosts", "learner.call_timeout_s", "learner.slow_call_timeout_s",
    "warmup.batch_size",
    "warmup.learning_rate", "warmup.eval_every", "warmup.eval_size", "eval.heldout_size",
    "eval.max_new_tokens", "run.log_every", "sandbox.num_actors", "sandbox.max_concurrent_runs",
    "sandbox.wall_time_s", "sandbox.cpu_time_s", "sandbox.memory_mb", "sandbox.max_processes",
    "sandbox.max_output_kb", "sandbox.tmp_mb", "sandbox.max_workdir_mb",
}
_NON_NEGATIVE = {
    "rollout.max_staleness", "rollout.adaptive_min_episodes", "rollout.adaptive_max_episodes",
    "rollout.dynamic_sampling_max_filtered", "rollout.max_episode_restarts",
    "rollout.max_group_retries", "rollout.max_consecutive_failures", "rollout.top_k", "learner.rl_steps", "learner.kl_coef",
    "learner.weight_decay", "learner.max_grad_norm", "warmup.max_steps", "warmup.min_steps",
    "env.env_actor_max_restarts", "engine.kv_cache_tokens", "learner.clip_eps_low",
    "learner.clip_eps_high", "warmup.warmup_steps", "sandbox.num_cpus_per_actor",
    "sandbox.actor_max_restarts", "engine.actor_max_restarts", "sandbox.max_file_mb", "learner.lr_warmup_steps",
    "learner.dual_clip", "learner.entropy_coef", "learner.overlong_buffer_tokens",
    "learner.micro_batch_size", "run.profile_window_s",
    "learner.max_consecutive_nonfinite_updates",
}
_PROBABILITY = {"warmup.tool_use_prob_2_terms", "warmup.tool_use_prob_3_terms",
                "warmup.target_tool_accuracy"}


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Converts a YAML or command-line value to the field's type, or raises ConfigError."""
    target = {"int": int, "float": float, "str": str, "bool": bool}.get(
        annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))
    if target is None:
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
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(tree).__name__}.")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    for section_name, values in tree.items():
        if section_name not in sections:
            raise ConfigError(
                f"{source}: unknown section {section_name!r}; valid sections: {', '.join(sections)}.")
        section = getattr(cfg, section_name)
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section_name!r} must be a mapping, got {values!r}.")
        for key, value in values.items():
            _set(section_name, section, key, value, source)


def _set(section_name: str, section: Any, key: str, value: Any, source: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(section)}
    full = f"{section_name}.{key}"
    if key not in fields:
        raise ConfigError(
            f"{source}: unknown key {full!r}; valid keys in {section_name!r}: {', '.join(fields)}.")
    setattr(section, key, _coerce(full, value, fields[key].type))


def _a_number_if_nan(value) -> str:
    """" a number" in a range error about nan (which fails every comparison), else ""."""
    return " a number" if isinstance(value, float) and math.isnan(value) else ""


def validate(cfg: Config) -> Config:
    """Checks ranges and choices; raises ConfigError naming the key and the bad value."""
    flat = {f"{s}.{k}": v for s, d in cfg.to_dict().items() for k, v in d.items()}
    for key, choices in _CHOICES.items():
        if flat[key] not in choices:
            raise ConfigError(f"{key}={flat[key]!r} is not one of {', '.join(choices)}.")
    for key in _POSITIVE:
        if not flat[key] > 0:
            raise ConfigError(f"{key}={flat[key]!r} must be{_a_number_if_nan(flat[key])} > 0.")
    for key in _NON_NEGATIVE:
        if not flat[key] >= 0:
            raise ConfigError(f"{key}={flat[key]!r} must be{_a_number_if_nan(flat[key])} >= 0.")
    for key in _PROBABILITY:
        if not 0.0 <= flat[key] <= 1.0:
            raise ConfigError(f"{key}={flat[key]!r} must be a probability in [0, 1].")
    if not (cfg.learner.importance_cap >= 1.0 and math.isfinite(cfg.learner.importance_cap)):
        raise ConfigError(
            f"learner.importance_cap={cfg.learner.importance_cap!r} must be a finite number "
            ">= 1 (e.g. 2.0): a cap below 1 down-weights tokens that are exactly on-policy.")
    if not math.isfinite(cfg.run.profile_window_s):
        raise ConfigError(
            f"run.profile_window_s={cfg.run.profile_window_s!r} must be a finite number of "
            "seconds >= 0 (e.g. 3): the records of the steps of a window wait for it to "
            "close, so a window that never closes keeps them, and its spans, to the end.")
    for key in ("learner.clip_eps_low", "learner.clip_eps_high"):
        if flat[key] >= 1.0:
            raise ConfigError(f"{key}={flat[key]!r} must be below 1 (a ratio clip range, e.g. 0.2).")
    _validate_learner(cfg)
    _validate_placement(cfg)
    m = cfg.model
    if m.path and not os.path.isfile(os.path.join(m.path, "config.json")):
        raise ConfigError(
            f"model.path={m.path!r} is not a Hugging Face model folder (no config.json in it); "
            "pass the folder save_pretrained wrote, or \"\" to train a fresh model.")
    if m.max_seq_len < 32:
        raise ConfigError(f"model.max_seq_len={m.max_seq_len} is too short for a conversation; use at least 32.")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.n_kv_heads}.")
    if m.tokenizer_vocab_size < 256 + 16:
        raise ConfigError(
            f"model.tokenizer_vocab_size={m.tokenizer_vocab_size} must be at least 272 "
            "(256 bytes plus the special tokens).")
    e = cfg.engine
    if e.kv_cache_tokens and e.kv_cache_tokens < m.max_seq_len:
        raise ConfigError(
            f"engine.kv_cache_tokens={e.kv_cache_tokens} cannot hold one context of "
            f"model.max_seq_len={m.max_seq_len} tokens; raise it, or use 0 for the default.")
    if e.block_size > m.max_seq_len:
        raise ConfigError(
            f"engine.block_size={e.block_size} exceeds model.max_seq_len={m.max_seq_len}: no "
            "KV block would ever fill, so nothing could be shared; use a block of 8-32 tokens.")
    if e.num_replicas > 1 and e.placement != "disaggregated":
        raise ConfigError(
            f"engine.num_replicas={e.num_replicas} needs engine.placement=disaggregated (a "
            "colocated engine lives in the learner's process, one per run).")
    if e.prefill_chunk_tokens < 2:
        raise ConfigError(f"engine.prefill_chunk_tokens={e.prefill_chunk_tokens} must be >= 2.")
    if cfg.warmup.min_steps > cfg.warmup.max_steps:
        raise ConfigError(
            f"warmup.min_steps={cfg.warmup.min_steps} exceeds warmup.max_steps={cfg.warmup.max_steps}.")
    if cfg.env.max_turns >= 1 << 16:
        raise ConfigError(f"env.max_turns={cfg.env.max_turns} must be below 65536 (one sampling seed per turn).")
    _validate_sampling(cfg.rollout, cfg.model)
    _validate_backoffs(cfg.rollout)
    _validate_adaptive_concurrency(cfg.rollout)
    if cfg.rollout.group_size < 2:
        raise ConfigError(
            f"rollout.group_size={cfg.rollout.group_size}: GRPO needs at least 2 samples per task.")
    if cfg.eval.heldout_size > cfg.data.heldout_size:
        raise ConfigError(
            f"eval.heldout_size={cfg.eval.heldout_size} exceeds data.heldout_size="
            f"{cfg.data.heldout_size}; raise data.heldout_size or lower eval.heldout_size.")
    _validate_env(cfg.env)
    _validate_data(cfg.data)
    _validate_sandbox(cfg.sandbox)
    return cfg


def _validate_data(data: DataConfig) -> None:
    """The keys a source reads are set, and keys it would ignore are not (a path given
    with source auto would silently train on something else). Files are read, and their
    columns checked, when the run starts (``raytunix.data.datasets``)."""
    from raytunix.data.datasets import FILE_SOURCES

    files = data.source in FILE_SOURCES
    if files and not data.path:
        raise ConfigError(f"data.source={data.source!r} needs data.path, the dataset's file "
                          "or folder.")
    if not files:
        for key in ("path", "heldout_path", "heldout_split"):
            if getattr(data, key):
                raise ConfigError(
                    f"data.{key}={getattr(data, key)!r} is read only when data.source is one "
                    f"of {', '.join(FILE_SOURCES)} (it is {data.source!r}); set data.source.")
    for key in ("question_column", "answer_column", "split"):
        if not getattr(data, key):
            raise ConfigError(f"data.{key} is empty; name the column (or split) to read.")
    if data.dataset_kwargs and data.source not in ("auto", "reasoning_gym"):
        raise ConfigError(f"data.dataset_kwargs={data.dataset_kwargs} configures a "
                          "reasoning-gym dataset; data.source is "
                          f"{data.source!r}. Drop it or use data.source=reasoning_gym.")
    if data.source in ("auto", "reasoning_gym") and data.dataset != "basic_arithmetic":
        from reasoning_gym.factory import DATASETS

        if data.dataset not in DATASETS:
            import difflib

            close = difflib.get_close_matches(data.dataset, list(DATASETS), n=5, cutoff=0.5)
            raise ConfigError(
                f"data.dataset={data.dataset!r} is not a reasoning-gym dataset"
                + (f"; did you mean {', '.join(close)}?" if close else "")
                + " (all: reasoning_gym.factory.DATASETS).")


def _validate_sandbox(sandbox: SandboxConfig) -> None:
    from raytunix.sandbox.types import MAX_BYTES, MAX_PROCESSES, MAX_SECONDS

    if sandbox.memory_mb < 16:
        raise ConfigError(f"sandbox.memory_mb={sandbox.memory_mb} must be >= 16: an interpreter "
                          "needs that much address space to start.")
    for key in ("wall_time_s", "cpu_time_s"):
        value = getattr(sandbox, key)
        if not value <= MAX_SECONDS:  # inf and nan too
            raise ConfigError(f"sandbox.{key}={value} must be a number of seconds <= "
                              f"{MAX_SECONDS:g}.")
    for key, high in (("memory_mb", MAX_BYTES >> 20), ("max_file_mb", MAX_BYTES >> 20),
                      ("tmp_mb", MAX_BYTES >> 20), ("max_output_kb", MAX_BYTES >> 10),
                      ("max_workdir_mb", MAX_BYTES >> 20),
                      ("max_processes", MAX_PROCESSES)):
        if getattr(sandbox, key) > high:
            raise ConfigError(f"sandbox.{key}={getattr(sandbox, key)} must be <= {high}.")
    if sandbox.resource in ("CPU", "GPU", "TPU", "memory", "object_store_memory"):
        raise ConfigError(
            f"sandbox.resource={sandbox.resource!r} is a built-in Ray resource; give a custom "
            "one (e.g. sandbox_host), and sandbox.num_cpus_per_actor for CPUs.")
    if sandbox.root_dir and not os.path.isabs(sandbox.root_dir):
        raise ConfigError(f"sandbox.root_dir={sandbox.root_dir!r} must be an absolute path (or "
                          "empty for the system temp dir).")


# Mapping-valued keys; an override may set one entry: env.kwargs.turns=2.
_MAPPINGS = frozenset({"env.kwargs", "env.agent_kwargs", "data.dataset_kwargs",
                       "env.actor_resources", "learner.resources", "engine.actor_resources"})


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
        agent = getattr(env_cls, "default_agent", None)
        if not isinstance(agent, str):
            raise ConfigError(
                f"env.agent=auto: {env_cls.__qualname__} has no default_agent; set env.agent "
                "(e.g. env.agent=text) or give the class default_agent = \"text\".")
    try:
        agent_cls = resolve("agent", agent)
    except PluginError as e:
        source = f"env.agent={env.agent!r}" + (
            f" (the default agent of {env_cls.__qualname__})" if env.agent == "auto" else "")
        raise ConfigError(f"{source}: {e}") from None
    try:
        check_kwargs(agent_cls, env.agent_kwargs, key="env.agent_kwargs", provided=("tokenizer",))
    except PluginError as e:
        raise ConfigError(str(e)) from None
    # An agent may check its values too (a chat template that does not load, a tool parser
    # that does not exist) so a bad one stops the run here, not in an actor.
    validate_kwargs = getattr(agent_cls, "validate_kwargs", None)
    if validate_kwargs is not None:
        try:
            validate_kwargs(env.agent_kwargs)
        except ValueError as e:
            raise ConfigError(f"env.agent_kwargs: {e}") from None


def _validate_learner(cfg: Config) -> None:
    """Settings of the update that only make sense together."""
    learner = cfg.learner
    if learner.dual_clip and not learner.dual_clip > 1.0:
        raise ConfigError(f"learner.dual_clip={learner.dual_clip!r} must be > 1 (e.g. 3.0), or 0 "
                          "for no dual clip.")
    if learner.dual_clip and learner.policy_loss != "ppo_clip":
        raise ConfigError(f"learner.dual_clip={learner.dual_clip!r} applies to "
                          f"learner.policy_loss=ppo_clip only (it is {learner.policy_loss!r}).")
    if not learner.normalize_advantages_by_std and learner.advantage_estimator != "grpo":
        raise ConfigError(
            "learner.normalize_advantages_by_std=false applies to learner.advantage_estimator="
            f"grpo only (it is {learner.advantage_estimator!r}, which sets its own scale).")
    for key in ("gae_gamma", "gae_lambda"):
        if not 0.0 <= getattr(learner, key) <= 1.0:
            raise ConfigError(f"learner.{key}={getattr(learner, key)!r} must be in [0, 1] "
                              "(e.g. gae_gamma 1.0, gae_lambda 0.95).")
    for key in ("value_coef", "value_clip"):
        if not getattr(learner, key) > 0:
            raise ConfigError(f"learner.{key}={getattr(learner, key)!r} must be > 0 (defaults: "
                              "value_coef 0.5, value_clip 0.2).")
    if learner.weight_decay and learner.optimizer != "adamw":
        raise ConfigError(f"learner.weight_decay={learner.weight_decay!r} is applied by adamw "
                          f"only; use learner.optimizer=adamw or learner.weight_decay=0.")
    steps = learner.rl_steps * learner.num_iterations
    if learner.lr_schedule != "constant" and steps <= learner.lr_warmup_steps:
        raise ConfigError(
            f"learner.lr_schedule={learner.lr_schedule!r} decays over the run's {steps} optimizer "
            f"steps (rl_steps x num_iterations), which must exceed learner.lr_warmup_steps="
            f"{learner.lr_warmup_steps}.")
    mesh = {k: getattr(learner, f"mesh_{k}") for k in ("data", "fsdp", "tensor")}
    for name, size in mesh.items():
        if size < 1 and size != -1:
            raise ConfigError(f"learner.mesh_{name}={size!r} must be a number of devices >= 1, "
                              "or -1 for the devices the other mesh axes leave.")
    if sum(size == -1 for size in mesh.values()) > 1:
        raise ConfigError(
            "learner.mesh_data, mesh_fsdp, mesh_tensor: at most one may be -1 (the rest of the "
            f"devices), got {mesh}.")
    batch_split = math.prod(s for k, s in mesh.items() if k != "tensor" and s > 0)
    if learner.micro_batch_size % batch_split:
        raise ConfigError(
            f"learner.micro_batch_size={learner.micro_batch_size} cannot be split over "
            f"learner.mesh_data x mesh_fsdp = {batch_split} devices; use a multiple of "
            f"{batch_split} (or 0, the whole batch).")
    if learner.pack_width == 1 or learner.pack_width < 0:
        raise ConfigError(f"learner.pack_width={learner.pack_width!r} must be >= 2 tokens per "
                          "packed row, or 0 for model.max_seq_len.")
    longest = cfg.env.max_turns * cfg.rollout.max_new_tokens
    if learner.overlong_buffer_tokens > longest:
        raise ConfigError(
            f"learner.overlong_buffer_tokens={learner.overlong_buffer_tokens} exceeds the most "
            f"tokens an episode can generate (env.max_turns x rollout.max_new_tokens = {longest}).")


def _validate_placement(cfg: Config) -> None:
    """Resources of learner hosts and env actors (``raytunix.placement``)."""
    from raytunix.placement import check_resources

    learner = cfg.learner
    for key in ("call_timeout_s", "slow_call_timeout_s"):
        if not math.isfinite(getattr(learner, key)):  # a stuck learner host would hang the run
            raise ConfigError(f"learner.{key}={getattr(learner, key)!r} must be a finite "
                              "number of seconds (e.g. 1800).")
    if learner.slow_call_timeout_s < learner.call_timeout_s:
        raise ConfigError(
            f"learner.slow_call_timeout_s={learner.slow_call_timeout_s!r} is below "
            f"learner.call_timeout_s={learner.call_timeout_s!r}; it covers the calls that "
            "take longest (compiling, checkpoints), so set it >= learner.call_timeout_s.")
    for key, wanted, accelerators in (("learner.resources", learner.resources, True),
                                      ("engine.actor_resources", cfg.engine.actor_resources, True),
                                      ("env.actor_resources", cfg.env.actor_resources, False)):
        try:
            check_resources(key, wanted, allow_accelerators=accelerators)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
    if cfg.engine.actor_resources and cfg.engine.placement == "colocated":
        raise ConfigError(
            f"engine.actor_resources={cfg.engine.actor_resources} places engine actors of "
            "engine.placement=disaggregated; a colocated engine runs in the learner's process "
            "(placed by learner.resources).")
    if learner.num_hosts > 1 and cfg.engine.placement == "colocated":
        raise ConfigError(
            f"learner.num_hosts={learner.num_hosts} needs engine.placement=disaggregated: a "
            "colocated engine lives in the one learner process.")
    if bool(learner.tpu_topology) != bool(learner.tpu_version):
        raise ConfigError(
            f"learner.tpu_topology={learner.tpu_topology!r} and learner.tpu_version="
            f"{learner.tpu_version!r}: set both (e.g. 4x4 and v6e) to reserve the learner's TPU "
            "slice, or neither.")
    if learner.tpu_topology:
        from ray._private.accelerators import TPUAcceleratorManager
        from ray.util.tpu import get_tpu_version_from_type, get_tpu_worker_resources

        try:
            version = get_tpu_version_from_type(learner.tpu_version)
        except ValueError as e:
            hint = (" (Ray names TPU v5e 'v5litepod': set learner.tpu_version=v5litepod)"
                    if learner.tpu_version.lower().replace("tpu-", "") == "v5e" else "")
            raise ConfigError(f"learner.tpu_version={learner.tpu_version!r}: {e}{hint}") from None
        if not TPUAcceleratorManager.is_valid_tpu_accelerator_topology(
                tpu_accelerator_version=version, tpu_topology=learner.tpu_topology):
            raise ConfigError(f"learner.tpu_topology={learner.tpu_topology!r} is not a topology "
                              f"of TPU {version} (e.g. 2x4, 4x4, 4x8 for v6e).")
        try:
            hosts, bundle = get_tpu_worker_resources(
                learner.tpu_topology, learner.tpu_version,
                resources_per_worker=dict(learner.resources) or None)
        except ValueError as e:
            raise ConfigError(f"learner.tpu_topology={learner.tpu_topology!r}, "
                              f"learner.tpu_version={learner.tpu_version!r}: {e}") from None
        _, host = get_tpu_worker_resources(learner.tpu_topology, learner.tpu_version)
        asked = dict(learner.resources).get("TPU")
        if asked is not None and asked != host["TPU"]:
            raise ConfigError(
                f"learner.resources asks for TPU: {asked:g} per host, but a {learner.tpu_version} "
                f"host of topology {learner.tpu_topology} has {host['TPU']} chips; set "
                f"learner.resources={{TPU: {host['TPU']}}} (or leave it empty).")
        if hosts != learner.num_hosts:
            raise ConfigError(
                f"a {learner.tpu_version} slice of topology {learner.tpu_topology} makes {hosts} "
                f"learner hosts of {bundle}, but learner.num_hosts={learner.num_hosts}; set "
                f"learner.num_hosts={hosts}.")


def _validate_adaptive_concurrency(rollout: RolloutConfig) -> None:
    """The controller's bounds must hold its start value; checked even when it is off, so
    that switching it on later cannot fail."""
    if rollout.target_engine_busy > 1.0:
        raise ConfigError(
            f"rollout.target_engine_busy={rollout.target_engine_busy!r} is a fraction of wall "
            "time and must be in (0, 1], e.g. 0.9.")
    start = rollout.max_concurrent_episodes
    low, high = rollout.adaptive_min_episodes, rollout.adaptive_max_episodes
    if low and low > start:
        raise ConfigError(
            f"rollout.adaptive_min_episodes={low} exceeds rollout.max_concurrent_episodes="
            f"{start}, the controller's start value; lower the first or raise the second.")
    if high and high < start:
        raise ConfigError(
            f"rollout.adaptive_max_episodes={high} is below rollout.max_concurrent_episodes="
            f"{start}, the controller's start value; raise the first or lower the second.")


def _validate_backoffs(rollout: RolloutConfig) -> None:
    """The two retry schedules (engine calls; group retries and episode re-runs) must grow
    from a finite first wait to a cap no smaller than it."""
    for prefix in ("engine_retry", "retry"):
        initial = getattr(rollout, f"{prefix}_initial_delay_s")
        cap = getattr(rollout, f"{prefix}_max_delay_s")
        multiplier = getattr(rollout, f"{prefix}_multiplier")
        jitter = getattr(rollout, f"{prefix}_jitter")
        if not math.isfinite(initial):
            raise ConfigError(f"rollout.{prefix}_initial_delay_s={initial!r} must be a finite "
                              "number of seconds.")
        if not (cap >= initial and math.isfinite(cap)):
            raise ConfigError(
                f"rollout.{prefix}_max_delay_s={cap!r} must be finite and >= "
                f"rollout.{prefix}_initial_delay_s={initial!r}; it caps each wait.")
        if not (multiplier >= 1 and math.isfinite(multiplier)):
            raise ConfigError(f"rollout.{prefix}_multiplier={multiplier!r} must be a finite "
                              "number >= 1 (1: constant waits, 2: each wait doubles).")
        if not 0.0 <= jitter <= 1.0:
            raise ConfigError(f"rollout.{prefix}_jitter={jitter!r} must be in [0, 1] (the "
                              "random fraction of each wait; 0.5 is a common choice).")


def _validate_sampling(rollout: RolloutConfig, model: ModelConfig) -> None:
    """Training rollouts must sample from a distribution the learner can score finitely
    (``raytunix.inference.sampling_checks``: the bounds the engine and learner check too)."""
    from raytunix.inference.sampling_checks import check_sampling_settings

    t = rollout.temperature
    if not (t > 0 and math.isfinite(t)):
        raise ConfigError(
            f"rollout.temperature={t!r}: training rollouts must sample, with a finite "
            "temperature > 0 (e.g. rollout.temperature=1.0). Greedy decoding (0) gives every "
            "sampled token probability 1, so the policy gradient has nothing to score and "
            "every sample of a group is the same; held-out evaluation is greedy already.")
    if rollout.top_k == 1:
        raise ConfigError(
            "rollout.top_k=1 is greedy decoding: every sampled token has probability 1 and "
            "the policy gradient is zero. Use 0 (off) or a value >= 2, e.g. rollout.top_k=50.")
    if not 0.0 < rollout.top_p <= 1.0:
        raise ConfigError(
            f"rollout.top_p={rollout.top_p!r} must be in (0, 1]; 1.0 turns nucleus sampling "
            "off, 0.95 is a common setting.")
    try:
        check_sampling_settings(t, rollout.top_k, rollout.top_p, allow_greedy=False,
                                vocab_size=_vocab_size(model))
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
    return sorted(p.name[:-5] for p in resources.files("raytunix.configs").iterdir()
                  if p.name.endswith(".yaml"))


def _read_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {e}") from None
    return tree or {}


def parse_override(item: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, YAML-parsed value); for a mapping-valued key,
    'env.kwargs.turns=2' -> ("env", "kwargs.turns", 2)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. learner.rl_steps=20.")
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) == 3 and ".".join(parts[:2]) in _MAPPINGS and parts[2]:
        parts = [parts[0], f"{parts[1]}.{parts[2]}"]
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key {dotted!r} must be section.key, e.g. rollout.group_size "
                          f"(or {' / '.join(sorted(_MAPPINGS))}.name for one entry of a mapping).")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts[0], parts[1], value


def load_config(config: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Builds the run config.

    Args:
      config: a packaged preset name (see ``preset_names()``), a path to a YAML file, or
        None for the defaults.
      overrides: ``section.key=value`` strings applied last, in order.

    Raises:
      ConfigError: unknown preset or file, bad YAML, unknown section/key, bad value.
    """
    cfg = Config()
    if config:
        if os.path.isdir(config):
            raise ConfigError(f"config {config!r} is a directory; pass a YAML file or a preset name.")
        if os.path.exists(config):
            with open(config) as f:
                _merge(cfg, _read_yaml(f.read(), config), config)
        elif config in preset_names():
            text = resources.files("raytunix.configs").joinpath(f"{config}.yaml").read_text()
            _merge(cfg, _read_yaml(text, f"preset {config}"), f"preset {config}")
        elif config.endswith((".yaml", ".yml")) or os.sep in config:
            raise ConfigError(f"config file {config!r} does not exist; check the path.")
        else:
            raise ConfigError(
                f"config {config!r} is neither a YAML file nor a preset; presets: "
                f"{', '.join(preset_names())}.")
    for item in overrides:
        apply_override(cfg, item)
    return validate(cfg)


def apply_override(cfg: Config, item: str) -> str:
    """Sets one ``section.key=value`` override on ``cfg`` in place, unvalidated (call
    ``validate`` once all are set); returns the ``section.key`` it set (``env.kwargs``
    for ``env.kwargs.turns=2``).

    Raises:
      ConfigError: a malformed override, an unknown section or key (naming the valid
        ones), or a value of the wrong type.
    """
    section, key, value = parse_override(item)
    if "." in key:  # one entry of a mapping: env.kwargs.turns=2
        key, name = key.split(".", 1)
        value = {**getattr(getattr(cfg, section), key), name: value}
    _merge(cfg, {section: {key: value}}, f"override {item!r}")
    return f"{section}.{key}"


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Rebuilds a Config saved with ``to_dict`` (e.g. from a run directory)."""
    cfg = Config()
    _merge(cfg, tree, "saved config")
    return validate(cfg)

