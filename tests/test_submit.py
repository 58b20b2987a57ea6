"""`raytunix submit` and `raytunix status` against a real local Ray head.

The head is started with `ray start --head` on free ports and its own temp dir, and stopped
by killing only its own processes (other Ray clusters may run on this machine; `ray stop`
would stop them all). Starting it and running one tiny job takes a minute or two.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from test_train import TINY  # the tiny model and run of the main job's tests

from raytunix.cluster import jobs
from raytunix.config import ConfigError

RAYTUNIX = [sys.executable, "-m", "raytunix.cli"]


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _kill_cluster(temp_dir: str) -> None:
    """Ends the processes of the cluster whose files live in ``temp_dir``, and theirs."""
    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid != os.getpid() and temp_dir in " ".join(proc.info["cmdline"] or []):
            procs.append(proc)
            try:
                procs.extend(proc.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    # Short: a wait of 10 s ran out every time (some process of the head outlasts
    # SIGTERM), so the wait only delayed the SIGKILL below.
    _, alive = psutil.wait_procs(procs, timeout=2)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


# The head poses as one TPU host (4 chips) that also offers the env pool's resource.
SIMULATED_RESOURCES = {"TPU": 4, "raytunix_env": 4}
# What the tiny job asks for: the learner (with its colocated engine) on the TPU host, env
# actors by their own resource.
PLACEMENT = ["learner.resources={TPU: 4}", "env.actor_resources={raytunix_env: 1}"]


def _start_head(temp_dir: str) -> tuple[subprocess.CompletedProcess, int]:
    """One ``ray start --head`` on ports that were free a moment ago; returns the finished
    command and the dashboard port."""
    (
        gcs,
        dashboard,
        agent_http,
        agent_grpc,
        metrics,
        client,
        node_manager,
        object_manager,
        runtime_env_agent,
    ) = _free_ports(9)
    command = [
        shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray"),
        "start",
        "--head",
        "--port",
        str(gcs),
        "--include-dashboard=true",
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dashboard),
        "--dashboard-agent-listen-port",
        str(agent_http),
        "--dashboard-agent-grpc-port",
        str(agent_grpc),
        "--metrics-export-port",
        str(metrics),
        "--ray-client-server-port",
        str(client),
        "--node-manager-port",
        str(node_manager),
        "--object-manager-port",
        str(object_manager),
        "--runtime-env-agent-port",
        str(runtime_env_agent),
        "--temp-dir",
        temp_dir,
        "--num-cpus",
        "2",
        "--object-store-memory",
        str(200 * 1024**2),
        "--disable-usage-stats",
        "--resources",
        json.dumps(SIMULATED_RESOURCES),
    ]
    # The host's TPU worker id, as a TPU VM's environment gives it (placement.tpu_worker_id).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_WORKER_ID": "0"}
    env.pop("RAY_ADDRESS", None)
    started = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    return started, dashboard


@pytest.fixture(scope="module")
def ray_head():
    """The job server address of a fresh local head: 2 CPUs, dashboard on, token auth on
    (Ray 2.60's default when ~/.ray/auth_token exists, which `ray start` creates)."""
    # Short: Ray's socket paths under it must fit the 107-byte Unix socket limit.
    temp_dir = tempfile.mkdtemp(prefix="rtxsub", dir="/tmp")
    try:
        # A port found free can be taken before the head binds it (another test worker's
        # Ray picks ports too): such a start is retried on new ports, any other failure not.
        for attempt in range(3):
            started, dashboard = _start_head(temp_dir)
            output = started.stdout + started.stderr
            port_taken = any(
                text in output.lower()
                for text in ("already in use", "failed to start the grpc server")
            )
            if started.returncode == 0 or not port_taken or attempt == 2:
                break
            _kill_cluster(temp_dir)
        assert started.returncode == 0, output
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        _kill_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _actor_resources(address: str) -> dict[str, list[dict[str, float]]]:
    """Class name -> the resources each of its actors asked for (CPU left out), from the
    cluster's state API (finished jobs' actors stay listed as dead)."""
    code = (
        "import json, sys\n"
        "from ray.util.state import list_actors\n"
        "actors = list_actors(address=sys.argv[1], detail=True, limit=1000, "
        "raise_on_missing_output=False)\n"
        "print(json.dumps([[a.class_name, a.required_resources or {}] for a in actors]))"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", code, address],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    asked: dict[str, list[dict[str, float]]] = {}
    for name, resources in json.loads(done.stdout.strip().splitlines()[-1]):
        asked.setdefault(name, []).append({k: v for k, v in resources.items() if k != "CPU"})
    return asked


def _raytunix(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    return subprocess.run(
        [*RAYTUNIX, *args], env=env, capture_output=True, text=True, check=False, timeout=timeout
    )


@pytest.mark.slow
def test_a_bad_config_key_fails_before_anything_is_submitted(ray_head, tmp_path):
    client = jobs.connect(ray_head)
    before = len(client.list_jobs())
    done = _raytunix(
        "submit", "--address", ray_head, "--working-dir", str(tmp_path), "learner.rl_stepz=2"
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "learner.rl_stepz" in done.stderr and "rl_steps" in done.stderr  # names the fix
    assert len(client.list_jobs()) == before


@pytest.mark.slow
def test_submit_runs_a_tiny_training_job_and_status_shows_it(ray_head, tmp_path):
    project = tmp_path / "project"  # the working dir shipped to the cluster
    project.mkdir()
    (project / "runs").mkdir()
    (project / "runs" / "old.bin").write_bytes(b"\0" * 1024)  # excluded from the upload
    out = tmp_path / "out"
    # No warm start and a short evaluation: what is checked here is the job's way through
    # submit, the cluster and status, not what it trains.
    done = _raytunix(
        "submit",
        "--address",
        ray_head,
        "--working-dir",
        str(project),
        *TINY,
        *PLACEMENT,
        "learner.rl_steps=2",
        "warmup.enabled=false",
        "eval.heldout_size=2",
        f"run.output_dir={out}",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job_id = re.search(r"submitted job (\S+)", done.stdout).group(1)
    assert job_id.startswith("raytunix-")
    assert f"ray job logs --follow {job_id}" in done.stdout  # how to follow it again

    # The job wrote its run directory where run.output_dir said, with its RL metrics.
    (run_dir,) = [os.path.join(out, name) for name in os.listdir(out)]
    assert f"run directory: {run_dir}" in done.stdout  # the followed logs
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rl = [r for r in map(json.loads, f) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["run_dir"] == run_dir

    listed = _raytunix("status", "--address", ray_head, timeout=60)
    assert listed.returncode == 0, listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if job_id in line]
    assert "SUCCEEDED" in row and "python -m raytunix.cli train --config default" in row

    shown = _raytunix("status", "--address", ray_head, job_id, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"status:\s+SUCCEEDED", shown.stdout)
    assert re.search(rf"run_dir:\s+{re.escape(run_dir)}", shown.stdout)

    # Where the job's actors went, as the cluster recorded it: the learner took the TPU
    # host's chips, the env actors their own resource and never a TPU.
    asked = _actor_resources(ray_head)
    assert asked["PolicyActor"] == [{"TPU": 4.0}], asked
    assert asked["EnvActor"] and all(r == {"raytunix_env": 1.0} for r in asked["EnvActor"]), asked


@pytest.mark.slow
def test_ctrl_c_stops_the_job(ray_head, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    submitter = subprocess.Popen(
        [
            *RAYTUNIX,
            "submit",
            "--address",
            ray_head,
            "--working-dir",
            str(tmp_path),
            *TINY,
            "learner.rl_steps=500",
            f"run.output_dir={tmp_path / 'out'}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell without job control starts background commands with SIGINT ignored,
        # and Python then installs no Ctrl-C handler: restore it, as a terminal has it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    job_id = None
    for line in submitter.stdout:  # until submit has printed the job id
        submitted = re.search(r"submitted job (\S+)", line)
        if submitted:
            job_id = submitted.group(1)
            break
    assert job_id, "submit printed no job id"
    client = jobs.connect(ray_head)
    deadline = time.monotonic() + 120
    while str(client.get_job_status(job_id)) != "RUNNING":  # the run has started
        assert time.monotonic() < deadline, client.get_job_status(job_id)
        time.sleep(0.2)
    submitter.send_signal(signal.SIGINT)
    _, err = submitter.communicate(timeout=120)
    assert submitter.returncode == 130, err[-3000:]
    assert f"stopping job {job_id}" in err
    assert str(jobs.connect(ray_head).get_job_status(job_id)) == "STOPPED"


def test_status_names_the_address_it_cannot_reach():
    (port,) = _free_ports(1)  # nothing listens there
    done = _raytunix("status", "--address", f"127.0.0.1:{port}", timeout=60)
    assert done.returncode == 2
    assert f"http://127.0.0.1:{port}" in done.stderr and "ray start --head" in done.stderr


def test_the_entrypoint_runs_train_with_the_same_arguments(tmp_path):
    (tmp_path / "my.yaml").write_text("learner:\n  rl_steps: 3\n")
    entry = jobs.train_entrypoint(str(tmp_path / "my.yaml"), ["env.kwargs.note=a b"], str(tmp_path))
    # -m: the job's copy of the working dir comes first on sys.path, not the PATH's raytunix.
    assert entry == "python -m raytunix.cli train --config my.yaml 'env.kwargs.note=a b'"
    assert jobs.check_config(str(tmp_path / "my.yaml"), [], str(tmp_path)).learner.rl_steps == 3
    elsewhere = tmp_path / "project"
    elsewhere.mkdir()
    with pytest.raises(ConfigError, match="outside the working dir"):
        jobs.check_config(str(tmp_path / "my.yaml"), [], str(elsewhere))


# -- what is shipped is what was validated --------------------------------------------------

ENV_MODULE = """
from raytunix.envs.math_envs import CalculatorMathEnv


class ShippedEnv(CalculatorMathEnv):
    pass
"""


def _project(tmp_path):
    project = tmp_path / "project"
    (project / "runs").mkdir(parents=True)
    (project / "runs" / "old.bin").write_bytes(b"\0" * 64)
    (project / "data").mkdir()
    (project / "data" / "big.jsonl").write_text("{}\n")
    (project / "notes.txt").write_text("kept")
    (project / ".gitignore").write_text("data/\nsecret.yaml\n")
    (project / "secret.yaml").write_text("learner:\n  rl_steps: 3\n")
    (project / "run.yaml").write_text("learner:\n  rl_steps: 3\n")
    return project


def test_the_staged_tree_is_what_ray_ships_and_the_rest_is_named(tmp_path):
    project = _project(tmp_path)
    staged = tmp_path / "staged"
    staged.mkdir()
    shipped, left_out = jobs.stage_working_dir(str(project), str(staged))
    assert shipped == ["notes.txt", "run.yaml"]
    assert left_out == ["data/big.jsonl", "runs/old.bin", "secret.yaml"]
    assert sorted(os.listdir(staged)) == ["notes.txt", "run.yaml"]
    assert jobs.describe_left_out(left_out) == "data/ (1 file), runs/ (1 file), secret.yaml"


def test_a_config_file_that_would_not_be_shipped_is_refused_before_submitting(tmp_path):
    project = _project(tmp_path)
    # Nothing may reach a cluster: there is none (client None), and none is needed.
    with pytest.raises(ConfigError, match=r"'.*secret.yaml' would not be shipped.*gitignore"):
        jobs.submit(None, str(project / "secret.yaml"), [], str(project))


def test_an_env_module_left_out_of_the_shipped_tree_fails_the_check(tmp_path):
    project = _project(tmp_path)
    (project / "my_envs.py").write_text(ENV_MODULE)
    overrides = ["env.name=my_envs:ShippedEnv"]
    # Here the module imports from the working dir; in what would ship it must too.
    assert jobs.check_config("default", overrides, str(project)).env.name == "my_envs:ShippedEnv"
    staged = tmp_path / "staged"
    staged.mkdir()
    jobs.stage_working_dir(str(project), str(staged))
    jobs.check_staged_config(str(staged), "default", overrides)  # shipped: it validates
    (project / ".gitignore").write_text("my_envs.py\n")
    ignored = tmp_path / "ignored"
    ignored.mkdir()
    jobs.stage_working_dir(str(project), str(ignored))
    with pytest.raises(ConfigError, match=r"as it would be shipped.*my_envs"):
        jobs.check_staged_config(str(ignored), "default", overrides)


def test_a_job_refuses_a_raytunix_other_than_the_one_it_shipped(tmp_path):
    import raytunix

    mine = os.path.dirname(os.path.dirname(raytunix.__file__))  # holds this raytunix/
    env = {jobs.SHIPPED_PACKAGE_ENV: "1"}
    assert jobs.check_shipped_package(env, cwd=mine) is None
    other = tmp_path / "job"
    (other / "raytunix").mkdir(parents=True)
    (other / "raytunix" / "__init__.py").write_text("")
    wrong = jobs.check_shipped_package(env, cwd=str(other))
    assert (
        wrong and str(other / "raytunix") in wrong and os.path.dirname(raytunix.__file__) in wrong
    )
    assert jobs.check_shipped_package({}, cwd=str(other)) is None  # not a submitted job
    # And the CLI stops on it before anything runs.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); "
            "from raytunix.cli import main; sys.exit(main(['config']))",
            mine,
        ],
        cwd=str(other),
        env={**os.environ, jobs.SHIPPED_PACKAGE_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "this job shipped raytunix in" in done.stderr, done.stderr
