"""Repository repair, the template for SWE-style benchmarks: a tiny Python project with one
bug is copied into the episode's sandbox work dir; the model reads and edits it with the
``bash`` and ``python`` tools until it answers; then hidden tests run in the sandbox and
the reward is whether they all pass.

To turn this into a benchmark of your own, keep ``RepoRepairEnv`` and swap ``PROJECTS``
for your repositories (files, the hidden tests, and bugs as ``(file, fixed text, buggy
text)`` substitutions or whole broken files): the episode, the sandbox and the scoring
stay as they are. SWE-bench's instances are exactly this shape: a repository at a commit,
a problem statement, and FAIL_TO_PASS / PASS_TO_PASS tests run after the agent's edits.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from raytunix.envs.hidden_tests import DEFAULT_TEST_TIMEOUT_S, run_hidden_tests
from raytunix.envs.tool_task import ToolTaskEnv, write_files
from raytunix.registry import register
from raytunix.sandbox import SandboxClient, SandboxSession
from raytunix.tools import BashTool, PythonTool
from raytunix.types import Task


@dataclasses.dataclass(frozen=True)
class Bug:
    """One bug: ``buggy`` replaces ``fixed`` (which occurs exactly once) in ``path``;
    ``symptom`` is what the issue report says."""

    name: str
    path: str
    fixed: str
    buggy: str
    symptom: str


@dataclasses.dataclass(frozen=True)
class Project:
    """A tiny repository: its files (the correct version, visible tests included), the
    hidden tests (a unittest module, run after the episode) and the bugs to plant."""

    name: str
    files: dict[str, str]
    hidden_tests: str
    bugs: tuple[Bug, ...]

    def source_dirs(self) -> list[str]:
        """The top-level directories of the project's source: those of its files, but
        ``tests`` (the visible tests). Only ``*.py`` files under them reach the hidden
        tests (``raytunix.envs.hidden_tests``)."""
        return sorted(
            {
                path.split("/", 1)[0]
                for path in self.files
                if "/" in path and path.split("/", 1)[0] != "tests"
            }
        )

    def packages(self) -> list[str]:
        """The top-level module names the hidden tests import from the project."""
        return self.source_dirs()

    def buggy_files(self, bug: Bug) -> dict[str, str]:
        """The project's files with ``bug`` planted.

        Raises:
          ValueError: ``bug.fixed`` does not occur exactly once in ``bug.path``.
        """
        text = self.files[bug.path]
        if text.count(bug.fixed) != 1:
            raise ValueError(
                f"bug {bug.name!r} of {self.name!r}: {bug.fixed!r} occurs "
                f"{text.count(bug.fixed)} times in {bug.path}, not once"
            )
        return {**self.files, bug.path: text.replace(bug.fixed, bug.buggy)}


TEXTSTATS = Project(
    name="textstats",
    files={
        "textstats/__init__.py": "from textstats.stats import mean, median, top_words, word_count\n",
        "textstats/stats.py": '''"""Small statistics over numbers and text."""
from collections import Counter


def mean(values):
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no values")
    middle = n // 2
    if n % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def word_count(text):
    return len(text.split())


def top_words(text, k):
    counts = Counter(word.strip(".,!?").lower() for word in text.split())
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [word for word, _ in ranked[:k]]
''',
        "tests/__init__.py": "",
        "tests/test_stats.py": '''import unittest

from textstats import mean, median


class StatsTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([2, 4, 6]), 4)

    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)


if __name__ == "__main__":
    unittest.main()
''',
    },
    hidden_tests='''import unittest

from textstats import mean, median, top_words, word_count


class HiddenStatsTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([2, 4, 6]), 4)
        self.assertAlmostEqual(mean([1, 2]), 1.5)
        with self.assertRaises(ValueError):
            mean([])

    def test_median(self):
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertEqual(median([4, 1, 3, 2]), 2.5)
        self.assertEqual(median([7]), 7)

    def test_word_count(self):
        self.assertEqual(word_count("a  b\\tc\\nd"), 4)
        self.assertEqual(word_count(""), 0)

    def test_top_words(self):
        self.assertEqual(top_words("b a b. C c, c!", 2), ["c", "b"])
        self.assertEqual(top_words("x y", 5), ["x", "y"])
''',
    bugs=(
        Bug(
            "median_even",
            "textstats/stats.py",
            "if n % 2 == 1:",
            "if n % 2 == 0:",
            "median([4, 1, 3, 2]) should be 2.5",
        ),
        Bug(
            "mean_divisor",
            "textstats/stats.py",
            "sum(values) / len(values)",
            "sum(values) / (len(values) - 1)",
            "mean([1, 2]) should be 1.5",
        ),
        Bug(
            "word_count_spaces",
            "textstats/stats.py",
            "len(text.split())",
            'len(text.split(" "))',
            "word_count('a  b') should be 2",
        ),
        Bug(
            "top_words_cut",
            "textstats/stats.py",
            "ranked[:k]",
            "ranked[:k - 1]",
            "top_words('x y', 2) should be ['x', 'y']",
        ),
    ),
)

CART = Project(
    name="cart",
    files={
        "cart/__init__.py": "from cart.cart import Cart\n",
        "cart/cart.py": '''"""A shopping cart with a bulk discount."""


class Cart:
    BULK_QUANTITY = 10  # this many units of one item or more get the discount
    BULK_DISCOUNT = 0.1

    def __init__(self):
        self.lines = {}  # item -> (quantity, unit price)

    def add(self, item, quantity, unit_price):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        old_quantity = self.lines.get(item, (0, unit_price))[0]
        self.lines[item] = (old_quantity + quantity, unit_price)

    def remove(self, item, quantity):
        old_quantity, unit_price = self.lines[item]
        if quantity >= old_quantity:
            del self.lines[item]
        else:
            self.lines[item] = (old_quantity - quantity, unit_price)

    def total(self):
        total = 0.0
        for quantity, unit_price in self.lines.values():
            line = quantity * unit_price
            if quantity >= self.BULK_QUANTITY:
                line *= 1 - self.BULK_DISCOUNT
            total += line
        return round(total, 2)
''',
        "tests/__init__.py": "",
        "tests/test_cart.py": '''import unittest

from cart import Cart


class CartTest(unittest.TestCase):
    def test_total(self):
        cart = Cart()
        cart.add("pen", 2, 1.5)
        self.assertEqual(cart.total(), 3.0)


if __name__ == "__main__":
    unittest.main()
''',
    },
    hidden_tests='''import unittest

from cart import Cart


class HiddenCartTest(unittest.TestCase):
    def test_add_accumulates(self):
        cart = Cart()
        cart.add("pen", 2, 1.5)
        cart.add("pen", 3, 1.5)
        self.assertEqual(cart.lines["pen"][0], 5)
        self.assertEqual(cart.total(), 7.5)

    def test_bulk_discount_at_threshold(self):
        cart = Cart()
        cart.add("cup", 10, 2.0)
        self.assertEqual(cart.total(), 18.0)

    def test_remove(self):
        cart = Cart()
        cart.add("pen", 3, 1.0)
        cart.remove("pen", 1)
        self.assertEqual(cart.lines["pen"][0], 2)
        cart.remove("pen", 2)
        self.assertNotIn("pen", cart.lines)

    def test_bad_quantity(self):
        with self.assertRaises(ValueError):
            Cart().add("pen", 0, 1.0)
''',
    bugs=(
        Bug(
            "bulk_threshold",
            "cart/cart.py",
            "if quantity >= self.BULK_QUANTITY:",
            "if quantity > self.BULK_QUANTITY:",
            "10 cups at 2.0 should cost 18.0 with the bulk discount",
        ),
        Bug(
            "add_overwrites",
            "cart/cart.py",
            "(old_quantity + quantity, unit_price)",
            "(quantity, unit_price)",
            "adding 2 pens then 3 pens should give 5 pens",
        ),
        Bug(
            "remove_keeps_empty",
            "cart/cart.py",
            "if quantity >= old_quantity:",
            "if quantity > old_quantity:",
            "removing every pen should drop the pen line",
        ),
    ),
)

PROJECTS: dict[str, Project] = {project.name: project for project in (TEXTSTATS, CART)}


@register("env", "repo_repair")
class RepoRepairEnv(ToolTaskEnv):
    """Fix a bug in a tiny Python project; reward 1.0 when its hidden tests pass.

    At reset the episode's sandbox work dir receives the project with one bug planted
    (visible tests under ``tests/`` included; ``python3 -m unittest`` runs them). The model
    calls ``bash`` and ``python`` (the same work dir) to read, edit and test it, and
    answers (``<answer>done</answer>``) when finished. Then the hidden tests (never in the
    work dir) run in the sandbox against a pristine copy of the project's source as left
    (``raytunix.envs.hidden_tests``: the tests, their runner and their report stay out of
    the project's reach, and every hidden test must be named in the report): reward 1.0
    if every one passes, else 0.0. ``info`` holds ``tests`` (run), ``failures``,
    ``errors`` (hidden tests not run count here), the tail of the test output
    (``test_output``) and ``not_copied`` (files of the source directories left out of the
    copy: links, ``conftest.py``, ``sitecustomize.py``...). An episode that runs out of
    turns ends ``truncated`` with reward 0, untested.

    Tasks: one per (project, bug) pair from ``PROJECTS``, drawn with replacement, seeded
    by split and seed (there are few bugs, so train and held-out share them; a real
    benchmark keeps its instances apart). Metadata: ``project``, ``bug``.

    Args:
      projects: names from ``PROJECTS`` to draw from (default: all).
      max_tool_errors: tool errors tolerated per episode (>= 0); a failing command is
        output, not an error.
      tool_timeout_s: deadline of one call as the env waits for it, seconds.
      test_timeout_s: deadline of one hidden test, seconds (> 0); a test past it errors.
      sandbox: the sandbox to run in (default: ``raytunix.sandbox.connect()``).

    Raises:
      ValueError: an unknown project name, a bad ``test_timeout_s``, or see
        ``CalculatorMathEnv``.
    """

    default_agent = "tool"
    uses_sandbox = True

    def __init__(
        self,
        projects: list[str] | None = None,
        max_tool_errors: int = 3,
        tool_timeout_s: float | None = 30.0,
        test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S,
        sandbox: SandboxClient | None = None,
    ) -> None:
        if (
            isinstance(test_timeout_s, bool)
            or not isinstance(test_timeout_s, (int, float))
            or not 0 < test_timeout_s <= 3600
        ):
            raise ValueError(f"test_timeout_s={test_timeout_s!r} must be seconds in (0, 3600]")
        self.test_timeout_s = float(test_timeout_s)
        names = list(projects) if projects is not None else sorted(PROJECTS)
        unknown = [name for name in names if name not in PROJECTS]
        if unknown or not names:
            raise ValueError(
                f"projects={projects!r}: unknown {unknown}; choose from {sorted(PROJECTS)}"
            )
        self.projects = names
        self.session = SandboxSession(sandbox, name="repo_repair")
        super().__init__(
            [BashTool(self.session), PythonTool(self.session)],
            max_tool_errors=max_tool_errors,
            tool_timeout_s=tool_timeout_s,
        )

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        rng = random.Random(f"repo_repair/{split}/{seed}")
        pairs = [(project, bug) for project in self.projects for bug in PROJECTS[project].bugs]
        tasks = []
        for i in range(size):
            project, bug = rng.choice(pairs)
            question = (
                f"The Python project {project} in your working directory has a bug: "
                f"{bug.symptom}. Fix it; python3 -m unittest runs its tests. Reply "
                "<answer>done</answer> when fixed."
            )
            tasks.append(
                Task(
                    f"{split}-{i}",
                    question,
                    "hidden tests pass",
                    {"project": project, "bug": bug.name},
                )
            )
        return tasks

    def _initial_observation(self, task: Task) -> str:
        question = super()._initial_observation(task)
        project = PROJECTS[task.metadata["project"]]
        bug = next(b for b in project.bugs if b.name == task.metadata["bug"])
        self.session.close()  # a fresh work dir per episode
        write_files(self.session, project.buggy_files(bug))
        return question

    def _score(self, answer: str) -> tuple[float, dict[str, Any]]:
        project = PROJECTS[self.task.metadata["project"]]
        report = run_hidden_tests(
            self.session,
            source_dirs=project.source_dirs(),
            tests=project.hidden_tests,
            packages=project.packages(),
            test_timeout_s=self.test_timeout_s,
        )
        return (1.0 if report.passed else 0.0), {
            "correct": report.passed,
            "tests": report.tests,
            "failures": report.failures,
            "errors": report.errors,
            "test_output": report.output,
            "not_copied": list(report.not_copied),
        }

    def close(self) -> None:
        """Deletes the episode's work dir."""
        super().close()
        self.session.close()
