"""An OpenEnv environment as a raytunix environment.

Source: OpenEnv (github.com/meta-pytorch/OpenEnv, PyPI ``openenv-core``, 0.2.1 to 0.3.x).
An OpenEnv environment is an ``Environment`` subclass (``reset(seed=...)`` and
``step(action)`` returning a pydantic ``Observation`` with ``reward`` and ``done``) served
over HTTP and WebSocket by openenv's FastAPI app; a client plays it as::

    result = client.reset(seed=seed)        # result.observation: the fields as a dict
    result = client.step(action)            # result.reward (float or None), result.done

Each raytunix episode starts the environment's server on a free port of 127.0.0.1 (in a
thread of the env actor, or in a child process), plays it through openenv's client and
stops the server when the episode's environment closes. In a config::

    env:
      name: openenv
      kwargs: {env_id: my_package.my_env:MyEnvironment, env_args: {level: 2}}

``env_id`` is an openenv ``Environment`` subclass by import path, a server app by import
path (``my_env.server.app:app``) or an installed OpenEnv environment package by name
(``echo_env``): ``raytunix.envs.openenv_server.resolve``. Nothing is pulled from a
registry, a Hugging Face Space or Docker: the environment's code must be installed.
"""

from __future__ import annotations

import collections.abc
import json
import logging
import math
import numbers
import os
import re
import threading
from typing import Any

from raytunix.envs.base import BaseEnv
from raytunix.envs.global_random import EpisodeRandom, seeded_tasks
from raytunix.envs.openenv_server import ProcessServer, ThreadServer, resolve
from raytunix.registry import register
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus, StepResult, Task, ToolErrorKind

logger = logging.getLogger(__name__)

SERVER_MODES = ("thread", "process")
# openenv-core's client adds localhost to NO_PROXY around each connect and then removes
# it again: a thread reading os.environ meanwhile (another episode's connect, in an env
# actor's threads) raised KeyError. With localhost already there it changes nothing.
_CONNECT_LOCK = threading.Lock()


def _localhost_without_proxy() -> None:
    current = os.environ.get("NO_PROXY", "")
    if "localhost" not in current.lower():
        os.environ["NO_PROXY"] = (
            f"{current},localhost,127.0.0.1" if current else "localhost,127.0.0.1"
        )


# A JSON object in a reply: the whole reply, else the last fenced block, else the span from
# the first "{" to the last "}".
_FENCED = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


