"""The contract page: the data types raytunix is built from and the protocols the rollout
orchestrator talks to (``EngineClient``, ``EnvClient``, ``Agent``; the driver joins it to a
``Learner``), on one page.

One episode (one agent, one environment, one task; ``raytunix.rollout.episode.run_episode``)
reads, inside one wall-clock deadline (``timeout_s``)::

    agent.reset(task, await env.reset(task))            # system + user message, tokenized
    for turn in range(max_turns):
        if the context is full: break                      # TRUNCATED
        request = agent.next_request(request_id, sampling, seed)   # prompt_ids = all tokens so far
        result = await engine.generate(request)            # retried with backoff on EngineFailure
        action = agent.on_generation(result)               # appends tokens, parses text -> Action
        if result.finish_reason is ABORT: break            # ABORTED
        if the reply was cut short: break                  # TRUNCATED
        step = await env.step(action)                      # StepResult; EnvFailure -> ENV_ERROR
        reward += step.reward                              # must be finite
        if step.done: break                                # status = step.status or COMPLETED
        if turn + 1 < max_turns:
            agent.on_observation(step.observation)         # env text, tokenized once, as plain text
    engine.end_session(session_id); await env.close()      # always, whatever happened
    trajectory = agent.to_trajectory(task_id, group_id, reward, status, metrics)

Many such coroutines run at once in the rollout orchestrator
(``raytunix.rollout.orchestrator``); the G trajectories of one task form a group, whose
valid members share one baseline; groups are packed into Arrow record batches, which the
driver hands to ``Learner.train_step`` (one update, one new policy version) before it
publishes the weights to the engine and tells the orchestrator the batch was trained.

Nothing here imports Ray or JAX.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Protocol, runtime_checkable


class EpisodeStatus(str, enum.Enum):
    """How an episode ended; counted in metrics by value.

    ``COMPLETED``, ``TRUNCATED`` and ``TOOL_ERROR_LIMIT`` are outcomes of the policy: they
    carry the reward the environment computed and keep their gradient. ``TIMEOUT``,
    ``ENV_ERROR`` and ``ABORTED`` are infrastructure failures (see
    ``is_infrastructure_failure``): reward 0, zero loss mask, left out of group statistics.
    """

    COMPLETED = "completed"
    TRUNCATED = "truncated"  # max turns, max tokens or the context length ran out
    TIMEOUT = "timeout"  # the episode's wall-clock budget ran out
    ENV_ERROR = "env_error"  # the environment raised or its actor died
    TOOL_ERROR_LIMIT = "tool_error_limit"  # too many malformed or failing tool calls
    ABORTED = "aborted"  # the run stopped while the episode was in flight


INFRASTRUCTURE_FAILURES = frozenset({"timeout", "env_error", "aborted"})


def is_infrastructure_failure(status: "EpisodeStatus | str") -> bool:
    """True when an episode ended because the infrastructure failed (env error, timeout,
    abort), not because of anything the policy did.

    Such a trajectory says nothing about the policy: it is left out of its group's
    statistics (advantages use the valid members only) and its loss mask is zero. A
    failure the policy caused (``TOOL_ERROR_LIMIT``) is an outcome with a reward and keeps
    its gradient. Engine failures never reach a trajectory: the episode's engine calls are
    retried, then the whole group is.
    """
    return EpisodeStatus(status).value in INFRASTRUCTURE_FAILURES


class ToolErrorKind(str, enum.Enum):
    """Why one tool call, or a turn that should hold calls or an answer, failed.

    Every layer counts tool errors under one key, ``TOOL_ERRORS_KEY``: an environment's
    ``StepResult.info[TOOL_ERRORS_KEY]`` is ``{kind value: count}`` for that step; an
    episode sums them into ``Trajectory.metrics[TOOL_ERRORS_KEY]`` (the total) and
    ``Trajectory.metrics[f"{TOOL_ERRORS_KEY}/{kind value}"]``.
    """

    UNKNOWN_TOOL = "unknown_tool"  # the call names a tool the environment does not offer
    BAD_JSON = "bad_json"  # the call is not a JSON object {"name": str, "arguments": {...}}, or its tag is unclosed
    BAD_ARGUMENTS = "bad_arguments"  # the arguments do not fit the tool's parameter schema
    TOOL_EXCEPTION = (
        "tool_exception"  # the tool ran and failed (input it cannot handle, or a bug in it)
    )
    TIMEOUT = "timeout"  # the tool did not answer within its deadline
    FORMAT = "format"  # the turn holds no call and no answer, both, or more than one answer


TOOL_ERRORS_KEY = "tool_errors"


class EngineFailure(Exception):
    """The inference engine could not serve a request (actor died or restarting, connection
    lost). Retried with backoff; never a reason to lose a task."""


class EnvFailure(Exception):
    """The environment, or the actor hosting it, failed; the episode ends as ENV_ERROR.

    Attributes:
      retryable: the failure was the host's (an actor died or restarted), not the
        environment's logic, so re-running the episode on a fresh environment may succeed.
      report: the ``raytunix.envs.contract.EnvErrorReport`` (kind, env class, task id,
        file:line, traceback) when the environment's own code raised or returned a value
        of the wrong kind; None for a host failure.
    """

    def __init__(self, message: str, *, retryable: bool = False, report: Any = None):
        super().__init__(message)
        self.retryable = retryable
        self.report = report


class RolloutHalted(Exception):
    """The rollout cannot go on (no environment can run, or too many consecutive episodes
    failed); raised by the orchestrator's ``next_batch`` once, with the cause. Checkpoints
    and the data ledger stay; fix the cause and resume."""


class FinishReason(str, enum.Enum):
    """Why the engine stopped generating for one request."""

    STOP = "stop"  # a stop token or stop string was produced
    LENGTH = "length"  # max_new_tokens or the context length was reached
    ABORT = "abort"  # the request was cancelled or the engine paused


@dataclasses.dataclass(frozen=True)
class Task:
    """One row of a dataset.

    Attributes:
      task_id: stable id, unique within a dataset split (used for exactly-once accounting).
      question: the prompt text shown to the agent.
      answer: the ground-truth answer as text.
      metadata: anything the environment's verifier needs (e.g. the generator's entry).
    """

    task_id: str
    question: str
    answer: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation.

    Attributes:
      max_new_tokens: at most this many tokens are generated (tokens).
      temperature: softmax temperature; 0 means greedy (argmax).
      top_k: sample only among the ``top_k`` most likely tokens (after temperature),
        renormalised; 0 = off.
      top_p: nucleus sampling (Holtzman et al. 2019): then sample only among the
        smallest set of most likely tokens whose renormalised probability mass is
        >= ``top_p``; in (0, 1], 1.0 = off. The transformation (temperature, top-k,
        top-p) is ``raytunix.inference.sampling.sampling_logprobs``; the learner scores
        tokens with the same one.
      stop_token_ids: generation ends after any of these tokens (the token is kept).
      stop_strings: generation ends at the token that completes one of these in the
        decoded text of the generated tokens (the prompt is not searched); that token is
        kept, and its text may run on past the stop string. Matched on text, so a stop
        string whose characters span several byte tokens stops too
        (``raytunix.inference.stops``).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One call to the inference engine.

    Attributes:
      request_id: unique per in-flight request.
      prompt_ids: the exact token ids the model sees, int, length >= 1.
      sampling: see ``SamplingParams``.
      seed: per-request PRNG seed; two requests of one group must differ, or every
        sample of the group is identical.
      session_id: the conversation this request continues, or None. The engine keeps a
        session's KV cache between its requests, so a turn that extends the previous
        context computes only its new tokens; one request per session at a time. End it
        with the engine's ``end_session`` when the episode is over.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int = 0
    session_id: str | None = None


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What the engine produced for one request.

    Attributes:
      request_id: as in the request.
      token_ids: generated token ids, length N (stop token included when one ended it).
      logprobs: float log-probabilities of ``token_ids`` under the distribution each was
        sampled from (``sampling_logprobs``: temperature, then top-k and top-p,
        renormalised; ``log_softmax(logits)`` when greedy), length N, nats.
      policy_versions: the policy version that produced each token, length N.
      finish_reason: see ``FinishReason``.
      text: ``token_ids`` decoded (special tokens kept), for parsing only.
      num_cached_tokens: prompt tokens whose KV the engine reused (from the request's
        session or a cached prefix) instead of computing them.
      stale_kv_tokens: tokens of ``token_ids`` sampled while the context held KV computed
        under weights older than the token's policy version (only when the engine keeps
        KV across weight updates).
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    finish_reason: FinishReason
    text: str = ""
    num_cached_tokens: int = 0
    stale_kv_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed request to run a tool: ``name`` with JSON ``arguments``."""

    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Action:
    """What the agent made of one model turn.

    Exactly one of ``tool_calls``, ``answer`` or ``parse_error`` is meaningful:
    tool calls to run, a final answer to verify, or a message saying why the text could
    not be parsed (the environment turns it into an error observation, never an
    exception).
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    answer: str | None = None
    parse_error: str | None = None
    parse_error_kind: ToolErrorKind | None = None  # set with parse_error (default FORMAT)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the environment returned for one action.

    Attributes:
      observation: text to show the agent next (tool results, error messages); empty
        when the episode is done.
      reward: float reward for this step (the episode reward is the sum).
      done: the episode ended.
      status: set when ``done``: how the episode ended.
      info: diagnostics: ``info[TOOL_ERRORS_KEY]`` is ``{ToolErrorKind value: count}``
        of this step's tool errors (absent or empty when none), ``tool_latency_s``
        (seconds), and whatever else the environment reports.
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    status: EpisodeStatus | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Trajectory:
    """The learner's unit: one episode as exact tokens.

    All per-token lists have the same length T (the whole conversation).

    Attributes:
      task_id, group_id: which task and which group of G samples it belongs to.
      token_ids: int token ids, exactly as the model saw and produced them.
      loss_mask: 1 on tokens the policy generated, 0 on prompt/env/tool tokens.
      logprobs: behaviour log-probabilities (nats) on generated tokens, 0.0 elsewhere.
      policy_versions: version that generated each token; -1 on non-generated tokens.
      reward: episode reward (float).
      status: how the episode ended.
      num_turns: model turns taken.
      metrics: timings in seconds and counts (``generate_s``, ``env_s``, ``tool_errors``
        and ``tool_errors/<kind>``, see ``ToolErrorKind``).
      error: for an ``ENV_ERROR`` episode, what failed (the ``EnvFailure`` message, or
        ``StepResult.info["error"]`` when ``BaseEnv.step`` caught the exception, e.g.
        ``"RuntimeError('step always fails')"``; at most 500 characters); "" otherwise.
      error_report: for an ``ENV_ERROR`` episode whose environment code raised or returned
        a value of the wrong kind, its ``raytunix.envs.contract.EnvErrorReport``; None
        otherwise (not carried into record batches).
      transcript: the conversation as the agent saw it, for people to read (the sample
        log, ``raytunix.samples``): ``{"role", "content"}`` messages in order (system, the
        first observation as ``user``, each generation decoded as ``assistant`` with its
        parsed ``action``, each later observation under the template's tool role); empty
        for trajectories built without an agent (not carried into record batches).
    """

    task_id: str
    group_id: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    reward: float
    status: EpisodeStatus
    num_turns: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str = ""
    error_report: Any = None
    transcript: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory {self.task_id}/{self.group_id}: {name} has "
                    f"{len(getattr(self, name))} entries but token_ids has {n}; every "
                    "per-token list must be as long as token_ids."
                )


# ---------------------------------------------------------------------------- protocols
# What the orchestrator and the driver call. Each is structural (``typing.Protocol``): the
# in-process and the Ray-backed implementations satisfy it without inheriting from it.


@runtime_checkable
class EngineClient(Protocol):
    """Anything that generates: a local ``InferenceEngine``, ``RayEngineClient`` over engine
    actors, or a test's scripted engine.

    ``generate`` raises ``EngineFailure`` (or ``ConnectionError`` / ``TimeoutError``) for an
    outage (actor died or restarting, connection lost); the episode retries it with backoff.
    Any other exception (a ``ValueError`` for a request that cannot fit...) is a bug and
    propagates. A client may also have ``end_session(session_id) -> None`` (returns at
    once; the episode calls it when it ends so the engine frees the KV it kept between
    turns) and ``abort(request_id) -> bool``; and ``async engine_stats() -> list[dict]``
    (``InferenceEngine.stats()`` per replica), which the orchestrator's adaptive
    concurrency controller reads.
    """

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...


@runtime_checkable
class EnvClient(Protocol):
    """One environment instance for one episode, in-process (``LocalEnv``) or hosted by an
    env actor (``RemoteEnv``). Any failure of the environment or its host is raised as
    ``EnvFailure`` (``retryable=True`` when the host died, so a re-run may succeed)."""

    async def reset(self, task: Task) -> str: ...

    async def step(self, action: Action) -> StepResult: ...

    async def close(self) -> None: ...


@runtime_checkable
class Agent(Protocol):
    """One conversation as exact tokens; ``raytunix.agents.ConversationAgentBase``
    implements it (subclasses override only ``parse`` and the prompts).

    Attributes (read-only, per token, all of one length T): ``token_ids``, ``loss_mask``,
    ``logprobs``, ``policy_versions``; see ``Trajectory``.
    """

    token_ids: list[int]

    def reset(self, task: Task, observation: str) -> None: ...

    def next_request(
        self, request_id: str, sampling: SamplingParams, seed: int
    ) -> GenerationRequest: ...

    def on_generation(self, result: GenerationResult) -> Action: ...

    def on_observation(self, text: str) -> None: ...

    def to_trajectory(
        self,
        task_id: str,
        group_id: str,
        reward: float,
        status: EpisodeStatus,
        metrics: dict[str, float] | None = None,
    ) -> Trajectory: ...

    @property
    def num_turns(self) -> int: ...

    @property
    def turn_finished(self) -> bool: ...

    @property
    def num_generated_tokens(self) -> int: ...


@runtime_checkable
class Learner(Protocol):
    """Holds the policy and updates it; ``raytunix.learner.learner.Learner`` implements it
    (``LearnerActor`` wraps it for Ray, taking object references of the same batches).

    ``train_step`` takes one Arrow record batch of trajectories (the layout of
    ``raytunix.rollout.batch.trajectories_to_record_batch``), runs one update and returns
    float metrics; afterwards ``version`` is one higher (unchanged for a batch with no
    trainable token, which is skipped). Raises ``ValueError`` for a non-finite reward.
    ``weights_numpy`` gives the parameters to publish to engines.
    """

    version: int

    def train_step(self, batch: Any) -> dict[str, float]: ...

    def weights_numpy(self) -> Any: ...
