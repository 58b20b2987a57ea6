"""Turn model text into tool calls or a final answer, never raising.

The raytunix chat contract (``raytunix.models.chat_template``) uses Hermes-style tags::

    <tool_call>{"name": "calculator", "arguments": {"expression": "95 - 21"}}</tool_call>
    <answer>74</answer>

A reply holds at most one answer: with two, first-tag-wins (or last-tag-wins) would let a
policy hedge between values and be paid for it, so several answers are a format error.

Other models write tool calls their own way; one ``ToolCallParser`` per format
(``TOOL_PARSERS``), each turning a reply into an ``Action`` and describing the tools to
the model in its own format:

* ``hermes`` (alias ``qwen``, the raytunix default): ``<tool_call>{"name", "arguments"}
  </tool_call>``, any number per reply (Hermes 2 Pro, Qwen2.5 and later).
* ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (several
  joined by ``;``), optionally after ``<|python_tag|>`` (Llama 3.1+ JSON tool calling).
* ``gemma``: the whole reply is a Python-style list of calls,
  ``[calculator(expression="95 - 21")]``, the format Google's Gemma 3 function-calling
  guide prompts for (keyword arguments with literal values; a ```` ```tool_code ````
  fence around it is tolerated).
* ``react``: ``Thought: ... / Action: <tool> / Action Input: {json}``, and
  ``Final Answer: ...`` to finish (Yao et al. 2022, "ReAct").

Failures carry a ``ToolErrorKind``: ``BAD_JSON`` for a malformed call (bad JSON or call
syntax, an unclosed tag, a missing or mistyped name/arguments, a number that is not
finite, text that is not valid Unicode), ``BAD_ARGUMENTS`` for a call whose arguments have
no names (Gemma's positional arguments), ``FORMAT`` for a reply with no call and no
answer, both, several answers or several ReAct actions, or a call placed where the format
does not allow one. Unknown tools and arguments that do not fit a tool's schema are found
by the environment, which owns the tools (``UNKNOWN_TOOL``, ``BAD_ARGUMENTS``).
"""

from __future__ import annotations

import abc
import ast
import json
import math
import re
from typing import Any, ClassVar, Mapping, Sequence

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
    payload, error = _load_json(body)
    if error is not None:
        return None, f"tool call is not valid JSON ({error}): {_short(body)!r}; expected {expected}"
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


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {_short(text, 20)} is too large for a float")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_SPACE = re.compile(r"\s*")
_JSON = json.JSONDecoder(parse_float=_finite_float, parse_constant=_reject_constant)


def _check_unicode(value: Any) -> None:
    """Raises ValueError for a string holding a lone surrogate (``"\\ud800"`` in JSON): it
    is not text, and no tokenizer can encode it when a tool echoes it back."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone UTF-16 surrogate") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)


def _decode_json(text: str, position: int = 0) -> tuple[Any, int, str | None]:
    """``(value, end, None)`` for the JSON value at ``text[position:]``, or
    ``(None, position, reason)``; numbers must be finite and strings valid Unicode."""
    position = _SPACE.match(text, position).end()
    try:
        value, end = _JSON.raw_decode(text, position)
        _check_unicode(value)
    except json.JSONDecodeError as e:
        return None, position, f"{e.msg} at char {e.pos}"
    except RecursionError:
        return None, position, "nested too deeply"
    except ValueError as e:  # a non-finite number, an int past Python's digit limit
        return None, position, str(e)
    return value, end, None


def _load_json(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` for a text that is exactly one JSON value, else ``(None, reason)``."""
    value, end, error = _decode_json(text)
    if error is None and text[end:].strip():
        return None, f"extra data at char {end}"
    return value, error


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- tool-call formats ------------------------------------------------------------------

END_MARKERS = (
    "<|end|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<eos>",
    "</s>",
)
"""End-of-turn and end-of-text token strings that decoded replies may end with (raytunix,
ChatML/Qwen, Llama 3, Gemma, Llama 2 families); formats that read a whole reply strip
them first."""

