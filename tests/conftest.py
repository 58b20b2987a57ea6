"""Shared fixtures. Ray starts once per test session, and only for tests that ask for it:
starting Ray per test is the main way to make this suite slow."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster (2 CPUs, no dashboard, 200 MB object store) for the session."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
                 runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}}, log_to_driver=False)
    yield ray
    if started_here:
        ray.shutdown()
