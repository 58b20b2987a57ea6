"""The memory plan of a run: the bytes its config puts on each device, computed before
anything starts (``raytunix plan``, and the driver's check before its actors start).

    plan = memory_plan(cfg, device_capacity(cfg, probe_devices()))   # allocates nothing
    print(format_plan(plan), end="")
    plan.check()     # MemoryPlanError (a ConfigError) naming the largest item and the fix

Exact where it is cheap: params and optimizer state are ``jax.eval_shape`` of the real
init (``init_model``, the run's optax optimizer; shapes and dtypes only), split over the
learner's mesh by the learner's own partition rules (``sharding.partition_spec``); the KV
pool is the engine's own sizing (``kv_pool_blocks``, then ``init_kv_pages``' shape).
Activations are an estimate (``activation_bytes`` gives the formula and its source).

Devices by ``engine.placement``: ``colocated``, the learner's first device also holds the
engine (its weights and KV pool) and is the one the plan checks; ``disaggregated``, a
learner device and an engine device (each engine replica has its own). Every learner device
holds the same share of the state; the learner's rows are split over data x fsdp.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from raytunix.config import Config, ConfigError
from raytunix.learner.batch import widest_packed_row
from raytunix.learner.lora import LoraSpec, init_adapters
from raytunix.learner.sharding import MESH_AXES, MeshConfig, partition_spec, path_name
from raytunix.learner.train_state import (
    RLHyperparams,
    SFTHyperparams,
    init_value_head,
    make_optimizer_from,
    packed_row_multiple,
)
from raytunix.models.llama import ModelConfig, init_kv_pages, init_model

ITEMS = (
    "params",
    "master_weights",
    "optimizer_state",
    "gradients",
    "new_state",
    "reference_params",
    "activations",
    "engine_weights",
    "kv_cache",
)
"""The plan's lines, in the order it prints them."""

# Activations live during the forward/backward pass, the new state while the optimizer
# applies the gradients: never both, so a device's total counts the larger of the two.
NOT_AT_ONCE = ("activations", "new_state")

FIXES = {
    "params": "split them over more devices (learner.mesh_fsdp, learner.mesh_tensor), or train "
    "a smaller model",
    "master_weights": "keep the params in float32, or split them over more devices "
    "(learner.mesh_fsdp)",
    "optimizer_state": "split it over more devices (learner.mesh_fsdp), or use "
    "learner.optimizer=sgd (no moments)",
    "gradients": "split them over more devices (learner.mesh_fsdp), or set "
    "learner.micro_batch_size=0 (one pass: no accumulated sum beside each pass's gradients)",
    "new_state": "split the state over more devices (learner.mesh_fsdp, learner.mesh_tensor)",
    "reference_params": "set learner.kl_coef=0 (no reference policy), or split it over more "
    "devices (learner.mesh_fsdp)",
    "activations": "set a smaller learner.micro_batch_size (rows per forward/backward pass; 0 "
    "is the whole batch) or warmup.batch_size, a shorter model.max_seq_len or "
    "learner.pack_width, or more data-parallel devices (learner.mesh_data, mesh_fsdp)",
    "engine_weights": "put the engine beside the learner on its own device "
    "(engine.placement=disaggregated), or train a smaller model",
    "kv_cache": "set engine.kv_cache_tokens (0 is 4 x engine.max_batch_size x "
    "model.max_seq_len tokens) or fewer engine rows (engine.max_batch_size), a shorter "
    "model.max_seq_len, or engine.placement=disaggregated",
}
"""What to change when an item is the largest on a device that does not fit."""


class MemoryPlanError(ConfigError):
    """The run's plan does not fit its devices; the message names the device, the largest
    item, the numbers and what to change."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes the run keeps things in: ``params`` (the learner's weights and the
    engine's copy), ``compute`` (the learner's activations) and ``kv_cache`` (the engine's
    KV pages)."""

    params: np.dtype
    compute: np.dtype
    kv_cache: np.dtype


