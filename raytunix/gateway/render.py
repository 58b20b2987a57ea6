"""OpenAI messages to prompt ids, and generated ids to OpenAI replies.

``EncoderRenderer`` renders a conversation the way raytunix's own agents do
(``raytunix.agents.encoding.ConversationEncoder``, with the tool schemas placed as
``raytunix.agents.ToolAgent`` places them: in the template when it renders tools and the
parser's format is the one it teaches, else described by the parser after the system
prompt)::

    [system]  user                  -> encoder.prompt(user)   (system, user, generation prompt)
    assistant (a reply of this episode) -> its generated ids verbatim + encoder.close_turn(...)
    assistant (any other)           -> encoder.assistant(content and calls as the parser writes them)
    tool / user / system            -> encoder.message(...)   (tool results as the template's tool role)

Consecutive non-assistant messages (the results of parallel tool calls) are each rendered
as one such message, without the generation prompt between them. Because an assistant
message the gateway itself returned is put back as the exact ids the engine generated
(looked up by its content and calls), a program that appends to its history sends a
prompt that starts with the previous prompt and completion, token for token.

``HFRenderer`` renders with a Hugging Face tokenizer's own ``apply_chat_template`` (tools
passed in) and tokenizes the whole text once per call; a call then extends the previous
one only where that tokenization agrees (the segment rule of ``raytunix.gateway.recorder``
decides from the ids either way).
"""

from __future__ import annotations

import abc
import collections
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from raytunix.agents.encoding import ConversationEncoder
from raytunix.agents.parsers import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallParser,
    make_tool_parser,
)
from raytunix.agents.tool_agent import ToolAgent
from raytunix.gateway.protocol import ChatMessage, GatewayError, bad_request
from raytunix.models.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from raytunix.types import FinishReason

_HERMES_CALL = re.compile(
    re.escape(TOOL_CALL_OPEN) + r".*?" + re.escape(TOOL_CALL_CLOSE), re.DOTALL
)
_CACHE_MAX = 256

AssistantKey = tuple[str, tuple[tuple[str, str], ...]]


def _normal_arguments(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):
        return arguments


def assistant_key(content: str | None, calls: Sequence[tuple[str, str]]) -> AssistantKey:
    """How an assistant message is recognised as a reply of this episode: its content and
    its calls' names and arguments (JSON compared by value, not spacing)."""
    return (content or "", tuple((name, _normal_arguments(args)) for name, args in calls))


class Reply:
    """One parsed completion: ``content`` (None for a reply that is only calls),
    ``tool_calls`` as ``(name, arguments JSON text)``, OpenAI ``finish_reason``."""

    def __init__(self, content: str | None, tool_calls: list[tuple[str, str]], finish_reason: str):
        self.content, self.tool_calls, self.finish_reason = content, tool_calls, finish_reason

    @property
    def key(self) -> AssistantKey:
        return assistant_key(self.content, self.tool_calls)

    @property
    def text(self) -> str:
        """The reply for people to read: its content, then one ``name(arguments)`` line per
        tool call."""
        calls = [f"{name}({arguments})" for name, arguments in self.tool_calls]
        return "\n".join([self.content or "", *calls]).strip("\n")


