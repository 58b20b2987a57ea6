"""The steps of the main job, in the order ``raytunix.train.train`` runs them:

    open_run          a new run directory, or a stopped run's own (its config, what it left)
    warm_start        supervised steps on demonstrations (a file, the env's expert,
                      arithmetic, or rejection-sampled episodes) before RL
    evaluate          greedy episodes on the held-out tasks (before RL and after)
    begin_rl          the RL optimizer, the KL reference, checkpoint 0
    restore_rl        ...or the newest RL checkpoint of a stopped run
    rl_loop           next batch -> update -> weights to the engines -> checkpoint
    export_policy     the trained policy as a Hugging Face folder (model.path runs)
    summarise         summary.json and the bottleneck report

Each takes the config, the ``Job`` (the run's actors) and the ``RunDir``, and logs what it
did to metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import ray

from raytunix import profiling
from raytunix.config import Config, ConfigError, shadowed_settings
from raytunix.driver import prepare
from raytunix.driver.heldout import PeriodicEval, heldout_line
from raytunix.driver.init_from import adopt_init_from
from raytunix.driver.job import Job
from raytunix.driver.prepare import Tasks
from raytunix.driver.run_dir import RunDir, RunError, load_run_config, new_run_dir, say
from raytunix.learner.group import LearnerHostFailure, LearnerStateDivergence
from raytunix.learner.learner import RLHyperparams, SFTHyperparams
from raytunix.profiling.learning import SignalWatch
from raytunix.rollout import preflight
from raytunix.cluster.scaling import ScaleWatcher
from raytunix.types import EpisodeStatus, RolloutHalted


@dataclasses.dataclass(frozen=True)
class RLStart:
    """Where the RL loop starts: its first step is ``step + 1``, at ``policy_version``;
    ``before`` is the held-out evaluation before RL and ``warm`` the warm start's
    ``{"warmup_steps", "warmup_s"}`` ({} without one), both kept in every checkpoint for
    the summary of a resumed run."""

    step: int
    policy_version: int
    before: dict[str, Any]
    warm: dict[str, Any]


# -- start or restore ------------------------------------------------------------------------


def open_run(
    cfg: Config | None, resume: str | None, overrides: Sequence[str] = ()
) -> tuple[Config, RunDir, Any]:
    """The run's config, directory and dataset, before Ray starts (so a config that cannot
    run fails fast and leaves no directory).

    A new run (``resume`` None): ``cfg``'s dataset is read, then a new directory made
    under ``run.output_dir`` with its config.yaml. A resumed run: ``resume``'s own
    config.yaml with ``overrides`` (saved back), its directory and its dataset; it goes on
    from its newest RL checkpoint, else from its warm start's (``warm_start``), else from
    the beginning.

    Returns:
      ``(cfg, run, dataset)``; dataset is ``(train, heldout)`` task lists or None (the
      environment's own tasks or reasoning-gym, made later).

    Raises:
      FileNotFoundError: ``resume`` is not a run directory.
      ValueError: neither ``cfg`` nor ``resume``.
      ConfigError: a bad override, or the dataset cannot be read; or the run does not fit
        its devices (``MemoryPlanError``, ``prepare.check_memory``); or the gateway of an
        agent-program run cannot listen where it is told (``prepare.check_gateway``).
      RunError: the checkpoint already holds ``learner.rl_steps`` steps, or another
        process runs ``resume`` now.

    The run stays locked for this process (``RunDir.lock``) until ``train`` ends.
    """
    from raytunix.data.datasets import DatasetError
    from raytunix.data.tasks import dataset_splits

    if cfg is None and not resume:
        raise ValueError("a new run needs a config: pass cfg (load_config(...)) or resume=RUN_DIR")
    if resume:
        cfg = load_run_config(resume, overrides)
        prepare.check_memory(cfg)  # an override (engine.max_batch_size...) may not fit
        prepare.check_gateway(cfg)
        run = RunDir(resume)
        run.lock()  # before anything is written: another driver may be running it
        try:
            return _reopened(cfg, run, dataset_splits)
        except BaseException:
            run.unlock()
            raise
    cfg = adopt_init_from(cfg)  # model.init_from's shape, checked before anything is made
    for line in shadowed_settings(cfg):
        say(f"note: {line}")
    prepare.check_memory(cfg)  # a run that cannot fit its devices stops before anything starts
    prepare.check_gateway(cfg)
    try:
        dataset = dataset_splits(cfg.data)  # a file, split or column missing: stop before Ray
    except DatasetError as e:
        raise ConfigError(str(e)) from None
    run = new_run_dir(cfg)  # created once the data is read: a config that cannot run leaves none
    run.lock()
    run.write_config(cfg)
    say(f"run directory: {run.path}")
    return cfg, run, dataset


def _reopened(cfg: Config, run: RunDir, dataset_splits) -> tuple[Config, RunDir, Any]:
    """``open_run`` for a resumed run, which this process holds (``RunDir.lock``)."""
    from raytunix.data.datasets import DatasetError

    saved = run.read_state()
    if "checkpoint_step" in saved:  # before Ray starts: fail fast
        check_steps_left(saved["checkpoint_step"], cfg)
    run.write_config(cfg)
    try:
        dataset = dataset_splits(cfg.data)
    except DatasetError as e:
        raise ConfigError(str(e)) from None
    say(f"run directory: {run.path}")
    return cfg, run, dataset


def check_steps_left(checkpoint_step: int, cfg: Config) -> None:
    """Raises RunError when a checkpoint at RL step ``checkpoint_step`` leaves no step of
    ``learner.rl_steps`` to train."""
    if checkpoint_step >= cfg.learner.rl_steps:
        raise RunError(
            f"the run's checkpoint is at RL step {checkpoint_step} and learner.rl_steps="
            f"{cfg.learner.rl_steps}: nothing left to train; resume with learner.rl_steps "
            f"greater than {checkpoint_step}."
        )


@contextlib.contextmanager
def profiled(cfg: Config, job: Job, run: RunDir) -> Iterator[Any]:
    """The run's profile collector (spans of every actor, drained at the end of a step, at
    most every ``run.profile_window_s``) and metric sinks (TensorBoard, Ray metrics, the
    console view), closed on the way out."""
    from raytunix.profiling.collect import Collector
    from raytunix.profiling.sinks import MetricSinks

    collector = Collector(
        run.path,
        job.profiled_actors,
        cfg.engine.max_batch_size,
        min_window_s=cfg.run.profile_window_s,
    )
    run.sinks = MetricSinks(run.path, cfg.learner.rl_steps, log_every=cfg.run.log_every)
    try:
        yield collector
    finally:
        run.sinks.close()
        run.sinks = None


# -- warm start ------------------------------------------------------------------------------


def warm_start(cfg: Config, job: Job, run: RunDir, tasks: Tasks, collector) -> dict[str, Any]:
    """Supervised steps on demonstrations (``prepare.warm_start_demonstrations``: a file,
    the environment's expert or the arithmetic ones), ``warmup.eval_every`` at a time, up
    to ``warmup.max_steps``; the arithmetic ones stop early once the dev check passes
    (after ``warmup.min_steps``), the others run the step budget and log the supervised
    loss. The engines get the weights after each dev check and at the end. Skipped
    (returns {}, said once on the console with the ways to get one) when ``warmup.enabled``
    is off or no source has demonstrations for the tasks.

    After each chunk its progress is checkpointed in ``RUN_DIR/warmup`` (the learner's SFT
    state, the step count, whether it is done), so a run stopped during the warm start, or
    after it but before RL's first checkpoint, continues from there instead of redoing it.

    Returns:
      ``{"warmup_steps": int, "warmup_s": float seconds}`` (seconds across resumes).
    """
    w = cfg.warmup
    if w.enabled and w.source == "rejection":
        tokens, mask, dropped = rejection_arrays(cfg, job)
        kind, where = "rejection", f"{len(tokens)} successful sampled episodes"
    else:
        demos = prepare.warm_start_demonstrations(
            cfg, job.train_tasks[: max(4000, w.batch_size)], job.env_pool
        )
        if demos is None:
            if w.enabled:
                say(
                    f"warm start: skipped; nothing demonstrates these tasks ({tasks.source}): "
                    f"{prepare.no_warm_start_advice(cfg)}"
                )
            return {}
        tokens, mask, dropped = prepare.demonstration_arrays(cfg, demos, job.tokenizer)
        kind, where = demos.kind, demos.where
    job.learner_get(job.learner.set_demonstrations.remote(tokens, mask), "set_demonstrations")
    job.learner_get(
        job.learner.start_warmup.remote(SFTHyperparams.from_config(cfg)), "start_warmup", slow=True
    )
    progress = restore_warm_start(job, run) or {"warmup_steps": 0, "warmup_s": 0.0, "done": False}
    steps = progress["warmup_steps"]
    if progress["done"]:
        return {"warmup_steps": steps, "warmup_s": progress["warmup_s"]}
    dev_check = kind == "arithmetic"
    measure = "tool-path accuracy" if prepare.uses_tools(cfg) else "success"
    left_out = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in dropped.items() if n)
    say(
        f"warm start: {len(tokens)} demonstrations from {where} of <= {tokens.shape[1]} "
        f"tokens" + (f" ({left_out} left out)" if left_out else "") + f", up to {w.max_steps} "
        "steps"
        + (
            f" (stop at dev {measure} >= {w.target_tool_accuracy:.0%})"
            if dev_check
            else " (the step budget: no dev check for this source)"
        )
    )
    run.log({"phase": "warmup_source", "source": kind, "rows": len(tokens), **dropped})
    t0 = time.monotonic() - progress["warmup_s"]
    done = steps >= w.max_steps
    while not done:
        steps, done = _warm_start_chunk(cfg, job, run, tasks, collector, steps, t0, dev_check)
    job.learner_get(
        job.learner.finish_checkpoints.remote(), "finish_checkpoints", slow=True
    )  # committed before RL's checkpoint 0
    return {"warmup_steps": steps, "warmup_s": time.monotonic() - t0}


def rejection_arrays(cfg: Config, job: Job) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """``warmup.source=rejection``: ``warmup.rejection_episodes`` episodes of the run's own
    engine (the train tasks in turn, at ``warmup.rejection_temperature``,
    ``rollout.max_new_tokens`` a turn), the successful ones kept as demonstrations: their
    exact tokens, the loss on the generated ones (``prepare.padded_arrays``). Sampled
    again on a resume.

    Raises:
      RunError: no episode succeeded (the policy earns no reward yet).
    """
    w = cfg.warmup
    train = job.train_tasks
    sampled = [train[i % len(train)] for i in range(w.rejection_episodes)]
    with profiling.span("rejection_sampling", "driver", {"episodes": len(sampled)}):
        result = job.evaluate(
            sampled, w.rejection_temperature, cfg.rollout.max_new_tokens, keep=True
        )
    successes = result["successes"]
    say(
        f"warm start: rejection sampling kept {len(successes)} of {len(sampled)} episodes "
        f"(success {result['success_rate']:.1%}, mean reward {result['reward_mean']:.3f})"
    )
    if not successes:
        raise RunError(
            f"warmup.source=rejection: none of {len(sampled)} sampled episodes succeeded "
            f"(reward >= 1; mean reward {result['reward_mean']:.3f}), so there is nothing to "
            f"learn from; {prepare.NO_WARM_START}, or raise warmup.rejection_episodes."
        )
    tokens, mask = prepare.padded_arrays(successes, job.tokenizer.pad_id)
    return tokens, mask, {"too_long": 0, "unparseable": 0}


def _warm_start_chunk(
    cfg: Config, job: Job, run: RunDir, tasks: Tasks, collector, steps: int, t0: float, dev_check
) -> tuple[int, bool]:
    """``warmup.eval_every`` supervised steps (fewer to end at ``max_steps``), the dev
    check when ``dev_check``, a checkpoint and the log line; returns ``(steps, done)``."""
    w = cfg.warmup
    n = min(w.eval_every, w.max_steps - steps)
    with profiling.span("sft_steps", "driver", {"steps": n}):
        metrics = job.learner_get(
            job.learner.sft_steps.remote(n, w.batch_size), "sft_steps", slow=True
        )
    steps += n
    check_nonfinite_warmup(metrics, cfg.learner.max_consecutive_nonfinite_updates, steps, run)
    done = steps >= w.max_steps
    dev: dict[str, Any] = {}
    if dev_check:
        job.publish_weights()
        with profiling.span("eval", "driver", {"tasks": len(tasks.dev)}):
            dev = job.evaluate(tasks.dev)
            dev.pop("rewards", None)
        score = dev["tool_path_accuracy"] if prepare.uses_tools(cfg) else dev["success_rate"]
        done = done or (steps >= w.min_steps and score >= w.target_tool_accuracy)
    elif done:
        job.publish_weights()
    job.learner_get(
        job.learner.save_warmup.remote(
            run.warmup,
            steps,
            {"warmup_steps": steps, "warmup_s": time.monotonic() - t0, "done": done},
        ),
        "save_warmup",
        slow=True,
    )
    collector.drain("warmup", steps)
    run.log(
        {"phase": "warmup", "step": steps, **metrics, **{f"dev_{k}": v for k, v in dev.items()}}
    )
    say(
        f"warm start step {steps}: loss {metrics['loss']:.3f}"
        + (
            f"  dev success {dev['success_rate']:.1%}  tool use {dev['tool_use_rate']:.1%}  "
            f"tool-path accuracy {dev['tool_path_accuracy']:.1%}"
            if dev
            else f" (last step {metrics['loss_last']:.3f})"
        )
        + f"  ({time.monotonic() - t0:.0f} s)"
    )
    return steps, done


def restore_warm_start(job: Job, run: RunDir) -> dict[str, Any] | None:
    """A stopped run's warm-start progress, restored into the learner (after its
    ``start_warmup``) and published to the engines: ``{"warmup_steps", "warmup_s",
    "done"}``; None when the run has none (a new run, or one stopped before its first
    warm-start check)."""
    if not os.path.isdir(run.warmup):
        return None
    progress = job.learner_get(
        job.learner.restore_warmup.remote(run.warmup), "restore_warmup", slow=True
    )
    if progress is None:
        return None
    job.publish_weights()
    steps = int(progress["warmup_steps"])
    say(
        f"warm start resumed after step {steps}"
        + (" (it was done; on to the evaluation before RL)" if progress["done"] else "")
    )
    run.log({"phase": "warmup_resume", "step": steps, "done": bool(progress["done"])})
    return progress


# -- evaluate --------------------------------------------------------------------------------


def evaluate(job: Job, run: RunDir, heldout, collector, when: str, step: int) -> dict[str, Any]:
    """Greedy episodes on the held-out tasks, logged as ``{"phase": "eval", "when": when}``
    (``before_rl`` / ``after_rl``) with the spans up to here under RL step ``step``.

    Returns:
      ``RolloutOrchestrator.evaluate``'s result: ``success_rate`` (episodes with reward
      >= ``SUCCESS_REWARD``, 1.0), ``reward_mean``, ``tool_use_rate``, ``num_tasks``,
      ``statuses``...
    """
    with profiling.span("eval", "driver", {"tasks": len(heldout)}):
        result = job.evaluate(heldout)
    result.pop("rewards", None)  # per episode: for `raytunix eval`, not for every record
    run.record_env_errors(result.pop("env_error_reports", ()))
    collector.drain("eval", step)
    run.log({"phase": "eval", "when": when, **result})
    say(heldout_line(when.replace("_rl", " RL"), result))
    return result


# -- into RL: fresh or restored ------------------------------------------------------------


def begin_rl(
    cfg: Config, job: Job, run: RunDir, before: dict[str, Any], warm: dict[str, Any]
) -> RLStart:
    """A fresh RL optimizer on the current weights, the KL reference policy saved (with
    ``learner.kl_coef`` > 0), and checkpoint 0 committed: a run that fails in RL step 1
    can resume. The warm start's checkpoint (``RUN_DIR/warmup``) goes then."""
    job.learner_get(
        job.learner.start_rl.remote(RLHyperparams.from_config(cfg)), "start_rl", slow=True
    )
    if cfg.learner.kl_coef > 0:
        job.learner_get(
            job.learner.save_reference.remote(run.reference), "save_reference", slow=True
        )
    checkpoint(job, run, cfg, before, warm)
    finish_checkpoints(job, run)
    # Never read again once RL has a checkpoint; with a model.path model its SFT state
    # (params and two Adam moments) would be three times the model's size on disk.
    shutil.rmtree(run.warmup, ignore_errors=True)
    return RLStart(step=0, policy_version=0, before=before, warm=warm)


