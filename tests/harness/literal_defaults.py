"""A default written twice, found on the source: every literal at a default site that equals a value of the one home.

The one home is a module of constants (``packcache._defaults``). :func:`scan` reads a source tree and reports
each place that writes one of its values again as a literal where a default is written, with file and line.
Which values and sites collide by accident is the caller's policy (``tests/test_defaults.py``), passed in.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "FALLBACKS",
    "HOME",
    "MODE_ARGUMENTS",
    "Stray",
    "constants_by_value",
    "fields",
    "key",
    "literal",
    "parameters",
    "scan",
]

#: The one home's module name: ``_defaults.X``, or ``X`` imported from it, names a constant.
HOME = "_defaults"

#: ``os`` calls that create a file or directory (or set its mode) -> the position of the mode argument: the mode
#: packcache gives what it creates is a default of the same kind (``FILE_MODE``, ``PRIVATE_DIR_MODE``...).
MODE_ARGUMENTS = {"open": 2, "mkdir": 1, "makedirs": 1, "fchmod": 1, "chmod": 1}

#: ``x.get(k, d)``, ``os.getenv(k, d)``, ``d.setdefault(k, d)``, ``getattr(o, k, d)`` -> the fallback's position.
FALLBACKS = {"get": 1, "getenv": 1, "setdefault": 1, "getattr": 2}

_NOT_A_LITERAL = object()
_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.LShift: operator.lshift,
}  # fmt: skip


@dataclass(frozen=True)
class Stray:
    """A literal default outside the one home that equals one of its constants."""

    where: str
    line: int
    site: str
    value: object
    constants: tuple[str, ...]

    def __str__(self) -> str:
        homes = " / ".join(f"{HOME}.{name}" for name in self.constants)
        return f"{self.where}:{self.line}: {self.site} = {self.value!r} equals {homes}"


def key(value: object) -> tuple[str, object]:
    """What a value compares as: ``10`` is ``10.0`` (a timeout written either way), ``True`` is not ``1``.

    >>> key(10) == key(10.0), key(True) == key(1), key((32, 64)) == key((32.0, 64))
    (True, False, True)
    """
    if value is None:
        return ("none", None)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        return ("number", float(value))
    if isinstance(value, tuple):
        return ("tuple", tuple(key(item) for item in value))
    return (type(value).__name__, value)


def constants_by_value(module: ModuleType) -> dict[tuple[str, object], list[str]]:
    """Each value of a constant the home exports (scalars and tuples; a mapping is not one value) -> its names."""
    found: dict[tuple[str, object], list[str]] = {}
    for name in module.__all__:
        value = getattr(module, name)
        if value is None or isinstance(value, (bool, int, float, str, tuple)):
            found.setdefault(key(value), []).append(name)
    return found


def literal(node: ast.expr) -> object:
    """The value of a literal (``10.0``, ``4 << 20``, ``-1``, ``0o600``, ``(32, 64)``), else a private sentinel."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = literal(node.left), literal(node.right)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.Tuple):
        items = [literal(item) for item in node.elts]
        if all(item is not _NOT_A_LITERAL for item in items):
            return tuple(items)
    return _NOT_A_LITERAL


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[tuple[ast.arg, ast.expr]]:
    """(parameter, default) of each parameter of a function that has a default."""
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
    return pairs + [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]


def fields(node: ast.ClassDef) -> list[tuple[str, int, ast.expr]]:
    """(name, line, default) of each annotated class attribute with a value (a dataclass or named tuple field)."""
    return [
        (item.target.id, item.lineno, item.value)
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None
    ]


