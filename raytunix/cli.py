"""raytunix command line.

raytunix train [--config PRESET|FILE] [section.key=value ...]
raytunix train --resume RUN_DIR [learner.rl_steps=N ...]
raytunix config [--config PRESET|FILE] [section.key=value ...]
raytunix config --explain [SECTION|KEY] [--markdown]   each setting: type, default, bounds, doc
raytunix plan [--config PRESET|FILE] [section.key=value ...] [--device-memory GIB] [--json]
                                       bytes per device of a run; exit 2 if it cannot fit
raytunix profile RUN_DIR [--out DIR]   report.txt, trace.json and profile.png of a run, again
raytunix submit [--address ADDR] [--config PRESET|FILE] [section.key=value ...]
raytunix status [--address ADDR] [JOB_ID]
raytunix scale RUN_DIR --env-actors N [--sandbox-actors M]   resize a running run's pools
raytunix eval RUN_DIR [--env NAME] [--k N] [--episodes N] [--temperature T] [--json]
raytunix samples RUN_DIR [--step N] [--json]   a run's logged episodes of an RL step, decoded
raytunix export-adapter RUN_DIR [--out DIR]    a LoRA run's adapters as a peft folder
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from raytunix.config import ConfigError, load_config, preset_names


def _parser() -> argparse.ArgumentParser:
    """The ``raytunix`` argument parser: one subcommand per verb, in the order ``--help``
    lists them."""
    parser = argparse.ArgumentParser(
        prog="raytunix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_config(sub)
    _add_plan(sub)
    _add_profile(sub)
    _add_submit(sub)
    _add_status(sub)
    _add_scale(sub)
    _add_eval(sub)
    _add_samples(sub)
    _add_export_adapter(sub)
    return parser


def _add_train(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix train``: a preset or file, or ``--resume RUN_DIR``, and overrides."""
    train = sub.add_parser(
        "train",
        help="warm start, then asynchronous GRPO on Ray; prints a summary",
        description="Runs the main job on local Ray (or the cluster in RAY_ADDRESS).",
    )
    train.add_argument(
        "--config",
        help=f"a preset ({', '.join(preset_names())}) or a YAML "
        "file (default: default); not with --resume",
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped run (from its newest checkpoint, or its warm "
        "start's) with the run's own config (overrides apply on top, e.g. "
        "learner.rl_steps=80)",
    )
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. rollout.max_concurrent_episodes=64",
    )


def _add_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix config``: the resolved config as YAML, or ``--explain`` of settings."""
    show = sub.add_parser(
        "config",
        help="print the resolved config as YAML, or explain settings",
        description="Prints the config a run would use, as YAML; with "
        "--explain, what each setting is.",
    )
    show.add_argument(
        "--explain",
        nargs="?",
        const="",
        metavar="SECTION|KEY",
        help="print each setting's key, type, default, bounds or choices, "
        "whether --resume may change it, and its doc: all of them, a "
        "section's (e.g. rollout) or one (e.g. rollout.group_size)",
    )
    show.add_argument(
        "--markdown", action="store_true", help="with --explain: Markdown tables, one per section"
    )
    show.add_argument(
        "--config", default="default", help=f"a preset ({', '.join(preset_names())}) or a YAML file"
    )
    show.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. learner.rl_steps=20",
    )


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix plan``: a run's memory per device, checked against a device's memory
    (``raytunix.driver.memory_plan``)."""
    plan = sub.add_parser(
        "plan",
        help="print the memory a run needs on each device and whether it fits",
        description="Prints, for each device the config places work on, the bytes of the "
        "params, master weights, optimizer state, gradients, the update's new state, the KL "
        "reference, activations, engine weights and KV cache, the total and the device "
        "memory it was checked against; exits 2 when the run cannot fit (as `raytunix "
        "train` would stop before it starts). Allocates nothing.",
    )
    plan.add_argument(
        "--config", default="default", help=f"a preset ({', '.join(preset_names())}) or a YAML file"
    )
    plan.add_argument(
        "--device-memory",
        type=_positive(float),
        default=0.0,
        metavar="GIB",
        help="one device's memory in GiB (default: run.device_memory_gib, else measured: the "
        "device's bytes_limit, on CPU the host's available memory)",
    )
    plan.add_argument(
        "--devices",
        type=_positive(int),
        metavar="N",
        help="the learner's devices on all its hosts, for a learner.mesh_* of -1 (default: "
        "this machine's x learner.num_hosts)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. learner.micro_batch_size=8",
    )


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)``, refused unless > 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return parse


