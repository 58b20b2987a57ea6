"""Environments, agents and tools named in config: a registered name or an import path.

A name is looked up in raytunix's own registry first (``raytunix.envs.ENVS``,
``raytunix.agents.AGENTS``, ``raytunix.tools.TOOLS``), then in the entry points that
installed packages declare (groups ``raytunix.envs``, ``raytunix.agents``,
``raytunix.tools``); anything else of the form ``package.module:Class`` is imported::

    resolve("env", "calculator_math")       # built in
    resolve("env", "parity")                # a package's entry point: parity = my_pkg.envs:Parity
    resolve("env", "my_pkg.envs:Parity")    # an import path

Every process that builds the object resolves the name itself: the driver when it checks
the config, each env actor and the orchestrator actor when they build environments and
agents. An import path must therefore be importable in those processes too; the driver
passes the directory it imported the module from (``import_root``) to the actors, which
put it on their ``sys.path`` (``add_import_paths``). That covers one machine and clusters
with a shared filesystem; otherwise install the package on every node or ship it with
the job (Ray's ``runtime_env``: ``working_dir`` or ``py_modules``).

Nothing here imports Ray or JAX.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import typing
from typing import Any, Iterable, Mapping

# kind -> (what it is called in messages, entry-point group)
KINDS = {
    "env": ("environment", "raytunix.envs"),
    "agent": ("agent", "raytunix.agents"),
    "tool": ("tool", "raytunix.tools"),
}


class PluginError(ValueError):
    """A name or import path cannot be resolved, or constructor arguments do not fit; the
    message names the bad value and says what to do."""


def is_import_path(spec: str) -> bool:
    """True for ``package.module:Attribute`` (a colon with text on both sides)."""
    module, sep, attr = spec.partition(":")
    return bool(sep and module and attr)


def builtin(kind: str) -> dict[str, type]:
    """raytunix's own registry of ``kind`` ("env", "agent" or "tool")."""
    _check_kind(kind)
    if kind == "env":
        from raytunix.envs import ENVS as registry
    elif kind == "agent":
        from raytunix.agents import AGENTS as registry
    else:
        from raytunix.tools import TOOLS as registry
    return dict(registry)


