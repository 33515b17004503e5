"""The public face (``packcache/__init__.py``): what ``import packcache`` offers."""

from __future__ import annotations

import os

import packcache


def test_exported_members_are_sorted_and_complete() -> None:
    assert packcache.__all__ == sorted(packcache.__all__)
    public = {n for n in dir(packcache) if not n.startswith("_") and not isinstance(getattr(packcache, n), type(os))}
    assert public - {"annotations"} == set(packcache.__all__) - {"__version__"}
