from __future__ import annotations

from collections.abc import Iterator

import pytest

from packcache import cache as cache_mod


@pytest.fixture(autouse=True)
def _restore_process_defaults() -> Iterator[None]:
    """Process-wide option defaults changed by a test must not leak into the next."""
    saved = dict(cache_mod.DEFAULTS)
    yield
    cache_mod.DEFAULTS.clear()
    cache_mod.DEFAULTS.update(saved)