def restore_rl(cfg: Config, job: Job, run: RunDir) -> RLStart:
    """The newest RL checkpoint that restores: learner state, policy version, the
    orchestrator at its data position and ledger; the engines get the weights.

    Raises:
      RunError: no checkpoint restores, or it already holds ``learner.rl_steps`` steps.
    """
    job.learner_get(
        job.learner.start_rl.remote(RLHyperparams.from_config(cfg)), "start_rl", slow=True
    )
    since = time.time()
    try:
        extras = job.learner_get(
            job.learner.restore.remote(
                run.checkpoints,
                cfg.learner.max_checkpoints,
                run.reference if cfg.learner.kl_coef > 0 else None,
                cfg.learner.keep_best_by,
                cfg.learner.keep_best_mode,
            ),
            "restore",
            slow=True,
        )
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, Exception) else e
        raise RunError(f"cannot resume {run.path}: {cause}") from None
    finally:
        _log_quarantined(run, since)
    job.publish_weights()
    version = int(extras["policy_version"])
    job.start_orchestrator(extras["orchestrator"], version)
    step = int(extras["rl_step"])
    check_steps_left(step, cfg)  # state.json may lag the newest checkpoint
    say(
        f"resumed at RL step {step}, policy version {version}, data position "
        f"{extras['orchestrator']['next_index']}"
    )
    # Steps past the checkpoint that a crashed run logged are trained again: from here on,
    # a step's record replaces any earlier one of the same step.
    run.log({"phase": "resume", "rl_step": step, "policy_version": version})
    return RLStart(
        step=step,
        policy_version=version,
        before=extras["heldout_before"],
        warm=extras.get("warm_start", {}),
    )


