"""An agent whose every reply, whatever its text, is the action: for environments that
take free text (and for benchmarks driving a random-weight model)."""

from __future__ import annotations

from raytunix.agents.base import ConversationAgentBase
from raytunix.registry import register
from raytunix.types import Action, FinishReason, GenerationResult


@register("agent", "text")
class TextAgent(ConversationAgentBase):
    """Passes the model's text through as ``Action(text=text)``; never a parse error. The
    end-of-turn token that closes a reply is not part of the action (a text environment,
    e.g. a gymnasium one, gets what the model said, not the chat format's marker).

    Since any text is a whole action, a reply cut at ``max_new_tokens`` still ends the
    turn: the agent closes it with the end-of-turn token (``<|end|>`` in the raytunix
    format) as context (mask 0, not generated), so the conversation goes on with turns of
    exactly ``max_new_tokens`` tokens. An aborted generation stays unfinished.
    """

    def on_generation(self, result: GenerationResult) -> Action:
        action = super().on_generation(result)
        if not self.turn_finished and result.finish_reason == FinishReason.LENGTH:
            self._append_context(self._encoder.close_turn(result.token_ids, stopped=True))
            self._turn_finished = True
        return action

    def parse(self, text: str) -> Action:
        end = self.tokenizer.decode([self.end_id], skip_special_tokens=False)
        return Action(text=text[: -len(end)] if end and text.endswith(end) else text)
