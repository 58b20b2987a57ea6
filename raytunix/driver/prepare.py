"""What a run needs before its actors train: the memory plan checked, Ray, the names its
config resolves to, the sandbox pool, the tasks, the tokenizer, the prompt check and the
warm start's demonstrations. Each step raises ``RunError`` (or ``ConfigError``) with what
to do."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import socket
import threading
from typing import Any

import numpy as np
import ray

from raytunix import plugins
from raytunix.config import Config, ConfigError
from raytunix.driver import memory_plan
from raytunix.driver.init_from import copy_tokenizer
from raytunix.driver.run_dir import RunDir, RunError, say
from raytunix.models.llama import ModelConfig
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout import preflight
from raytunix.rollout.env_pool import EnvPool

# Env actors may wait for a node of their own resource (an autoscaled pool) before they
# build the environment; past this, the run stops with the reason.
ENV_READY_TIMEOUT_S = 600.0


# -- Ray and signals -------------------------------------------------------------------------


def connect_ray() -> None:
    """Joins the cluster in ``RAY_ADDRESS``, or starts a local one (watched, so that a
    killed driver takes it down); nothing when Ray is already up. Then SIGTERM stops the
    run as Ctrl-C does (actors shut down, checkpoints kept).

    Raises:
      RunError: Ray could not start the local cluster or join ``RAY_ADDRESS``'s (the
        message says which, Ray's reason, and what to try).
    """
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            _check_reachable(address)
            try:
                ray.init(address=address, log_to_driver=True)
            except Exception as e:  # noqa: BLE001  (Ray raises bare Exception and others)
                raise RunError(
                    f"cannot join the Ray cluster at RAY_ADDRESS={address!r}: "
                    f"{type(e).__name__}: {_first_line(e)}. Check that the cluster is up "
                    "(`ray status`) and the address, or unset RAY_ADDRESS to run on a local "
                    "cluster of this machine."
                ) from e
        else:
            from raytunix.cluster.watchdog import start_watchdog

            # address="local": a new cluster, even where `ray start` left one running on
            # this machine (ray.init() alone would join it); RAY_ADDRESS joins one.
            try:
                context = ray.init(
                    address="local",
                    include_dashboard=False,
                    object_store_memory=256 * 1024**2,
                    num_cpus=max(2, os.cpu_count() or 2),
                    log_to_driver=True,
                )
            except Exception as e:  # noqa: BLE001  (Ray raises bare Exception on a timeout)
                ray.shutdown()  # the processes it did start
                raise RunError(
                    f"Ray could not start a local cluster: {type(e).__name__}: "
                    f"{_first_line(e)}. On a heavily loaded machine its raylet can miss "
                    "Ray's 30 s start-up deadline: retry with RAY_raylet_start_wait_time_s=120 "
                    "in the environment; nothing was trained, so there is nothing to "
                    "resume."
                ) from e
            # This process started the cluster: if it is killed (kill -9, OOM), the
            # cluster's processes go with it instead of outliving it for a minute.
            start_watchdog(context.address_info["session_dir"])
    if threading.current_thread() is threading.main_thread():
        # After ray.init, which installs its own SIGTERM handler.
        signal.signal(signal.SIGTERM, _interrupt)


def compilation_cache_env(cfg: Config) -> dict[str, str]:
    """Environment variables that turn on JAX's persistent compilation cache in a process
    that compiles (``run.compilation_cache_dir``, ``~`` expanded;
    ``run.compilation_cache_min_compile_s``); empty when the cache is off (``""``). JAX
    reads them at import, so they go into the process's environment, not its code."""
    directory = cfg.run.compilation_cache_dir
    if not directory:
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": os.path.abspath(os.path.expanduser(directory)),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": repr(
            float(cfg.run.compilation_cache_min_compile_s)
        ),
    }


def jit_actor_options(cfg: Config) -> dict[str, Any]:
    """``.options()`` keywords for an actor that compiles (learner, engine): its runtime
    env carries ``compilation_cache_env`` (Ray merges these ``env_vars`` with the job's);
    empty when the cache is off."""
    env = compilation_cache_env(cfg)
    return {"runtime_env": {"env_vars": env}} if env else {}


# How long the driver waits for anything to answer at RAY_ADDRESS before it says so (Ray
# itself retries an address where nothing listens for many minutes).
RAY_ADDRESS_TIMEOUT_S = 15.0


