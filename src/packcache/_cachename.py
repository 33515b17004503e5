"""A default cache file's name, made of what its packs are made of.

:func:`model_cache_name` hashes the sources' content identities (:attr:`packcache.identity.FileDigest.identity`),
the packers and the recipe (calibration), never a path, a name or a time: every copy of one checkpoint, at
any path or on any machine, opens one file, and two recipes never share one. The loaders (``minilm``, ``hf``)
put it in their default cache directory; ``packcache publish`` and ``fetch`` rely on the name meaning the
same on every machine.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

__all__ = ["model_cache_name"]


class _PackerLike(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def params(self) -> dict[str, Any]: ...


_LABEL = re.compile(r"[^a-z0-9_]+")


def model_cache_name(
    label: str,
    scheme: str,
    sources: Iterable[str],
    packers: Iterable[_PackerLike],
    recipe: Mapping[str, Any] | str | None = None,
) -> str:
    """A default cache file name made of what its packs are made of: ``<label>-<scheme>-<16 hex>.pcache``.

    The hex digits are a sha256 over the sources' identities (sorted: shard order and names do
    not matter), the packers' ids, versions and parameters, and ``recipe`` (what else a loader
    packs by, e.g. its calibration). ``label`` (a model type, say) is only for people reading
    the directory. No path, name, mtime, inode or device enters: every copy of one model opens
    one file, and two recipes never share one.

    Raises:
        ValueError: ``scheme`` is not 1 to 16 lowercase letters and digits.

    >>> from packcache.packers import Float32
    >>> name = model_cache_name("bert", "fp32", ["sha256:" + "0" * 64 + ":8"], [Float32()])
    >>> name.startswith("bert-fp32-") and name.endswith(".pcache") and len(name) == len("bert-fp32-") + 16 + 7
    True
    >>> model_cache_name("BERT!", "fp32", ["sha256:" + "0" * 64 + ":8"], [Float32()]) == name  # only for reading
    True
    """
    if not re.fullmatch(r"[a-z0-9]{1,16}", scheme):
        raise ValueError(f"scheme must be a short lowercase name, got {scheme!r}")
    described = {
        "sources": sorted(sources),
        "packers": [{"id": p.id, "version": p.version, "params": p.params} for p in packers],
        "recipe": recipe,
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    shown = _LABEL.sub("-", label.lower()).strip("-")[:32] or "model"
    return f"{shown}-{scheme}-{digest[:16]}.pcache"
