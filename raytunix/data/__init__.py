"""Datasets and task generators: the math answer rule, datasets on disk and reasoning-gym
tasks (data.* sources), arithmetic, warm-start demonstrations."""

from __future__ import annotations

from raytunix.data.answers import answers_match, score_answer
from raytunix.data.arithmetic import make_arithmetic_splits
from raytunix.data.demonstrations import (
    DEFAULT_TOOL_USE_PROB,
    make_demonstration,
    sample_demonstrations,
    tokenizer_corpus,
)

__all__ = [
    "DEFAULT_TOOL_USE_PROB",
    "answers_match",
    "make_arithmetic_splits",
    "make_demonstration",
    "sample_demonstrations",
    "score_answer",
    "tokenizer_corpus",
]
