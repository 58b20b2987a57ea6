"""What keeps a run's directory safe: one driver per run (a lock the kernel frees however
the driver ends), no scale request for a finished run, placement and mesh keys a resume may
change, and a learner mesh that does not fit its devices stopping the run before it trains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from raytunix.config import ConfigError, load_config
from raytunix.driver import steps
from raytunix.driver.run_dir import RunDir, RunError, load_run_config
from raytunix.cluster.scaling import ScaleRequestError, write_scale_request

from test_train import TINY  # the tiny model and run of the main job's tests


def _new_run(tmp_path, *overrides) -> str:
    cfg = load_config(None, [*TINY, f"run.output_dir={tmp_path}", *overrides])
    _, run, _ = steps.open_run(cfg, None)
    run.unlock()
    return run.path


def test_a_second_driver_on_a_running_run_is_refused_and_the_config_is_untouched(tmp_path):
    path = _new_run(tmp_path)
    first = RunDir(path)
    first.lock()
    with open(os.path.join(path, "config.yaml")) as f:
        config = f.read()
    with pytest.raises(RunError, match=rf"is being run by pid {os.getpid()} on .*--resume"):
        steps.open_run(None, path, ["learner.rl_steps=9"])
    with open(os.path.join(path, "config.yaml")) as f:
        assert f.read() == config  # the refused resume wrote nothing
    assert RunDir(path).running_driver() == f"pid {os.getpid()} on {os.uname().nodename}"
    first.unlock()
    assert RunDir(path).running_driver() is None
    _, run, _ = steps.open_run(None, path, ["learner.rl_steps=9"])  # free again
    run.unlock()


def test_the_lock_goes_with_a_killed_driver(tmp_path):
    path = _new_run(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from raytunix.driver.run_dir import RunDir
            RunDir({path!r}).lock()
            print("locked", flush=True)
            time.sleep(120)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert RunDir(path).running_driver() == f"pid {holder.pid} on {os.uname().nodename}"
        with pytest.raises(RunError, match=f"pid {holder.pid}"):
            RunDir(path).lock()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert RunDir(path).running_driver() is None
    RunDir(path).lock()


def test_scale_refuses_a_finished_run(tmp_path):
    path = _new_run(tmp_path)
    write_scale_request(path, env_actors=2)  # not running yet: kept for the next resume
    with open(os.path.join(path, "summary.json"), "w") as f:
        f.write("{}")
    with pytest.raises(ScaleRequestError, match="has finished.*--resume"):
        write_scale_request(path, env_actors=3)


def test_placement_and_mesh_keys_may_change_on_resume_the_model_may_not(tmp_path):
    path = _new_run(tmp_path)
    cfg = load_run_config(
        path,
        [
            "env.actor_resources={raytunix_env: 1}",
            "learner.resources={TPU: 4}",
            "learner.mesh_fsdp=1",
            "learner.sequence_packing=false",
        ],
    )
    assert cfg.env.actor_resources == {"raytunix_env": 1}
    assert cfg.learner.resources == {"TPU": 4} and cfg.learner.sequence_packing is False
    with pytest.raises(ConfigError, match="model.d_model cannot change when resuming"):
        load_run_config(path, ["model.d_model=64"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.tpu_version=v5e"], "set learner.tpu_version=v5litepod"),
        (
            ["learner.resources={TPU: 8}", "learner.num_hosts=2"],
            r"TPU: 8 per host, but a v6e host of topology 4x4 has 4 chips; set "
            r"learner.resources=\{TPU: 4\}",
        ),
    ],
)
def test_tpu_slice_settings_that_no_slice_has_are_refused_with_the_fix(overrides, message):
    slice_ = [
        "learner.tpu_topology=4x4",
        "learner.tpu_version=v6e",
        "learner.num_hosts=4",
        "engine.placement=disaggregated",
    ]
    with pytest.raises(ConfigError, match=message):
        load_config(None, slice_ + overrides)


@pytest.mark.slow
def test_a_mesh_the_devices_cannot_hold_stops_the_run_before_it_trains(ray_session, tmp_path):
    from raytunix.train import train

    cfg = load_config(None, [*TINY, f"run.output_dir={tmp_path}", "learner.mesh_data=3"])
    # The memory plan, checked before Ray or any actor starts, finds it first.
    with pytest.raises(
        ConfigError,
        match=r"the learner's device mesh: learner\.mesh_data .* = 3 devices, "
        r"but this run has 1",
    ):
        train(cfg)
    assert os.listdir(tmp_path) == []  # the run stopped before it trained: no directory left
