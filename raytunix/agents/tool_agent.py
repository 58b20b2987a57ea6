"""Agents for the math environments: one that calls tools, one that only answers."""

from __future__ import annotations

import datetime
import json
from typing import Any, Mapping, Sequence

from raytunix.agents.base import ConversationAgentBase
from raytunix.agents.parsers import (
    TOOL_PARSERS,
    ToolCallParser,
    make_tool_parser,
    parse_answer_action,
)
from raytunix.models.chat_template import ChatTemplate, load_chat_template
from raytunix.registry import register
from raytunix.tools import resolve_tool
from raytunix.types import Action


@register("agent", "tool")
class ToolAgent(ConversationAgentBase):
    """Multi-turn agent: each turn is one or more tool calls or a final answer, in the
    format of ``tool_parser``; anything else is a parse error the environment answers with
    an error observation.

    Args:
      tokenizer, system_prompt, chat_template, template_kwargs: see
        ``ConversationAgentBase``.
      tool_parser: a ``ToolCallParser`` or a name from ``TOOL_PARSERS`` (default
        ``hermes``: ``<tool_call>{json}</tool_call>`` or ``<answer>...</answer>``).
      tools: the tools shown to the model, each a ``Tool`` (its ``function_schema()`` is
        used), a tool's registered name or import path (``"calculator"``, as config gives
        it), or a JSON schema ``{"type": "function", "function": {"name",
        "description", "parameters"}}``. When the chat template renders tools and the
        parser's format is the one such templates teach, the schemas go to the template
        (Qwen's ``<tools>`` block, Llama 3's JSON list); otherwise the parser describes
        them after the system prompt. None or empty: no tools are shown (the default run's
        warm start teaches the format instead).

    Raises:
      ValueError: an unknown parser name, an unknown tool name, or a tool that is
        neither a ``Tool`` nor a schema with a function name.
    """

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str | None = None,
        *,
        chat_template: ChatTemplate | str = "raytunix",
        tool_parser: ToolCallParser | str = "hermes",
        tools: Sequence[Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tool_parser = (
            make_tool_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
        )
        schemas = [_schema(tool) for tool in tools or ()]
        template = (
            load_chat_template(chat_template) if isinstance(chat_template, str) else chat_template
        )
        template_tools = None
        if (
            schemas
            and self.tool_parser.uses_template_tools
            and _renders_tools(template, schemas, template_kwargs)
        ):
            template_tools = schemas
        elif schemas:
            description = self.tool_parser.describe_tools(schemas)
            system_prompt = (
                description if system_prompt is None else (f"{system_prompt}\n\n{description}")
            )
        super().__init__(
            tokenizer,
            system_prompt,
            chat_template=template,
            tools=template_tools,
            template_kwargs=template_kwargs,
        )

    @classmethod
    def validate_kwargs(cls, kwargs: Mapping[str, Any]) -> None:
        """Also checks ``tool_parser`` (a registered format) and ``tools`` (a list of
        registered tool names, import paths or schemas).

        Raises:
          ValueError: naming the argument, its value and what to give instead.
        """
        super().validate_kwargs(kwargs)
        parser = kwargs.get("tool_parser", "hermes")
        if not isinstance(parser, (str, ToolCallParser)) or (
            isinstance(parser, str) and parser not in TOOL_PARSERS
        ):
            raise ValueError(f"tool_parser={parser!r} is not one of {', '.join(TOOL_PARSERS)}")
        tools = kwargs.get("tools") or []
        if not isinstance(tools, (list, tuple)):
            raise ValueError(f"tools={tools!r} must be a list of tool names, e.g. [calculator]")
        for tool in tools:
            try:
                _schema(tool)
            except ValueError as e:
                raise ValueError(f"tools: {e}") from None

    def parse(self, text: str) -> Action:
        return self.tool_parser.parse(text)


@register("agent", "answer")
class AnswerAgent(ConversationAgentBase):
    """Single-turn agent: the reply must hold ``<answer>...</answer>``; otherwise
    ``Action(answer=None, parse_error=...)``."""

    def parse(self, text: str) -> Action:
        return parse_answer_action(text)


def _schema(tool: Any) -> dict[str, Any]:
    if isinstance(tool, str):  # a registered tool name or package.module:Class, from config
        cls = resolve_tool(tool)  # its schema is class-level: nothing is started
        return {
            "type": "function",
            "function": {
                "name": cls.name,
                "description": cls.description,
                "parameters": cls.parameters,
            },
        }
    if hasattr(tool, "function_schema"):
        return tool.function_schema()
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if isinstance(function, Mapping) and isinstance(function.get("name"), str):
        return dict(tool)
    raise ValueError(
        f"tool {tool!r} is neither a raytunix Tool nor a JSON schema "
        '{"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}'
    )


def _renders_tools(
    template: ChatTemplate, schemas: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None
) -> bool:
    """Whether ``template`` shows tools to the model (its text changes when given them)."""
    key = (
        template.source,
        template.tool_use_source,
        json.dumps(schemas, sort_keys=True),
        json.dumps(template_kwargs, sort_keys=True) if template_kwargs else None,
    )
    if key not in _RENDERS_TOOLS:
        messages = [{"role": "user", "content": "Hello."}]
        kwargs = {**(template_kwargs or {}), "now": datetime.datetime.now()}
        plain = template.render(messages, add_generation_prompt=True, **kwargs)
        _RENDERS_TOOLS[key] = (
            template.render(messages, add_generation_prompt=True, tools=schemas, **kwargs) != plain
        )
    return _RENDERS_TOOLS[key]


_RENDERS_TOOLS: dict[tuple, bool] = {}
