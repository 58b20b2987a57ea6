"""The raytunix chat format.

Every message is ``<|role|>content<|end|>``, with nothing between messages::

    <|system|>Use the calculator.<|end|><|user|>2+2?<|end|><|assistant|>

and a generation prompt is the bare assistant header. Because each message starts and
ends with a special token, the token ids of a rendered conversation are the
concatenation of ``encode(message_header(role))``, ``encode(content)`` and
``encode(MESSAGE_END)`` per message (see ``raytunix.models.tokenizer``), so an agent can
extend its token sequence one message at a time without re-rendering.

This module does not import JAX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False
                ) -> str:
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
                "'content' keys.")
        message_header(message["role"])
        if not isinstance(message["content"], str):
            raise ValueError(
                f"Message {index} ({message['role']}) has content of type "
                f"{type(message['content']).__name__}; content must be a str.")
    return _TEMPLATE.render(messages=list(messages),
                            add_generation_prompt=add_generation_prompt)
