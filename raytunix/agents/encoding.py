"""Exact per-turn tokens from a chat template: render prefix differences, tokenize once.

An agent never re-tokenizes its conversation: earlier tokens, the model's own above all,
must stay exactly what the engine saw. But chat templates render whole conversations.
``ConversationEncoder`` bridges the two by rendering *differences*: what a new message
(plus the generation prompt) adds after a conversation that ends with a finished
assistant message. Three facts about chat templates make that work:

1. **Prefix stability.** Rendering ``history + [message]`` starts with the rendering of
   ``history`` (checked the first time an encoder meets a role; a template that rewrites
   earlier messages is refused with an error naming it). So the delta is a suffix of the
   text, and the history's tokens stay as they are.
2. **Content slots.** The delta of a message whose content is a fixed sentinel
   (``SLOT``) splits into ``head + SLOT + tail``: ``head`` and ``tail`` are the template's
   own text (role headers, ``<|im_end|>``, ``<tool_response>``...), the same for any
   content. The real rendering must then be ``head + C + tail``; ``C`` is the content as
   the template wrote it (after ``| trim``, ``| tojson``...). ``head`` and ``tail`` are
   tokenized with special tokens (they are ours), ``C`` as plain text (it came from the
   environment or a dataset, so a ``<|im_end|>`` inside it stays bytes and cannot close
   the message or forge a turn). ``head`` and ``tail`` are tokenized once per encoder; a
   template that declares a role's content verbatim (``ChatTemplate.verbatim_roles``, the
   built-ins do) is not rendered again per message of that role.
3. **A stub history.** In the templates we know, a message renders from its own role
   and content and at most its neighbours' roles, so a tool message renders the same
   after any finished assistant message. Deltas are therefore taken after a short stub
   conversation (system prompt, a user message and an assistant message), not after the
   real one: the cost of a turn does not grow with the conversation, and the model's
   text is never rendered again. (A template that looked at earlier contents would break
   this; the test suite checks the built-ins against whole-conversation renders.)

The model's own turn is not rendered at all: the generated ids go in verbatim. Templates
write something after the end-of-turn token of an assistant message (ChatML ``"\\n"``
after ``<|im_end|>``, Gemma ``"\\n"`` after ``<end_of_turn>``, nothing in Llama 3 or the
raytunix format); ``close_turn`` appends that *trailer* as context (mask 0), and the
end-of-turn token itself when the engine stopped on another stop token or string. So
after every finished turn the tokens are those of the rendered conversation, piece by
piece::

    prompt:       encode(head) + encode(task text, plain) + encode(tail)   # + generation prompt
    turn k:       generated ids (as sampled) + encode(trailer)
    observation:  encode(head) + encode(observation, plain) + encode(tail) # + generation prompt

These ids equal ``encode(rendered conversation)`` whenever the tokenizer splits text at
special tokens first and every piece meets its neighbours at a special token (the raytunix
format; ChatML tool results meet at ``"\\n"``, where a BPE merge across the boundary could
differ from tokenizing the whole string; the pieces, not the string, are what the model
sees and is trained on, every turn alike).

A template's time (``strftime_now``) is pinned when the encoder is built, so every render
of one conversation shows the same date. Agents share encoders (``shared_encoder``): one
per tokenizer, template, tools, system prompt and day, so an episode costs a few renders,
not a template analysis. Nothing here imports JAX.
"""

from __future__ import annotations

import collections
import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from raytunix.models.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

SLOT = "RAYTUNIX7SLOT"
"""Stands for a message's content when a template's own text is found."""

Message = Mapping[str, Any]

_STUB_USER = "Hello."
_STUB_ASSISTANT = "Hi."