def precision(cfg: Config) -> Precision:
    """The run's dtypes: the learner's params are float32 master weights whatever
    ``model.dtype`` says (the forward casts them to it); activations and the engine's
    weights are in ``model.dtype``; the KV pages in ``engine.kv_dtype`` (``auto``: the
    model's)."""
    compute = np.dtype(jnp.dtype(cfg.model.dtype))
    kv = compute if cfg.engine.kv_dtype == "auto" else np.dtype(jnp.dtype(cfg.engine.kv_dtype))
    return Precision(params=np.dtype(np.float32), compute=compute, kv_cache=kv)


@dataclasses.dataclass(frozen=True)
class DeviceProbe:
    """What this machine's JAX sees: ``platform`` (cpu, gpu, tpu), ``count`` (local
    devices), ``bytes_limit`` (device 0's ``memory_stats()['bytes_limit']``, None where
    the backend does not report it) and ``host_available`` (bytes of host memory
    available now, None where unknown)."""

    platform: str
    count: int
    bytes_limit: int | None
    host_available: int | None


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The memory of one device the plan is checked against: ``bytes`` (None: unknown,
    nothing to check against), ``source`` (where the number came from) and ``devices``
    (the learner's devices, for a ``learner.mesh_*`` of -1; None: unknown)."""

    bytes: int | None
    source: str
    devices: int | None = None


def probe_devices() -> DeviceProbe:
    """This process's devices (``jax.devices()``): it opens the backend, so a process that
    must leave the accelerator to others calls ``probe_devices_elsewhere`` instead."""
    devices = jax.devices()
    stats = devices[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return DeviceProbe(
        platform=devices[0].platform,
        count=len(devices),
        bytes_limit=int(limit) if limit else None,
        host_available=_host_available(),
    )


def probe_devices_elsewhere(timeout_s: float = 120.0) -> DeviceProbe | None:
    """``probe_devices`` in a child process that exits at once: a TPU is held by one
    process at a time and a GPU backend takes most of the memory when it starts, so the
    driver asks without opening the backend itself. None when the child fails."""
    code = (
        "import dataclasses, json; from raytunix.driver.memory_plan import probe_devices; "
        "print(json.dumps(dataclasses.asdict(probe_devices())))"
    )
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=True,
        )
        return DeviceProbe(**json.loads(out.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError):
        return None


def _host_available() -> int | None:
    """Host memory available for new allocations, bytes: ``MemAvailable`` of
    ``/proc/meminfo`` (Linux), else free pages (``os.sysconf``); None where neither."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def device_capacity(
    cfg: Config, probe: DeviceProbe | None, device_memory_gib: float = 0.0
) -> Capacity:
    """One device's memory: ``device_memory_gib`` (the CLI's flag) or
    ``run.device_memory_gib`` when set; else the probe's ``bytes_limit``; else, on CPU, the
    host's available memory shared by its devices; else unknown. The learner's devices
    are the probe's times ``learner.num_hosts`` (None without a probe)."""
    gib = device_memory_gib or cfg.run.device_memory_gib
    devices = probe.count * cfg.learner.num_hosts if probe is not None else None
    if gib:
        key = "--device-memory" if device_memory_gib else "run.device_memory_gib"
        return Capacity(int(gib * 2**30), f"{key}={gib:g}", devices)
    if probe is None:
        return Capacity(None, "not measured", devices)
    if probe.bytes_limit:
        return Capacity(probe.bytes_limit, f"{probe.platform} bytes_limit", devices)
    if probe.platform == "cpu" and probe.host_available:
        share = f" / {probe.count} devices" if probe.count > 1 else ""
        return Capacity(
            probe.host_available // probe.count, f"host available memory{share}", devices
        )
    return Capacity(None, f"{probe.platform} reports no bytes_limit", devices)


# -- the plan --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """One device's bytes by item (``ITEMS``; 0 for an item it does not hold); ``name``
    says which device it is."""

    name: str
    items: dict[str, int]

    @property
    def total(self) -> int:
        """The bytes the device needs at its peak: every item, but only the larger of
        ``NOT_AT_ONCE``."""
        return sum(self.items.values()) - min(self.items[k] for k in NOT_AT_ONCE)

    def largest(self) -> str:
        return max(ITEMS, key=lambda k: self.items[k])


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A run's bytes per device (``devices``: the colocated policy device, or a learner
    and an engine device), checked against ``capacity``. ``how`` says how each item was
    counted; ``header`` describes the model, the placement and the mesh."""

    devices: tuple[DevicePlan, ...]
    capacity: Capacity
    how: dict[str, str]
    header: str

    def fullest(self) -> DevicePlan:
        return max(self.devices, key=lambda d: d.total)

    def fits(self) -> bool | None:
        """Whether every device's total is within the capacity; None when it is unknown."""
        if self.capacity.bytes is None:
            return None
        return self.fullest().total <= self.capacity.bytes

    def check(self) -> None:
        """Raises ``MemoryPlanError`` when a device's total exceeds the capacity, naming
        the device, its largest item, the numbers and what to change."""
        if self.fits() is not False:
            return
        device = self.fullest()
        item = device.largest()
        raise MemoryPlanError(
            f"the run does not fit its devices: the {device.name} needs "
            f"{gib(device.total)} but has {gib(self.capacity.bytes or 0)} "
            f"({self.capacity.source}). Its largest item is {item}, {gib(device.items[item])} "
            f"({self.how[item]}); to fit, {FIXES[item]}. `raytunix plan` with the same "
            "config and overrides prints every item; a wrong capacity is corrected by "
            "run.device_memory_gib."
        )

    def to_json(self) -> dict[str, Any]:
        fullest = self.fullest()
        return {
            "header": self.header,
            "devices": [
                {"name": d.name, "items": dict(d.items), "total_bytes": d.total}
                for d in self.devices
            ],
            "how": dict(self.how),
            "capacity_bytes": self.capacity.bytes,
            "capacity_source": self.capacity.source,
            "fits": self.fits(),
            "largest": {
                "device": fullest.name,
                "item": fullest.largest(),
                "bytes": fullest.items[fullest.largest()],
            },
        }


def memory_plan(cfg: Config, capacity: Capacity) -> MemoryPlan:
    """The run's bytes per device, as its config and ``capacity.devices`` say; nothing is
    allocated (``jax.eval_shape``).

    Raises:
      ConfigError: the model folder cannot be read, the mesh does not fit the devices or
        divide a parameter, or the optimizer's settings are refused (each names the key).
    """
    model = model_shape(cfg)
    dtypes = precision(cfg)
    mesh = learner_mesh(cfg, capacity.devices)
    params = _abstract_params(cfg, model)
    learner, how = learner_items(cfg, params, model, mesh)
    full_params = _nbytes(params)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    learner["activations"], how["activations"] = max(
        _rl_activations(cfg, model, dtypes, shards, mesh.shape["tensor"]),
        _warmup_activations(cfg, model, dtypes, shards, mesh.shape["tensor"]),
    )
    kv, how["kv_cache"] = kv_cache_bytes(cfg, model, dtypes)
    colocated = cfg.engine.placement == "colocated"
    # A colocated engine reads the learner's own arrays when device 0 holds them whole;
    # otherwise it, like a separate engine, holds a full copy, and a second while the next
    # version's weights are swapped in.
    # Under another compute dtype the engine gets the learner's params cast, a copy.
    shared = (
        colocated
        and not _lora(cfg).enabled  # LoRA serves merged weights: arrays of their own
        and dtypes.compute == np.float32
        and _bytes_per_device(params, mesh) == full_params
    )
    engine_copy = full_params * dtypes.compute.itemsize // dtypes.params.itemsize
    # A separate engine under LoRA is sent adapters only and keeps the base to merge onto.
    lora_base = not colocated and _lora(cfg).enabled
    engine_weights = 0 if shared else (3 if lora_base else 2) * engine_copy
    how["engine_weights"] = (
        f"the whole params in {dtypes.compute.name}, twice while a new version is swapped in"
    )
    if shared:
        how["engine_weights"] = "the learner's params on this device, by reference"
    elif lora_base:
        how["engine_weights"] = (
            f"the LoRA base in {dtypes.compute.name} (the published adapters are merged onto "
            "it here) and the merged params, twice while a new version is swapped in: 3 copies"
        )
    engine = {k: 0 for k in ITEMS} | {"engine_weights": engine_weights, "kv_cache": kv}
    devices: tuple[DevicePlan, ...]
    if colocated:
        devices = (DevicePlan("policy device (learner + engine)", _add(learner, engine)),)
    else:
        devices = (
            DevicePlan("learner device", _add(learner, {})),
            DevicePlan("engine device", engine),
        )
    n_params = sum(x.size for x in jax.tree.leaves(params))
    axes = " x ".join(f"{name} {mesh.shape[name]}" for name in MESH_AXES)
    header = (
        f"model: {n_params / 1e6:.3g} M params ({dtypes.params.name}), context "
        f"{model.max_seq_len} tokens; engine.placement={cfg.engine.placement}; learner "
        f"mesh {axes}" + ("" if capacity.devices is not None else " (devices not measured)")
    )
    return MemoryPlan(devices, capacity, how, header)


def _add(learner: dict[str, int], engine: dict[str, int]) -> dict[str, int]:
    return {k: learner.get(k, 0) + engine.get(k, 0) for k in ITEMS}


def model_shape(cfg: Config, vocab_size: int | None = None) -> ModelConfig:
    """The run's model: ``model.path``'s config.json at ``model.max_seq_len`` tokens of
    context, else a fresh model of the ``model.*`` sizes over ``vocab_size`` ids
    (default ``model.tokenizer_vocab_size``, the most the trained tokenizer has); either
    computing in ``model.dtype``.

    Raises:
      ConfigError: the folder's config.json cannot be read as a model.
    """
    m = cfg.model
    if not m.path:
        return ModelConfig(
            vocab_size=vocab_size or m.tokenizer_vocab_size,
            d_model=m.d_model,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads,
            d_ff=m.d_ff,
            max_seq_len=m.max_seq_len,
            dtype=m.dtype,
        )
    from raytunix.models.hf import CheckpointError, read_model_config

    try:
        return dataclasses.replace(read_model_config(m.path, m.max_seq_len), dtype=m.dtype)
    except CheckpointError as e:
        raise ConfigError(f"model.path: {e}") from None


def learner_mesh(cfg: Config, devices: int | None) -> jax.sharding.AbstractMesh:
    """The learner's mesh shape over ``devices`` (``learner.mesh_*``); without a device
    count, an axis of -1 counts as 1 (the fewest devices: the most bytes on each).

    Raises:
      ConfigError: the axes do not multiply to ``devices``.
    """
    mesh = MeshConfig.from_config(cfg)
    if devices is None:
        devices = math.prod(size for size in (mesh.data, mesh.fsdp, mesh.tensor) if size != -1)
    try:
        sizes = mesh.axis_sizes(devices)
    except ValueError as e:
        raise ConfigError(f"the learner's device mesh: {e}") from None
    return jax.sharding.AbstractMesh(sizes, MESH_AXES)


def _abstract_params(cfg: Config, model: ModelConfig) -> Any:
    """The params ``init_model`` makes, as ``jax.ShapeDtypeStruct`` leaves, in the run's
    params dtype."""
    params = jax.eval_shape(lambda: init_model(model, cfg.run.seed)[1])
    dtype = precision(cfg).params
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)


