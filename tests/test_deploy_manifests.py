"""deploy/ is checked without a cluster: the GKE manifests render, their Kubernetes objects
(and every pod template inside the Ray ones) pass Kubernetes' published schema, their KubeRay
fields pass a schema written from KubeRay's API reference (tests/kuberay_v1_fields.schema.json),
and their TPU worker groups follow GKE's TPU rules. Each check is also shown to reject a
manifest broken the way a hand edit would break it.
"""

from __future__ import annotations

import copy
import glob
import json
import math
import os
import re
import shlex
import string

import jsonschema
import kubernetes_validate
import pytest
import ray
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
GKE_FILES = sorted(glob.glob(os.path.join(DEPLOY, "gke", "*.yaml")))
K8S_VERSION = "1.33.0"  # a GKE version with TPU v6e (>= 1.31.2)
IMAGE = "us-docker.pkg.dev/my-project/raytunix/raytunix:0.1.0"

with open(os.path.join(os.path.dirname(__file__), "kuberay_v1_fields.schema.json")) as f:
    KUBERAY = jsonschema.Draft202012Validator(json.load(f))

# GKE's TPU node labels: accelerator -> the slice topologies it offers. Single-host slices
# are one VM of 1, 4 or 8 chips (1x1, 2x2, 2x4); multi-host slices are VMs of 4 chips each.
TPU_TOPOLOGIES = {
    "tpu-v5-lite-podslice": {"1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"},
    "tpu-v6e-slice": {"1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"},
}


def render(path: str) -> list[dict]:
    """The objects of one manifest with ${IMAGE} filled in, as `envsubst` would."""
    with open(path) as f:
        text = string.Template(f.read()).substitute(IMAGE=IMAGE)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def cluster_spec(obj: dict) -> dict:
    return obj["spec"] if obj["kind"] == "RayCluster" else obj["spec"]["rayClusterSpec"]


def pod_templates(obj: dict) -> dict[str, dict]:
    """Every core/v1 PodTemplateSpec inside a RayCluster or RayJob, by where it sits."""
    spec = cluster_spec(obj)
    found = {"headGroupSpec": spec["headGroupSpec"]["template"]}
    for group in spec.get("workerGroupSpecs", []):
        found[f"workerGroupSpecs[{group['groupName']}]"] = group["template"]
    if obj["kind"] == "RayJob" and "submitterPodTemplate" in obj["spec"]:
        found["submitterPodTemplate"] = obj["spec"]["submitterPodTemplate"]
    return found


