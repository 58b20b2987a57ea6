import pytest

from raytunix.agents import (
    AnswerAgent,
    ToolAgent,
    make_agent,
    parse_action,
    parse_answer,
    parse_tool_calls,
)
from raytunix.models.chat_template import render_chat
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import (
    EpisodeStatus,
    FinishReason,
    GenerationResult,
    SamplingParams,
    Task,
    ToolCall,
)

TASK = Task(task_id="t0", question="Calculate 95 - 21.", answer="74")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "95 - 21"}}</tool_call>'
MESSAGES = [
    {"role": "user", "content": TASK.question},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "74"},
    {"role": "assistant", "content": "<answer>74</answer>"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.byte_level()


def generation(tokenizer, text, version=3, logprob=-0.25, finish_reason=FinishReason.STOP):
    ids = tuple(tokenizer.encode(text))
    return GenerationResult(
        request_id="r",
        token_ids=ids,
        logprobs=(logprob,) * len(ids),
        policy_versions=(version,) * len(ids),
        finish_reason=finish_reason,
        text=text,
    )


# -- token exactness -------------------------------------------------------------------


def test_tokens_are_prompt_plus_generations_plus_observations(tokenizer):
    agent = ToolAgent(tokenizer)
    agent.reset(TASK, TASK.question)
    prompt = tokenizer.encode(f"<|user|>{TASK.question}<|end|><|assistant|>")
    request = agent.next_request("r0", SamplingParams(), seed=11)
    assert list(request.prompt_ids) == prompt
    assert request.seed == 11
    assert agent.end_id in request.sampling.stop_token_ids

    first = generation(tokenizer, CALL + "<|end|>", version=3, logprob=-0.5)
    action = agent.on_generation(first)
    assert action.tool_calls == (ToolCall("calculator", {"expression": "95 - 21"}),)
    agent.on_observation("74")
    observation = tokenizer.encode("<|tool|>74<|end|><|assistant|>")
    request = agent.next_request("r1", SamplingParams(), seed=12)
    assert list(request.prompt_ids) == prompt + list(first.token_ids) + observation

    second = generation(tokenizer, "<answer>74</answer><|end|>", version=4, logprob=-0.1)
    action = agent.on_generation(second)
    assert action.answer == "74" and action.parse_error is None

    trajectory = agent.to_trajectory("t0", "g0", 1.0, EpisodeStatus.COMPLETED, {"generate_s": 0.5})
    n0, n1, n2, n3 = len(prompt), len(first.token_ids), len(observation), len(second.token_ids)
    expected_ids = prompt + list(first.token_ids) + observation + list(second.token_ids)
    assert trajectory.token_ids == expected_ids
    assert trajectory.token_ids == tokenizer.encode(render_chat(MESSAGES))
    assert trajectory.loss_mask == [0] * n0 + [1] * n1 + [0] * n2 + [1] * n3
    assert trajectory.logprobs == [0.0] * n0 + [-0.5] * n1 + [0.0] * n2 + [-0.1] * n3
    assert trajectory.policy_versions == [-1] * n0 + [3] * n1 + [-1] * n2 + [4] * n3
    assert trajectory.num_turns == agent.num_turns == 2
    assert agent.num_generated_tokens == n1 + n3
    assert trajectory.reward == 1.0 and trajectory.status is EpisodeStatus.COMPLETED
    assert trajectory.metrics == {"generate_s": 0.5}


def test_system_prompt_comes_first(tokenizer):
    agent = ToolAgent(tokenizer, system_prompt="Use the calculator.")
    agent.reset(TASK, TASK.question)
    assert agent.token_ids == tokenizer.encode(
        f"<|system|>Use the calculator.<|end|><|user|>{TASK.question}<|end|><|assistant|>"
    )
    assert agent.loss_mask == [0] * len(agent.token_ids)


def test_demonstration_matches_episode_and_rendered_chat(tokenizer):
    episode = ToolAgent(tokenizer)
    episode.reset(TASK, MESSAGES[0]["content"])
    episode.on_generation(generation(tokenizer, MESSAGES[1]["content"] + "<|end|>"))
    episode.on_observation(MESSAGES[2]["content"])
    episode.on_generation(generation(tokenizer, MESSAGES[3]["content"] + "<|end|>"))

    token_ids, loss_mask = ToolAgent(tokenizer).render_demonstration(TASK, MESSAGES)
    assert token_ids == episode.token_ids
    assert loss_mask == episode.loss_mask
    assert token_ids == tokenizer.encode(render_chat(MESSAGES, add_generation_prompt=False))
    # Only assistant contents and their <|end|> are trained on.
    trained = [t for t, m in zip(token_ids, loss_mask) if m]
    assert tokenizer.decode(trained) == CALL + "<|end|>" + "<answer>74</answer><|end|>"


def test_demonstration_with_system_prompt_matches_rendered_chat(tokenizer):
    agent = AnswerAgent(tokenizer, system_prompt="Answer in <answer> tags.")
    messages = [MESSAGES[0], MESSAGES[3]]
    token_ids, _ = agent.render_demonstration(TASK, messages)
    system = [{"role": "system", "content": "Answer in <answer> tags."}]
    assert token_ids == tokenizer.encode(render_chat(system + messages))


@pytest.mark.parametrize("roles", [["user"], ["assistant", "user"], ["user", "assistant", "tool"]])
def test_demonstration_rejects_bad_roles(tokenizer, roles):
    with pytest.raises(ValueError, match="roles"):
        messages = [{"role": role, "content": "x"} for role in roles]
        ToolAgent(tokenizer).render_demonstration(TASK, messages)


def test_unfinished_generation_appends_nothing_extra(tokenizer):
    agent = ToolAgent(tokenizer)
    agent.reset(TASK, TASK.question)
    before = list(agent.token_ids)
    cut = generation(tokenizer, '<tool_call>{"name": "calc', finish_reason=FinishReason.LENGTH)
    action = agent.on_generation(cut)
    assert agent.token_ids == before + list(cut.token_ids)
    assert not agent.turn_finished
    assert action.parse_error is not None
    with pytest.raises(RuntimeError, match="truncate"):
        agent.on_observation("74")
    with pytest.raises(RuntimeError, match="truncate"):
        agent.next_request("r1", SamplingParams(), seed=0)
    trajectory = agent.to_trajectory("t0", "g0", 0.0, EpisodeStatus.TRUNCATED)
    assert trajectory.token_ids == before + list(cut.token_ids)


def test_calls_before_reset_raise(tokenizer):
    with pytest.raises(RuntimeError, match="reset"):
        ToolAgent(tokenizer).next_request("r", SamplingParams(), seed=0)


def test_mismatched_generation_lengths_raise(tokenizer):
    agent = ToolAgent(tokenizer)
    agent.reset(TASK, TASK.question)
    bad = GenerationResult("r", (1, 2), (0.0,), (1, 1), FinishReason.STOP)
    with pytest.raises(ValueError, match="logprobs"):
        agent.on_generation(bad)


def test_reset_starts_a_fresh_conversation(tokenizer):
    agent = ToolAgent(tokenizer)
    agent.reset(TASK, TASK.question)
    agent.on_generation(generation(tokenizer, "<answer>1</answer><|end|>"))
    agent.reset(TASK, TASK.question)
    assert agent.num_turns == 0 and agent.num_generated_tokens == 0
    assert agent.token_ids == tokenizer.encode(f"<|user|>{TASK.question}<|end|><|assistant|>")


# -- parsers ---------------------------------------------------------------------------


def test_parse_tool_calls_reads_every_call():
    second = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
    calls, error = parse_tool_calls(CALL + "\n" + second + "<|end|>")
    assert error is None
    assert [c.arguments["expression"] for c in calls] == ["95 - 21", "1 + 1"]
    assert parse_tool_calls("no calls here") == ([], None)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "calculator"}</tool_call>', '"arguments"'),
        ('<tool_call>{"name": "calculator", "arguments": "1 + 1"}</tool_call>', '"arguments"'),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {}}<|end|>', "unclosed"),
        (CALL + '<tool_call>{"name": 1, "arguments": {}}</tool_call>', '"name"'),
    ],
)
def test_malformed_tool_calls_give_an_error_not_an_exception(text, fragment):
    calls, error = parse_tool_calls(text)
    assert calls == []
    assert fragment in error
    action = parse_action(text)
    assert action.parse_error == error and action.tool_calls == () and action.answer is None


