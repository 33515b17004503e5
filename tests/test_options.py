"""The option channel (``packcache.options``) and the process-wide state behind it
(``packcache._registry``: option defaults and the live caches ``aggregate_stats`` sums).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import packcache
from packcache import WeightCache
from test_cache import load


def test_unknown_option_key_is_a_key_error_naming_close_matches() -> None:
    cache = WeightCache(None)
    for get in (cache.get_option, packcache.get_option):
        with pytest.raises(KeyError) as info:
            get("packed_cache_heap_mb")
        assert isinstance(info.value, packcache.OptionError)
        assert "'packed_cache_heap_mib'" in str(info.value)
    with pytest.raises(packcache.OptionError, match="did you mean 'packed_cache_lock_timeout'"):
        cache.set_option("packed_cache_lock_timout", 3.0)
    cache.close()


def test_writing_a_read_only_key_or_a_wrong_type_raises() -> None:
    cache = WeightCache(None)
    with pytest.raises(packcache.ReadOnlyOptionError, match="read-only"):
        cache.set_option("packed_cache_state", "mapped")
    with pytest.raises(packcache.ReadOnlyOptionError):
        packcache.set_option("packed_cache_heap_bytes", 0)
    with pytest.raises(TypeError, match="bool"):
        cache.set_option("packed_cache_read_only", 1)
    with pytest.raises(packcache.OptionTypeError):
        packcache.set_option("packed_cache_lock_timeout", "5")
    with pytest.raises(packcache.OptionValueError, match=">= 0"):
        cache.set_option("packed_cache_lock_timeout", -1.0)
    with pytest.raises(packcache.OptionValueError, match="no path"):
        cache.set_option("packed_cache_enabled", True)
    cache.close()


def test_option_values_match_stats(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "m.pcache") as cache:
        load(cache, {"w": np.ones(1 << 18, np.float32)})
        with cache.session() as s:
            s.get_or_pack(None, lambda: np.ones(1 << 17, np.float32))
        st = cache.stats()
        assert cache.get_option("packed_cache_state") == st.state == "stored"
        assert cache.get_option("packed_cache_mapped_mib") == 1.0
        assert cache.get_option("packed_cache_heap_mib") == 0.5
        assert cache.get_option("packed_cache_heap_bytes") == st.heap_bytes == 1 << 19
        assert cache.get_option("packed_cache_heap_reason") == "unnamed"
        assert cache.get_option("packed_cache_errno") == 0
        assert cache.get_option("packed_cache_file_mib") == st.file_bytes / 2**20 > 1.0
        cache.set_option("packed_cache_lock_timeout", 2)
        assert cache.get_option("packed_cache_lock_timeout") == 2.0
    for key in packcache.OPTION_KEYS:
        packcache.get_option(key)  # every key readable process-wide


def test_process_wide_defaults_apply_to_caches_created_afterwards(tmp_path: Path) -> None:
    packcache.set_option("packed_cache_enabled", False)
    packcache.set_option("packed_cache_lock_timeout", 0.5)
    with WeightCache(tmp_path / "m.pcache") as cache:
        assert cache.get_option("packed_cache_lock_timeout") == 0.5
        load(cache, {"w": np.ones(3)})
        assert cache.stats().state == "off" and cache.stats().heap_reason == "disabled"


# --------------------------------------------------------------------------- live caches (_registry)


def test_aggregate_stats_sums_live_caches(tmp_path: Path) -> None:
    before = packcache.aggregate_stats()
    off, on = WeightCache(None), WeightCache(tmp_path / "m.pcache")
    load(off, {"a": np.ones(10, np.int8)})
    load(on, {"b": np.ones(20, np.int8)})
    agg = packcache.aggregate_stats()
    assert agg.heap_bytes - before.heap_bytes == 10 and agg.mapped_bytes - before.mapped_bytes == 20
    assert packcache.get_option("packed_cache_mapped_bytes") == agg.mapped_bytes
    off.close()
    on.close()
    assert packcache.aggregate_stats().mapped_bytes == before.mapped_bytes
