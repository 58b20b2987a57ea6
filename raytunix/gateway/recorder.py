"""What the gateway records of an episode's calls, and how the calls become trajectories.

Pure data and functions: no Ray, no JAX, no HTTP. The gateway (``raytunix.gateway.server``)
appends one ``RecordedCall`` per answered call, holding the prompt ids exactly as they were
sent to the engine and, per choice, the completion ids, logprobs and policy versions
exactly as the engine returned them. Nothing here decodes or tokenizes text.

The segment rule (``segment_calls``), applied to the calls in the order the gateway
received them::

    for each call, for each of its choices j:
        candidates = the open segments the rule allows (see ``extend``)
        if j == 0 and some candidate's tokens are a prefix of the call's prompt ids:
            that candidate (the newest such) is extended:
                prompt ids past the segment's tokens -> observation tokens (loss mask 0)
                completion ids                      -> generated tokens (loss mask 1)
        else:
            a new segment starts: prompt ids (mask 0), then the completion (mask 1)

``extend="latest"`` (the default) allows only the segments the previous call extended or
started, so a call extends "the previous conversation" or starts a new segment;
``extend="any"`` allows every segment of the episode, so a main agent's conversation that
resumes after a sub-agent's calls extends its own segment again. Either way, a call whose
history was rewritten (dropped reasoning, a summary), a parallel call whose sibling already
extended the shared segment, the other choices of an ``n > 1`` call, and a sub-agent's
first call start new segments; every segment of an episode shares its reward
(``episode_trajectories``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from raytunix.types import EpisodeStatus, FinishReason, Trajectory

ExtendRule = Literal["latest", "any"]
EXTEND_RULES: tuple[str, ...] = ("latest", "any")


@dataclasses.dataclass(frozen=True)
class RecordedChoice:
    """One completion of a call, as the engine returned it.

    Attributes:
      token_ids: generated ids, length N (the stop token included when one ended it).
      logprobs: behaviour log-probabilities of ``token_ids`` (nats), length N.
      policy_versions: the policy version that generated each token, length N.
      finish_reason: ``FinishReason`` value (``"stop"``, ``"length"``, ``"abort"``).
      request_id: the engine request that produced it.
      num_cached_tokens: prompt tokens whose KV the engine reused for it.
      text: the reply as the program read it (its content, then any tool calls as
        ``name(arguments)`` lines), for people (the sample log); never tokenized.
      tool_calls: how many tool calls the gateway parsed from the reply.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    finish_reason: str
    request_id: str = ""
    num_cached_tokens: int = 0
    text: str = ""
    tool_calls: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.policy_versions) != n:
            raise ValueError(
                f"RecordedChoice {self.request_id!r}: {n} token_ids, {len(self.logprobs)} "
                f"logprobs and {len(self.policy_versions)} policy_versions; the engine must "
                "return one of each per token."
            )
        FinishReason(self.finish_reason)  # a ValueError names an unknown reason


@dataclasses.dataclass(frozen=True)
class RecordedCall:
    """One answered call of an episode.

    Attributes:
      index: the call's place among the episode's calls, in the order the gateway
        received them (0, 1, ...).
      endpoint: ``"chat.completions"`` or ``"completions"``.
      prompt_ids: the exact ids sent to the engine (every choice shares them).
      choices: one ``RecordedChoice`` per completion (``n`` of them).
      started_s: ``time.time()`` when the call arrived (seconds).
      duration_s: seconds from arrival to the answer being ready.
      messages: the request's conversation as ``{"role", "content"}`` text (a text
        prompt of ``/v1/completions`` as one ``user`` message; none for an id prompt), for
        people (the sample log); never tokenized.
    """

    index: int
    endpoint: str
    prompt_ids: tuple[int, ...]
    choices: tuple[RecordedChoice, ...]
    started_s: float = 0.0
    duration_s: float = 0.0
    messages: tuple[dict[str, str], ...] = ()


