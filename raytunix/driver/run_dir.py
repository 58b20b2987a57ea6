"""The run directory: its files, a new one per run, the config a resumed run keeps, and
what a stopped run left to resume from.

    RUN_DIR/config.yaml       the run's config (a resume may change only RESUME_OVERRIDABLE)
    RUN_DIR/tokenizer.json    the trained tokenizer (runs without model.path)
    RUN_DIR/metrics.jsonl     one JSON record per warm-start check, RL step and evaluation
    RUN_DIR/warmup/           the warm start's latest checkpoint (orbax; SFT state + steps)
    RUN_DIR/checkpoints/      the RL checkpoints (orbax; learner state + orchestrator state)
    RUN_DIR/state.json        the newest committed RL checkpoint's step and data position
    RUN_DIR/export/           the trained policy, Hugging Face layout (model.path runs)
    RUN_DIR/adapter/          LoRA model.path runs: the adapters as a peft folder
                              (``raytunix export-adapter`` writes it from a checkpoint)
    RUN_DIR/summary.json      written once the run ends
    RUN_DIR/samples.jsonl     a few whole episodes of each RL step, decoded (``raytunix.samples``)
    RUN_DIR/env_errors.jsonl  the first error of each kind from the environment's code
                              (an ``EnvErrorReport`` a line: kind, env class, task id,
                              file:line, traceback); later ones are counted, not kept
    RUN_DIR/driver.lock       held (flock) by the driver running the run; the kernel frees it
                              when that process ends, however it ends
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Sequence
from typing import Any

import yaml

from raytunix.config import (
    Config,
    ConfigError,
    apply_override,
    config_from_dict,
    load_yaml,
    resumable_keys,
    validate,
)
from raytunix.profiling.collect import append_jsonl
from raytunix.samples import SampleLog


class RunError(RuntimeError):
    """The run cannot go on; the message says why and what to do (checkpoints are kept)."""


def say(msg: str) -> None:
    """Prints a progress line of the driver, time-stamped."""
    print(f"[raytunix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class RunDir:
    """The files of one run (see the module docstring); creates ``path`` if missing."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        self.config = os.path.join(self.path, "config.yaml")
        self.tokenizer = os.path.join(self.path, "tokenizer.json")
        self.metrics = os.path.join(self.path, "metrics.jsonl")
        self.warmup = os.path.join(self.path, "warmup")  # the warm start's progress
        self.checkpoints = os.path.join(self.path, "checkpoints")
        self.reference = os.path.join(self.path, "reference")  # KL reference policy, if any
        self.export = os.path.join(
            self.path, "export"
        )  # the trained policy in HF layout (model.path runs)
        self.adapter = os.path.join(self.path, "adapter")  # LoRA runs: peft's adapter folder
        self.summary = os.path.join(self.path, "summary.json")
        self.state = os.path.join(self.path, "state.json")
        self.env_errors = os.path.join(self.path, "env_errors.jsonl")
        self.samples = SampleLog(self.path)  # RUN_DIR/samples.jsonl
        self.sinks = None  # profiling.sinks.MetricSinks once the run starts its actors
        self.checkpoint_in_flight: dict[str, Any] | None = None  # state.json once it commits
        self.lock_file = os.path.join(self.path, "driver.lock")
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Takes the run for this process (an exclusive ``flock`` on driver.lock, which
        names the holder), so that two drivers never write one run's checkpoints.

        Raises:
          RunError: another process runs it (named by pid and host).
        """
        if self._lock_fd is not None:
            return
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunError(
                f"{self.path} is being run by {holder}; two drivers would overwrite each "
                "other's checkpoints. Wait for that run to end or stop it (Ctrl-C), then "
                "--resume."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        """Gives the run back (also done by the kernel when the process ends)."""
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    close = unlock  # for contextlib.closing: the run is given back when train() ends

    def running_driver(self) -> str | None:
        """Who runs the run now (``"pid N on HOST"``), or None when no process holds it."""
        if self._lock_fd is not None:
            return f"pid {os.getpid()} on {socket.gethostname()}"
        if not os.path.exists(self.lock_file):
            return None
        fd = os.open(self.lock_file, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 200).decode(errors="replace").strip() or "another process"
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def log(self, record: dict[str, Any]) -> None:
        """Appends ``record`` to metrics.jsonl and hands it to the other metric sinks
        (TensorBoard, Ray metrics, the console view); ``time`` (unix s) is now unless the
        record has its own."""
        record = dict(record)
        record.setdefault("time", time.time())
        append_jsonl(self.metrics, [json.dumps(record) + "\n"])
        if self.sinks is not None:
            self.sinks.write(record)

    def record_env_errors(self, reports: Sequence[dict[str, Any]]) -> None:
        """Appends each ``EnvErrorReport`` (as JSON, ``raytunix.envs.contract``) to
        env_errors.jsonl and prints it with its traceback: the first error of its kind;
        the run goes on, and later errors of the kind are only counted (the step's
        ``env_errors/<kind>``, the summary's ``env_errors_by_kind``)."""
        if not reports:
            return
        append_jsonl(
            self.env_errors, [json.dumps(dict(r, time=time.time())) + "\n" for r in reports]
        )
        for r in reports:
            trace = "".join(f"    {line}\n" for line in r.get("traceback", "").splitlines())
            say(
                f"env error {r['kind']} (first of its kind; the episode ends as env_error, "
                f"the run goes on, later ones are counted; kept in {self.env_errors}):\n"
                f"  env {r['env_class']}, task {r['task_id']!r}, at {r['location']}\n"
                f"  {r['message']}\n{trace}".rstrip()
            )

    def read_state(self) -> dict[str, Any]:
        """state.json: ``{"checkpoint_step", "data_position"}`` of the newest committed RL
        checkpoint; {} before the first."""
        if not os.path.exists(self.state):
            return {}
        with open(self.state) as f:
            return json.load(f)

    def write_state(self, state: dict[str, Any]) -> None:
        tmp = self.state + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=2)
        os.replace(tmp, self.state)

    def commit_checkpoint_in_flight(self) -> None:
        """The learner has finished the checkpoint in flight (``checkpoint_in_flight``):
        state.json names it now, and none is in flight.

        Raises:
          OSError: state.json cannot be written (the checkpoint stays in flight).
        """
        if self.checkpoint_in_flight is not None:
            self.write_state(self.checkpoint_in_flight)
            self.checkpoint_in_flight = None

    def write_config(self, cfg: Config) -> None:
        with open(self.config, "w") as f:
            f.write(cfg.to_yaml())

    def has_rl_checkpoint(self) -> bool:
        """Whether an RL checkpoint was committed: state.json names one, or checkpoints/
        holds a step directory (orbax renames ``<step>.orbax-checkpoint-tmp-*`` to
        ``<step>`` only once every file is written; a run killed between that and
        state.json still resumes from it)."""
        if "checkpoint_step" in self.read_state():
            return True
        return has_steps(self.checkpoints)


