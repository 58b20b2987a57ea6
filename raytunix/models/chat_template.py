"""Chat templates: the raytunix chat format, and Hugging Face-style Jinja templates.

The raytunix format (the default tiny model's) writes every message as
``<|role|>content<|end|>``, with nothing between messages::

    <|system|>Use the calculator.<|end|><|user|>2+2?<|end|><|assistant|>

and a generation prompt is the bare assistant header. Because each message starts and
ends with a special token, the token ids of a rendered conversation are the
concatenation of ``encode(message_header(role))``, ``encode(content)`` and
``encode(MESSAGE_END)`` per message (see ``raytunix.models.tokenizer``), so an agent can
extend its token sequence one message at a time without re-rendering.

``ChatTemplate`` renders any chat template the way Hugging Face ``transformers``
renders ``tokenizer.apply_chat_template(..., tokenize=False)``: a Jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block tag, a ``tojson`` filter that
does not HTML-escape, the globals ``raise_exception`` and ``strftime_now``, and the
variables ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``,
``eos_token`` (and the tokenizer's other special tokens). Templates come from a model
folder (``chat_template.jinja``, ``chat_template.json`` or the ``chat_template`` field of
``tokenizer_config.json``) or are built in: ``raytunix``, ``chatml`` (alias ``qwen``),
``llama3`` and ``gemma`` (see ``BUILTIN_TEMPLATES``). How an agent turns a template into
exact per-turn tokens is ``raytunix.agents.encoding``.

This module does not import JAX.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_END = "<|end|>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('Unknown chat role ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
"""Jinja2 template over ``messages`` (a list of ``{"role", "content"}``) and
``add_generation_prompt``; it calls ``raise_exception(message)`` on an unknown role, as
Hugging Face chat templates do."""


def _raise_exception(message: str):
    raise ValueError(message)


_ENV = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
_ENV.globals["raise_exception"] = _raise_exception
_TEMPLATE = _ENV.from_string(CHAT_TEMPLATE)


def message_header(role: str) -> str:
    """The special token that opens a message of ``role``, e.g. ``"<|user|>"``.

    Raises:
      ValueError: if ``role`` is not one of ``ROLES``.
    """
    if role not in ROLES:
        raise ValueError(f"Unknown chat role {role!r}; expected one of {ROLES}.")
    return f"<|{role}|>"


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """Renders a conversation with ``CHAT_TEMPLATE``.

    Args:
      messages: each a mapping with a ``"role"`` from ``ROLES`` and a ``"content"`` str.
      add_generation_prompt: append ``<|assistant|>`` so the model writes the next turn.

    Returns:
      The rendered text, to be tokenized with ``Tokenizer.encode``.

    Raises:
      ValueError: if a message lacks ``role`` or ``content``, has an unknown role, or
        its content is not a str.
    """
    for index, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ValueError(
                f"Message {index} is {dict(message)!r}; every message needs 'role' and "
                "'content' keys."
            )
        message_header(message["role"])
        if not isinstance(message["content"], str):
            raise ValueError(
                f"Message {index} ({message['role']}) has content of type "
                f"{type(message['content']).__name__}; content must be a str."
            )
    return _TEMPLATE.render(messages=list(messages), add_generation_prompt=add_generation_prompt)


# -- Hugging Face-style chat templates ------------------------------------------------


class ChatTemplateError(ValueError):
    """A chat template could not be loaded or rendered; the message names the template."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own ``tojson`` escapes < > & ' for HTML; chat templates need the plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    some templates; rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _template_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it is rendered with.

    Attributes:
      source: the Jinja source.
      name: a built-in name or the file it came from (for error messages).
      special_tokens: variables such as ``bos_token`` and ``eos_token`` (strings).
      end_of_turn: the token string that ends an assistant message (``"<|im_end|>"``),
        or None to let the agent infer it from a rendered assistant message.
      tool_use_source: the template to use instead of ``source`` when tools are given
        (a ``tool_use`` entry of ``tokenizer_config.json``), or None.
      verbatim_roles: roles whose content the template writes exactly as given, whatever
        it is (no ``trim``, no content-dependent branch); an agent then need not render
        each such message to find its content. Empty (check every message) for templates
        read from files.
    """

    source: str
    name: str = "custom"
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    end_of_turn: str | None = None
    tool_use_source: str | None = None
    verbatim_roles: frozenset[str] = frozenset()

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        now: datetime.datetime | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders ``messages`` as ``apply_chat_template(..., tokenize=False)`` would.

        Args:
          messages: ``{"role": str, "content": str, ...}`` mappings (assistant messages
            may carry ``tool_calls``).
          add_generation_prompt: end with the header the model continues from.
          tools: JSON schemas of the tools (``Tool.function_schema()``), or None.
          now: the time ``strftime_now`` reports (default: the current time); an agent
            pins it so that every render of one conversation shows the same date.
          **kwargs: further template variables (e.g. ``enable_thinking``); they override
            ``special_tokens``.

        Raises:
          ChatTemplateError: the template raised (``raise_exception``, an undefined
            variable used as a value, a sandbox violation), naming the template.
        """
        source = self.tool_use_source if tools and self.tool_use_source else self.source
        context: dict[str, Any] = {**self.special_tokens, **kwargs}
        if now is not None:
            context["strftime_now"] = now.strftime
        try:
            template = _compile(source)
            return template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(
                f"chat template {self.name!r} failed: {e.message or type(e).__name__}"
            ) from e


