"""Math with a Python interpreter: the model writes a program, reads what it prints, and
answers. Like ``calculator_math``, but the tool is the sandboxed ``python`` tool and the
questions are ones a program answers more easily than mental arithmetic (counts of primes,
sums over ranges, modular powers...)."""

from __future__ import annotations

import math
import random
from typing import Any, Callable

from raytunix.data.answers import MAX_ANSWER_CHARS, parse_number, score_answer, unwrap
from raytunix.envs.tool_task import ToolTaskEnv, draw_tasks
from raytunix.registry import register
from raytunix.sandbox import SandboxClient, SandboxSession
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
    return f"What is the sum of the squares of the integers from 1 to {n}?", sum(
        i * i for i in range(1, n + 1)
    )


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
    return (
        f"How many integers from 1 to {n} are divisible by {a} or by {b}?",
        sum(1 for i in range(1, n + 1) if i % a == 0 or i % b == 0),
    )


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


def numeric_answer_matches(answer: str | None, task: Task) -> bool:
    """Whether ``answer`` is right for ``task``: when the task's answer is a plain number,
    ``answer`` must be a plain number of the same value (no symbolic evaluation, so an
    expression the task wanted computed does not count); otherwise
    ``raytunix.data.answers.score_answer`` decides."""
    reference = task.answer
    expected = (
        parse_number(unwrap(reference))
        if isinstance(reference, str) and len(reference) <= MAX_ANSWER_CHARS
        else None
    )
    if expected is None:
        return score_answer(task, answer) == 1.0
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return False
    return parse_number(unwrap(answer)) == expected


@register("env", "python_math")
class PythonMathEnv(ToolTaskEnv):
    """Multi-turn math with the sandboxed ``python`` tool.

    Steps as in ``CalculatorMathEnv``: a ``python`` call (``{"code": "print(...)"}``)
    returns what the program printed, or ``error: ...`` (an exception, a limit) counted as
    a tool error; an ``<answer>`` ends the episode, reward 1.0 if it is right, else 0.0.
    The reward is decided on the host from the answer text alone, never from anything in
    the work dir. Where the task's answer is a plain number (every generated task), the
    answer must be a plain number equal to it (``raytunix.data.answers.parse_number``
    after ``unwrap``: ``1,024``, ``\\boxed{1024}`` and ``1024.0`` count): an expression
    that states the question instead of its value (``2^{10}``, ``\\sum_{i=1}^{20} i^2``,
    ``\\gcd(12, 18)``) scores 0, though the math answer rule would evaluate it. Other
    answers (a ``data.source`` dataset's) follow ``score_answer``. The program runs in the
    episode's sandbox work dir (``raytunix.sandbox``), so files it writes are there for its
    next call; each ``reset`` starts a fresh work dir, and ``close`` deletes it.

    Tasks: ``tasks`` draws questions from ``TEMPLATES`` (metadata ``template``), seeded by
    split and seed, train and held-out kept apart (``tool_task.split_of``); a run with
    ``data.source`` set to a dataset trains on that instead.

    Args:
      max_tool_errors: tool errors tolerated per episode (>= 0).
      tool_timeout_s: deadline of one call as the env waits for it, seconds (the sandbox's
        own ``sandbox.wall_time_s`` bounds the program itself).
      scale: size of the numbers in generated questions (>= 10; the default keeps answers
        short, larger values make mental arithmetic hopeless).
      sandbox: the sandbox to run in (default: ``raytunix.sandbox.connect()``).

    Raises:
      ValueError: a bad ``scale``, or see ``CalculatorMathEnv``.
    """

    default_agent = "tool"
    uses_sandbox = True

    def __init__(
        self,
        max_tool_errors: int = 2,
        tool_timeout_s: float | None = 30.0,
        scale: int = 20,
        sandbox: SandboxClient | None = None,
    ) -> None:
        if isinstance(scale, bool) or not isinstance(scale, int) or scale < 10:
            raise ValueError(f"scale={scale!r} must be an int >= 10")
        self._python = PythonTool(SandboxSession(sandbox, name="python_math"))
        super().__init__(
            [self._python], max_tool_errors=max_tool_errors, tool_timeout_s=tool_timeout_s
        )
        self.scale = scale

    def _initial_observation(self, task: Task) -> str:
        self._python.session.close()  # a fresh work dir per episode: nothing carries over
        return super()._initial_observation(task)

    def _score(self, answer: str) -> tuple[float, dict[str, Any]]:
        correct = numeric_answer_matches(answer, self.task)
        return (1.0 if correct else 0.0), {"correct": correct}

    def close(self) -> None:
        """Deletes the episode's work dir."""
        super().close()
        self._python.session.close()

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        names = sorted(TEMPLATES)

        def draw(rng: random.Random) -> tuple[str, str, dict]:
            name = rng.choice(names)
            question, answer = TEMPLATES[name](rng, self.scale)
            return f"{question} Use python to compute it.", str(answer), {"template": name}

        return draw_tasks(
            split, size, random.Random(f"python_math/{split}/{seed}/{self.scale}"), draw
        )