def scan(
    root: Path,
    constants: Mapping[tuple[str, object], list[str]],
    *,
    allowed: Collection[tuple[str, object]] = (),
    unrelated: Collection[tuple[str, str]] = (),
    aliases: Collection[str] = (),
) -> list[Stray]:
    """Every literal default under ``root`` (but the home's own file) that equals a value of ``constants``.

    A default is written at: a function parameter, a class field (dataclass, named tuple), ``add_argument(default=)``
    and ``field(default=)``, the fallback of :data:`FALLBACKS`, a module or class constant named ``DEFAULT_*`` (a
    second home), the mode given to an ``os`` call of :data:`MODE_ARGUMENTS`, and a keyword argument at a call
    of a function (or class) under ``root`` whose parameter (or field) of that name takes its default from the
    home: written there as a literal, the call pins the value the home names. Values whose :func:`key` is in
    ``allowed`` and sites in ``unrelated`` ((file relative to ``root``, site as :class:`Stray` names it)) are
    left out; ``aliases`` are other names of the home's constants (a re-export).
    """
    trees = {
        str(path.relative_to(root)): ast.parse(path.read_text(), str(path))
        for path in sorted(root.rglob("*.py"))
        if path.stem != HOME
    }
    homed: dict[str, set[str]] = {}  # function or class name -> its parameters whose default names the home
    for tree in trees.values():
        imported = {*_imported_from_home(tree), *aliases}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = homed.setdefault(node.name, set())
                names.update(name for name, _, value in fields(node) if _names_home(value, imported))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__":
                        names.update(a.arg for a, d in parameters(item) if _names_home(d, imported))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = homed.setdefault(node.name, set())
                names.update(a.arg for a, d in parameters(node) if _names_home(d, imported))
    strays: list[Stray] = []
    for where, tree in trees.items():
        for line, site, node in _default_sites(tree, homed):
            value = literal(node)
            if value is _NOT_A_LITERAL or key(value) in allowed or (where, site) in unrelated:
                continue
            if homes := constants.get(key(value)):
                strays.append(Stray(where, line, site, value, tuple(homes)))
    return strays


def _imported_from_home(tree: ast.Module) -> set[str]:
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == HOME
        for alias in node.names
    }


def _names_home(node: ast.expr, imported: Collection[str]) -> bool:
    """Whether an expression names a constant of the home (``_defaults.X``, or ``X`` imported from it)."""
    if isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id == HOME
    return isinstance(node, ast.Name) and node.id in imported


def _default_sites(tree: ast.Module, homed: Mapping[str, set[str]]) -> list[tuple[int, str, ast.expr]]:
    """(line, site, expression) of every default written in a module (the sites :func:`scan` names)."""
    sites: list[tuple[int, str, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            sites += [(default.lineno, f"parameter {arg.arg}", default) for arg, default in parameters(node)]
        elif isinstance(node, ast.ClassDef):
            sites += [(line, f"field {node.name}.{name}", default) for name, line, default in fields(node)]
        elif isinstance(node, ast.Assign):
            sites += [
                (node.lineno, f"constant {target.id}", node.value)
                for target in node.targets
                if isinstance(target, ast.Name) and target.id.startswith("DEFAULT")
            ]
        elif isinstance(node, ast.Call):
            sites += _call_sites(node, homed)
    return sites


def _call_sites(call: ast.Call, homed: Mapping[str, set[str]]) -> list[tuple[int, str, ast.expr]]:
    func = call.func
    callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    on_os = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "os"
    mode = MODE_ARGUMENTS.get(callee) if on_os else None
    fallback = FALLBACKS.get(callee)
    sites: list[tuple[int, str, ast.expr]] = []
    if mode is not None and len(call.args) > mode:
        sites.append((call.args[mode].lineno, f"os.{callee}() mode", call.args[mode]))
    if fallback is not None and len(call.args) == fallback + 1:
        sites.append((call.args[fallback].lineno, f"{callee}() fallback", call.args[fallback]))
    for keyword in call.keywords:
        if keyword.arg == "mode" and mode is not None:
            sites.append((keyword.value.lineno, f"os.{callee}(mode=)", keyword.value))
        elif keyword.arg == "default" and callee in ("add_argument", "field"):
            sites.append((keyword.value.lineno, f"{callee}(default=)", keyword.value))
        elif keyword.arg is not None and keyword.arg in homed.get(callee, ()):
            sites.append((keyword.value.lineno, f"{callee}({keyword.arg}=)", keyword.value))
    return sites