def _check_reachable(address: str) -> None:
    """Raises ``RunError`` unless a TCP connection to ``address``'s ``host:port`` (``ray://``
    client addresses too) opens within ``RAY_ADDRESS_TIMEOUT_S``; ``auto`` and addresses
    without a port are left to Ray."""
    target = address.split("://", 1)[-1].rstrip("/")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection(
            (host.strip("[]"), int(port)), timeout=RAY_ADDRESS_TIMEOUT_S
        ).close()
    except (OSError, OverflowError, ValueError) as e:
        raise RunError(
            f"cannot join the Ray cluster at RAY_ADDRESS={address!r}: nothing answered at "
            f"{host}:{port} within {RAY_ADDRESS_TIMEOUT_S:g} s ({type(e).__name__}: "
            f"{_first_line(e)}). Check that the cluster is up (`ray status` on its head) and "
            "the address, or unset RAY_ADDRESS to run on a local cluster of this "
            "machine."
        ) from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def _interrupt(signum, frame):
    interrupt = KeyboardInterrupt()
    interrupt.signum = signum  # the CLI exits with 128 + signum, as a shell reports it
    raise interrupt


# -- what the config names -------------------------------------------------------------------


def env_class(cfg: Config) -> type:
    return plugins.resolve("env", cfg.env.name)


def agent_name(cfg: Config) -> str:
    return env_class(cfg).default_agent if cfg.env.agent == "auto" else cfg.env.agent


def agent_kwargs(cfg: Config) -> dict[str, Any]:
    """``env.agent_kwargs``; with ``model.path``, the chat template is the folder's unless
    the config names one."""
    kwargs = dict(cfg.env.agent_kwargs)
    if cfg.model.path:
        kwargs.setdefault("chat_template", cfg.model.path)
    return kwargs


def program_settings(cfg: Config) -> dict[str, Any] | None:
    """What the orchestrator needs to run episodes that are programs through a gateway
    (``raytunix.rollout.program.program_parts``): for ``env.name=agent_program`` and any
    env subclassing it (``verifiers``); None for any other env. The programs themselves run
    in the env actors, which build them from ``env.*``."""
    from raytunix.envs.agent_program import AgentProgramEnv

    if not issubclass(env_class(cfg), AgentProgramEnv):
        return None
    return {
        "chat_template": agent_kwargs(cfg).get("chat_template", "raytunix"),
        "default_max_tokens": cfg.rollout.max_new_tokens,
        "max_model_len": cfg.model.max_seq_len,
        **dataclasses.asdict(cfg.gateway),
    }


def new_agent(cfg: Config, tokenizer: Tokenizer):
    from raytunix.agents import make_agent

    return make_agent(agent_name(cfg), tokenizer, **agent_kwargs(cfg))


def import_paths(cfg: Config) -> tuple[str, ...]:
    """Directories the actors put on sys.path to import what the config names by import
    path: the env and agent classes (resolved here first) and modules named inside
    env.kwargs / env.agent_kwargs (a tool class, a gymnasium env)."""
    classes = (env_class(cfg), plugins.resolve("agent", agent_name(cfg)))
    roots = [plugins.import_root(cls) for cls in classes]
    roots += plugins.module_roots(cfg.env.kwargs) + plugins.module_roots(cfg.env.agent_kwargs)
    return tuple(dict.fromkeys(root for root in roots if root))


def uses_tools(cfg: Config) -> bool:
    """The warm start's tool demonstrations are for the calculator environment."""
    from raytunix.envs import CalculatorMathEnv

    return issubclass(env_class(cfg), CalculatorMathEnv)


def model_config(cfg: Config, tokenizer: Tokenizer) -> ModelConfig:
    """The run's model: ``model.path``'s config.json at ``model.max_seq_len`` tokens of
    context, else a fresh model of the ``model.*`` sizes over ``tokenizer``'s ids
    (``memory_plan.model_shape``); either computes in ``model.dtype``.

    Raises:
      RunError: the folder's model cannot be read, or its embedding has fewer ids than
        its tokenizer.
    """
    try:
        config = memory_plan.model_shape(cfg, tokenizer.vocab_size)
    except ConfigError as e:
        raise RunError(str(e)) from None
    if cfg.model.path and tokenizer.vocab_size > config.vocab_size:
        raise RunError(
            f"model.path={cfg.model.path!r}: tokenizer.json has {tokenizer.vocab_size} ids but "
            f"the model's embedding only {config.vocab_size}; the folder's files do "
            "not belong together."
        )
    return config