@register("env", "openenv")
class OpenEnvEnv(BaseEnv):
    """Runs one OpenEnv episode per raytunix episode, against a server of its own.

    Seeds: a task is a reset seed (``tasks``), sent as ``reset(seed=...)``, so the G
    episodes of a group start from the same state when the environment honours its seed.
    ``tasks`` checks that it does (the first seed reset twice must give the same
    observation), and so does each episode (its first observation must be the task's);
    an environment that ignores its seed fails these checks with an error that says so,
    unless ``require_seed=False``: then the tasks keep their seeds but a group's episodes
    may start from different states (a warning says it once per instance).

    Observations: the observation's fields as openenv sends them (``reward``, ``done``
    and ``metadata`` apart): ``observation_field``'s value when given, the only field's
    value when there is one, else one ``name: value`` line per field (JSON for non-text).

    Actions: when the action class has one text field (or ``action_field`` names one), the
    model's reply goes into it as it is and the environment judges it (its own penalty for
    a bad move is kept). Otherwise the reply must hold the action as a JSON object (the
    whole reply, a fenced block or the span between its outer braces); a reply that does
    not parse or that the action class refuses is not sent: it gets an ``error: ...``
    observation naming the fields, reward 0 and one ``format`` tool error, and the episode
    goes on.

    Rewards: each step's reward as the environment gives it (``None`` is 0; the episode's
    reward is their sum, so an environment that pays only at the end pays at the end).
    ``done`` ends the episode ``COMPLETED``; ``env.max_turns`` truncates it otherwise.

    Thread safety: with ``server="thread"`` (an Environment class's default) the environment's code runs in this process,
    and every call into it holds ``GLOBAL_RNG_LOCK`` with the episode's own streams of
    ``random`` and ``numpy.random`` swapped in (``raytunix.envs.global_random``), so an
    environment that seeds the global generators plays each episode as if it ran alone;
    calls of one env actor's episodes take turns. ``server="process"`` runs each server
    in a child process: nothing is shared and calls run in parallel, at the price of a
    process start (importing openenv-core: seconds) per episode.

    Args:
      env_id: what to serve (see the module docstring).
      env_args: keyword arguments for the Environment class (not for an app).
      action_cls, observation_cls: import paths of the action and observation classes,
        when they cannot be inferred.
      action_field: the action's text field that receives the reply.
      observation_field: the observation field shown to the model.
      server: "thread" or "process"; by default "thread" for an Environment class,
        "process" for an app (a package's app object is one per process and serves one
        session at a time, so concurrent episodes in one env actor need a process each).
      require_seed: refuse an environment that does not start from its seed's state.
      timeout_s: seconds to wait for one reset or step reply.
      start_timeout_s: seconds to wait for the server to start.

    Raises:
      ImportError: openenv-core is not installed (``pip install 'raytunix[openenv]'``).
      ValueError: a bad ``env_id`` (see ``raytunix.envs.openenv_server.resolve``), a
        ``server`` other than "thread"/"process", an ``action_field`` that is not a text
        field of the action, non-positive timeouts.
      TypeError: ``env_args`` is not a mapping.
    """

    default_agent = "text"

    def __init__(
        self,
        env_id: str,
        env_args: dict[str, Any] | None = None,
        action_cls: str | None = None,
        observation_cls: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        server: str | None = None,
        require_seed: bool = True,
        timeout_s: float = 60.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        super().__init__()
        if env_args is not None and not isinstance(env_args, collections.abc.Mapping):
            raise TypeError(f"env.kwargs.env_args must be a mapping, got {env_args!r}.")
        if server is not None and server not in SERVER_MODES:
            raise ValueError(
                f"env.kwargs.server={server!r}: use 'thread' (the server in this process) "
                "or 'process' (a child process per episode)."
            )
        for key, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(value, numbers.Real) or not value > 0:
                raise ValueError(f"env.kwargs.{key}={value!r}: give a positive number of seconds.")
        self.env_id = env_id
        args: dict[str, Any] = dict(env_args or {})
        self._spec = {
            "env_id": env_id,
            "env_args": args,
            "action_cls": action_cls,
            "observation_cls": observation_cls,
        }
        # Resolved here too in process mode: a bad env_id fails when the env is built.
        resolved = resolve(env_id, args, action_cls, observation_cls)
        self._make_app = resolved.make_app
        # A pydantic model class (openenv's Action).
        self.action_cls: Any = resolved.action_cls
        self.action_field = _text_field(self.action_cls, action_field)
        self.observation_field = observation_field
        # A package's app is one per process and holds one session at a time.
        self.server_mode = server or ("thread" if resolved.kind == "class" else "process")
        self.require_seed = bool(require_seed)
        self._timeout_s = float(timeout_s)
        self._start_timeout_s = float(start_timeout_s)
        self._server: ThreadServer | ProcessServer | None = None
        self._client: Any = None
        self._streams = EpisodeRandom()
        self._warned_unseeded = False

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        """``size`` tasks, one reset seed each (``raytunix.envs.global_random.reset_seeds``);
        the question is the environment's first observation under that seed.

        Raises:
          ValueError: ``split`` is not "train" or "heldout", ``size`` exceeds 2**20, or
            (with ``require_seed``) the first seed reset twice starts differently.
        """
        tasks = seeded_tasks(split, size, seed, self._reset, openenv_id=self.env_id)
        if tasks:
            again = self._reset(tasks[0].metadata["seed"])
            if again != tasks[0].question:
                self._unseeded(
                    f"two resets with seed {tasks[0].metadata['seed']} started differently "
                    f"({tasks[0].question!r:.200} then {again!r:.200})",
                    ValueError,
                )
        return tasks

    def _initial_observation(self, task: Task) -> str:
        seed = task.metadata.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(
                f"task {task.task_id!r}: metadata['seed'] is {seed!r}, not an int; "
                "OpenEnv tasks come from OpenEnvEnv.tasks."
            )
        observation = self._reset(seed)
        if observation != task.question:
            self._unseeded(
                f"task {task.task_id!r} (seed {seed}) started from {observation!r:.200}, "
                f"not from its question {task.question!r:.200}",
                RuntimeError,
            )
        return observation

    def _step_impl(self, action: Action) -> StepResult:
        payload = self._action_payload(action.text)
        if isinstance(payload, str):
            return StepResult(
                observation=payload, info={TOOL_ERRORS_KEY: {ToolErrorKind.FORMAT.value: 1}}
            )
        result = self._call("step", payload)
        reward = _reward(result.reward, self.env_id)
        observation = self._shown(result.observation)
        if not result.done:
            return StepResult(observation=observation, reward=reward)
        return StepResult(
            observation=observation, reward=reward, done=True, status=EpisodeStatus.COMPLETED
        )

    def close(self) -> None:
        """Closes the client's session and stops the server (idempotent)."""
        client, server = self._client, self._server
        self._client = self._server = None
        try:
            if client is not None:
                client.close()
        finally:
            if server is not None:
                server.stop()

    def _reset(self, seed: int) -> str:
        self._streams.restart()
        return self._shown(self._call("reset", {"seed": seed}).observation)

    def _call(self, method: str, payload: dict[str, Any]) -> Any:
        """``client.reset(**payload)`` or ``client.step(payload)``; in thread mode with
        the episode's random streams in place (the environment runs in this process)."""
        client = self._connected()
        call = (
            (lambda: client.reset(**payload))
            if method == "reset"
            else (lambda: client.step(payload))
        )
        try:
            if self.server_mode == "process":
                return call()
            with self._streams.use():
                return call()
        except RuntimeError as e:
            # The server's error message: FACTORY_ERROR when the constructor raised.
            raise RuntimeError(
                f"OpenEnv environment {self.env_id!r}, {method}: {e}."
                + (self._constructor_hint() if "FACTORY_ERROR" in str(e) else "")
            ) from e
        except ConnectionError as e:
            raise RuntimeError(
                f"OpenEnv environment {self.env_id!r}, {method}: cannot reach its server: {e}."
            ) from e
        except Exception as e:
            # A session whose environment could not be built can be closed by the server
            # before its error message is read (websockets' ConnectionClosed).
            if "ConnectionClosed" not in type(e).__name__:
                raise
            raise RuntimeError(
                f"OpenEnv environment {self.env_id!r}, {method}: the server closed the session "
                f"({e}).{self._constructor_hint()}"
            ) from e

    def _constructor_hint(self) -> str:
        return (
            " The environment's constructor raised: build it by hand with "
            f"env.kwargs.env_args={self._spec['env_args']!r} to see why."
        )

    def _connected(self) -> Any:
        """The client, starting the server and connecting on first use."""
        if self._client is not None:
            return self._client
        try:
            if self.server_mode == "process":
                self._server = ProcessServer(self._spec, self._start_timeout_s)
            else:
                self._server = ThreadServer(self._make_app(), self._start_timeout_s)
        except RuntimeError as e:
            raise RuntimeError(
                f"env.name=openenv env.kwargs.env_id={self.env_id!r} "
                f"(server={self.server_mode}): {e}. Fix the environment's constructor or "
                "startup, or raise env.kwargs.start_timeout_s if it is only slow."
            ) from e
        from openenv.core.generic_client import GenericEnvClient

        client = GenericEnvClient(base_url=self._server.url, message_timeout_s=self._timeout_s)
        # openenv-core 0.3's client is async with a .sync() wrapper; 0.2's is synchronous.
        sync = getattr(client, "sync", None)
        self._client = sync() if callable(sync) else client
        with _CONNECT_LOCK:
            _localhost_without_proxy()
            self._client.connect()
        return self._client

    def _action_payload(self, text: str) -> dict[str, Any] | str:
        """The action's JSON payload for the reply ``text``, or the error observation."""
        from pydantic import ValidationError

        if self.action_field is not None:
            raw: Any = {self.action_field: text}
        else:
            raw = _json_object(text)
            if raw is None:
                return f"error: no JSON object in the reply. {self._action_help()}"
        try:
            return self.action_cls.model_validate(raw).model_dump(mode="json")
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'action'}: {err['msg']}" for err in e.errors()
            )
            return f"error: not a valid action ({problems}). {self._action_help()}"

    def _action_help(self) -> str:
        fields = [
            f"{name} ({getattr(info.annotation, '__name__', info.annotation)})"
            for name, info in self.action_cls.model_fields.items()
            if name != "metadata"
        ]
        return f"Reply with one JSON object of {self.action_cls.__name__}: {', '.join(fields)}."

    def _shown(self, observation: Any) -> str:
        if not isinstance(observation, collections.abc.Mapping):
            return str(observation)
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise ValueError(
                    f"env.kwargs.observation_field={self.observation_field!r} is not a field "
                    f"of {self.env_id!r}'s observation (fields: {', '.join(observation)})."
                )
            return _text(observation[self.observation_field])
        if len(observation) == 1:
            return _text(next(iter(observation.values())))
        return "\n".join(f"{name}: {_text(value)}" for name, value in observation.items())

    def _unseeded(self, what: str, error: type[Exception]) -> None:
        message = (
            f"OpenEnv environment {self.env_id!r} does not start from its seed's state: {what}. "
            "A group's episodes would start from different states. Make its reset(seed=...) "
            "seed everything it draws, or set env.kwargs.require_seed=false to train anyway."
        )
        if self.require_seed:
            raise error(message)
        if not self._warned_unseeded:
            self._warned_unseeded = True
            logger.warning("%s", message)


