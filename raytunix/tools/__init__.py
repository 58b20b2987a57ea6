"""Tools the model can call, and the registry that builds them by name. ``python`` and
``bash`` run in a sandbox (``raytunix.sandbox``), each in a work dir of its own unless
given a shared ``SandboxSession``."""

from __future__ import annotations

from raytunix import registry
from raytunix.tools.base import Tool, ToolError, ToolResult
from raytunix.tools.bash_tool import BashTool
from raytunix.tools.calculator import Calculator
from raytunix.tools.python_tool import PythonTool

# The live registry: each tool registers itself (``@register("tool", name)``) on import.
TOOLS: dict[str, type[Tool]] = registry.entries("tool")


def resolve_tool(spec: str) -> type[Tool]:
    """The ``Tool`` subclass named by ``spec``: a registered name, a package's entry point
    (group ``raytunix.tools``) or ``package.module:Class``.

    Raises:
      raytunix.registry.PluginError (a ValueError): ``spec`` does not resolve to a
        concrete ``Tool`` subclass (the message lists the registered names).
    """
    return registry.resolve("tool", spec, Tool)


def get_tool(name: str) -> Tool:
    """Returns a new instance of the tool registered as ``name``.

    Raises:
      ValueError: ``name`` is not registered (the message lists the valid names).
    """
    try:
        return TOOLS[name]()
    except KeyError:
        raise ValueError(f"unknown tool {name!r}; valid names: {sorted(TOOLS)}") from None


__all__ = [
    "BashTool",
    "Calculator",
    "PythonTool",
    "TOOLS",
    "Tool",
    "ToolError",
    "ToolResult",
    "get_tool",
    "resolve_tool",
]
