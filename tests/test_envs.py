import json

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from raytunix.agents import AGENTS, ToolAgent, parse_action
from raytunix.data import make_arithmetic_splits
from raytunix.envs import ENVS, BaseEnv, CalculatorMathEnv, GymTextEnv, MathVerifierEnv, make_env
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import (
    Action,
    EpisodeStatus,
    FinishReason,
    GenerationResult,
    SamplingParams,
    StepResult,
    Task,
)

TASK = Task(task_id="t0", question="Calculate 95 - 21.", answer="74")  # no entry: numeric check


def call(expression, name="calculator"):
    payload = json.dumps({"name": name, "arguments": {"expression": expression}})
    return f"<tool_call>{payload}</tool_call>"


@pytest.fixture(scope="module")
def tasks():
    return make_arithmetic_splits(20, 5, seed=3)[0]


def test_tool_call_then_correct_answer(tasks):
    env = CalculatorMathEnv()
    task = tasks[0]
    assert env.reset(task) == task.question
    step = env.step(parse_action(call(task.metadata["expression"])))
    assert step == StepResult(observation=task.answer, info=step.info)
    assert not step.done and step.info["tool_errors"] == {} and step.info["tool_latency_s"] >= 0
    step = env.step(parse_action(f"<answer>{task.answer}</answer>"))
    assert (step.done, step.reward, step.status) == (True, 1.0, EpisodeStatus.COMPLETED)
    assert step.info["correct"]


def test_wrong_answer_scores_zero(tasks):
    env = CalculatorMathEnv()
    env.reset(tasks[0])
    step = env.step(parse_action(f"<answer>-{tasks[0].answer}1</answer>"))
    assert (step.done, step.reward, step.status) == (True, 0.0, EpisodeStatus.COMPLETED)


def test_numeric_comparison_without_reasoning_gym_entry():
    env = CalculatorMathEnv()
    env.reset(TASK)
    assert env.step(Action(text="", answer="74.0")).reward == 1.0
    env.reset(TASK)
    assert env.step(Action(text="", answer="-74")).reward == 0.0


def test_several_calls_give_one_line_each():
    env = CalculatorMathEnv()
    env.reset(TASK)
    step = env.step(parse_action(call("95 - 21") + call("1 / 0") + call("2 * 3")))
    assert step.observation == "74\nerror: division by zero in '1 / 0'\n6"
    assert step.info["tool_errors"] == {"tool_exception": 1} and not step.done


@pytest.mark.parametrize(
    "text, fragment, kind",
    [
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
            "not valid JSON",
            "bad_json",
        ),
        ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', '"name"', "bad_json"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}',
            "unclosed",
            "bad_json",
        ),
        (call("1 + 1", name="python"), "unknown tool 'python'", "unknown_tool"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
            "unknown argument",
            "bad_arguments",
        ),
        ("the answer is 74", "no <tool_call> or <answer> found", "format"),
        ("<answer>74</answer><answer>75</answer>", "give exactly one answer", "format"),
    ],
)
def test_malformed_calls_become_error_observations_counted_by_kind(text, fragment, kind):
    env = CalculatorMathEnv()
    env.reset(TASK)
    step = env.step(parse_action(text))
    assert step.observation.startswith("error: ") and fragment in step.observation
    assert not step.done and step.info["tool_errors"] == {kind: 1}


def test_tool_error_limit_ends_the_episode():
    env = make_env("calculator_math", max_tool_errors=2)
    env.reset(TASK)
    for _ in range(2):
        step = env.step(parse_action(call("1 / 0")))
        assert not step.done and step.info["tool_errors"] == {"tool_exception": 1}
    step = env.step(parse_action("garbage"))
    assert (step.done, step.reward, step.status) == (True, 0.0, EpisodeStatus.TOOL_ERROR_LIMIT)
    assert step.info["tool_errors"] == {"format": 1}
    env.reset(TASK)  # the count starts over with each episode
    assert not env.step(parse_action(call("1 / 0"))).done
    assert not env.step(parse_action(call("1 / 0"))).done


class ExplodingEnv(BaseEnv):
    default_agent = "tool"

    def _initial_observation(self, task):
        return task.question

    def _step_impl(self, action):
        raise ZeroDivisionError("boom")


def test_a_raising_step_ends_the_episode_with_env_error():
    env = ExplodingEnv()
    env.reset(TASK)
    step = env.step(Action(text="x"))
    assert (step.done, step.reward, step.status) == (True, 0.0, EpisodeStatus.ENV_ERROR)
    assert step.info["error"] == "ZeroDivisionError('boom')" and "boom" in step.info["traceback"]


