"""Fleets: caches built once, shipped to every machine of their platform class (docs/FLEET.md).

Layout of a store (one URL prefix; every key relative to it)::

    blobs/sha256/<64 hex>.pcache          immutable, content-addressed cache files (create-only)
    manifests/<model>/<class>.json        one signed manifest per (model, platform class)

``<model>`` is the cache file's name without ``.pcache`` (default names are content-derived:
``identity.model_cache_name``); ``<class>`` is :func:`packcache.fleet.platform.platform_class`.

Modules: :mod:`.stores` (the store interface; a directory store in the stdlib, object stores
through ``obstore``), :mod:`.manifest` (manifests and their ed25519 signatures), :mod:`.keys`
(key files), :mod:`.platform` (platform classes), :mod:`.probe` (graded verdicts from a header),
:mod:`.publish`, :mod:`.fetch` and :mod:`.names` (published names). Reading (fetch, probe, names)
never imports writing (publish). Only :mod:`.stores`' object store and :mod:`.keys` need the ``fleet``
extra (``obstore``, ``cryptography``); each imports it when used.
"""

from __future__ import annotations

__all__: list[str] = []
