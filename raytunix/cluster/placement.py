"""Where a run's actors go, from its config: Ray resources and node labels, never host names.

* **Learner hosts**: one actor per host of the learner's slice, reserved together as one
  placement group (``reserve_learner_hosts``). On a TPU slice (``learner.tpu_topology``
  and ``learner.tpu_version`` set) the reservation is Ray's own slice placement group
  (``ray.util.tpu.SlicePlacementGroup``): Ray first claims the slice through its
  ``TPU-<pod type>-head`` resource on worker 0, then reserves one bundle of
  ``{"TPU": chips per host}`` on every host carrying that slice's
  ``ray.io/tpu-slice-name`` label. Otherwise it is a plain placement group of
  ``learner.num_hosts`` bundles of ``learner.resources`` with
  ``learner.placement_strategy`` (``STRICT_SPREAD``: one bundle per node).
* **The JAX process rank of a learner host** is the host's TPU worker id
  (``tpu_worker_id``: the node's ``ray.io/tpu-worker-id`` label, which Ray sets from
  ``TPU_WORKER_ID`` on GKE or the VM metadata's ``agent-worker-number`` on TPU VMs), not
  the bundle index: Ray may fill bundle 0 with any host of the slice, and libtpu numbers
  the hosts of a slice by worker id. Hosts without a worker id (CPU nodes, a local run)
  take their bundle index (``assign_ranks``).
* **Env and sandbox actors** ask for a custom resource (``env.actor_resources``, e.g.
  ``{raytunix_env: 1}``; ``sandbox.resource``) that only CPU node pools offer, and run
  with ``JAX_PLATFORMS=cpu`` (``CPU_ONLY_RUNTIME_ENV``), so they never take a TPU: libtpu
  lets one process per host hold it (``cpu_actor_options``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, get_args

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytunix.config import PlacementStrategy

__all__ = [
    "CPU_ONLY_RUNTIME_ENV",
    "PLACEMENT_STRATEGIES",
    "TPU_WORKER_ID_LABEL",
    "LearnerHosts",
    "LearnerHostsSpec",
    "assign_ranks",
    "cpu_actor_options",
    "reserve_learner_hosts",
    "tpu_worker_id",
]

# Actors that must never take the accelerator (env, sandbox, orchestrator).
CPU_ONLY_RUNTIME_ENV = {"env_vars": {"JAX_PLATFORMS": "cpu"}}
PLACEMENT_STRATEGIES: tuple[str, ...] = get_args(PlacementStrategy)  # learner.placement_strategy
TPU_WORKER_ID_LABEL = "ray.io/tpu-worker-id"  # ray._raylet.RAY_NODE_TPU_WORKER_ID_KEY
TPU_WORKER_ID_ENV = "TPU_WORKER_ID"  # set by GKE on TPU pods
BUILTIN_RESOURCES = ("CPU", "GPU", "TPU", "memory", "object_store_memory")


@dataclasses.dataclass(frozen=True)
class LearnerHostsSpec:
    """What the learner's hosts need (``learner.*`` keys of the config).

    Attributes:
      num_hosts: learner actors, one per host (JAX processes of the learner's program).
      resources: Ray resources of each host's bundle, e.g. ``{"TPU": 4}``; empty: one CPU.
      strategy: placement group strategy (``PLACEMENT_STRATEGIES``); ``STRICT_SPREAD`` puts
        each bundle on its own node.
      tpu_topology: the learner slice's TPU topology (e.g. ``"4x4"``); with
        ``tpu_version``, the hosts are reserved as a slice through ``ray.util.tpu``.
      tpu_version: the TPU generation (e.g. ``"v6e"``, ``"v5p"``, ``"TPU-V6E"``).
    """

    num_hosts: int = 1
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    strategy: str = "STRICT_SPREAD"
    tpu_topology: str = ""
    tpu_version: str = ""

    def __post_init__(self):
        if self.num_hosts < 1:
            raise ValueError(f"num_hosts={self.num_hosts}: the learner needs at least one host.")
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"strategy={self.strategy!r} is not one of {', '.join(PLACEMENT_STRATEGIES)}."
            )
        check_resources("learner.resources", self.resources)
        if bool(self.tpu_topology) != bool(self.tpu_version):
            raise ValueError(
                f"tpu_topology={self.tpu_topology!r} and tpu_version={self.tpu_version!r}: "
                "give both (e.g. 4x4 and v6e) to reserve a TPU slice, or neither."
            )

    @classmethod
    def from_config(cls, learner) -> LearnerHostsSpec:
        """From the config's ``learner`` section (``raytunix.config.LearnerConfig``)."""
        return cls(
            num_hosts=learner.num_hosts,
            resources=dict(learner.resources),
            strategy=learner.placement_strategy,
            tpu_topology=learner.tpu_topology,
            tpu_version=learner.tpu_version,
        )

    @property
    def bundle(self) -> dict[str, float]:
        """The resources of one host's bundle: ``resources``, or one CPU when empty."""
        return dict(self.resources) or {"CPU": 1.0}

    def actor_options(self) -> dict[str, Any]:
        """``.options()`` of a single learner actor (``num_hosts == 1``: no placement
        group) asking for one host's ``bundle``."""
        return resource_options(self.bundle)


def resource_options(bundle: dict[str, float]) -> dict[str, Any]:
    """``bundle`` (Ray resource name -> amount) as ``.options()`` keywords: ``num_cpus``
    and ``num_gpus`` (0 when absent), ``memory`` (bytes, when given), the rest as custom
    ``resources``."""
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    if "memory" in bundle:
        options["memory"] = bundle["memory"]
    options["resources"] = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    return options


def check_resources(key: str, resources: Any, *, allow_accelerators: bool = True) -> None:
    """Raises ``ValueError`` naming ``key`` unless ``resources`` maps resource names to
    positive numbers (and, with ``allow_accelerators=False``, names no TPU or GPU)."""
    if not isinstance(resources, dict):
        raise TypeError(
            f"{key}={resources!r} must be a mapping of Ray resource names to "
            "amounts, e.g. {raytunix_env: 1}."
        )
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{key}: resource name {name!r} must be a non-empty string.")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ValueError(f"{key}: {name}={amount!r} must be a positive number.")
        if not allow_accelerators and name in ("TPU", "GPU"):
            raise ValueError(
                f"{key} asks for {name}: these actors run with JAX_PLATFORMS=cpu and must "
                "never hold an accelerator; ask for a custom resource that only CPU nodes "
                "offer (e.g. {raytunix_env: 1})."
            )


def cpu_actor_options(resources: dict[str, float] | None = None, **options) -> dict[str, Any]:
    """``.options()`` for an actor that must never take the accelerator: the custom
    ``resources`` it is placed by (e.g. ``{"raytunix_env": 1}``), no CPU reservation unless
    ``options`` give one, and ``JAX_PLATFORMS=cpu`` in its runtime env.

    Raises:
      ValueError: ``resources`` names TPU or GPU, or an amount is not positive.
    """
    check_resources("resources", dict(resources or {}), allow_accelerators=False)
    return {
        "num_cpus": 0,
        **options,
        "resources": dict(resources or {}),
        "runtime_env": CPU_ONLY_RUNTIME_ENV,
    }


def tpu_worker_id() -> int | None:
    """This process's host's TPU worker id, or None off a TPU slice.

    Call it inside an actor. Read as Ray reads it: the node's ``ray.io/tpu-worker-id``
    label (which Ray sets at node start from ``TPU_WORKER_ID`` on GKE, or the TPU VM's
    metadata), else the ``TPU_WORKER_ID`` environment variable.

    Raises:
      ValueError: the label or variable is not an integer.
    """
    labels = {}
    if ray.is_initialized():
        labels = ray.get_runtime_context().get_node_labels() or {}
    for source, value in (
        (f"node label {TPU_WORKER_ID_LABEL}", labels.get(TPU_WORKER_ID_LABEL)),
        (f"${TPU_WORKER_ID_ENV}", os.environ.get(TPU_WORKER_ID_ENV)),
    ):
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"{source}={value!r} is not a TPU worker id (an integer); "
                    "check the node's TPU setup."
                ) from None
    return None