def check_gateway(cfg: Config) -> None:
    """For a run of agent programs on this machine (no ``RAY_ADDRESS``: the orchestrator,
    which serves the gateway, runs here): ``gateway.host`` resolves to an address this
    machine can bind, and ``gateway.port`` (unless 0, any free port) is free. On a
    cluster the orchestrator's node is not known yet, so nothing is checked.

    Raises:
      ConfigError: naming the key, its value and what to set instead.
    """
    if os.environ.get("RAY_ADDRESS") or program_settings(cfg) is None:
        return
    host, port = cfg.gateway.host, cfg.gateway.port
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(
            f"gateway.host={host!r} does not resolve ({e.strerror}); use 127.0.0.1 (the "
            "default, loopback), 0.0.0.0 (every interface) or an address of this machine."
        ) from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind(address)
        except OSError as e:
            what = f"gateway.port={port} is in use" if port else f"{host!r} is not local"
            raise ConfigError(
                f"the gateway cannot listen on gateway.host={host!r} gateway.port={port}: "
                f"{e.strerror} ({what}?); set gateway.port=0 (any free port) or a "
                "gateway.host of this machine."
            ) from None


def _accelerator_installed() -> bool:
    """Whether JAX could open an accelerator here: libtpu, or a PJRT plugin (the CUDA and
    ROCm ones), which JAX finds as ``jax_plugins`` modules or entry points."""
    import importlib.metadata
    import importlib.util

    return (
        importlib.util.find_spec("libtpu") is not None
        or importlib.util.find_spec("jax_plugins") is not None
        or bool(importlib.metadata.entry_points(group="jax_plugins"))
    )


def check_memory(cfg: Config) -> None:
    """The run's memory plan (``raytunix.driver.memory_plan``) against its devices, before
    Ray or any actor starts; one line says how full the fullest device will be. The
    devices are measured in a child process where an accelerator is installed (the driver
    leaves it to the learner and engine), in this one where only the CPU is, or read from ``run.device_memory_gib``; on a cluster
    (``RAY_ADDRESS``) only the latter, as this machine's devices are not the run's.

    Raises:
      MemoryPlanError: a device's total exceeds its memory (a ``ConfigError``, naming the
        device, its largest item, the numbers and what to change).
      ConfigError: the mesh or the optimizer settings do not fit the model.
    """
    local = not os.environ.get("RAY_ADDRESS")
    if not local and not cfg.run.device_memory_gib:
        say(
            "memory plan: not checked, the devices are the cluster's (RAY_ADDRESS); set "
            "run.device_memory_gib to check it, or run `raytunix plan` on a device host"
        )
        return
    probe = None
    if local:  # a CPU-only driver opens no accelerator: no child process needed
        cpu_only = os.environ.get("JAX_PLATFORMS", "") == "cpu" or not _accelerator_installed()
        probe = memory_plan.probe_devices() if cpu_only else memory_plan.probe_devices_elsewhere()
    plan = memory_plan.memory_plan(cfg, memory_plan.device_capacity(cfg, probe))
    plan.check()
    fullest, capacity = plan.fullest(), plan.capacity
    room = (
        f" of {memory_plan.gib(capacity.bytes)} ({capacity.source})"
        if capacity.bytes is not None
        else ", capacity unknown (set run.device_memory_gib to check it)"
    )
    say(
        f"memory plan: the {fullest.name} needs {memory_plan.gib(fullest.total)}{room}; "
        f"largest item {fullest.largest()} (`raytunix plan` prints every item)"
    )


# -- actors before the learner ---------------------------------------------------------------


def start_sandbox_pool(cfg: Config):
    """The run's sandbox actors, when its environment runs sandboxed tools (its class sets
    ``uses_sandbox``); their tools find them with ``raytunix.sandbox.connect()``. None
    otherwise.

    Raises:
      RunError: the actors are not placed within ``ENV_READY_TIMEOUT_S`` or cannot start.
    """
    if not getattr(env_class(cfg), "uses_sandbox", False):
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
            + (
                f" and the resource sandbox.resource={cfg.sandbox.resource!r}"
                if cfg.sandbox.resource
                else ""
            )
            + "?"
        ) from None
    except ray.exceptions.RayActorError as e:
        pool.shutdown()
        raise RunError(
            f"the sandbox actors could not start (sandbox.backend={cfg.sandbox.backend!r}): {e}"
        ) from None
    say(
        f"sandbox: {len(stats)} actors, backend {stats[0]['backend']}, isolation "
        f"{stats[0]['isolation']}"
    )
    return pool


