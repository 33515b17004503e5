"""States and reasons (``packcache.stats``): a known failure makes the state ``degraded`` before any
pack shows it; ``heap_reason`` names a failure before a bigger legitimate reason.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import packcache
from harness import KEY, KIB, build_keyed, packed
from packcache import WeightCache

# --------------------------------------------------------------------------- what the state says


def test_a_file_that_cannot_be_opened_shows_degraded_before_any_pack(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    with WeightCache(blocker / "m.pcache") as cache:
        with cache.session():
            pass  # nothing requested yet
        st = cache.stats()
        assert (st.state, st.errno, st.failing) == ("degraded", errno.ENOTDIR, True)
        assert cache.get_option("packed_cache_state") == "degraded"
        assert packcache.get_option("packed_cache_state") == "degraded"


def test_an_untrusted_file_shows_degraded_before_any_pack(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build_keyed(path, {"a": 1})
    os.chmod(path, 0o666)
    with WeightCache(path) as cache:
        with cache.session():
            pass
        assert cache.stats().state == "degraded"


def test_aggregate_heap_reason_names_the_failure_not_a_bigger_legitimate_reason(tmp_path: Path) -> None:
    opted_out = WeightCache(None)
    path = tmp_path / "m.pcache"
    build_keyed(path, {"a": 1})
    failing = WeightCache(path, read_only=True)
    with opted_out.session() as s:
        s.get_or_pack("big", lambda: packed(1, 1024 * KIB), KEY)
    with failing.session() as s:
        s.get_or_pack("a", lambda: packed(1), KEY)  # mapped: the aggregate is degraded, not heap
        s.get_or_pack("small", lambda: packed(2, 4 * KIB), KEY)
    total = packcache.aggregate_stats()
    assert total.state == "degraded"
    assert total.heap_reason == "read_only"
    assert packcache.get_option("packed_cache_heap_reason") == "read_only"
    opted_out.close()
    failing.close()
