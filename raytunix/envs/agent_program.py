"""``env.name=agent_program``: an episode is a user's unchanged agent program.

The program is any callable ``run(task, base_url, api_key)`` (a plain function or an
``async def``) that talks to the model through an OpenAI-compatible client::

    def run(task, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...                                  # as many calls, tools and turns as it likes
        return answer                        # anything; the reward function reads it

``task`` is a dict: ``{"id", "question", "answer", "metadata"}`` of the run's task.
The reward of the episode is, in this order:

* ``reward(task, result)`` when ``env.kwargs.reward=pkg.mod:score`` is set (a number);
* else the program's return value: a number (``bool`` counts as 0/1), or a dict with a
  ``"reward"`` key holding one.

Anything else is the program's error and ends its episode as ``env_error``. Tasks come from
the run's dataset (``data.*``) unless ``env.kwargs.tasks=pkg.mod:tasks`` names a function
``tasks(split, size, seed)`` returning dicts with ``question`` (and optionally ``id``,
``answer``, ``metadata``) or ``Task`` objects.

The episodes themselves are run by ``raytunix.rollout.program.ProgramOrchestrator`` (one
gateway key per episode, the recorded calls become the trajectories). The program runs in
an env actor (``EnvActor.play`` calls ``play_with_deadline``), never in the orchestrator:
a program that kills its process (``os._exit``, a crash in native code) takes that env
actor with it, and the orchestrator ends or re-runs the episodes it hosted as it does for
any env actor that died. For the prompt-length preflight the first observation is the
task's question.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Sequence

from raytunix.envs.base import BaseEnv
from raytunix.envs.contract import EnvErrorReport, check_reward, report_for
from raytunix.registry import PluginError, import_object, register
from raytunix.types import Action, EpisodeStatus, StepResult, Task


def load_callable(path: str, key: str, arity: int) -> Callable[..., Any]:
    """Imports ``package.module:function`` and checks that it takes ``arity`` positional
    arguments.

    Raises:
      ValueError: ``path`` is not an import path, does not import, is not callable or
        takes another number of arguments (the message names ``key`` and ``path``).
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"{key}={path!r}: give an import path package.module:function.")
    if ":" not in path:
        raise ValueError(f"{key}={path!r} is not an import path; write package.module:function.")
    try:
        fn = import_object(path, key)
    except PluginError as e:
        raise ValueError(str(e)) from None
    if not callable(fn):
        raise ValueError(
            f"{key}={path!r} is an object of type {type(fn).__name__}, not a function."
        )
    try:
        inspect.signature(fn).bind(*range(arity))
    except TypeError:
        raise ValueError(
            f"{key}={path!r}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot be "
            f"called with {arity} positional arguments; it must take {arity}."
        ) from None
    except ValueError:  # a builtin without a signature: trust it
        pass
    return fn


def task_dict(task: Task) -> dict[str, Any]:
    """What a program gets as ``task``: ``{"id", "question", "answer", "metadata"}``."""
    return {
        "id": task.task_id,
        "question": task.question,
        "answer": task.answer,
        "metadata": dict(task.metadata),
    }


def reward_of(value: Any, source: str) -> float:
    """The reward in a reward function's or program's return value: a number (numpy
    scalars and ``True`` taken) or a dict with a numeric ``"reward"``, checked by
    ``raytunix.envs.contract.check_reward`` (finite, within float32).

    Raises:
      ValueError: a dict without ``"reward"``; ``EnvContractError`` (a ``TypeError``) for
        a reward that is not a finite float32-sized number; ``source`` names who returned
        it.
    """
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise ValueError(
                f"{source} returned a dict without a 'reward' key ({sorted(value)[:8]}); "
                "return a number, a dict with 'reward', or set env.kwargs.reward."
            )
        value = value["reward"]
    return check_reward(value, source)


@register("env", "agent_program")
class AgentProgramEnv(BaseEnv):
    """A user's agent program as the episode (see the module docstring).

    Args:
      entrypoint: ``package.module:run``, called ``run(task, base_url, api_key)``.
      reward: ``package.module:score``, called ``score(task, result)``; "" = the
        program's return value is the reward.
      tasks: ``package.module:tasks``, called ``tasks(split, size, seed)``; "" = the run's
        dataset.

    Raises:
      ValueError: an import path that does not resolve to a function of the right arity
        (named, with its value).
    """

    default_agent = "text"
    runs_outside_code = True  # its errors are located in the user's program (contract.py)

    def __init__(self, entrypoint: str, reward: str = "", tasks: str = ""):
        super().__init__()
        self.entrypoint = entrypoint
        self.program = load_callable(entrypoint, "env.kwargs.entrypoint", 3)
        self.score = load_callable(reward, "env.kwargs.reward", 2) if reward else None
        self.task_source = load_callable(tasks, "env.kwargs.tasks", 3) if tasks else None

    @classmethod
    def validate_kwargs(cls, kwargs: Mapping[str, Any]) -> None:
        """Resolves the entrypoints at config time, so a bad one stops the run before any
        actor starts. Raises ValueError as the constructor."""
        cls(**kwargs)

    def play(self, task: Task, base_url: str, api_key: str) -> float:
        """Runs the program once on ``task`` (an ``async def`` one on a loop of its own,
        in this thread) and returns the episode's reward. Blocking: call it in a thread.

        Raises:
          Exception: whatever the program or the reward function raises; ValueError for a
            reward that is not a finite number.
        """
        given = task_dict(task)
        result = self.program(given, base_url, api_key)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        if self.score is not None:
            return reward_of(self.score(given, result), "env.kwargs.reward")
        return reward_of(result, f"the program {self.entrypoint}")

    def tasks(self, split: str, size: int, seed: int) -> Sequence[Task] | None:
        if self.task_source is None:
            return None
        rows = list(self.task_source(split, size, seed))[:size]
        return [_as_task(row, split, i) for i, row in enumerate(rows)]

    def _initial_observation(self, task: Task) -> str:
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        raise RuntimeError(
            "agent_program episodes have no env steps: the program makes its own calls "
            "through the gateway (raytunix.rollout.program.ProgramOrchestrator runs them)."
        )