class ConversationEncoder:
    """Turns messages into token ids one message at a time, with a chat template.

    Args:
      tokenizer: has ``encode(text, special_tokens=bool) -> list[int]``,
        ``decode(ids) -> str`` and ``token_to_id(token) -> int`` (raising ``ValueError``
        for an unknown token), like ``raytunix.models.tokenizer.Tokenizer``.
      template: a ``ChatTemplate`` or a name/path for ``load_chat_template``.
      tools: JSON schemas passed to the template as ``tools`` (``Tool.function_schema()``
        of each tool), or None.
      system_prompt: the system message's text (rendered into the prompt's template text,
        so its special-token strings stay tokens: it is ours), or None.
      template_kwargs: further template variables (e.g. ``{"enable_thinking": False}``).

    Attributes:
      end_of_turn: the token string that ends an assistant message; ``end_id`` its id.
      trailer: template text after ``end_of_turn`` in a rendered assistant message.
      tool_role: the role observations are sent as: ``"tool"``, or ``"user"`` when the
        template refuses a tool message (Gemma's templates have no tool role).

    Raises:
      ChatTemplateError: the template fails on a stub conversation, its end-of-turn text
        cannot be found, or ``end_of_turn`` is not one token of ``tokenizer`` (the message
        says which and what to do).
    """

    def __init__(
        self,
        tokenizer: Any,
        template: ChatTemplate | str = "raytunix",
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        system_prompt: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = load_chat_template(template) if isinstance(template, str) else template
        self.tools = list(tools) if tools else None
        self.system_prompt = system_prompt
        self._kwargs = dict(template_kwargs or {})
        self._now = datetime.datetime.now()
        self._system = (
            [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        )
        self._stub = [
            *self._system,
            {"role": "user", "content": _STUB_USER},
            {"role": "assistant", "content": _STUB_ASSISTANT},
        ]
        self.end_of_turn, self.trailer = self._find_end_of_turn()
        self.end_id = self._single_token(self.end_of_turn)
        self._trailer_ids = tokenizer.encode(self.trailer, special_tokens=True)
        self.tool_role = self._find_tool_role()
        self._slots: dict[tuple[str, str], tuple[str, str, str, list[int], list[int]]] = {}

    # -- the pieces an agent appends ------------------------------------------------------

    def prompt(self, user: Message) -> list[int]:
        """Ids of the first prompt: the system message (if any), ``user`` and the
        generation prompt. ``user["content"]`` is encoded as plain text."""
        return self._delta(self._system, user, base="")

    def message(self, message: Message) -> list[int]:
        """Ids a message adds after a finished assistant turn, generation prompt included
        (an observation: ``{"role": self.tool_role, "content": text}``); the content is
        encoded as plain text."""
        return self._delta(self._stub, message, base=None)

    def close_turn(self, generated_ids: Sequence[int], stopped: bool) -> list[int] | None:
        """Context ids (mask 0) that close the model's turn, or None if it stays open.

        Args:
          generated_ids: the ids the engine returned for this turn.
          stopped: the engine stopped on a stop token or string (``FinishReason.STOP``).

        Returns:
          the trailer's ids when the turn ended with ``end_of_turn``; ``end_of_turn`` and
          the trailer when the engine stopped on another stop token or string (the policy
          did not write them); None when the generation was cut short (the turn cannot be
          continued and the episode must be truncated).
        """
        if generated_ids and generated_ids[-1] == self.end_id:
            return list(self._trailer_ids)
        if stopped:
            return [self.end_id, *self._trailer_ids]
        return None

    def assistant(self, content: str) -> tuple[list[int], list[int]]:
        """(ids the model writes, context ids after them) for a demonstrated assistant
        message: ``content`` (special tokens kept: demonstrations are ours) and
        ``end_of_turn``, then the trailer."""
        return (
            self.tokenizer.encode(content, special_tokens=True) + [self.end_id],
            list(self._trailer_ids),
        )

    # -- internals ------------------------------------------------------------------------

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self.template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=self.tools,
            now=self._now,
            **self._kwargs,
        )

    def _delta(self, history: list[Message], message: Message, base: str | None) -> list[int]:
        role = message["role"]
        content = message["content"]
        if not isinstance(content, str):
            raise TypeError(f"message content must be a str, got {type(content).__name__}")
        # A lone surrogate (from a tool's output) is not text; no tokenizer can encode it.
        content = content.encode("utf-8", "replace").decode("utf-8")
        key = (role, "prompt" if base == "" else "after_turn")
        slot = self._slots.get(key)
        if slot is None:
            start, head, tail = self._split_slot(history, role, base)
            encode = self.tokenizer.encode
            slot = self._slots[key] = (
                start,
                head,
                tail,
                encode(head, special_tokens=True),
                encode(tail, special_tokens=True),
            )
        start, head, tail, head_ids, tail_ids = slot
        if role in self.template.verbatim_roles:
            rendered = content  # the template writes this role's content as it is
        else:
            text = self._render([*history, {"role": role, "content": content}], True)
            if not (
                text.startswith(start + head)
                and text.endswith(tail)
                and len(text) >= len(start) + len(head) + len(tail)
            ):
                raise ChatTemplateError(
                    f"chat template {self.template.name!r} renders a {role} message's template "
                    f"text differently for content {content[:40]!r} than for other content, so "
                    "its content cannot be tokenized apart from the template's tokens; use a "
                    "template whose headers do not depend on the content."
                )
            rendered = text[len(start) + len(head) : len(text) - len(tail)]
        return head_ids + self.tokenizer.encode(rendered, special_tokens=False) + tail_ids

    def _split_slot(
        self, history: list[Message], role: str, base: str | None
    ) -> tuple[str, str, str]:
        """(text before the delta, template text before the content, after it)."""
        start = self._render(history, False) if base is None else base
        text = self._render([*history, {"role": role, "content": SLOT}], True)
        if not text.startswith(start):
            raise ChatTemplateError(
                f"chat template {self.template.name!r} is not prefix-stable: adding a {role} "
                "message changes how earlier messages render, so turns cannot be tokenized "
                "one at a time."
            )
        delta = text[len(start) :]
        if delta.count(SLOT) != 1:
            raise ChatTemplateError(
                f"chat template {self.template.name!r} does not write a {role} message's "
                "content exactly once, so it cannot be tokenized apart from the template."
            )
        head, tail = delta.split(SLOT)
        return start, head, tail

    def _find_end_of_turn(self) -> tuple[str, str]:
        text = self._render([*self._stub[:-1], {"role": "assistant", "content": SLOT}], False)
        if text.count(SLOT) != 1:
            raise ChatTemplateError(
                f"chat template {self.template.name!r} does not write an assistant message's "
                "content exactly once."
            )
        after = text.split(SLOT)[1]
        end = self.template.end_of_turn
        if end is None:  # the first token of what follows the content
            ids = self.tokenizer.encode(after, special_tokens=True)
            end = self.tokenizer.decode(ids[:1]) if ids else ""
        if not end or not after.startswith(end):
            raise ChatTemplateError(
                f"chat template {self.template.name!r} ends an assistant message with "
                f"{after!r}, which does not start with an end-of-turn token "
                f"{end!r}; set the template's end_of_turn."
            )
        return end, after[len(end) :]

    def _single_token(self, token: str) -> int:
        try:
            token_id = self.tokenizer.token_to_id(token)
        except (KeyError, ValueError):
            token_id = None
        if token_id is None:
            raise ChatTemplateError(
                f"chat template {self.template.name!r} ends a turn with {token!r}, which is "
                "not one token of this tokenizer; use the template that belongs to the "
                "model's tokenizer (the default tiny model speaks agent.chat_template=raytunix)."
            )
        return token_id

    def _find_tool_role(self) -> str:
        try:
            self._render([*self._stub, {"role": "tool", "content": SLOT}], True)
            return "tool"
        except ChatTemplateError:
            return "user"


_SHARED: collections.OrderedDict[tuple, tuple[Any, ConversationEncoder]] = collections.OrderedDict()
_SHARED_MAX = 256


def shared_encoder(
    tokenizer: Any,
    template: ChatTemplate | str,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    system_prompt: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ConversationEncoder:
    """A ``ConversationEncoder`` for these arguments, reused across conversations (the
    most recent 256 are kept). A new one is built each day, so a template that shows
    today's date (``strftime_now``) shows it for conversations started that day.

    Raises:
      ChatTemplateError: as ``ConversationEncoder``.
      TypeError: ``tools`` or ``template_kwargs`` are not JSON-serializable.
    """
    key = (
        id(tokenizer),
        template if isinstance(template, str) else id(template),
        json.dumps(tools, sort_keys=True) if tools else None,
        system_prompt,
        json.dumps(template_kwargs, sort_keys=True) if template_kwargs else None,
        datetime.date.today(),
    )
    hit = _SHARED.get(key)
    if hit is not None:
        _SHARED.move_to_end(key)
        return hit[1]
    encoder = ConversationEncoder(
        tokenizer,
        template,
        tools=tools,
        system_prompt=system_prompt,
        template_kwargs=template_kwargs,
    )
    # The key holds ids: keep the tokenizer and template alive while their encoder is cached.
    _SHARED[key] = ((tokenizer, template), encoder)
    if len(_SHARED) > _SHARED_MAX:
        _SHARED.popitem(last=False)
    return encoder
