"""Placement by resources (issue 10 item 1), on a simulated cluster of its own: a 4-host
TPU v6e-16 slice (topology 4x4) and two CPU nodes offering ``raytunix_env``. Learner
hosts land one per TPU host, ranked by the hosts' TPU worker ids (not by placement group
bundle), and env actors land only on the CPU nodes.

The cluster (``ray.cluster_utils.Cluster``) runs in a subprocess: this process may hold
the session's Ray, and one process can be connected to one cluster only. The simulated
TPU nodes carry what Ray derives on a real TPU VM: the ``TPU`` resource, the
``accelerator_type:TPU-V6E`` and ``TPU-v6e-16-head`` (worker 0) resources, the
``ray.io/tpu-*`` node labels, and ``TPU_NAME`` / ``TPU_WORKER_ID`` in the raylet's
environment (which Ray's slice reservation reads in a task on worker 0)."""

import json
import subprocess
import sys
import textwrap

import pytest

SCENARIO = textwrap.dedent('''
    import json, os, random
    os.environ.pop("JAX_PLATFORMS", None)  # learner hosts must not inherit a CPU-only env
    import ray
    from ray.cluster_utils import Cluster

    from raytunix.learner.group import place_learner_hosts
    from raytunix.cluster.placement import LearnerHostsSpec, cpu_actor_options
    from raytunix.rollout.env_pool import EnvPool

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"raytunix_env": 4}, "include_dashboard": False})
    worker_ids = [0, 1, 2, 3]
    random.Random(7).shuffle(worker_ids)  # nodes join out of worker-id order
    tpu_nodes = {}
    for w in worker_ids:
        resources = {"TPU": 4, "accelerator_type:TPU-V6E": 1}
        if w == 0:
            resources["TPU-v6e-16-head"] = 1
        node = cluster.add_node(
            wait=False, num_cpus=1, resources=resources,
            labels={"ray.io/tpu-worker-id": str(w), "ray.io/tpu-slice-name": "slice-a",
                    "ray.io/tpu-pod-type": "v6e-16", "ray.io/tpu-topology": "4x4",
                    "ray.io/accelerator-type": "TPU-V6E"},
            env_vars={"TPU_NAME": "slice-a", "TPU_WORKER_ID": str(w),
                      "TPU_ACCELERATOR_TYPE": "v6e-16", "TPU_TOPOLOGY": "4x4"})
        tpu_nodes[node.node_id] = w
    cpu_node = cluster.add_node(wait=False, num_cpus=1, resources={"raytunix_env": 4})
    cluster.wait_for_nodes(timeout=120)
    ray.init(address=cluster.address, log_to_driver=False)
    head_id = cluster.head_node.node_id

    spec = LearnerHostsSpec(num_hosts=4, resources={"TPU": 4}, tpu_topology="4x4",
                            tpu_version="v6e")
    reservation, hosts, infos = place_learner_hosts(spec, timeout_s=120)

    pool = EnvPool("calculator_math", {}, num_actors=4, resources={"raytunix_env": 1},
                   threads_per_actor=2)
    pool.wait_ready(timeout_s=120)
    env_nodes = [ray._private.state.actors(a._actor_id.hex())["Address"]["NodeID"]
                 for a in pool.actors]

    @ray.remote
    def probe():
        return os.environ.get("JAX_PLATFORMS")

    cpu_probe = ray.get(probe.options(**cpu_actor_options({"raytunix_env": 1})).remote())
    print(json.dumps({
        "tpu_nodes": tpu_nodes, "cpu_nodes": [head_id, cpu_node.node_id],
        "hosts": infos, "env_nodes": env_nodes, "cpu_probe": cpu_probe,
        "bundle_nodes": reservation.node_ids}))
    reservation.release()
    ray.shutdown()
    cluster.shutdown()
''')


@pytest.fixture(scope="module")
def scenario():
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.cluster
def test_learner_hosts_land_one_per_tpu_host_ranked_by_worker_id(scenario):
    tpu_nodes = scenario["tpu_nodes"]  # node id -> worker id
    hosts = scenario["hosts"]  # rank order
    assert [h["rank"] for h in hosts] == [0, 1, 2, 3]
    assert sorted(h["node_id"] for h in hosts) == sorted(tpu_nodes)  # one per TPU host
    for h in hosts:  # the rank is the host's worker id, read where the actor runs
        assert h["worker_id"] == tpu_nodes[h["node_id"]] == h["rank"]
    # Each host knows its bundle, and its rank is its worker id whatever bundle it is in.
    # Ray decides which bundle goes to which node: the nodes join out of worker-id order,
    # yet in 2 of the last 7 clean-clone runs it put bundle b on worker b anyway (a test
    # that required otherwise failed CI twice), and then this check cannot tell ranking by
    # bundle from ranking by worker id. test_learner_ranks_come_from_worker_ids_and_are_checked
    # covers a shuffled bundle order (assign_ranks([2, 0, 3, 1])) every time.
    bundles = [tpu_nodes[node] for node in scenario["bundle_nodes"]]
    assert sorted(bundles) == [0, 1, 2, 3]
    assert [hosts[r]["bundle_index"] for r in range(4)] == [bundles.index(r) for r in range(4)]


