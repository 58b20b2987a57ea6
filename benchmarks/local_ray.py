"""Ray for the benchmarks that run on it: a local cluster of the script's own (the default,
and what every recorded number used), or a running cluster named by ``--ray-address``.

The smoke tests (``tests/test_benchmarks.py``) pass their session's cluster: starting one
costs about 7 s of CPU on 2 cores, more than some of the smoke runs themselves. The
script's actors ask for no CPUs (``num_cpus=0``), so a shared cluster never makes them
wait; they are the script's job's and go when it disconnects. Imported by the benchmarks
(``benchmarks/`` is on ``sys.path`` when they run as scripts)."""

from __future__ import annotations

import argparse
import os


def add_ray_address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster to connect to (its GCS address, host:port); default: "
        "start a local one for this run",
    )


def init_ray(address: str | None, runtime_env: dict | None = None) -> None:
    """Connects to the cluster at ``address``, or starts a local one (as many CPUs as the
    machine, no dashboard, a 128 MiB object store) when it is None. Actors' output stays
    in their logs, not on this process's stdout, which carries the JSON.

    A local cluster's workers inherit this process's environment; a running cluster's
    were started by someone else, so this process's ``JAX_*`` settings go to them in
    ``runtime_env`` (those of ``runtime_env`` win)."""
    import ray  # here: orchestrator_overhead.py measures without Ray too

    if address:
        env = dict(runtime_env or {})
        jax = {k: v for k, v in os.environ.items() if k.startswith("JAX_")}
        env["env_vars"] = {**jax, **env.get("env_vars", {})}
        ray.init(address=address, log_to_driver=False, runtime_env=env)
        return
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=os.cpu_count() or 2,
        object_store_memory=128 * 1024**2,
        log_to_driver=False,
        runtime_env=runtime_env,
    )
