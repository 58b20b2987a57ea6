"""A multi-host learner: one learner actor per host, one SPMD program (``jax.distributed``).

    group = LearnerGroup(LearnerHostsSpec(num_hosts=4, resources={"TPU": 4},
                                          tpu_topology="4x4", tpu_version="v6e"),
                         model_config, seed=0, pad_id=0)
    group.start_rl(hp)
    metrics = group.train_step([batch_ref])     # every host, same refs, same order
    weights, version = group.weights()          # from rank 0
    group.save(ckpt_dir, extras)                # every host writes its shards (orbax)
    ...
    except LearnerHostFailure:
        extras = group.rebuild()                # new actors, new coordinator, last checkpoint

How it starts (``_start``):

1. The hosts are reserved as one placement group (``raytunix.cluster.placement.
   reserve_learner_hosts``; on a TPU slice, Ray's slice placement group) and one
   ``LearnerHost`` actor is placed in each bundle.
2. Each host reports its TPU worker id; the JAX process ranks are those ids, not the
   bundle indices (``raytunix.cluster.placement.assign_ranks``; bundle order off a TPU slice).
3. Rank 0 picks a free port on its node: the coordinator address is its node's IP and
   that port, new at every start, so a rebuilt group never meets the old one's
   coordinator.
4. Every host calls ``jax.distributed.initialize(coordinator, num_processes, rank)``
   (CPU collectives through gloo), then builds its ``Learner``: the model from the same
   seed or checkpoint on every host, its mesh over ``jax.devices()`` (every host's
   devices; ``raytunix.learner.sharding``).

Every call then goes to every host in rank order and the group waits for all of them:
collectives (the update's gradient reduction, gathering weights, orbax's multi-process
save) need every process. Results are rank 0's; rank 0 alone ships weights and writes an
export. A host that dies mid-call leaves the others blocked in a collective, so the group
waits on all hosts at once, and at the first death tears the group down (kills every
host, releases the reservation) and raises ``LearnerHostFailure``; ``rebuild()`` then
starts a new group and brings it back to the newest checkpoint the group saved. Every call
has a deadline (``call_timeout_s``; ``slow_call_timeout_s`` for compiling and checkpoint
calls): a host that is alive but stuck is found only that way, named, and handled as a
dead one. A restore reads only the steps every host lists (``common_steps``), and the hosts'
answers must agree (``check_same_restore``), else ``LearnerStateDivergence`` stops the run.

The group is a plain class; as a Ray actor (``ray.remote(LearnerGroup)``, ``num_cpus=0``)
it answers the calls ``LearnerActor`` answers, so a driver can hold either. The group
itself never touches a device, but give that actor no ``JAX_PLATFORMS=cpu``: the hosts
it starts inherit its runtime env (Ray merges a child's ``env_vars`` into its
parent's), and would then leave the TPU unused.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

import ray

from raytunix import profiling
from raytunix.learner.actor import LearnerActor
from raytunix.learner.learner import RLHyperparams, SFTHyperparams
from raytunix.models.llama import ModelConfig
from raytunix.cluster.placement import (
    LearnerHosts,
    LearnerHostsSpec,
    assign_ranks,
    reserve_learner_hosts,
)

logger = logging.getLogger(__name__)

__all__ = [
    "LearnerGroup",
    "LearnerHost",
    "LearnerHostFailure",
    "LearnerStateDivergence",
    "check_same_restore",
    "common_steps",
    "place_learner_hosts",
]


class LearnerHostFailure(RuntimeError):
    """A learner host died (its actor or node is gone) or is stuck (alive, but a call did
    not end within its deadline); the group was torn down. Call ``LearnerGroup.rebuild()``
    to start it again from the newest checkpoint."""


class LearnerStateDivergence(RuntimeError):
    """The hosts of a group restored different checkpoints (another step, data position or
    extras), or have no step every one of them can read; the group was torn down. Not
    retried: a rebuild would read the same directories."""


def common_steps(steps_by_host: list[list[int]], where: list[str]) -> list[int]:
    """The checkpoint steps every host lists, ascending: what a group may restore (a
    shared filesystem can show one host a step that another does not see yet).

    Args:
      steps_by_host: each host's committed steps, in rank order.
      where: each host's name for messages (e.g. ``host 1 (10.0.0.2)``), in rank order.

    Raises:
      FileNotFoundError: no host lists any step (a new run, or nothing saved yet).
      LearnerStateDivergence: some host lists steps but no step is on every host; the
        message names each host's steps.
    """
    if not any(steps_by_host):
        raise FileNotFoundError("no learner host lists a checkpoint")
    common = set(steps_by_host[0]).intersection(*map(set, steps_by_host[1:]))
    if not common:
        listing = "; ".join(
            f"{name}: {sorted(steps) or 'none'}" for name, steps in zip(where, steps_by_host)
        )
        raise LearnerStateDivergence(
            f"no checkpoint step is readable by every learner host ({listing}). The "
            "checkpoint directory must be one path every host sees (a shared volume or "
            "gs://); check that it is mounted on every host."
        )
    return sorted(common)


def check_same_restore(extras_by_host: list[dict[str, Any] | None], where: list[str]) -> None:
    """Checks that every host restored the same checkpoint: the same extras (the step, the
    policy version, the data position...), compared whole.

    Raises:
      LearnerStateDivergence: they differ; the message names each host's step and data
        position.
    """

    def key(extras):
        return json.dumps(extras, sort_keys=True, default=str)

    if len({key(e) for e in extras_by_host}) <= 1:
        return

    def summary(extras):
        if extras is None:
            return "no checkpoint"
        position = (extras.get("orchestrator") or {}).get("next_index", extras.get("data_position"))
        return (
            f"step {extras.get('rl_step', extras.get('warmup_steps', '?'))}, policy "
            f"version {extras.get('policy_version', '?')}, data position {position}"
        )

    listing = "; ".join(f"{name}: {summary(e)}" for name, e in zip(where, extras_by_host))
    raise LearnerStateDivergence(
        f"the learner hosts restored different checkpoints ({listing}); training on would "
        "run one program over different weights. Make every host see the same checkpoint "
        "directory (one shared path), then resume."
    )


class LearnerHost(LearnerActor):
    """One host of a ``LearnerGroup``: a ``LearnerActor`` whose learner is built only
    after ``jax.distributed.initialize`` (which must come before any JAX computation)."""

    def __init__(self):
        self.rank: int | None = None
        self.learner = None

    def host_info(self) -> dict[str, Any]:
        """Where this actor runs: ``node_id``, ``node_ip``, ``pid`` and the host's TPU
        ``worker_id`` (None off a TPU slice; ``raytunix.cluster.placement.tpu_worker_id``)."""
        import os

        from raytunix.cluster.placement import tpu_worker_id

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "worker_id": tpu_worker_id(),
        }

    def coordinator_address(self) -> str:
        """``ip:port`` of a port free now on this node, for the JAX coordinator that
        ``initialize`` with process id 0 starts in this process."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def initialize(
        self,
        coordinator: str,
        num_processes: int,
        rank: int,
        model_config: ModelConfig,
        seed: int,
        pad_id: int,
        model_path: str = "",
        init_from: str = "",
        timeout_s: int = 300,
    ) -> dict[str, Any]:
        """Joins the group's JAX program as process ``rank`` of ``num_processes`` and
        builds the learner; returns ``process_index``, ``process_count``,
        ``device_count`` (global) and ``local_device_count`` as JAX sees them.

        Blocks until every process of the group has called it (at most ``timeout_s``
        seconds, then JAX raises)."""
        import jax

        # CPU collectives (tests, CPU hosts) need an implementation; TPUs ignore it.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=rank,
            initialization_timeout=timeout_s,
        )
        self.rank = rank
        LearnerActor.__init__(self, model_config, seed, pad_id, model_path, init_from)
        profiling.configure(f"learner host {rank}", "learner")
        return {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
        }

    def mesh_shape(self) -> dict[str, int]:
        """The learner's device mesh, axis name -> size (``Learner.mesh``, built when a
        phase starts); {} before."""
        mesh = getattr(self.learner, "mesh", None)
        return {} if mesh is None else {k: int(v) for k, v in mesh.shape.items()}

    @property
    def writes_exports(self) -> bool:  # type: ignore[override]
        return self.rank == 0

    def weights(self, whole: bool = False) -> Any:
        """``LearnerActor.weights`` on rank 0, None on the others; every host must call it
        (gathering split parameters is a collective)."""
        payload = super().weights(whole)
        return payload if self.rank == 0 else None

    def base_weights(self) -> Any:
        """``LearnerActor.base_weights`` on rank 0, None on the others; every host must
        call it."""
        payload = super().base_weights()
        return payload if self.rank == 0 else None

    async def export(self, out_dir: str) -> list[str]:
        """Rank 0 writes the policy as a Hugging Face folder (``LearnerActor.export``),
        from parameters every host helps gather; the others return []."""
        from raytunix.models.hf import export_checkpoint

        params = await self._in_thread(self.learner.weights_numpy, True)  # float32 master
        if self.rank != 0:
            return []
        return await self._in_thread(
            lambda: export_checkpoint(
                out_dir, self.learner.model_config, params, source=self.model_path or None
            )
        )