PYTHON_TAG = "<|python_tag|>"

_Calls = tuple[list[ToolCall], str | None, ToolErrorKind | None]


def _strip_end_markers(text: str) -> str:
    text = text.strip()
    while True:
        for marker in END_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                break
        else:
            return text


def _function(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """``{"name", "description", "parameters"}`` of a tool schema, bare or wrapped as
    ``{"type": "function", "function": {...}}`` (``Tool.function_schema()``)."""
    inner = schema.get("function")
    return inner if isinstance(inner, Mapping) else schema


def _call_or_error(
    payload: Any, arguments_keys: tuple[str, ...], expected: str, body: str
) -> tuple[ToolCall | None, str | None]:
    if not isinstance(payload, dict):
        return None, f"tool call must be a JSON object, got {_short(body)!r}; expected {expected}"
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return None, f'tool call needs a string "name", got {_short(body)!r}; expected {expected}'
    key = next((k for k in arguments_keys if k in payload), arguments_keys[0])
    arguments = payload.get(key)
    if not isinstance(arguments, dict):
        return None, (
            f'tool call needs an object "{arguments_keys[0]}", got {_short(body)!r}; '
            f"expected {expected}"
        )
    return ToolCall(name=name, arguments=arguments), None


class ToolCallParser(abc.ABC):
    """One tool-call format: reads replies into ``Action``s, describes tools to the model.

    A reply is either tool calls or a final answer (by default the one
    ``<answer>...</answer>``); ``parse`` never raises.

    Attributes:
      name: the registry name (``agent.tool_parser``).
      uses_template_tools: True when chat templates that render ``tools`` teach this
        format (Hermes in ChatML/Qwen, JSON in Llama 3), so an agent passes the tool
        schemas to such a template; False when the format must be described in the system
        prompt whatever the template (ReAct).
    """

    name: ClassVar[str]
    uses_template_tools: ClassVar[bool] = True
    call_hint: ClassVar[str]  # how a call looks, for error messages

    def parse(self, text: str) -> Action:
        """The ``Action`` of one reply (decoded text, special tokens kept).

        Returns:
          ``Action(tool_calls=...)``, ``Action(answer=...)``, or ``Action(parse_error=...,
          parse_error_kind=...)`` (see the module docstring for the kinds).
        """
        calls, error, kind = self.find_calls(text)
        if error is not None:
            return Action(text=text, parse_error=error, parse_error_kind=kind)
        answer, error = self.find_answer(text)
        if error is None and calls and answer is not None:
            error = f"found both a tool call and {self.answer_hint}; write one of them per turn"
        if error is None and not calls and answer is None:
            error = (
                f"no tool call ({self.call_hint}) or {self.answer_hint} found in {_short(text)!r}"
            )
        if error is not None:
            return Action(text=text, parse_error=error, parse_error_kind=ToolErrorKind.FORMAT)
        if calls:
            return Action(text=text, tool_calls=tuple(calls))
        return Action(text=text, answer=answer)

    @abc.abstractmethod
    def find_calls(self, text: str) -> _Calls:
        """``(calls, None, None)``, with no calls when the reply holds none, or
        ``([], message, kind)`` for a malformed or misplaced call."""

    answer_hint: ClassVar[str] = f"{ANSWER_OPEN}VALUE{ANSWER_CLOSE}"

    def find_answer(self, text: str) -> tuple[str | None, str | None]:
        """``(answer or None, error or None)``; by default the one ``<answer>`` block."""
        answer, error = _answer_or_error(text)
        if error is None and answer is None and ANSWER_OPEN in text:
            error = f"unclosed {ANSWER_OPEN} tag; write {self.answer_hint}"
        return answer, error

    @abc.abstractmethod
    def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """System-prompt text that lists ``tools`` (JSON schemas, ``Tool.function_schema()``)
        and says how to call them and how to answer, in this format."""


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per reply,
    or ``<answer>...</answer>``; exactly ``parse_action``. A tag is a call wherever it
    stands (inside a code fence too); a tag inside a tag is bad JSON."""

    name = "hermes"
    call_hint = TOOL_CALL_OPEN

    def parse(self, text: str) -> Action:
        return parse_action(text)

    def find_calls(self, text: str) -> _Calls:
        calls, error = parse_tool_calls(text)
        return calls, error, ToolErrorKind.BAD_JSON if error is not None else None

    def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        signatures = "\n".join(json.dumps(dict(_function(t)), ensure_ascii=False) for t in tools)
        return (
            f"You can call these tools; their JSON signatures are inside <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            f'To call a tool, write {TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": '
            f"<arguments as a JSON object>}}{TOOL_CALL_CLOSE}. When you know the result, "
            f"write {self.answer_hint}."
        )


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1+ JSON tool calling: the whole reply is ``{"name": ..., "parameters":
    {...}}`` (``"arguments"`` is accepted too), several joined by ``;``, optionally after
    ``<|python_tag|>``. A reply that does not start with ``{`` is not a call; a JSON call
    inside a code fence or after prose is a format error (the model must write it alone)."""

    name = "llama3_json"
    call_hint = '{"name": ..., "parameters": {...}} alone'
    _EXPECTED = '{"name": "<tool>", "parameters": {...}}'
    _EMBEDDED = re.compile(r'\{\s*"name"\s*:')

    def find_calls(self, text: str) -> _Calls:
        body = _strip_end_markers(text)
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG) :].strip()
        if not body.startswith("{"):
            if tagged:
                return (
                    [],
                    (
                        f"{PYTHON_TAG} must be followed by a JSON call {self._EXPECTED}, got "
                        f"{_short(body)!r}"
                    ),
                    ToolErrorKind.BAD_JSON,
                )
            if self._EMBEDDED.search(body):
                return (
                    [],
                    (
                        "a tool call must be the whole reply: write the JSON object alone, "
                        f"not inside a code fence or after other text; got {_short(body)!r}"
                    ),
                    ToolErrorKind.FORMAT,
                )
            return [], None, None
        calls, position = [], 0
        while True:
            payload, end, error = _decode_json(body, position)
            piece = body[position:end] if error is None else body[position:]
            if error is not None:
                return (
                    [],
                    (
                        f"tool call is not valid JSON ({error}): {_short(piece)!r}; expected "
                        f"{self._EXPECTED}"
                    ),
                    ToolErrorKind.BAD_JSON,
                )
            call, error = _call_or_error(
                payload, ("parameters", "arguments"), self._EXPECTED, piece
            )
            if error is not None:
                return [], error, ToolErrorKind.BAD_JSON
            calls.append(call)
            position = _SPACE.match(body, end).end()
            if position == len(body):
                return calls, None, None
            if body[position] != ";":
                return (
                    [],
                    (
                        f"text after the tool call: {_short(body[position:])!r}; a call "
                        "must be the whole reply (join several with ';')"
                    ),
                    ToolErrorKind.FORMAT,
                )
            position += 1

    def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        signatures = "\n\n".join(
            json.dumps(dict(_function(t)), indent=4, ensure_ascii=False) for t in tools
        )
        return (
            "You can call the functions below. To call one, reply with nothing but a JSON "
            f"object {self._EXPECTED}. When you know the result, write {self.answer_hint}."
            f"\n\n{signatures}"
        )


