"""The OpenAI wire format: request bodies checked into plain dataclasses, errors as OpenAI
error bodies. No HTTP, no engine: ``raytunix.gateway.server`` calls these.

Every check names the bad field (``param``, as OpenAI's error bodies do) and its value, and
says what to send instead; nothing here raises anything but ``GatewayError``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class GatewayError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type",
    "param", "code"}}`` and HTTP ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str, message: str) -> GatewayError:
    """A 400 naming ``param``."""
    return GatewayError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclasses.dataclass(frozen=True)
class ToolCallOut:
    """One function call of an assistant message: ``arguments`` is the JSON text."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """One message of a chat request; ``content`` is text ("" when absent)."""

    role: str
    content: str
    tool_calls: tuple[ToolCallOut, ...] = ()
    tool_call_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling fields shared by both endpoints."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False


@dataclasses.dataclass(frozen=True)
class ChatCall:
    """A checked ``POST /v1/chat/completions`` body.

    Attributes:
      tool_choice: ``"auto"``, ``"none"``, ``"required"`` or a function name.
      logprobs: return the sampled tokens' logprobs.
    """

    messages: tuple[ChatMessage, ...]
    tools: tuple[dict[str, Any], ...]
    tool_choice: str
    sampling: Sampling
    logprobs: bool
    model: str


@dataclasses.dataclass(frozen=True)
class CompletionCall:
    """A checked ``POST /v1/completions`` body: each prompt is text or token ids."""

    prompts: tuple[str | tuple[int, ...], ...]
    sampling: Sampling
    logprobs: bool
    model: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(
    body: Mapping[str, Any],
    name: str,
    default: float,
    low: float,
    high: float,
    low_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(
            name,
            f"{value!r} is not a number; send a number in "
            f"{'(' if low_open else '['}{low}, {high}].",
        )
    if value < low or value > high or (low_open and value == low):
        raise bad_request(
            name,
            f"{value!r} is out of range; send a number in "
            f"{'(' if low_open else '['}{low}, {high}].",
        )
    return float(value)


def _int(
    body: Mapping[str, Any], name: str, default: int | None, low: int, high: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise bad_request(name, f"{value!r} must be an integer {bound}.")
    return int(value)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0, 1.0 if name == "repetition_penalty" else 0):
            raise bad_request(
                name,
                f"{value!r} is not supported (the engine samples without "
                "penalties); leave it out or send 0.",
            )
    if body.get("logit_bias"):
        raise bad_request("logit_bias", "is not supported by the engine; leave it out.")
    if body.get("echo"):
        raise bad_request("echo", "is not supported; leave it out or send false.")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") != "text"):
        raise bad_request(
            "response_format",
            f"{fmt!r} is not supported (no constrained "
            'decoding); leave it out or send {"type": "text"}.',
        )


def parse_sampling(body: Mapping[str, Any], max_n: int) -> Sampling:
    """The sampling fields of a request body.

    ``max_completion_tokens`` wins over ``max_tokens`` when both are given; ``stop`` is a
    string or a list of at most 4 non-empty strings.

    Raises:
      GatewayError: 400 naming the first bad field.
    """
    _refuse_unsupported(body)
    n = _int(body, "n", 1, 1, max_n)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad_request("best_of", f"{best_of!r} is not supported; leave it out or send n.")
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad_request("stop", f"{stop!r} must be a string or a list of at most 4 strings.")
    if any(not s for s in stops):
        raise bad_request("stop", f"{stop!r} holds an empty string; every stop must be non-empty.")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_request("seed", f"{seed!r} must be an integer.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream", f"{stream!r} must be true or false.")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise bad_request("stream_options", f"{options!r} must be an object.")
    return Sampling(
        n=int(n or 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(int(_int(body, "top_k", 0, -1) or 0), 0),  # vLLM's -1 means off, like 0
        max_tokens=max_tokens,
        stop=stops,
        seed=seed,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
    )


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad_request("model", f"{model!r} must be a string.")
    return model


def _text(value: Any, where: str) -> str:
    """Message content: a string, None, or a list of ``{"type": "text", "text": ...}``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f"{where}[{i}]",
                    f"{part!r} is not a text part; only "
                    '{"type": "text", "text": ...} is supported.',
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(where, f"{value!r} must be a string or a list of text parts.")


def _tool_calls(value: Any, where: str) -> tuple[ToolCallOut, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request(where, f"{value!r} must be a list of tool calls.")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments", "{}") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name or not isinstance(arguments, str):
            raise bad_request(
                f"{where}[{i}]",
                f"{call!r} must be {{\"id\", \"type\": "
                '"function", "function": {"name": str, '
                '"arguments": JSON text}}.',
            )
        call_id = call.get("id")
        calls.append(
            ToolCallOut(
                id=call_id if isinstance(call_id, str) else f"call_{i}",
                name=name,
                arguments=arguments,
            )
        )
    return tuple(calls)


def parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    """The ``messages`` of a chat request.

    Raises:
      GatewayError: 400 naming the bad message (``messages[i].role`` ...).
    """
    if not isinstance(value, list) or not value:
        raise bad_request("messages", f"{_short(value)} must be a non-empty list of messages.")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise bad_request(where, f"{_short(message)} must be an object with role and content.")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}.")
        calls = _tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
        if calls and role != "assistant":
            raise bad_request(
                f"{where}.tool_calls",
                f"only assistant messages carry tool calls, not {role} messages.",
            )
        call_id = message.get("tool_call_id")
        messages.append(
            ChatMessage(
                role="system" if role == "developer" else role,
                content=_text(message.get("content"), f"{where}.content"),
                tool_calls=calls,
                tool_call_id=call_id if isinstance(call_id, str) else None,
            )
        )
    return tuple(messages)


