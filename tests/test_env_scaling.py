"""Env and sandbox actor pools scale apart from the learner, during a run: a grown env pool's
new actors take episodes, a shrunk one's retired actors finish theirs and are then killed,
and no episode is lost or failed because of it; on a multi-node cluster the env actors land
only on the nodes offering their resource. ``raytunix scale`` asks a running run for a size
through a file its driver reads once per RL step.

Run as a script (``python tests/test_env_scaling.py``), this file plays the multi-node
scenario on a ``ray.cluster_utils.Cluster`` of its own; the test below starts it in a
subprocess, since the session's Ray is already up in the pytest process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from raytunix.models.tokenizer import Tokenizer
from raytunix.types import (
    FinishReason,
    GenerationResult,
    SamplingParams,
    Task,
)

TOK = Tokenizer.byte_level()
TASKS = [Task(f"t{i}", f"Calculate {i} + 1.", str(i + 1)) for i in range(400)]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%d + 1"}}</tool_call>'
ENV_RESOURCE = "raytunix_env"


def _result(request, text: str) -> GenerationResult:
    ids = TOK.encode(text) + [TOK.end_id]
    return GenerationResult(
        request.request_id, tuple(ids), (-0.1,) * len(ids), (0,) * len(ids), FinishReason.STOP
    )


class SlowEngine:
    """Calls the calculator on turn 0 and answers on turn 1, each after ``delay_s``
    seconds, so that episodes stay in flight while the pool is resized."""

    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s

    async def generate(self, request):
        await asyncio.sleep(self.delay_s)
        group, _, turn = request.request_id.split("/")
        index = int(group.lstrip("g"))
        if turn == "0":
            return _result(request, CALL % index)
        return _result(request, f"<answer>{index + 1}</answer>")


def _orchestrator_kwargs() -> dict:
    return {
        "tasks": TASKS,
        "tokenizer": TOK,
        "agent_name": "tool",
        "group_size": 2,
        "groups_per_batch": 2,
        "max_concurrent_episodes": 8,
        "max_staleness": 1000,
        "max_turns": 3,
        "max_context_tokens": 512,
        "sampling": SamplingParams(max_new_tokens=64),
        "episode_timeout_s": 60.0,
    }


def _statuses(infos) -> dict[str, int]:
    total: dict[str, int] = {}
    for info in infos:
        for status, n in info["statuses"].items():
            total[status] = total.get(status, 0) + n
    return total


# -- (a) an orchestrator's pool grown and shrunk mid-run, through the driver's scale file --


@pytest.mark.slow
def test_env_pool_grown_then_shrunk_mid_run_loses_and_fails_no_episode(ray_session, tmp_path):
    from ray import cloudpickle

    from raytunix.rollout.actor import OrchestratorActor
    from raytunix.rollout.env_pool import EnvPool
    from raytunix.cluster.scaling import ScaleWatcher, write_scale_request

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on workers' path
    (tmp_path / "config.yaml").write_text("{}\n")
    said: list[str] = []
    pool = EnvPool("calculator_math", {}, num_actors=1, max_restarts=0)
    pool.wait_ready(timeout_s=120)
    watcher = ScaleWatcher(str(tmp_path), pool, say=said.append)
    engine = ray_session.remote(SlowEngine).options(num_cpus=0, max_concurrency=1000).remote()
    orchestrator = (
        ray_session.remote(OrchestratorActor)
        .options(num_cpus=0, max_concurrency=1000)
        .remote(env_pool=pool, engine=engine, **_orchestrator_kwargs())
    )
    infos, records, version = [], [], 0

    def rl_step() -> dict:
        nonlocal version
        _refs, info = ray_session.get(orchestrator.next_batch.remote(), timeout=120)
        version += 1
        ray_session.get(orchestrator.mark_trained.remote(info["batch_id"], version))
        infos.append(info)
        return info

    def membership() -> dict:
        return ray_session.get(orchestrator.env_pool_membership.remote())

    try:
        rl_step()
        assert watcher.poll(orchestrator, version + 1) is None  # no request: nothing happens
        write_scale_request(str(tmp_path), env_actors=3)
        records.append(watcher.poll(orchestrator, version + 1))
        assert records[-1]["env_actors_before"] == 1 and records[-1]["env_actors"] == 3
        assert watcher.poll(orchestrator, version + 1) is None  # each request applies once
        assert len(pool.actors) == 3  # the driver's copy follows (profiling, shutdown)
        for _ in range(40):  # the new actors take episodes once ready
            rl_step()
            leases = membership()["leases"]
            if leases[1] > 0 and leases[2] > 0:
                break
        grown = membership()
        assert grown["active"] == [0, 1, 2] and grown["leases"][1] > 0 and grown["leases"][2] > 0

        write_scale_request(str(tmp_path), env_actors=1)
        in_flight = sum(membership()["load"])
        records.append(watcher.poll(orchestrator, version + 1))
        shrunk = membership()
        assert in_flight > 0  # episodes were running when the pool shrank
        assert len(shrunk["active"]) == 1 and len(shrunk["retiring"] + shrunk["retired"]) == 2
        keeper = shrunk["active"][0]
        retired = shrunk["retiring"] + shrunk["retired"]
        leases_at_shrink = shrunk["leases"]
        for _ in range(40):  # the retiring actors drain, then are killed
            rl_step()
            if not membership()["retiring"]:
                break
        for _ in range(3):
            rl_step()
        final = membership()
        # The driver's copy, as of the shrink: the resize's answer. An actor whose last
        # episode ended between that answer and the ``shrunk`` snapshot is retiring in the
        # copy and retired in the snapshot (CI saw [1, 2] against [2]).
        assert set(shrunk["retiring"]) <= set(pool.retiring) <= set(retired)
        assert watcher.poll(orchestrator, version + 1) is None  # no new request, but...
        assert [i for i, _ in pool.members()] == [keeper]  # ...retired actors are not drained
        state = ray_session.get(orchestrator.state.remote())
        ray_session.get(orchestrator.stop.remote(), timeout=60)
    finally:
        ray_session.kill(orchestrator)
        ray_session.kill(engine)
        for actor in pool.actors:
            ray_session.kill(actor)

    # Every episode of every batch completed: none was lost or failed by the resizes.
    assert _statuses(infos) == {"completed": 2 * 2 * len(infos)}
    counters = state["counters"]
    assert counters.get("episodes_env_error", 0) == 0
    assert counters.get("episodes_restarted_env_error", 0) == 0
    assert not [k for k in counters if k.startswith(("groups_filtered", "groups_retried"))]
    assert counters["groups_trained"] == 2 * len(infos) and counters["env_pool_resizes"] == 2
    # Exactly once: every task index handed out is trained on or still in flight.
    assert counters["groups_started"] == state["next_index"]
    assert len(state["pending"]) == state["next_index"] - counters["groups_trained"]
    # The retired actors got no lease after the shrink, and are dead.
    assert final["retired"] == sorted(retired) and final["retiring"] == []
    assert [final["leases"][i] for i in retired] == [leases_at_shrink[i] for i in retired]
    assert final["leases"][keeper] > leases_at_shrink[keeper]
    for i in retired:
        with pytest.raises(ray_session.exceptions.RayActorError):
            ray_session.get(pool.actors[i].pid.remote(), timeout=60)
    assert [r["phase"] for r in records] == ["scale", "scale"]
    assert any("env actors 1 -> 3" in line for line in said)
    assert any("env actors 3 -> 1" in line for line in said)


# -- the sandbox pool --------------------------------------------------------------------


@pytest.mark.slow
def test_sandbox_pool_grows_and_a_retiring_actor_serves_its_work_dirs_then_is_killed(ray_session):
    from raytunix.sandbox.pool import SandboxPool, find_pool

    pool = SandboxPool(num_actors=1, num_cpus=0, max_restarts=0, name="test-scale-sandbox")
    try:
        pool.wait_ready(timeout_s=120)
        client = find_pool("test-scale-sandbox")  # as an env actor's tools find it
        held = [client.open_workspace("before")]
        assert pool.resize(2) == {"active": [0, 1], "retiring": [], "retired": []}
        pool.wait_ready(timeout_s=120)
        client.refresh()  # (a client also looks again on its own every few seconds)
        for i in range(40):
            held.append(client.open_workspace(f"w{i}"))
            if {w.split(":")[0] for w in held} == {"0", "1"}:
                break
        assert {w.split(":")[0] for w in held} == {"0", "1"}  # the new actor gets work dirs
        on_1 = [w for w in held if w.startswith("1:")]

        shrunk = pool.resize(1)
        # Both hold work dirs; the newest of the least-loaded retires and serves its own.
        retiring = shrunk["retiring"]
        assert shrunk["active"] + retiring == [0, 1] and len(retiring) == 1
        mine = [w for w in held if w.startswith(f"{retiring[0]}:")] or on_1
        assert client.run(mine[0], ["echo", "still here"]).stdout == "still here\n"
        fresh = [client.open_workspace(f"after{i}") for i in range(8)]  # a stale client too
        assert {w.split(":")[0] for w in fresh} == {str(shrunk["active"][0])}
        assert pool.reap() == []  # it still holds work dirs
        for w in held:
            client.close_workspace(w)
        for w in fresh:
            client.close_workspace(w)
        assert pool.reap() == retiring
        assert pool.membership()["retired"] == retiring and pool.size == 1
        with pytest.raises(ray_session.exceptions.RayActorError):
            ray_session.get(client.actors[retiring[0]].stats.remote(), timeout=30)

        # A client that starts now never sees the retired actor; growing again takes a new
        # index (never the retired one's name).
        assert sorted(find_pool("test-scale-sandbox").actors) == shrunk["active"]
        regrown = pool.resize(2)
        assert regrown["active"] == [*shrunk["active"], 2] and regrown["retired"] == retiring
        pool.wait_ready(timeout_s=120)
        client.refresh()
        assert sorted(i for i in client.actors if i not in client._dead) == regrown["active"]
    finally:
        pool.shutdown()


# -- (c) the request file: CLI and driver-side reader -------------------------------------


def test_scale_cli_writes_the_request_atomically_and_rejects_bad_input(tmp_path, capsys):
    from raytunix.cli import main
    from raytunix.cluster.scaling import SCALE_FILE, read_scale_request

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")
    assert main(["scale", str(run_dir), "--env-actors", "6"]) == 0
    first = read_scale_request(str(run_dir))
    assert (first.env_actors, first.sandbox_actors) == (6, None)
    assert "6 env actors" in capsys.readouterr().out
    assert main(["scale", str(run_dir), "--env-actors", "2", "--sandbox-actors", "3"]) == 0
    second = read_scale_request(str(run_dir))
    assert (second.env_actors, second.sandbox_actors) == (2, 3)
    assert second.request_id != first.request_id
    assert sorted(os.listdir(run_dir)) == ["config.yaml", SCALE_FILE]  # no temp file left

    for argv, named in [
        (["--env-actors", "0"], "--env-actors 0"),
        (["--env-actors", "-3"], "--env-actors -3"),
        (["--env-actors", "four"], "--env-actors 'four'"),
        (["--env-actors", "2.5"], "--env-actors '2.5'"),
        (["--sandbox-actors", "0"], "--sandbox-actors 0"),
        ([], "nothing to scale"),
    ]:
        assert main(["scale", str(run_dir), *argv]) == 2
        assert named in capsys.readouterr().err
    assert read_scale_request(str(run_dir)) == second  # a bad request leaves the file alone

    missing = str(tmp_path / "nope")
    assert main(["scale", missing, "--env-actors", "2"]) == 2
    assert repr(missing) in capsys.readouterr().err
    assert main(["scale", str(tmp_path), "--env-actors", "2"]) == 2
    assert "no config.yaml" in capsys.readouterr().err


class _RecordingOrchestrator:
    """The orchestrator's ``resize_env_pool`` as the driver calls it (``.remote`` then
    ``ray.get``), backed by a real ``EnvPool`` object held here."""

    def __init__(self, pool):
        self.pool = pool
        self.resize_env_pool = self

    def remote(self, n):
        import ray

        return ray.put(self.pool.resize(n))


@pytest.mark.slow
def test_the_driver_applies_each_request_once_and_reports_a_bad_file_once(ray_session, tmp_path):
    from ray import cloudpickle

    from raytunix.rollout.env_pool import EnvPool
    from raytunix.cluster.scaling import SCALE_FILE, ScaleWatcher, write_scale_request

    (tmp_path / "config.yaml").write_text("{}\n")
    orchestrator_copy = EnvPool("calculator_math", {}, num_actors=1, max_restarts=0)
    driver_copy = cloudpickle.loads(cloudpickle.dumps(orchestrator_copy))  # as Ray ships it
    said: list[str] = []
    watcher = ScaleWatcher(str(tmp_path), driver_copy, sandbox_pool=None, say=said.append)
    orchestrator = _RecordingOrchestrator(orchestrator_copy)
    try:
        write_scale_request(str(tmp_path), env_actors=2, sandbox_actors=4)
        record = watcher.poll(orchestrator, 7)
        assert record["phase"] == "scale" and record["step"] == 7
        assert record["env_actors"] == 2 and record["env_starting"] == [1]
        assert "no sandbox pool" in record["sandbox_error"]  # this run has none
        assert driver_copy.size == 2 and len(driver_copy.actors) == 2
        assert watcher.poll(orchestrator, 8) is None

        (tmp_path / SCALE_FILE).write_text('{"request_id": "x", "env_actors": 0}')
        bad = watcher.poll(orchestrator, 9)
        assert "env_actors 0 is below 1" in bad["error"]
        assert watcher.poll(orchestrator, 10) is None  # said once, not every step
        (tmp_path / SCALE_FILE).write_text("{not json")
        assert "is not JSON" in watcher.poll(orchestrator, 11)["error"]
        assert orchestrator_copy.size == 2  # the run goes on at its size
        assert len([line for line in said if "ignored" in line]) == 2
    finally:
        for actor in orchestrator_copy.actors:
            ray_session.kill(actor)


@pytest.mark.slow
def test_resize_rejects_a_size_that_is_not_a_whole_number_of_at_least_one(ray_session):
    from raytunix.rollout.env_pool import EnvPool

    pool = EnvPool("calculator_math", {}, num_actors=1, max_restarts=0)
    try:
        for bad in (0, -1, 2.0, True, "3"):
            with pytest.raises(ValueError, match=f"num_actors={bad!r}"):
                pool.resize(bad)
        assert pool.size == 1
    finally:
        ray_session.kill(pool.actors[0])


# -- (b) a multi-node cluster: env actors only on the nodes offering their resource -------


@pytest.mark.slow
@pytest.mark.cluster
def test_env_actors_land_only_on_env_nodes_and_a_run_grows_and_shrinks_there(tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_ADDRESS="")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(__file__), *filter(None, [env.get("PYTHONPATH")])]
    )
    done = subprocess.run(
        [sys.executable, __file__, str(out)],
        env=env,
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(out.read_text())
    env_nodes, other = set(result["env_nodes"]), result["other_node"]
    assert other not in env_nodes
    assert set(result["placed_at_start"]) <= env_nodes
    assert set(result["placed_after_growth"]) <= env_nodes
    assert len(set(result["placed_after_growth"])) == 2  # 3 actors, 2 fit per node: both used
    assert result["unplaceable_got_leases"] == 0  # past the nodes' capacity: no episode waits
    assert result["starting_past_capacity"] == 1
    assert result["statuses"] == {"completed": result["episodes"]} and result["episodes"] > 0
    assert result["new_actor_leases"] > 0
    assert result["retired_dead"] is True


def _cluster_scenario(out_path: str) -> None:
    """Head (1 CPU, no env resource) + two nodes offering ``raytunix_env: 2``: a run's
    env pool starts with 2 actors, grows to 3 while batches are made, is asked for 5
    (1 past capacity: it stays starting, with no lease), then shrinks to 2."""
    import ray
    from ray.cluster_utils import Cluster

    from raytunix.agents import ToolAgent
    from raytunix.rollout.env_pool import EnvPool
    from raytunix.rollout.orchestrator import RolloutOrchestrator

    small = {"num_cpus": 1, "object_store_memory": 80 * 1024**2}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    env_nodes = [cluster.add_node(**small, resources={ENV_RESOURCE: 2}) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        pool = EnvPool(
            "calculator_math", {}, num_actors=2, max_restarts=0, resources={ENV_RESOURCE: 1}
        )
        pool.wait_ready(timeout_s=120)
        result = {
            "env_nodes": [n.node_id for n in env_nodes],
            "other_node": cluster.head_node.node_id,
        }
        result["placed_at_start"] = ray.get([a.node_id.remote() for a in pool.actors])

        def env_provider(group_id):
            env, index = pool.lease(group_id)
            return env, lambda: pool.release(index)

        async def run() -> dict:
            kwargs = _orchestrator_kwargs()
            for key in ("tokenizer", "agent_name"):
                kwargs.pop(key)
            orch = RolloutOrchestrator(
                agent_factory=lambda: ToolAgent(TOK),
                engine=SlowEngine(),
                env_provider=env_provider,
                **kwargs,
            )
            infos = []

            async def steps(n):
                for _ in range(n):
                    _, info = await asyncio.wait_for(orch.next_batch(), 120)
                    orch.mark_trained(info["batch_id"], len(infos) + 1)
                    infos.append(info)

            await steps(2)
            pool.resize(3)
            deadline = time.monotonic() + 180
            while pool.membership()["starting"] and time.monotonic() < deadline:
                await steps(1)
            await steps(2)
            grown = pool.membership()
            result["placed_after_growth"] = ray.get(
                [pool.actors[i].node_id.remote() for i in grown["active"]]
            )
            result["new_actor_leases"] = sum(grown["leases"][2:3])
            pool.resize(5)  # 4 fit on the env nodes: 1 waits for a node (none comes)
            await steps(1)
            while len(pool.membership()["starting"]) > 1 and time.monotonic() < deadline:
                await steps(1)
            past = pool.membership()
            result["starting_past_capacity"] = len(past["starting"])
            result["unplaceable_got_leases"] = sum(past["leases"][i] for i in past["starting"])
            pool.resize(2)
            while pool.membership()["retiring"] and time.monotonic() < deadline:
                await steps(1)
            await steps(1)
            await orch.stop()
            return {"infos": infos, "membership": pool.membership()}

        ran = asyncio.run(run())
        result["statuses"] = _statuses(ran["infos"])
        result["episodes"] = sum(info["num_trajectories"] for info in ran["infos"])
        retired = ran["membership"]["retired"]
        dead = []
        for i in retired:
            try:
                ray.get(pool.actors[i].pid.remote(), timeout=30)
                dead.append(False)
            except ray.exceptions.RayActorError:
                dead.append(True)
        result["retired_dead"] = len(retired) == 3 and all(dead)
        with open(out_path, "w") as f:
            json.dump(result, f)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    _cluster_scenario(sys.argv[1])
