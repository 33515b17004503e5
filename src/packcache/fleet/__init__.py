"""Fleets: caches built once, shipped to every machine of their platform class (docs/FLEET.md).

Layout of a store (one URL prefix; every key relative to it)::

    blobs/sha256/<64 hex>.pcache          immutable, content-addressed cache files (create-only)
    manifests/<model>/<class>.json        one signed manifest per (model, platform class)

``<model>`` is the cache file's name without ``.pcache`` (default names are content-derived:
``identity.model_cache_name``); ``<class>`` is :func:`packcache.fleet.platform.platform_class`.

Modules: :mod:`.stores` (the store interface; a directory store in the stdlib, object stores
through ``obstore``), :mod:`.manifest` (manifests, ed25519 signatures, keys),
:mod:`.platform` (platform classes), :mod:`.probe` (graded verdicts from a header),
:mod:`.publish` and :mod:`.fetch`. Only :mod:`.stores`' object store and :mod:`.manifest`'s
signing need the ``fleet`` extra (``obstore``, ``cryptography``); each imports it when used.
"""

from __future__ import annotations

__all__: list[str] = []