def start_env_pool(cfg: Config) -> EnvPool:
    """The env actors, each with its environment built (``preflight.check_env_actors``).

    Raises:
      RunError: an environment cannot be built, or the actors are not placed in time.
    """
    env_pool = EnvPool(
        cfg.env.name,
        dict(cfg.env.kwargs),
        cfg.env.num_env_actors,
        max_restarts=cfg.env.env_actor_max_restarts,
        resources=dict(cfg.env.actor_resources),
        import_paths=import_paths(cfg),
    )
    try:
        run_preflight(preflight.check_env_actors, env_pool, ENV_READY_TIMEOUT_S)
    except BaseException:
        for actor in env_pool.actors:
            ray.kill(actor)
        raise
    return env_pool


def run_preflight(check, *args):
    """Runs a ``preflight`` check; its failure stops the run as a RunError (exit 2)."""
    try:
        return check(*args)
    except preflight.PreflightError as e:
        raise RunError(str(e)) from None


# -- tasks, tokenizer, prompts -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tasks:
    """The run's tasks: ``train`` (RL and the warm start's demonstrations), ``heldout``
    (evaluated before and after RL, ``eval.heldout_size`` of them), ``dev`` (the warm
    start's stop check: the last ``warmup.eval_size`` train tasks, not held out),
    ``source`` (where they came from, for the log) and ``dropped`` (tasks left out before
    training, by reason: ``overlong_prompt_train``, ``overlong_prompt_heldout``)."""

    train: list
    heldout: list
    dev: list
    source: str
    dropped: dict = dataclasses.field(
        default_factory=lambda: {"overlong_prompt_train": 0, "overlong_prompt_heldout": 0}
    )


def task_splits(cfg: Config, env_pool: EnvPool, dataset) -> Tasks:
    """``dataset`` (``(train, heldout)`` read from ``data.*`` already) if given, else the
    environment's own tasks (built in an env actor, as the environment is), else
    reasoning-gym ``data.dataset``.

    Raises:
      RunError: no held-out task is left, or the environment's tasks() fails or answers
        only one split, or ``data.source=env`` and the environment brings none, or
        reasoning-gym refuses the dataset's settings.
    """
    from raytunix.data.datasets import DatasetError
    from raytunix.data.tasks import generator_splits

    d = cfg.data
    if dataset is not None:
        where = d.path if d.source != "reasoning_gym" else d.dataset
        if not dataset[1]:
            raise RunError(
                f"data.source={d.source} {where}: no held-out task is left once "
                "those whose question is also in train are dropped; give another "
                "held-out split (data.heldout_path / data.heldout_split) or none, "
                "to hold out rows of the training split."
            )
        return _tasks(cfg, dataset[0], dataset[1], f"{d.source} {where}")
    actor = env_pool.actors[0]
    try:
        own = ray.get(
            [
                actor.tasks.remote(split, size, d.seed)
                for split, size in (("train", d.train_size), ("heldout", d.heldout_size))
            ]
        )
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else e
        raise RunError(
            f"environment {cfg.env.name!r} failed to make its tasks: "
            f"{type(cause).__name__}: {cause}"
        ) from None
    if own[0] is not None:
        if own[1] is None:
            raise RunError(
                f"environment {cfg.env.name!r} brings train tasks but none for "
                "'heldout'; its tasks() must answer both splits."
            )
        return _tasks(cfg, own[0], own[1], "the environment's own")
    if d.source == "env":
        raise RunError(
            f"data.source=env but environment {cfg.env.name!r} brings no tasks "
            "(its tasks() returns None); set data.source to a dataset."
        )
    try:
        train, heldout = generator_splits(d)
    except DatasetError as e:  # reasoning-gym refused the settings it was built with
        keys = "data.dataset_kwargs" if d.dataset_kwargs else "the data.min_*/max_* keys"
        raise RunError(f"data.dataset={d.dataset!r}: {e}; change {keys}.") from None
    return _tasks(cfg, train, heldout, f"reasoning-gym {d.dataset}")


