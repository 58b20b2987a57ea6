import pytest
import reasoning_gym

from raytunix.tools import Calculator, Tool, ToolResult, get_tool
from raytunix.tools.calculator import MAX_EXPRESSION_CHARS


@pytest.fixture
def calculator():
    return get_tool("calculator")


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("95 - 21", "74"),
        ("-7 - -35", "28"),
        ("-( -46 + 330 + 846 )", "-1130"),
        ("( -( -929 / 929 ) )", "1"),
        ("7 / 2", "3"),
        ("-7 / 2", "-4"),  # floor, not truncation
        ("10 * 3 / 4", "7"),  # left to right, as Python's //
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("--5", "5"),
        ("2.5 * 2", "5"),
        ("1.5 + 1", "2.5"),
        ("7.0 / 2", "3.5"),
    ],
)
def test_calculator_evaluates(calculator, expression, expected):
    result = calculator(expression=expression)
    assert result == ToolResult(output=expected, error=None, latency_s=result.latency_s)
    assert result.latency_s >= 0.0


@pytest.mark.parametrize(
    "expression, fragment",
    [
        ("1 / 0", "division by zero"),
        ("5 / (3 - 3)", "division by zero"),
        ("2 ** 10", "unsupported syntax"),
        ("1 // 2", "unsupported syntax"),
        ("__import__('os')", "unsupported character"),
        ("1e5", "unsupported character"),
        ("(1 + 2", "cannot parse"),
        ("", "cannot parse"),
        ("1 " + "+ 1 " * MAX_EXPRESSION_CHARS, "limit"),
    ],
)
def test_calculator_returns_errors_for_bad_input(calculator, expression, fragment):
    result = calculator(expression=expression)
    assert result.output == ""
    assert fragment in result.error


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({}, "missing"),
        ({"expression": 3}, "must be a string"),
        ({"expression": "1", "x": 1}, "unknown"),
    ],
)
def test_calculator_reports_bad_arguments(calculator, arguments, fragment):
    result = calculator(**arguments)
    assert fragment in result.error


def test_calculator_agrees_with_reasoning_gym_answers(calculator):
    dataset = reasoning_gym.create_dataset(
        "basic_arithmetic", min_terms=2, max_terms=3, min_digits=2, max_digits=3, size=300, seed=7
    )
    for entry in dataset:
        result = calculator(expression=entry["metadata"]["expression"])
        assert result.output == entry["answer"], entry


def test_registry():
    assert isinstance(get_tool("calculator"), Calculator)
    assert isinstance(get_tool("calculator"), Tool)
    with pytest.raises(
        ValueError,
        match=r"unknown tool 'web_search'; valid names: \['bash', 'calculator', 'python'\]",
    ):
        get_tool("web_search")
