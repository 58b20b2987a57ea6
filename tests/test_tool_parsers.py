"""Tool-call parsers on malformed and adversarial model output.

Every reply goes through its parser and then through the calculator environment, as in an
episode: the observation the model gets back and the tool-error kind counted for it are
what a user cares about. None of these replies may raise.
"""

from __future__ import annotations

import random

import pytest

from raytunix.agents.parsers import TOOL_PARSERS, make_tool_parser
from raytunix.envs import CalculatorMathEnv
from raytunix.tools import Calculator
from raytunix.types import TOOL_ERRORS_KEY, Action, Task, ToolCall, ToolErrorKind

TASK = Task("t", "Calculate 95 - 21 * 3.", "32")
OK = '{"name": "calculator", "arguments": {"expression": "95 - 21 * 3"}}'
K = ToolErrorKind

# (parser, model reply, expected kind or None, a fragment of the observation)
CASES = [
    # -- Hermes / Qwen <tool_call> JSON ---------------------------------------------------
    ("hermes", f"<tool_call>{OK}</tool_call><|im_end|>", None, "32"),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}</tool_call>',
        K.BAD_JSON,
        "not valid JSON",
    ),
    ("hermes", f"<tool_call><tool_call>{OK}</tool_call></tool_call>", K.BAD_JSON, "not valid JSON"),
    (
        "hermes",
        '<tool_call>{"name": "calculater", "arguments": {"expression": "1"}}</tool_call>',
        K.UNKNOWN_TOOL,
        "unknown tool 'calculater'",
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>',
        K.BAD_ARGUMENTS,
        "'expression' must be a string",
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
        K.BAD_ARGUMENTS,
        "unknown argument(s) ['expr']",
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "２＋２"}}</tool_call>',
        K.TOOL_EXCEPTION,
        "unsupported character",
    ),
    (
        "hermes",
        '<tool_call>{"name": "计算器", "arguments": {}}</tool_call>',
        K.UNKNOWN_TOOL,
        "unknown tool '计算器'",
    ),
    ("hermes", '<tool_call>{"name": "calculator", "argu', K.BAD_JSON, "unclosed <tool_call>"),
    ("hermes", f"```\n<tool_call>{OK}</tool_call>\n```", None, "32"),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": {"expression": 1e999}}</tool_call>',
        K.BAD_JSON,
        "too large for a float",
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": {"expression": '
        + "9" * 5000
        + "}}</tool_call>",
        K.BAD_JSON,
        "not valid JSON",
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": {"expression": NaN}}</tool_call>',
        K.BAD_JSON,
        "NaN is not a JSON number",
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": ' + "[" * 100_000 + "</tool_call>",
        K.BAD_JSON,
        "nested too deeply",
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "\\ud800"}}</tool_call>',
        K.BAD_JSON,
        "lone UTF-16 surrogate",
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": "95 - 21"}</tool_call>',
        K.BAD_JSON,
        'needs an object "arguments"',
    ),
    ("hermes", f"<tool_call>{OK}</tool_call><answer>32</answer>", K.FORMAT, "found both"),
    ("hermes", "<answer>32</answer> or maybe <answer>31</answer>", K.FORMAT, "give exactly one"),
    ("hermes", "", K.FORMAT, "no <tool_call> or <answer> found"),
    # -- Llama 3 JSON ---------------------------------------------------------------------
    (
        "llama3_json",
        '{"name": "calculator", "parameters": {"expression": "95 - 21 * 3"}}<|eot_id|>',
        None,
        "32",
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}<|eom_id|>',
        None,
        "6",
    ),
    (
        "llama3_json",
        '<|python_tag|>brave_search.call(query="x")',
        K.BAD_JSON,
        "must be followed by a JSON call",
    ),
    (
        "llama3_json",
        '```json\n{"name": "calculator", "parameters": {"expression": "1"}}\n```',
        K.FORMAT,
        "must be the whole reply",
    ),
    (
        "llama3_json",
        '{"name": "calculator", "parameters": {"expression": "1"}} so it is 1',
        K.FORMAT,
        "text after the tool call",
    ),
    (
        "llama3_json",
        '{"name": "calculator", "parameters": {"expression": "1"}}; '
        '{"name": "calculator", "parameters": {"expression": "2 * 4"}}',
        None,
        "1\n8",
    ),
    (
        "llama3_json",
        '{"name": "calculator", "parameters": {"expression": "1 +',
        K.BAD_JSON,
        "not valid JSON",
    ),
    ("llama3_json", '{"name": ["calculator"], "parameters": {}}', K.BAD_JSON, 'a string "name"'),
    # -- Gemma [f(a=1)] -------------------------------------------------------------------
    ("gemma", '[calculator(expression="95 - 21 * 3")]<end_of_turn>', None, "32"),
    ("gemma", '```tool_code\n[calculator(expression="2 * 3")]\n```', None, "6"),
    ("gemma", '[calculator("95 - 21 * 3")]', K.BAD_ARGUMENTS, "passes arguments by position"),
    ("gemma", "[calculator(expression=x)]", K.BAD_JSON, "must be a literal value"),
    ("gemma", '[calculator(expression="1"]', K.BAD_JSON, "function call list is not valid"),
    ("gemma", 'Sure! [calculator(expression="1")]', K.FORMAT, "must be the whole reply"),
    (
        "gemma",
        "[__import__('os').system('touch /tmp/pwned')]",
        K.BAD_JSON,
        "is not a function call",
    ),
    ("gemma", "[calculator(expression=1e999)]", K.BAD_JSON, "not a finite number"),
    (
        "gemma",
        '[calculator(expression="1"), search(q="x")]',
        K.UNKNOWN_TOOL,
        "unknown tool 'search'",
    ),
    # -- ReAct ------------------------------------------------------------------------------
    (
        "react",
        'Thought: multiply first\nAction: calculator\nAction Input: {"expression": "95 - 21 * 3"}',
        None,
        "32",
    ),
    (
        "react",
        'Action: calculator\nAction Input: {"expression": "1"}\nObservation: 999\n'
        "Final Answer: 999",
        None,
        "1",
    ),
    (
        "react",
        'Action: calculator\nAction Input: {"expression": "1"}\nAction: calculator\n'
        'Action Input: {"expression": "2"}',
        K.FORMAT,
        "found 2 Action lines",
    ),
    ("react", "Thought: hmm\nAction: calculator", K.BAD_JSON, "no 'Action Input:' line"),
    ("react", "Action: calculator\nAction Input: 95 - 21 * 3", K.BAD_JSON, "not a JSON object"),
    ("react", 'Action:\nAction Input: {"expression": "1"}', K.BAD_JSON, "needs a tool name"),
    (
        "react",
        'Action: calculator\nAction Input: {"expression": "1"}\nFinal Answer: 1',
        K.FORMAT,
        "found both",
    ),
    ("react", "Thought: done\nFinal Answer:<|im_end|>", K.FORMAT, "is empty"),
]


