"""Shared fixtures. Ray starts once per test session, and only for tests that ask for it:
starting Ray per test is the main way to make this suite slow. For the same reason the
tests that only read a trained run's directory share one (``tiny_run``)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent JAX compilation cache for the session: the suite builds the same tiny
# models in many processes (Ray actors, `raytunix train` subprocesses), which inherit this
# environment, so a program compiled once is loaded by the others (about a fifth off the
# end-to-end runs, measured on 2 cores). Every program is cached, however fast it compiled.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _JAX_CACHE = tempfile.mkdtemp(prefix="raytunix-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
else:
    _JAX_CACHE = None

# The suite compiles hundreds of tiny programs and runs each a few times: JAX's switch for
# when compiling costs more than running cuts an update program's compile by about 40%
# (4.7 s to 2.9 s of CPU, measured on 2 cores). Every process of the session inherits it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before xdist's, which turns -n's "no" dist into "load"
def pytest_cmdline_main(config):
    # Under -n with no --dist chosen (on the command line, -d, or PYTEST_ADDOPTS), xdist's
    # group scheduler: tests that share a module- or class-scoped fixture go to one worker
    # (``_group_shared_fixtures``), which builds it once (handed out one at a time, they
    # met on both workers: a 4-node cluster scenario was built twice, 47 s + 38 s); every
    # other test goes out one at a time in collection order (slow tier first).
    option = config.option
    if (
        getattr(option, "numprocesses", None)
        and getattr(option, "dist", "no") == "no"
        and not getattr(option, "distload", False)
    ):
        option.dist = "loadgroup"
        option.loadscopereorder = False


def pytest_configure(config):
    # A chosen --dist load hands out one test at a time too: its default chunks gave one
    # worker nearly the whole slow tier.
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
    # A worker names each grouped test by its group (xdist reads ``loadgroup`` when it
    # collects); it parses the command line itself, where no --dist asked for groups.
    if getattr(config, "workerinput", {}).get("raytunix_test_groups"):
        config.option.loadgroup = True
    config.addinivalue_line(
        "markers",
        "benchmark: runs a benchmarks/ script end to end with tiny settings, in "
        "a subprocess (10 s to a minute each on 2 cores); -m 'not benchmark' skips them",
    )


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without xdist
def pytest_configure_node(node):
    """(xdist, in the controller) Tells a worker whether tests are scheduled by group."""
    node.workerinput["raytunix_test_groups"] = node.config.option.dist == "loadgroup"


_RAY_INIT = dict(
    address="local",
    num_cpus=2,
    include_dashboard=False,
    object_store_memory=200 * 1024**2,
    runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}},
    log_to_driver=False,
)
_started_here = []


def _start_ray():
    import ray

    if not ray.is_initialized():
        ray.init(**_RAY_INIT)
        _started_here.append(True)
    return ray


def pytest_unconfigure(config):
    if _JAX_CACHE is not None:
        import shutil

        shutil.rmtree(_JAX_CACHE, ignore_errors=True)


def pytest_collection(session):
    """Starts Ray before any test module is imported when a test file to be collected asks
    for ``ray_session``.

    Ray starts its processes with a ``preexec_fn``: Python code that runs in the forked
    child before exec. Once JAX's runtime threads run in this process, such a fork can
    deadlock (JAX warns "os.fork() was called"), and some test modules start JAX when they
    are imported; so Ray starts before collection imports them. Files are checked by their
    text, before import; a file that mentions the fixture (or ``tiny_run``, which uses it)
    but whose tests are deselected costs one idle Ray start (~3 s).
    """
    if session.config.option.collectonly:
        return
    base = session.config.invocation_params.dir
    for arg in session.config.args:
        path = base / arg.split("::", 1)[0]
        files = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        if any(f.is_file() and _needs_ray(f.read_text(errors="ignore")) for f in files):
            try:
                _start_ray()
            except Exception:  # noqa: BLE001 - the fixture tries again and fails the tests that need Ray
                pass
            return


def _needs_ray(test_file_text: str) -> bool:
    return "ray_session" in test_file_text or "tiny_run" in test_file_text


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster (2 CPUs, no dashboard, 200 MB object store) for the session."""
    ray = _start_ray()
    yield ray
    if _started_here:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_run(ray_session, tmp_path_factory):
    """A finished tiny run (``shared_runs.TinyRun``: its directory, its driver's output),
    trained on first use. The directory is shared: copy it before writing into it."""
    from filelock import FileLock

    import shared_runs

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, above each worker's own: one run for all
    directory = str(root / "tiny-run")
    with FileLock(directory + ".lock"):
        return shared_runs.trained(directory)


@pytest.hookimpl(tryfirst=True)  # before xdist's, which names each test by its group
def pytest_collection_modifyitems(config, items):
    """Runs the slow tier first, each tier in its usual order. With two workers
    (``-n 2``) handed one test at a time (``pytest_cmdline_main``), the end-to-end tests then
    share the run's first part and the many short tests fill the last minutes, instead of
    one worker finishing a two-minute test alone while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if getattr(config.option, "loadgroup", False):  # a worker of a group-scheduled run
        _group_shared_fixtures(items)


_SHARED_SCOPES = {"class", "module", "package"}


def _group_shared_fixtures(items) -> None:
    """Marks each test that uses a module-, class- or package-scoped fixture, directly or
    through another fixture, with its file's ``xdist_group``: under ``-n`` those tests run
    on one worker, which builds the fixture once (``pytest_cmdline_main`` picks the group
    scheduler). Session-scoped fixtures are per worker anyway and group nothing."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("xdist_group") is not None:
            continue
        if any(
            definitions[-1].scope in _SHARED_SCOPES
            for definitions in info.name2fixturedefs.values()
            if definitions
        ):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
