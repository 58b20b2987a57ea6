"""Sharding of the learner's update over a device mesh with axes (data, fsdp, tensor).

One code path for one CPU device, N fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``) and a TPU slice of many hosts
(``jax.distributed`` with one process per host)::

    mesh = MeshConfig(data=2, fsdp=2, tensor=2).build()    # from jax.devices(): global
    state = shard_train_state(state, mesh)                  # params + optimizer state
    batch = place_batch(batch.pad_rows(batch_shards(mesh)), mesh)   # rows over data x fsdp
    weights = gather_to_host(state.params)                  # full numpy arrays

``MeshConfig.from_config(cfg)`` reads ``learner.mesh_data``, ``mesh_fsdp`` and
``mesh_tensor``; one of them may be -1, "the rest of the devices" (the default: data
parallel over every device, which on one device is the plain single-device update).
``make_policy_update(..., mesh=mesh)`` and ``make_sft_update(..., mesh=mesh)`` keep the
state sharded across steps (``with_sharding_constraint`` on the new state), and
``Learner`` does all of the above when its hyperparameters carry a ``MeshConfig``.

The axes:

* ``data``: pure data parallelism; parameters are replicated across it.
* ``fsdp``: the batch is split over it too, and every matrix is split over it along one
  dimension (ZeRO-3 / fully sharded data parallelism, Rajbhandari et al. 2020,
  arXiv:1910.02054): XLA gathers a layer's weights where it needs them.
* ``tensor``: Megatron-style tensor parallelism (Shoeybi et al. 2019, arXiv:1909.08053):
  the query/key/value and MLP gate/up projections are split by output column
  (column-parallel), the attention output and MLP down projections by input row
  (row-parallel), so a block needs one reduction per projection pair; the embedding and
  the LM head are split over the vocabulary.

Partition rules (``PARAM_RULES``) match a leaf's path, its keys joined by ``/`` without
nnx's ``value`` (``layers/0/mlp/gate_proj/kernel``), with ``re.search``; the first match
wins. The optimizer state follows the params because optax keeps each moment under the
param's own path (``opt_state/1/0/mu/layers/0/mlp/gate_proj/kernel``). A leaf no rule
matches (scalars, the step counter, the PRNG key, a param of a model these rules do not
know) is replicated, logged at debug level: replication is always correct, only memory
is at stake. A dimension that a mesh axis does not divide is an error naming the param,
its shape, the axis and the setting to change.

Host data reaches devices through ``jax.make_array_from_callback`` from the full host
array that every process holds (each process fills its own devices' shards), never a
``jax.device_put`` of a process-local array, so the same calls work with several
processes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from raytunix.learner.batch import Batch

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
"""The mesh axes the rows of a batch are split over."""

PARAM_RULES: tuple[tuple[str, P], ...] = (
    # Flax kernels are [in, out]; embeddings are [vocab, d_model].
    (r"(^|/)embed_tokens/embedding$", P("tensor", "fsdp")),
    (r"(^|/)(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P("fsdp", "tensor")),
    (r"(^|/)(q_proj|k_proj|v_proj)/bias$", P("tensor")),
    (r"(^|/)(o_proj|down_proj)/kernel$", P("tensor", "fsdp")),
    (r"(^|/)(o_proj|down_proj)/bias$", P()),
    (r"(^|/)lm_head/kernel$", P("fsdp", "tensor")),
    (r"(^|/)[a-z_]*norm/scale$", P()),  # input/post-attention/final norms, q/k norms
)
"""``(regex over the leaf's path, PartitionSpec)`` for the Llama/Qwen model of
``raytunix.models.llama``; see the module docstring."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """How many devices each mesh axis spans; their product is the device count.

    Attributes:
      data: data-parallel replicas (``learner.mesh_data``).
      fsdp: devices each parameter is split over, and the batch too
        (``learner.mesh_fsdp``).
      tensor: tensor-parallel devices (``learner.mesh_tensor``).
      One of the three may be -1: the devices the other two leave.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> MeshConfig:
        """From a run config's ``learner.mesh_data``, ``mesh_fsdp``, ``mesh_tensor``."""
        return cls(
            data=cfg.learner.mesh_data, fsdp=cfg.learner.mesh_fsdp, tensor=cfg.learner.mesh_tensor
        )

    def axis_sizes(self, num_devices: int) -> tuple[int, int, int]:
        """``(data, fsdp, tensor)`` with a -1 resolved for ``num_devices`` devices.

        Raises:
          ValueError: a size that is neither -1 nor >= 1, more than one -1, or sizes
            that do not multiply to ``num_devices`` (naming the ``learner.mesh_*`` keys).
        """
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise ValueError(
                    f"learner.mesh_{name}={size!r} must be a positive number of "
                    "devices, or -1 for the devices the other axes leave."
                )
        rest = [name for name, size in sizes.items() if size == -1]
        if len(rest) > 1:
            raise ValueError(
                f"learner.mesh_{rest[0]} and learner.mesh_{rest[1]} are both -1; "
                "at most one mesh axis takes the rest of the devices."
            )
        fixed = math.prod(size for size in sizes.values() if size != -1)
        if rest:
            if num_devices % fixed:
                given = " x ".join(f"learner.mesh_{n}={s}" for n, s in sizes.items() if s != -1)
                raise ValueError(
                    f"{given} = {fixed} devices does not divide the {num_devices} devices of "
                    f"this run; set them to divisors of {num_devices} (learner.mesh_{rest[0]}"
                    "=-1 takes the rest)."
                )
            sizes[rest[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ValueError(
                f"learner.mesh_data x mesh_fsdp x mesh_tensor = {self.data} x {self.fsdp} x "
                f"{self.tensor} = {fixed} devices, but this run has {num_devices}; make the "
                "product the device count, or set one of them to -1 (the rest)."
            )
        return sizes["data"], sizes["fsdp"], sizes["tensor"]

    def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The mesh over ``devices`` (default ``jax.devices()``: every process's devices,
        so every process of a multi-host learner must build it the same way), axes
        ``MESH_AXES``, laid out by ``jax.make_mesh`` (which follows a TPU's topology).

        Raises:
          ValueError: see ``axis_sizes``.
        """
        devices = list(jax.devices() if devices is None else devices)
        shape = self.axis_sizes(len(devices))
        return jax.make_mesh(
            shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices
        )


def batch_shards(mesh: Mesh) -> int:
    """How many pieces a batch's rows are split into: the product of ``BATCH_AXES``."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def path_name(path: tuple) -> str:
    """A pytree key path as the rules read it: keys joined by ``/``, nnx's ``value``
    attribute dropped (``layers/0/self_attn/q_proj/kernel``)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            if key.name not in ("value", "raw_value"):
                parts.append(key.name)
        else:
            parts.append(str(getattr(key, "key", key)))
    return "/".join(parts)


def partition_spec(
    name: str,
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    rules: Sequence[tuple[str, P]] = PARAM_RULES,
) -> P:
    """The ``PartitionSpec`` of the leaf at ``name`` (see ``path_name``) of ``shape`` on
    ``mesh`` (or a mesh's shape alone, an ``AbstractMesh``): the first rule whose regex ``re.search``-es ``name``; replicated when none
    does (logged at debug level for a leaf with dimensions).

    Raises:
      ValueError: the rule's spec has more dimensions than the leaf, or a mesh axis does
        not divide the dimension it splits (naming the leaf, its shape, the axis and the
        ``learner.mesh_*`` key to change).
    """
    spec = next((spec for pattern, spec in rules if re.search(pattern, name)), None)
    if spec is None:
        if len(shape):
            logger.debug("No partition rule matches %s %s; replicated.", name, tuple(shape))
        return P()
    if len(spec) > len(shape):
        raise ValueError(
            f"the partition rule {spec} for {name} has more dimensions than its "
            f"shape {tuple(shape)}; fix the rule."
        )
    for dim, axes in enumerate(spec):
        for axis in (axes,) if isinstance(axes, str) else (axes or ()):
            size = mesh.shape[axis]
            if shape[dim] % size:
                divisors = [d for d in range(1, shape[dim] + 1) if shape[dim] % d == 0][:8]
                raise ValueError(
                    f"cannot shard {name} of shape {tuple(shape)}: dimension {dim} "
                    f"({shape[dim]}) is not divisible by mesh axis {axis!r} of size {size}; "
                    f"set learner.mesh_{axis} to a divisor of {shape[dim]} (one of "
                    f"{divisors}...), or move those devices to another axis."
                )
    return spec


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
    """A pytree of ``NamedSharding`` like ``tree`` (arrays, tracers or
    ``jax.ShapeDtypeStruct``; any tree holding the params: an ``nnx.State``, a
    ``TrainState``), each leaf's by ``partition_spec``.

    Raises:
      ValueError: see ``partition_spec``.
    """

    def sharding(path, leaf):
        return NamedSharding(mesh, partition_spec(path_name(path), np.shape(leaf), mesh, rules))

    return jax.tree_util.tree_map_with_path(sharding, tree)


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` as a global array with ``sharding``: an array already so is kept, one on
    this process's devices is moved (no copy where it already lies), one
    spread over other devices of several processes is resharded by XLA, anything else
    is read on the host (where every process holds all of it) and each process fills
    its own devices' shards."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        # An equivalent sharding is not enough: an array on one device without the mesh
        # has another type than the update's output, and jit would compile twice.
        if x.is_fully_addressable and sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        if not x.is_fully_addressable:
            return jax.jit(lambda a: a, out_shardings=sharding)(x)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: np.asarray(host[index]))


def shard_tree(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
    """``tree`` (params, a ``TrainState``, any pytree of arrays) placed on ``mesh`` by
    the partition rules (``tree_shardings``); leaves already placed so are not copied.

    Raises:
      ValueError: see ``partition_spec``.
    """
    return jax.tree.map(_place, tree, tree_shardings(tree, mesh, rules))


def shard_train_state(state: Any, mesh: Mesh) -> Any:
    """A ``TrainState`` with params and optimizer state split by ``PARAM_RULES`` (the
    moments of a param as the param), step and PRNG key replicated.

    Raises:
      ValueError: see ``partition_spec``.
    """
    return shard_tree(state, mesh)


def constrain(tree: Any, mesh: Mesh) -> Any:
    """Inside ``jax.jit``: ``tree`` with the rules' shardings imposed
    (``jax.lax.with_sharding_constraint``), so an update returns its state split as it
    came in."""
    return jax.lax.with_sharding_constraint(tree, tree_shardings(tree, mesh))


def row_sharding(mesh: Mesh, ndim: int, leading: int = 0) -> NamedSharding:
    """Rows split over ``BATCH_AXES``: dimension ``leading`` of an ``ndim``-dimensional
    array (``leading=1`` for micro-batches ``[n, rows, ...]``), the rest replicated."""
    return NamedSharding(mesh, P(*([None] * leading), BATCH_AXES, *([None] * (ndim - leading - 1))))


def place_rows(array: Any, mesh: Mesh) -> jax.Array:
    """A host array ``[B, ...]`` (the same on every process) as a global array with its
    rows split over ``BATCH_AXES``.

    Raises:
      ValueError: ``B`` is not a multiple of ``batch_shards(mesh)``.
    """
    host = np.asarray(array)
    shards = batch_shards(mesh)
    if host.ndim == 0 or host.shape[0] % shards:
        raise ValueError(
            f"a batch of shape {host.shape} cannot be split over mesh data x fsdp = {shards} "
            f"devices; pad its rows to a multiple of {shards} (Batch.pad_rows)."
        )
    return _place(host, row_sharding(mesh, host.ndim))


def place_batch(batch: Batch, mesh: Mesh) -> Batch:
    """Every array of ``batch`` as a global array, rows split over ``BATCH_AXES``.

    Raises:
      ValueError: the batch's rows are not a multiple of ``batch_shards(mesh)``; pad
        them first (``batch.pad_rows(batch_shards(mesh))``: empty rows, outside every
        statistic).
    """
    return Batch(*(place_rows(field, mesh) for field in batch))


def tree_nbytes(tree: Any) -> int:
    """Bytes of the array leaves of ``tree`` (numpy or jax arrays; not abstract shapes)."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def gather_to_host(tree: Any) -> Any:
    """``tree`` as full numpy arrays on the host. With several processes this is a
    collective (``process_allgather``) that every process must call."""

    def gather(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(gather, tree)


def describe(tree: Any) -> dict[str, str]:
    """``{path: PartitionSpec as text}`` of every array leaf of ``tree``; for logs."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        out[path_name(path)] = str(spec)
    return out
