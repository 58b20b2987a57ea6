"""Synthetic demonstrations for the supervised warm start, in the chat contract's format.

With the tool (the tool call is one line, wrapped here)::

    <|user|>Calculate 95 - 21.<|end|>
    <|assistant|><tool_call>{"name": "calculator",
                             "arguments": {"expression": "95 - 21"}}</tool_call><|end|>
    <|tool|>74<|end|>
    <|assistant|><answer>74</answer><|end|>

Without the tool, the assistant answers at once. Mixing the two by the number of terms
(harder tasks use the tool more often) gives RL a policy that can call the tool but has
not learned when it pays.
"""

from __future__ import annotations

import json
import random
import types
from typing import Iterable, Iterator, Mapping

from raytunix.models.chat_template import render_chat
from raytunix.tools import Calculator
from raytunix.types import Task

DEFAULT_TOOL_USE_PROB: Mapping[int, float] = types.MappingProxyType({2: 0.25, 3: 0.85})

_CALCULATOR = Calculator()


def make_demonstration(task: Task, use_tool: bool) -> list[dict[str, str]]:
    """Messages of one demonstration for an arithmetic task.

    Args:
      task: a task whose ``metadata["expression"]`` is the expression to compute
        (as made by ``make_arithmetic_splits``).
      use_tool: call the calculator on the expression before answering.

    Returns:
      ``[{"role": "user", "content": question}, ...]``: user, assistant tool call, tool
      result, assistant answer; or user, assistant answer.

    Raises:
      ValueError: ``use_tool`` and the task has no ``expression`` in its metadata, or the
        calculator disagrees with ``task.answer`` (a demonstration must not teach a
        wrong answer).
    """
    messages = [{"role": "user", "content": task.question}]
    if use_tool:
        expression = task.metadata.get("expression")
        if not isinstance(expression, str):
            raise ValueError(
                f"task {task.task_id} has no string metadata['expression'] (got {expression!r}); "
                "tool demonstrations need the expression to pass to the calculator."
            )
        result = _CALCULATOR(expression=expression)
        if result.error is not None or result.output != task.answer:
            raise ValueError(
                f"task {task.task_id}: calculator gives {result.output or result.error!r} for "
                f"{expression!r} but the answer is {task.answer!r}; fix the task or the calculator."
            )
        call = json.dumps({"name": _CALCULATOR.name, "arguments": {"expression": expression}})
        messages.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
        messages.append({"role": "tool", "content": result.output})
    messages.append({"role": "assistant", "content": f"<answer>{task.answer}</answer>"})
    return messages


def sample_demonstrations(
    tasks: Iterable[Task],
    rng: random.Random,
    tool_use_prob: Mapping[int, float] = DEFAULT_TOOL_USE_PROB,
) -> list[list[dict[str, str]]]:
    """One demonstration per task, using the tool with probability
    ``tool_use_prob[task.metadata["num_terms"]]``.

    Raises:
      ValueError: a task's ``num_terms`` has no entry in ``tool_use_prob``.
    """
    demonstrations = []
    for task in tasks:
        num_terms = task.metadata.get("num_terms")
        if num_terms not in tool_use_prob:
            raise ValueError(
                f"task {task.task_id} has num_terms={num_terms!r}, which tool_use_prob "
                f"{dict(tool_use_prob)} does not cover; add a probability for it."
            )
        use_tool = rng.random() < tool_use_prob[num_terms]
        demonstrations.append(make_demonstration(task, use_tool=use_tool))
    return demonstrations


def tokenizer_corpus(tasks: Iterable[Task]) -> Iterator[str]:
    """Yields rendered chat texts to train a BPE tokenizer on: for an arithmetic task (one
    with a string ``metadata["expression"]``) with and without the tool; for any other
    task (an environment's own) its question answered with ``<answer>`` and its answer."""
    for task in tasks:
        if isinstance(task.metadata.get("expression"), str):
            for use_tool in (True, False):
                yield render_chat(make_demonstration(task, use_tool), add_generation_prompt=False)
        else:
            yield render_chat(make_demonstration(task, use_tool=False), add_generation_prompt=False)