def _text_field(action_cls: Any, action_field: str | None) -> str | None:
    """The action's field that takes the reply as text: ``action_field`` (checked), else
    its only field besides ``metadata`` when that is a str, else None (JSON replies).

    Raises:
      ValueError: ``action_field`` is not a str field of the action class.
    """
    fields = {n: f for n, f in action_cls.model_fields.items() if n != "metadata"}
    if action_field is not None:
        if action_field not in fields or fields[action_field].annotation is not str:
            text_fields = [n for n, f in fields.items() if f.annotation is str]
            raise ValueError(
                f"env.kwargs.action_field={action_field!r} is not a text field of "
                f"{action_cls.__name__} (text fields: {', '.join(text_fields) or 'none'}); "
                "leave it out for replies that are JSON objects of the action."
            )
        return action_field
    if len(fields) == 1:
        ((name, info),) = fields.items()
        if info.annotation is str:
            return name
    return None


def _json_object(text: str) -> dict[str, Any] | None:
    candidates = [text.strip()] + _FENCED.findall(text)[::-1]
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{") : text.rindex("}") + 1])
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _reward(value: Any, env_id: str) -> float:
    if value is None:
        return 0.0
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise TypeError(
            f"OpenEnv environment {env_id!r} gave reward {value!r}; it must be a finite number."
        )
    return float(value)
