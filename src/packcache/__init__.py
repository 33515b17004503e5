"""packcache: a memory-mapped cache for packed model weights that accounts for every byte.

>>> import packcache, numpy as np
>>> cache = packcache.WeightCache(None)  # caching off: everything goes to heap, and says so
>>> with cache.session() as s:
...     w = s.get_or_pack("w", lambda: np.zeros(4, np.float32))
>>> cache.stats().heap_bytes_by_reason["disabled"], cache.stats().state
(16, 'off')
>>> cache.close()
"""

from __future__ import annotations

from .cache import PackKey, Session, WeightCache, aggregate_stats
from .errors import (
    FormatError,
    LockTimeoutError,
    NonFiniteWeightError,
    OptionError,
    OptionTypeError,
    OptionValueError,
    PackCacheError,
    PackResultError,
    ReadOnlyOptionError,
    SessionError,
    UntrustedFileError,
)
from .maintenance import (
    CompactReport,
    GcFile,
    GcReport,
    InspectEntry,
    InspectReport,
    VerifyProblem,
    VerifyReport,
    compact,
    gc,
    inspect,
    verify,
)
from .options import OPTION_KEYS, get_option, set_option
from .stats import CacheState, CacheStats, HeapReason

__version__ = "0.1.0"

__all__ = [
    "CacheState",
    "CacheStats",
    "CompactReport",
    "FormatError",
    "GcFile",
    "GcReport",
    "HeapReason",
    "InspectEntry",
    "InspectReport",
    "LockTimeoutError",
    "NonFiniteWeightError",
    "OPTION_KEYS",
    "OptionError",
    "OptionTypeError",
    "OptionValueError",
    "PackCacheError",
    "PackKey",
    "PackResultError",
    "ReadOnlyOptionError",
    "Session",
    "SessionError",
    "UntrustedFileError",
    "VerifyProblem",
    "VerifyReport",
    "WeightCache",
    "__version__",
    "aggregate_stats",
    "compact",
    "gc",
    "get_option",
    "inspect",
    "set_option",
    "verify",
]
