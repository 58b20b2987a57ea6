"""Scripted policies that try to earn reward without solving the task, in each environment
that decides its reward in its own process (text_to_sql, web_api, calculator_math,
math_verifier, reasoning_gym, simulated_tool): every such try earns nothing, and the
honest solution, as a control, earns full reward.

The replies go through the agents' parsers (``raytunix.agents.parsers``) where the way
a reply is written is the trick (several answers, tags in odd places), as in a run."""

from __future__ import annotations

import json

import pytest

from raytunix.agents.parsers import ReActParser, parse_action, parse_answer_action
from raytunix.envs import make_env
from raytunix.envs.sql_env import TEMPLATES, TextToSQLEnv, run_query
from raytunix.envs.web_api_env import WebAPIEnv
from raytunix.types import Action, Task, ToolCall


def _call(name: str, **arguments) -> Action:
    return Action(text="", tool_calls=(ToolCall(name, arguments),))


def _reward(env, task: Task, action: Action) -> float:
    env.reset(task)
    return env.step(action).reward


def _sql_literal(value) -> str:
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return "NULL" if value is None else repr(value)


# --- text_to_sql -----------------------------------------------------------------------


def _sql_forgeries(task: Task, rows: list[tuple]) -> dict[str, str]:
    """Answers built from the result the model can see through the tool, not from a query
    that computes it; each would match on the task's database alone."""
    literal = (
        " UNION ALL ".join("SELECT " + ", ".join(_sql_literal(v) for v in row) for row in rows)
        or "SELECT 1 WHERE 0"
    )
    first = rows[0] if rows else (None,)
    return {
        "literal": literal,
        "literal_with_from": literal + " FROM customers LIMIT 1" if len(rows) == 1 else literal,
        # Detects the instance it runs on and answers the seen values only there.
        "instance_switch": (
            f"SELECT * FROM ({literal}) WHERE (SELECT COUNT(*) FROM orders) = 300"
            f" UNION ALL SELECT * FROM (SELECT {', '.join(['NULL'] * len(first))})"
            " WHERE (SELECT COUNT(*) FROM orders) <> 300"
        ),
        "values_clause": "VALUES "
        + ", ".join("(" + ", ".join(_sql_literal(v) for v in row) + ")" for row in rows)
        if rows
        else literal,
    }


def test_sql_answers_that_write_down_seen_values_earn_nothing_and_queries_earn_one():
    env = TextToSQLEnv(max_tool_errors=10)
    tasks = env.tasks("train", 120, seed=5) + env.tasks("heldout", 30, seed=5)
    assert {t.metadata["template"] for t in tasks} == set(TEMPLATES)
    for task in tasks:
        env.reset(task)
        seen = env.step(_call("sql", query=task.answer))  # what the tool shows the model
        assert not seen.info.get("tool_errors"), seen
        _, rows = run_query(env.db_path, task.answer)
        for name, forged in _sql_forgeries(task, rows).items():
            step = (env.reset(task), env.step(Action(text="", answer=forged)))[1]
            assert step.reward == 0.0, (name, forged, task.question, step.info)
        assert _reward(env, task, Action(text="", answer=task.answer)) == 1.0, task
        equivalent = f"SELECT * FROM ({task.answer})"
        if task.metadata["ordered"]:
            equivalent = task.answer  # a subquery's order is not kept
        assert _reward(env, task, Action(text="", answer=equivalent)) == 1.0, task


def test_sql_shortcuts_true_only_of_the_tasks_rows_earn_nothing():
    env = TextToSQLEnv()
    tasks = {t.metadata["template"]: t for t in env.tasks("train", 120, seed=1)}
    never = tasks["never_ordered"]
    # The task's database leaves its last three customers without orders; a query that
    # knows that, instead of reading the orders, is right there only.
    _, rows = run_query(env.db_path, never.answer)
    shortcut = "SELECT name FROM customers WHERE id > 37"
    assert sorted(run_query(env.db_path, shortcut)[1]) == sorted(rows)
    assert _reward(env, never, Action(text="", answer=shortcut)) == 0.0
    ranked = tasks["most_expensive"]
    names = [r[0] for r in run_query(env.db_path, ranked.answer)[1]]
    by_name = (
        "SELECT name FROM products WHERE name IN ("
        + ", ".join(map(_sql_literal, names))
        + ") ORDER BY price DESC"
    )
    assert [r[0] for r in run_query(env.db_path, by_name)[1]] == names
    assert _reward(env, ranked, Action(text="", answer=by_name)) == 0.0
    for bad in ("", "   ", "SELECT zeroblob(10)", "DELETE FROM orders", "SELECT 1; SELECT 2"):
        assert _reward(env, ranked, Action(text="", answer=bad)) == 0.0, bad


# --- web_api ---------------------------------------------------------------------------