def assign_ranks(worker_ids: list[int | None]) -> list[int]:
    """JAX process ranks of the hosts in bundle order: their TPU worker ids when every host
    has one, their bundle indices when none has.

    Args:
      worker_ids: each bundle's host's ``tpu_worker_id()``.

    Raises:
      ValueError: some hosts have a worker id and others not, or the ids are not
        0..N-1 each once (two bundles on one host, or hosts of two slices).
    """
    n = len(worker_ids)
    known = [w for w in worker_ids if w is not None]
    if not known:
        return list(range(n))
    if len(known) != n:
        raise ValueError(
            f"learner hosts' TPU worker ids {worker_ids} (by bundle): some hosts have one and "
            "some not; the learner's hosts must all be TPU hosts of one slice, or none."
        )
    if sorted(known) != list(range(n)):
        raise ValueError(
            f"learner hosts' TPU worker ids {worker_ids} (by bundle) are not 0..{n - 1} each "
            "once: the learner needs one actor on every host of one slice. Set "
            "learner.num_hosts to the slice's host count and learner.resources to all of a "
            "host's chips (e.g. {TPU: 4})."
        )
    return list(known)


@dataclasses.dataclass
class LearnerHosts:
    """A ready reservation of the learner's hosts.

    Attributes:
      placement_group: the placement group holding one bundle per host.
      spec: what was asked for.
      node_ids: the node of each bundle (hex), in bundle order.
    """

    placement_group: PlacementGroup
    spec: LearnerHostsSpec
    node_ids: list[str]
    _slice: Any = None  # ray.util.tpu.SlicePlacementGroup, when reserved as a TPU slice

    @property
    def num_hosts(self) -> int:
        return len(self.node_ids)

    def actor_options(self, bundle_index: int) -> dict[str, Any]:
        """``.options()`` placing an actor in bundle ``bundle_index``, holding all of its
        resources (its CPUs, TPU chips...)."""
        bundle = self.spec.bundle if self._slice is None else dict(self._slice.bundle_resources)
        return {
            **resource_options(bundle),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=bundle_index
            ),
        }

    def release(self) -> None:
        """Removes the placement group (the actors in it die with it). Idempotent."""
        if self._slice is not None:
            self._slice.shutdown()
            self._slice = None
        elif self.placement_group is not None:
            remove_placement_group(self.placement_group)
        self.placement_group = None


