"""Math with a Python interpreter: the model writes a program, reads what it prints, and
answers. Like ``calculator_math``, but the tool is the sandboxed ``python`` tool and the
questions are ones a program answers more easily than mental arithmetic (counts of primes,
sums over ranges, modular powers...)."""

from __future__ import annotations

import math
import random
from typing import Callable

from raytunix.envs.math_envs import CalculatorMathEnv
from raytunix.envs.tool_task import draw_tasks
from raytunix.tools import PythonTool
from raytunix.types import Task


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _fibonacci(k: int) -> int:
    a, b = 1, 1
    for _ in range(k - 1):
        a, b = b, a + b
    return a


# Each draws (question, answer) from rng, numbers sized by `scale` (>= 10).
_Template = Callable[[random.Random, int], tuple[str, int]]


def _sum_of_squares(rng: random.Random, scale: int) -> tuple[str, int]:
    n = rng.randint(5, scale)
    return f"What is the sum of the squares of the integers from 1 to {n}?", \
        sum(i * i for i in range(1, n + 1))


def _count_primes(rng: random.Random, scale: int) -> tuple[str, int]:
    n = rng.randint(10, 10 * scale)
    return f"How many prime numbers are less than {n}?", sum(map(_is_prime, range(n)))


def _modular_power(rng: random.Random, scale: int) -> tuple[str, int]:
    a, b, m = rng.randint(2, scale), rng.randint(5, 3 * scale), rng.randint(7, 10 * scale)
    return f"What is {a} to the power {b}, modulo {m}?", pow(a, b, m)


def _fibonacci_number(rng: random.Random, scale: int) -> tuple[str, int]:
    k = rng.randint(5, max(6, scale // 2))
    return f"What is the Fibonacci number F({k}), with F(1) = F(2) = 1?", _fibonacci(k)


def _divisible_count(rng: random.Random, scale: int) -> tuple[str, int]:
    n, a, b = rng.randint(20, 20 * scale), rng.randint(2, 9), rng.randint(2, 9)
    return (f"How many integers from 1 to {n} are divisible by {a} or by {b}?",
            sum(1 for i in range(1, n + 1) if i % a == 0 or i % b == 0))


def _digit_sum_of_product(rng: random.Random, scale: int) -> tuple[str, int]:
    a, b = rng.randint(10, 100 * scale), rng.randint(10, 100 * scale)
    return f"What is the sum of the digits of {a} * {b}?", sum(map(int, str(a * b)))


def _gcd(rng: random.Random, scale: int) -> tuple[str, int]:
    g = rng.randint(2, scale)
    a, b = g * rng.randint(2, 10 * scale), g * rng.randint(2, 10 * scale)
    return f"What is the greatest common divisor of {a} and {b}?", math.gcd(a, b)


TEMPLATES: dict[str, _Template] = {
    "sum_of_squares": _sum_of_squares,
    "count_primes": _count_primes,
    "modular_power": _modular_power,
    "fibonacci": _fibonacci_number,
    "divisible_count": _divisible_count,
    "digit_sum": _digit_sum_of_product,
    "gcd": _gcd,
}


class PythonMathEnv(CalculatorMathEnv):
    """Multi-turn math with the sandboxed ``python`` tool.

    Steps as in ``CalculatorMathEnv``: a ``python`` call (``{"code": "print(...)"}``)
    returns what the program printed, or ``error: ...`` (an exception, a limit) counted as
    a tool error; an ``<answer>`` ends the episode, reward 1.0 if it equals the task's
    integer answer (``raytunix.data.answers.score_answer``) else 0.0. The program runs
    in the episode's sandbox work dir (``raytunix.sandbox``), so files it writes are there
    for its next call; the work dir goes when the episode ends.

    Tasks: ``tasks`` draws questions from ``TEMPLATES`` (metadata ``template``), seeded by
    split and seed, train and held-out kept apart (``tool_task.split_of``); a run with
    ``data.source`` set to a dataset trains on that instead.

    Args:
      max_tool_errors: tool errors tolerated per episode (>= 0).
      tool_timeout_s: deadline of one call as the env waits for it, seconds (the sandbox's
        own ``sandbox.wall_time_s`` bounds the program itself).
      scale: size of the numbers in generated questions (>= 10; the default keeps answers
        short, larger values make mental arithmetic hopeless).

    Raises:
      ValueError: a bad ``scale``, or see ``CalculatorMathEnv``.
    """

    default_agent = "tool"
    uses_sandbox = True

    def __init__(self, max_tool_errors: int = 2, tool_timeout_s: float | None = 30.0,
                 scale: int = 20) -> None:
        if isinstance(scale, bool) or not isinstance(scale, int) or scale < 10:
            raise ValueError(f"scale={scale!r} must be an int >= 10")
        super().__init__(max_tool_errors=max_tool_errors, tools=[PythonTool()],
                         tool_timeout_s=tool_timeout_s)
        self.scale = scale

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        names = sorted(TEMPLATES)

        def draw(rng: random.Random) -> tuple[str, str, dict]:
            name = rng.choice(names)
            question, answer = TEMPLATES[name](rng, self.scale)
            return f"{question} Use python to compute it.", str(answer), {"template": name}

        return draw_tasks(split, size, random.Random(f"python_math/{split}/{seed}/{self.scale}"),
                          draw)