# Built-in templates, written for raytunix from the public descriptions of each format.
# They render messages (system, user, assistant, tool) as the model families expect; a
# model folder's own template, when there is one, is the better choice for that model.

_CHATML_SOURCE = r"""
{%- if messages and messages[0].role == 'system' %}
    {%- set system_text = messages[0].content %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = none %}
    {%- set turns = messages %}
{%- endif %}
{%- if system_text is not none or tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system_text is not none %}
        {{- system_text }}
    {%- endif %}
    {%- if tools %}
        {%- if system_text is not none %}
            {{- '\n\n' }}
        {%- endif %}
        {{- '# Tools\n\nYou may call the functions below to help with the request. '
            'Their JSON signatures are inside <tools></tools>:\n<tools>' }}
        {%- for tool in tools %}
            {{- '\n' ~ (tool | tojson) }}
        {%- endfor %}
        {{- '\n</tools>\n\nTo call a function, write a JSON object with its name and '
            'arguments inside <tool_call></tool_call> tags:\n<tool_call>\n'
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in turns %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ message.content ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' ~ (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ message.content ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

_LLAMA3_SOURCE = r"""
{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
    {%- set system_text = messages[0].content | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = none %}
    {%- set turns = messages %}
{%- endif %}
{%- if system_text is not none or tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
    {%- if system_text is not none %}
        {{- system_text }}
    {%- endif %}
    {%- if tools %}
        {%- if system_text is not none %}
            {{- '\n\n' }}
        {%- endif %}
        {{- 'You can call the functions below. To call one, reply with nothing but a JSON '
            'object {"name": function name, "parameters": object of argument names and values}.' }}
        {%- for tool in tools %}
            {{- '\n\n' ~ (tool | tojson(indent=4)) }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in turns %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if not loop.first %}
                {{- '; ' }}
            {%- endif %}
            {{- '{"name": ' ~ (fn.name | tojson) ~ ', "parameters": ' ~ (fn.arguments | tojson) ~ '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {{- message.content | tojson }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\n\n'
            ~ (message.content | trim) ~ '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

_GEMMA_SOURCE = r"""
{{- bos_token }}
{%- set ns = namespace(prefix='') %}
{%- if messages and messages[0].role == 'system' %}
    {%- set ns.prefix = (messages[0].content | trim) ~ '\n\n' %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
    {%- if message.role == 'assistant' %}
        {%- set role = 'model' %}
    {%- elif message.role in ['user', 'tool'] %}
        {%- set role = 'user' %}
    {%- else %}
        {{- raise_exception('Gemma has no ' ~ message.role ~ ' role; use system (first '
                            'message only), user, assistant or tool') }}
    {%- endif %}
    {{- '<start_of_turn>' ~ role ~ '\n' }}
    {%- if loop.first %}
        {{- ns.prefix }}
    {%- endif %}
    {{- (message.content | trim) ~ '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""

_CHATML = ChatTemplate(
    _CHATML_SOURCE,
    name="chatml",
    special_tokens={"bos_token": "", "eos_token": "<|im_end|>"},
    end_of_turn="<|im_end|>",
    verbatim_roles=frozenset(ROLES),
)

BUILTIN_TEMPLATES: dict[str, ChatTemplate] = {
    # The raytunix format; the default tiny model's tokenizer has its special tokens.
    "raytunix": ChatTemplate(
        CHAT_TEMPLATE,
        name="raytunix",
        special_tokens={"bos_token": "", "eos_token": MESSAGE_END},
        end_of_turn=MESSAGE_END,
        verbatim_roles=frozenset(ROLES),
    ),
    # ChatML (<|im_start|>role ... <|im_end|>), with tools and tool results the way Qwen2.5
    # shows them: signatures in <tools> in the system message, calls in <tool_call>,
    # results in <tool_response> inside a user turn.
    "chatml": _CHATML,
    "qwen": dataclasses.replace(_CHATML, name="qwen"),
    # Llama 3.x headers; tools as JSON in the system message, calls as one JSON object
    # {"name", "parameters"}, results in an ipython turn.
    "llama3": ChatTemplate(
        _LLAMA3_SOURCE,
        name="llama3",
        special_tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        end_of_turn="<|eot_id|>",
        verbatim_roles=frozenset({"tool"}),
    ),
    # Gemma 2/3 turns (user and model only): the system prompt opens the first user turn,
    # tool results come back as user turns; tools are described in the system prompt.
    "gemma": ChatTemplate(
        _GEMMA_SOURCE,
        name="gemma",
        special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"},
        end_of_turn="<end_of_turn>",
    ),
}
"""Built-in chat templates by name (``agent.chat_template``)."""


def _token_text(value: Any) -> str | None:
    """A special token in ``tokenizer_config.json``: a string or ``{"content": str, ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"cannot read {path!r} as JSON ({e}); check the file.") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path!r} must hold a JSON object, got {type(data).__name__}.")
    return data


def _sources(value: Any, path: str) -> tuple[str, str | None]:
    """(default source, tool_use source or None) of a ``chat_template`` field, which is a
    string or a list of ``{"name": ..., "template": ...}``."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        if isinstance(named.get("default"), str):
            tool_use = named.get("tool_use")
            return named["default"], tool_use if isinstance(tool_use, str) else None
    raise ChatTemplateError(
        f"the chat_template in {path!r} must be a string or a list of {{\"name\", \"template\"}} "
        "entries with a 'default' one."
    )


def chat_template_from_folder(path: str) -> ChatTemplate:
    """Reads the chat template of a model folder (or of one of its files).

    The template comes from ``chat_template.jinja``, else ``chat_template.json``, else the
    ``chat_template`` field of ``tokenizer_config.json`` (the order ``transformers``
    uses); special tokens (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``)
    come from ``tokenizer_config.json``. ``path`` may also name one of these files.

    Raises:
      ChatTemplateError: no template is found, or a file is not valid.
    """
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    special = {
        key: text
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (text := _token_text(config.get(key))) is not None
    }
    candidates = ([path] if os.path.isfile(path) else []) + [
        os.path.join(folder, name)
        for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
    ]
    for candidate in candidates:
        if not os.path.isfile(candidate):
            continue
        if candidate.endswith(".jinja"):
            with open(candidate, encoding="utf-8") as f:
                return ChatTemplate(f.read(), name=candidate, special_tokens=special)
        field = _read_json(candidate).get("chat_template")
        if field is not None:
            source, tool_use = _sources(field, candidate)
            return ChatTemplate(
                source, name=candidate, special_tokens=special, tool_use_source=tool_use
            )
    raise ChatTemplateError(
        f"no chat template in {path!r}: expected chat_template.jinja, chat_template.json or a "
        "'chat_template' field in tokenizer_config.json; name a built-in template instead "
        f"({', '.join(BUILTIN_TEMPLATES)})."
    )


@functools.lru_cache(maxsize=32)
def load_chat_template(spec: str) -> ChatTemplate:
    """The chat template named by ``spec``: a built-in name (``BUILTIN_TEMPLATES``), a
    model folder, or a ``tokenizer_config.json`` / ``chat_template.json`` /
    ``chat_template.jinja`` file (see ``chat_template_from_folder``). Results are cached
    by ``spec``.

    Raises:
      ChatTemplateError: ``spec`` is neither a built-in name nor an existing path, or the
        files hold no valid template.
    """
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    if os.path.exists(spec):
        return chat_template_from_folder(spec)
    raise ChatTemplateError(
        f"chat template {spec!r} is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) nor an "
        "existing model folder or tokenizer_config.json / chat_template.jinja file."
    )