class GemmaParser(ToolCallParser):
    """Gemma function calls as Google's Gemma 3 function-calling guide prompts for: the
    whole reply is a Python-style list ``[name(arg=value, ...), name2(...)]`` with keyword
    arguments and literal values (strings, numbers, booleans, None, lists, dicts). A
    ```` ```tool_code ```` (or ```` ```python ````) fence around the list is tolerated;
    a call list with other text around it is a format error."""

    name = "gemma"
    call_hint = "[tool_name(argument=value)] alone"
    _START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
    _FENCE = re.compile(r"```(?:tool_code|python|py)?[ \t]*\n?(.*?)\n?[ \t]*```", re.DOTALL)

    def find_calls(self, text: str) -> _Calls:
        body = _strip_end_markers(text)
        fenced = self._FENCE.fullmatch(body)
        if fenced:
            body = fenced.group(1).strip()
        if not self._START.match(body):
            if self._START.search(body):
                return (
                    [],
                    (
                        "function calls must be the whole reply, as [name(argument=value)], "
                        f"with no other text; got {_short(body)!r}"
                    ),
                    ToolErrorKind.FORMAT,
                )
            return [], None, None
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            reason = e.msg if isinstance(e, SyntaxError) else type(e).__name__
            return (
                [],
                (
                    f"function call list is not valid ({reason}): {_short(body)!r}; expected "
                    "[name(argument=value, ...)]"
                ),
                ToolErrorKind.BAD_JSON,
            )
        if not isinstance(tree, ast.List):
            return (
                [],
                (
                    f"function calls must form one list, got {_short(body)!r}; expected "
                    "[name(argument=value, ...)]"
                ),
                ToolErrorKind.BAD_JSON,
            )
        calls = []
        for node in tree.elts:
            call, error, kind = self._call(node)
            if error is not None:
                return [], error, kind
            calls.append(call)
        return calls, None, None

    def _call(self, node: ast.expr) -> tuple[ToolCall | None, str | None, ToolErrorKind | None]:
        source = _short(ast.unparse(node))
        name = _dotted_name(node.func) if isinstance(node, ast.Call) else None
        if name is None:
            return (
                None,
                (f"{source!r} is not a function call name(argument=value)"),
                ToolErrorKind.BAD_JSON,
            )
        if node.args:
            return (
                None,
                (
                    f"{source!r} passes arguments by position; name every argument, "
                    f"as {name}(argument=value)"
                ),
                ToolErrorKind.BAD_ARGUMENTS,
            )
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return (
                    None,
                    f"{source!r} unpacks **arguments; name every argument",
                    ToolErrorKind.BAD_JSON,
                )
            try:
                value = ast.literal_eval(keyword.value)
                _check_finite(value)
                _check_unicode(value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as e:
                return (
                    None,
                    (
                        f"argument {keyword.arg!r} of {source!r} must be a literal value "
                        f"(string, number, boolean, None, list or dict): {e}"
                    ),
                    ToolErrorKind.BAD_JSON,
                )
            arguments[keyword.arg] = value
        return ToolCall(name=name, arguments=arguments), None, None

    def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        signatures = json.dumps([dict(_function(t)) for t in tools], indent=2, ensure_ascii=False)
        return (
            "You have access to the functions below. To call functions, reply with nothing but "
            "a list of calls in the format [function_name(argument_name=value, ...), "
            "other_function(...)]. When you know the result, write "
            f"{self.answer_hint}.\n{signatures}"
        )


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _check_finite(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number")
    if isinstance(value, complex):
        raise ValueError("complex numbers are not accepted")
    if isinstance(value, dict):
        for item in value.values():
            _check_finite(item)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            _check_finite(item)


class ReActParser(ToolCallParser):
    """ReAct text (Yao et al. 2022, "ReAct: Synergizing Reasoning and Acting in Language
    Models"): ``Thought: ...``, then either ``Action: <tool>`` with ``Action Input: <JSON
    object>`` (one action per turn) or ``Final Answer: <answer>``. Text from an
    ``Observation:`` line on is ignored: observations are the environment's to write."""

    name = "react"
    uses_template_tools = False
    call_hint = "Action: <tool> / Action Input: {...}"
    answer_hint = "Final Answer: VALUE"
    _ACTION = re.compile(r"^[ \t]*Action[ \t]*:(.*)$", re.MULTILINE)
    _INPUT = re.compile(r"^[ \t]*Action[ \t]+Input[ \t]*:", re.MULTILINE)
    _FINAL = re.compile(r"^[ \t]*Final[ \t]+Answer[ \t]*:", re.MULTILINE)
    _OBSERVATION = re.compile(r"^[ \t]*Observation[ \t]*:", re.MULTILINE)
    _FENCE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```", re.DOTALL)

    def _own_text(self, text: str) -> str:
        observation = self._OBSERVATION.search(text)
        return _strip_end_markers(text[: observation.start()] if observation else text)

    def find_calls(self, text: str) -> _Calls:
        body = self._own_text(text)
        actions = list(self._ACTION.finditer(body))
        if not actions:
            return [], None, None
        if len(actions) > 1:
            return (
                [],
                (
                    f"found {len(actions)} Action lines; take one action per turn and wait "
                    "for its Observation"
                ),
                ToolErrorKind.FORMAT,
            )
        name = _strip_end_markers(actions[0].group(1))
        if not name:
            return [], "Action needs a tool name, as 'Action: calculator'", ToolErrorKind.BAD_JSON
        given = self._INPUT.search(body, actions[0].end())
        if given is None:
            return (
                [],
                (
                    f"Action {_short(name, 40)!r} has no 'Action Input:' line; give the "
                    "arguments as a JSON object"
                ),
                ToolErrorKind.BAD_JSON,
            )
        raw = _strip_end_markers(body[given.end() :])
        fenced = self._FENCE.fullmatch(raw)
        if fenced:
            raw = fenced.group(1).strip()
        arguments, end, error = _decode_json(raw)
        if error is None and not isinstance(arguments, dict):
            error = f"got {type(arguments).__name__}, not an object"
        if error is not None:
            return (
                [],
                (
                    f"Action Input is not a JSON object ({error}): {_short(raw)!r}; write "
                    'e.g. Action Input: {"expression": "1 + 2"}'
                ),
                ToolErrorKind.BAD_JSON,
            )
        return [ToolCall(name=name, arguments=arguments)], None, None

    def find_answer(self, text: str) -> tuple[str | None, str | None]:
        body = self._own_text(text)
        finals = list(self._FINAL.finditer(body))
        if len(finals) > 1:
            return None, f"found {len(finals)} 'Final Answer:' lines; give exactly one answer"
        if not finals:
            return None, None
        answer = _strip_end_markers(body[finals[0].end() :])
        if not answer:
            return None, "'Final Answer:' is empty; write the answer after it"
        return answer, None

    def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        lines = [
            f"{f['name']}: {f.get('description', '')} Arguments (a JSON object): "
            f"{json.dumps(f.get('parameters', {}), ensure_ascii=False)}"
            for f in map(_function, tools)
        ]
        names = ", ".join(_function(t)["name"] for t in tools)
        return (
            "You can use these tools:\n\n" + "\n".join(lines) + "\n\n"
            "Work in this format:\n"
            "Thought: what to do next\n"
            f"Action: the tool to use, one of [{names}]\n"
            "Action Input: the tool's arguments as a JSON object\n"
            "Observation: the tool's result (written for you; stop after Action Input)\n"
            "... (Thought, Action, Action Input and Observation may repeat)\n"
            "Thought: I know the final answer\n"
            "Final Answer: the answer"
        )


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "gemma": GemmaParser,
    "react": ReActParser,
}
"""Tool-call formats by name (``agent.tool_parser``)."""


def make_tool_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name``.

    Raises:
      ValueError: ``name`` is not registered (the message lists the valid names).
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool parser {name!r}; valid names: {', '.join(TOOL_PARSERS)}"
        ) from None