@dataclasses.dataclass
class Segment:
    """One trajectory's worth of an episode: calls that extend one another.

    Per-token lists, all of length T (as in ``Trajectory``): ``token_ids``, ``loss_mask``
    (1 on generated ids), ``logprobs`` (nats on generated ids, 0.0 elsewhere),
    ``policy_versions`` (-1 on ids the policy did not generate).

    Attributes:
      calls: ``(call index, choice index)`` of each generation, in order.
      tool_calls: tool calls parsed from its generations, summed.
      finish_reasons: the ``FinishReason`` value of each generation, in order.
      transcript: the newest call's messages and reply as text (``Trajectory.transcript``).
    """

    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)
    calls: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    tool_calls: int = 0
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    transcript: list[dict[str, str]] = dataclasses.field(default_factory=list)

    @property
    def num_turns(self) -> int:
        """Generations in the segment."""
        return len(self.calls)

    def extends(self, prompt_ids: Sequence[int]) -> bool:
        """Whether ``prompt_ids`` start with all of this segment's tokens."""
        n = len(self.token_ids)
        return n <= len(prompt_ids) and list(prompt_ids[:n]) == self.token_ids

    def _append_context(self, ids: Sequence[int]) -> None:
        self.token_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.policy_versions.extend([-1] * len(ids))

    def _append_choice(self, call: int, index: int, choice: RecordedChoice) -> None:
        self.token_ids.extend(int(i) for i in choice.token_ids)
        self.loss_mask.extend([1] * len(choice.token_ids))
        self.logprobs.extend(float(x) for x in choice.logprobs)
        self.policy_versions.extend(int(v) for v in choice.policy_versions)
        self.calls.append((call, index))
        self.tool_calls += choice.tool_calls
        self.finish_reasons.append(choice.finish_reason)

    def _read_as(self, call: RecordedCall, choice: RecordedChoice) -> None:
        if call.messages or choice.text:
            reply = {"role": "assistant", "content": choice.text}
            self.transcript = [*(dict(m) for m in call.messages), reply]


def segment_calls(calls: Sequence[RecordedCall], extend: ExtendRule = "latest") -> list[Segment]:
    """Turns an episode's calls into segments by the rule of the module docstring.

    Args:
      calls: the episode's calls, in the order the gateway received them (``index``
        order; they are sorted by it).
      extend: ``"latest"``: a call may extend only a segment the previous call extended
        or started; ``"any"``: any segment of the episode.

    Returns:
      The segments in the order they were started; their ids are the calls' own ids,
      never re-tokenized.

    Raises:
      ValueError: ``extend`` is not one of ``EXTEND_RULES``.
    """
    if extend not in EXTEND_RULES:
        raise ValueError(f"extend={extend!r} is not a segment rule; use one of {EXTEND_RULES}.")
    segments: list[Segment] = []
    previous: list[Segment] = []  # the segments the previous call extended or started
    for call in sorted(calls, key=lambda c: c.index):
        candidates = previous if extend == "latest" else segments
        touched: list[Segment] = []
        for j, choice in enumerate(call.choices):
            segment = None
            if j == 0:
                # Newest first: of two that match, the longer, later one is the conversation.
                segment = next(
                    (s for s in reversed(candidates) if s.extends(call.prompt_ids)), None
                )
            if segment is None:
                segment = Segment()
                segments.append(segment)
            segment._append_context(call.prompt_ids[len(segment.token_ids) :])
            segment._append_choice(call.index, j, choice)
            segment._read_as(call, choice)
            touched.append(segment)
        previous = touched
    return segments


def segment_to_trajectory(
    segment: Segment,
    task_id: str,
    group_id: str,
    reward: float,
    status: EpisodeStatus | str,
    metrics: dict[str, float] | None = None,
) -> Trajectory:
    """A ``Trajectory`` holding ``segment``'s tokens (copies of its lists), as an agent's
    ``to_trajectory`` would build it: the first prompt and every observation with loss
    mask 0, logprob 0.0 and policy version -1; generated ids with mask 1 and the engine's
    logprobs and versions; ``num_turns`` = generations; metrics ``tool_calls`` = the
    segment's parsed tool calls (the batch's tool-use rate counts it, as a native
    episode's).

    Raises:
      ValueError: ``status`` is not an ``EpisodeStatus`` value.
    """
    return Trajectory(
        task_id=task_id,
        group_id=group_id,
        token_ids=list(segment.token_ids),
        loss_mask=list(segment.loss_mask),
        logprobs=list(segment.logprobs),
        policy_versions=list(segment.policy_versions),
        reward=float(reward),
        status=EpisodeStatus(status),
        num_turns=segment.num_turns,
        metrics={**(metrics or {}), "tool_calls": float(segment.tool_calls)},
        transcript=[dict(m) for m in segment.transcript],
    )


def episode_trajectories(
    calls: Sequence[RecordedCall],
    task_id: str,
    group_id: str,
    reward: float,
    status: EpisodeStatus | str,
    *,
    extend: ExtendRule = "latest",
    metrics: dict[str, float] | None = None,
) -> list[Trajectory]:
    """One ``Trajectory`` per segment of an episode's calls (``segment_calls``), all with
    the episode's ``reward`` and ``status``; each one's metrics add ``segment`` (its index)
    and ``segments`` (how many the episode has) to ``metrics``.

    Raises:
      ValueError: an unknown ``extend`` rule or ``status``.
    """
    segments = segment_calls(calls, extend)
    return [
        segment_to_trajectory(
            s,
            task_id,
            group_id,
            reward,
            status,
            {**(metrics or {}), "segment": float(i), "segments": float(len(segments))},
        )
        for i, s in enumerate(segments)
    ]
