"""The one rule for math answers (raytunix.data.answers): the documented format table, the
unwrapping, math-verify for LaTeX, and that every math scoring path uses it."""

import threading

import pytest

from raytunix.data.answers import MAX_ANSWER_CHARS, answers_match, parse_number, unwrap
from raytunix.envs import CalculatorMathEnv, MathVerifierEnv
from raytunix.types import Action, Task

# (model answer, reference, match) - the table of the module docstring, and more.
RULE_TABLE = [
    ("1,000", "1000", True),
    ("1e3", "1000", True),
    ("1E3", "1,000", True),
    ("0.50", "1/2", True),
    (".5", "0.5", True),
    ("\\boxed{42}", "42", True),
    ("The answer is \\boxed{\\frac{3}{4}}.", "0.75", True),
    ("$18", "18", True),
    ("$18$", "18", True),
    ("12%", "12", True),
    ("12%", "0.12", False),
    ("42.", "42", True),
    ("\u22127", "-7", True),
    ("+7", "7", True),
    ("-3", "3", False),
    ("0.333", "1/3", False),
    ("1,00", "100", False),
    ("10/0", "10", False),
    ("1e999999", "1", False),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{1}{2}", "1/2", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("x+1", "1+x", True),
    ("Paris", "paris", True),
    ("olleh", "hello", False),  # words are text, never symbols (E*h*l*l*o)
    ("1" * (MAX_ANSWER_CHARS + 1), "1" * (MAX_ANSWER_CHARS + 1), False),
    (None, "1", False),
    ("", "1", False),
]


@pytest.mark.parametrize("answer,reference,match", RULE_TABLE)
def test_number_format_rule(answer, reference, match):
    assert answers_match(answer, reference) is match


def test_rule_holds_off_the_main_thread():
    # Env actors step in threads, where math-verify's signal timeout cannot run.
    results = []
    thread = threading.Thread(
        target=lambda: results.extend(answers_match(a, r) is m for a, r, m in RULE_TABLE)
    )
    thread.start()
    thread.join()
    assert results and all(results)


@pytest.mark.slow
def test_a_symbolic_comparison_without_end_is_cut_off():
    # 9^(9^9) has 370 million digits; sympy would compute it. The helper process is killed
    # at its deadline, the answer does not match, and the next comparison gets a new one.
    result = []
    thread = threading.Thread(
        target=lambda: result.append(answers_match("9^{9^{9}}", "\\frac{1}{2}"))
    )
    thread.start()
    thread.join()
    assert result == [False]
    assert answers_match("\\frac{2}{4}", "\\frac{1}{2}")


@pytest.mark.slow
def test_symbolic_comparison_runs_in_a_ray_actor(ray_session):
    # The helper is spawned from a Ray worker process, as from an env actor.
    check = ray_session.remote(lambda: answers_match("2\\sqrt{2}", "\\sqrt{8}"))
    assert ray_session.get(check.remote()) is True


def test_parse_number_and_unwrap():
    assert parse_number("1,234.5") == parse_number("2469/2")
    assert parse_number("3 / 4") * 4 == 3
    assert parse_number("forty") is None
    assert parse_number("1,2345") is None
    assert unwrap("so \\boxed{\\frac{1}{2}} and \\boxed{7}") == "7"
    assert unwrap("\\boxed{a{b}c}") == "a{b}c"
    assert unwrap(" \\(x^2\\) ") == "x^2"


def test_reference_must_be_text():
    with pytest.raises(TypeError, match="reference answer must be a str"):
        answers_match("1", 1)


@pytest.mark.parametrize("env_cls", [MathVerifierEnv, CalculatorMathEnv])
def test_math_envs_score_by_the_rule(env_cls):
    task = Task(task_id="t", question="How many?", answer="1000")
    for answer, reward in (("1,000", 1.0), ("\\boxed{1e3}", 1.0), ("999", 0.0)):
        env = env_cls()
        env.reset(task)
        result = env.step(Action(text=answer, answer=answer))
        assert (result.reward, result.info["correct"]) == (reward, reward == 1.0), answer
