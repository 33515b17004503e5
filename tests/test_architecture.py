"""The package's shape, checked: one-way imports in the layers docs/ARCHITECTURE.md lists, each
module's ``__all__`` matching what the rest of the package takes from it, private rooms private.

The import graph is read from the source (every ``import``: at module level, inside a function,
and inside ``if TYPE_CHECKING:`` blocks), so an import hidden in a function to dodge a loop counts
like any other, and so does a type-only one: a reader of the imports sees it all the same.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import warnings
from pathlib import Path

import pytest

import packcache

SRC = Path(packcache.__file__).resolve().parent
ARCHITECTURE = SRC.parents[1] / "docs" / "ARCHITECTURE.md"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


@functools.cache  # the source does not change during a run; one test asks for every module's imports per module
def _imports(module: str) -> tuple[tuple[str, str | None], ...]:
    """(module imported, name taken from it or None) for every import of ``module`` that runs."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            walk_one(child)  # an ``if TYPE_CHECKING:`` block too: a type-only import is still an edge

    def walk_one(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "packcache" or target.startswith("packcache."):
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    if submodule in MODULES:
                        found.append((submodule, None))
                        aliases[alias.asname or alias.name] = submodule  # its names are taken as attributes
                    else:
                        found.append((target, alias.name))
        elif isinstance(node, ast.Import):
            found.extend((a.name, None) for a in node.names if a.name.startswith("packcache"))
        walk(node)

    aliases: dict[str, str] = {}
    tree = ast.parse(path.read_text())
    walk(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append((aliases[node.value.id], node.attr))
    return tuple((target, name) for target, name in found if target != module)


GRAPH = {module: sorted({target for target, _ in _imports(module)}) for module in MODULES}


def _layers() -> dict[str, int]:
    """Layer of each module, from the table in docs/ARCHITECTURE.md ("| 0 | `errors`, ... |")."""
    layers: dict[str, int] = {}
    for line in ARCHITECTURE.read_text().splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if row:
            for name in re.findall(r"`([\w.]+)`", row.group(2)):
                layers["packcache" if name == "packcache" else f"packcache.{name}"] = int(row.group(1))
    return layers


def test_the_import_graph_has_no_cycle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in GRAPH[module]:
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target in GRAPH and state.get(target) is None:
                visit(target)
        path.pop()
        state[module] = 2

    for module in GRAPH:
        if module not in state:
            visit(module)


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_layers() -> None:
    layers = _layers()
    assert sorted(set(MODULES) - set(layers)) == [], "modules missing from docs/ARCHITECTURE.md's table"
    assert sorted(set(layers) - set(MODULES)) == [], "docs/ARCHITECTURE.md lists modules that do not exist"
    upward = [
        f"{module} (layer {layers[module]}) imports {target} (layer {layers[target]})"
        for module, targets in GRAPH.items()
        for target in targets
        if target in layers and layers[target] > layers[module]
    ]
    assert upward == []


def _exported(module: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return list(importlib.import_module(module).__all__)


def test_names_taken_from_another_module_are_in_its_all() -> None:
    missing = [
        f"{module} imports {name} from {target}, which does not export it"
        for module in MODULES
        for target, name in _imports(module)
        if name is not None and name != "*" and not name.startswith("__") and target in MODULES
        and name not in _exported(target)
    ]
    assert missing == []


def test_a_private_module_exports_exactly_what_the_package_takes_from_it() -> None:
    for module in MODULES:
        if not module.rpartition(".")[2].startswith("_") or module.endswith("__main__"):
            continue
        taken = {name for other in MODULES for target, name in _imports(other) if target == module and name}
        taken.discard("*")
        assert sorted(_exported(module)) == sorted(taken), module


def test_every_name_in_all_exists() -> None:
    for module in MODULES:
        if module.endswith("__main__"):
            continue
        loaded = importlib.import_module(module)
        assert [name for name in _exported(module) if not hasattr(loaded, name)] == [], module


def test_the_public_face_is_unchanged() -> None:
    assert sorted(packcache.__all__) == sorted([
        "CacheState", "CacheStats", "CompactReport", "FormatError", "GcFile", "GcReport", "HeapReason",
        "InspectEntry", "InspectReport", "LockTimeoutError", "NonFiniteWeightError", "OPTION_KEYS", "OptionError",
        "OptionTypeError", "OptionValueError", "PackCacheError", "PackKey", "PackResultError", "ReadOnlyOptionError",
        "Session", "SessionError",
        "UntrustedFileError", "VerifyProblem", "VerifyReport", "WeightCache", "__version__", "aggregate_stats",
        "compact", "gc", "get_option", "inspect", "set_option", "verify",
    ])  # fmt: skip


def test_internal_faults_stay_inside_the_file_layer_and_the_session() -> None:
    """``Fault`` (a cache problem on its way to a heap reason) is made by the file layer, recorded by the
    ledger and ended by the session: only their modules take it at run time, and no public namespace has it."""
    users = sorted(module for module in MODULES for target, name in _imports(module) if name == "Fault")
    file_layer = ["packcache._store", "packcache._store_lock", "packcache._store_state", "packcache._store_write"]
    session = ["packcache._routing", "packcache._session", "packcache._commit"]
    assert users == sorted(["packcache._ledger", *file_layer, *session])
    from packcache._faults import Fault

    assert Fault.__module__ == "packcache._faults"
    public = [m for m in MODULES if not any(part.startswith("_") for part in m.split("."))]
    assert [m for m in public if "Fault" in _exported(m)] == []


#: The fleet's reading side (docs/ARCHITECTURE.md, "Each rule has one home"): a machine that only fetches or
#: probes runs none of publishing's code, and a change to publishing cannot break reading.
FLEET_READERS = ("packcache.fleet.fetch", "packcache.fleet.probe", "packcache.fleet.names")


def _reached(module: str) -> set[str]:
    """Every packcache module ``module`` imports, directly or through others (the graph read from the source)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for target in GRAPH.get(todo.pop(), ()):
            if target in MODULES and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("reader", FLEET_READERS)
def test_fleet_reading_never_imports_fleet_writing(reader: str) -> None:
    """What publish and fetch both need (the model a file is published under) lives in ``fleet.manifest``."""
    assert reader in MODULES
    assert "packcache.fleet.publish" not in _reached(reader), f"{reader} reaches packcache.fleet.publish"
