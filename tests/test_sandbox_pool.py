"""Sandboxes in a pool of Ray actors: tool calls reach them (from the driver and from
another worker, by name), each bomb is contained and the actor serves the next call,
and a dead sandbox actor ends the episode as an env_error, not as the policy's tool
error."""

from __future__ import annotations

import os

import re

import pytest

from raytunix.envs import CalculatorMathEnv
from raytunix.sandbox import (
    SandboxLimit,
    SandboxLimits,
    SandboxSession,
    SandboxUnavailable,
    connect,
)
from raytunix.sandbox.pool import RemoteSandbox, SandboxPool
from raytunix.tools import BashTool, PythonTool
from raytunix.types import Action, EpisodeStatus, Task, ToolCall

# A roomy deadline: each bomb is stopped by its own limit (the loop by its CPU seconds, or
# the deadline on a machine too loaded to give it one), however slowly it starts.
BOMB = SandboxLimits(
    wall_time_s=20.0,
    cpu_time_s=1.0,
    memory_bytes=64 << 20,
    max_processes=16,
    max_file_bytes=1 << 20,
    max_output_bytes=4096,
)
BOMBS = {
    "fork bomb": ["python3", "-I", "-c", "import os\nwhile True:\n    os.fork()"],
    "memory bomb": ["python3", "-I", "-c", "x = []\nwhile True:\n    x.append(bytearray(8 << 20))"],
    "infinite loop": ["python3", "-I", "-c", "while True: pass"],
    "100 MB of output": ["head", "-c", "100000000", "/dev/zero"],
}


@pytest.fixture(scope="module")
def pool(ray_session):
    pool = SandboxPool(
        num_actors=2,
        limits=SandboxLimits(wall_time_s=20.0),
        num_cpus=0.25,
        max_concurrent_runs=4,
        name="test-sandbox",
    )
    pool.wait_ready(timeout_s=120)
    yield pool
    pool.shutdown()


@pytest.mark.slow
def test_connect_finds_the_pool_by_name_and_a_tool_call_runs_on_a_sandbox_actor(pool):
    client = connect("test-sandbox")
    assert isinstance(client, RemoteSandbox) and len(client.actors) == 2
    runs_before = sum(stats["runs"] for stats in pool.stats())
    with SandboxSession(client) as session:
        result = PythonTool(session)(code="import os; print(os.getppid() > 0)")
        assert result.output == "True"
        assert BashTool(session)(command="echo kept > f.txt").ok
        assert PythonTool(session)(code="print(open('f.txt').read().strip())").output == "kept"
    stats = pool.stats()
    assert sum(s["runs"] for s in stats) == runs_before + 3
    assert all(s["pid"] != os.getpid() for s in stats)
    assert all(s["workspaces"] == 0 for s in stats)  # the session closed its work dir


@pytest.mark.slow
def test_another_worker_reaches_the_pool_through_connect(pool, ray_session):
    @ray_session.remote(num_cpus=0)
    def tool_call_elsewhere():
        from raytunix.sandbox import SandboxSession, connect
        from raytunix.tools import PythonTool

        client = connect("test-sandbox")
        with SandboxSession(client) as session:
            return type(client).__name__, PythonTool(session)(code="print(6 * 7)").output

    assert ray_session.get(tool_call_elsewhere.remote(), timeout=120) == ("RemoteSandbox", "42")


@pytest.mark.slow
@pytest.mark.parametrize("bomb", list(BOMBS))
def test_every_bomb_is_contained_and_the_actor_serves_the_next_call(pool, bomb):
    client = pool.client(seed=0)
    workspace = client.open_workspace("bomb")
    pids_before = [s["pid"] for s in pool.stats()]
    try:
        result = client.run(workspace, BOMBS[bomb], limits=BOMB)
        expected = {
            "fork bomb": {SandboxLimit.PROCESSES, SandboxLimit.WALL_TIME},
            "memory bomb": {SandboxLimit.MEMORY},
            "infinite loop": {SandboxLimit.CPU_TIME, SandboxLimit.WALL_TIME},
            "100 MB of output": {None},
        }[bomb]
        assert result.killed_by_limit in expected, result
        if bomb == "100 MB of output":
            assert result.stdout_truncated and result.stdout_bytes == 100_000_000
        again = client.run(workspace, ["echo", "alive"])
        assert again.stdout == "alive\n"
    finally:
        client.close_workspace(workspace)
    assert [s["pid"] for s in pool.stats()] == pids_before  # no actor died or restarted


