"""Chaos, measured: a tiny ``raytunix train`` run whose processes are killed at seeded
random moments, and what survived.

Per seed, one run on local Ray (a tiny random model, no warm start, disaggregated: a
learner actor and ``--engine-replicas`` engine actors), in an environment that runs a
short program in its episode's sandbox work dir at every step (so sandbox actors serve
every episode), is started as ``python -m raytunix.cli train`` in a subprocess. A
schedule drawn from the seed kills, each once, with SIGKILL of the process:

* ``env_actor``: one env actor's worker process (``ray::EnvActor``);
* ``sandbox_actor``: one sandbox actor's worker process (``ray::SandboxActor``);
* ``engine_replica``: one engine replica's worker process (``ray::EngineActor``);
* ``driver``: the ``raytunix train`` process itself; the harness then waits for every
  process of its tree to go, and runs ``raytunix train --resume <run dir>``.

A kill's moment is "``delay`` seconds after the run has logged RL step ``k``" (``k = 0``:
once checkpoint 0 is committed), ``k`` uniform in ``[0, --rl-steps - 2]`` and ``delay``
uniform in ``[0, --max-delay-s]``, both from ``random.Random(seed)``, as is which of
several matching processes dies. A kill whose moment the run does not reach (it ended
first) is counted under ``kills_missed``.

Per seed it checks, and the JSON reports:

* **finished**: the last ``raytunix train`` exited 0 and wrote ``summary.json``.
* **tasks** (the data ledger of the final checkpoint, ``raytunix.rollout.ledger``):
  ``tasks_lost`` = task indices below the final data position that are neither trained,
  filtered nor pending, plus indices that an earlier committed checkpoint had settled
  (trained, or filtered for a reason) and the final one does not settle the same way;
  ``tasks_duplicated`` = groups the final lineage counts as trained
  (``groups_trained``) beyond the distinct trained indices, plus any excess of trained
  indices over ``rl_steps x groups_per_batch`` (each RL step trains one batch of
  ``groups_per_batch`` tasks, so more trained indices than that were trained twice or
  by a step that did not happen).
* **checkpoints**: every RL step that ``state.json`` named while the run was polled
  (every 0.1 s; state.json only ever names a committed checkpoint) is a committed
  checkpoint. The run keeps every checkpoint (``learner.max_checkpoints`` above the
  steps), so none may go: ``checkpoints_lost`` counts committed steps that at the end
  are not among the checkpointer's steps or whose extras (data position, ledger) cannot
  be read, plus every entry moved to ``checkpoints-corrupt/``, plus each resume that
  started below the newest step committed before the driver's kill (counted as the
  committed steps it skipped).
* **processes**: every process seen in the drivers' trees (by pid and start time) and
  every process whose command line names the run's Ray temp dir (``RAY_TMPDIR``, one per
  seed) must be gone within ``--reap-timeout-s`` after the run ends; what is left is
  reported (and then killed) as ``processes_left``.

Ray's raylet gets 120 s to come up (``RAY_raylet_start_wait_time_s``; Ray's default of
30 s fails on a heavily loaded 2-core machine); a launch that fails so, before its run
starts, is repeated, up to 3 times, and counted under ``ray_startup_retries``.

``runs_survived`` counts seeds that finished with no process left; ``tasks_lost``,
``checkpoints_lost``, ``tasks_duplicated`` and ``processes_left`` are summed over seeds.
The JSON holds a row per seed (its schedule, kills done, wall time, the checks' detail).

    python benchmarks/chaos.py --seeds 10
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
# The checks read the runs' checkpoints with the code the runs used (PYTHONPATH=ROOT
# below), not whatever raytunix is installed, if any.
sys.path.insert(0, str(ROOT))
GROUPS_PER_BATCH = 2
# Ray gives its raylet 30 s to come up (raised to 120 here); on a heavily loaded machine it
# may still not, and the launch fails before the run starts: it is repeated (and counted).
RAY_STARTUP_TIMEOUT = "The current node timed out during startup"
MAX_STARTUP_RETRIES = 3
KINDS = ("env_actor", "sandbox_actor", "engine_replica", "driver")
# Ray names a worker process after the actor class it hosts ("ray::EnvActor.step").
PROCESS_TITLE = {
    "env_actor": "ray::EnvActor",
    "sandbox_actor": "ray::SandboxActor",
    "engine_replica": "ray::EngineActor",
}

# Runs a short program in the episode's sandbox work dir at every step, so a sandbox actor
# serves every episode; the reward is the reply's share of digits (a random tiny model
# never solves a task, but its samples differ in this, so groups have advantages and every
# update moves the weights). A sandbox that died ends the episode as env_error.
CHAOS_ENV = '''
from raytunix.envs.base import BaseEnv
from raytunix.sandbox import SandboxSession
from raytunix.types import EpisodeStatus, StepResult

COUNT = "import sys; t = sys.stdin.read(); print(sum(c.isdigit() for c in t), len(t))"


class SandboxDigitsEnv(BaseEnv):
    default_agent = "text"
    uses_sandbox = True

    def __init__(self, turns: int = 2):
        super().__init__()
        self.turns = turns
        self.session = SandboxSession(name="chaos")

    def _initial_observation(self, task):
        self.turn = 0
        return task.question

    def _step_impl(self, action):
        self.turn += 1
        result = self.session.run(["python3", "-I", "-c", COUNT], stdin=action.text)
        digits, length = map(int, result.stdout.split())
        done = self.turn >= self.turns
        return StepResult("" if done else "More digits, please.", digits / max(length, 1),
                          done, EpisodeStatus.COMPLETED if done else None)

    def close(self):
        self.session.close()
'''


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10, help="seeds to run")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated kinds to kill, each once per seed ({', '.join(KINDS)})",
    )
    p.add_argument("--rl-steps", type=int, default=6)
    p.add_argument(
        "--max-delay-s",
        type=float,
        default=6.0,
        help="a kill comes up to this long after its RL step was logged",
    )
    p.add_argument("--env-actors", type=int, default=2)
    p.add_argument("--sandbox-actors", type=int, default=2)
    p.add_argument("--engine-replicas", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument(
        "--seed-timeout-s",
        type=float,
        default=2400.0,
        help="a seed whose runs take longer is stopped and counted as not finished",
    )
    p.add_argument(
        "--reap-timeout-s",
        type=float,
        default=30.0,
        help="how long the processes of a run may take to go after it ends",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep each seed's run directory (a seed that did not finish keeps its own)",
    )
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"--kinds {unknown} unknown; choose from {list(KINDS)}")
    args.kinds = kinds
    if args.rl_steps < 2:
        p.error(f"--rl-steps={args.rl_steps} must be >= 2 (a kill needs a step to come after)")
    return args


def train_overrides(args, output_dir: str) -> list[str]:
    return [
        "env.name=chaos_env:SandboxDigitsEnv",
        "env.max_turns=2",
        f"env.num_env_actors={args.env_actors}",
        f"sandbox.num_actors={args.sandbox_actors}",
        "sandbox.num_cpus_per_actor=0",
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        "model.d_ff=64",
        "model.max_seq_len=128",
        "model.tokenizer_vocab_size=300",
        "data.train_size=200",
        "data.heldout_size=2",
        "eval.heldout_size=2",
        "eval.max_new_tokens=8",
        "warmup.enabled=false",
        "rollout.group_size=2",
        f"rollout.groups_per_batch={GROUPS_PER_BATCH}",
        "rollout.max_concurrent_episodes=8",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        # a killed actor's episodes wait for its restart; keep the backoff short
        "rollout.retry_initial_delay_s=0.2",
        "rollout.retry_max_delay_s=2",
        "engine.max_batch_size=4",
        "engine.placement=disaggregated",
        f"engine.num_replicas={args.engine_replicas}",
        f"learner.rl_steps={args.rl_steps}",
        "learner.checkpoint_every=1",
        f"learner.max_checkpoints={args.rl_steps + 2}",  # every checkpoint stays: none may go
        f"run.output_dir={output_dir}",
    ]


def schedule(seed: int, kinds: list[str], rl_steps: int, max_delay_s: float) -> list[dict]:
    rng = random.Random(seed)
    kills = [
        {
            "kind": kind,
            "after_step": rng.randint(0, rl_steps - 2),
            "delay_s": round(rng.uniform(0.0, max_delay_s), 2),
            "pick": rng.random(),
        }
        for kind in kinds
    ]
    return sorted(kills, key=lambda k: (k["after_step"], k["delay_s"]))


# -- watching a run ------------------------------------------------------------------------


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):  # not there yet, or being replaced
        return None


def rl_progress(run_dir: str | None) -> int:
    """-1 before checkpoint 0 is committed, else the highest RL step logged."""
    if run_dir is None or not os.path.exists(os.path.join(run_dir, "state.json")):
        return -1
    step = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                if '"phase": "rl"' in line:
                    try:
                        step = max(step, int(json.loads(line)["step"]))
                    except (ValueError, KeyError):
                        pass  # a line being written
    except OSError:
        pass
    return step


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def alive(known: dict[tuple[int, float], str]) -> dict[tuple[int, float], str]:
    """Those of ``known`` ((pid, start time) -> name) still running (a zombie is not)."""
    left = {}
    for (pid, started), name in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                left[(pid, started)] = name
        except psutil.NoSuchProcess:
            pass
    return left


def named_processes(marker: str) -> dict[tuple[int, float], str]:
    """Every live process whose command line holds ``marker`` (the run's Ray temp dir)."""
    found = {}
    for p in psutil.process_iter():
        try:
            if (
                p.pid != os.getpid()
                and marker in _cmdline(p)
                and p.status() != psutil.STATUS_ZOMBIE
            ):
                found[(p.pid, p.create_time())] = _cmdline(p)[:120]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def wait_gone(known: dict, marker: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    left = {**alive(known), **named_processes(marker)}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {**alive(left), **named_processes(marker)}
    return left


def kill_left(left: dict) -> None:
    for pid, started in left:
        try:
            p = psutil.Process(pid)
            if p.create_time() == started:
                p.kill()
        except psutil.NoSuchProcess:
            pass


# -- one seed ------------------------------------------------------------------------------


def run_seed(seed: int, args) -> dict:
    t0 = time.monotonic()
    # Short: Ray's socket paths live under it (a Unix socket path has ~107 bytes).
    work = tempfile.mkdtemp(prefix=f"chaos{seed}-", dir="/tmp")
    ray_tmp = os.path.join(work, "r")
    output_dir = os.path.join(work, "runs")
    Path(work, "chaos_env.py").write_text(CHAOS_ENV)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        RAY_TMPDIR=ray_tmp,
        RAY_raylet_start_wait_time_s=os.environ.get("RAY_raylet_start_wait_time_s", "120"),
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("RAY_ADDRESS", None)  # a cluster of its own, which the driver's death takes down
    plan = schedule(seed, args.kinds, args.rl_steps, args.max_delay_s)
    todo = [dict(k) for k in plan]
    kills_done: list[dict] = []
    committed: set[int] = set()
    seen: dict[tuple[int, float], str] = {}
    resumes: list[dict] = []
    launches = 0
    run_dir = None
    log_path = os.path.join(work, "driver.log")
    row: dict = {
        "seed": seed,
        "schedule": [{k: v for k, v in kill.items() if k != "pick"} for kill in plan],
    }

    startup_retries = 0
    current: list[str] = []

    def launch(cmd_args):
        nonlocal launches
        launches += 1
        current[:] = cmd_args
        log = open(log_path, "a")
        log.write(f"\n==== launch {launches}: {' '.join(cmd_args)}\n")
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "raytunix.cli", *cmd_args],
            cwd=work,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return proc

    driver = launch(["train", *train_overrides(args, output_dir)])
    due_since: dict[int, float] = {}  # kill index -> when its step was reached
    rc = None
    timed_out = False
    while True:
        if run_dir is not None and not os.path.isdir(run_dir):
            run_dir = None  # a launch that failed before it trained removed its run dir
        if run_dir is None:
            found = glob.glob(os.path.join(output_dir, "*", "config.yaml"))
            run_dir = os.path.dirname(found[0]) if found else None
        for p in tree(driver.pid):
            try:
                seen.setdefault((p.pid, p.create_time()), p.name())
            except psutil.NoSuchProcess:
                pass
        state = _read_json(os.path.join(run_dir, "state.json")) if run_dir else None
        if state and "checkpoint_step" in state:
            committed.add(int(state["checkpoint_step"]))
        rc = driver.poll()
        if rc is not None and rc != 0 and startup_retries < MAX_STARTUP_RETRIES:
            with open(log_path) as f:
                last = f.read().rsplit("\n==== launch ", 1)[-1]
            if RAY_STARTUP_TIMEOUT in last:  # the machine, not the run: start it again
                startup_retries += 1
                driver = launch(current)
                continue
        if rc is not None:
            break
        if time.monotonic() - t0 > args.seed_timeout_s:
            timed_out = True
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
            rc = driver.returncode
            break
        progress = rl_progress(run_dir)
        now = time.monotonic()
        for kill in todo:
            if progress >= kill["after_step"]:
                due_since.setdefault(id(kill), now)
        due = [k for k in todo if id(k) in due_since and now - due_since[id(k)] >= k["delay_s"]]
        if due:
            kill = due[0]
            if kill["kind"] == "driver":
                at_kill = max(committed, default=None)
                os.kill(driver.pid, signal.SIGKILL)
                driver.wait()
                # Its tree (Ray's processes, the actors) must go on its own: the watchdog.
                left = wait_gone(seen, ray_tmp, args.reap_timeout_s)
                kills_done.append(
                    {
                        "kind": "driver",
                        "at_rl_step": progress,
                        "t_s": round(now - t0, 1),
                        "committed_at_kill": at_kill,
                        "left_after_kill": sorted(set(left.values())),
                    }
                )
                kill_left(left)
                todo.remove(kill)
                resumes.append({"committed_at_kill": at_kill, "launch": launches + 1})
                driver = launch(["train", "--resume", run_dir])
                continue
            title = PROCESS_TITLE[kill["kind"]]
            targets = sorted(
                (p for p in tree(driver.pid) if _cmdline(p).startswith(title)), key=lambda p: p.pid
            )
            if targets:  # else not up yet, or restarting: try again at the next poll
                target = targets[int(kill["pick"] * len(targets))]
                try:
                    target.send_signal(signal.SIGKILL)
                    kills_done.append(
                        {
                            "kind": kill["kind"],
                            "at_rl_step": progress,
                            "t_s": round(now - t0, 1),
                            "pid": target.pid,
                            "of": len(targets),
                        }
                    )
                    todo.remove(kill)
                except psutil.NoSuchProcess:
                    pass
        time.sleep(0.1)

    row["wall_s"] = round(time.monotonic() - t0, 1)
    row["exit_code"] = rc
    row["timed_out"] = timed_out
    row["launches"] = launches
    row["ray_startup_retries"] = startup_retries
    summary = os.path.join(run_dir, "summary.json") if run_dir else None
    row["finished"] = rc == 0 and summary is not None and os.path.exists(summary)
    row["kills"] = kills_done
    row["kills_missed"] = [k["kind"] for k in todo]
    left = wait_gone(seen, ray_tmp, args.reap_timeout_s)
    row["processes_left"] = sorted(set(left.values()))
    kill_left(left)
    row.update(check_run(run_dir, committed, resumes, log_path, args))
    if not row["finished"]:
        with open(log_path) as f:
            row["log_tail"] = f.read()[-3000:]
    if args.keep or not row["finished"]:  # a failed seed's evidence stays
        row["work_dir"] = work
    else:
        shutil.rmtree(work, ignore_errors=True)
    return row


def check_run(
    run_dir: str | None, committed: set[int], resumes: list[dict], log_path: str, args
) -> dict:
    """The ledger and checkpoint checks of one seed's run (see the module docstring)."""
    from raytunix.learner.checkpoint import Checkpointer
    from raytunix.rollout.ledger import TaskLedger

    out = {
        "committed_steps": sorted(committed),
        "tasks_lost": None,
        "tasks_duplicated": None,
        "checkpoints_lost": None,
    }
    if run_dir is None or not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        out["checkpoints_lost"] = len(committed)
        return out
    checkpoints = Checkpointer(os.path.join(run_dir, "checkpoints"))
    extras: dict[int, dict] = {}
    try:
        steps = checkpoints.all_steps()
        for step in steps:
            try:
                extras[step] = checkpoints.read_extras(step)
            except Exception as e:  # noqa: BLE001 - what cannot be read is lost, with the reason
                out.setdefault("unreadable", {})[step] = f"{type(e).__name__}: {e}"[:300]
    finally:
        checkpoints.close()
    corrupt = (
        sorted(os.listdir(os.path.join(run_dir, "checkpoints-corrupt")))
        if os.path.isdir(os.path.join(run_dir, "checkpoints-corrupt"))
        else []
    )
    lost_steps = sorted(s for s in committed if s not in extras)
    # A resume must start at (or after) the newest checkpoint committed before the kill.
    with open(log_path) as f:
        text = f.read()
    resumed_at = [
        int(line.split("resumed at RL step ")[1].split(",")[0])
        for line in text.splitlines()
        if "resumed at RL step " in line
    ]
    skipped = 0
    for resume, step in zip(resumes, resumed_at):
        resume["resumed_at"] = step
        if resume["committed_at_kill"] is not None and step < resume["committed_at_kill"]:
            skipped += resume["committed_at_kill"] - step
    out.update(
        checkpoint_steps=sorted(extras),
        checkpoints_corrupt=corrupt,
        resumes=resumes,
        checkpoints_lost_steps=lost_steps,
        checkpoints_lost=len(lost_steps) + len(corrupt) + skipped,
    )
    if not extras:
        return out
    final = extras[max(extras)]["orchestrator"]
    ledger = TaskLedger.from_json(final["ledger"])
    pending = set(final["pending"])
    next_index = int(final["next_index"])
    lost = {i for i in range(next_index) if ledger.outcome(i) is None and i not in pending}
    for step, tree_ in extras.items():  # what an earlier checkpoint settled stays settled
        before = TaskLedger.from_json(tree_["orchestrator"]["ledger"])
        lost |= {i for i in before.trained if ledger.outcome(i) != "trained"}
        for reason, indices in before.filtered.items():
            lost |= {i for i in indices if ledger.outcome(i) != f"filtered:{reason}"}
    trained = len(ledger.trained)
    groups_trained = int(final["counters"].get("groups_trained", 0))
    rl_step = int(extras[max(extras)]["rl_step"])
    duplicated = max(0, groups_trained - trained) + max(0, trained - rl_step * GROUPS_PER_BATCH)
    out.update(
        final_checkpoint=max(extras),
        data_position=next_index,
        tasks_trained=trained,
        tasks_filtered={r: len(i) for r, i in ledger.filtered.items()},
        tasks_pending=len(pending),
        tasks_lost=len(lost),
        tasks_lost_indices=sorted(lost)[:20],
        tasks_duplicated=duplicated,
        counters=final["counters"],
    )
    return out


def machine() -> dict:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    import ray

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "ray": ray.__version__,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        rows.append(run_seed(seed, args))
        print(
            f"seed {seed}: finished={rows[-1]['finished']} tasks_lost={rows[-1]['tasks_lost']} "
            f"checkpoints_lost={rows[-1]['checkpoints_lost']} "
            f"left={len(rows[-1]['processes_left'])} {rows[-1]['wall_s']} s",
            file=sys.stderr,
        )
        if not rows[-1]["finished"]:
            print(
                f"seed {seed} did not finish; its run is kept in {rows[-1]['work_dir']}; "
                f"the driver log ends:\n{rows[-1]['log_tail']}",
                file=sys.stderr,
                flush=True,
            )
    kills: dict[str, int] = {kind: 0 for kind in args.kinds}
    for row in rows:
        for kill in row["kills"]:
            kills[kill["kind"]] += 1

    def total(key):  # a seed whose run left nothing to check is under seeds_unchecked
        return sum(row[key] for row in rows if row[key] is not None)

    report = {
        "benchmark": "chaos",
        "seeds": [row["seed"] for row in rows],
        "runs_survived": sum(row["finished"] and not row["processes_left"] for row in rows),
        "runs_finished": sum(row["finished"] for row in rows),
        "tasks_lost": total("tasks_lost"),
        "tasks_duplicated": total("tasks_duplicated"),
        "checkpoints_lost": total("checkpoints_lost"),
        "processes_left": sum(len(row["processes_left"]) for row in rows),
        "seeds_unchecked": [row["seed"] for row in rows if row["tasks_lost"] is None],
        "kills": kills,
        "kills_missed": sum(len(row["kills_missed"]) for row in rows),
        "ray_startup_retries": sum(row["ray_startup_retries"] for row in rows),
        "wall_s_per_seed": [row["wall_s"] for row in rows],
        "wall_s": round(time.monotonic() - t0, 1),
        "config": {k: v for k, v in vars(args).items()},
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "runs": rows,
    }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