def _tasks(cfg: Config, train, heldout, source: str) -> Tasks:
    return Tasks(
        train=train,
        heldout=heldout[: cfg.eval.heldout_size],
        dev=train[-cfg.warmup.eval_size :],
        source=source,
    )


def run_tokenizer(cfg: Config, run: RunDir, train_tasks) -> Tokenizer:
    """``model.path``'s tokenizer; else the run's ``tokenizer.json`` if it has one (a
    resumed run, or a ``model.init_from`` run, which copies the earlier run's there first);
    else one trained on the train tasks (and a ``warmup.demonstrations`` file's
    conversations) and saved there.

    Raises:
      RunError: ``model.path``'s tokenizer is missing or bad, or the folder has no chat
        template and ``env.agent_kwargs`` names none; or the run has a checkpoint but
        lost its tokenizer.json; or the demonstrations file is bad.
    """
    if cfg.model.path:  # the model's own tokenizer; nothing to train or save
        return _folder_tokenizer(cfg)
    copy_tokenizer(cfg, run)  # model.init_from's, which its weights' ids are of
    if os.path.exists(run.tokenizer):
        return Tokenizer.load(run.tokenizer)
    if run.has_rl_checkpoint() or os.path.isdir(run.warmup):
        raise RunError(
            f"{run.tokenizer} is missing but the run has checkpoints made with it; "
            "restore the file or start a new run."
        )
    import itertools

    from raytunix.data.demonstrations import tokenizer_corpus
    from raytunix.models.chat_template import render_chat

    corpus: Any = tokenizer_corpus(train_tasks[:3000])
    w = cfg.warmup
    if w.enabled and w.demonstrations and w.source in ("auto", "file"):
        # The file's replies are what the warm start teaches: tokens of their own.
        rows = _file_demonstrations(w.demonstrations, tell=False).rows[:3000]
        corpus = itertools.chain(
            corpus, (render_chat(m, add_generation_prompt=False) for _, m in rows)
        )
    tokenizer = Tokenizer.train(corpus, cfg.model.tokenizer_vocab_size)
    tokenizer.save(run.tokenizer)
    return tokenizer


def _folder_tokenizer(cfg: Config) -> Tokenizer:
    from raytunix.models.chat_template import (
        ChatTemplateError,
        chat_template_from_folder,
    )

    path = cfg.model.path
    try:
        tokenizer = Tokenizer.from_folder(path)
        if "chat_template" not in cfg.env.agent_kwargs:
            chat_template_from_folder(path)
    except (OSError, ValueError) as e:  # ChatTemplateError is a ValueError
        hint = (
            " Set env.agent_kwargs.chat_template to a built-in template whose tokens "
            "the model's tokenizer has (chatml, llama3, gemma)."
            if isinstance(e, ChatTemplateError)
            else ""
        )
        raise RunError(f"model.path={path!r}: {e}{hint}") from None
    return tokenizer


def check_prompts(cfg: Config, env_pool: EnvPool, tasks: Tasks, tokenizer: Tokenizer) -> Tasks:
    """Length-checks every train and held-out task's first prompt in tokens
    (``preflight.check_prompt_lengths``: samples exactly, every question in one tokenizer
    batch, flagged ones exactly) and logs the sampled lengths.

    Returns:
      ``tasks``, or with ``data.overlong_prompts=drop`` a copy without the tasks whose
      prompt leaves no room for a reply, ``dropped`` counting them per split.

    Raises:
      RunError: a prompt does not fit ``model.max_seq_len`` and ``data.overlong_prompts``
        is ``error`` (the tasks are named, with their rows), or dropping them leaves a
        split empty; or see ``preflight.prompt_lengths``.
    """
    limit = cfg.model.max_seq_len
    samples = preflight.sample_tasks(tasks.train, 24) + preflight.sample_tasks(tasks.heldout, 8)
    check = run_preflight(
        preflight.check_prompt_lengths,
        env_pool,
        [*tasks.train, *tasks.heldout],
        samples,
        lambda: new_agent(cfg, tokenizer),
        tokenizer,
        limit,
    )
    _say_prompt_lengths(cfg, tasks, check)
    if not check.too_long:
        return tasks
    too_long = {id(t) for t, _ in check.too_long}
    train = [t for t in tasks.train if id(t) not in too_long]
    heldout = [t for t in tasks.heldout if id(t) not in too_long]
    dropped = {
        "overlong_prompt_train": len(tasks.train) - len(train),
        "overlong_prompt_heldout": len(tasks.heldout) - len(heldout),
    }
    if cfg.data.overlong_prompts == "drop" and train and heldout:
        say(
            f"data.overlong_prompts=drop: left out {dropped['overlong_prompt_train']} train "
            f"and {dropped['overlong_prompt_heldout']} held-out tasks whose first prompt leaves "
            f"no room for a reply in model.max_seq_len={limit} tokens "
            f"({_named(check.too_long)})"
        )
        return dataclasses.replace(
            tasks,
            train=train,
            heldout=heldout,
            dev=train[-cfg.warmup.eval_size :],
            dropped={**tasks.dropped, **dropped},
        )
    raise _overlong_prompts_error(cfg, tasks, tokenizer, check, train, heldout, dropped)