@pytest.mark.slow
def test_a_dead_sandbox_actor_ends_the_episode_as_env_error(ray_session):
    pool = SandboxPool(num_actors=1, num_cpus=0, max_restarts=0, name="test-sandbox-doomed")
    pool.wait_ready(timeout_s=120)
    client = pool.client()
    session = SandboxSession(client)
    env = CalculatorMathEnv(tools=[BashTool(session)])
    env.reset(Task("t", "List the files.", "none"))
    call = Action(text="", tool_calls=(ToolCall("bash", {"command": "ls"}),))
    assert env.step(call).observation == "(no output)"
    ray_session.kill(pool.actors[0], no_restart=True)
    with pytest.raises(SandboxUnavailable):
        client.run(session.workspace, ["ls"])
    env.reset(Task("t", "List the files.", "none"))
    step = env.step(call)
    assert step.done and step.status is EpisodeStatus.ENV_ERROR
    assert "SandboxUnavailable" in step.info["error"]
    session.close()  # a work dir gone with its actor closes quietly


class ShellEnv(CalculatorMathEnv):
    """An environment whose tools run code: a run starts the sandbox pool for it."""

    uses_sandbox = True

    def __init__(self):
        super().__init__(tools=[BashTool()])


@pytest.mark.slow
def test_a_run_starts_the_pool_its_config_describes_for_an_env_that_uses_a_sandbox(ray_session):
    from raytunix.config import load_config
    from raytunix.driver import prepare

    cfg = load_config(
        None,
        [
            f"env.name={__name__}:ShellEnv",
            "sandbox.num_actors=2",
            "sandbox.num_cpus_per_actor=0",
            "sandbox.wall_time_s=3",
            "sandbox.memory_mb=128",
            "sandbox.max_output_kb=1",
        ],
    )
    pool = prepare.start_sandbox_pool(cfg)
    try:
        assert len(pool.actors) == 2
        env = ShellEnv()  # as an env actor would build it: its tool connects to the pool
        env.reset(Task("t", "Print a lot.", "none"))
        step = env.step(Action(text="", tool_calls=(ToolCall("bash", {"command": "seq 1 5000"}),)))
        assert step.observation.endswith("[stdout cut: first 1024 of 23893 bytes shown]")
        assert sum(s["runs"] for s in pool.stats()) == 1
        assert sum(s["workspaces"] for s in pool.stats()) == 1
        env.close()  # as at the end of an episode: the tool's work dir goes
        assert sum(s["workspaces"] for s in pool.stats()) == 0
    finally:
        pool.shutdown()
    assert prepare.start_sandbox_pool(load_config(None, [])) is None  # calculator: no sandbox


def test_the_config_sections_sizes_become_the_sandbox_limits():
    from raytunix.config import load_config

    cfg = load_config(
        None,
        [
            "sandbox.memory_mb=64",
            "sandbox.max_file_mb=2",
            "sandbox.max_output_kb=8",
            "sandbox.tmp_mb=16",
            "sandbox.wall_time_s=1.5",
            "sandbox.max_processes=12",
        ],
    )
    assert SandboxLimits.from_config(cfg.sandbox) == SandboxLimits(
        wall_time_s=1.5,
        cpu_time_s=10.0,
        memory_bytes=64 << 20,
        max_processes=12,
        max_file_bytes=2 << 20,
        max_output_bytes=8 << 10,
        tmp_bytes=16 << 20,
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("sandbox.memory_mb=99999999999999", "sandbox.memory_mb=99999999999999 must be <= "),
        ("sandbox.max_file_mb=99999999999999", "sandbox.max_file_mb=99999999999999 must be <= "),
        ("sandbox.cpu_time_s=1e30", "sandbox.cpu_time_s=1e+30 must be a number of seconds <= "),
        ("sandbox.wall_time_s=inf", "sandbox.wall_time_s=inf must be a finite number > 0"),
        ("sandbox.max_processes=99999999", "sandbox.max_processes=99999999 must be <= 4194304"),
    ],
)
def test_sandbox_sizes_the_kernel_cannot_take_are_config_errors(override, message):
    # Each had passed the config and failed every command with a launcher traceback.
    from raytunix.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])
