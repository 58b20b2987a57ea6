"""Shared fixtures. Ray starts once per test session, and only for tests that ask for it:
starting Ray per test is the main way to make this suite slow."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


_RAY_INIT = dict(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
                 runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}}, log_to_driver=False)
_started_here = []


def _start_ray():
    import ray

    if not ray.is_initialized():
        ray.init(**_RAY_INIT)
        _started_here.append(True)
    return ray


def pytest_collection_finish(session):
    """Starts Ray before the first test when any collected test asks for it.

    Ray starts its processes with a ``preexec_fn``: Python code that runs in the forked
    child before exec. Once a test has started JAX's runtime threads in this process, such
    a fork can deadlock (JAX warns "os.fork() was called"), so Ray must start before any
    test runs JAX, not when the first Ray test happens to run.
    """
    if session.config.option.collectonly:
        return
    if any("ray_session" in getattr(item, "fixturenames", ()) for item in session.items):
        try:
            _start_ray()
        except Exception:  # noqa: BLE001 - the fixture tries again and fails the tests that need Ray
            pass


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster (2 CPUs, no dashboard, 200 MB object store) for the session."""
    ray = _start_ray()
    yield ray
    if _started_here:
        ray.shutdown()