def core_errors(obj: dict) -> list[str]:
    """Kubernetes schema errors of a core object, or of the pod templates in a Ray one."""
    if obj["apiVersion"] != "ray.io/v1":
        checks = {obj["kind"]: obj}
    else:
        checks = {
            where: {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "check"},
                "template": template,
            }
            for where, template in pod_templates(obj).items()
        }
    errors = []
    for where, data in checks.items():
        try:
            kubernetes_validate.validate(data, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{where}: {e.message}")
    return errors


def kuberay_errors(obj: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in KUBERAY.iter_errors(obj)]


def _container(group: dict) -> dict:
    (container,) = [
        c
        for c in group["template"]["spec"]["containers"]
        if c["name"] in ("ray-worker", "ray-head")
    ]
    return container


def tpu_errors(obj: dict) -> list[str]:
    """GKE's TPU rules for every worker group that requests TPUs (see TPU_TOPOLOGIES)."""
    errors = []
    for group in cluster_spec(obj).get("workerGroupSpecs", []):
        resources = _container(group).get("resources", {})
        requests, limits = resources.get("requests", {}), resources.get("limits", {})
        if "google.com/tpu" not in requests and "google.com/tpu" not in limits:
            continue
        name = group["groupName"]
        if str(requests.get("google.com/tpu")) != str(limits.get("google.com/tpu")):
            errors.append(
                f"{name}: google.com/tpu requests {requests.get('google.com/tpu')} "
                f"!= limits {limits.get('google.com/tpu')}"
            )
            continue
        selector = group["template"]["spec"].get("nodeSelector", {})
        accelerator = selector.get("cloud.google.com/gke-tpu-accelerator")
        topology = selector.get("cloud.google.com/gke-tpu-topology")
        if accelerator not in TPU_TOPOLOGIES:
            errors.append(f"{name}: accelerator selector {accelerator!r} is not v5e/v6e")
            continue
        if topology not in TPU_TOPOLOGIES[accelerator]:
            errors.append(f"{name}: topology selector {topology!r} is not one of {accelerator}'s")
            continue
        chips = math.prod(int(n) for n in topology.split("x"))
        per_host, hosts = int(limits["google.com/tpu"]), group.get("numOfHosts", 1)
        if hosts * per_host != chips:
            errors.append(
                f"{name}: numOfHosts {hosts} x {per_host} chips != {chips} chips of {topology}"
            )
        elif hosts > 1 and per_host != 4:
            errors.append(f"{name}: multi-host VMs have 4 chips, not {per_host}")
    return errors


MANIFESTS = {os.path.basename(path): render(path) for path in GKE_FILES}
RAY_OBJECTS = {
    name: obj
    for name, docs in MANIFESTS.items()
    for obj in docs
    if obj["apiVersion"] == "ray.io/v1"
}


def test_deploy_holds_clusters_and_jobs_for_v5e_and_v6e_single_and_multi_host():
    shapes = set()
    for obj in RAY_OBJECTS.values():
        for group in cluster_spec(obj)["workerGroupSpecs"]:
            selector = group["template"]["spec"]["nodeSelector"]
            if "cloud.google.com/gke-tpu-accelerator" in selector:
                shapes.add(
                    (
                        obj["kind"],
                        selector["cloud.google.com/gke-tpu-accelerator"],
                        group.get("numOfHosts", 1) > 1,
                    )
                )
    assert {(a, m) for _, a, m in shapes} == {(a, m) for a in TPU_TOPOLOGIES for m in (False, True)}
    assert {kind for kind, _, _ in shapes} == {"RayCluster", "RayJob"}


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_passes_kubernetes_kuberay_and_gke_tpu_checks(name):
    for obj in MANIFESTS[name]:
        assert core_errors(obj) == []
        if obj["apiVersion"] == "ray.io/v1":
            assert kuberay_errors(obj) == []
            assert tpu_errors(obj) == []


@pytest.mark.parametrize("name", sorted(RAY_OBJECTS))
def test_ray_cluster_has_token_auth_a_zero_cpu_head_and_an_autoscaled_env_group(name):
    spec = cluster_spec(RAY_OBJECTS[name])
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert spec["enableInTreeAutoscaling"] is True
    (env,) = [
        g
        for g in spec["workerGroupSpecs"]
        if "raytunix_env" in g["rayStartParams"].get("resources", "")
    ]
    custom = json.loads(json.loads(env["rayStartParams"]["resources"]))  # KubeRay's quoting
    assert custom["raytunix_env"] > 0
    assert env["minReplicas"] <= env["replicas"] <= env["maxReplicas"]
    assert env["maxReplicas"] > env["minReplicas"]
    container = _container(env)
    assert "google.com/tpu" not in container["resources"]["limits"]
    assert {"name": "JAX_PLATFORMS", "value": "cpu"} in container["env"]
    # every pod mounts the shared run directory the entrypoints write to
    for template in pod_templates(RAY_OBJECTS[name]).values():
        assert any(
            v.get("persistentVolumeClaim", {}).get("claimName") == "raytunix-runs"
            for v in template["spec"]["volumes"]
        )


def _tpu_group(obj: dict) -> dict:
    return next(
        g
        for g in cluster_spec(obj)["workerGroupSpecs"]
        if "google.com/tpu" in _container(g)["resources"]["limits"]
    )


def test_the_checks_reject_broken_manifests():
    multi = copy.deepcopy(RAY_OBJECTS["raycluster-v6e-4x4.yaml"])
    _tpu_group(multi)["numOfHosts"] = 2
    assert "numOfHosts 2 x 4 chips != 16 chips" in " ".join(tpu_errors(multi))

    unequal = copy.deepcopy(RAY_OBJECTS["rayjob-v5e-4x4.yaml"])
    _container(_tpu_group(unequal))["resources"]["requests"]["google.com/tpu"] = "2"
    assert "requests 2 != limits 4" in " ".join(tpu_errors(unequal))

    no_topology = copy.deepcopy(RAY_OBJECTS["raycluster-v5e-2x4.yaml"])
    del _tpu_group(no_topology)["template"]["spec"]["nodeSelector"][
        "cloud.google.com/gke-tpu-topology"
    ]
    assert "topology selector None" in " ".join(tpu_errors(no_topology))

    typo = copy.deepcopy(RAY_OBJECTS["rayjob-v6e-2x4.yaml"])
    typo["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["numOfHost"] = 1
    typo["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "tokens"
    errors = " ".join(kuberay_errors(typo))
    assert "'numOfHost' was unexpected" in errors and "'tokens' is not one of" in errors

    bad_pod = copy.deepcopy(RAY_OBJECTS["raycluster-v5e-2x4.yaml"])
    _container(_tpu_group(bad_pod))["ports"][0]["containerPort"] = "8471"
    assert any("containerPort" in e or "8471" in e for e in core_errors(bad_pod))


# GKE's TPU accelerator label -> the learner.tpu_version raytunix (Ray) knows it by.
TPU_VERSIONS = {"tpu-v5-lite-podslice": "v5litepod", "tpu-v6e-slice": "v6e"}


def entrypoint_config(job: dict):
    """The config a RayJob's `raytunix train` entrypoint resolves to (load_config)."""
    from raytunix.config import load_config

    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["raytunix", "train", "--config", "default"], argv
    return load_config("default", argv[4:])


def placement_errors(job: dict) -> list[str]:
    """The entrypoint's learner spans every host of the TPU group with all its chips, as one
    slice, and env actors ask for what the env group offers (never a TPU)."""
    cfg, tpu = entrypoint_config(job), _tpu_group(job)
    hosts, chips = (
        tpu.get("numOfHosts", 1),
        int(_container(tpu)["resources"]["limits"]["google.com/tpu"]),
    )
    selector = tpu["template"]["spec"]["nodeSelector"]
    (env,) = [
        g
        for g in cluster_spec(job)["workerGroupSpecs"]
        if "raytunix_env" in g["rayStartParams"].get("resources", "")
    ]
    offered = json.loads(json.loads(env["rayStartParams"]["resources"]))
    learner, errors = cfg.learner, []
    if learner.num_hosts != hosts:
        errors.append(f"learner.num_hosts={learner.num_hosts} != numOfHosts {hosts}")
    if learner.resources != {"TPU": chips}:
        errors.append(f"learner.resources={learner.resources} != {{TPU: {chips}}}")
    if (learner.tpu_topology, learner.tpu_version) != (
        selector["cloud.google.com/gke-tpu-topology"],
        TPU_VERSIONS[selector["cloud.google.com/gke-tpu-accelerator"]],
    ):
        errors.append(
            f"learner.tpu_topology/tpu_version {learner.tpu_topology}/"
            f"{learner.tpu_version} is not the group's slice {selector}"
        )
    if not cfg.env.actor_resources or not set(cfg.env.actor_resources) <= set(offered):
        errors.append(
            f"env.actor_resources={cfg.env.actor_resources} not offered by the env "
            f"group ({offered})"
        )
    return errors


@pytest.mark.parametrize("name", sorted(n for n, o in RAY_OBJECTS.items() if o["kind"] == "RayJob"))
def test_rayjob_entrypoint_places_the_learner_on_its_slice_and_env_actors_on_the_env_group(name):
    assert placement_errors(RAY_OBJECTS[name]) == []
    single = copy.deepcopy(RAY_OBJECTS[name])
    single["spec"]["entrypoint"] = re.sub(
        r" learner\.num_hosts=\d+", "", single["spec"]["entrypoint"]
    )
    single["spec"]["entrypoint"] = re.sub(
        r" env\.actor_resources\.\S+", "", single["spec"]["entrypoint"]
    )
    if _tpu_group(single).get("numOfHosts", 1) > 1:  # the slice's host count is checked
        from raytunix.config import ConfigError

        with pytest.raises(ConfigError, match="set learner.num_hosts=4"):
            entrypoint_config(single)
    else:
        assert "env.actor_resources={}" in " ".join(placement_errors(single))


def test_rendering_leaves_no_placeholder_but_the_image():
    for path in GKE_FILES:
        with open(path) as f:
            names = {
                m.group(1) or m.group(2) for m in re.finditer(r"\$\{(\w+)\}|\$(\w+)", f.read())
            }
        assert names <= {"IMAGE"}, (path, names)


def test_image_and_manifests_use_the_ray_version_of_the_client():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        (version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", f.read(), re.MULTILINE)
    assert version == ray.__version__
    assert {cluster_spec(obj)["rayVersion"] for obj in RAY_OBJECTS.values()} == {version}


def test_tpu_vm_launcher_config():
    with open(os.path.join(DEPLOY, "tpu-vm", "cluster.yaml")) as f:
        cfg = yaml.safe_load(f)
    nodes = cfg["available_node_types"]
    assert nodes[cfg["head_node_type"]]["resources"] == {"CPU": 0}
    tpu = [n for n in nodes.values() if "acceleratorType" in n["node_config"]]
    assert tpu and all(
        re.fullmatch(r"(v5litepod|v6e)-\d+", n["node_config"]["acceleratorType"]) for n in tpu
    )
    env = [n for n in nodes.values() if "raytunix_env" in n["resources"]]
    assert env and all(n["max_workers"] > n["min_workers"] for n in env)
    assert cfg["max_workers"] >= sum(n["max_workers"] for n in nodes.values())
    assert any("ray[default]==" + ray.__version__ in c for c in cfg["setup_commands"])