def _say_prompt_lengths(cfg: Config, tasks: Tasks, check: preflight.PromptCheck) -> None:
    """Logs the env's readiness, the tasks and the sampled prompt lengths in tokens."""
    limit = cfg.model.max_seq_len
    sizes = check.sample_tokens
    say(
        f"env {cfg.env.name!r} ready on {cfg.env.num_env_actors} actors; tasks: {tasks.source} "
        f"({len(tasks.train)} train, {len(tasks.heldout)} held out); "
        f"prompts {sizes[0]}-{sizes[-1]} tokens on {len(sizes)} samples (context {limit}); "
        f"all {len(tasks.train) + len(tasks.heldout)} length-checked, "
        f"{check.measured_exactly} through the environment"
        + (
            " (the rest by question tokens)"
            if check.bound_applies
            else " (its first observation does not hold the task's question, so no bound applies)"
        )
    )


def _overlong_prompts_error(
    cfg: Config,
    tasks: Tasks,
    tokenizer: Tokenizer,
    check: preflight.PromptCheck,
    train: list,
    heldout: list,
    dropped: dict[str, int],
) -> RunError:
    """The error that stops a run whose prompts leave no room for a reply: ``dropped``'s
    counts per split (``train`` and ``heldout`` are what is left without those tasks), the
    first tasks named, the longest prompt, and the fix (``data.overlong_prompts=drop``,
    unless dropping is what emptied a split; a larger vocabulary for a run-trained
    tokenizer)."""
    limit = cfg.model.max_seq_len
    sizes = check.sample_tokens
    worst = max(n for _, n in check.too_long)
    emptied = [name for name, kept in (("train", train), ("held-out", heldout)) if not kept]
    hint = (
        f"The model's tokenizer has {tokenizer.vocab_size} ids."
        if cfg.model.path
        else f"The run's tokenizer has {tokenizer.vocab_size} ids; a small vocabulary spends "
        "about a token per byte, so a larger model.tokenizer_vocab_size (the tokenizer "
        "is trained on the run's tasks) makes prompts shorter."
    )
    fix = (
        f"every {' and '.join(emptied)} task would be dropped, so the run cannot train. "
        if cfg.data.overlong_prompts == "drop"
        else "Or set data.overlong_prompts=drop to leave them out (counted in summary.json). "
    )
    return RunError(
        f"{dropped['overlong_prompt_train']} of {len(tasks.train)} train and "
        f"{dropped['overlong_prompt_heldout']} of {len(tasks.heldout)} held-out tasks have a "
        f"first prompt that leaves no room for a reply in model.max_seq_len={limit} tokens: "
        f"{_named(check.too_long)}; the longest has {worst} tokens (sampled prompts are "
        f"{sizes[0]}-{sizes[-1]}). Raise model.max_seq_len above {worst} plus the reply "
        "length (rollout.max_new_tokens), or shorten those prompts (the task text, the "
        f"environment's first observation, the system prompt). {fix}{hint}"
    )


def _named(too_long, shown: int = 8) -> str:
    """``task 'train-000137' (row 137, 10013 tokens), ...`` for the first ``shown`` of
    ``(task, prompt tokens)``; the row is a dataset file's (``metadata["row"]``)."""

    def one(task, n):
        row = task.metadata.get("row") if isinstance(task.metadata, dict) else None
        where = f"row {row}, " if row is not None else ""
        return f"task {task.task_id!r} ({where}{n} tokens)"

    names = ", ".join(one(t, n) for t, n in too_long[:shown])
    return names + (f", and {len(too_long) - shown} more" if len(too_long) > shown else "")