def place_learner_hosts(
    spec: LearnerHostsSpec, timeout_s: float = 600.0, runtime_env: dict[str, Any] | None = None
) -> tuple[LearnerHosts, list, list[dict[str, Any]]]:
    """Reserves the hosts (``reserve_learner_hosts``), starts one ``LearnerHost`` in each
    bundle (with ``runtime_env``, e.g. XLA flags; None: the job's) and ranks them by
    their TPU worker ids (``assign_ranks``).

    Returns ``(reservation, hosts, infos)``: the hosts' actor handles in rank order and
    their ``host_info()`` with ``bundle_index`` and ``rank`` added, in the same order.

    Raises:
      TimeoutError: the hosts were not reserved, or did not answer, within ``timeout_s``.
      ValueError: the hosts' worker ids are not 0..N-1 each once (``assign_ranks``).
      LearnerHostFailure: a host died while starting.
      Nothing stays reserved or running when it raises.
    """
    deadline = time.monotonic() + timeout_s
    reservation = reserve_learner_hosts(spec, timeout_s=timeout_s)
    cls = ray.remote(LearnerHost)
    # A host that restarted alone could not rejoin the JAX program: no Ray restarts.
    options = {} if runtime_env is None else {"runtime_env": runtime_env}
    hosts = [
        cls.options(
            max_restarts=0, max_concurrency=100, **options, **reservation.actor_options(b)
        ).remote()
        for b in range(reservation.num_hosts)
    ]
    try:
        infos = ray.get(
            [h.host_info.remote() for h in hosts], timeout=max(1.0, deadline - time.monotonic())
        )
        ranks = assign_ranks([info["worker_id"] for info in infos])
    except ray.exceptions.GetTimeoutError:
        reservation.release()
        raise TimeoutError(
            f"the {len(hosts)} learner hosts did not start within "
            f"{timeout_s} s; see their logs (`ray logs`)."
        ) from None
    except ray.exceptions.RayActorError as e:
        reservation.release()
        raise LearnerHostFailure(f"a learner host died while starting: {e}") from e
    except BaseException:
        reservation.release()
        raise
    order = sorted(range(len(hosts)), key=ranks.__getitem__)
    return (
        reservation,
        [hosts[b] for b in order],
        [dict(infos[b], bundle_index=b, rank=ranks[b]) for b in order],
    )


