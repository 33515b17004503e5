"""Old import paths of modules that became private, kept working for one release.

The internal modules are private (``packcache.store`` is now ``packcache._store``,
and so on; CHANGELOG, "Changed"). Code that imported an old path keeps working
for one release and gets a :class:`DeprecationWarning` naming the new one. The
alias is the same module object, not a copy.

Installed once, by ``packcache/__init__.py``; a finder that answers only for the
names in :data:`MOVED`. The import system sets ``__spec__`` and ``__loader__`` on
whatever module a loader creates, so the loader creates a throw-away placeholder and
puts the real module in ``sys.modules`` in its place: the real module keeps its own
spec, and ``importlib.reload`` of it (by either name) executes its source again.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

from . import _boundedjson, _ledger, _mapping, _paths, _store

__all__ = ["install"]

#: old public path -> the private module that holds the code now
MOVED = {
    "packcache.boundedjson": _boundedjson,
    "packcache.ledger": _ledger,
    "packcache.mapping": _mapping,
    "packcache.paths": _paths,
    "packcache.store": _store,
}


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # A placeholder, never the real module: the import system sets __spec__ and __loader__ on
        # what this returns, and on the real module they would make reload() reload the alias.
        return ModuleType(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        old, new = module.__name__, MOVED[module.__name__]
        warnings.warn(
            f"{old} is internal and has moved to {new.__name__}; the old name goes away in the next release",
            DeprecationWarning,
            stacklevel=2,  # the import statement: warnings skips importlib's own frames
        )
        # The import returns what sys.modules holds after exec_module (a module may replace itself
        # there), so the old name is the same module object, with its own spec untouched.
        sys.modules[old] = new


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _Aliases) for finder in sys.meta_path):
        sys.meta_path.append(_Aliases())