def reserve_learner_hosts(spec: LearnerHostsSpec, timeout_s: float = 600.0) -> LearnerHosts:
    """Reserves ``spec.num_hosts`` hosts for the learner and waits until they are held.

    Raises:
      ValueError: ``spec`` names a TPU topology whose host count is not
        ``spec.num_hosts``, or an invalid topology for the version.
      TimeoutError: the cluster did not offer the resources within ``timeout_s`` seconds
        (the message lists what was asked and what is free).
    """
    tpu_slice = None
    if spec.tpu_topology:
        from ray.util.tpu import SlicePlacementGroup

        tpu_slice = SlicePlacementGroup(
            topology=spec.tpu_topology,
            accelerator_version=spec.tpu_version,
            resources_per_bundle=dict(spec.resources) or None,
            strategy=spec.strategy,
            head_reservation_timeout_s=timeout_s,
        )
        if tpu_slice.num_bundles != spec.num_hosts:
            tpu_slice.shutdown()
            raise ValueError(
                f"a {spec.tpu_version} slice of topology {spec.tpu_topology} has "
                f"{tpu_slice.num_hosts} hosts and makes {tpu_slice.num_bundles} bundles of "
                f"{tpu_slice.bundle_resources}, but learner.num_hosts={spec.num_hosts}; set "
                f"learner.num_hosts={tpu_slice.num_bundles} (one learner actor per host)."
            )
        pg = tpu_slice.placement_group
        asked = f"{spec.num_hosts} bundles of {tpu_slice.bundle_resources} on one TPU slice"
    else:
        pg = placement_group([spec.bundle for _ in range(spec.num_hosts)], strategy=spec.strategy)
        asked = f"{spec.num_hosts} bundles of {spec.bundle} ({spec.strategy})"
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        if tpu_slice is not None:
            tpu_slice.shutdown()
        else:
            remove_placement_group(pg)
        raise TimeoutError(
            f"the learner's hosts ({asked}) were not reserved within {timeout_s} s; free "
            f"resources: {ray.available_resources()}. Check learner.num_hosts, "
            "learner.resources and the cluster's nodes (`ray status`)."
        )
    if tpu_slice is not None:
        tpu_slice.release_head_pgs()  # the worker group holds the slice now
    table = ray.util.placement_group_table(pg)
    nodes = table["bundles_to_node_id"]
    return LearnerHosts(
        placement_group=pg,
        spec=spec,
        node_ids=[nodes[i] for i in range(len(nodes))],
        _slice=tpu_slice,
    )
