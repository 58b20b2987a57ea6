"""``env.name=verifiers``: a verifiers 0.4 environment, run through the gateway.

Source: verifiers (github.com/PrimeIntellect-ai/verifiers, PyPI ``verifiers``, 0.4.x; the
``verifiers.v1`` stack). A verifiers environment drives the model itself: its harness
calls an OpenAI-compatible endpoint. Each episode here is one ``Env.run_episode`` of the
environment against the episode's gateway URL and key, so its calls are answered by the
run's engines and recorded by the gateway token for token (``raytunix.rollout.program``
runs it, as it runs any agent program); the reward is the environment's own score, the sum
of its traces' weighted ``@reward`` values (one trace for a single-seat env). In a config::

    env:
      name: verifiers
      kwargs:
        env_id: my-env             # an installed verifiers taskset package (or owner/name)
        env_args: {taskset: {split: train}}    # more of verifiers' EnvConfig, optional

``env_id`` is either a verifiers taskset id, loaded with ``vf.load_environment`` on
``{"taskset": {"id": env_id}, **env_args}``, or ``package.module:function``, called with
``**env_args`` and returning a ``vf.Env``. On the id route every seat that does not pin a
harness plays with ``raytunix_chat`` (``raytunix.envs.verifiers_harness``: in-process, no
network) on the local ``subprocess`` runtime unless it pins one; verifiers' own defaults
are a harness script that ``uv`` provisions from the network on a Prime cloud sandbox.

Tasks come from the environment's taskset, in a fixed order shuffled with ``data.seed``:
``train`` takes ``data.train_size`` of them from the front, ``heldout`` ``data.heldout_size``
from the back (disjoint while the two sizes add up to at most the taskset's size). A task's
question is its prompt text; its verifiers index rides in ``metadata["verifiers_idx"]``. An
infinite taskset is read up to its first ``MAX_TASKS``.

Faults end the episode only: an episode whose ``run``/``finalize``, harness or scoring
raised (or that verifiers marks as not ok) raises here with verifiers' errors, which the
program runner records as ``env_error``; a hanging one hits ``rollout.episode_timeout_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import sys
import threading
import uuid
from collections.abc import Mapping
from typing import Any, Sequence

from raytunix.envs.agent_program import AgentProgramEnv, load_callable
from raytunix.envs.base import BaseEnv
from raytunix.registry import is_import_path, register
from raytunix.types import Task

# How many tasks of an infinite taskset (``Taskset.INFINITE``) are drawn from.
MAX_TASKS = 100_000

# What the verifiers client config reads the episode's key from (a variable per episode:
# verifiers reads provider keys from the environment, never from the config).
_KEY_PREFIX = "RAYTUNIX_VERIFIERS_KEY_"


def _verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ValueError(
            "env.name=verifiers needs the verifiers package: pip install 'raytunix[verifiers]'"
        ) from e
    from raytunix.envs import verifiers_harness

    # verifiers imports a harness by its top-level module name; make ours one.
    sys.modules.setdefault(verifiers_harness.HARNESS_ID, verifiers_harness)
    return vf


def load_verifiers_env(env_id: str, env_args: Mapping[str, Any]) -> Any:
    """The ``vf.Env`` that ``env_id`` names (see the module docstring).

    Raises:
      ValueError: verifiers is not installed, ``env_id`` is empty or does not load, or
        the function does not return a ``vf.Env`` (the message names the value).
    """
    vf = _verifiers()
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(
            f"env.kwargs.env_id={env_id!r}: name a verifiers environment (an installed "
            "taskset id) or a function package.module:make_env returning a vf.Env."
        )
    if is_import_path(env_id):
        env = load_callable(env_id, "env.kwargs.env_id", 0)(**env_args)
    else:
        raw = dict(env_args)
        raw["taskset"] = {**dict(raw.get("taskset", {})), "id": env_id}
        try:
            config = vf.resolve_env_config(raw)
        except (ImportError, TypeError, ValueError) as e:
            raise ValueError(f"env.kwargs.env_id={env_id!r} does not load: {e}") from e
        for seat in _seats(config):
            if seat.harness is None:
                seat.harness = vf.HarnessConfig(id="raytunix_chat")
                if "runtime" not in seat.model_fields_set:
                    seat.runtime = vf.SubprocessConfig()
        env = vf.load_environment(config)
    if not isinstance(env, vf.Env):
        raise ValueError(
            f"env.kwargs.env_id={env_id!r} returned a {type(env).__name__}, not a "
            "verifiers Env (vf.SingleAgentEnv(...) or vf.load_environment(...))."
        )
    return env


def _seats(config: Any) -> list[Any]:
    from verifiers.v1.configs.agent import agent_config_fields

    return list(agent_config_fields(config).values())


@register("env", "verifiers")
class VerifiersEnv(AgentProgramEnv):
    """A verifiers environment as the episode (see the module docstring).

    Args:
      env_id: a verifiers taskset id, or ``package.module:function`` returning a
        ``vf.Env``.
      env_args: the rest of verifiers' environment config (id route), or the function's
        keyword arguments.
      model: the model name the harness sends (the gateway serves any name).

    Raises:
      ValueError: as ``load_verifiers_env``.
    """

    default_agent = "text"

    def __init__(
        self, env_id: str, env_args: Mapping[str, Any] | None = None, model: str = "policy"
    ):
        BaseEnv.__init__(self)
        self.entrypoint = env_id
        self.env = load_verifiers_env(env_id, dict(env_args or {}))
        self.model = model
        self._tasks: list[Any] | None = None
        self._tasks_lock = threading.Lock()

    def _all_tasks(self) -> list[Any]:
        with self._tasks_lock:
            if self._tasks is None:
                self._tasks = list(itertools.islice(self.env.taskset, MAX_TASKS))
            return self._tasks

    def tasks(self, split: str, size: int, seed: int) -> Sequence[Task]:
        """``size`` tasks of the taskset for ``split`` (see the module docstring).

        Raises:
          ValueError: the taskset holds fewer than ``size`` tasks.
        """
        tasks = self._all_tasks()
        if size > len(tasks):
            raise ValueError(
                f"the verifiers environment {self.entrypoint!r} has {len(tasks)} tasks; "
                f"data.{split}_size={size} asks for more: lower it."
            )
        order = list(range(len(tasks)))
        random.Random(seed).shuffle(order)
        chosen = order[:size] if split == "train" else order[len(order) - size :]
        return [_as_task(tasks[i], i) for i in chosen]

    def play(self, task: Task, base_url: str, api_key: str) -> float:
        """One verifiers episode of ``task`` against ``base_url``/``api_key``; its score.
        Blocking: call it in a thread (a loop of its own runs the episode).

        Raises:
          KeyError: ``task`` did not come from this environment's ``tasks``.
          RuntimeError: verifiers reports the episode as failed (its errors, joined).
        """
        vf_task = self._all_tasks()[int(task.metadata["verifiers_idx"])]
        return asyncio.run(self._episode(vf_task, base_url, api_key))

    async def _episode(self, vf_task: Any, base_url: str, api_key: str) -> float:
        vf = _verifiers()
        var = f"{_KEY_PREFIX}{uuid.uuid4().hex}"
        os.environ[var] = api_key
        try:
            client = vf.EvalClientConfig(base_url=base_url, api_key_var=var)
            episode = await self.env.run_episode(vf_task, vf.ModelContext(self.model, client))
        finally:
            os.environ.pop(var, None)
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        if not episode.ok or errors:
            detail = "\n".join(f"{e.type}: {e.message}\n{e.traceback or ''}" for e in errors)
            raise RuntimeError(
                f"the verifiers episode failed ({len(errors)} errors):\n{detail or 'not ok'}"
            )
        return float(sum(t.reward for t in episode.traces))


def _as_task(vf_task: Any, idx: int) -> Task:
    data = vf_task.data
    answer = getattr(data, "answer", "")
    return Task(
        task_id=f"verifiers-{idx}",
        question=data.prompt_text,
        answer="" if answer is None else str(answer),
        metadata={"verifiers_idx": idx, "verifiers_key": vf_task.key},
    )
