"""A calculator tool: + - * / with unary minus and parentheses, evaluated through ``ast``.

Division follows Python on the operand types: two integers divide with floor division
(``-7 / 2`` is ``-4``), matching reasoning-gym's ``basic_arithmetic`` answers, which are
computed with ``//``; a decimal operand gives true division.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from raytunix.registry import register
from raytunix.tools.base import Tool, ToolError

MAX_EXPRESSION_CHARS = 200
_ALLOWED_CHARS = frozenset("0123456789.+-*/() \t")
# Integral floats below this print as integers; larger ones keep float notation so a
# rounded 1e20 is not presented as an exact 21-digit integer.
_MAX_EXACT_FLOAT = 2**53

_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


@register("tool", "calculator")
class Calculator(Tool):
    """Evaluates one arithmetic expression on integers and decimals.

    Argument ``expression`` (str, at most ``MAX_EXPRESSION_CHARS`` characters). The output
    is an integer string when the value is integral (``"74"``, ``"-1130"``), otherwise
    Python's shortest float repr (``"2.5"``). Errors: characters other than digits,
    ``.``, ``+ - * /``, parentheses and spaces; syntax errors; division by zero; a
    non-finite result.
    """

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression with + - * / and parentheses; "
        "/ on two integers is floor division."
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. '( 56 + -33 ) * 2'"}},
        "required": ["expression"],
    }

    def run(self, expression: str) -> str:
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise ToolError(
                f"expression has {len(expression)} characters, more than the limit of "
                f"{MAX_EXPRESSION_CHARS}; split it into smaller calculations"
            )
        bad = sorted(set(expression) - _ALLOWED_CHARS)
        if bad:
            raise ToolError(
                f"unsupported character(s) {''.join(bad)!r} in {expression!r}; use digits, "
                "'.', + - * / and parentheses only"
            )
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise ToolError(f"cannot parse {expression!r} as an arithmetic expression") from None
        return _format(_evaluate(tree.body, expression))


def _evaluate(node: ast.AST, expression: str) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, expression)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left = _evaluate(node.left, expression)
        right = _evaluate(node.right, expression)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ToolError(f"division by zero in {expression!r}")
            if isinstance(left, int) and isinstance(right, int):
                return left // right
            return left / right
        op = _BINARY_OPS.get(type(node.op))
        if op is not None:
            return op(left, right)
    raise ToolError(
        f"unsupported syntax {ast.unparse(node)!r} in {expression!r}; "
        "use + - * / and parentheses only"
    )


def _format(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ToolError(f"result {value} is not a finite number")
    if value.is_integer() and abs(value) < _MAX_EXACT_FLOAT:
        return str(int(value))
    return repr(value)