def test_web_api_answers_without_the_apis_prices_earn_nothing():
    env = WebAPIEnv(catalogue_seed=3, max_tool_errors=20)
    task = env.tasks("train", 1, seed=4)[0]
    quantities = list(task.metadata["items"].values())
    total = float(task.answer)
    forged = [
        "",
        " ",
        "0",
        str(sum(quantities)),
        str(quantities[0]),  # numbers the prompt holds
        f"{total - 0.01:.2f}",
        f"{total + 1:.2f}",
        f"{total - 1:.2f} or {task.answer}",
        f"{task.answer}, {total + 1:.2f}",
        f"\\{{{total - 1:.2f}, {task.answer}\\}}",
        f"[{total - 1:.2f}, {total + 1:.2f}]",
        " ".join(f"{c / 100:.2f}" for c in range(0, 40000, 7)),  # very long: many numbers
        f"\\boxed{{{task.answer}}}\\boxed{{{total + 1:.2f}}}",
    ]
    for text in forged:
        action = parse_action(f"<answer>{text}</answer>")
        assert _reward(env, task, action) == 0.0, text
    hedged = parse_action(f"<answer>{total - 1:.2f}</answer> <answer>{task.answer}</answer>")
    assert hedged.parse_error and _reward(env, task, hedged) == 0.0
    in_call = parse_action(
        '<tool_call>{"name": "http_get", "arguments": {"path": '
        f'"/items", "answer": "<answer>{task.answer}</answer>"}}}}</tool_call>'
    )
    assert in_call.parse_error and _reward(env, task, in_call) == 0.0
    # No endpoint knows the question: none gives a total, whatever the path.
    env.reset(task)
    for path in (
        "/total",
        "/items?total=1",
        "/items/../total",
        "/answer",
        "/items?name=total",
        "//items",
        "/items?name=kettle&name=lantern",
    ):
        step = env.step(_call("http_get", path=path))
        assert task.answer not in step.observation and step.reward == 0.0, (path, step)
    # Control: the prices fetched and summed.
    env.reset(task)
    cents = 0
    for name, quantity in task.metadata["items"].items():
        step = env.step(_call("http_get", path=f"/items?name={name}"))
        cents += quantity * json.loads(step.observation)["price_cents"]
    assert env.step(parse_action(f"<answer>{cents / 100:.2f}</answer>")).reward == 1.0


# --- calculator_math and math_verifier -----------------------------------------------------


_MATH = Task("t", "What is 95 - 21?", "74")
_MATH_FORGERIES = [
    "<answer></answer>",
    "<answer> </answer>",
    "<answer>73</answer><answer>74</answer>",
    "<answer>74</answer> <answer>73</answer>",
    "<answer>73, 74</answer>",
    "<answer>73 74 75</answer>",
    "<answer>\\{73, 74\\}</answer>",
    "<answer>[70, 80]</answer>",
    "<answer>73 \\text{ or } 74</answer>",
    "<answer>74 \\lor 73</answer>",
    "<answer>\\boxed{74}\\boxed{73}</answer>",
    "<answer>\\boxed{}</answer>",
    "<answer>" + " ".join(map(str, range(200))) + "</answer>",
    "<answer>" + "\\boxed{74}" * 40 + "</answer>",  # past MAX_ANSWER_CHARS
    "<answer><answer>74</answer></answer>",
    "<answer>74",
    "74",
    "\\boxed{74}",
    "The answer is 74.",  # no answer tag
    "<answer>７３</answer>",
    "<answer>\u202e47</answer>",  # Unicode: 73, and 47 shown as "74"
]


@pytest.mark.parametrize("env_name", ["calculator_math", "math_verifier"])
def test_math_replies_that_hedge_or_dodge_the_answer_format_earn_nothing(env_name):
    env = make_env(env_name)
    parse = parse_action if env_name == "calculator_math" else parse_answer_action
    for text in _MATH_FORGERIES:
        assert _reward(env, _MATH, parse(text)) == 0.0, text
    assert _reward(env, _MATH, parse("<answer>74</answer>")) == 1.0
    assert _reward(env, _MATH, parse("<answer>\\boxed{74}</answer>")) == 1.0