def parse_tools(body: Mapping[str, Any]) -> tuple[tuple[dict[str, Any], ...], str]:
    """``(tools as {"type": "function", "function": {...}} schemas, tool_choice)``.

    Raises:
      GatewayError: 400 for a tool that is not a function schema (``parameters`` not an
        object, a name used twice), a ``tool_choice`` that is
        not ``"auto"``/``"none"``/``"required"``/a named function of ``tools``, or a
        ``tool_choice`` without ``tools``.
    """
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request("tools", f"{_short(tools)} must be a list of function tools.")
    schemas: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not (
            isinstance(tool, Mapping)
            and tool.get("type", "function") == "function"
            and isinstance(function, Mapping)
            and isinstance(function.get("name"), str)
            and function["name"]
        ):
            raise bad_request(
                f"tools[{i}]",
                f"{_short(tool)} must be {{\"type\": \"function\", "
                '"function": {"name": str, "description": str, '
                '"parameters": JSON schema}}.',
            )
        parameters = function.get("parameters", {})
        if not isinstance(parameters, Mapping):
            raise bad_request(
                f"tools[{i}].function.parameters",
                f"{_short(parameters)} must be a JSON schema object "
                '(e.g. {"type": "object", "properties": {...}}).',
            )
        if function["name"] in (s["function"]["name"] for s in schemas):
            raise bad_request(
                f"tools[{i}].function.name",
                f"{function['name']!r} names two tools; give each tool its own name.",
            )
        schemas.append({"type": "function", "function": dict(function)})
    choice = body.get("tool_choice")
    names = [s["function"]["name"] for s in schemas]
    if choice is None:
        return tuple(schemas), "auto" if schemas else "none"
    if not schemas and choice != "none":
        raise bad_request(
            "tool_choice", f"{_short(choice)} needs tools; send tools or leave tool_choice out."
        )
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        return tuple(schemas), choice
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or name not in names:
        raise bad_request(
            "tool_choice",
            f"{_short(choice)} must be \"auto\", \"none\", "
            '"required" or {"type": "function", "function": '
            f'{{"name": one of {names}}}}}.',
        )
    return tuple(schemas), name


def parse_chat(body: Any, max_n: int) -> ChatCall:
    """A chat completions body, checked.

    Raises:
      GatewayError: 400 naming the first bad field; ``top_logprobs`` above 0 is refused
        (the engine returns only the sampled token's logprob).
    """
    if not isinstance(body, Mapping):
        raise bad_request("body", f"{_short(body)} must be a JSON object.")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) and logprobs is not None:
        raise bad_request("logprobs", f"{logprobs!r} must be true or false.")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise bad_request(
            "top_logprobs",
            f"{top!r} is not available: the engine returns only "
            "the sampled token's logprob; send 0 or leave it out.",
        )
    tools, choice = parse_tools(body)
    return ChatCall(
        messages=parse_messages(body.get("messages")),
        tools=tools,
        tool_choice=choice,
        sampling=parse_sampling(body, max_n),
        logprobs=bool(logprobs),
        model=_model(body),
    )


def parse_completion(body: Any, max_n: int, vocab_size: int | None) -> CompletionCall:
    """A (legacy) completions body: ``prompt`` is a string, a list of token ids, or a list
    of either; ``logprobs`` is 0 (the sampled tokens' logprobs) or absent.

    Raises:
      GatewayError: 400 naming the first bad field.
    """
    if not isinstance(body, Mapping):
        raise bad_request("body", f"{_short(body)} must be a JSON object.")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)
    ):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = list(prompt)
    else:
        raise bad_request(
            "prompt",
            f"{_short(prompt)} must be a string, a list of token ids, "
            "or a non-empty list of either.",
        )
    checked: list[str | tuple[int, ...]] = []
    for i, item in enumerate(prompts):
        if isinstance(item, str) and item:
            checked.append(item)
        elif (
            isinstance(item, list)
            and item
            and all(_is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size) for t in item)
        ):
            checked.append(tuple(item))
        else:
            raise bad_request(
                f"prompt[{i}]",
                f"{_short(item)} must be a non-empty string or "
                "a non-empty list of token ids in the vocabulary"
                + (f" [0, {vocab_size})." if vocab_size else "."),
            )
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise bad_request(
            "logprobs",
            f"{logprobs!r} is not available: the engine returns only "
            "the sampled token's logprob; send 0 or leave it out.",
        )
    if body.get("suffix"):
        raise bad_request("suffix", "is not supported; leave it out.")
    return CompletionCall(
        prompts=tuple(checked),
        sampling=parse_sampling(body, max_n),
        logprobs=logprobs == 0,
        model=_model(body),
    )


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