def test_step_without_a_running_episode_is_an_env_error():
    env = MathVerifierEnv()
    assert env.step(Action(text="", answer="74")).status is EpisodeStatus.ENV_ERROR
    env.reset(TASK)
    assert env.step(Action(text="", answer="74")).status is EpisodeStatus.COMPLETED
    assert env.step(Action(text="", answer="74")).status is EpisodeStatus.ENV_ERROR


def test_math_verifier_is_single_turn(tasks):
    env = make_env("math_verifier")
    env.reset(tasks[1])
    step = env.step(Action(text="", answer=tasks[1].answer))
    assert (step.done, step.reward, step.status) == (True, 1.0, EpisodeStatus.COMPLETED)
    env.reset(tasks[1])
    step = env.step(Action(text="hmm", parse_error="no <answer> found"))
    assert (step.done, step.reward, step.status) == (True, 0.0, EpisodeStatus.COMPLETED)
    assert step.info["parse_error"] == "no <answer> found"


def test_registry_names_and_default_agents():
    assert {"calculator_math", "gymnasium", "math_verifier", "simulated_tool"} <= set(ENVS)
    assert make_env("calculator_math").default_agent == "tool"
    assert make_env("math_verifier").default_agent == "answer"
    assert all(cls.default_agent in AGENTS for cls in ENVS.values())
    with pytest.raises(ValueError, match="calculator_math"):
        make_env("bash")


def test_episode_with_agent_and_env(tasks):
    """The docstring loop of raytunix.types, with scripted generations."""
    tokenizer = Tokenizer.byte_level()
    task = tasks[2]
    replies = [
        call(task.metadata["expression"]) + "<|end|>",
        f"<answer>{task.answer}</answer><|end|>",
    ]
    env, agent = CalculatorMathEnv(), ToolAgent(tokenizer)
    agent.reset(task, env.reset(task))
    for turn, reply in enumerate(replies):
        request = agent.next_request(f"r{turn}", SamplingParams(), seed=turn)
        ids = tuple(tokenizer.encode(reply))
        assert ids[-1] in request.sampling.stop_token_ids
        result = GenerationResult(
            request.request_id, ids, (-1.0,) * len(ids), (0,) * len(ids), FinishReason.STOP
        )
        action = agent.on_generation(result)
        step = env.step(action)
        if step.done:
            break
        agent.on_observation(step.observation)
    trajectory = agent.to_trajectory(task.task_id, "g", step.reward, step.status)
    assert (trajectory.reward, trajectory.num_turns) == (1.0, 2)
    assert tokenizer.decode(trajectory.token_ids) == (
        f"<|user|>{task.question}<|end|><|assistant|>{replies[0]}<|tool|>{task.answer}<|end|>"
        f"<|assistant|>{replies[1]}"
    )


# -- gymnasium adapter ------------------------------------------------------------------


def test_gym_adapter_passes_gymnasium_checks(tasks):
    env = GymTextEnv(CalculatorMathEnv(), tasks)
    check_env(env, skip_render_check=True)


def test_gym_adapter_episode(tasks):
    env = GymTextEnv(CalculatorMathEnv(max_tool_errors=0), tasks)
    assert isinstance(env, gymnasium.Env)
    observation, info = env.reset(seed=0, options={"task": tasks[4]})
    assert observation == tasks[4].question and info == {"task_id": tasks[4].task_id}
    assert env.observation_space.contains(observation)
    task = tasks[4]
    observation, reward, terminated, truncated, info = env.step(call(task.metadata["expression"]))
    assert (observation, reward, terminated, truncated) == (tasks[4].answer, 0.0, False, False)
    observation, reward, terminated, truncated, info = env.step(f"<answer>{task.answer}</answer>")
    assert (reward, terminated, truncated, info["status"]) == (1.0, True, False, "completed")
    env.reset(seed=1)
    _, reward, terminated, _, info = env.step("not a call")
    assert (reward, terminated, info["status"]) == (0.0, True, "tool_error_limit")


def test_gym_adapter_draws_tasks_reproducibly(tasks):
    env = GymTextEnv(MathVerifierEnv(), tasks)
    first = [env.reset(seed=5)[1]["task_id"]] + [env.reset()[1]["task_id"] for _ in range(4)]
    again = [env.reset(seed=5)[1]["task_id"]] + [env.reset()[1]["task_id"] for _ in range(4)]
    assert first == again
    with pytest.raises(ValueError, match="task"):
        GymTextEnv(MathVerifierEnv(), [])
