"""The main job: warm start, then asynchronous GRPO on Ray, then a summary.

    driver ─► PolicyActor (learner + engine, colocated) or LearnerActor + EngineActor
          ─► EnvActor pool (environments, no JAX)
          ─► OrchestratorActor (episodes as coroutines, Arrow batches in the object store)

The driver builds everything from one config, moves batch references from the
orchestrator to the learner, writes metrics/checkpoints to the run directory and prints
progress. ``train(cfg)`` starts local Ray itself when no cluster is connected.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import threading
import time
from typing import Any, Sequence

import numpy as np
import ray
import yaml

from raytunix import plugins, profiling
from raytunix.config import Config, ConfigError, RolloutConfig, config_from_dict, parse_override
from raytunix.learner.learner import GRPOHyperparams, SFTHyperparams
from raytunix.models.llama import ModelConfig
from raytunix.models.tokenizer import Tokenizer
from raytunix.profiling.collect import append_jsonl
from raytunix.rollout import preflight
from raytunix.rollout.env_pool import CPU_ONLY_RUNTIME_ENV, EnvPool
from raytunix.types import EpisodeStatus, RolloutHalted, SamplingParams



class RunError(RuntimeError):
    """The run cannot go on; the message says why and what to do (checkpoints are kept)."""


class RunDir:
    """The files of one run: config.yaml, tokenizer.json, metrics.jsonl, checkpoints/,
    summary.json."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        self.config = os.path.join(self.path, "config.yaml")
        self.tokenizer = os.path.join(self.path, "tokenizer.json")
        self.metrics = os.path.join(self.path, "metrics.jsonl")
        self.checkpoints = os.path.join(self.path, "checkpoints")
        self.reference = os.path.join(self.path, "reference")  # KL reference policy, if any
        self.export = os.path.join(self.path, "export")  # the trained policy in HF layout (model.path runs)
        self.summary = os.path.join(self.path, "summary.json")
        self.state = os.path.join(self.path, "state.json")
        self.sinks = None  # profiling.sinks.MetricSinks once the run starts its actors
        self.checkpoint_in_flight: dict[str, Any] | None = None  # state.json once it commits

    def log(self, record: dict[str, Any]) -> None:
        """Appends ``record`` to metrics.jsonl and hands it to the other metric sinks
        (TensorBoard, Ray metrics, the console view)."""
        record = dict(record, time=time.time())
        append_jsonl(self.metrics, [json.dumps(record) + "\n"])
        if self.sinks is not None:
            self.sinks.write(record)

    def read_state(self) -> dict[str, Any]:
        if not os.path.exists(self.state):
            return {}
        with open(self.state) as f:
            return json.load(f)

    def write_state(self, state: dict[str, Any]) -> None:
        tmp = self.state + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=2)
        os.replace(tmp, self.state)


def _say(msg: str) -> None:
    print(f"[raytunix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _new_run_dir(cfg: Config) -> RunDir:
    try:
        os.makedirs(cfg.run.output_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"run.output_dir={cfg.run.output_dir!r} cannot be created ({e.strerror}); pass a "
            "writable directory.") from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(cfg.run.output_dir, f"{cfg.run.name}-{stamp}")
    suffix = 1
    while os.path.exists(path):
        path = os.path.join(cfg.run.output_dir, f"{cfg.run.name}-{stamp}-{suffix}")
        suffix += 1
    return RunDir(path)


# What a resumed run may change: how long it trains and how it is run, never what the
# checkpoint holds (model shape, tokenizer, data, algorithm).
RESUME_OVERRIDABLE = frozenset({
    "learner.rl_steps", "learner.checkpoint_every", "learner.max_checkpoints", "run.log_every",
    "learner.keep_best_by", "learner.keep_best_mode",
    "rollout.batch_timeout_s", "rollout.max_concurrent_episodes", "env.num_env_actors",
    "eval.max_new_tokens", "engine.max_batch_size", "engine.block_size",
    "engine.kv_cache_tokens", "engine.prefill_chunk_tokens", "engine.kv_on_weight_update",
    "engine.sessions", "rollout.adaptive_concurrency", "rollout.target_engine_busy",
    "rollout.adaptive_min_episodes", "rollout.adaptive_max_episodes",
    "rollout.adaptive_interval_s", "sandbox.num_actors", "sandbox.num_cpus_per_actor",
    "sandbox.resource", "sandbox.max_concurrent_runs", "sandbox.actor_max_restarts",
    "rollout.max_episode_restarts", "rollout.max_group_retries",
    "rollout.max_consecutive_failures", "rollout.engine_retry_max_attempts",
    "rollout.engine_retry_initial_delay_s", "rollout.engine_retry_max_delay_s",
    "rollout.engine_retry_multiplier", "rollout.engine_retry_jitter",
    "rollout.retry_initial_delay_s", "rollout.retry_max_delay_s", "rollout.retry_multiplier",
    "rollout.retry_jitter",
})


def load_run_config(run_dir: str, overrides: Sequence[str] = ()) -> Config:
    """The config a run was started with (``RUN_DIR/config.yaml``), plus ``overrides``.

    Raises:
      FileNotFoundError: ``run_dir`` is not a raytunix run directory.
      ConfigError: the saved config is corrupt or an override is bad.
    """
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{run_dir!r} has no config.yaml, so it is not a raytunix run directory; pass the "
            "directory `raytunix train` printed at start (under runs/).")
    with open(path) as f:
        try:
            tree = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML ({e}); restore it from a copy or start a new run.") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} does not hold a config mapping; restore it or start a new run.")
    for item in overrides:
        section, key, value = parse_override(item)
        if f"{section}.{key}" not in RESUME_OVERRIDABLE:
            raise ConfigError(
                f"{section}.{key} cannot change when resuming (the checkpoint depends on it); "
                f"keys a resume may change: {', '.join(sorted(RESUME_OVERRIDABLE))}.")
        tree.setdefault(section, {})[key] = value
    return config_from_dict(tree)