@pytest.mark.slow
@pytest.mark.cluster
def test_env_actors_land_only_on_cpu_nodes_and_never_see_the_tpu(scenario):
    assert set(scenario["env_nodes"]) <= set(scenario["cpu_nodes"])
    assert len(scenario["env_nodes"]) == 4
    assert scenario["cpu_probe"] == "cpu"  # cpu_actor_options: JAX_PLATFORMS=cpu


def test_learner_ranks_come_from_worker_ids_and_are_checked():
    from raytunix.cluster.placement import assign_ranks

    assert assign_ranks([2, 0, 3, 1]) == [2, 0, 3, 1]
    assert assign_ranks([None, None]) == [0, 1]
    with pytest.raises(ValueError, match=r"some hosts have one and some not"):
        assign_ranks([0, None])
    with pytest.raises(ValueError, match=r"\[0, 0\] .*not 0..1 each once"):
        assign_ranks([0, 0])


def test_env_actors_may_not_ask_for_an_accelerator():
    from raytunix.cluster.placement import cpu_actor_options

    with pytest.raises(ValueError, match="TPU.*JAX_PLATFORMS=cpu"):
        cpu_actor_options({"TPU": 1})
    with pytest.raises(ValueError, match="raytunix_env=0"):
        cpu_actor_options({"raytunix_env": 0})
    assert cpu_actor_options({"raytunix_env": 1}) == {
        "num_cpus": 0,
        "resources": {"raytunix_env": 1},
        "runtime_env": {"env_vars": {"JAX_PLATFORMS": "cpu"}},
    }


def test_placement_config_keys_are_validated_with_the_fix_in_the_message():
    from raytunix.config import ConfigError, load_config
    from raytunix.cluster.placement import LearnerHostsSpec

    slice_keys = [
        "learner.num_hosts=4",
        "learner.resources.TPU=4",
        "learner.tpu_topology=4x4",
        "learner.tpu_version=v6e",
        "engine.placement=disaggregated",
    ]
    cfg = load_config(None, [*slice_keys, "env.actor_resources.raytunix_env=1"])
    spec = LearnerHostsSpec.from_config(cfg.learner)
    assert (spec.num_hosts, spec.resources, spec.strategy) == (4, {"TPU": 4}, "STRICT_SPREAD")
    assert cfg.env.actor_resources == {"raytunix_env": 1}
    assert load_config(None).learner.num_hosts == 1  # one learner actor, as before

    bad = {
        "learner.num_hosts=2": "needs engine.placement=disaggregated",
        "learner.num_hosts=0": "learner.num_hosts=0 must be > 0",
        "env.actor_resources.TPU=1": "env.actor_resources asks for TPU",
        "learner.resources.TPU=0": "learner.resources: TPU=0 must be a positive number",
        "learner.resources=3": "learner.resources=3 must be a mapping",
        "learner.tpu_topology=4x4": "set both",
        "learner.placement_strategy=spread": "not one of STRICT_SPREAD",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="makes 4 learner hosts.*set learner.num_hosts=4"):
        load_config(None, [*slice_keys, "learner.num_hosts=2"])
    with pytest.raises(ConfigError, match="'4x5' is not a topology of TPU v6e"):
        load_config(None, [*slice_keys, "learner.tpu_topology=4x5"])


def test_engine_and_single_learner_resources():
    from raytunix.config import ConfigError, load_config
    from raytunix.cluster.placement import LearnerHostsSpec

    cfg = load_config(
        None,
        [
            "engine.placement=disaggregated",
            "engine.actor_resources.TPU=4",
            "learner.resources.TPU=8",
            "learner.resources.CPU=4",
        ],
    )
    assert cfg.engine.actor_resources == {"TPU": 4}
    assert LearnerHostsSpec.from_config(cfg.learner).actor_options() == {
        "num_cpus": 4,
        "num_gpus": 0,
        "resources": {"TPU": 8},
    }
    assert LearnerHostsSpec().actor_options() == {"num_cpus": 1.0, "num_gpus": 0, "resources": {}}
    with pytest.raises(ConfigError, match="engine.actor_resources=.*disaggregated"):
        load_config(None, ["engine.actor_resources.TPU=4"])