def test_parse_answer():
    assert parse_answer("so <answer> -1130 </answer><|end|>") == "-1130"
    assert parse_answer("<answer>1</answer><answer>2</answer>") is None  # two answers: none
    assert parse_answer("<answer>1") is None
    assert parse_answer("74") is None


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("I think it is 74<|end|>", "no <tool_call> or <answer> found"),
        ("<answer>74<|end|>", "unclosed <answer>"),
        (CALL + "<answer>74</answer>", "both"),
    ],
)
def test_tool_agent_parse_errors(tokenizer, text, fragment):
    action = ToolAgent(tokenizer).parse(text)
    assert fragment in action.parse_error
    assert action.answer is None and action.tool_calls == ()


def test_parsers_never_raise_on_garbage():
    garbage = [
        "",
        "<tool_call>",
        "</tool_call><tool_call>",
        "<answer></answer>",
        "<tool_call>null</tool_call>",
        '<tool_call>"x"</tool_call>',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 3,
    ]
    for text in garbage:
        parse_action(text)
        parse_tool_calls(text)
        parse_answer(text)


def test_answer_agent_only_reads_answers(tokenizer):
    agent = AnswerAgent(tokenizer)
    assert agent.parse("<answer>74</answer><|end|>").answer == "74"
    action = agent.parse(CALL + "<|end|>")
    assert action.answer is None and action.tool_calls == ()
    assert "<answer>" in action.parse_error


def test_make_agent(tokenizer):
    assert isinstance(make_agent("tool", tokenizer), ToolAgent)
    agent = make_agent("answer", tokenizer, system_prompt="hi")
    assert isinstance(agent, AnswerAgent) and agent.system_prompt == "hi"
    with pytest.raises(ValueError, match="unknown agent 'bash'; registered: answer, text, tool"):
        make_agent("bash", tokenizer)