def entry_points(kind: str) -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points that installed packages declare for ``kind`` (not loaded yet)."""
    _check_kind(kind)
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=KINDS[kind][1])}


def registered_names(kind: str) -> list[str]:
    """Built-in names, then entry-point names (a built-in name wins over an entry point)."""
    names = builtin(kind)
    return sorted(names) + sorted(set(entry_points(kind)) - set(names))


def resolve(kind: str, spec: str) -> type:
    """The class named by ``spec`` for ``kind``.

    Args:
      kind: "env" (a ``BaseEnv`` subclass), "agent" (a ``ConversationAgentBase``
        subclass) or "tool" (a ``Tool`` subclass).
      spec: a registered name, an entry-point name, or ``package.module:Class``.

    Raises:
      PluginError: unknown name, module or attribute that cannot be imported, or an object
        that is not a subclass of the kind's base class; the message lists the registered
        names.
    """
    what, group = KINDS[_check_kind(kind)]
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(f"{what} {spec!r} is not a name; give a registered name "
                          f"({', '.join(registered_names(kind))}) or package.module:Class.")
    registry = builtin(kind)
    if spec in registry:
        obj = registry[spec]
    elif spec in (eps := entry_points(kind)):
        try:
            obj = eps[spec].load()
        except Exception as e:  # noqa: BLE001 - a third party's import error, reported whole
            raise PluginError(
                f"{what} {spec!r} is the entry point {eps[spec].value!r} (group {group!r}, "
                f"package {_dist_name(eps[spec])}), which fails to load: "
                f"{type(e).__name__}: {e}") from e
    elif is_import_path(spec):
        obj = import_object(spec, what)
    else:
        raise PluginError(
            f"unknown {what} {spec!r}; registered: {', '.join(registered_names(kind))}; or "
            f"give an import path package.module:Class (packages can also register names "
            f"through the {group!r} entry-point group).")
    base = _base_class(kind)
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise PluginError(
            f"{what} {spec!r} is {_describe(obj)}, not a subclass of {base.__module__}."
            f"{base.__qualname__}.")
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
            "add that directory to PYTHONPATH, or pip install its package.") from e
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise PluginError(f"{what} {path!r}: importing {module_name!r} raised "
                          f"{type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            names = sorted(n for n in vars(module) if not n.startswith("_"))
            raise PluginError(
                f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}; it "
                f"defines: {', '.join(names[:30])}.") from None
    return obj


def check_kwargs(cls: type, kwargs: Mapping[str, Any], *, key: str,
                 provided: Iterable[str] = ()) -> None:
    """Checks ``cls(**provided, **kwargs)`` against the constructor's signature without
    calling it.

    Names must be parameters of the constructor (unless it takes ``**kwargs``), every
    required parameter must be given, and a value for a parameter annotated ``int``,
    ``float``, ``str`` or ``bool`` (or ``X | None`` of those) must have that type (an int
    passes for a float; a bool passes only for ``bool``, not for ``int`` or ``float``).

    Args:
      cls: the class to be built.
      kwargs: the keyword arguments the user gave.
      key: the config key they came from (e.g. ``"env.kwargs"``), used in messages.
      provided: parameters raytunix passes itself (e.g. an agent's ``tokenizer``).

    Raises:
      PluginError: ``kwargs`` is not a mapping with string keys, a name is not accepted
        (the message lists the accepted ones), a required parameter is missing, or a value
        has the wrong type.
    """
    if not isinstance(kwargs, Mapping):
        raise PluginError(f"{key}={kwargs!r} must be a mapping of argument names to values, "
                          f"e.g. {key}={{turns: 2}}.")
    bad_names = [k for k in kwargs if not isinstance(k, str)]
    if bad_names:
        raise PluginError(f"{key} has non-string argument names {bad_names!r}.")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a constructor in C: nothing to check against
        return
    provided = set(provided)
    params = {name: p for name, p in signature.parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    accepted = [name for name in params if name not in provided]
    for name in kwargs:
        if name in provided:
            raise PluginError(f"{key}.{name} is set by raytunix itself; remove it from {key}.")
        if name not in params and not takes_any:
            raise PluginError(
                f"{key}.{name}: {cls.__qualname__} takes no argument {name!r}; it accepts "
                f"{', '.join(accepted) or 'no arguments'}.")
    missing = [name for name, p in params.items() if p.default is p.empty
               and name not in kwargs and name not in provided]
    positional_only = [name for name, p in signature.parameters.items()
                       if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    if missing or positional_only:
        raise PluginError(
            f"{key}: {cls.__qualname__} needs {', '.join(missing + positional_only)}, which "
            f"{key} does not give; add {'it' if len(missing) == 1 else 'them'} to {key}.")
    hints = _type_hints(cls)
    for name, value in kwargs.items():
        expected = _scalar_types(hints.get(name))
        if expected is None:
            continue
        # bool is a subclass of int in Python; `true` for an int or float parameter is a
        # typo or a wrong key, not a number.
        if isinstance(value, bool) and bool not in expected:
            pass
        elif isinstance(value, expected):
            continue
        if float in expected and isinstance(value, int) and not isinstance(value, bool):
            continue
        if value is None and type(None) in expected:
            continue
        names = " or ".join(t.__name__ for t in expected)
        raise PluginError(f"{key}.{name}={value!r} must be {names} "
                          f"({cls.__qualname__}.__init__ says so).")


def import_root(obj: Any) -> str | None:
    """The ``sys.path`` entry that ``obj``'s module was imported from, for actors to add;
    None for built-in modules and for raytunix's own (importable wherever raytunix is)."""
    return _module_root(getattr(obj, "__module__", None) or "")


# "package.module:anything" — a module named before a colon (gymnasium's "module:Id-v0"
# too); URLs and plain words do not match.
_MODULE_REF = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[^/\s]\S*$")


def module_roots(value: Any) -> list[str]:
    """``sys.path`` entries of the modules that import-path strings inside ``value``
    (nested mappings, lists and tuples; e.g. ``env.kwargs``) name, found without importing
    the modules themselves; unknown modules and raytunix's own are skipped."""
    found: list[str] = []

    def visit(item: Any) -> None:
        if isinstance(item, str):
            match = _MODULE_REF.match(item)
            root = _module_root(match.group(1)) if match else None
            if root:
                found.append(root)
        elif isinstance(item, Mapping):
            for child in item.values():
                visit(child)
        elif isinstance(item, (list, tuple)):
            for child in item:
                visit(child)

    visit(value)
    return list(dict.fromkeys(found))


def _module_root(module_name: str) -> str | None:
    if not module_name or module_name.split(".")[0] == "raytunix":
        return None
    module = sys.modules.get(module_name)
    spec = getattr(module, "__spec__", None)
    if spec is None:
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            return None
    origin = getattr(spec, "origin", None)
    if not origin or not os.path.isabs(origin):  # built-in, frozen, namespace package
        return None
    root = os.path.dirname(origin)
    depth = module_name.count(".") + (os.path.basename(origin) == "__init__.py")
    for _ in range(depth):
        root = os.path.dirname(root)
    return root


def add_import_paths(paths: Iterable[str]) -> None:
    """Puts ``paths`` at the front of ``sys.path`` (once each), so import paths resolved in
    the driver resolve the same way in this process."""
    for path in reversed(list(paths)):
        if path and path not in sys.path:
            sys.path.insert(0, path)


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    return kind


def _base_class(kind: str) -> type:
    if kind == "env":
        from raytunix.envs.base import BaseEnv
        return BaseEnv
    if kind == "agent":
        from raytunix.agents.base import ConversationAgentBase
        return ConversationAgentBase
    from raytunix.tools.base import Tool
    return Tool


def _describe(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__name__} ({obj!r:.60})"


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return repr(dist.name) if dist is not None else "unknown"


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: check names only
        return {}


def _scalar_types(hint: Any) -> tuple[type, ...] | None:
    """(int,) for ``int``, (float, NoneType) for ``float | None``; None when the hint is
    anything else (no type check)."""
    if hint is None:
        return None
    scalars = (bool, int, float, str)
    if hint in scalars:
        return (hint,)
    args = typing.get_args(hint)
    if args and all(a in scalars or a is type(None) for a in args):
        return tuple(args)
    return None
