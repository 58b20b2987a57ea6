"""Tool errors are typed and counted under one key by every layer: the tool reports its
kind, the environment counts each step's errors by kind, the episode sums them into the
trajectory. Nothing the model writes into a tool call can crash the environment."""

from __future__ import annotations

import time

import pytest

from raytunix.agents.parsers import parse_action
from raytunix.envs import CalculatorMathEnv
from raytunix.tools import Calculator, Tool, ToolError
from raytunix.types import TOOL_ERRORS_KEY, EpisodeStatus, Task, ToolErrorKind

TASK = Task("t", "Calculate 12 + 30.", "42")


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


@pytest.mark.parametrize(
    "arguments",
    [
        '{"self": 1}',
        '{"self": 1, "expression": "1 + 1"}',
        '{"run": "x"}',
        '{"arguments": {}}',
        '{"__class__": 2}',
    ],
)
def test_a_tool_argument_named_like_a_python_parameter_is_a_tool_error_not_a_crash(arguments):
    env = CalculatorMathEnv()
    env.reset(TASK)
    step = env.step(parse_action(call("calculator", arguments)))
    assert step.status is None and not step.done  # not an env_error
    assert step.info[TOOL_ERRORS_KEY] == {"bad_arguments": 1}
    assert step.observation.startswith("error: calculator: unknown argument")


class EchoSelf(Tool):
    """A tool whose schema really has a parameter named ``self``."""

    name = "echo"
    description = "Echoes its argument."
    parameters = {
        "type": "object",
        "properties": {"self": {"type": "string"}},
        "required": ["self"],
    }

    def run(self, /, **arguments):
        return arguments["self"]


def test_a_tool_may_even_declare_a_parameter_named_self():
    assert EchoSelf()(self="hi").output == "hi"
    assert Calculator()(expression="2 * 3").output == "6"


class Sleepy(Tool):
    name = "sleepy"
    description = "Sleeps for the given seconds."
    parameters = {
        "type": "object",
        "properties": {"seconds": {"type": "number"}},
        "required": ["seconds"],
    }

    def run(self, /, seconds):
        time.sleep(seconds)
        return "awake"


class Buggy(Tool):
    name = "buggy"
    description = "Has a bug."
    parameters = {"type": "object", "properties": {}}

    def run(self, /):
        return {}["missing"]


class Refuses(Tool):
    name = "refuses"
    description = "Refuses its input."
    parameters = {"type": "object", "properties": {}}

    def run(self, /):
        raise ToolError("cannot do that")


@pytest.mark.parametrize(
    "text, kind",
    [
        (call("calculator", '{"expression": "1 / 0"}'), "tool_exception"),
        (call("refuses", "{}"), "tool_exception"),
        (call("buggy", "{}"), "tool_exception"),
        (call("sleepy", '{"seconds": 0.5}'), "timeout"),
        (call("sleepy", '{"seconds": "long"}'), "bad_arguments"),
        (call("nope", "{}"), "unknown_tool"),
        ('<tool_call>{"name" "calculator"}</tool_call>', "bad_json"),
        ('<tool_call>{"arguments": {}}</tool_call>', "bad_json"),
        ("no tags at all", "format"),
    ],
)
def test_each_kind_of_tool_error_is_counted_under_its_kind(text, kind):
    env = CalculatorMathEnv(tools=[Calculator(), Sleepy(), Buggy(), Refuses()], tool_timeout_s=0.05)
    env.reset(TASK)
    step = env.step(parse_action(text))
    assert step.info[TOOL_ERRORS_KEY] == {kind: 1}
    assert step.observation.startswith("error: ") and not step.done


def test_errors_of_several_calls_in_one_turn_are_counted_per_call():
    env = CalculatorMathEnv(max_tool_errors=5)
    env.reset(TASK)
    step = env.step(
        parse_action(
            call("calculator", '{"expression": "1 / 0"}')
            + call("calculator", '{"self": 0}')
            + call("calculator", '{"expression": "2 / 0"}')
            + call("python", "{}")
        )
    )
    assert step.info[TOOL_ERRORS_KEY] == {
        "tool_exception": 2,
        "bad_arguments": 1,
        "unknown_tool": 1,
    }


