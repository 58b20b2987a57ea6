"""Tools the model can call, and the registry that builds them by name. ``python`` and
``bash`` run in a sandbox (``raytunix.sandbox``), each in a work dir of its own unless
given a shared ``SandboxSession``."""

from __future__ import annotations

from raytunix.tools.base import Tool, ToolError, ToolResult
from raytunix.tools.bash_tool import BashTool
from raytunix.tools.calculator import Calculator
from raytunix.tools.python_tool import PythonTool

TOOLS: dict[str, type[Tool]] = {tool.name: tool for tool in (Calculator, PythonTool, BashTool)}


def get_tool(name: str) -> Tool:
    """Returns a new instance of the tool registered as ``name``.

    Raises:
      ValueError: ``name`` is not registered (the message lists the valid names).
    """
    try:
        return TOOLS[name]()
    except KeyError:
        raise ValueError(f"unknown tool {name!r}; valid names: {sorted(TOOLS)}") from None


__all__ = ["BashTool", "Calculator", "PythonTool", "TOOLS", "Tool", "ToolError", "ToolResult",
           "get_tool"]