def _nbytes(tree: Any) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _bytes_per_device(tree: Any, mesh: jax.sharding.AbstractMesh) -> int:
    """Bytes of ``tree``'s array leaves on one device when split over ``mesh`` by the
    learner's partition rules (replicated where none matches, as ``shard_tree`` does)."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        spec = partition_spec(path_name(path), leaf.shape, mesh)
        split = math.prod(
            mesh.shape[axis]
            for axes in spec
            for axis in ((axes,) if isinstance(axes, str) else (axes or ()))
        )
        total += leaf.size // split * np.dtype(leaf.dtype).itemsize
    return total


def _lora(cfg: Config) -> LoraSpec:
    return LoraSpec(cfg.learner.lora_rank, cfg.learner.lora_alpha, cfg.learner.lora_target_modules)


def _trained(cfg: Config, params: Any, model: ModelConfig) -> tuple[list[Any], Any]:
    """The abstract trees the optimizer trains (the policy's params, or its LoRA adapters;
    PPO's value head) and the frozen LoRA base (None without LoRA).

    Raises:
      ValueError: invalid LoRA settings (``init_adapters``).
    """
    lora = _lora(cfg)
    trained = [params]
    frozen = None
    if lora.enabled:  # only the adapters train and carry optimizer state (raytunix.learner.lora)
        trained = [jax.eval_shape(lambda base: init_adapters(base, lora, 0), params)]
        frozen = params
    if cfg.learner.advantage_estimator == "gae":  # PPO's value head, its own optimizer state
        trained.append(jax.eval_shape(lambda: init_value_head(model.d_model)))
    return trained, frozen


def _merged_kernel_bytes(trained: list[Any]) -> int:
    """Bytes of the adapted kernels LoRA's forward builds (``W + scale (B A)^T``, one
    float32[d_in, d_out] per adapter, counted whole), 0 without LoRA."""
    return sum(
        a["lora_A"].shape[1] * a["lora_B"].shape[0] * 4
        for tree in trained
        if isinstance(tree, dict)
        for a in tree.values()
        if isinstance(a, dict) and "lora_A" in a
    )


def learner_items(
    cfg: Config, params: Any, model: ModelConfig, mesh: jax.sharding.AbstractMesh
) -> tuple[dict[str, int], dict[str, str]]:
    """A learner device's bytes of its state for the abstract policy ``params``: params,
    master weights, optimizer state, gradients, the update's new state and the KL
    reference, with how each was counted. With LoRA the optimizer state, gradients and new
    state are the adapters', the params hold the frozen base, the adapters and the merged
    kernels of the forward, and the base is the KL reference at no cost of its own.

    Raises:
      ConfigError: a parameter the mesh does not divide, or optimizer or LoRA settings
        refused.
    """
    try:
        trained, frozen = _trained(cfg, params, model)
        rl = make_optimizer_from(RLHyperparams.from_config(cfg))
        opt_bytes = {
            "RL": sum(_bytes_per_device(jax.eval_shape(rl.init, t), mesh) for t in trained)
        }
        if cfg.warmup.enabled:  # the warm start's optimizer, on what the policy trains
            sft = SFTHyperparams.from_config(cfg).optimizer()
            opt_bytes["warm start"] = _bytes_per_device(jax.eval_shape(sft.init, trained[0]), mesh)
        trained_bytes = sum(_bytes_per_device(t, mesh) for t in trained)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    phase = max(opt_bytes, key=lambda p: opt_bytes[p])
    count = sum(x.size for x in jax.tree.leaves(trained))
    split = "split by the learner's partition rules"
    compute = precision(cfg).compute
    accumulate = _rl_micro_batches(cfg, mesh.shape["data"] * mesh.shape["fsdp"]) > 1
    lora = frozen is not None
    frozen_bytes = 0 if frozen is None else _bytes_per_device(frozen, mesh)
    merged = _merged_kernel_bytes(trained)
    items = {
        "params": trained_bytes + frozen_bytes + merged,
        "master_weights": 0,  # the params are the master weights (see ``how``)
        "optimizer_state": opt_bytes[phase],
        "gradients": trained_bytes * (2 if accumulate else 1),
        "new_state": trained_bytes + opt_bytes[phase],
        "reference_params": trained_bytes if cfg.learner.kl_coef > 0 and not lora else 0,
    }
    trains = "the adapters" if lora else "the params"
    how = {
        "params": f"the frozen base ({frozen_bytes:,} B), the LoRA adapters ({count:,} values) "
        f"and the adapted kernels the forward builds ({merged:,} B), {split}"
        if lora
        else f"jax.eval_shape of init_model, {count:,} values, {split}",
        "master_weights": "none: params are float32"
        if compute == np.float32
        else f"none apart: the params are the float32 master weights, cast to {compute.name} "
        "inside the forward",
        "optimizer_state": f"jax.eval_shape of the {phase} optax optimizer's init "
        f"(learner.optimizer={cfg.learner.optimizer}) on {trains}, {split}",
        "gradients": f"{trains}' shape; twice: the micro-batches' sum and one pass's own"
        if accumulate
        else f"{trains}' shape, one pass",
        "new_state": f"{trains} and optimizer state the update writes while the old ones "
        "live (no buffer donation)",
        "reference_params": "none: the frozen LoRA base is the reference policy"
        if lora and cfg.learner.kl_coef > 0
        else "the KL reference policy, learner.kl_coef > 0"
        if cfg.learner.kl_coef > 0
        else "none: learner.kl_coef=0",
    }
    return items, how


# -- activations ----------------------------------------------------------------------------


def activation_bytes(
    model: ModelConfig,
    *,
    rows: int,
    width: int,
    compute_itemsize: int = 4,
    tensor: int = 1,
    vocab_copies: int = 5,
) -> int:
    """Estimated bytes a forward pass of ``rows`` rows of ``width`` tokens keeps for its
    backward pass on one device, with nothing rematerialised (the learner's update
    recomputes nothing):

        rows * width * (n_layers * (e * (6 d + 2 q + 4 kv + 3 f) + 12 h width + width)
                        + 4 c V + 2 e d)

    with ``e`` the compute dtype's bytes, ``d`` = d_model, ``q`` = n_heads x head_dim,
    ``kv`` = n_kv_heads x head_dim, ``f`` = d_ff, ``h`` = n_heads, ``V`` = vocab_size
    (``q``, ``kv``, ``f``, ``h`` and ``V`` divided by ``tensor``, the tensor-parallel
    devices) and ``c`` = ``vocab_copies``. Per layer and token: the block's input, the
    residual after attention, each with its normed copy and the norm's scaled input (6 d);
    the rotated queries in the grouped layout and the attention output (2 q); the keys
    and values, rotated and regrouped (4 kv); the SwiGLU gate, up and their product
    (3 f); float32 attention scores, masked scores and probabilities ``[n_heads, width]``
    (``raytunix.models.llama`` attends densely: 12 h width bytes) and the boolean mask
    ``[width]``. Per token at the head: ``c`` float32 vocabulary-wide arrays (logits,
    log-softmax, the loss's softmax and the logits' gradient; more for a top-k/top-p
    truncation or a reference forward) and the final norm's input and output.

    The method is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models" (arXiv:2205.05198, section 4.1: count the tensors each layer keeps
    for its backward pass), applied to this model (SwiGLU, grouped-query attention, no
    dropout, float32 attention scores); the counts per width were checked against XLA's
    own (``compiled.memory_analysis().temp_size_in_bytes`` of the warm-start update on
    CPU, which also holds the gradients): within about 20% of it, below it.
    """
    e, d = compute_itemsize, model.d_model
    hd = model.head_dim or d // model.n_heads  # resolved once the config is built
    q = model.n_heads * hd // tensor
    kv = model.n_kv_heads * hd // tensor
    f = model.d_ff // tensor
    heads = model.n_heads // tensor
    layer = e * (6 * d + 2 * q + 4 * kv + 3 * f) + 3 * 4 * heads * width + width
    head = 4 * vocab_copies * (-(-model.vocab_size // tensor)) + 2 * e * d
    return rows * width * (model.n_layers * layer + head)


def _rl_batch_rows(cfg: Config, shards: int) -> tuple[int, int]:
    """``(rows, width)`` of an RL batch at most: a packed batch holds at worst one
    trajectory per row (one just over half a row each), rounded up to
    ``packed_row_multiple``; a padded one, one per row at the model's context."""
    learner = cfg.learner
    trajectories = cfg.rollout.group_size * cfg.rollout.groups_per_batch
    if learner.sequence_packing:
        multiple = packed_row_multiple(learner.micro_batch_size, shards)
        width = widest_packed_row(learner.pack_width, cfg.model.max_seq_len)
    else:
        multiple, width = learner.micro_batch_size or shards, cfg.model.max_seq_len
    return -(-trajectories // multiple) * multiple, width


def _rl_micro_batches(cfg: Config, shards: int) -> int:
    rows, _ = _rl_batch_rows(cfg, shards)
    return rows // (cfg.learner.micro_batch_size or rows)


def _rl_activations(
    cfg: Config, model: ModelConfig, dtypes: Precision, shards: int, tensor: int
) -> tuple[int, str]:
    """The RL update's activations on one learner device, and how they were counted."""
    rows, width = _rl_batch_rows(cfg, shards)
    per_pass = cfg.learner.micro_batch_size or rows
    on_device = -(-per_pass // shards)
    r = cfg.rollout
    copies = 3 + (r.top_k > 0 or r.top_p < 1.0) + 2 * (cfg.learner.kl_coef > 0)
    nbytes = activation_bytes(
        model,
        rows=on_device,
        width=width - 1,  # the forward reads every token but the last
        compute_itemsize=dtypes.compute.itemsize,
        tensor=tensor,
        vocab_copies=copies,
    )
    whole = (
        "learner.micro_batch_size"
        if cfg.learner.micro_batch_size
        else "learner.micro_batch_size=0: the whole batch, at worst a trajectory per row"
    )
    return nbytes, (
        f"estimate (activation_bytes): RL pass of {on_device} rows x {width - 1} tokens on "
        f"this device ({whole})"
    )


def _warmup_activations(
    cfg: Config, model: ModelConfig, dtypes: Precision, shards: int, tensor: int
) -> tuple[int, str]:
    """The warm start's activations on one learner device (0 when it is off): at worst one
    demonstration per packed row, ``warmup.batch_size`` rows of the model's context."""
    if not cfg.warmup.enabled:
        return 0, "no warm start"
    size = cfg.warmup.batch_size
    multiple = math.lcm(shards, min(4, size))
    on_device = -(-(-(-size // multiple) * multiple) // shards)
    width = cfg.model.max_seq_len - 1
    nbytes = activation_bytes(
        model, rows=on_device, width=width, compute_itemsize=dtypes.compute.itemsize, tensor=tensor
    )
    return nbytes, (
        f"estimate (activation_bytes): warm-start pass of {on_device} rows x {width} tokens "
        "on this device (warmup.batch_size, at most one demonstration per row)"
    )


# -- the engine ----------------------------------------------------------------------------


def kv_cache_bytes(cfg: Config, model: ModelConfig, dtypes: Precision) -> tuple[int, str]:
    """The engine's KV pool as the engine allocates it: ``kv_pool_blocks`` blocks of
    ``engine.block_size`` tokens, ``init_kv_pages``' arrays; and how it was counted."""
    from raytunix.inference.engine import kv_pool_blocks

    e = cfg.engine
    blocks = kv_pool_blocks(
        model.max_seq_len, e.block_size, e.max_batch_size, e.kv_cache_tokens or None
    )
    pages = jax.eval_shape(lambda: init_kv_pages(model, blocks, e.block_size, dtypes.kv_cache))
    sized = (
        f"engine.kv_cache_tokens={e.kv_cache_tokens}"
        if e.kv_cache_tokens
        else f"4 x engine.max_batch_size={e.max_batch_size} contexts"
    )
    return _nbytes(pages), (
        f"{blocks} blocks x {e.block_size} tokens ({sized}), keys and values of "
        f"{model.n_layers} layers"
    )


# -- the table -----------------------------------------------------------------------------


def gib(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1: ``12.3 MiB``."""
    value, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}" if unit != "B" else f"{nbytes} B"


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: one line per item with its bytes on each device and how it
    was counted, the totals, the capacity and whether it fits."""
    names = [d.name for d in plan.devices]
    width = max(16, *(len(n) for n in names))
    lines = [f"memory plan: {plan.header}"]
    lines.append(f"{'item':<18}" + "".join(f"{n:>{width + 2}}" for n in names) + "  how")
    for item in ITEMS:
        cells = "".join(f"{gib(d.items[item]):>{width + 2}}" for d in plan.devices)
        lines.append(f"{item:<18}{cells}  {plan.how[item]}")
    totals = "".join(f"{gib(d.total):>{width + 2}}" for d in plan.devices)
    lines.append(f"{'total':<18}{totals}  at the peak: the larger of activations and new_state")
    cap = plan.capacity
    shown = gib(cap.bytes) if cap.bytes is not None else "unknown"
    lines.append(f"{'capacity':<18}{shown:>{width + 2}}  per device: {cap.source}")
    fits = plan.fits()
    if fits is None:
        lines.append(
            "fits: not checked (no capacity; pass --device-memory GIB or set run.device_memory_gib)"
        )
    else:
        fullest = plan.fullest()
        share = fullest.total / max(cap.bytes or 1, 1)
        lines.append(
            f"fits: {'yes' if fits else 'NO'} (the {fullest.name} at {share:.0%} of the "
            f"capacity; its largest item: {fullest.largest()})"
        )
    return "\n".join(lines) + "\n"