# Env actors may wait for a node of their own resource (an autoscaled pool) before they
# build the environment; past this, the run stops with the reason.
ENV_READY_TIMEOUT_S = 600.0
# A run that stops waits this long for the learner's checkpoint in flight to be committed.
CHECKPOINT_FINISH_TIMEOUT_S = 300.0


def _env_class(cfg: Config) -> type:
    return plugins.resolve("env", cfg.env.name)


def _agent_name(cfg: Config) -> str:
    return _env_class(cfg).default_agent if cfg.env.agent == "auto" else cfg.env.agent


def _import_paths(cfg: Config) -> tuple[str, ...]:
    """Directories the actors put on sys.path to import what the config names by import
    path: the env and agent classes (resolved here first) and modules named inside
    env.kwargs / env.agent_kwargs (a tool class, a gymnasium env)."""
    classes = (_env_class(cfg), plugins.resolve("agent", _agent_name(cfg)))
    roots = [plugins.import_root(cls) for cls in classes]
    roots += plugins.module_roots(cfg.env.kwargs) + plugins.module_roots(cfg.env.agent_kwargs)
    return tuple(dict.fromkeys(root for root in roots if root))


def _check_steps_left(checkpoint_step: int, cfg: Config) -> None:
    if checkpoint_step >= cfg.learner.rl_steps:
        raise RunError(
            f"the run's checkpoint is at RL step {checkpoint_step} and learner.rl_steps="
            f"{cfg.learner.rl_steps}: nothing left to train; resume with learner.rl_steps "
            f"greater than {checkpoint_step}.")


def _uses_tools(cfg: Config) -> bool:
    """The warm start's tool demonstrations are for the calculator environment."""
    from raytunix.envs import CalculatorMathEnv

    return issubclass(_env_class(cfg), CalculatorMathEnv)


