"""Turn model text into tool calls or a final answer, never raising.

The tags are those of the chat contract (``raytunix.models.chat_template``)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "95 - 21"}}</tool_call>
    <answer>74</answer>

A reply holds at most one answer: with two, first-tag-wins (or last-tag-wins) would let a
policy hedge between values and be paid for it, so several answers are a format error.
"""

from __future__ import annotations

import json
import re

from raytunix.types import Action, ToolCall, ToolErrorKind

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

_ANSWER = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """Parses every ``<tool_call>{json}</tool_call>`` in ``text``.

    Each body must be a JSON object with ``"name"`` (str) and ``"arguments"`` (object).

    Returns:
      ``(calls, None)`` with the calls in order (empty when ``text`` has no tool call),
      or ``([], message)`` when any call is malformed (bad JSON, missing or mistyped
      keys, an unclosed tag); the message names the bad text and the expected form.
    """
    calls: list[ToolCall] = []
    position = 0
    while (start := text.find(TOOL_CALL_OPEN, position)) != -1:
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end == -1:
            return [], (
                f"unclosed {TOOL_CALL_OPEN} tag before {_short(text[body_start:])!r}; "
                f"close every call with {TOOL_CALL_CLOSE}"
            )
        call, error = _parse_call(text[body_start:end].strip())
        if error is not None:
            return [], error
        calls.append(call)
        position = end + len(TOOL_CALL_CLOSE)
    return calls, None


def parse_answer(text: str) -> str | None:
    """Returns the stripped text inside the one ``<answer>...</answer>`` of ``text``; None
    when there is none or more than one (see ``parse_answer_action`` for the reason)."""
    answers = _ANSWER.findall(text)
    return answers[0].strip() if len(answers) == 1 else None


def _answer_or_error(text: str) -> tuple[str | None, str | None]:
    answers = _ANSWER.findall(text)
    if len(answers) > 1:
        return None, (
            f"found {len(answers)} {ANSWER_OPEN} blocks "
            f"({', '.join(repr(_short(a.strip(), 20)) for a in answers)}); give exactly one answer"
        )
    if not answers:
        return None, None
    return answers[0].strip(), None


def parse_action(text: str) -> Action:
    """Parses one model turn that must hold tool calls or an answer, but not both.

    Returns:
      ``Action`` with ``tool_calls``, or ``answer``, or ``parse_error`` saying what was
      wrong and ``parse_error_kind``: ``BAD_JSON`` for a malformed call; ``FORMAT`` for
      an unclosed ``<answer>``, neither found, both found, or more than one answer.
    """
    calls, error = parse_tool_calls(text)
    if error is not None:
        return Action(text=text, parse_error=error, parse_error_kind=ToolErrorKind.BAD_JSON)
    answer, error = _answer_or_error(text)
    if error is None and calls and answer is not None:
        error = f"found both {TOOL_CALL_OPEN} and {ANSWER_OPEN}; write one of them per turn"
    if error is None and not calls and answer is None:
        error = _missing_answer_error(text, with_tool_calls=True)
    if error is not None:
        return Action(text=text, parse_error=error, parse_error_kind=ToolErrorKind.FORMAT)
    if calls:
        return Action(text=text, tool_calls=tuple(calls))
    return Action(text=text, answer=answer)


def parse_answer_action(text: str) -> Action:
    """Parses a single-turn reply that must hold an ``<answer>``; tool calls are ignored.

    Returns:
      ``Action`` with ``answer``, or with ``answer=None``, ``parse_error`` set and
      ``parse_error_kind=FORMAT`` (no answer, an unclosed one, or more than one).
    """
    answer, error = _answer_or_error(text)
    if error is None and answer is None:
        error = _missing_answer_error(text, with_tool_calls=False)
    if error is not None:
        return Action(text=text, parse_error=error, parse_error_kind=ToolErrorKind.FORMAT)
    return Action(text=text, answer=answer)


def _missing_answer_error(text: str, with_tool_calls: bool) -> str:
    if ANSWER_OPEN in text:
        return f"unclosed {ANSWER_OPEN} tag; write {ANSWER_OPEN}VALUE{ANSWER_CLOSE}"
    wanted = f"{TOOL_CALL_OPEN} or {ANSWER_OPEN}" if with_tool_calls else ANSWER_OPEN
    return f"no {wanted} found in {_short(text)!r}; write {ANSWER_OPEN}VALUE{ANSWER_CLOSE}"


def _parse_call(body: str) -> tuple[ToolCall | None, str | None]:
    expected = '{"name": "<tool>", "arguments": {...}}'
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as e:
        return None, (
            f"tool call is not valid JSON ({e.msg} at char {e.pos}): {_short(body)!r}; "
            f"expected {expected}"
        )
    if not isinstance(payload, dict):
        return None, f"tool call must be a JSON object, got {_short(body)!r}; expected {expected}"
    name, arguments = payload.get("name"), payload.get("arguments")
    if not isinstance(name, str) or not name:
        return None, f'tool call needs a string "name", got {_short(body)!r}; expected {expected}'
    if not isinstance(arguments, dict):
        return None, (
            f'tool call needs an object "arguments", got {_short(body)!r}; expected {expected}'
        )
    return ToolCall(name=name, arguments=arguments), None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