def has_steps(directory: str) -> bool:
    """Whether the orbax directory ``directory`` holds a committed step (a ``<step>``
    subdirectory; one still being written is ``<step>.orbax-checkpoint-tmp-*``)."""
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def new_run_dir(cfg: Config) -> RunDir:
    """``run.output_dir/<run.name>-<date-time>[-n]``, created.

    Raises:
      ConfigError: ``run.output_dir`` cannot be created.
    """
    try:
        os.makedirs(cfg.run.output_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"run.output_dir={cfg.run.output_dir!r} cannot be created ({e.strerror}); pass a "
            "writable directory."
        ) from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(cfg.run.output_dir, f"{cfg.run.name}-{stamp}")
    suffix = 1
    while os.path.exists(path):
        path = os.path.join(cfg.run.output_dir, f"{cfg.run.name}-{stamp}-{suffix}")
        suffix += 1
    return RunDir(path)


# What a resumed run may change: the settings declared resume=True in raytunix/config.py.
RESUME_OVERRIDABLE = resumable_keys()


def load_run_config(
    run_dir: str, overrides: Sequence[str] = (), schema: type[Config] = Config
) -> Config:
    """The config a run was started with (``RUN_DIR/config.yaml``), plus ``overrides``
    (``schema``: the config class, ``Config`` unless a test adds sections).

    Raises:
      FileNotFoundError: ``run_dir`` is not a raytunix run directory.
      ConfigError: the saved config is corrupt, or an override is bad: malformed, an
        unknown key (named with the valid ones, as for a new run), a bad value, or a key
        the checkpoint depends on (one not declared ``resume=True``).
    """
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{run_dir!r} has no config.yaml, so it is not a raytunix run directory; pass the "
            "directory `raytunix train` printed at start (under runs/)."
        )
    with open(path) as f:
        try:
            tree = load_yaml(f.read())
        except yaml.YAMLError as e:
            raise ConfigError(
                f"{path} is not valid YAML ({e}); restore it from a copy or start a new run."
            ) from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} does not hold a config mapping; restore it or start a new run.")
    cfg = config_from_dict(tree, schema)
    resumable = resumable_keys(schema)
    saved = cfg.to_dict()  # the run's own values, which an override may repeat
    for item in overrides:
        key = apply_override(cfg, item)  # an unknown key is reported as unknown
        section, name = key.split(".", 1)
        unchanged = cfg.to_dict()[section][name] == saved[section][name]
        if key not in resumable and not unchanged:  # the run's own value may be repeated
            raise ConfigError(
                f"{key} cannot change when resuming (the checkpoint depends on it; the run "
                f"has {key}={saved[section][name]!r}); `raytunix config --explain` says of "
                "each key whether a resume may change it."
            )
    return validate(cfg)


@contextlib.contextmanager
def removed_if_left_empty(run: RunDir, new: bool):
    """When a new run fails before it has written more than its config and tokenizer (an
    environment that cannot be built, a prompt that does not fit...), its directory goes,
    so runs/ holds only runs that got somewhere; the error propagates unchanged. A resumed
    run's directory (``new=False``) always stays."""
    try:
        yield
    except BaseException:
        leftovers = set(os.listdir(run.path)) if os.path.isdir(run.path) else set()
        if new and leftovers <= {
            os.path.basename(run.config),
            os.path.basename(run.tokenizer),
            os.path.basename(run.lock_file),
        }:
            shutil.rmtree(run.path, ignore_errors=True)
            say(f"run directory {run.path} removed: the run stopped before it trained")
        raise
