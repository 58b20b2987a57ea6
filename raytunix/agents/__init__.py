"""Agents: conversation state as exact tokens, and parsers from model text to actions."""

from __future__ import annotations

from typing import Any

from raytunix.agents.base import ConversationAgentBase
from raytunix.agents.parsers import (
    parse_action,
    parse_answer,
    parse_answer_action,
    parse_tool_calls,
)
from raytunix.agents.text_agent import TextAgent
from raytunix.agents.tool_agent import AnswerAgent, ToolAgent

AGENTS: dict[str, type[ConversationAgentBase]] = {
    "tool": ToolAgent,
    "answer": AnswerAgent,
    "text": TextAgent,
}


def make_agent(
    name: str, tokenizer: Any, system_prompt: str | None = None
) -> ConversationAgentBase:
    """Builds the agent registered as ``name`` ("tool", "answer" or "text").

    Raises:
      ValueError: ``name`` is not registered (the message lists the valid names).
    """
    try:
        cls = AGENTS[name]
    except KeyError:
        raise ValueError(f"unknown agent {name!r}; valid names: {sorted(AGENTS)}") from None
    return cls(tokenizer, system_prompt=system_prompt)


__all__ = [
    "AGENTS",
    "AnswerAgent",
    "ConversationAgentBase",
    "TextAgent",
    "ToolAgent",
    "make_agent",
    "parse_action",
    "parse_answer",
    "parse_answer_action",
    "parse_tool_calls",
]