@dataclasses.dataclass(frozen=True)
class Demonstrations:
    """The warm start's conversations: ``kind`` (``file``, ``expert`` or ``arithmetic``:
    ``warmup.source``'s choices but ``rejection``, which ``steps.rejection_arrays`` makes), ``rows`` of ``(task, messages)`` (messages as
    ``ConversationAgentBase.render_demonstration`` takes them) and ``where`` (the file
    or the environment, for messages)."""

    kind: str
    rows: list[tuple[Any, list[dict[str, str]]]]
    where: str


NO_WARM_START = (
    "give warmup.demonstrations=FILE (chat-format .jsonl or .parquet with a messages column), "
    "use an environment whose demonstrate(task) expert covers these tasks, or train on "
    "arithmetic tasks (the synthetic calculator demonstrations)"
)


def no_warm_start_advice(cfg: Config) -> str:
    """What gives a run with no demonstrations a warm start (``NO_WARM_START``, or for
    agent programs the two sources that fit a program's own conversation)."""
    if program_settings(cfg) is None:
        return NO_WARM_START
    return (
        "an agent program's episodes are its own conversations, so give "
        "warmup.demonstrations=FILE (chat-format .jsonl or .parquet, the messages as your "
        "program sends them) or warmup.source=rejection (the run's own successful episodes)"
    )


def warm_start_demonstrations(cfg: Config, tasks, env_pool: EnvPool) -> Demonstrations | None:
    """The warm start's demonstrations by ``warmup.source``: ``auto`` takes the file
    (``warmup.demonstrations``) if given, else the environment's expert episodes on
    ``tasks`` (``BaseEnv.demonstrate``, played in the env actors), else the synthetic
    calculator ones for arithmetic tasks unless the episodes are agent programs (whose
    conversations are their own); None when ``warmup.enabled`` is off or none
    applies. Deterministic in ``run.seed`` (and the environment's expert).

    Raises:
      RunError: the file cannot be read or a row is bad (``DemonstrationError``'s
        message); ``warmup.source`` names a source that has nothing for these tasks; the
        expert raised.
    """
    w = cfg.warmup
    if not w.enabled:
        return None
    if w.source == "rejection":
        raise ValueError("warmup.source=rejection samples episodes: steps.rejection_arrays")
    if w.source in ("auto", "file") and w.demonstrations:
        return _file_demonstrations(w.demonstrations)
    if w.source in ("auto", "expert"):
        found = _expert_demonstrations(cfg, tasks, env_pool)
        if found is not None or w.source == "expert":
            if found is None:
                raise RunError(
                    f"warmup.source=expert but environment {cfg.env.name!r} has no expert "
                    f"episode for any of {len(tasks)} train tasks (its demonstrate(task) "
                    f"returns None); {NO_WARM_START}."
                )
            return found
    from raytunix.data.tasks import is_arithmetic

    if w.source == "auto" and program_settings(cfg) is not None:
        # The calculator demonstrations teach the calculator agent's conversation; a
        # program writes its own (its prompts, its tool schemas), which they would not fit.
        return None
    if not is_arithmetic(tasks):
        if w.source == "arithmetic":
            raise RunError(
                "warmup.source=arithmetic but the tasks are not arithmetic (no string "
                f"metadata['expression']); {NO_WARM_START}."
            )
        return None
    return arithmetic_demonstrations(cfg, tasks)


def arithmetic_demonstrations(cfg: Config, tasks) -> Demonstrations:
    """The synthetic calculator demonstrations of arithmetic ``tasks``
    (``raytunix.data.demonstrations``): with the tool by ``warmup.tool_use_prob_*`` where
    the environment has it, else answered at once; deterministic in ``run.seed``."""
    from raytunix.data.demonstrations import sample_demonstrations

    w = cfg.warmup
    probs = (
        {2: w.tool_use_prob_2_terms, 3: w.tool_use_prob_3_terms}
        if uses_tools(cfg)
        else {n: 0.0 for n in range(1, 10)}
    )
    demos = sample_demonstrations(tasks, random.Random(cfg.run.seed), probs)
    return Demonstrations("arithmetic", list(zip(tasks, demos)), "synthetic arithmetic")