# -- the RL loop -------------------------------------------------------------------------


def rl_loop(
    cfg: Config, job: Job, run: RunDir, start: RLStart, collector, heldout: Sequence[Any] = ()
) -> float:
    """The RL steps (``rl_steps``); when a host of a multi-host learner dies in them, the
    learner group is rebuilt and the steps go on from the newest checkpoint
    (``recover_learner``). ``heldout``: the tasks of the periodic evaluation
    (``eval.every``). Returns the wall time, seconds, the lost steps included.

    Raises:
      RunError: as ``rl_steps`` does, or the learner group cannot be rebuilt.
    """
    t0 = time.monotonic()
    try:
        rl_steps(cfg, job, run, start, collector, heldout)
    except LearnerHostFailure as e:
        rl_loop(cfg, job, run, recover_learner(cfg, job, run, e), collector, heldout)
    return time.monotonic() - t0


def recover_learner(cfg: Config, job: Job, run: RunDir, error: Exception) -> RLStart:
    """A host of the learner group died: the group is rebuilt (new hosts, a new
    coordinator; ``LearnerGroup.rebuild``) and the run goes back to its newest checkpoint
    as a resume does (``restore_rl``: learner state, the orchestrator at the checkpoint's
    data position and ledger, new engines with the checkpoint's weights).

    Raises:
      RunError: the group cannot be rebuilt (hosts keep dying, or no room for them).
    """
    cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
    say(f"{cause} Rebuilding the learner group from the last checkpoint.")
    try:
        ray.get(job.learner.rebuild.remote())  # the group's own deadlines bound it
    except (LearnerHostFailure, LearnerStateDivergence, TimeoutError) as e:
        raise RunError(
            f"the learner group could not be rebuilt: {e} Checkpoints up to the "
            f"last one are in {run.checkpoints}; use --resume once the cause is "
            "fixed."
        ) from None
    job.restart_engines()  # they hold newer weights than the checkpoint's
    return restore_rl(cfg, job, run)


