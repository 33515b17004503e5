from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from packcache import _registry

# Hypothesis writes under its home directory even with database=None; keep it out of the work tree.
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="packcache-hypothesis-"))
# The per-user digest cache (packcache.identity) of this run, not the user's own; child processes inherit it.
# Tests that count how a digest was found set their own.
os.environ["PACKCACHE_DIGEST_DIR"] = tempfile.mkdtemp(prefix="packcache-digests-")


@pytest.fixture(autouse=True)
def _restore_process_defaults() -> Iterator[None]:
    """Process-wide option defaults changed by a test must not leak into the next."""
    saved = dict(_registry.DEFAULTS)
    yield
    _registry.DEFAULTS.clear()
    _registry.DEFAULTS.update(saved)
