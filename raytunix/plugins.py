"""Environments, agents and tools named in config: a registered name or an import path.

A name is looked up in the registry first (``raytunix.registry``: raytunix's own classes
and any that ``@register`` themselves in this process), then in the entry points that
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

Nothing here imports Ray or JAX. This module sits above ``raytunix.envs``,
``raytunix.agents`` and ``raytunix.tools``; they use ``raytunix.registry`` directly.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys
import typing
from typing import Any, Iterable, Mapping

# Importing the three packages registers raytunix's own names.
from raytunix import registry
from raytunix.agents import ConversationAgentBase
from raytunix.envs import BaseEnv
from raytunix.registry import (
    KINDS,
    PluginError,
    entry_points,
    import_object,
    is_import_path,
    registered_names,
)
from raytunix.tools import Tool

_BASES: dict[str, type] = {"env": BaseEnv, "agent": ConversationAgentBase, "tool": Tool}

__all__ = [
    "KINDS",
    "PluginError",
    "add_import_paths",
    "builtin",
    "check_kwargs",
    "entry_points",
    "import_object",
    "import_root",
    "is_import_path",
    "module_roots",
    "registered_names",
    "resolve",
]


def builtin(kind: str) -> dict[str, type]:
    """A copy of the registry of ``kind`` ("env", "agent" or "tool")."""
    return dict(registry.entries(kind))


def resolve(kind: str, spec: str) -> type:
    """The class named by ``spec`` for ``kind`` (``raytunix.registry.resolve`` with the
    kind's base class).

    Args:
      kind: "env" (a ``BaseEnv`` subclass), "agent" (a ``ConversationAgentBase``
        subclass) or "tool" (a ``Tool`` subclass).
      spec: a registered name, an entry-point name, or ``package.module:Class``.

    Raises:
      ValueError: ``kind`` is unknown.
      PluginError: unknown name, module or attribute that cannot be imported, or an object
        that is not a subclass of the kind's base class; the message lists the registered
        names.
    """
    return registry.resolve(kind, spec, _BASES[registry.check_kind(kind)])


def check_kwargs(
    cls: type, kwargs: Mapping[str, Any], *, key: str, provided: Iterable[str] = ()
) -> None:
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
        raise PluginError(
            f"{key}={kwargs!r} must be a mapping of argument names to values, "
            f"e.g. {key}={{turns: 2}}."
        )
    bad_names = [k for k in kwargs if not isinstance(k, str)]
    if bad_names:
        raise PluginError(f"{key} has non-string argument names {bad_names!r}.")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a constructor in C: nothing to check against
        return
    _check_names(cls, signature, kwargs, key, set(provided))
    hints = _type_hints(cls)
    for name, value in kwargs.items():
        expected = _scalar_types(hints.get(name))
        if expected is not None and not _fits(value, expected):
            names = " or ".join(t.__name__ for t in expected)
            raise PluginError(
                f"{key}.{name}={value!r} must be {names} ({cls.__qualname__}.__init__ says so)."
            )


def _check_names(
    cls: type,
    signature: inspect.Signature,
    kwargs: Mapping[str, Any],
    key: str,
    provided: set[str],
) -> None:
    """Raises ``PluginError`` when ``kwargs`` names a parameter raytunix ``provided``
    itself or one ``signature`` lacks (without ``**kwargs``), or when a required one is
    given by neither (positional-only ones can never be: they count as missing)."""
    params = {
        name: p
        for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    accepted = [name for name in params if name not in provided]
    for name in kwargs:
        if name in provided:
            raise PluginError(f"{key}.{name} is set by raytunix itself; remove it from {key}.")
        if name not in params and not takes_any:
            raise PluginError(
                f"{key}.{name}: {cls.__qualname__} takes no argument {name!r}; it accepts "
                f"{', '.join(accepted) or 'no arguments'}."
            )
    missing = [
        name
        for name, p in params.items()
        if p.default is p.empty and name not in kwargs and name not in provided
    ]
    positional_only = [
        name
        for name, p in signature.parameters.items()
        if p.kind == p.POSITIONAL_ONLY and p.default is p.empty
    ]
    if missing or positional_only:
        raise PluginError(
            f"{key}: {cls.__qualname__} needs {', '.join(missing + positional_only)}, which "
            f"{key} does not give; add {'it' if len(missing) == 1 else 'them'} to {key}."
        )


def _fits(value: Any, expected: tuple[type, ...]) -> bool:
    """Whether ``value`` passes for a parameter annotated with the scalar types
    ``expected`` (``_scalar_types``): an int passes for a float, ``None`` only where
    ``expected`` holds ``NoneType``, and a bool only where it holds ``bool`` (bool is a
    subclass of int in Python; ``true`` for a number is a typo or a wrong key)."""
    if isinstance(value, bool):
        return bool in expected
    if isinstance(value, expected):
        return True
    if float in expected and isinstance(value, int):
        return True
    return value is None and type(None) in expected


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