def _start_sandbox_pool(cfg: Config):
    """The run's sandbox actors, when its environment runs sandboxed tools (its class sets
    ``uses_sandbox``); their tools find them with ``raytunix.sandbox.connect()``. None
    otherwise."""
    if not getattr(_env_class(cfg), "uses_sandbox", False):
        return None
    from raytunix.sandbox.pool import SandboxPool

    pool = SandboxPool.from_config(cfg.sandbox)
    try:
        stats = pool.wait_ready(ENV_READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        pool.shutdown()
        raise RunError(
            f"the {cfg.sandbox.num_actors} sandbox actors were not placed within "
            f"{ENV_READY_TIMEOUT_S:.0f} s; does the cluster have sandbox.num_cpus_per_actor="
            f"{cfg.sandbox.num_cpus_per_actor} CPUs each"
            + (f" and the resource sandbox.resource={cfg.sandbox.resource!r}" if cfg.sandbox.resource else "")
            + "?") from None
    except ray.exceptions.RayActorError as e:
        pool.shutdown()
        raise RunError(f"the sandbox actors could not start (sandbox.backend="
                       f"{cfg.sandbox.backend!r}): {e}") from None
    _say(f"sandbox: {len(stats)} actors, backend {stats[0]['backend']}, isolation "
         f"{stats[0]['isolation']}")
    return pool


def _demonstration_arrays(cfg: Config, tasks, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Renders warm-start demonstrations through the agent's own token path."""
    from raytunix.agents import make_agent
    from raytunix.data.demonstrations import sample_demonstrations

    rng = random.Random(cfg.run.seed)
    probs = ({2: cfg.warmup.tool_use_prob_2_terms, 3: cfg.warmup.tool_use_prob_3_terms}
             if _uses_tools(cfg) else {n: 0.0 for n in range(1, 10)})
    demos = sample_demonstrations(tasks, rng, probs)
    agent = make_agent(_agent_name(cfg), tokenizer, **_agent_kwargs(cfg))
    rows = [agent.render_demonstration(task, messages) for task, messages in zip(tasks, demos)]
    limit = cfg.model.max_seq_len
    fitting = [r for r in rows if len(r[0]) <= limit]
    if not fitting:
        raise RunError(
            f"model.max_seq_len={limit} is shorter than every warm-start demonstration "
            f"(shortest: {min(len(r[0]) for r in rows)} tokens); raise model.max_seq_len.")
    rows = fitting
    width = max(len(r[0]) for r in rows)
    width = -(-width // 16) * 16
    tokens = np.full((len(rows), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for i, (ids, m) in enumerate(rows):
        tokens[i, : len(ids)] = ids
        mask[i, : len(m)] = m
    return tokens, mask


class Job:
    """The actors of one run, built from its config."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, train_tasks, env_pool: EnvPool):
        from raytunix.learner.actor import LearnerActor, PolicyActor

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.train_tasks = train_tasks
        self.orchestrator = None
        self.env_pool = env_pool
        self.sandbox_actors: list = []
        model_config = _model_config(cfg, tokenizer)
        path = cfg.model.path
        self.colocated = cfg.engine.placement == "colocated"
        if self.colocated:
            self.learner = ray.remote(PolicyActor).options(
                num_cpus=1, max_concurrency=10_000).remote(
                model_config, cfg.run.seed, tokenizer, cfg.engine.engine_kwargs(), path)
            self.engine = self.learner
            self.engines = [self.learner]
        else:
            from raytunix.inference.actor import EngineActor

            self.learner = ray.remote(LearnerActor).options(
                num_cpus=1, max_concurrency=100).remote(
                model_config, cfg.run.seed, tokenizer.pad_id, path)
            self.engines = [
                ray.remote(EngineActor).options(num_cpus=0, max_concurrency=10_000).remote(
                    model_config, cfg.run.seed, tokenizer, cfg.engine.engine_kwargs(), path)
                for _ in range(cfg.engine.num_replicas)]
            self.engine = self.engines[0]

    def start_orchestrator(self, state: dict[str, Any], policy_version: int) -> None:
        """(Re)creates the orchestrator at a data position (``state``) and version."""
        from raytunix.rollout.actor import OrchestratorActor
        from raytunix.rollout.concurrency import ConcurrencyController

        cfg, tokenizer = self.cfg, self.tokenizer
        if self.orchestrator is not None:
            ray.kill(self.orchestrator)
        self.orchestrator = ray.remote(OrchestratorActor).options(
            num_cpus=0, max_concurrency=10_000, runtime_env=CPU_ONLY_RUNTIME_ENV).remote(
            tasks=self.train_tasks, tokenizer=tokenizer, agent_name=_agent_name(cfg),
            agent_kwargs=_agent_kwargs(cfg), import_paths=_import_paths(cfg),
            env_pool=self.env_pool, engine=self.engines,
            group_size=cfg.rollout.group_size, groups_per_batch=cfg.rollout.groups_per_batch,
            max_concurrent_episodes=cfg.rollout.max_concurrent_episodes,
            max_staleness=cfg.rollout.max_staleness, max_turns=cfg.env.max_turns,
            max_context_tokens=cfg.model.max_seq_len,
            sampling=SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                                    temperature=cfg.rollout.temperature,
                                    top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                                    stop_token_ids=tokenizer.stop_ids),
            episode_timeout_s=cfg.rollout.episode_timeout_s,
            batch_queue_size=cfg.rollout.batch_queue_size,
            drop_failed_groups=cfg.rollout.drop_failed_groups,
            stale_token_policy=cfg.rollout.stale_token_policy,
            partial_rollout=cfg.rollout.partial_rollout,
            concurrency=(ConcurrencyController.from_config(cfg.rollout)
                         if cfg.rollout.adaptive_concurrency else None),
            concurrency_interval_s=cfg.rollout.adaptive_interval_s,
            dynamic_sampling=cfg.rollout.dynamic_sampling,
            dynamic_sampling_max_filtered=cfg.rollout.dynamic_sampling_max_filtered,
            **_fault_kwargs(cfg.rollout),
            seed=cfg.run.seed, policy_version=policy_version, state=state)


    def publish_weights(self) -> None:
        """Disaggregated placement: ship the learner's weights to the engine."""
        if not self.colocated:
            weights = self.learner.weights.remote()
            ray.get([engine.update_weights.remote(weights) for engine in self.engines])

    def evaluate(self, tasks) -> dict[str, Any]:
        return ray.get(self.orchestrator.evaluate.remote(tasks, self.cfg.eval.max_new_tokens))

    def engine_stats(self) -> dict[str, Any]:
        per_replica = ray.get([engine.engine_stats.remote() for engine in self.engines])
        if len(per_replica) == 1:
            return per_replica[0]
        merged = {key: sum(stats[key] for stats in per_replica)
                  for key, value in per_replica[0].items()
                  if isinstance(value, (int, float)) and not key.startswith("policy_version")}
        merged["busy_fraction"] = sum(s["busy_fraction"] for s in per_replica) / len(per_replica)
        for key in ("policy_version", "policy_version_received"):
            merged[key] = min(s[key] for s in per_replica)
        merged["replicas"] = per_replica
        return merged

    def profiled_actors(self) -> list[tuple[str, Any]]:
        """``(name, handle)`` of every actor whose spans the driver drains."""
        actors = [("policy (learner + engine)" if self.colocated else "learner", self.learner)]
        if not self.colocated:
            actors += [(f"engine {i}", engine) for i, engine in enumerate(self.engines)]
        if self.orchestrator is not None:
            actors.append(("orchestrator", self.orchestrator))
        actors += [(f"env actor {i}", actor) for i, actor in enumerate(self.env_pool.actors)]
        actors += [(f"sandbox {i}", actor) for i, actor in enumerate(self.sandbox_actors)]
        return actors

    def shutdown(self) -> None:
        """Lets the learner finish a checkpoint it is writing, then kills the run's actors
        (checkpoints and the run directory stay)."""
        try:
            ray.get(self.learner.finish_checkpoints.remote(), timeout=CHECKPOINT_FINISH_TIMEOUT_S)
        except ray.exceptions.RayError as e:  # a dead learner; a timeout: orbax's temporary
            _say(f"the checkpoint in flight was not finished ({type(e).__name__}: "  # dir
                 f"{str(e)[:300]}); resuming uses the one before it")  # keeps the last valid
        actors = [self.orchestrator, self.learner, *self.env_pool.actors]
        if not self.colocated:
            actors += self.engines
        for actor in actors:
            if actor is not None:
                ray.kill(actor)


def _fault_kwargs(rollout: RolloutConfig) -> dict[str, Any]:
    """The orchestrator's fault handling from ``rollout.*`` (``RolloutConfig``)."""
    from raytunix.rollout.faults import Backoff

    r = rollout
    return {
        "max_episode_restarts": r.max_episode_restarts,
        "max_group_retries": r.max_group_retries,
        "max_consecutive_failures": r.max_consecutive_failures,
        "engine_backoff": Backoff(
            initial_delay_s=r.engine_retry_initial_delay_s, max_delay_s=r.engine_retry_max_delay_s,
            multiplier=r.engine_retry_multiplier, jitter=r.engine_retry_jitter,
            max_attempts=r.engine_retry_max_attempts),
        "retry_backoff": Backoff(
            initial_delay_s=r.retry_initial_delay_s, max_delay_s=r.retry_max_delay_s,
            multiplier=r.retry_multiplier, jitter=r.retry_jitter),
    }


def _ensure_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        from raytunix.watchdog import start_watchdog

        context = ray.init(include_dashboard=False, object_store_memory=256 * 1024**2,
                           num_cpus=max(2, os.cpu_count() or 2), log_to_driver=True)
        # This process started the cluster: if it is killed (kill -9, OOM), the cluster's
        # processes go with it instead of outliving it for a minute.
        start_watchdog(context.address_info["session_dir"])


def _warm_start(cfg: Config, job: Job, run: RunDir, dev_tasks, collector) -> dict:
    """Supervised steps on demonstrations until the dev check passes (or max_steps)."""
    w = cfg.warmup
    tokens, mask = _demonstration_arrays(cfg, job.train_tasks[: max(4000, w.batch_size)], job.tokenizer)
    ray.get(job.learner.set_demonstrations.remote(tokens, mask))
    ray.get(job.learner.start_warmup.remote(SFTHyperparams.from_config(cfg)))
    measure = "tool-path accuracy" if _uses_tools(cfg) else "success"
    _say(f"warm start: {len(tokens)} demonstrations of <= {tokens.shape[1]} tokens, "
         f"up to {w.max_steps} steps (stop at dev {measure} >= {w.target_tool_accuracy:.0%})")
    steps, t0, result = 0, time.monotonic(), {}
    while steps < w.max_steps:
        n = min(w.eval_every, w.max_steps - steps)
        with profiling.span("sft_steps", "driver", {"steps": n}):
            metrics = ray.get(job.learner.sft_steps.remote(n, w.batch_size))
        steps += n
        job.publish_weights()
        with profiling.span("eval", "driver", {"tasks": len(dev_tasks)}):
            dev = job.evaluate(dev_tasks)
        collector.drain("warmup", steps)
        result = {"phase": "warmup", "step": steps, **metrics, **{f"dev_{k}": v for k, v in dev.items()}}
        run.log(result)
        _say(f"warm start step {steps}: loss {metrics['loss']:.3f}  dev success "
             f"{dev['success_rate']:.1%}  tool use {dev['tool_use_rate']:.1%}  tool-path accuracy "
             f"{dev['tool_path_accuracy']:.1%}  ({time.monotonic() - t0:.0f} s)")
        target_met = (dev["tool_path_accuracy"] if _uses_tools(cfg) else dev["success_rate"]) >= w.target_tool_accuracy
        if steps >= w.min_steps and target_met:
            break
    return {"warmup_steps": steps, "warmup_s": time.monotonic() - t0}


def train(cfg: Config, resume: str | None = None, resume_overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Runs the main job; returns the summary (also saved as ``summary.json``).

    Args:
      cfg: the run config (ignored when resuming: the run's own config is used).
      resume: a run directory to continue from its latest checkpoint.
      resume_overrides: ``section.key=value`` changes to the resumed run's config, e.g.
        ``learner.rl_steps=80`` to train further; saved back to its config.yaml.

    Raises:
      FileNotFoundError: ``resume`` is not a run directory or has no checkpoint.
    """
    from raytunix.data.datasets import DatasetError
    from raytunix.data.tasks import dataset_splits

    wall0 = time.monotonic()
    if resume:
        cfg = load_run_config(resume, resume_overrides)
        run = RunDir(resume)
        saved = run.read_state()
        if "checkpoint_step" not in saved:
            raise FileNotFoundError(
                f"{resume!r} has no RL checkpoint yet (the run stopped before RL began); start "
                "a new run instead.")
        _check_steps_left(saved["checkpoint_step"], cfg)  # before Ray starts: fail fast
        with open(run.config, "w") as f:
            f.write(cfg.to_yaml())
    try:
        dataset = dataset_splits(cfg.data)  # a file, split or column missing: stop before Ray
    except DatasetError as e:
        raise ConfigError(str(e)) from None
    if not resume:  # created once the data is read: a config that cannot run leaves none
        run = _new_run_dir(cfg)
        with open(run.config, "w") as f:
            f.write(cfg.to_yaml())
    _say(f"run directory: {run.path}")
    with _removed_if_left_empty(run, new=not resume):
        return _start_and_run(cfg, run, resume, dataset, wall0)


@contextlib.contextmanager
def _removed_if_left_empty(run: RunDir, new: bool):
    """When a new run fails before it has written more than its config and tokenizer (an
    environment that cannot be built, a prompt that does not fit...), its directory goes,
    so runs/ holds only runs that got somewhere; the error propagates unchanged. A resumed
    run's directory (``new=False``) always stays."""
    try:
        yield
    except BaseException:
        leftovers = set(os.listdir(run.path)) if os.path.isdir(run.path) else set()
        if new and leftovers <= {os.path.basename(run.config), os.path.basename(run.tokenizer)}:
            shutil.rmtree(run.path, ignore_errors=True)
            _say(f"run directory {run.path} removed: the run stopped before it trained")
        raise


def _start_and_run(cfg: Config, run: RunDir, resume: str | None, dataset,
                   wall0: float) -> dict[str, Any]:
    """``train`` once the run directory exists: Ray, the env actors, the tasks, the job."""
    from raytunix.data.demonstrations import tokenizer_corpus
    from raytunix.data.tasks import is_arithmetic

    _ensure_ray(cfg)
    if threading.current_thread() is threading.main_thread():
        # After ray.init, which installs its own SIGTERM handler: `kill`/`timeout` stop a
        # run the way Ctrl-C does (actors shut down, checkpoints kept).
        signal.signal(signal.SIGTERM, _interrupt)
    hp = GRPOHyperparams.from_config(cfg)

    # Sandboxes, then env actors: an environment that cannot be built stops the run before
    # anything is trained, and an environment that brings its own tasks builds them there.
    sandbox_pool = _start_sandbox_pool(cfg)
    env_pool = EnvPool(cfg.env.name, dict(cfg.env.kwargs), cfg.env.num_env_actors,
                       max_restarts=cfg.env.env_actor_max_restarts,
                       import_paths=_import_paths(cfg))
    job = None
    try:
        _preflight(preflight.check_env_actors, env_pool, ENV_READY_TIMEOUT_S)
        train_tasks, heldout, source = _task_splits(cfg, env_pool, dataset)
        heldout = heldout[: cfg.eval.heldout_size]
        dev_tasks = train_tasks[-cfg.warmup.eval_size:]  # warm-start stop condition; not held out
        if cfg.model.path:  # the model's own tokenizer; nothing to train or save
            tokenizer = _folder_tokenizer(cfg)
        elif resume:
            tokenizer = Tokenizer.load(run.tokenizer)
        else:
            tokenizer = Tokenizer.train(tokenizer_corpus(train_tasks[:3000]),
                                        cfg.model.tokenizer_vocab_size)
            tokenizer.save(run.tokenizer)
        prompts = _preflight(
            preflight.measure_prompts, env_pool,
            preflight.sample_tasks(train_tasks, 24) + preflight.sample_tasks(heldout, 8),
            lambda: _new_agent(cfg, tokenizer), cfg.model.max_seq_len)
        _say(f"env {cfg.env.name!r} ready on {cfg.env.num_env_actors} actors; tasks: {source} "
             f"({len(train_tasks)} train, {len(heldout)} held out); "
             f"prompts {prompts['prompt_tokens_min']}-{prompts['prompt_tokens_max']} tokens "
             f"(context {cfg.model.max_seq_len})")
        # The warm start's demonstrations (and its stop check) are arithmetic; for any other
        # tasks it is off rather than teaching a format on tasks it cannot solve.
        warm_start = cfg.warmup.enabled and is_arithmetic(train_tasks)
        if cfg.warmup.enabled and not warm_start and not resume:
            _say(f"warm start: skipped; its demonstrations are arithmetic and the tasks "
                 f"({source}) are not")
        job = Job(cfg, tokenizer, train_tasks, env_pool)
        if sandbox_pool is not None:
            job.sandbox_actors = list(sandbox_pool.actors)
        return _run(cfg, job, run, hp, resume, heldout, dev_tasks, wall0,
                    warm_start=warm_start)
    finally:
        if job is not None:
            job.shutdown()
        else:
            for actor in env_pool.actors:
                ray.kill(actor)
        if sandbox_pool is not None:
            sandbox_pool.shutdown()


def _preflight(check, *args):
    """Runs a ``preflight`` check; its failure stops the run as a RunError (exit 2)."""
    try:
        return check(*args)
    except preflight.PreflightError as e:
        raise RunError(str(e)) from None


def _new_agent(cfg: Config, tokenizer: Tokenizer):
    from raytunix.agents import make_agent

    return make_agent(_agent_name(cfg), tokenizer, **_agent_kwargs(cfg))


def _agent_kwargs(cfg: Config) -> dict[str, Any]:
    """``env.agent_kwargs``; with ``model.path``, the chat template is the folder's unless
    the config names one."""
    kwargs = dict(cfg.env.agent_kwargs)
    if cfg.model.path:
        kwargs.setdefault("chat_template", cfg.model.path)
    return kwargs


def _model_config(cfg: Config, tokenizer: Tokenizer) -> ModelConfig:
    """The run's model: ``model.path``'s config.json at ``model.max_seq_len`` tokens of
    context, else a fresh model of the ``model.*`` sizes over ``tokenizer``'s ids.

    Raises:
      RunError: the folder's model cannot be read, or its embedding has fewer ids than
        its tokenizer.
    """
    m = cfg.model
    if not m.path:
        return ModelConfig(vocab_size=tokenizer.vocab_size, d_model=m.d_model,
                           n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                           d_ff=m.d_ff, max_seq_len=m.max_seq_len)
    from raytunix.models.hf import CheckpointError, read_model_config

    try:
        config = read_model_config(m.path, m.max_seq_len)
    except CheckpointError as e:
        raise RunError(f"model.path: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise RunError(f"model.path={m.path!r}: tokenizer.json has {tokenizer.vocab_size} ids but "
                       f"the model's embedding only {config.vocab_size}; the folder's files do "
                       "not belong together.")
    return config


def _folder_tokenizer(cfg: Config) -> Tokenizer:
    """``model.path``'s tokenizer, after checking that a chat template comes with it.

    Raises:
      RunError: the tokenizer files are missing or bad, or the folder has no chat template
        and ``env.agent_kwargs`` names none.
    """
    from raytunix.models.chat_template import ChatTemplateError, chat_template_from_folder

    path = cfg.model.path
    try:
        tokenizer = Tokenizer.from_folder(path)
        if "chat_template" not in cfg.env.agent_kwargs:
            chat_template_from_folder(path)
    except (OSError, ValueError) as e:  # ChatTemplateError is a ValueError
        hint = (" Set env.agent_kwargs.chat_template to a built-in template whose tokens "
                "the model's tokenizer has (chatml, llama3, gemma)."
                if isinstance(e, ChatTemplateError) else "")
        raise RunError(f"model.path={path!r}: {e}{hint}") from None
    return tokenizer


def _task_splits(cfg: Config, env_pool: EnvPool, dataset):
    """``(train, heldout, source)``: ``dataset`` (read from ``data.*`` already) if given,
    else the environment's own tasks (built in an env actor, as the environment is), else
    reasoning-gym ``data.dataset``; ``source`` says which, for the log."""
    from raytunix.data.tasks import generator_splits

    d = cfg.data
    if dataset is not None:
        where = d.path if d.source != "reasoning_gym" else d.dataset
        if not dataset[1]:
            raise RunError(f"data.source={d.source} {where}: no held-out task is left once "
                           "those whose question is also in train are dropped; give another "
                           "held-out split (data.heldout_path / data.heldout_split) or none, "
                           "to hold out rows of the training split.")
        return dataset[0], dataset[1], f"{d.source} {where}"
    actor = env_pool.actors[0]
    try:
        own = ray.get([actor.tasks.remote(split, size, d.seed)
                       for split, size in (("train", d.train_size), ("heldout", d.heldout_size))])
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else e
        raise RunError(f"environment {cfg.env.name!r} failed to make its tasks: "
                       f"{type(cause).__name__}: {cause}") from None
    if own[0] is not None:
        if own[1] is None:
            raise RunError(f"environment {cfg.env.name!r} brings train tasks but none for "
                           "'heldout'; its tasks() must answer both splits.")
        return own[0], own[1], "the environment's own"
    if d.source == "env":
        raise RunError(f"data.source=env but environment {cfg.env.name!r} brings no tasks "
                       "(its tasks() returns None); set data.source to a dataset.")
    train, heldout = generator_splits(d)
    return train, heldout, f"reasoning-gym {d.dataset}"


def _run(cfg: Config, job: Job, run: RunDir, hp: GRPOHyperparams, resume: str | None, heldout,
         dev_tasks, wall0: float, warm_start: bool = True) -> dict[str, Any]:
    """Warm start (new runs) or restore (resumed runs), then the RL loop and the summary."""
    from raytunix.profiling.collect import Collector

    from raytunix.profiling.sinks import MetricSinks

    ckpt_dir = run.checkpoints
    collector = Collector(run.path, job.profiled_actors, cfg.engine.max_batch_size)
    run.sinks = MetricSinks(run.path, cfg.learner.rl_steps, log_every=cfg.run.log_every)
    try:
        return _run_phases(cfg, job, run, hp, resume, heldout, dev_tasks, wall0, warm_start,
                           collector)
    finally:
        run.sinks.close()
        run.sinks = None


def _run_phases(cfg: Config, job: Job, run: RunDir, hp: GRPOHyperparams, resume: str | None,
                heldout, dev_tasks, wall0: float, warm_start: bool, collector) -> dict[str, Any]:
    ckpt_dir = run.checkpoints
    if resume:
        ray.get(job.learner.start_rl.remote(hp))
        try:
            extras = ray.get(job.learner.restore.remote(
                ckpt_dir, cfg.learner.max_checkpoints,
                run.reference if cfg.learner.kl_coef > 0 else None,
                cfg.learner.keep_best_by, cfg.learner.keep_best_mode))
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else e
            raise RunError(f"cannot resume {run.path}: {cause}") from None
        job.publish_weights()
        version = int(extras["policy_version"])
        job.start_orchestrator(extras["orchestrator"], version)
        before = extras["heldout_before"]
        warm = extras.get("warm_start", {})
        start_step = int(extras["rl_step"])
        _check_steps_left(start_step, cfg)  # state.json may lag the newest checkpoint
        _say(f"resumed at RL step {start_step}, policy version {version}, data position "
             f"{extras['orchestrator']['next_index']}")
        # Steps past the checkpoint that a crashed run logged are trained again: from here
        # on, a step's record replaces any earlier one of the same step.
        run.log({"phase": "resume", "rl_step": start_step, "policy_version": version})
    else:
        job.start_orchestrator({}, 0)
        warm = _warm_start(cfg, job, run, dev_tasks, collector) if warm_start else {}
        with profiling.span("eval", "driver", {"tasks": len(heldout)}):
            before = job.evaluate(heldout)
        collector.drain("eval", 0)
        run.log({"phase": "eval", "when": "before_rl", **before})
        _say(f"held-out before RL: success {before['success_rate']:.1%}"
             f"{_unfinished_episodes(before)} (tool use {before['tool_use_rate']:.1%}) on "
             f"{before['num_tasks']} tasks")
        ray.get(job.learner.start_rl.remote(hp))
        if cfg.learner.kl_coef > 0:  # the KL penalty's reference policy; none without one
            ray.get(job.learner.save_reference.remote(run.reference))
        start_step = 0
        _checkpoint(job, run, ckpt_dir, cfg, before, warm)
        _finish_checkpoints(job, run)  # a run that fails in step 1 can still resume

    t_rl = time.monotonic()
    collector.drain("rl", start_step)  # what came before RL stays out of step 1's window
    collector.start_window()
    for step in range(start_step, cfg.learner.rl_steps):
        try:
            with profiling.span("next_batch_wait", "driver", {"step": step + 1}):
                refs, info = ray.get(job.orchestrator.next_batch.remote(),
                                     timeout=cfg.rollout.batch_timeout_s)
        except ray.exceptions.GetTimeoutError:
            stats = ray.get(job.orchestrator.stats.remote())
            raise RunError(
                f"no trajectory batch within rollout.batch_timeout_s={cfg.rollout.batch_timeout_s} s "
                f"at RL step {step + 1}; orchestrator: {json.dumps(stats)}. Checkpoints up to "
                f"the last one are in {ckpt_dir}; fix the cause and use --resume.") from None
        except RolloutHalted as e:  # the breaker: no environment or engine can run
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
            raise RunError(
                f"rollout halted at RL step {step + 1}: {cause} Checkpoints up to the last one "
                f"are in {ckpt_dir}; use --resume once the cause is fixed.") from None
        _preflight(preflight.check_batch, info, step + 1)  # nothing to learn from: stop
        with profiling.span("train_step", "driver", {"step": step + 1}):
            metrics = ray.get(job.learner.train_step.remote(refs))
        with profiling.span("weight_publish", "driver"):
            job.publish_weights()
        version = int(metrics["policy_version"])
        ray.get(job.orchestrator.mark_trained.remote(info["batch_id"], version))
        record = {"phase": "rl", "step": step + 1, **metrics,
                  **{k: v for k, v in info.items() if k != "statuses"},
                  "statuses": info["statuses"], **collector.window("rl", step + 1)}
        run.log(record)  # the console view prints the step's headline numbers
        if (step + 1) % cfg.learner.checkpoint_every == 0 or step + 1 == cfg.learner.rl_steps:
            with profiling.span("checkpoint", "driver", {"step": step + 1}):
                _checkpoint(job, run, ckpt_dir, cfg, before, warm, _best_metric(cfg, record))

    _finish_checkpoints(job, run)
    ray.get(job.orchestrator.stop.remote())
    engine_stats = job.engine_stats()
    with profiling.span("eval", "driver", {"tasks": len(heldout)}):
        after = job.evaluate(heldout)
    collector.drain("eval", cfg.learner.rl_steps)
    run.log({"phase": "eval", "when": "after_rl", **after})
    if cfg.model.path:
        files = ray.get(job.learner.export.remote(run.export))
        _say(f"trained policy exported to {run.export} ({len(files)} files, Hugging Face layout)")
    artifacts = profiling.write_artifacts(run.path)
    summary = {
        "run_dir": run.path,
        "env": cfg.env.name,
        "heldout_tasks": before["num_tasks"],
        "heldout_success_before_rl": before["success_rate"],
        "heldout_success_after_rl": after["success_rate"],
        "improvement_points": 100 * (after["success_rate"] - before["success_rate"]),
        "tool_use_before_rl": before["tool_use_rate"],
        "tool_use_after_rl": after["tool_use_rate"],
        "rl_steps": cfg.learner.rl_steps,
        "warm_start_steps": warm.get("warmup_steps", 0),
        "warm_start_s": warm.get("warmup_s", 0.0),
        "rl_s": time.monotonic() - t_rl,
        "wall_s": time.monotonic() - wall0,
        "engine_busy_fraction": engine_stats.get("busy_fraction"),
        "engine_policy_version": engine_stats.get("policy_version_received"),
        "export_dir": run.export if cfg.model.path else None,
        "eval_decoding": "greedy",
        "bottleneck": artifacts.get("bottleneck", "unknown"),
        "bottleneck_summary": artifacts.get("bottleneck_summary", ""),
        "profile": {k: v for k, v in artifacts.items() if k.endswith("_path")},
        "rl_engine_busy_fraction": _rl_mean(run, "engine_busy_fraction"),
        "orchestrator": {**{f"episodes_{s.value}": 0 for s in EpisodeStatus},
                         **ray.get(job.orchestrator.stats.remote())["counters"]},
    }
    with open(run.summary, "w") as f:
        json.dump(summary, f, indent=2)
    _say("summary:\n" + json.dumps(summary, indent=2))
    return summary


def _rl_mean(run: RunDir, key: str) -> float | None:
    """``key``'s mean over the RL steps as the bottleneck report takes it (weighted by
    step time, compiling steps left out); None when no step has it."""
    from raytunix.profiling.collect import read_jsonl, rl_steps
    from raytunix.profiling.report import compile_steps, weighted_means

    records = list(read_jsonl(run.metrics))
    return weighted_means(rl_steps(records), compile_steps(records)).get(key)


def _unfinished_episodes(result: dict[str, Any]) -> str:
    """For an evaluation's log line: " (8 of 8 episodes ended env_error; first error:
    <error>)" when some episodes did not complete (``result`` is
    ``RolloutOrchestrator.evaluate``'s), else "". A 0% success from a broken environment
    must not read as a policy that cannot solve anything."""
    statuses = result.get("statuses") or {}
    total = sum(statuses.values())
    other = {s: n for s, n in sorted(statuses.items()) if s != EpisodeStatus.COMPLETED.value}
    if not other:
        return ""
    ended = ", ".join(f"{n} of {total} episodes ended {s}" for s, n in other.items())
    error = result.get("error")
    return f" ({ended}" + (f"; first error: {error}" if error else "") + ")"


def _checkpoint(job: Job, run: RunDir, ckpt_dir: str, cfg: Config, before: dict, warm: dict,
                metrics: dict[str, float] | None = None) -> None:
    """Starts the learner's checkpoint of this step, with the orchestrator's state (data
    position, ledger) of the same step: nothing trains between the two calls. The save is
    asynchronous and the learner finishes the one before it first, so state.json (read
    first by a resume) moves on to that one here, and to this one in
    ``_finish_checkpoints``: it never names a checkpoint that is not committed."""
    orch_state = ray.get(job.orchestrator.state.remote())
    extras = {"orchestrator": orch_state, "heldout_before": before, "warm_start": warm}
    learner = cfg.learner
    step = ray.get(job.learner.save.remote(ckpt_dir, extras, learner.max_checkpoints, metrics,
                                           learner.keep_best_by, learner.keep_best_mode))
    if run.checkpoint_in_flight is not None:
        run.write_state(run.checkpoint_in_flight)
    run.checkpoint_in_flight = {"checkpoint_step": step, "data_position": orch_state["next_index"]}


def _finish_checkpoints(job: Job, run: RunDir) -> None:
    """Waits for the learner's checkpoint in flight and records it in state.json."""
    ray.get(job.learner.finish_checkpoints.remote())
    if run.checkpoint_in_flight is not None:
        run.write_state(run.checkpoint_in_flight)
        run.checkpoint_in_flight = None


def _best_metric(cfg: Config, record: dict[str, Any]) -> dict[str, float] | None:
    """``{learner.keep_best_by: value}`` from an RL step's metrics record; None when
    keep_best_by is off.

    Raises:
      RunError: the record has no number of that name.
    """
    name = cfg.learner.keep_best_by
    if not name:
        return None
    numbers = {k: float(v) for k, v in record.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if name not in numbers:
        raise RunError(f"learner.keep_best_by={name!r} is not a number of the RL step's "
                       f"metrics; choose one of {sorted(numbers)} (e.g. reward_mean).")
    return {name: numbers[name]}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main_train(cfg: Config, resume: str | None = None, resume_overrides: Sequence[str] = ()) -> int:
    try:
        summary = train(cfg, resume, resume_overrides)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return 0 if summary else 1