def _step(action: Action):
    env = CalculatorMathEnv(max_tool_errors=10, tools=[Calculator()])
    env.reset(TASK)
    return env.step(action)


@pytest.mark.parametrize(
    "parser, reply, kind, fragment", CASES, ids=[f"{i}-{case[0]}" for i, case in enumerate(CASES)]
)
def test_each_reply_gets_the_right_observation_and_error_kind(parser, reply, kind, fragment):
    action = make_tool_parser(parser).parse(reply)
    step = _step(action)
    assert not step.done
    assert fragment in step.observation
    errors = step.info[TOOL_ERRORS_KEY]
    if kind is None:
        assert errors == {} and action.tool_calls and action.parse_error is None
    else:
        assert errors.get(kind.value) == 1, errors
        assert step.observation.startswith("error:") or "\nerror:" in step.observation


def test_there_are_at_least_twenty_malformed_cases():
    assert sum(kind is not None for _, _, kind, _ in CASES) >= 20


@pytest.mark.parametrize(
    "parser, reply, answer",
    [
        ("hermes", "<answer>32</answer><|im_end|>", "32"),
        ("llama3_json", "The result is <answer>32</answer><|eot_id|>", "32"),
        ("gemma", "<answer> 32 </answer><end_of_turn>", "32"),
        ("react", "Thought: I know it\nFinal Answer: 32<|im_end|>", "32"),
    ],
)
def test_final_answers_end_the_episode_with_a_reward(parser, reply, answer):
    action = make_tool_parser(parser).parse(reply)
    assert action.answer == answer and action.parse_error is None
    step = _step(action)
    assert step.done and step.reward == 1.0


def test_several_calls_in_one_reply_are_all_run():
    reply = (
        '[calculator(expression="95 - 21 * 3"), calculator(expression="2 * 3"), '
        'calculator(expression="1 / 0")]'
    )
    action = make_tool_parser("gemma").parse(reply)
    assert action.tool_calls == (
        ToolCall("calculator", {"expression": "95 - 21 * 3"}),
        ToolCall("calculator", {"expression": "2 * 3"}),
        ToolCall("calculator", {"expression": "1 / 0"}),
    )
    step = _step(action)
    assert step.observation.splitlines()[:2] == ["32", "6"]
    assert "division by zero" in step.observation
    assert step.info[TOOL_ERRORS_KEY] == {"tool_exception": 1}


def test_gemma_reads_literal_values_of_every_json_type():
    action = make_tool_parser("gemma").parse(
        "[f(s='x', i=-3, x=2.5, b=True, n=None, l=[1, 'a'], d={'k': {'v': 1}})]"
    )
    assert action.tool_calls == (
        ToolCall(
            "f",
            {
                "s": "x",
                "i": -3,
                "x": 2.5,
                "b": True,
                "n": None,
                "l": [1, "a"],
                "d": {"k": {"v": 1}},
            },
        ),
    )


def test_the_hermes_parser_is_exactly_the_default_parse_action():
    from raytunix.agents.parsers import parse_action

    for reply, _kind, _fragment in [(r, k, f) for p, r, k, f in CASES if p == "hermes"]:
        assert make_tool_parser("hermes").parse(reply) == parse_action(reply)


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="'xml'.*hermes, qwen, llama3_json, gemma, react"):
        make_tool_parser("xml")


@pytest.mark.parametrize("parser", list(TOOL_PARSERS))
def test_no_parser_raises_on_random_fragments(parser):
    fragments = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        "[",
        "]",
        "(",
        ")",
        '"name"',
        ":",
        '"arguments"',
        '"parameters"',
        "calculator",
        "=",
        ",",
        "Action:",
        "Action Input:",
        "Final Answer:",
        "Observation:",
        "<answer>",
        "</answer>",
        "<|python_tag|>",
        "```",
        "tool_code",
        "\n",
        " ",
        "1e999",
        "NaN",
        "'",
        "\\u",
        "ü",
        "\ud800",
        ";",
        "**",
        "lambda",
        "__class__",
        "<|im_end|>",
        "<end_of_turn>",
    ]
    rng = random.Random(parser)
    p = make_tool_parser(parser)
    for _ in range(3000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        action = p.parse(text)
        meaningful = [
            bool(action.tool_calls),
            action.answer is not None,
            action.parse_error is not None,
        ]
        assert sum(meaningful) == 1, (text, action)
        if action.parse_error is not None:
            assert action.parse_error_kind is not None