def _file_demonstrations(path: str, tell: bool = True) -> Demonstrations:
    from raytunix.data.demonstration_file import DemonstrationError, read_demonstrations
    from raytunix.types import Task

    try:
        found = read_demonstrations(path)
    except DemonstrationError as e:
        raise RunError(str(e)) from None
    if found.system_replaced and tell:
        say(
            f"warm start: {found.system_replaced} rows of {path} start with a system message; "
            "the agent's own system prompt (what RL shows the model) is used instead"
        )
    rows = [
        (Task(f"demonstration-{row}", messages[0]["content"], "", {"row": row}), messages)
        for row, messages in zip(found.rows, found.conversations)
    ]
    return Demonstrations("file", rows, path)


def _expert_demonstrations(cfg: Config, tasks, env_pool: EnvPool) -> Demonstrations | None:
    """The env actors' expert episodes on ``tasks``, split over the actors; None when
    there is none."""
    actors = env_pool.actors
    share = -(-len(tasks) // len(actors))
    chunks = [list(tasks[i : i + share]) for i in range(0, len(tasks), share)]
    refs = [actor.demonstrations.remote(chunk) for actor, chunk in zip(actors, chunks)]
    try:
        episodes = [m for part in ray.get(refs) for m in part]
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else e
        raise RunError(
            f"environment {cfg.env.name!r}'s expert (demonstrate) failed: "
            f"{type(cause).__name__}: {cause}; fix it, or set warmup.source to another source "
            "(or warmup.enabled=false)."
        ) from None
    rows = [(t, m) for t, m in zip(tasks, episodes) if m is not None]
    if not rows:
        return None
    return Demonstrations("expert", rows, f"environment {cfg.env.name!r}'s expert")


def demonstration_arrays(
    cfg: Config, demos: Demonstrations, tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """``demos`` rendered through the agent's own token path
    (``render_demonstration``): ``(tokens int32[N, T], loss_mask float32[N, T],
    dropped)``, right-padded with the pad id, T a multiple of 16, the mask 1 exactly on
    the assistant messages' tokens (and their end-of-turn token). Left out, counted in
    ``dropped``: ``too_long`` (over ``model.max_seq_len`` tokens) and ``unparseable``
    (an assistant message the run's agent parses as a format error, so RL would score
    it as one).

    Raises:
      RunError: no demonstration is left, naming why (and the rows of a file).
    """
    agent = new_agent(cfg, tokenizer)
    limit = cfg.model.max_seq_len
    rows, lengths = [], []
    dropped = {"too_long": 0, "unparseable": 0}
    first_bad: str = ""
    for task, messages in demos.rows:
        bad = next(
            (
                m["content"]
                for m in messages
                if m["role"] == "assistant" and agent.parse(m["content"]).parse_error
            ),
            None,
        )
        if bad is not None:
            dropped["unparseable"] += 1
            first_bad = first_bad or f"{task.task_id}: {bad[:80]!r}"
            continue
        ids, m = agent.render_demonstration(task, messages)
        lengths.append(len(ids))
        if len(ids) > limit:
            dropped["too_long"] += 1
            continue
        rows.append((ids, m))
    if not rows:
        raise RunError(_none_left(cfg, demos, dropped, lengths, first_bad))
    return (*padded_arrays(rows, tokenizer.pad_id), dropped)


def padded_arrays(rows, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` of ``(token_ids, loss_mask)`` as ``(tokens int32[N, T], loss_mask
    float32[N, T])``, right-padded with ``pad_id`` (mask 0), T the longest row rounded up
    to a multiple of 16 (few shapes to compile)."""
    width = -(-max(len(r[0]) for r in rows) // 16) * 16
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for i, (ids, m) in enumerate(rows):
        tokens[i, : len(ids)] = ids
        mask[i, : len(m)] = m
    return tokens, mask


def _none_left(cfg, demos, dropped, lengths, first_bad) -> str:
    why = []
    if dropped["too_long"]:
        why.append(
            f"{dropped['too_long']} are longer than model.max_seq_len={cfg.model.max_seq_len} "
            f"tokens (shortest: {min(lengths)}); raise model.max_seq_len or shorten them"
        )
    if dropped["unparseable"]:
        why.append(
            f"{dropped['unparseable']} have an assistant message the agent "
            f"({agent_name(cfg)!r}) cannot parse (first: {first_bad}); write the replies in "
            "its action format"
        )
    return (
        f"no warm-start demonstration from {demos.where} is usable: of {len(demos.rows)}, "
        + "; ".join(why)
        + "."
    )
