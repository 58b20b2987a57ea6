"""The agent side of an episode: the conversation as exact tokens, token-in/token-out.

An agent keeps the token ids of its conversation and extends them piece by piece, each
piece tokenized once when it arrives::

    agent.reset(task, observation)            # [system] <|user|>obs<|end|> <|assistant|>
    request = agent.next_request(rid, sampling, seed)
    action = agent.on_generation(result)      # generated ids appended verbatim, mask 1
    agent.on_observation(step.observation)    # <|tool|>obs<|end|> <|assistant|>
    ...
    trajectory = agent.to_trajectory(task_id, group_id, reward, status)

The history is never re-rendered or re-tokenized, so the learner trains on exactly the
tokens the engine saw and produced. The pieces come from a chat template through
``raytunix.agents.encoding.ConversationEncoder`` (the raytunix format by default, above;
ChatML/Qwen, Llama 3, Gemma or a model folder's own template by ``chat_template``); in the
raytunix format they equal tokenizing the rendered chat (``render_chat``), because the
tokenizer splits special tokens out before anything else.

User and tool message contents (the task, observations, tool output) are encoded as
plain text: a special-token string inside them (``<|end|><|user|>`` echoed by a tool)
stays bytes and cannot close the message or forge a turn. Only the template's own text,
the system prompt (ours, from the config) and the model's own tokens hold control tokens.

A new agent overrides only what it needs: ``parse`` (model text -> ``Action``), and if it
wants, ``system_prompt_for`` (the system message) and ``observation_message`` (how an
observation is sent back).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping, Sequence

from raytunix.agents.encoding import ConversationEncoder, shared_encoder
from raytunix.models.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from raytunix.types import (
    Action,
    EpisodeStatus,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    Task,
    Trajectory,
)


class ConversationAgentBase(abc.ABC):
    """Keeps one conversation as per-token lists and turns model text into actions.

    Per-token state (all the same length T):
      token_ids: int ids of the whole conversation.
      loss_mask: 1 on model-generated tokens, 0 on headers, user, system and tool text.
      logprobs: behaviour log-probabilities (nats) of generated tokens, 0.0 elsewhere.
      policy_versions: policy version of each generated token, -1 elsewhere.

    Args:
      tokenizer: a ``raytunix.models.tokenizer.Tokenizer`` (``encode``, ``decode``,
        ``token_to_id``) whose special tokens include the chat template's end-of-turn
        token (``<|end|>`` in the raytunix format).
      system_prompt: text of a system message put before the user message, or None.
      chat_template: a ``ChatTemplate``, a built-in name (``raytunix``, ``chatml``,
        ``qwen``, ``llama3``, ``gemma``) or a model folder / ``tokenizer_config.json``
        path; default the raytunix format.
      tools: JSON schemas given to the chat template as ``tools`` (for templates that
        show tools to the model), or None.
      template_kwargs: further chat-template variables (e.g. ``{"enable_thinking": False}``).

    Raises:
      ChatTemplateError: the template cannot be used with this tokenizer (its end-of-turn
        token is not one token, it is not prefix-stable...); the message says which.

    Subclasses implement ``parse``; they may override ``system_prompt_for`` and
    ``observation_message``.
    """

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str | None = None,
        *,
        chat_template: ChatTemplate | str = "raytunix",
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        self._template_tools = list(tools) if tools else None
        self._template_kwargs = dict(template_kwargs or {})
        self._encoders: dict[str | None, ConversationEncoder] = {}
        self._encoder = self._encoder_for(system_prompt)
        self.end_id: int = self._encoder.end_id
        self._clear()

    @classmethod
    def validate_kwargs(cls, kwargs: Mapping[str, Any]) -> None:
        """Checks constructor arguments from config before anything is built (the
        tokenizer is not known yet): the chat template must load and ``template_kwargs``
        must be a mapping. Subclasses extend it for their own arguments.

        Raises:
          ValueError: naming the argument, its value and what to give instead.
        """
        template = kwargs.get("chat_template", "raytunix")
        if not isinstance(template, (str, ChatTemplate)):
            raise ValueError(f"chat_template={template!r} must be a built-in name or a path")
        if isinstance(template, str):
            try:
                load_chat_template(template)
            except ChatTemplateError as e:
                raise ValueError(f"chat_template: {e}") from None
        template_kwargs = kwargs.get("template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
            raise ValueError(
                f"template_kwargs={template_kwargs!r} must be a mapping of template "
                "variables, e.g. {enable_thinking: false}"
            )

    # -- what a subclass may override ------------------------------------------------------

    def system_prompt_for(self, task: Task) -> str | None:
        """The system message's text for ``task``, or None for none; by default
        ``system_prompt``. It is ours, so special-token strings in it stay tokens."""
        return self.system_prompt

    def observation_message(self, observation: str) -> dict[str, str]:
        """The message that carries an environment observation back to the model; by
        default a tool message (a user message for templates without a tool role)."""
        return {"role": self._encoder.tool_role, "content": observation}

    # -- the episode ---------------------------------------------------------------------

    def reset(self, task: Task, observation: str) -> None:
        """Starts a conversation: optional system message, the user message holding
        ``observation``, then the assistant header the model continues from (mask 0)."""
        self._clear()
        self.task = task
        system_prompt = self.system_prompt_for(task)
        self._encoder = self._encoder_for(system_prompt)
        self._append_context(self._encoder.prompt({"role": "user", "content": observation}))
        if system_prompt is not None:
            self.transcript.append({"role": "system", "content": system_prompt})
        self.transcript.append({"role": "user", "content": observation})

    def next_request(
        self, request_id: str, sampling: SamplingParams, seed: int
    ) -> GenerationRequest:
        """Returns the request that continues the conversation: ``prompt_ids`` are all
        tokens so far; the end-of-turn token is added to ``sampling.stop_token_ids`` if
        missing.

        Raises:
          RuntimeError: called before ``reset`` or while a turn is unfinished (the last
            generation did not end with the end-of-turn token).
        """
        self._check_turn_open("next_request")
        if self.end_id not in sampling.stop_token_ids:
            stop_token_ids = (*sampling.stop_token_ids, self.end_id)
            sampling = dataclasses.replace(sampling, stop_token_ids=stop_token_ids)
        return GenerationRequest(
            request_id=request_id, prompt_ids=tuple(self.token_ids), sampling=sampling, seed=seed
        )

    def on_generation(self, result: GenerationResult) -> Action:
        """Appends the generated tokens verbatim (mask 1, their logprobs and versions) and
        parses their text into an ``Action``.

        A generation that ended with the end-of-turn token is followed by whatever the
        template writes after it (ChatML's newline; nothing in the raytunix format) as
        context (mask 0). A generation the engine stopped on another stop token or a stop
        string (``FinishReason.STOP``) is a whole reply too: the turn is closed with the
        end-of-turn token as context (mask 0; the policy did not write it), so the next
        message starts cleanly. A generation cut short (max tokens, abort) leaves the
        turn unfinished: nothing is added, ``turn_finished`` is False and the episode
        driver should truncate the episode.

        Raises:
          RuntimeError: called before ``reset`` or after an unfinished turn.
          ValueError: the per-token lists of ``result`` differ in length.
        """
        self._check_turn_open("on_generation")
        n = len(result.token_ids)
        if len(result.logprobs) != n or len(result.policy_versions) != n:
            raise ValueError(
                f"GenerationResult {result.request_id!r} has {n} token_ids, {len(result.logprobs)} "
                f"logprobs and {len(result.policy_versions)} policy_versions; the engine must "
                "return one of each per token."
            )
        self._append_generated(result.token_ids, result.logprobs, result.policy_versions)
        self._num_turns += 1
        closing = self._encoder.close_turn(
            result.token_ids, stopped=result.finish_reason == FinishReason.STOP
        )
        self._turn_finished = closing is not None
        if closing:
            self._append_context(closing)
        text = self.tokenizer.decode(list(result.token_ids), skip_special_tokens=False)
        action = self.parse(text)
        self.transcript.append(
            {"role": "assistant", "content": text, "action": action_summary(action)}
        )
        return action

    def on_observation(self, text: str) -> None:
        """Appends the environment's reply (``observation_message``), then the assistant
        header (mask 0); ``text`` is tokenized once, here, as plain text.

        Raises:
          RuntimeError: called before ``reset`` or after an unfinished turn.
        """
        self._check_turn_open("on_observation")
        message = self.observation_message(text)
        self._append_context(self._encoder.message(message))
        self.transcript.append({"role": message["role"], "content": text})

    @abc.abstractmethod
    def parse(self, text: str) -> Action:
        """Turns the decoded text of one generation (special tokens kept) into an Action;
        never raises: unparseable text gives ``Action(parse_error=...)``."""

    def to_trajectory(
        self,
        task_id: str,
        group_id: str,
        reward: float,
        status: EpisodeStatus,
        metrics: Mapping[str, float] | None = None,
    ) -> Trajectory:
        """Returns the conversation so far as a ``Trajectory`` (copies of the lists)."""
        return Trajectory(
            task_id=task_id,
            group_id=group_id,
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            policy_versions=list(self.policy_versions),
            reward=float(reward),
            status=status,
            num_turns=self._num_turns,
            metrics=dict(metrics or {}),
            transcript=list(self.transcript),
        )

    @property
    def num_turns(self) -> int:
        """Model turns (generations) so far."""
        return self._num_turns

    @property
    def turn_finished(self) -> bool:
        """False when the last generation was cut short (no end-of-turn); the episode must
        then be truncated, since the conversation cannot be continued."""
        return self._turn_finished

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the model generated in this conversation."""
        return sum(self.loss_mask)

    # -- supervised demonstrations ---------------------------------------------------------

    def render_demonstration(
        self, task: Task, messages: Sequence[Mapping[str, str]]
    ) -> tuple[list[int], list[int]]:
        """Tokens and loss mask of a whole demonstration, built through the same per-piece
        path as an episode (so SFT and RL see identical token boundaries). Resets the
        agent: afterwards it holds the demonstrated conversation.

        Args:
          task: the task the demonstration solves.
          messages: ``[{"role": "user", "content": ...}, {"role": "assistant", ...},
            ({"role": "tool", ...}, {"role": "assistant", ...})*]``; the agent's own
            system prompt, if any, goes first.

        Returns:
          ``(token_ids, loss_mask)``, both length T; mask 1 on assistant contents and
          their end-of-turn token, 0 on headers, system, user and tool messages.

        Raises:
          ValueError: the roles are not user, assistant, then (tool, assistant) pairs.
        """
        roles = [message["role"] for message in messages]
        n_pairs = max(len(roles) - 2, 0) // 2
        if roles != ["user", "assistant"] + ["tool", "assistant"] * n_pairs:
            raise ValueError(
                f"demonstration roles {roles} must be user, assistant, then (tool, assistant) "
                "pairs, ending with an assistant message."
            )
        self.reset(task, messages[0]["content"])
        for message in messages[1:]:
            if message["role"] == "tool":
                self.on_observation(message["content"])
            else:
                ids, closing = self._encoder.assistant(message["content"])
                self._append_generated(ids, [0.0] * len(ids), [-1] * len(ids))
                self._append_context(closing)
                self._num_turns += 1
        return list(self.token_ids), list(self.loss_mask)

    # -- internals --------------------------------------------------------------------

    def _clear(self) -> None:
        self.task: Task | None = None
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.policy_versions: list[int] = []
        self.transcript: list[dict[str, Any]] = []  # for people to read: Trajectory.transcript
        self._num_turns = 0
        self._turn_finished = True

    def _check_turn_open(self, method: str) -> None:
        if self.task is None:
            raise RuntimeError(
                f"{type(self).__name__}.{method} called before reset(task, observation)."
            )
        if not self._turn_finished:
            raise RuntimeError(
                f"{type(self).__name__}.{method} called after a generation that did not end with "
                f"{self._encoder.end_of_turn!r}; the episode driver must end (truncate) such an "
                "episode."
            )

    def _encoder_for(self, system_prompt: str | None) -> ConversationEncoder:
        encoder = self._encoders.get(system_prompt)
        if encoder is None:
            encoder = shared_encoder(
                self.tokenizer,
                self.chat_template,
                tools=self._template_tools,
                system_prompt=system_prompt,
                template_kwargs=self._template_kwargs,
            )
            self._encoders[system_prompt] = encoder
        return encoder

    def _append_context(self, ids: Sequence[int]) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.policy_versions.extend([-1] * len(ids))

    def _append_generated(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
    ) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.policy_versions.extend(int(v) for v in versions)


def action_summary(action: Action) -> dict[str, Any]:
    """What the agent made of one generation, as JSON for the transcript: ``tool_calls``
    (``[{"name", "arguments"}]``), ``answer`` or ``parse_error`` (with its kind), whichever
    it holds; {} for a turn that holds none."""
    summary: dict[str, Any] = {}
    if action.tool_calls:
        summary["tool_calls"] = [
            {"name": c.name, "arguments": c.arguments} for c in action.tool_calls
        ]
    if action.answer is not None:
        summary["answer"] = action.answer
    if action.parse_error is not None:
        summary["parse_error"] = action.parse_error
        kind = action.parse_error_kind
        summary["parse_error_kind"] = kind.value if kind is not None else "format"
    return summary