class LearnerGroup:
    """``spec.num_hosts`` learner actors running one JAX program (see the module
    docstring). Its calls mirror ``LearnerActor``'s, made on every host and answered by
    rank 0.

    Args:
      spec: the hosts to reserve (``LearnerHostsSpec.from_config(cfg.learner)``).
      model_config, seed, pad_id, model_path, init_from: each host's ``Learner`` (as
        ``LearnerActor`` takes them).
      start_timeout_s: seconds allowed for reserving the hosts, starting the actors and
        joining ``jax.distributed``.
      call_timeout_s: seconds a call may take on every host before the group counts as
        stuck (torn down, ``LearnerHostFailure`` naming the hosts still busy); a host that
        is alive but not answering (a wedged collective, a hung storage read) is found
        this way, as heartbeats only find dead ones. Must be finite.
      slow_call_timeout_s: the same for calls that compile or move the whole state: the
        first update after a (re)start, ``start_rl``/``start_warmup``, ``sft_steps``,
        checkpoint saves and restores, ``export``. None: ``call_timeout_s``.
      runtime_env: the hosts' Ray runtime env (e.g. ``{"env_vars": {...}}`` for XLA or
        libtpu flags, or ``JAX_COMPILATION_CACHE_DIR`` so that a rebuilt group reuses the
        compiled update); None: the job's.
      max_rebuilds: ``rebuild`` refuses after this many (a host that keeps dying is a
        fault to fix, not to retry for ever).

    Raises:
      TimeoutError: the hosts could not be reserved in time (``reserve_learner_hosts``).
      ValueError: the hosts' TPU worker ids are not one slice's (``assign_ranks``).
      LearnerHostFailure: a host died while starting.
    """

    def __init__(
        self,
        spec: LearnerHostsSpec,
        model_config: ModelConfig,
        seed: int,
        pad_id: int,
        model_path: str = "",
        init_from: str = "",
        *,
        start_timeout_s: float = 600.0,
        call_timeout_s: float = 1800.0,
        slow_call_timeout_s: float | None = 3600.0,
        runtime_env: dict[str, Any] | None = None,
        max_rebuilds: int = 3,
    ):
        if not (isinstance(call_timeout_s, (int, float)) and 0 < call_timeout_s < float("inf")):
            raise ValueError(
                f"call_timeout_s must be a finite number of seconds > 0, got "
                f"{call_timeout_s!r}: a stuck host would hang the group for ever."
            )
        self.spec = spec
        self.max_rebuilds = max_rebuilds
        self.runtime_env = runtime_env
        self._learner_args = (model_config, seed, pad_id, model_path, init_from)
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = float(call_timeout_s)
        self.slow_call_timeout_s = max(self.call_timeout_s, float(slow_call_timeout_s or 0.0))
        self._compiled = False  # has this group's update run once (compiled)?
        self.hosts: list = []  # LearnerHost handles, in rank order
        self.host_infos: list[dict[str, Any]] = []  # host_info() of each, in rank order
        self._reservation: LearnerHosts | None = None
        # What a rebuilt group replays: the phase started and where checkpoints went.
        self._demonstrations = None
        self._warmup: tuple[SFTHyperparams, str | None] | None = None
        self._rl: RLHyperparams | None = None
        self._checkpoints: dict[str, Any] | None = None
        self._reference: str | None = None
        self.rebuilds = 0
        self._start()

    # -- lifecycle -----------------------------------------------------------------------
    def _start(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        self._reservation, self.hosts, self.host_infos = place_learner_hosts(
            self.spec, timeout_s=self.start_timeout_s, runtime_env=self.runtime_env
        )
        try:
            coordinator = ray.get(
                self.hosts[0].coordinator_address.remote(),
                timeout=max(1.0, deadline - time.monotonic()),
            )
            n = len(self.hosts)
            remaining = max(1, int(deadline - time.monotonic()))
            joined = self._on_all_ranked(
                lambda rank, host: host.initialize.remote(
                    coordinator, n, rank, *self._learner_args, timeout_s=remaining
                ),
                timeout_s=remaining + 60,
            )
            for rank, info in enumerate(joined):
                if info["process_index"] != rank or info["process_count"] != n:
                    raise RuntimeError(
                        f"learner host {rank} joined JAX as {info}; expected process {rank} of {n}."
                    )
        except BaseException:  # a half-started group holds its hosts for nothing
            self.shutdown()
            raise
        self.coordinator = coordinator
        self._compiled = False
        self.device_count = joined[0]["device_count"]
        logger.info(
            "learner group: %d hosts, %d devices, coordinator %s, ranks by %s",
            n,
            self.device_count,
            coordinator,
            "TPU worker id" if self.host_infos[0]["worker_id"] is not None else "bundle",
        )

    def shutdown(self) -> None:
        """Kills every host and releases the reservation. Idempotent."""
        for host in self.hosts:
            try:
                ray.kill(host, no_restart=True)
            except ValueError:  # not an actor handle any more
                pass
        self.hosts = []
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None

    def rebuild(self) -> dict[str, Any] | None:
        """Tears the group down (if a failure has not already) and starts a new one: new
        actors, new reservation, a new coordinator port; then replays the phase the old
        group was in: RL (``start_rl``, then ``restore`` of the newest checkpoint the
        group saved), or the warm start (demonstrations, ``start_warmup``, then
        ``restore_warmup`` when it saved one).

        Returns the restored checkpoint's extras (data position, policy version...), or
        None when there was no checkpoint to restore: the learner then starts from its
        initial weights, and the caller must rewind its data to match.

        Raises:
          LearnerHostFailure: a host died again while rebuilding, or the group was rebuilt
            ``max_rebuilds`` times already.
        """
        self.shutdown()
        if self.rebuilds >= self.max_rebuilds:
            raise LearnerHostFailure(
                f"the learner group was rebuilt {self.rebuilds} times already (max_rebuilds="
                f"{self.max_rebuilds}); find out why its hosts die (`ray logs`, the nodes' "
                "health) before going on."
            )
        self.rebuilds += 1
        self._start()
        if self._rl is not None:
            self._on_all("start_rl", self._rl, timeout_s=self.slow_call_timeout_s)
            if self._checkpoints is not None:
                try:
                    return self.restore(**self._checkpoints, reference_directory=self._reference)
                except FileNotFoundError:
                    logger.warning(
                        "learner group rebuilt with no checkpoint in %s: it starts "
                        "from its initial weights.",
                        self._checkpoints["directory"],
                    )
            return None
        if self._warmup is not None:
            if self._demonstrations is not None:
                self._on_all("set_demonstrations", *self._demonstrations)
            hp, directory = self._warmup
            self._on_all("start_warmup", hp, timeout_s=self.slow_call_timeout_s)
            if directory is not None:
                return self.restore_warmup(directory)
        return None

    # -- calls on every host -------------------------------------------------------------------
    def _host_name(self, rank: int) -> str:
        info = self.host_infos[rank] if rank < len(self.host_infos) else {}
        return f"host {rank} ({info.get('node_ip', '?')}, pid {info.get('pid', '?')})"

    def _on_all(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        return self._on_all_ranked(
            lambda rank, host: getattr(host, method).remote(*args, **kwargs), timeout_s
        )

    def _on_all_ranked(self, submit, timeout_s: float | None = None) -> list:
        """``submit(rank, host)`` on every host, in rank order; their results in rank
        order. Waits on all hosts at once: at the first host that died, or when
        ``timeout_s`` (default ``call_timeout_s``) passes, the group is torn down and
        ``LearnerHostFailure`` raised. An exception raised by a host's method (a bug, a
        bad batch) is raised here once every host has answered; if the others do not
        answer (blocked in a collective the failed host left), the group is torn down."""
        if not self.hosts:
            raise LearnerHostFailure("the learner group is down; call rebuild().")
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        refs = [submit(rank, host) for rank, host in enumerate(self.hosts)]
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending, error = list(refs), None
        while pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if error is not None:  # the others get a while to answer the same way
                wait = min(wait if wait is not None else 60.0, 60.0)
            done, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not done:
                stuck = ", ".join(self._host_name(r) for r in sorted(index[p] for p in pending))
                self.shutdown()  # kills the stuck hosts with the rest: none can rejoin alone
                if error is not None:
                    raise error
                raise LearnerHostFailure(
                    f"learner {stuck} alive but stuck: no answer within {timeout_s} s "
                    f"(learner.call_timeout_s / slow_call_timeout_s); the group was torn down. "
                    "Call rebuild()."
                )
            ref = done[0]
            try:
                results[index[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.shutdown()
                raise LearnerHostFailure(
                    f"learner {self._host_name(index[ref])} died: {e}. The group was torn "
                    "down; call rebuild()."
                ) from e
            except ray.exceptions.RayTaskError as e:
                error = error or e
        if error is not None:
            raise error
        return results

    # -- the LearnerActor calls ------------------------------------------------------------------
    def set_demonstrations(self, tokens, loss_mask) -> int:
        self._demonstrations = (tokens, loss_mask)
        return self._on_all("set_demonstrations", tokens, loss_mask)[0]

    def start_warmup(self, hp: SFTHyperparams) -> None:
        self._warmup, self._rl = (hp, None), None
        self._on_all("start_warmup", hp, timeout_s=self.slow_call_timeout_s)

    def sft_steps(self, num_steps: int, batch_size: int) -> dict[str, float]:
        return self._on_all("sft_steps", num_steps, batch_size, timeout_s=self.slow_call_timeout_s)[
            0
        ]

    def save_warmup(self, directory: str, steps: int, extras: dict[str, Any]) -> None:
        self._warmup = (self._warmup[0], directory) if self._warmup else None
        self._on_all("save_warmup", directory, steps, extras, timeout_s=self.slow_call_timeout_s)

    def restore_warmup(self, directory: str) -> dict[str, Any] | None:
        """Every host restores the newest warm-start checkpoint; they must agree
        (``check_same_restore``: ``LearnerStateDivergence``, the group torn down)."""
        extras = self._on_all("restore_warmup", directory, timeout_s=self.slow_call_timeout_s)
        self._check_same(extras)
        return extras[0]

    def _check_same(self, extras_by_host: list) -> None:
        try:
            check_same_restore(extras_by_host, [self._host_name(r) for r in range(len(self.hosts))])
        except LearnerStateDivergence:
            self.shutdown()  # no update may run over hosts holding different weights
            raise

    def start_rl(self, hp: RLHyperparams) -> None:
        self._rl = hp
        self._on_all("start_rl", hp, timeout_s=self.slow_call_timeout_s)

    def train_step(self, batch_refs: list) -> dict[str, float]:
        """One update on the batch behind ``batch_refs[0]`` (an ObjectRef in a list):
        every host reads the same batch and runs the same program; rank 0's metrics. The
        first one after a (re)start compiles: it gets ``slow_call_timeout_s``."""
        timeout = self.call_timeout_s if self._compiled else self.slow_call_timeout_s
        metrics = self._on_all("train_step", batch_refs, timeout_s=timeout)[0]
        self._compiled = True
        return metrics

    def weights(self, whole: bool = False) -> Any:
        """``LearnerActor.weights`` (the parameters and policy version, or under LoRA the
        adapters), gathered by every host and shipped by rank 0 alone."""
        return self._on_all("weights", whole)[0]

    def base_weights(self) -> Any:
        """``LearnerActor.base_weights`` (the LoRA base), gathered by every host and
        shipped by rank 0 alone."""
        return self._on_all("base_weights")[0]

    def policy_version(self) -> int:
        return self._on_all("policy_version")[0]

    def mesh_shape(self) -> dict[str, int]:
        """The learner's device mesh over every host's devices (axis -> size)."""
        return self._on_all("mesh_shape")[0]

    def device_count(self) -> int:
        """The devices of every host together (the mesh's size)."""
        return self._on_all("device_count")[0]

    def export(self, out_dir: str) -> list[str]:
        return self._on_all("export", out_dir, timeout_s=self.slow_call_timeout_s)[0]

    def export_adapters(self, out_dir: str, alpha: float) -> list[str]:
        return self._on_all("export_adapters", out_dir, alpha, timeout_s=self.slow_call_timeout_s)[
            0
        ]

    def save(
        self,
        directory: str,
        extras: dict[str, Any],
        max_to_keep: int = 3,
        metrics: dict[str, float] | None = None,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
    ) -> int:
        """A checkpoint written by every host (orbax: each process its shards, process 0
        the metadata; ``directory`` must be one path all hosts see, e.g. ``gs://`` or a
        shared volume); remembered as where ``rebuild`` restores from."""
        self._checkpoints = {
            "directory": directory,
            "max_to_keep": max_to_keep,
            "keep_best_by": keep_best_by,
            "keep_best_mode": keep_best_mode,
        }
        return self._on_all(
            "save",
            directory,
            extras,
            max_to_keep,
            metrics,
            keep_best_by,
            keep_best_mode,
            timeout_s=self.slow_call_timeout_s,
        )[0]

    def finish_checkpoints(self) -> None:
        self._on_all("finish_checkpoints", timeout_s=self.slow_call_timeout_s)

    def save_reference(self, directory: str) -> None:
        self._reference = directory
        self._on_all("save_reference", directory, timeout_s=self.slow_call_timeout_s)

    def restore(
        self,
        directory: str,
        max_to_keep: int = 3,
        reference_directory: str | None = None,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
    ) -> dict[str, Any]:
        """Every host restores the same checkpoint: the newest of the steps that every host
        lists (``common_steps``; a damaged one is skipped as ``Checkpointer.restore``
        does), then each reports what it restored and the group checks that they agree
        (``check_same_restore``). Returns the checkpoint's extras.

        Raises:
          FileNotFoundError: no host lists a checkpoint in ``directory``.
          LearnerStateDivergence: no step is on every host, or the hosts restored
            different ones (the group is then torn down).
          LearnerHostFailure: a host died or was stuck (past ``slow_call_timeout_s``).
          whatever a host's ``Checkpointer.restore`` raised (``CheckpointUnavailable``...).
        """
        self._checkpoints = {
            "directory": directory,
            "max_to_keep": max_to_keep,
            "keep_best_by": keep_best_by,
            "keep_best_mode": keep_best_mode,
        }
        if reference_directory:
            self._reference = reference_directory
        slow = self.slow_call_timeout_s
        listed = self._on_all(
            "checkpoint_steps", directory, max_to_keep, keep_best_by, keep_best_mode, timeout_s=slow
        )
        among = common_steps(listed, [self._host_name(r) for r in range(len(self.hosts))])
        extras = self._on_all(
            "restore",
            directory,
            max_to_keep,
            reference_directory,
            keep_best_by,
            keep_best_mode,
            among=among,
            timeout_s=slow,
        )
        self._check_same(extras)
        return extras[0]

    def profile_drain(self) -> dict[str, Any]:
        """Rank 0's spans (every host runs the same program)."""
        return self._on_all("profile_drain")[0]

    def profile_set_enabled(self, enabled: bool) -> None:
        self._on_all("profile_set_enabled", enabled)