def test_the_tool_error_limit_ends_the_episode_as_the_policys_outcome():
    env = CalculatorMathEnv(max_tool_errors=1)
    env.reset(TASK)
    assert not env.step(parse_action("garbage")).done
    step = env.step(parse_action(call("calculator", '{"expression": "1 / 0"}')))
    assert (step.done, step.reward, step.status) == (True, 0.0, EpisodeStatus.TOOL_ERROR_LIMIT)


def test_tool_timeout_must_be_positive():
    with pytest.raises(ValueError, match="tool_timeout_s"):
        CalculatorMathEnv(tool_timeout_s=0)
    assert ToolErrorKind("timeout") is ToolErrorKind.TIMEOUT


# -- counted per trajectory ----------------------------------------------------------------

import asyncio  # noqa: E402

from raytunix.agents import ToolAgent  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout.env_pool import LocalEnv  # noqa: E402
from raytunix.rollout.episode import run_episode  # noqa: E402
from raytunix.types import FinishReason, GenerationResult, SamplingParams  # noqa: E402

TOK = Tokenizer.byte_level()


class ScriptedEngine:
    """Turn i replies ``replies[i]``."""

    def __init__(self, replies):
        self.replies = replies

    async def generate(self, req):
        ids = TOK.encode(self.replies[int(req.request_id.split("/")[-1])]) + [TOK.end_id]
        return GenerationResult(
            req.request_id, tuple(ids), (-0.1,) * len(ids), (0,) * len(ids), FinishReason.STOP
        )


def _episode(replies, max_tool_errors=5):
    return asyncio.run(
        run_episode(
            TASK,
            "g",
            ToolAgent(TOK),
            LocalEnv("calculator_math", {"max_tool_errors": max_tool_errors}),
            ScriptedEngine(replies),
            SamplingParams(max_new_tokens=96),
            max_turns=len(replies),
            max_context_tokens=2048,
            seed=0,
            timeout_s=10,
        )
    )


def test_parse_errors_are_counted():
    traj = _episode(
        [
            '<tool_call>{"name" "calculator"}</tool_call>',  # missing colon
            '<tool_call>{"arguments": {}}</tool_call>',  # no name
            "<answer>42</answer>",
        ]
    )
    assert traj.status.value == "completed" and traj.num_turns == 3
    assert traj.metrics["tool_errors"] == 2
    assert traj.metrics["tool_errors/bad_json"] == 2


def test_every_kind_is_summed_into_the_trajectory_under_one_key():
    traj = _episode(
        [
            call("calculator", '{"self": 1}'),
            call("calculator", '{"expression": "1 / 0"}') + call("abacus", "{}"),
            "I think it is 42",
            call("calculator", '{"expression": "12 + 30"}'),
            "<answer>42</answer>",
        ]
    )
    assert traj.status == EpisodeStatus.COMPLETED and traj.reward == 1.0
    assert traj.metrics[TOOL_ERRORS_KEY] == 4
    assert {k: v for k, v in traj.metrics.items() if k.startswith(f"{TOOL_ERRORS_KEY}/")} == {
        "tool_errors/bad_arguments": 1,
        "tool_errors/tool_exception": 1,
        "tool_errors/unknown_tool": 1,
        "tool_errors/format": 1,
    }


def test_a_self_argument_in_an_episode_costs_a_tool_error_not_the_episode():
    traj = _episode(
        [
            call("calculator", '{"self": "x", "expression": "12 + 30"}'),
            call("calculator", '{"expression": "12 + 30"}'),
            "<answer>42</answer>",
        ]
    )
    assert traj.status == EpisodeStatus.COMPLETED and traj.reward == 1.0
    assert traj.metrics["tool_errors/bad_arguments"] == 1
