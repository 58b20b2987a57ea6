"""Episodes that are programs: ``env.name=agent_program`` run through the gateway.

One episode::

    base_url, key = gateway.open_episode(...)         # a key of its own
    reward = program.play(task, base_url, key)        # in a thread of its own, with a deadline
    calls = gateway.close_episode(key)                # later calls with the key: 401
    trajectories = episode_trajectories(calls, ...)   # one per segment, sharing the reward

Status: ``completed`` when the program returned a reward in time; ``timeout`` when it ran
past ``episode_timeout_s`` (its thread is left to finish on its own; every call it makes
from then on is refused, so it cannot add to the episode); ``env_error`` (with the
traceback) when the program or its reward function raised. A failed episode keeps the
tokens of the calls it made, with reward 0 (the orchestrator zeroes its loss mask). An
episode that made no call is one empty trajectory. Neither a hanging nor a crashing program
touches any other episode or the run.

The gateway runs on the orchestrator's event loop, in front of the same engine client the
native episodes use, so the program's calls join the engine's continuous batching.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from raytunix.envs.agent_program import AgentProgramEnv
from raytunix.envs.contract import check_reward
from raytunix.gateway import Gateway, episode_trajectories
from raytunix.gateway.recorder import ExtendRule
from raytunix.rollout.orchestrator import RolloutOrchestrator
from raytunix.types import EpisodeStatus, SamplingParams, Task, Trajectory


async def _in_thread(fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` in a fresh daemon thread; awaiting it never blocks the loop, and a caller
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


async def run_program_episode(
    gateway: Gateway,
    program: AgentProgramEnv,
    task: Task,
    group_id: str,
    seed: int,
    timeout_s: float,
    extend: ExtendRule = "latest",
) -> list[Trajectory]:
    """One agent-program episode (see the module docstring); never raises for the
    program's faults.

    Returns:
      One ``Trajectory`` per segment of the recorded calls (``episode_trajectories``), all
      with the episode's reward and status; metrics ``program_s`` (seconds) and
      ``gateway_calls``; ``error`` says the deadline (``timeout``) or holds the
      program's traceback, its last 2,000 characters (``env_error``).
    """
    episode_id = f"{group_id}/{seed}/{time.monotonic_ns()}"
    base_url, key = gateway.open_episode(episode_id=episode_id, seed=seed)
    started = time.monotonic()
    reward, status, error = 0.0, EpisodeStatus.COMPLETED, ""
    try:
        async with asyncio.timeout(timeout_s):
            played = await _in_thread(
                lambda: program.play(task, base_url, key), f"agent-program-{episode_id}"
            )
            # Whatever env played it (a subclass's play too), one rule for its reward.
            reward = check_reward(played, f"{type(program).__name__}.play")
    except TimeoutError:
        status = EpisodeStatus.TIMEOUT
        error = f"the program did not return within episode_timeout_s={timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 - the program's fault ends its episode only
        status = EpisodeStatus.ENV_ERROR
        error = "".join(traceback.format_exception(e))[-2000:]
    finally:
        calls = gateway.close_episode(key)
    metrics = {"program_s": time.monotonic() - started, "gateway_calls": float(len(calls))}
    trajectories = episode_trajectories(
        calls, task.task_id, group_id, reward, status, extend=extend, metrics=metrics
    )
    if not trajectories:
        trajectories = [
            Trajectory(task.task_id, group_id, [], [], [], [], reward, status, 0, metrics)
        ]
    for t in trajectories:
        t.error = error
    return trajectories


class ProgramOrchestrator(RolloutOrchestrator):
    """``RolloutOrchestrator`` whose episodes are ``AgentProgramEnv`` programs run through
    a ``Gateway`` (started on this orchestrator's loop at the first episode).

    Args:
      program: the resolved program (``AgentProgramEnv(**env.kwargs)``).
      make_gateway: builds the gateway in front of an engine client (the orchestrator's
        own, so calls join the same engines and continuous batching).
      segments: ``gateway.segments``, the rule of ``raytunix.gateway.recorder``.
      **kwargs: ``RolloutOrchestrator``'s.

    A group of G episodes holds one trajectory per segment of each; all segments of an
    episode share its reward, so an episode with k segments weighs k rows in its group's
    advantage statistics.
    """

    def __init__(
        self,
        *,
        program: AgentProgramEnv,
        make_gateway: Callable[[Any], Gateway],
        segments: ExtendRule = "latest",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.program = program
        self.segments = segments
        self.gateway = make_gateway(self._engine)
        self._gateway_lock: asyncio.Lock | None = None
        self._gateway_up = False

    async def _ensure_gateway(self) -> Gateway:
        """Starts the gateway on this loop, once (the engine client is served from it)."""
        if self._gateway_lock is None:
            self._gateway_lock = asyncio.Lock()
        async with self._gateway_lock:
            if not self._gateway_up:
                await self.gateway.start()
                self._gateway_up = True
        return self.gateway

    async def _episode(  # type: ignore[override]
        self,
        task: Task,
        group_id: str,
        sampling: SamplingParams,
        seed: int,
        one_version: bool | None = None,
    ) -> list[Trajectory] | Trajectory:
        """An agent-program episode: its segments, or for an evaluation episode (group
        ``eval<i>``) its first segment, the one row ``evaluate`` scores per task.
        ``sampling`` is the program's to choose (it sets its own ``temperature`` and
        ``max_tokens`` per call) and ``one_version`` does not apply (calls are stamped
        with the versions that made their tokens)."""
        gateway = await self._ensure_gateway()
        segments = await run_program_episode(
            gateway, self.program, task, group_id, seed, self.episode_timeout_s, self.segments
        )
        return segments[0] if group_id.startswith("eval") else segments

    async def stop(self) -> None:
        """Stops the episodes, then the gateway."""
        await super().stop()
        await self.gateway.stop()
        self._gateway_up = False


def program_parts(settings: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """``ProgramOrchestrator``'s own arguments from the driver's ``settings``
    (``raytunix.driver.prepare.program_settings``): the program, ``env_name`` (an
    ``AgentProgramEnv``: ``agent_program`` or ``verifiers``) built from ``env_kwargs``
    and a gateway factory with the ``gateway.*`` settings and the run's chat template.

    Raises:
      ValueError: a bad entrypoint (``AgentProgramEnv``) or renderer setting.
    """
    from raytunix.gateway import make_renderer

    renderer = make_renderer(
        tokenizer, settings["chat_template"], tool_parser=settings["tool_parser"]
    )

    def make_gateway(engine: Any) -> Gateway:
        return Gateway(
            engine,
            renderer,
            host=settings["host"],
            port=settings["port"],
            call_timeout_s=settings["call_timeout_s"],
            default_max_tokens=settings["default_max_tokens"],
            max_model_len=settings["max_model_len"],
            vocab_size=getattr(tokenizer, "vocab_size", None),
        )

    from raytunix.envs import make_env

    program = make_env(settings.get("env_name", "agent_program"), **settings["env_kwargs"])
    if not isinstance(program, AgentProgramEnv):
        raise ValueError(
            f"env.name={settings['env_name']!r} is a {type(program).__name__}, not an agent "
            "program (raytunix.envs.agent_program.AgentProgramEnv)."
        )
    return {
        "program": program,
        "make_gateway": make_gateway,
        "segments": settings["segments"],
    }