def _step_batch(cfg: Config, job: Job, run: RunDir, scaler: ScaleWatcher, step: int):
    """``(refs, info)`` of step ``step``'s batch (``_next_batch``), after applying a pending
    scale request; the batch's env error reports and samples are kept, and a batch with
    nothing to learn from is refused (``preflight.check_batch``, a ``RunError``)."""
    scaled = scaler.poll(job.orchestrator, step)
    if scaled is not None:
        run.log(scaled)
    refs, info = _next_batch(cfg, job, run, step)
    _keep_batch_reports(run, step, info)
    prepare.run_preflight(preflight.check_batch, info, step)
    return refs, info


def rl_steps(
    cfg: Config, job: Job, run: RunDir, start: RLStart, collector, heldout: Sequence[Any] = ()
) -> float:
    """RL steps ``start.step + 1`` .. ``learner.rl_steps``: a new scale request
    (``raytunix scale``, ``RUN_DIR/scale.json``) applied to the env and sandbox pools, the
    orchestrator's next batch (by reference), one learner update, the new weights to the
    engines, the batch marked trained, a metrics record, and a checkpoint every
    ``learner.checkpoint_every`` steps and at the last. Ends with every checkpoint committed
    and the orchestrator stopped.

    A step's record waits for its profiling window to close (``Collector.due``: at least
    ``run.profile_window_s`` long; always at the first step, which compiles, and at a
    checkpoint's step and the last); the records of the steps
    of one window are then written together, each with the window's metrics,
    ``window_s`` (its length) and ``window_steps`` (how many steps share it). When a step
    raises (or the run is interrupted), the window closes with a drain of at most
    ``CLOSING_DRAIN_TIMEOUT_S``; if that fails, the records are written without them.
    Every ``eval.every`` steps a held-out evaluation on ``heldout`` starts beside the
    training (``PeriodicEval``); the last one is waited for after the last step.

    Returns:
      the loop's wall time, seconds.

    Raises:
      RunError: no batch within ``rollout.batch_timeout_s``, the rollout halted (no env or
        engine can run), a batch with nothing to learn from (``preflight.check_batch``), or
        ``learner.max_consecutive_nonfinite_updates`` updates in a row not applied
        because they were not finite (``check_nonfinite_update``).
    """
    t0 = time.monotonic()
    collector.drain("rl", start.step)  # what came before RL stays out of step 1's window
    collector.start_window()
    scaler = ScaleWatcher(run.path, job.env_pool, job.sandbox_pool, say=say)
    watch = SignalWatch.from_config(cfg)
    waiting: list[dict[str, Any]] = []  # records of the steps of the open profiling window
    evals = PeriodicEval(job, run, heldout, cfg.eval.every, cfg.learner.rl_steps)
    try:
        for step in range(start.step + 1, cfg.learner.rl_steps + 1):
            refs, info = _step_batch(cfg, job, run, scaler, step)
            with profiling.span("train_step", "driver", {"step": step}):
                metrics = job.learner_get(
                    job.learner.train_step.remote(refs), "train_step", slow=step == start.step + 1
                )  # compiles
            with profiling.span("weight_publish", "driver"):
                job.publish_weights()
            version = int(metrics["policy_version"])
            ray.get(job.orchestrator.mark_trained.remote(info["batch_id"], version))
            evals.after_step(step, version)
            record = _step_record(step, metrics, info, job.env_pool.size)
            waiting.append(record)
            watch_learning_signal(watch, run, step, record)
            check_nonfinite_update(
                metrics, cfg.learner.max_consecutive_nonfinite_updates, step, run
            )
            saving = step % cfg.learner.checkpoint_every == 0 or step == cfg.learner.rl_steps
            # The first step's window (compiling) stays its own, and no checkpoint is
            # taken of a step whose record is not written yet.
            if saving or step == start.step + 1 or collector.due():
                _close_window(run, collector, waiting, step)
            if saving:
                with profiling.span("checkpoint", "driver", {"step": step}):
                    checkpoint(job, run, cfg, start.before, start.warm, best_metric(cfg, record))
    except BaseException:
        # A step raised (or the run was interrupted): the steps before it keep their
        # records, with the window's metrics when its drain answers within a few seconds
        # (an actor may be dead), else without them.
        if waiting:
            try:
                _close_window(run, collector, waiting, step, timeout_s=CLOSING_DRAIN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the step's own error is the one to raise
                for record in waiting:
                    run.log(record)
        raise
    evals.finish(cfg.learner.rl_steps, cfg.rollout.batch_timeout_s)
    finish_checkpoints(job, run)
    ray.get(job.orchestrator.stop.remote())
    return time.monotonic() - t0


def _step_record(
    step: int, metrics: dict[str, Any], info: dict[str, Any], env_actors: int
) -> dict[str, Any]:
    """RL step ``step``'s metrics record: the learner's ``metrics``, the batch's ``info``
    (its ``statuses`` last), the env pool's size, the time now."""
    return {
        "phase": "rl",
        "step": step,
        **metrics,
        **{k: v for k, v in info.items() if k != "statuses"},
        "statuses": info["statuses"],
        "env_actors": env_actors,
        "time": time.time(),
    }


def _keep_batch_reports(run: RunDir, step: int, info: dict[str, Any]) -> None:
    """Takes what RL step ``step``'s batch ``info`` carries for files of their own out of
    it: the env error reports (env_errors.jsonl) and the episodes for samples.jsonl
    (``raytunix.samples``), written before the update so a step that fails keeps them."""
    run.record_env_errors(info.pop("env_error_reports", ()))
    run.samples.write(
        step,
        info.pop("samples", ()),
        consume_version=info.get("consume_version"),
        batch_trajectories=info.get("num_trajectories"),
    )


def watch_learning_signal(
    watch: SignalWatch, run: RunDir, step: int, record: dict[str, Any]
) -> None:
    """After RL step ``step``: when ``watch`` (``raytunix.profiling.learning``) sees the
    learning signal go (``run.no_signal_steps`` steps in a row without) or come back, says
    so in one line and logs its ``{"phase": "learning_signal"}`` record to metrics.jsonl
    at once (the step's own record waits for its profiling window). Advice only: the run
    goes on."""
    change = watch.observe(step, record)
    if change is not None:
        say(change["message"])
        run.log(change)


CLOSING_DRAIN_TIMEOUT_S = 5.0  # the drain of a window closed by an error or interrupt

_NONFINITE_PARTS = {
    "nonfinite_loss": "the loss",
    "nonfinite_gradients": "the gradients",
    "nonfinite_new_state": "the new parameters or optimizer state",
}


def check_nonfinite_update(metrics: dict[str, float], limit: int, step: int, run: RunDir) -> None:
    """After RL step ``step``'s update: says so when it was not applied because something
    was not finite (``make_policy_update``'s ``update_nonfinite``), and stops the run when
    ``limit`` (``learner.max_consecutive_nonfinite_updates``; 0 = never) such updates came
    in a row (the learner's ``nonfinite_updates_in_a_row``).

    Raises:
      RunError: ``limit`` non-finite updates in a row; it names what was not finite and
        what to change.
    """
    if not metrics.get("update_nonfinite"):
        return
    parts = [name for key, name in _NONFINITE_PARTS.items() if metrics.get(key)] or ["it"]
    parts = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    in_a_row = int(metrics.get("nonfinite_updates_in_a_row", 1))
    what = (
        f"RL step {step}: the update was not applied: {parts} "
        f"{'was' if ' and ' not in parts else 'were'} not finite (loss "
        f"{metrics.get('loss')}, grad_norm {metrics.get('grad_norm')}); the policy stays "
        f"at version {int(metrics.get('policy_version', 0))}"
    )
    if limit and in_a_row >= limit:
        raise RunError(
            f"{in_a_row} updates in a row were not applied because they were not finite "
            f"(learner.max_consecutive_nonfinite_updates={limit}); {what}. Checkpoints up to "
            f"the last one are in {run.checkpoints}. Lower learner.learning_rate (and keep "
            "learner.max_grad_norm > 0, gradient clipping), check that the engine's logprobs "
            "and the environment's rewards are finite, then --resume; or raise "
            "learner.max_consecutive_nonfinite_updates (0 = never stop) to skip more."
        )
    say(
        f"{what} ({in_a_row} in a row; the run stops at "
        f"learner.max_consecutive_nonfinite_updates={limit or 'off'})."
    )


def check_nonfinite_warmup(metrics: dict[str, float], limit: int, steps: int, run: RunDir) -> None:
    """After a chunk of warm-start steps ending at step ``steps``: says how many were not
    applied because the loss, the gradients or the new parameters were not finite
    (``make_sft_update``'s ``update_nonfinite``), and stops the run when the last ``limit``
    (``learner.max_consecutive_nonfinite_updates``; 0 = never) steps in a row were such.

    Raises:
      RunError: ``limit`` such steps in a row; it names the setting to change.
    """
    skipped = int(metrics.get("updates_skipped_nonfinite", 0))
    if not skipped:
        return
    in_a_row = int(metrics.get("nonfinite_updates_in_a_row", 0))
    what = (
        f"warm start: {skipped} step(s) up to step {steps} were not applied: the loss, "
        f"the gradients or the new parameters were not finite (mean loss "
        f"{metrics.get('loss')}); the parameters stay those of the last finite step"
    )
    if limit and in_a_row >= limit:
        raise RunError(
            f"{what}, and the last {in_a_row} in a row were such "
            f"(learner.max_consecutive_nonfinite_updates={limit}). Lower "
            "warmup.learning_rate, then start the run again."
        )
    say(f"{what} ({in_a_row} in a row).")


def _close_window(
    run: RunDir, collector, records: list[dict[str, Any]], step: int, timeout_s: float | None = None
) -> None:
    """Drains the profiling window ending at ``step`` (an actor that does not answer within
    ``timeout_s``, default the collector's, is skipped), adds its metrics to ``records``
    (its steps' records, oldest first) and writes them (the console view prints each);
    empties ``records``, each as it is written: an interrupt between two leaves only the
    unwritten ones for the closing of the window on the way out."""
    window = collector.window("rl", step, timeout_s=timeout_s)
    steps = len(records)
    while records:
        records[0].update(window, window_steps=steps)
        run.log(records[0])
        del records[0]


def _next_batch(cfg: Config, job: Job, run: RunDir, step: int) -> tuple[list, dict[str, Any]]:
    """``(refs, info)`` of the orchestrator's next batch for RL step ``step``."""
    try:
        with profiling.span("next_batch_wait", "driver", {"step": step}):
            return ray.get(
                job.orchestrator.next_batch.remote(), timeout=cfg.rollout.batch_timeout_s
            )
    except ray.exceptions.GetTimeoutError:
        stats = ray.get(job.orchestrator.stats.remote())
        raise RunError(
            f"no trajectory batch within rollout.batch_timeout_s={cfg.rollout.batch_timeout_s} s "
            f"at RL step {step}; orchestrator: {json.dumps(stats)}. Checkpoints up to the last "
            f"one are in {run.checkpoints}; fix the cause and use --resume."
        ) from None
    except RolloutHalted as e:  # the breaker: no environment or engine can run
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
        run.record_env_errors(ray.get(job.orchestrator.take_env_errors.remote())[0])
        raise RunError(
            f"rollout halted at RL step {step}: {cause} Checkpoints up to the last one are in "
            f"{run.checkpoints}; use --resume once the cause is fixed."
        ) from None


def checkpoint(
    job: Job,
    run: RunDir,
    cfg: Config,
    before: dict,
    warm: dict,
    metrics: dict[str, float] | None = None,
) -> None:
    """Starts the learner's checkpoint of this step, with the orchestrator's state (data
    position, ledger) of the same step: nothing trains between the two calls. The save is
    asynchronous and the learner finishes the one before it first, so state.json (read
    first by a resume) moves on to that one here, and to this one in
    ``finish_checkpoints``: it never names a checkpoint that is not committed."""
    orch_state = ray.get(job.orchestrator.state.remote())
    extras = {"orchestrator": orch_state, "heldout_before": before, "warm_start": warm}
    learner = cfg.learner
    step = job.learner_get(
        job.learner.save.remote(
            run.checkpoints,
            extras,
            learner.max_checkpoints,
            metrics,
            learner.keep_best_by,
            learner.keep_best_mode,
        ),
        "save",
        slow=True,
    )
    run.commit_checkpoint_in_flight()  # the learner finished it before starting this one
    run.checkpoint_in_flight = {"checkpoint_step": step, "data_position": orch_state["next_index"]}


def finish_checkpoints(job: Job, run: RunDir) -> None:
    """Waits for the learner's checkpoint in flight and records it in state.json."""
    job.learner_get(job.learner.finish_checkpoints.remote(), "finish_checkpoints", slow=True)
    run.commit_checkpoint_in_flight()


def _log_quarantined(run: RunDir, since: float) -> None:
    """Says, and logs to metrics.jsonl (``phase: checkpoint_quarantined``), each damaged
    checkpoint that the restore begun at ``since`` (unix time) moved aside: its reason file
    in ``RUN_DIR/checkpoints-corrupt/`` (``Checkpointer._quarantine``)."""
    aside = run.checkpoints.rstrip("/") + "-corrupt"
    if "://" in aside or not os.path.isdir(aside):
        return
    for name in sorted(os.listdir(aside)):
        path = os.path.join(aside, name)
        if not name.endswith(".reason.json") or os.path.getmtime(path) < since - 1:
            continue
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        say(
            f"CHECKPOINT DAMAGED: step {record.get('step')} could not be read "
            f"({record.get('reason')}); moved to {record.get('moved_to')}"
        )
        run.log({"phase": "checkpoint_quarantined", **record})


def best_metric(cfg: Config, record: dict[str, Any]) -> dict[str, float] | None:
    """``{learner.keep_best_by: value}`` from an RL step's metrics record; None when
    keep_best_by is off.

    Raises:
      RunError: the record has no number of that name.
    """
    name = cfg.learner.keep_best_by
    if not name:
        return None
    numbers = {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    if name not in numbers:
        raise RunError(
            f"learner.keep_best_by={name!r} is not a number of the RL step's "
            f"metrics; choose one of {sorted(numbers)} (e.g. reward_mean)."
        )
    return {name: numbers[name]}


# -- after RL ------------------------------------------------------------------------------


def export_policy(cfg: Config, job: Job, run: RunDir) -> None:
    """With ``model.path``: the trained policy to ``RUN_DIR/export`` in the Hugging Face
    layout, beside the source folder's tokenizer files, and with LoRA its adapters to
    ``RUN_DIR/adapter`` as a ``peft`` folder over ``model.path``."""
    if not cfg.model.path:
        return
    files = job.learner_get(job.learner.export.remote(run.export), "export", slow=True)
    say(f"trained policy exported to {run.export} ({len(files)} files, Hugging Face layout)")
    if cfg.learner.lora_rank > 0:
        learner = cfg.learner
        job.learner_get(
            job.learner.export_adapters.remote(run.adapter, learner.lora_alpha),
            "export_adapters",
            slow=True,
        )
        say(f"LoRA adapters exported to {run.adapter} (peft's layout, over {cfg.model.path})")


def summarise(
    cfg: Config,
    job: Job,
    run: RunDir,
    start: RLStart,
    after: dict[str, Any],
    engine_stats: dict[str, Any],
    rl_s: float,
    wall0: float,
    tasks_dropped: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Writes the profile (trace, bottleneck report, plots) and summary.json, prints the
    summary and returns it. ``rl_s`` and ``wall_s`` (from ``wall0``, ``time.monotonic``)
    cover this process's part of the run only; ``tasks_dropped`` is ``Tasks.dropped``
    (tasks left out before training, by reason)."""
    artifacts = profiling.write_artifacts(run.path)
    before, warm = start.before, start.warm
    orchestrator = ray.get(job.orchestrator.stats.remote())
    summary = {
        "run_dir": run.path,
        "env": cfg.env.name,
        "heldout_tasks": before["num_tasks"],
        "heldout_success_before_rl": before["success_rate"],
        "heldout_success_after_rl": after["success_rate"],
        "improvement_points": 100 * (after["success_rate"] - before["success_rate"]),
        # None from a checkpoint taken before the evaluation reported it
        "heldout_reward_mean_before_rl": before.get("reward_mean"),
        "heldout_reward_mean_after_rl": after["reward_mean"],
        "tool_use_before_rl": before["tool_use_rate"],
        "tool_use_after_rl": after["tool_use_rate"],
        "rl_steps": cfg.learner.rl_steps,
        "warm_start_steps": warm.get("warmup_steps", 0),
        "warm_start_s": warm.get("warmup_s", 0.0),
        "rl_s": rl_s,
        "wall_s": time.monotonic() - wall0,
        "engine_busy_fraction": engine_stats.get("busy_fraction"),
        "engine_policy_version": engine_stats.get("policy_version_received"),
        "export_dir": run.export if cfg.model.path else None,
        "eval_decoding": "greedy",
        "bottleneck": artifacts.get("bottleneck", "unknown"),
        "bottleneck_summary": artifacts.get("bottleneck_summary", ""),
        "learning_signal": artifacts.get("learning_signal", "unknown"),
        "learning_signal_summary": artifacts.get("learning_signal_summary", ""),
        "profile": {k: v for k, v in artifacts.items() if k.endswith("_path")},
        "rl_engine_busy_fraction": rl_mean(run, "engine_busy_fraction"),
        "tasks_dropped": dict(tasks_dropped or {}),
        "orchestrator": {
            **{f"episodes_{s.value}": 0 for s in EpisodeStatus},
            **orchestrator["counters"],
        },
        "env_errors_by_kind": orchestrator["env_errors_by_kind"],
    }
    with open(run.summary, "w") as f:
        json.dump(summary, f, indent=2)
    say("summary:\n" + json.dumps(summary, indent=2))
    return summary


def rl_mean(run: RunDir, key: str) -> float | None:
    """``key``'s mean over the RL steps as the bottleneck report takes it (weighted by
    step time, compiling steps left out); None when no step has it."""
    from raytunix.profiling.collect import read_jsonl, rl_steps
    from raytunix.profiling.report import compile_steps, weighted_means

    records = list(read_jsonl(run.metrics))
    return weighted_means(rl_steps(records), compile_steps(records)).get(key)
