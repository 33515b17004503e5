"""Real models run end to end on packed weights from the cache.

Each model is its own module, imported by name (it imports torch):

- :mod:`packcache.models.minilm`: all-MiniLM-L6-v2 sentence embeddings.

Importing this package imports nothing heavy.
"""

from __future__ import annotations

__all__: list[str] = []
