"""Tools the model can call, and the registry that builds them by name."""

from __future__ import annotations

from raytunix.tools.base import Tool, ToolError, ToolResult
from raytunix.tools.calculator import Calculator

TOOLS: dict[str, type[Tool]] = {Calculator.name: Calculator}


def get_tool(name: str) -> Tool:
    """Returns a new instance of the tool registered as ``name``.

    Raises:
      ValueError: ``name`` is not registered (the message lists the valid names).
    """
    try:
        return TOOLS[name]()
    except KeyError:
        raise ValueError(f"unknown tool {name!r}; valid names: {sorted(TOOLS)}") from None


__all__ = ["Calculator", "TOOLS", "Tool", "ToolError", "ToolResult", "get_tool"]