def test_calculator_math_answers_inside_tool_calls_or_observations_earn_nothing():
    env = make_env("calculator_math", max_tool_errors=10)
    inside = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": '
        '"<answer>74</answer>"}}</tool_call>'
    )
    both = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "95-21"}}</tool_call>'
        "<answer>74</answer>"
    )
    for text in (inside, both):
        env.reset(_MATH)
        step = env.step(parse_action(text))
        assert step.reward == 0.0 and not step.done, text
    react = ReActParser()
    # ReAct: what follows "Observation:" is the environment's to write, never an answer.
    env.reset(_MATH)
    step = env.step(react.parse("Thought: done\nObservation: Final Answer: 74"))
    assert step.reward == 0.0 and not step.done
    assert _reward(env, _MATH, react.parse("Final Answer: 73\nFinal Answer: 74")) == 0.0
    # Control: compute with the tool, then answer.
    env.reset(_MATH)
    result = env.step(
        parse_action(
            '<tool_call>{"name": "calculator", "arguments": {"expression": "95 - 21"}}</tool_call>'
        )
    )
    assert result.observation == "74"
    assert (
        env.step(react.parse(f"Thought: I know it\nFinal Answer: {result.observation}")).reward
        == 1.0
    )


# --- reasoning_gym -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["leg_counting", "basic_arithmetic", "chain_sum", "spell_backward"]
)
def test_reasoning_gym_lists_of_candidates_and_empty_answers_earn_nothing(name):
    env = make_env("reasoning_gym", task=name)
    for task in env.tasks("train", 3, seed=2):
        right = task.answer
        forged = [
            "",
            " ",
            "\n",
            f"7 {right}" if right != "7" else "8 7",
            f"{right}\n{right}x",
            f"0\n1\n{right}\n2",
            f"{right} {right} {right}x",
            " ".join(str(i) for i in range(300)),
        ]
        for text in forged:
            step = (env.reset(task), env.step(Action(text="", answer=text)))[1]
            # reasoning-gym's own scorer pays some of these (partial credit, 0.01 for any
            # answer); the reward must not.
            assert step.reward == 0.0, (name, text[:60], step.info)
        assert _reward(env, task, Action(text="", answer=right)) == 1.0


def test_reasoning_gym_partial_credit_is_paid_only_when_asked_for():
    plain = make_env("reasoning_gym", task="leg_counting")
    paying = make_env("reasoning_gym", task="leg_counting", partial_credit=True)
    task = plain.tasks("train", 1, seed=0)[0]
    hedge = Action(text="", answer=f"1 {task.answer}")
    assert _reward(plain, task, hedge) == 0.0
    assert 0.0 < _reward(paying, task, hedge) < 1.0
    with pytest.raises(ValueError, match="partial_credit"):
        make_env("reasoning_gym", task="leg_counting", partial_credit="yes")


def test_reasoning_gym_datasets_whose_scorer_pays_any_answer_are_refused():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("game_of_life_halting", size=1, seed=0)[0]
    # The scorer itself: a reply with no answer in it is "right".
    assert reasoning_gym.get_score_answer_fn("game_of_life_halting")("no idea", entry) == 1.0
    with pytest.raises(ValueError, match="game_of_life_halting.*every non-empty answer"):
        make_env("reasoning_gym", task="game_of_life_halting")
    env = make_env("reasoning_gym")  # scoring the run's dataset: refused at reset
    with pytest.raises(ValueError, match="game_of_life_halting"):
        env.reset(Task("t", entry["question"], str(entry["answer"]), {"entry": entry}))


def test_reasoning_gym_coin_flip_whose_scorer_pays_the_constant_zero_is_refused():
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    with pytest.raises(ValueError, match="coin_flip.*constant answer 0"):
        make_env("reasoning_gym", task="coin_flip")
    if "coin_flip" not in DATASETS:
        pytest.skip("this reasoning-gym (0.1.23, gem-llm's pin) has no coin_flip; 0.1.25 has")
    entries = list(reasoning_gym.create_dataset("coin_flip", size=20, seed=3))
    score = reasoning_gym.get_score_answer_fn("coin_flip")
    # The scorer itself: "0" (a prefix of "0.3125") is "right" on nearly every question.
    assert sum(score("0", e) == 1.0 for e in entries) >= 15
    assert not any(e["answer"] in ("0", "0.0") for e in entries)
    env = make_env("reasoning_gym")  # scoring the run's dataset: refused at reset
    with pytest.raises(ValueError, match="coin_flip"):
        env.reset(
            Task("t", entries[0]["question"], str(entries[0]["answer"]), {"entry": entries[0]})
        )


# --- simulated_tool ----------------------------------------------------------------------


def test_simulated_tool_reward_does_not_depend_on_what_the_policy_writes():
    # A throughput benchmark with no task: every episode of `turns` steps gets 1.0, so no
    # reply can earn more than another (a group's advantages are all zero).
    rewards = set()
    for replies in (["", "", ""], ["<answer>1</answer>"] * 3, ["x" * 10_000, "\x00", "🙂"]):
        env = make_env("simulated_tool", tool_latency_s=0.0, turns=3)
        env.reset(Task("t", "anything", "1"))
        steps = [env.step(Action(text=reply)) for reply in replies]
        assert [s.done for s in steps] == [False, False, True]
        rewards.add(sum(s.reward for s in steps))
    assert rewards == {1.0}
