"""Episodes that are programs: ``env.name=agent_program`` run through the gateway.

One episode::

    base_url, key = gateway.open_episode(...)         # a key of its own
    outcome = await env.play(task, base_url, key)     # in an env actor, with a deadline
    calls = gateway.close_episode(key)                # later calls with the key: 401
    trajectories = episode_trajectories(calls, ...)   # one per segment, sharing the reward

Status: ``completed`` when the program returned a reward in time; ``timeout`` when it ran
past ``episode_timeout_s`` (its thread is left to finish on its own; every call it makes
from then on is refused, so it cannot add to the episode); ``env_error`` (with the
traceback) when the program or its reward function raised, or when its env actor died
(a program that exits its process, a crash in native code: the episode is re-run on a live
actor up to ``rollout.max_episode_restarts`` times, like any episode whose actor died). A
failed episode keeps the tokens of the calls it made, with reward 0 (the orchestrator
zeroes its loss mask). An episode that made no call is one empty trajectory. Neither a
hanging nor a crashing program touches any other episode or the run.

The gateway runs on the orchestrator's event loop, in front of the same engine client the
native episodes use, so the program's calls join the engine's continuous batching; the
programs run in the env actors (``EnvActor.play``), which reach it over HTTP.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from raytunix import profiling
from raytunix.envs.agent_program import ProgramOutcome, clip_error
from raytunix.gateway import Gateway, episode_trajectories
from raytunix.gateway.recorder import ExtendRule, RecordedCall
from raytunix.rollout.orchestrator import RolloutOrchestrator
from raytunix.types import EnvFailure, EpisodeStatus, SamplingParams, Task, Trajectory

# How much longer than episode_timeout_s the orchestrator waits for an env actor's answer
# (the actor enforces the deadline itself; this covers Ray's round trip and a busy actor).
HOST_MARGIN_S = 30.0


class ProgramHost(Protocol):
    """Where a program's episode runs: ``RemoteEnv`` (an env actor) or ``LocalEnv`` (this
    process). ``play`` raises ``EnvFailure`` (``retryable`` when the host died)."""

    async def play(
        self,
        task: Task,
        base_url: str,
        api_key: str,
        timeout_s: float,
        gateway_node_id: str | None = None,
    ) -> ProgramOutcome: ...


async def run_program_episode(
    gateway: Gateway,
    host: ProgramHost,
    task: Task,
    group_id: str,
    seed: int,
    timeout_s: float,
    extend: ExtendRule = "latest",
    gateway_node_id: str | None = None,
) -> list[Trajectory]:
    """One agent-program episode on ``host`` (see the module docstring); never raises for
    the program's or its host's faults.

    Returns:
      One ``Trajectory`` per segment of the recorded calls (``episode_trajectories``), all
      with the episode's reward and status; metrics ``program_s`` (seconds),
      ``generate_s`` (seconds its calls took, overlapping calls counted once each, at most
      ``program_s``), ``env_s`` (the rest: the program's own work and its tools),
      ``gateway_calls``, and ``env_failure_retryable`` = 1.0 when the host died (the
      episode may run again elsewhere); ``error`` says the deadline (``timeout``) or holds
      the program's traceback, clipped by ``clip_error`` (``env_error``).
    """
    episode_id = f"{group_id}/{seed}/{time.monotonic_ns()}"
    base_url, key = gateway.open_episode(episode_id=episode_id, seed=seed)
    started = time.monotonic()
    retryable = False
    try:
        async with asyncio.timeout(timeout_s + HOST_MARGIN_S):
            outcome = await host.play(task, base_url, key, timeout_s, gateway_node_id)
    except TimeoutError:
        outcome = ProgramOutcome(
            0.0,
            EpisodeStatus.TIMEOUT,
            f"the program's env actor did not answer within episode_timeout_s={timeout_s:g} s "
            f"+ {HOST_MARGIN_S:g} s",
        )
    except EnvFailure as e:
        retryable = e.retryable
        outcome = ProgramOutcome(0.0, EpisodeStatus.ENV_ERROR, clip_error(str(e)))
    finally:
        calls = gateway.close_episode(key)
    program_s = time.monotonic() - started
    generate_s = min(program_s, sum(c.duration_s for c in calls))
    metrics = {
        "program_s": program_s,
        "generate_s": generate_s,
        "env_s": program_s - generate_s,
        "gateway_calls": float(len(calls)),
    }
    if retryable:
        metrics["env_failure_retryable"] = 1.0
    trajectories = episode_trajectories(
        calls,
        task.task_id,
        group_id,
        outcome.reward,
        outcome.status,
        extend=extend,
        metrics=metrics,
    )
    if not trajectories:
        trajectories = [
            Trajectory(
                task.task_id, group_id, [], [], [], [], outcome.reward, outcome.status, 0, metrics
            )
        ]
    for t in trajectories:
        t.error = outcome.error
        t.error_report = outcome.report
        # The completions the gateway recorded (loss mask 1), which the batch's
        # generated_tokens_mean and tokens/s count as they do a native episode's.
        t.metrics = {**t.metrics, "generated_tokens": float(sum(t.loss_mask))}
    _record_spans(calls, task, f"{group_id}/{seed}", outcome, metrics)
    return trajectories


def _record_spans(
    calls: list[RecordedCall],
    task: Task,
    session_id: str,
    outcome: ProgramOutcome,
    metrics: dict[str, float],
) -> None:
    """The episode's trace spans, as a native episode's: a ``turn`` per call (its
    generated tokens, which the window's tokens/s counts) and the ``episode`` with its
    ``generate_s`` and ``env_s`` (``raytunix.profiling.metrics``)."""
    end = time.perf_counter()
    offset = end - time.time()  # the calls are stamped with time.time()
    for call in calls:
        start = call.started_s + offset
        tokens = sum(len(c.token_ids) for c in call.choices)
        args = {"turn": call.index, "tokens": tokens, "generate_s": call.duration_s}
        profiling.add("turn", start, start + call.duration_s, "episodes", args, session_id)
    profiling.add(
        "episode",
        end - metrics["program_s"],
        end,
        "episodes",
        {
            "task_id": task.task_id,
            "status": outcome.status.value,
            "turns": len(calls),
            "reward": outcome.reward,
            "generate_s": metrics["generate_s"],
            "env_s": metrics["env_s"],
        },
        session_id,
    )


class ProgramOrchestrator(RolloutOrchestrator):
    """``RolloutOrchestrator`` whose episodes are agent programs run through a ``Gateway``
    (started on this orchestrator's loop at the first episode); each program runs in the
    env actor ``env_provider`` leases for its episode (``EnvActor.play``).

    Args:
      make_gateway: builds the gateway in front of an engine client (the orchestrator's
        own, so calls join the same engines and continuous batching).
      segments: ``gateway.segments``, the rule of ``raytunix.gateway.recorder``.
      gateway_node_id: the Ray node this orchestrator (and so the gateway) runs on; env
        actors elsewhere cannot reach a loopback gateway and say so. None = not checked.
      **kwargs: ``RolloutOrchestrator``'s.

    A group of G episodes holds one trajectory per segment of each; all segments of an
    episode share its reward, so an episode with k segments weighs k rows in its group's
    advantage statistics.
    """

    def __init__(
        self,
        *,
        make_gateway: Callable[[Any], Gateway],
        segments: ExtendRule = "latest",
        gateway_node_id: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.segments = segments
        self.gateway_node_id = gateway_node_id
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
        ``eval<i>``) its first segment, the one row ``evaluate`` scores per task. Re-run
        on a live env actor (after a backoff) while its actor died under it, up to
        ``max_episode_restarts`` times. ``sampling`` is the program's to choose (it sets
        its own ``temperature`` and ``max_tokens`` per call) and ``one_version`` does not
        apply (calls are stamped with the versions that made their tokens)."""
        gateway = await self._ensure_gateway()
        rng = random.Random(seed)
        restarts = 0
        while True:
            env, release = self._env_provider(group_id)
            try:
                if not hasattr(env, "play"):
                    raise TypeError(
                        f"the env provider gave a {type(env).__name__}, which cannot run an "
                        "agent program (no play); use EnvPool or LocalEnv."
                    )
                segments = await run_program_episode(
                    gateway,
                    cast(ProgramHost, env),
                    task,
                    group_id,
                    seed,
                    self.episode_timeout_s,
                    self.segments,
                    self.gateway_node_id,
                )
            finally:
                release()
            if not await self._rerun_after_env_failure(group_id, segments, restarts, rng):
                return segments[0] if group_id.startswith("eval") else segments
            restarts += 1

    async def stop(self) -> None:
        """Stops the episodes, then the gateway."""
        await super().stop()
        await self.gateway.stop()
        self._gateway_up = False


def program_parts(settings: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """``ProgramOrchestrator``'s own arguments from the driver's ``settings``
    (``raytunix.driver.prepare.program_settings``): a gateway factory with the
    ``gateway.*`` settings and the run's chat template, the segment rule, and the node the
    gateway serves from (this process's Ray node, when Ray is up).

    Raises:
      ValueError: a bad renderer setting.
    """
    import ray

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

    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    return {
        "make_gateway": make_gateway,
        "segments": settings["segments"],
        "gateway_node_id": node_id,
    }
