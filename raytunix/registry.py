"""Names for environments, agents and tools: what config values such as ``env.name`` mean.

A class registers itself under a name::

    from raytunix.registry import register

    @register("env", "parity")
    class ParityEnv(BaseEnv): ...

and ``resolve`` finds a spec, in order: a registered name, an entry point that an installed
package declares (groups ``raytunix.envs``, ``raytunix.agents``, ``raytunix.tools``), or an
import path ``package.module:Class``. A registered name is known only in processes that
imported the class's module; raytunix's own classes are registered by importing
``raytunix.envs``, ``raytunix.agents`` and ``raytunix.tools`` (``raytunix.plugins`` imports
all three). For a class of your own that Ray actors build, an import path or an entry point
works in every process.

This module is a leaf of the import graph: it imports nothing of raytunix, so base classes,
environments, agents and tools can all import it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
from typing import Any, Callable, TypeVar

# kind -> (what it is called in messages, entry-point group)
KINDS = {
    "env": ("environment", "raytunix.envs"),
    "agent": ("agent", "raytunix.agents"),
    "tool": ("tool", "raytunix.tools"),
}

_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}

C = TypeVar("C", bound=type)


class PluginError(ValueError):
    """A name or import path cannot be resolved, or constructor arguments do not fit; the
    message names the bad value and says what to do."""


def register(kind: str, name: str) -> Callable[[C], C]:
    """Class decorator: registers the class as ``name`` for ``kind`` ("env", "agent" or
    "tool") and returns it unchanged.

    Registering the same class again (a module reloaded) replaces the entry.

    Raises:
      ValueError: ``kind`` is unknown.
      PluginError: ``name`` is empty, contains ``:`` (it would read as an import path), or
        is taken by another class (the message names both).
    """
    what = KINDS[check_kind(kind)][0]
    if not isinstance(name, str) or not name.strip() or ":" in name:
        raise PluginError(
            f"{what} name {name!r} must be a non-empty string without ':' "
            "(a ':' marks an import path package.module:Class)."
        )

    def decorator(cls: C) -> C:
        if not inspect.isclass(cls):
            raise PluginError(f"register({kind!r}, {name!r}) decorates a class, got {cls!r:.60}.")
        taken = _REGISTRY[kind].get(name)
        if taken is not None and _qualified(taken) != _qualified(cls):
            raise PluginError(
                f"{what} name {name!r} is taken by {_qualified(taken)}; register "
                f"{_qualified(cls)} under another name."
            )
        _REGISTRY[kind][name] = cls
        return cls

    return decorator


def entries(kind: str) -> dict[str, type]:
    """The live registry of ``kind``: name -> class (mutating it registers or removes)."""
    return _REGISTRY[check_kind(kind)]


def entry_points(kind: str) -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points that installed packages declare for ``kind`` (not loaded yet)."""
    group = KINDS[check_kind(kind)][1]
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


def registered_names(kind: str) -> list[str]:
    """Registered names, then entry-point names (a registered name wins over an entry
    point), each sorted."""
    names = entries(kind)
    return sorted(names) + sorted(set(entry_points(kind)) - set(names))


def is_import_path(spec: str) -> bool:
    """True for ``package.module:Attribute`` (a colon with text on both sides)."""
    module, sep, attr = spec.partition(":")
    return bool(sep and module and attr)


def resolve(kind: str, spec: str, base: type) -> type:
    """The class named by ``spec`` for ``kind``.

    Args:
      kind: "env", "agent" or "tool".
      spec: a registered name, an entry-point name, or ``package.module:Class``.
      base: the class it must subclass (``BaseEnv``, ``ConversationAgentBase``, ``Tool``).

    Raises:
      PluginError: unknown name, module or attribute that cannot be imported, an entry
        point that fails to load, an object that is not a subclass of ``base``, or an
        abstract class; the message lists the registered names.
    """
    what, group = KINDS[check_kind(kind)]
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(
            f"{what} {spec!r} is not a name; give a registered name "
            f"({', '.join(registered_names(kind))}) or package.module:Class."
        )
    registry = entries(kind)
    if spec in registry:
        obj = registry[spec]
    elif spec in (eps := entry_points(kind)):
        try:
            obj = eps[spec].load()
        except Exception as e:  # noqa: BLE001 - a third party's import error, reported whole
            raise PluginError(
                f"{what} {spec!r} is the entry point {eps[spec].value!r} (group {group!r}, "
                f"package {_dist_name(eps[spec])}), which fails to load: "
                f"{type(e).__name__}: {e}"
            ) from e
    elif is_import_path(spec):
        obj = import_object(spec, what)
    else:
        raise PluginError(
            f"unknown {what} {spec!r}; registered: {', '.join(registered_names(kind))}; or "
            f"give an import path package.module:Class (packages can also register names "
            f"through the {group!r} entry-point group)."
        )
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise PluginError(
            f"{what} {spec!r} is {_describe(obj)}, not a subclass of {base.__module__}."
            f"{base.__qualname__}."
        )
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise PluginError(f"{what} {spec!r} ({obj.__qualname__}) is abstract; implement {missing}.")
    return obj


def import_object(path: str, what: str = "object") -> Any:
    """Imports ``package.module:Attribute`` (the attribute may be dotted, ``mod:Outer.Inner``).

    Raises:
      PluginError: the path is malformed, the module cannot be imported (the message says
        where Python looked), or it has no such attribute.
    """
    if not is_import_path(path):
        raise PluginError(f"{what} {path!r} is not an import path; write package.module:Class.")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and not module_name.startswith(e.name) and not e.name.startswith(module_name):
            # The module exists; one of its own imports is missing.
            raise PluginError(f"{what} {path!r}: importing {module_name!r} failed: {e}") from e
        raise PluginError(
            f"{what} {path!r}: no module named {module_name!r} on this process's path "
            f"(pid {os.getpid()}; cwd {os.getcwd()!r}). Run from the directory that holds it, "
            "add that directory to PYTHONPATH, or pip install its package."
        ) from e
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise PluginError(
            f"{what} {path!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            names = sorted(n for n in vars(module) if not n.startswith("_"))
            raise PluginError(
                f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}; it "
                f"defines: {', '.join(names[:30])}."
            ) from None
    return obj


def check_kind(kind: str) -> str:
    """``kind`` itself if it is "env", "agent" or "tool".

    Raises:
      ValueError: any other kind.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    return kind


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _describe(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__name__} ({obj!r:.60})"


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return repr(dist.name) if dist is not None else "unknown"