MAX_ERROR_CHARS = 2000  # of a program's traceback kept on its episode


def clip_error(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` if it is at most ``limit`` characters, else its first and last
    ``limit // 2`` with how many were left out between them: a traceback keeps its first
    frames and its last (the exception's type and place are at one end or the other, also
    under a 100,000-character message)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters ...]\n{text[-half:]}"


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _as_task(row: Any, split: str, i: int) -> Task:
    if isinstance(row, Task):
        return row
    if not isinstance(row, Mapping) or not isinstance(row.get("question"), str):
        raise ValueError(
            f"env.kwargs.tasks: row {i} of split {split!r} is {row!r}; each row must be a "
            "Task or a dict with a 'question' string (and optional id, answer, metadata)."
        )
    return Task(
        task_id=str(row.get("id", f"{split}-{i}")),
        question=row["question"],
        answer=str(row.get("answer", "")),
        metadata=dict(row.get("metadata", {})),
    )


@dataclasses.dataclass
class ProgramOutcome:
    """How one program episode ended (``play_with_deadline``), sent back from an env actor.

    Attributes:
      reward: the checked reward (``check_reward``); 0.0 unless ``completed``.
      status: ``completed``, ``timeout`` or ``env_error``.
      error: the deadline for ``timeout``; the traceback (``clip_error``) for
        ``env_error``; "" when completed.
      report: for ``env_error``, the ``EnvErrorReport`` of what the program (method
        ``play``) raised or returned, which the run tallies by kind
        (``env_errors.jsonl``) as it does a native environment's; else None.
    """

    reward: float
    status: EpisodeStatus
    error: str = ""
    report: EnvErrorReport | None = None


async def _in_fresh_thread(fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` in a new daemon thread; awaiting it never blocks the loop, and a caller
    that stops waiting (a deadline) leaves the thread behind instead of a pool's worker.
    A ``SystemExit`` or ``KeyboardInterrupt`` of ``fn`` comes back as a ``RuntimeError``:
    raised in the awaiting task it would stop the whole event loop, not one episode."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def main() -> None:
        try:
            value, ok = fn(), True
        except Exception as e:  # noqa: BLE001 - handed to the awaiting episode
            value, ok = e, False
        except BaseException as e:  # noqa: BLE001 - SystemExit raised on the loop would stop it
            value, ok = RuntimeError(f"the program raised {type(e).__name__}: {e}"), False
            value.__cause__ = e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=main, name=name, daemon=True).start()
    return await done


async def play_with_deadline(
    program: AgentProgramEnv, task: Task, base_url: str, api_key: str, timeout_s: float
) -> ProgramOutcome:
    """``program.play(task, base_url, api_key)`` in a thread of its own, within
    ``timeout_s`` seconds; never raises for the program's faults.

    A program past its deadline is left running in its thread (Python cannot stop a
    thread); the gateway refuses its key once the episode closes, so it adds nothing.
    """
    try:
        async with asyncio.timeout(timeout_s):
            played = await _in_fresh_thread(
                lambda: program.play(task, base_url, api_key), f"agent-program-{task.task_id}"
            )
        # Whatever env played it (a subclass's play too), one rule for its reward.
        reward = check_reward(played, f"{type(program).__name__}.play")
        return ProgramOutcome(reward, EpisodeStatus.COMPLETED)
    except TimeoutError:
        return ProgramOutcome(
            0.0,
            EpisodeStatus.TIMEOUT,
            f"the program did not return within episode_timeout_s={timeout_s:g} s",
        )
    except Exception as e:  # noqa: BLE001 - the program's fault ends its episode only
        formatted = "".join(traceback.format_exception(e))
        report = report_for(e, program, "play", task.task_id, formatted)
        return ProgramOutcome(0.0, EpisodeStatus.ENV_ERROR, clip_error(formatted), report)
