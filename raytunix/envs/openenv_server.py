"""Serving an OpenEnv environment on 127.0.0.1 for ``env.name=openenv``
(``raytunix.envs.openenv_env``).

``resolve`` turns ``env.kwargs.env_id`` into the server's ASGI app and the environment's
action class; ``ThreadServer`` runs the app with uvicorn in a thread of this process,
``ProcessServer`` in a child process (``python -m raytunix.envs.openenv_server SPEC``). Both
listen on a socket bound here to a free port of 127.0.0.1 before the server starts (no
race for the port) and stop on ``stop()``; a child also exits when its parent dies (its
stdin, a pipe from the parent, closes).

Nothing here imports openenv-core until an environment is resolved.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.error
import urllib.request
from typing import Any, Callable

# Where an installed OpenEnv environment package keeps its server app (OpenEnv's layout:
# ``<name>_env/server/app.py`` defines ``app = create_app(...)``).
APP_ATTR = "server.app:app"
INSTALL_HINT = "pip install 'raytunix[openenv]'"


@dataclasses.dataclass
class Resolved:
    """What ``env_id`` names.

    Attributes:
      make_app: returns the ASGI (FastAPI) app serving the environment: a new one per call
        for an Environment class, the package's own (one per process) for an app.
      action_cls: the environment's Action class (a pydantic model).
      kind: "class" (an Environment subclass served with openenv's ``create_fastapi_app``)
        or "app" (an app the environment's package built).
    """

    make_app: Callable[[], Any]
    action_cls: type
    kind: str


def _openenv_types() -> tuple[type, type, type, Any]:
    """openenv's Environment, Action and Observation classes and ``create_fastapi_app``."""
    try:
        from openenv.core.env_server.http_server import create_fastapi_app
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action, Observation
    except ImportError as e:
        raise ImportError(
            f"env.name=openenv needs the openenv-core package ({e}); {INSTALL_HINT}."
        ) from e
    return Environment, Action, Observation, create_fastapi_app


def _import_attr(path: str, key: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"env.kwargs.{key}={path!r}: module {module_name!r} cannot be imported "
            f"({type(e).__name__}: {e}); install it or put its directory on PYTHONPATH."
        ) from e
    if not hasattr(module, attr):
        raise ValueError(f"env.kwargs.{key}={path!r}: module {module_name!r} has no {attr!r}.")
    return getattr(module, attr)


def _class_arg(value: Any, base: type, key: str) -> type:
    """``value`` (a class or an import path ``package.module:Class``) as a subclass of
    ``base``."""
    cls = _import_attr(value, key) if isinstance(value, str) and ":" in value else value
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        raise ValueError(
            f"env.kwargs.{key}={value!r} is not an openenv {base.__name__} subclass "
            f"(give package.module:Class)."
        )
    return cls


def _generic_args(env_cls: type, environment: type) -> tuple[Any, ...]:
    """The type arguments ``(ActT, ObsT, StateT)`` of ``Environment[...]`` among the
    class's bases, or ``()``."""
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is environment:
                return typing.get_args(base)
    return ()


def installed_packages() -> list[str]:
    """The installed OpenEnv environment packages (distributions ``openenv-*`` other than
    openenv-core itself)."""
    names = {dist.metadata["Name"] or "" for dist in importlib.metadata.distributions()}
    return sorted(n for n in names if n.startswith("openenv-") and n != "openenv-core")


def package_module(name: str) -> str:
    """OpenEnv's module name for an environment name: ``echo``, ``echo-env`` and
    ``echo_env`` are all ``echo_env``."""
    stem = re.sub(r"[-_]env$", "", name).replace("-", "_")
    return f"{stem}_env"


def _package_app_path(env_id: str) -> str:
    module = package_module(env_id)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        installed = installed_packages()
        raise ValueError(
            f"env.kwargs.env_id={env_id!r} is not an installed OpenEnv environment (no module "
            f"{module!r}). Installed: {', '.join(installed) if installed else 'none'}. "
            "Install the environment's package (its server must be importable as "
            f"{module}.{APP_ATTR}), or name an Environment class or a server app by import "
            "path: env.kwargs.env_id=package.module:MyEnvironment."
        )
    return f"{module}.{APP_ATTR}"


def resolve(
    env_id: str,
    env_args: dict[str, Any],
    action_cls: Any = None,
    observation_cls: Any = None,
) -> Resolved:
    """The app and action class that ``env_id`` names.

    ``env_id`` is an import path ``package.module:Name`` of an openenv ``Environment``
    subclass (served with openenv's ``create_fastapi_app``, built per session as
    ``Name(**env_args)``; its action and observation classes come from its
    ``Environment[Action, Observation, State]`` base unless given) or of a server app
    (``create_app(...)``'s FastAPI app; its action class is the one ``Action`` subclass its
    module holds unless given), or the name of an installed OpenEnv environment package
    (``echo_env``, ``echo``), whose app is ``<name>_env.server.app:app``.

    Raises:
      ImportError: openenv-core is not installed.
      ValueError: ``env_id`` names nothing importable, nothing of these kinds, or an app
        with ``env_args``; the classes cannot be inferred (``action_cls`` /
        ``observation_cls`` named as the fix), or a given class is not of its kind.
    """
    environment, action, observation, create_fastapi_app = _openenv_types()
    if not isinstance(env_id, str) or not env_id.strip():
        raise ValueError(
            f"env.kwargs.env_id={env_id!r}: name an OpenEnv environment: an installed "
            "environment package (echo_env) or package.module:MyEnvironment."
        )
    path = env_id if ":" in env_id else _package_app_path(env_id)
    target = _import_attr(path, "env_id")
    if inspect.isclass(target) and issubclass(target, environment):
        action_cls, observation_cls = _environment_classes(
            env_id, target, action_cls, observation_cls
        )
        make_app = functools.partial(
            create_fastapi_app,
            functools.partial(target, **env_args),
            action_cls,
            observation_cls,
        )
        return Resolved(make_app, action_cls, "class")
    if not _is_asgi_app(target):
        raise ValueError(
            f"env.kwargs.env_id={env_id!r} is a {type(target).__name__}, neither an openenv "
            "Environment subclass nor a server app (openenv's create_app(...))."
        )
    if env_args:
        raise ValueError(
            f"env.kwargs.env_args={env_args!r}: {env_id!r} is a server app that builds its "
            "environment itself; name the Environment class instead to pass arguments."
        )
    if action_cls is None:
        module = sys.modules[path.partition(":")[0]]
        found = {v for v in vars(module).values() if _is_strict_subclass(v, action)}
        if len(found) != 1:
            raise ValueError(
                f"env.kwargs.env_id={env_id!r}: found {len(found)} Action classes in its "
                f"module ({', '.join(sorted(c.__name__ for c in found)) or 'none'}); give "
                "env.kwargs.action_cls=package.module:MyAction."
            )
        (action_cls,) = found
    app = target
    return Resolved(lambda: app, _class_arg(action_cls, action, "action_cls"), "app")


def _environment_classes(
    env_id: str, env_cls: type, action_cls: Any, observation_cls: Any
) -> tuple[type, type]:
    """The Action and Observation classes of an Environment subclass: those given, else its
    ``Environment[MyAction, MyObservation, State]`` base's."""
    environment, action, observation, _ = _openenv_types()
    inferred = _generic_args(env_cls, environment)
    classes = []
    for given, index, base, key in (
        (action_cls, 0, action, "action_cls"),
        (observation_cls, 1, observation, "observation_cls"),
    ):
        value = given if given is not None else (inferred[index] if inferred else None)
        if given is None and not (inspect.isclass(value) and issubclass(value, base)):
            raise ValueError(
                f"env.kwargs.env_id={env_id!r}: {env_cls.__name__} does not name its "
                f"{base.__name__} class (Environment[MyAction, MyObservation, State]); "
                f"give env.kwargs.{key}=package.module:Class."
            )
        classes.append(_class_arg(value, base, key))
    return classes[0], classes[1]


def _is_strict_subclass(value: Any, base: type) -> bool:
    return inspect.isclass(value) and issubclass(value, base) and value is not base


def _is_asgi_app(value: Any) -> bool:
    try:
        from starlette.applications import Starlette
    except ImportError:
        return False
    return isinstance(value, Starlette)


def _bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def _uvicorn_server(app: Any, log_level: str) -> Any:
    import uvicorn
    import uvicorn.config

    # The sans-I/O implementation avoids websockets' deprecated legacy server.
    ws = "websockets-sansio" if "websockets-sansio" in uvicorn.config.WS_PROTOCOLS else "auto"
    config = uvicorn.Config(app, log_level=log_level, ws=ws, lifespan="on")
    return uvicorn.Server(config)


class ThreadServer:
    """The app served by uvicorn in a daemon thread of this process.

    Raises:
      RuntimeError: the server did not start within ``start_timeout_s`` seconds (or its
        startup raised: the message says what).
    """

    def __init__(self, app: Any, start_timeout_s: float) -> None:
        self._sock = _bound_socket()
        self.url = "http://127.0.0.1:%d" % self._sock.getsockname()[1]
        # Quiet: openenv's server logs a client's orderly close as an ASGI error, and what
        # goes wrong in a session comes back to the client as an error message.
        self._server = _uvicorn_server(app, "critical")
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="openenv-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                if self._error is not None:
                    why = repr(self._error)
                elif self._thread.is_alive():
                    why = f"not up in {start_timeout_s} s"
                else:
                    why = "its startup failed (run it with env.kwargs.server=process to see why)"
                raise RuntimeError(f"the OpenEnv server did not start: {why}")
            time.sleep(0.005)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as e:  # noqa: BLE001 - uvicorn exits its thread with SystemExit
            self._error = e

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the server (its open sessions close) and waits up to ``timeout_s``."""
        self._server.should_exit = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._sock.close()


class ProcessServer:
    """The environment served in a child process (``python -m raytunix.envs.openenv_server``)
    that resolves ``spec`` (``resolve``'s arguments) itself; its stderr goes to a
    temporary file whose tail a failed start reports.

    Raises:
      RuntimeError: the child exited or did not answer ``/health`` within
        ``start_timeout_s`` seconds (its stderr's tail in the message).
    """

    def __init__(self, spec: dict[str, Any], start_timeout_s: float) -> None:
        sock = _bound_socket()
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ)
        # The child imports what this process imports (a test's or a user's module).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__, json.dumps({**spec, "fd": sock.fileno()})],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=self._log,
                pass_fds=[sock.fileno()],
                env=env,
            )
        finally:
            sock.close()  # the child holds its own copy
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, start_timeout_s: float) -> None:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self._child.poll() is not None:
                raise RuntimeError(
                    f"the OpenEnv server process exited with code {self._child.returncode}: "
                    f"{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the OpenEnv server process did not answer in {start_timeout_s} s "
                    f"(raise env.kwargs.start_timeout_s if it is slow): {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the child's stderr (``"(no output)"`` when it wrote none)."""
        self._log.seek(0)
        text = self._log.read().decode("utf-8", "replace").strip()
        return text[-chars:] if text else "(no output)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the child: closes its stdin (it exits on that), then terminates it, then
        kills it if it is still there after ``timeout_s``."""
        if self._child.poll() is None:
            if self._child.stdin is not None:
                self._child.stdin.close()
            try:
                self._child.wait(timeout_s / 2)
            except subprocess.TimeoutExpired:
                self._child.terminate()
                try:
                    self._child.wait(timeout_s / 2)
                except subprocess.TimeoutExpired:
                    self._child.kill()
                    self._child.wait()
        self._log.close()


def _exit_with_parent() -> None:
    sys.stdin.buffer.read()  # returns at EOF: the parent closed the pipe or died
    os._exit(0)


def main(argv: list[str]) -> None:
    """The child's entry point: ``argv[0]`` is a JSON spec with ``resolve``'s arguments
    and the listening socket's ``fd``."""
    spec = json.loads(argv[0])
    sock = socket.socket(fileno=spec["fd"])
    resolved = resolve(
        spec["env_id"], spec["env_args"], spec.get("action_cls"), spec.get("observation_cls")
    )
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    # The parent shows this stderr only when the server fails to start.
    _uvicorn_server(resolved.make_app(), "error").run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1:])