class _Renderer(abc.ABC):
    """What both renderers share: reply parsing with the configured tool-call parser."""

    parser: ToolCallParser
    stop_token_ids: tuple[int, ...]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""

    @abc.abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens)."""

    @abc.abstractmethod
    def max_token_chars(self) -> int:
        """Characters the longest token stands for (>= 1): a prompt holding ``c``
        characters of messages is at least ``c / max_token_chars()`` tokens, so an
        overlong one is refused before it is rendered and encoded."""

    def forced_prefix(self, tool_choice: str) -> list[int]:
        """Ids put after the generation prompt so that the reply is a call:
        ``<tool_call>`` for ``"required"``, ``<tool_call>{"name": NAME, "arguments": `` for a
        named function (Hermes format only; the engine has no constrained decoding).

        Raises:
          GatewayError: 400 when ``tool_choice`` forces a call and the parser is not Hermes.
        """
        if tool_choice in ("auto", "none"):
            return []
        if self.parser.name != "hermes":
            raise bad_request(
                "tool_choice",
                f"{tool_choice!r} forces a call, which the gateway "
                "can do only for tool_parser=hermes (it writes the "
                f"call's opening); this one is {self.parser.name!r}.",
            )
        text = TOOL_CALL_OPEN
        if tool_choice != "required":
            text += '{"name": ' + json.dumps(tool_choice) + ', "arguments": '
        return self.encode_text(text)

    def reply(
        self,
        forced_ids: Sequence[int],
        ids: Sequence[int],
        finish: FinishReason,
        stops: Sequence[str],
        parse_tools: bool,
    ) -> Reply:
        """Parses ``forced_ids + ids`` (the ids the engine generated after any forced
        prefix) into a reply. The end-of-turn token is not content; a stop string and what
        follows it are cut (OpenAI's ``stop``); calls are parsed only from a finished reply."""
        body = [*forced_ids, *ids]
        if finish == FinishReason.STOP and body and body[-1] in self.stop_token_ids:
            body.pop()
        text = self.decode(body)
        if finish == FinishReason.STOP and stops:
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        reason = "stop" if finish == FinishReason.STOP else "length"
        if parse_tools and finish == FinishReason.STOP:
            calls, error, _ = self.parser.find_calls(text)
            if calls and error is None:
                content = (
                    _HERMES_CALL.sub("", text).strip() or None
                    if self.parser.name == "hermes"
                    else None
                )
                return Reply(
                    content,
                    [(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in calls],
                    "tool_calls",
                )
        return Reply(text, [], reason)


class EncoderRenderer(_Renderer):
    """Renders with a raytunix ``Tokenizer`` (``encode(text, special_tokens)``,
    ``decode``, ``token_to_id``) and a chat template, exactly as agents do (module
    docstring).

    Args:
      tokenizer: the engine's tokenizer.
      chat_template: a ``ChatTemplate``, a built-in name or a model folder path.
      tool_parser: a name of ``raytunix.agents.TOOL_PARSERS`` (default ``hermes``).
      template_kwargs: further template variables.

    Raises:
      ChatTemplateError: the template cannot be used with this tokenizer.
      ValueError: an unknown parser.
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: ChatTemplate | str = "raytunix",
        *,
        tool_parser: str = "hermes",
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.template = (
            load_chat_template(chat_template) if isinstance(chat_template, str) else chat_template
        )
        self.parser = make_tool_parser(tool_parser)
        self.template_kwargs = dict(template_kwargs or {})
        self._encoders: collections.OrderedDict[tuple, tuple[ConversationEncoder, list[int]]] = (
            collections.OrderedDict()
        )
        encoder, _ = self._encoder(None, ())
        self.stop_token_ids = (encoder.end_id,)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, special_tokens=True)

    def max_token_chars(self) -> int:
        return self.tokenizer.max_token_chars

    def chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]],
        known: Mapping[AssistantKey, Sequence[int]],
    ) -> list[int]:
        """The prompt ids of ``messages`` (module docstring), ending with the generation
        prompt; ``known`` maps the episode's replies (``Reply.key``) to their ids.

        Raises:
          GatewayError: 400 when the conversation does not start with an optional system
            message and a user message, ends with an assistant message, or a message cannot
            be rendered by the template.
        """
        system = messages[0].content if messages[0].role == "system" else None
        start = 0 if system is None else 1
        if len(messages) <= start or messages[start].role != "user":
            role = messages[start].role if len(messages) > start else None
            raise bad_request(
                f"messages[{start}].role",
                f"{role!r}: the conversation must start with an optional system "
                "message and then a user message.",
            )
        if messages[-1].role == "assistant":
            raise bad_request(
                f"messages[{len(messages) - 1}].role",
                "'assistant': the last message must be a user or tool message "
                "(continuing an assistant message is not supported).",
            )
        try:
            encoder, generation_prompt = self._encoder(system, tools)
            ids: list[int] = []
            run: list[tuple[int, ChatMessage]] = []
            for i in range(start, len(messages)):
                if messages[i].role == "assistant":
                    ids += self._run(encoder, generation_prompt, run, first=not ids)
                    ids += self._assistant(encoder, i, messages[i], known)
                    run = []
                else:
                    run.append((i, messages[i]))
            return ids + self._run(encoder, generation_prompt, run, first=not ids)
        except ChatTemplateError as e:
            raise bad_request("messages", f"cannot be rendered by the chat template: {e}") from None

    def close_turn(self, generated_ids: Sequence[int], stopped: bool) -> list[int] | None:
        """Ids that close the model's turn in the next prompt (``ConversationEncoder``'s
        ``close_turn``), or None when the reply was cut short."""
        encoder, _ = self._encoder(None, ())
        return encoder.close_turn(generated_ids, stopped)

    def _encoder(
        self, system: str | None, tools: Sequence[Mapping[str, Any]]
    ) -> tuple[ConversationEncoder, list[int]]:
        key = (system, json.dumps(list(tools), sort_keys=True))
        hit = self._encoders.get(key)
        if hit is not None:
            self._encoders.move_to_end(key)
            return hit
        agent = ToolAgent(
            self.tokenizer,
            system,
            chat_template=self.template,
            tool_parser=self.parser,
            tools=list(tools) or None,
            template_kwargs=self.template_kwargs,
        )
        encoder = agent._encoder  # where ToolAgent put the schemas, and its system prompt
        with_prompt = encoder._render(encoder._stub, True)
        without = encoder._render(encoder._stub, False)
        if not with_prompt.startswith(without):
            raise ChatTemplateError(
                f"chat template {self.template.name!r} changes earlier "
                "messages when it adds the generation prompt."
            )
        generation_prompt = self.tokenizer.encode(with_prompt[len(without) :], special_tokens=True)
        self._encoders[key] = (encoder, generation_prompt)
        if len(self._encoders) > _CACHE_MAX:
            self._encoders.popitem(last=False)
        return encoder, generation_prompt

    def _run(
        self,
        encoder: ConversationEncoder,
        generation_prompt: list[int],
        run: list[tuple[int, ChatMessage]],
        first: bool,
    ) -> list[int]:
        ids: list[int] = []
        for k, (i, message) in enumerate(run):
            role = encoder.tool_role if message.role == "tool" else message.role
            piece = {"role": role, "content": message.content}
            part = encoder.prompt(piece) if first and k == 0 else encoder.message(piece)
            if k < len(run) - 1:
                n = len(generation_prompt)
                if n and part[-n:] != generation_prompt:
                    raise bad_request(
                        f"messages[{i}]",
                        f"chat template {self.template.name!r} does not end a "
                        f"{role} message with its generation prompt, so several "
                        "messages in a row cannot be rendered one at a time.",
                    )
                part = part[:-n] if n else part
            ids += part
        return ids

    def _assistant(
        self,
        encoder: ConversationEncoder,
        i: int,
        message: ChatMessage,
        known: Mapping[AssistantKey, Sequence[int]],
    ) -> list[int]:
        calls = [(c.name, c.arguments) for c in message.tool_calls]
        exact = known.get(assistant_key(message.content, calls))
        if exact is not None:
            return list(exact)
        text = message.content
        if calls:
            written = _write_calls(self.parser.name, calls, f"messages[{i}].tool_calls")
            text = f"{text}\n{written}" if text else written
        content_ids, closing = encoder.assistant(text)
        return content_ids + closing


def _write_calls(parser: str, calls: Sequence[tuple[str, str]], where: str) -> str:
    """Tool calls as the parser's format writes them (for history this episode did not
    generate)."""
    loaded = []
    for k, (name, arguments) in enumerate(calls):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise bad_request(
                f"{where}[{k}].function.arguments", f"{arguments[:80]!r} is not a JSON object."
            )
        loaded.append((name, value))
    if parser == "hermes":
        return "".join(
            f"{TOOL_CALL_OPEN}{json.dumps({'name': n, 'arguments': a})}{TOOL_CALL_CLOSE}"
            for n, a in loaded
        )
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in loaded)
    if parser == "gemma":
        return (
            "["
            + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in loaded)
            + "]"
        )
    if parser == "react":
        if len(loaded) != 1:
            raise bad_request(where, "the react format holds one action per turn.")
        return f"Action: {loaded[0][0]}\nAction Input: {json.dumps(loaded[0][1])}"
    raise GatewayError(400, f"{where}: tool parser {parser!r} cannot write calls back")


class HFRenderer(_Renderer):
    """Renders with a Hugging Face tokenizer's own ``apply_chat_template`` (``tools``
    passed in, calls' arguments as objects, as ``transformers`` documents them) and
    tokenizes the whole text once per call (module docstring).

    Args:
      tokenizer: a ``transformers`` tokenizer with a ``chat_template``.
      tool_parser: a name of ``raytunix.agents.TOOL_PARSERS``.
      template_kwargs: further template variables.

    Raises:
      ValueError: the tokenizer has no ``chat_template`` or no ``eos_token_id``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_parser: str = "hermes",
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "HFRenderer needs a tokenizer with a chat_template; set "
                "tokenizer.chat_template or use EncoderRenderer."
            )
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError(
                "HFRenderer needs a tokenizer with an eos_token (the token that ends a reply)."
            )
        self.tokenizer = tokenizer
        self.parser = make_tool_parser(tool_parser)
        self.template_kwargs = dict(template_kwargs or {})
        self.stop_token_ids = (int(tokenizer.eos_token_id),)
        self._max_token_chars: int | None = None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def max_token_chars(self) -> int:
        if self._max_token_chars is None:
            self._max_token_chars = max(1, *map(len, self.tokenizer.get_vocab()))
        return self._max_token_chars

    def chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]],
        known: Mapping[AssistantKey, Sequence[int]],
    ) -> list[int]:
        """The ids of ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``.

        Raises:
          GatewayError: 400 when the template raises for these messages.
        """
        plain = []
        for message in messages:
            item: dict[str, Any] = {"role": message.role, "content": message.content}
            if message.tool_calls:
                item["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _arguments_object(c.arguments)},
                    }
                    for c in message.tool_calls
                ]
            if message.tool_call_id:
                item["tool_call_id"] = message.tool_call_id
            plain.append(item)
        try:
            text = self.tokenizer.apply_chat_template(
                plain,
                tools=list(tools) or None,
                add_generation_prompt=True,
                tokenize=False,
                **self.template_kwargs,
            )
        except Exception as e:  # noqa: BLE001 - a template's own error is the caller's input
            raise bad_request("messages", f"the chat template failed: {e}") from None
        return self.encode_text(text)

    def close_turn(self, generated_ids: Sequence[int], stopped: bool) -> list[int] | None:
        """None: the whole conversation is rendered again each call."""
        return None


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


def make_renderer(
    tokenizer: Any,
    chat_template: ChatTemplate | str = "raytunix",
    *,
    tool_parser: str = "hermes",
    template_kwargs: Mapping[str, Any] | None = None,
) -> EncoderRenderer | HFRenderer:
    """``HFRenderer`` for a ``transformers`` tokenizer that has a ``chat_template``, else
    ``EncoderRenderer`` with ``chat_template``.

    Raises:
      ChatTemplateError, ValueError: as the chosen renderer.
    """
    if hasattr(tokenizer, "apply_chat_template") and getattr(tokenizer, "chat_template", None):
        return HFRenderer(tokenizer, tool_parser=tool_parser, template_kwargs=template_kwargs)
    return EncoderRenderer(
        tokenizer, chat_template, tool_parser=tool_parser, template_kwargs=template_kwargs
    )
