"""The actors of one run (``Job``), and ``started_job``, which brings them up from a
config and takes them down however the run ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import ray

from raytunix.config import Config, RolloutConfig
from raytunix.driver import prepare
from raytunix.driver.init_from import initial_checkpoints
from raytunix.driver.prepare import Tasks
from raytunix.driver.run_dir import RunDir, RunError, say
from raytunix.models.tokenizer import Tokenizer
from raytunix.cluster.placement import LearnerHostsSpec, resource_options
from raytunix.rollout.env_pool import CPU_ONLY_RUNTIME_ENV, EnvPool
from raytunix.types import SamplingParams

# A run that stops waits this long for the learner's checkpoint in flight to be committed.
CHECKPOINT_FINISH_TIMEOUT_S = 300.0
# A crashed engine replica must be back (restarted, weights taken) within this, seconds.
ENGINE_RESTART_TIMEOUT_S = 600.0

# A learner group finds its stuck hosts itself, within its own deadlines; the driver waits
# this much longer before it counts the group's actor itself as stuck.
GROUP_ANSWER_MARGIN_S = 120.0


class LearnerStuck(RunError):
    """The learner did not answer a call within its deadline (``learner.call_timeout_s``,
    or ``slow_call_timeout_s``) although its actor is alive."""


class Job:
    """The actors of one run, built from its config: the learner (with the engine in one
    process when ``engine.placement=colocated``, else beside ``engine.num_replicas``
    engine actors), the env pool, the sandbox pool (or None) and, once started, the
    orchestrator. ``init_from``: a checkpoint directory whose newest policy the learner
    (and so the engines) start from (``model.init_from``); "" for the model itself."""

    def __init__(
        self,
        cfg: Config,
        tokenizer: Tokenizer,
        train_tasks,
        env_pool: EnvPool,
        sandbox_pool=None,
        init_from: str = "",
    ):
        from raytunix.learner.actor import PolicyActor

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.train_tasks = train_tasks
        self.orchestrator = None
        self.env_pool = env_pool
        self.sandbox_pool = sandbox_pool
        model_config = prepare.model_config(cfg, tokenizer)
        path = cfg.model.path
        self.colocated = cfg.engine.placement == "colocated"
        hosts = LearnerHostsSpec.from_config(cfg.learner)  # learner.resources, num_hosts...
        self.learner_group = hosts.num_hosts > 1
        jit_options = prepare.jit_actor_options(cfg)  # the persistent compilation cache
        if self.colocated:
            self.learner = (
                ray.remote(PolicyActor)
                .options(max_concurrency=10_000, **hosts.actor_options(), **jit_options)
                .remote(
                    model_config,
                    cfg.run.seed,
                    tokenizer,
                    cfg.engine.engine_kwargs(),
                    path,
                    init_from,
                )
            )
            self.engine = self.learner
            self.engines = [self.learner]
        else:
            from raytunix.inference.actor import EngineActor

            self.learner = self._disaggregated_learner(model_config, hosts, init_from)
            # A crashed engine is restarted by Ray under the same handle (the orchestrator's
            # router keeps it; calls wait for it) and takes the learner's weights first.
            engine_options = {
                **resource_options(cfg.engine.actor_resources),
                "max_restarts": cfg.engine.actor_max_restarts,
                **jit_options,
            }
            self._new_engine = lambda: (
                ray.remote(EngineActor)
                .options(max_concurrency=10_000, **engine_options)
                .remote(
                    model_config,
                    cfg.run.seed,
                    tokenizer,
                    cfg.engine.engine_kwargs(),
                    path,
                    weights_source=self.learner,
                )
            )
            self.engines = [self._new_engine() for _ in range(cfg.engine.num_replicas)]
            self.engine = self.engines[0]
        if init_from:  # the engines built a fresh model; the learner holds the earlier run's
            self.publish_weights()

    def _disaggregated_learner(self, model_config, hosts: LearnerHostsSpec, init_from: str):
        """The learner's actor beside the engines: a ``LearnerGroup`` (one actor per host,
        one JAX program; called as a ``LearnerActor``) for ``learner.num_hosts`` > 1."""
        from raytunix.learner.actor import LearnerActor

        cfg, path, pad_id = self.cfg, self.cfg.model.path, self.tokenizer.pad_id
        if self.learner_group:
            from raytunix.learner.group import LearnerGroup

            return (
                ray.remote(LearnerGroup)
                .options(num_cpus=0)
                .remote(
                    hosts,
                    model_config,
                    cfg.run.seed,
                    pad_id,
                    path,
                    init_from,
                    call_timeout_s=cfg.learner.call_timeout_s,
                    slow_call_timeout_s=cfg.learner.slow_call_timeout_s,
                )
            )
        options = dict(max_concurrency=100, **hosts.actor_options())
        return (
            ray.remote(LearnerActor)
            .options(**options, **prepare.jit_actor_options(cfg))
            .remote(model_config, cfg.run.seed, pad_id, path, init_from)
        )

    def learner_get(self, ref, what: str, slow: bool = False, fetch: bool = True):
        """``ray.get`` of a learner call's ``ref`` within its deadline:
        ``learner.slow_call_timeout_s`` when ``slow`` (compiling, checkpoints, export),
        else ``learner.call_timeout_s``; a learner group gets ``GROUP_ANSWER_MARGIN_S``
        more, as it tears itself down and raises ``LearnerHostFailure`` first. With
        ``fetch=False`` it only waits until the result exists (weights for the engines
        stay out of the driver) and returns None.

        Raises:
          LearnerStuck: no answer in time (``what`` names the call in the message); the
            learner actor is killed, as a call still running in it cannot be trusted to
            end.
          whatever the call raised.
        """
        learner = self.cfg.learner
        timeout = learner.slow_call_timeout_s if slow else learner.call_timeout_s
        if self.learner_group:
            timeout += GROUP_ANSWER_MARGIN_S
        try:
            if fetch:
                return ray.get(ref, timeout=timeout)
            if not ray.wait([ref], timeout=timeout, fetch_local=False)[0]:
                raise ray.exceptions.GetTimeoutError(what)
            return None
        except ray.exceptions.GetTimeoutError:
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(self.learner)
            key = "slow_call_timeout_s" if slow else "call_timeout_s"
            raise LearnerStuck(
                f"the learner did not answer {what} within {timeout:.0f} s (learner.{key}="
                f"{getattr(learner, key)}{' plus the group margin' if self.learner_group else ''}"
                "): its actor is alive but stuck (a hung storage read, a wedged device call), "
                "so it was killed. Raise learner."
                f"{key} if the call is just slow on these hosts."
            ) from None

    def restart_engines(self) -> None:
        """New engine actors in place of the current ones (disaggregated placement), for a
        learner that went back to an older checkpoint in the run: an engine's policy
        version never decreases. Start the orchestrator again after this."""
        for engine in self.engines:
            ray.kill(engine)
        self.engines = [self._new_engine() for _ in self.engines]
        self.engine = self.engines[0]

    def start_orchestrator(self, state: dict[str, Any], policy_version: int) -> None:
        """(Re)creates the orchestrator at a data position (``state``) and version."""
        from raytunix.rollout.actor import OrchestratorActor
        from raytunix.rollout.concurrency import ConcurrencyController

        cfg, tokenizer = self.cfg, self.tokenizer
        if self.orchestrator is not None:
            ray.kill(self.orchestrator)
        self.orchestrator = (
            ray.remote(OrchestratorActor)
            .options(num_cpus=0, max_concurrency=10_000, runtime_env=CPU_ONLY_RUNTIME_ENV)
            .remote(
                tasks=self.train_tasks,
                tokenizer=tokenizer,
                agent_name=prepare.agent_name(cfg),
                agent_kwargs=prepare.agent_kwargs(cfg),
                import_paths=prepare.import_paths(cfg),
                program=prepare.program_settings(cfg),
                env_pool=self.env_pool,
                engine=self.engines,
                group_size=cfg.rollout.group_size,
                groups_per_batch=cfg.rollout.groups_per_batch,
                max_concurrent_episodes=cfg.rollout.max_concurrent_episodes,
                max_staleness=cfg.rollout.max_staleness,
                max_turns=cfg.env.max_turns,
                max_context_tokens=cfg.model.max_seq_len,
                sampling=SamplingParams(
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature,
                    top_k=cfg.rollout.top_k,
                    top_p=cfg.rollout.top_p,
                    stop_token_ids=tokenizer.stop_ids,
                ),
                episode_timeout_s=cfg.rollout.episode_timeout_s,
                batch_queue_size=cfg.rollout.batch_queue_size,
                drop_failed_groups=cfg.rollout.drop_failed_groups,
                stale_token_policy=cfg.rollout.stale_token_policy,
                partial_rollout=cfg.rollout.partial_rollout,
                concurrency=(
                    ConcurrencyController.from_config(cfg.rollout)
                    if cfg.rollout.adaptive_concurrency
                    else None
                ),
                concurrency_interval_s=cfg.rollout.adaptive_interval_s,
                dynamic_sampling=cfg.rollout.dynamic_sampling,
                dynamic_sampling_max_filtered=cfg.rollout.dynamic_sampling_max_filtered,
                **fault_kwargs(cfg.rollout),
                seed=cfg.run.seed,
                policy_version=policy_version,
                state=state,
                samples_per_step=cfg.run.samples_per_step,
            )
        )

    def publish_weights(self) -> None:
        """Disaggregated placement: ship the learner's weights to the engines (under LoRA
        only the adapters, which each engine merges onto the learner's base, fetched once
        per base: ``LearnerActor.weights``, ``EngineActor.update_weights``). A replica
        that crashed is asked again, with backoff, until Ray has restarted it (a call to a
        restarting actor fails at once with ``ActorUnavailableError``).

        Raises:
          RunError: a replica is dead for good (``engine.actor_max_restarts`` used up, or
            it fails at start), or not back within ``ENGINE_RESTART_TIMEOUT_S``.
        """
        if self.colocated:
            return
        weights = self.learner.weights.remote()
        self.learner_get(weights, "weights", fetch=False)  # engines would wait for ever
        calls = {i: engine.update_weights.remote(weights) for i, engine in enumerate(self.engines)}
        deaths = dict.fromkeys(calls, 0)
        deadline, delay = time.monotonic() + ENGINE_RESTART_TIMEOUT_S, 0.2
        while calls:
            failed = {}
            for i, call in calls.items():
                try:
                    ray.get(call)
                except ray.exceptions.RayActorError as e:
                    failed[i] = e
                    # A crash answers one call with ActorDiedError; a dead actor, every call.
                    deaths[i] += not isinstance(e, ray.exceptions.ActorUnavailableError)
            for i, error in failed.items():
                if deaths[i] > self.cfg.engine.actor_max_restarts or time.monotonic() > deadline:
                    raise RunError(
                        f"engine replica {i} cannot take the new weights: it died and Ray did "
                        f"not bring it back (engine.actor_max_restarts="
                        f"{self.cfg.engine.actor_max_restarts} restarts used up, it fails at "
                        f"start, or it was not back within {ENGINE_RESTART_TIMEOUT_S:g} s): "
                        f"{str(error)[:500]} Checkpoints up to the last one stay; raise "
                        "engine.actor_max_restarts or fix the cause, then --resume."
                    )
            if failed:
                time.sleep(delay)
                delay = min(2 * delay, 5.0)
            calls = {i: self.engines[i].update_weights.remote(weights) for i in failed}

    def evaluate(
        self, tasks, temperature: float = 0.0, max_new_tokens: int = 0, keep: bool = False
    ) -> dict[str, Any]:
        """One episode per task, greedy unless ``temperature`` > 0, ``max_new_tokens`` per
        turn (0: ``eval.max_new_tokens``); with ``keep``, the successful episodes' tokens
        too (``RolloutOrchestrator.evaluate``'s result)."""
        return ray.get(self.start_evaluation(tasks, temperature, max_new_tokens, keep))

    def start_evaluation(
        self, tasks, temperature: float = 0.0, max_new_tokens: int = 0, keep: bool = False
    ):
        """``evaluate`` without waiting for it: the object reference of its result."""
        max_new_tokens = max_new_tokens or self.cfg.eval.max_new_tokens
        return self.orchestrator.evaluate.remote(tasks, max_new_tokens, temperature, keep)

    def engine_stats(self) -> dict[str, Any]:
        """The engine's counters; across replicas, sums, the mean busy fraction and the
        lowest policy version, with each replica's under ``replicas``."""
        per_replica = ray.get([engine.engine_stats.remote() for engine in self.engines])
        if len(per_replica) == 1:
            return per_replica[0]
        merged = {
            key: sum(stats[key] for stats in per_replica)
            for key, value in per_replica[0].items()
            if isinstance(value, (int, float)) and not key.startswith("policy_version")
        }
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
        # By their pools' stable indices: a resize (raytunix scale) renames no actor, and
        # a retired one is no longer drained.
        actors += [(f"env actor {i}", actor) for i, actor in self.env_pool.members()]
        if self.sandbox_pool is not None:
            actors += [(f"sandbox {i}", actor) for i, actor in self.sandbox_pool.members()]
        return actors

    def shutdown(self, run: RunDir | None = None) -> None:
        """Lets the learner finish a checkpoint it is writing (and records it in ``run``'s
        state.json, so that it names the newest committed one after an interrupt too),
        then kills the run's actors (checkpoints and the run directory stay)."""
        try:
            ray.get(self.learner.finish_checkpoints.remote(), timeout=CHECKPOINT_FINISH_TIMEOUT_S)
        except ray.exceptions.RayError as e:  # a dead learner; a timeout: orbax's temporary
            say(
                f"the checkpoint in flight was not finished ({type(e).__name__}: "  # dir
                f"{str(e)[:300]}); resuming uses the one before it"
            )  # keeps the last valid
        else:
            if run is not None:
                # A resume reads the checkpoints themselves; a state.json that cannot be
                # written only lags them, so it does not stop the actors' shutdown.
                with contextlib.suppress(OSError):
                    run.commit_checkpoint_in_flight()
        if self.learner_group:  # its hosts and their reservation
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(self.learner.shutdown.remote(), timeout=60)
        actors = [self.orchestrator, self.learner, *self.env_pool.actors]
        if not self.colocated:
            actors += self.engines
        for actor in actors:
            if actor is not None:
                ray.kill(actor)
        if self.sandbox_pool is not None:
            self.sandbox_pool.shutdown()


def fault_kwargs(rollout: RolloutConfig) -> dict[str, Any]:
    """The orchestrator's fault handling from ``rollout.*`` (``RolloutConfig``)."""
    from raytunix.rollout.faults import Backoff

    r = rollout
    return {
        "max_episode_restarts": r.max_episode_restarts,
        "max_group_retries": r.max_group_retries,
        "max_consecutive_failures": r.max_consecutive_failures,
        "engine_backoff": Backoff(
            initial_delay_s=r.engine_retry_initial_delay_s,
            max_delay_s=r.engine_retry_max_delay_s,
            multiplier=r.engine_retry_multiplier,
            jitter=r.engine_retry_jitter,
            max_attempts=r.engine_retry_max_attempts,
        ),
        "retry_backoff": Backoff(
            initial_delay_s=r.retry_initial_delay_s,
            max_delay_s=r.retry_max_delay_s,
            multiplier=r.retry_multiplier,
            jitter=r.retry_jitter,
        ),
    }


@contextlib.contextmanager
def started_job(cfg: Config, run: RunDir, dataset) -> Iterator[tuple[Job, Tasks]]:
    """Brings a run's actors up, in the order that stops a run that cannot work before
    anything trains: sandboxes, env actors (an environment that brings its own tasks
    builds them there), the tasks, the tokenizer, the prompt check, then the learner and
    engines. Yields ``(job, tasks)``; on the way out, however the run ends, lets the
    learner finish its checkpoint in flight and kills every actor.

    Args:
      dataset: ``(train, heldout)`` read from ``data.*`` (``dataset_splits``) or None.

    Raises:
      RunError: a step above fails (see ``raytunix.driver.prepare``).
    """
    with contextlib.ExitStack() as stack:
        sandbox_pool = prepare.start_sandbox_pool(cfg)
        if sandbox_pool is not None:
            stack.callback(sandbox_pool.shutdown)
        env_pool = prepare.start_env_pool(cfg)
        stack.callback(lambda: [ray.kill(actor) for actor in env_pool.actors])
        tasks = prepare.task_splits(cfg, env_pool, dataset)
        tokenizer = prepare.run_tokenizer(cfg, run, tasks.train)
        tasks = prepare.check_prompts(cfg, env_pool, tasks, tokenizer)
        init_from = initial_checkpoints(cfg, run)  # model.init_from's, until the run saves its own
        job = Job(cfg, tokenizer, tasks.train, env_pool, sandbox_pool, init_from)
        stack.pop_all()  # the job's shutdown takes them all down now
        try:
            _check_mesh(cfg, job)
        except BaseException:
            job.shutdown()
            raise
        try:
            yield job, tasks
        finally:
            job.shutdown(run)


def _check_mesh(cfg: Config, job: Job) -> None:
    """The learner's ``learner.mesh_*`` against the devices it has, before anything trains
    (the mesh itself is built when a phase starts).

    Raises:
      RunError: the axes do not fit the devices (the message names the keys to set).
    """
    from raytunix.learner.sharding import MeshConfig

    devices = job.learner_get(job.learner.device_count.remote(), "device_count", slow=True)
    try:
        MeshConfig.from_config(cfg).axis_sizes(devices)
    except ValueError as e:
        raise RunError(f"the learner's device mesh: {e}") from None
