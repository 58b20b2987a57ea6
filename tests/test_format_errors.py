"""A reply with more than one answer is a format error with reward 0, in training and in
evaluation alike: first-tag-wins would let a policy hedge between values."""

from __future__ import annotations

import asyncio

import pytest

from raytunix.agents import ToolAgent
from raytunix.agents.parsers import parse_action, parse_answer_action
from raytunix.data.answers import score_answer
from raytunix.envs import CalculatorMathEnv, MathVerifierEnv
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.env_pool import LocalEnv
from raytunix.rollout.orchestrator import RolloutOrchestrator
from raytunix.types import FinishReason, GenerationResult, SamplingParams, Task, ToolErrorKind

TOK = Tokenizer.byte_level()
TASK = Task("x", "q", "12")
HEDGES = [
    "<answer>12</answer><answer>13</answer>",
    "<answer>13</answer><answer>12</answer>",
    "<answer>12</answer> or maybe <answer>12</answer>",
]


@pytest.mark.parametrize("parse", [parse_action, parse_answer_action])
@pytest.mark.parametrize("reply", HEDGES)
def test_two_answer_tags_never_score(parse, reply):
    action = parse(reply)
    assert action.parse_error is not None and "exactly one answer" in action.parse_error
    assert action.parse_error_kind == ToolErrorKind.FORMAT
    assert score_answer(TASK, action.answer) == 0.0


@pytest.mark.parametrize("reply", HEDGES)
def test_both_environments_pay_nothing_for_several_answers(reply):
    verifier = MathVerifierEnv()
    verifier.reset(TASK)
    assert verifier.step(parse_answer_action(reply)).reward == 0.0
    tools = CalculatorMathEnv(max_tool_errors=0)
    tools.reset(TASK)
    step = tools.step(parse_action(reply))
    assert step.reward == 0.0 and step.info["tool_errors"] == {"format": 1}


class HedgingEngine:
    async def generate(self, request):
        ids = TOK.encode("<answer>12</answer><answer>13</answer>") + [TOK.end_id]
        return GenerationResult(
            request.request_id, tuple(ids), (0.0,) * len(ids), (0,) * len(ids), FinishReason.STOP
        )


def test_evaluation_scores_a_hedged_reply_as_wrong():
    async def main():
        orchestrator = RolloutOrchestrator(
            tasks=[TASK],
            agent_factory=lambda: ToolAgent(TOK),
            engine=HedgingEngine(),
            env_provider=lambda g: (
                LocalEnv("calculator_math", {"max_tool_errors": 0}),
                lambda: None,
            ),
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=2,
            max_staleness=0,
            max_turns=2,
            max_context_tokens=512,
            sampling=SamplingParams(max_new_tokens=64),
        )
        return await orchestrator.evaluate([TASK, TASK], max_new_tokens=64)

    result = asyncio.run(main())
    assert result["success_rate"] == 0.0
    assert result["statuses"] == {"tool_error_limit": 2}


def test_one_answer_still_scores():
    action = parse_action("<answer> 12 </answer>")
    assert action.parse_error is None and score_answer(TASK, action.answer) == 1.0
