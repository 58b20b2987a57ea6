"""Agents for the math environments: one that calls tools, one that only answers."""

from __future__ import annotations

from raytunix.agents.base import ConversationAgentBase
from raytunix.agents.parsers import parse_action, parse_answer_action
from raytunix.types import Action


class ToolAgent(ConversationAgentBase):
    """Multi-turn agent: each turn is either ``<tool_call>{json}</tool_call>`` (one or
    more) or a final ``<answer>...</answer>``; anything else is a parse error the
    environment answers with an error observation."""

    def parse(self, text: str) -> Action:
        return parse_action(text)


class AnswerAgent(ConversationAgentBase):
    """Single-turn agent: the reply must hold ``<answer>...</answer>``; otherwise
    ``Action(answer=None, parse_error=...)``."""

    def parse(self, text: str) -> Action:
        return parse_answer_action(text)