def _add_profile(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix profile RUN_DIR``: a run's trace, report and plots, made again."""
    profile = sub.add_parser(
        "profile",
        help="write a run's trace.json, report.txt and profile.png again",
        description="Makes the Perfetto trace (open it at ui.perfetto.dev), the bottleneck "
        "report and the plots of a run from its files, and prints the report. "
        "Works on a run that is still going or one that crashed.",
    )
    profile.add_argument("run_dir", metavar="RUN_DIR", help="a run directory under runs/")
    profile.add_argument(
        "--out",
        metavar="DIR",
        help="write the three files here instead of into RUN_DIR (for a "
        "run directory you cannot write to)",
    )


def _add_submit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix submit``: ``raytunix train`` as a Ray job on a cluster."""
    submit = sub.add_parser(
        "submit",
        help="run `raytunix train` as a Ray job on a cluster and follow its logs",
        description="Validates the config here, ships the working dir to the cluster and runs "
        "`raytunix train` there as a Ray job; prints its logs until it ends (Ctrl-C "
        "stops the job) and exits with its status. See deploy/README.md.",
    )
    submit.add_argument(
        "--address",
        help="the job server, http://HEAD:8265 (default: "
        "RAY_API_SERVER_ADDRESS, else the local head)",
    )
    submit.add_argument(
        "--config",
        default="default",
        help=f"a preset ({', '.join(preset_names())}) or a YAML file inside the working dir",
    )
    submit.add_argument(
        "--working-dir",
        default=".",
        help="directory shipped to the cluster, less runs/, .git and caches",
    )
    submit.add_argument(
        "--no-follow", action="store_true", help="print the job id and return once it is submitted"
    )
    submit.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. learner.rl_steps=200",
    )


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix status [JOB_ID]``: the cluster's raytunix jobs, or one of them."""
    status = sub.add_parser(
        "status",
        help="list the cluster's raytunix jobs, or show one",
        description="Lists raytunix jobs on a cluster, or shows one job's "
        "status, times, entrypoint and run directory.",
    )
    status.add_argument(
        "--address",
        help="the job server, http://HEAD:8265 (default: "
        "RAY_API_SERVER_ADDRESS, else the local head)",
    )
    status.add_argument("job_id", nargs="?", metavar="JOB_ID", help="one job to show")


def _add_scale(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix scale RUN_DIR``: resize a running run's actor pools."""
    scale = sub.add_parser(
        "scale",
        help="grow or shrink a running run's env (and sandbox) actor pools",
        description="Writes RUN_DIR/scale.json; the run applies it before its next RL step: "
        "new actors take episodes once ready, removed ones finish theirs first.",
    )
    scale.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a running run")
    scale.add_argument("--env-actors", metavar="N", help="env actors wanted (>= 1)")
    scale.add_argument("--sandbox-actors", metavar="M", help="sandbox actors wanted (>= 1)")


def _add_eval(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix eval RUN_DIR``: held-out episodes of a run's newest RL checkpoint
    (``raytunix.driver.evaluate_run``)."""
    ev = sub.add_parser(
        "eval",
        help="a run's newest RL checkpoint on held-out tasks: success, mean reward, pass@k",
        description="Greedy and sampled episodes on the held-out tasks of the run's env (or "
        "of each --env, same tokenizer); prints a per-env table and writes "
        "RUN_DIR/eval/summary.json. Success: episode reward >= 1.0.",
    )
    ev.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with an RL checkpoint")
    ev.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME",
        help="env.name to evaluate on instead of the run's (repeat for several)",
    )
    ev.add_argument("--k", type=int, default=1, metavar="N", help="pass@k's k (default 1)")
    ev.add_argument(
        "--episodes",
        type=int,
        metavar="N",
        help="sampled episodes per task (>= k; default max(k, 4))",
    )
    ev.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="temperature of the sampled episodes (default 1.0)",
    )
    ev.add_argument("--json", action="store_true", help="print the summary as JSON at the end")


def _add_samples(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix samples RUN_DIR``: the episodes a run logged of one RL step
    (``raytunix.samples``)."""
    samples = sub.add_parser(
        "samples",
        help="print the episodes a run kept of an RL step: what the model said, what it got",
        description="Prints RL step N's episodes from RUN_DIR/samples.jsonl (the best, the "
        "worst and random ones of its batch; run.samples_per_step): each message, the "
        "action parsed from each reply, the reward and the status.",
    )
    samples.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    samples.add_argument(
        "--step", type=int, metavar="N", help="the RL step (default: the last one logged)"
    )
    samples.add_argument("--json", action="store_true", help="print the step's line as JSON")


def _add_export_adapter(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``raytunix export-adapter RUN_DIR``: a LoRA run's adapters as a ``peft`` folder
    (``raytunix.driver.export_adapter``)."""
    export = sub.add_parser(
        "export-adapter",
        help="write a LoRA run's adapters (newest RL checkpoint) as a Hugging Face peft folder",
        description="Writes adapter_config.json and adapter_model.safetensors, which "
        "peft's PeftModel.from_pretrained loads over the run's model.path; the merged "
        "weights of a finished run are RUN_DIR/export.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a LoRA run directory (model.path)")
    export.add_argument(
        "--out", metavar="DIR", help="the folder to write (default RUN_DIR/adapter)"
    )


def _export_adapter(run_dir: str, out_dir: str | None) -> int:
    """``raytunix export-adapter``: 0 once written, 2 when the run has no adapters to
    export (the message says why and what to do)."""
    from raytunix.driver.export_adapter import export_run_adapters
    from raytunix.driver.run_dir import RunError

    try:
        out, step = export_run_adapters(run_dir, out_dir)
    except (FileNotFoundError, RunError, ConfigError) as e:
        print(f"raytunix: {e}", file=sys.stderr)
        return 2
    print(f"LoRA adapters of RL step {step} written to {out} (peft's layout)")
    return 0


def _samples(run_dir: str, step: int | None, as_json: bool) -> int:
    """``raytunix samples``: 0 once printed, 2 when the run or the step has no samples."""
    import json

    from raytunix.samples import SamplesError, format_step, step_samples

    try:
        record = step_samples(run_dir, step)
    except SamplesError as e:
        print(f"raytunix: {e}", file=sys.stderr)
        return 2
    print(
        json.dumps(record, indent=2) if as_json else format_step(record),
        end="\n" if as_json else "",
    )
    return 0


def _plan(cfg, args: argparse.Namespace) -> int:
    """``raytunix plan``: 0 when the run fits (or no capacity is known), 2 when it cannot
    fit or its model, mesh or optimizer cannot be planned."""
    import dataclasses
    import json

    # Opening a GPU backend takes most of its memory by default; the plan needs none.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from raytunix.driver import memory_plan

    try:
        capacity = memory_plan.device_capacity(cfg, memory_plan.probe_devices(), args.device_memory)
        if args.devices:
            capacity = dataclasses.replace(capacity, devices=args.devices)
        plan = memory_plan.memory_plan(cfg, capacity)
    except ConfigError as e:
        print(f"raytunix: config error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(memory_plan.format_plan(plan), end="")
    try:
        plan.check()
    except ConfigError as e:  # MemoryPlanError
        print(f"raytunix: config error: {e}", file=sys.stderr)
        return 2
    return 0


def _eval(args: argparse.Namespace) -> int:
    """``raytunix eval``: 0 once the summary is written, 2 for a bad request."""
    import json

    import ray

    from raytunix.driver.evaluate_run import evaluate_run
    from raytunix.driver.run_dir import RunError

    try:
        summary = evaluate_run(args.run_dir, args.env, args.k, args.episodes, args.temperature)
    except ConfigError as e:
        print(f"raytunix: config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, RunError, ValueError) as e:
        print(f"raytunix: {e}", file=sys.stderr)
        return 2
    finally:
        if ray.is_initialized():
            ray.shutdown()
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def _run_dir_problem(run_dir: str) -> str | None:
    """Why ``run_dir`` is not a run directory, with what to pass instead; None if it is."""
    if not os.path.exists(run_dir):
        return (
            f"{run_dir!r} does not exist; pass the run directory `raytunix train` printed at start."
        )
    if not os.path.isdir(run_dir):
        return f"{run_dir!r} is a file; pass the run directory that holds it."
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        return None
    runs = sorted(
        name
        for name in os.listdir(run_dir)
        if os.path.exists(os.path.join(run_dir, name, "metrics.jsonl"))
    )
    if runs:
        return (
            f"{run_dir!r} holds run directories, it is not one; pass one of them, e.g. "
            f"{os.path.join(run_dir, runs[-1])}"
        )
    return (
        f"{run_dir!r} has no metrics.jsonl, so it is not a run directory (or its run "
        "stopped before it logged anything)."
    )


def _profile(run_dir: str, out_dir: str | None) -> int:
    from raytunix.profiling import write_artifacts

    problem = _run_dir_problem(run_dir)
    if problem is None and out_dir is not None:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:  # a file in the way, no permission, a read-only place
            problem = (
                f"--out {out_dir!r} is not a directory and cannot be made ({e}); "
                "pass a directory you can write to."
            )
    if problem:
        print(f"raytunix: {problem}", file=sys.stderr)
        return 2
    artifacts = write_artifacts(run_dir, out_dir, log_errors=False)
    print(artifacts.get("report_text", ""), end="")
    for key in ("report_path", "trace_path", "plot_path"):
        if key in artifacts:
            print(f"wrote {artifacts[key]}")
    for name, why in artifacts["errors"].items():
        print(f"raytunix: {name} not written: {why}", file=sys.stderr)
    if any("Permission" in why or "Read-only" in why for why in artifacts["errors"].values()):
        where = f"--out {out_dir!r} is" if out_dir is not None else "the run directory is"
        print(
            f"raytunix: {where} not writable; pass --out DIR (a directory you can write "
            "to) to write elsewhere.",
            file=sys.stderr,
        )
    return 1 if artifacts["errors"] else 0


def _scale(run_dir: str, env_actors: str | None, sandbox_actors: str | None) -> int:
    from raytunix.cluster.scaling import ScaleRequestError, write_scale_request

    try:
        counts = [
            _whole_number(flag, value)
            for flag, value in (("--env-actors", env_actors), ("--sandbox-actors", sandbox_actors))
        ]
        request = write_scale_request(run_dir, *counts)
    except (ScaleRequestError, OSError) as e:
        print(f"raytunix: {e}", file=sys.stderr)
        return 2
    wanted = ", ".join(
        f"{n} {what} actors"
        for what, n in (("env", request.env_actors), ("sandbox", request.sandbox_actors))
        if n is not None
    )
    from raytunix.driver.run_dir import RunDir

    driver = RunDir(run_dir).running_driver()
    when = (
        f"the run ({driver}) applies it before its next RL step"
        if driver
        else "no driver runs it now: it is applied at the first RL step after `raytunix train "
        "--resume`"
    )
    print(
        f"asked {run_dir} for {wanted} (request {request.request_id}); {when}, and logged "
        "in metrics.jsonl (phase scale)."
    )
    return 0


def _explain(key: str, markdown: bool) -> int:
    from raytunix.config import explain

    try:
        print(explain(key, markdown=markdown), end="")
    except ConfigError as e:
        print(f"raytunix: {e}", file=sys.stderr)
        return 2
    return 0


def _whole_number(flag: str, value: str | None) -> int | None:
    from raytunix.cluster.scaling import ScaleRequestError

    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ScaleRequestError(
            f"{flag} {value!r} is not a whole number; pass an int >= 1."
        ) from None


# The commands that read (or resize) one run directory and need no config: exit status of each.
_RUN_DIR_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "samples": lambda a: _samples(a.run_dir, a.step, a.json),
    "export-adapter": lambda a: _export_adapter(a.run_dir, a.out),
    "profile": lambda a: _profile(a.run_dir, a.out),
    "scale": lambda a: _scale(a.run_dir, a.env_actors, a.sandbox_actors),
}


def _explain_extra_words(explained: str | None, words: list[str]) -> str:
    """The error for words after ``config --explain [KEY]``: more keys (say how to explain
    each) or overrides (say how to see their resolved values)."""
    keys = [w for w in words if "=" not in w]
    if keys and not explained and len(keys) == 1:
        return (
            "config --explain takes its SECTION or KEY right after it; run "
            f"`raytunix config --explain {keys[0]}`."
        )
    if keys:
        each = list(dict.fromkeys(([explained] if explained else []) + keys))
        commands = ", ".join(f"`raytunix config --explain {k}`" for k in each)
        return f"config --explain takes one SECTION or KEY at a time; run {commands}."
    return (
        f"config --explain takes one SECTION or KEY, not overrides ({' '.join(words)}); "
        f"drop them, or run `raytunix config {' '.join(words)}` for the resolved values."
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from raytunix.cluster.jobs import check_shipped_package

    wrong = check_shipped_package()  # in a submitted job: the shipped raytunix, or stop
    if wrong:
        print(f"raytunix: {wrong}", file=sys.stderr)
        return 2
    if args.command in _RUN_DIR_COMMANDS:
        return _RUN_DIR_COMMANDS[args.command](args)
    if args.command == "config" and (args.explain is not None or args.markdown):
        if args.overrides:  # --explain describes the settings, not one run's values
            print(
                f"raytunix: {_explain_extra_words(args.explain, args.overrides)}", file=sys.stderr
            )
            return 2
        return _explain(args.explain or "", args.markdown)
    if args.command in ("submit", "status"):
        from raytunix.cluster import jobs

        if args.command == "status":
            return jobs.status_command(args.address, args.job_id)
        return jobs.submit_command(
            args.address,
            args.config,
            args.overrides,
            args.working_dir,
            follow_logs=not args.no_follow,
        )
    # `env.name=my_envs:MyEnv` names a module in the working directory, as `python -m`
    # would find it; the console script's own path does not include it.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args.command == "eval":
        return _eval(args)
    if getattr(args, "resume", None) and args.config is not None:
        print(
            f"raytunix: --config {args.config} cannot be combined with --resume: a resumed run "
            f"keeps its own config ({os.path.join(args.resume, 'config.yaml')}); pass the "
            "settings a resume may change as overrides (e.g. learner.rl_steps=80), or start "
            "a new run with --config.",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = (
            None
            if getattr(args, "resume", None)
            else load_config(args.config or "default", args.overrides)
        )
    except ConfigError as e:
        print(f"raytunix: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(cfg.to_yaml(), end="")
        return 0
    if args.command == "plan":
        return _plan(cfg, args)
    from raytunix.train import RunError, main_train

    try:
        if args.resume:  # the run's own config, with the overrides on top (e.g. more steps)
            return main_train(cfg, resume=args.resume, resume_overrides=args.overrides)
        return main_train(cfg)
    except ConfigError as e:  # a --resume override, a dataset
        print(f"raytunix: config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, RunError) as e:
        print(f"raytunix: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(interrupted_message(getattr(e, "run_dir", None)), file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)  # 130 for Ctrl-C, 143 for SIGTERM


def interrupted_message(run_dir: str | None) -> str:
    """What ``raytunix train`` prints when Ctrl-C or SIGTERM stopped it: what the run kept
    and how to go on from ``run_dir`` (None: the run had no directory yet, or it was
    removed as empty)."""
    if run_dir is None:
        return "raytunix: interrupted before the run had trained anything; nothing to resume."
    kept = [
        what
        for what, sub in (
            ("RL checkpoints", "checkpoints"),
            ("the warm start's progress", "warmup"),
        )
        if os.path.isdir(os.path.join(run_dir, sub)) and os.listdir(os.path.join(run_dir, sub))
    ]
    kept_text = (
        f"kept: {' and '.join(kept)} in {run_dir}"
        if kept
        else f"no checkpoint was written yet, so a resume of {run_dir} starts over"
    )
    return (
        f"raytunix: interrupted; {kept_text}. Continue with `raytunix train --resume "
        f"{run_dir}`; `raytunix profile {run_dir}` writes the report, trace and plots of "
        f"what ran."
    )


if __name__ == "__main__":
    sys.exit(main())
