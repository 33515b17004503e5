"""Every default value of packcache, in one place (diskcache's ``DEFAULT_SETTINGS``, httpx's ``_config.py``).

Constants only: no function, no import from packcache, nothing mutable. Whoever takes a default takes it
from here, by name, so a default is written once.

The rule, everywhere: a parameter whose default is ``None`` means "the default", and an explicit
value always wins. For the four cache options (:data:`OPTIONS`) "the default" is the
*process* default, :data:`packcache._registry.DEFAULTS`, a mutable copy of :data:`OPTIONS`
that :func:`packcache.set_option` changes; for everything else it is the constant here
(:data:`SCHEME` resolved through :func:`packcache.loader.resolve_scheme`).

>>> SCHEME, GROUP_SIZE, LOCK_TIMEOUT
('auto', 32, 30.0)
>>> sorted(OPTIONS)
['enabled', 'lock_timeout', 'read_only', 'verify']
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

__all__ = [
    "ALIGNMENT",
    "DIR_MODE",
    "FETCH_DEADLINE",
    "FETCH_PART_BYTES",
    "FETCH_STREAMS",
    "FILE_MODE",
    "GROUP_SIZE",
    "GROUP_SIZES",
    "KERNEL_PATH",
    "LLM_MAX_BATCH_TOKENS",
    "LLM_MAX_MODEL_LEN",
    "LLM_MAX_SEQS",
    "LLM_PAGE_SIZE",
    "LOCK_TIMEOUT",
    "OPTIONS",
    "REMOTE_TIMEOUT",
    "SCHEME",
]

# --------------------------------------------------------------------------- loading a model

#: The weight scheme of the linear layers: ``"auto"`` is the one fast on this CPU
#: (:func:`packcache.kernels.default_scheme`: int8 with torch's vectorised kernels, else fp32).
SCHEME = "auto"

#: Input features per scale of the int4 scheme. Ignored by the other schemes.
GROUP_SIZE = 32

#: The int4 group sizes there are (``packcache.packers_torch.Int4WeightOnly.GROUP_SIZES``; a test checks they
#: agree): named here so the command line offers them without importing torch.
GROUP_SIZES = (32, 64, 128)

#: The kernel path: ``None`` lets ``$PACKCACHE_KERNEL_PATH``, then the machine's rule, choose
#: (:mod:`packcache.kernels`).
KERNEL_PATH: str | None = None

# --------------------------------------------------------------------------- generating (serve, a causal LM)

#: Sequences one worker generates together (``max_seqs``): the width of a step and, with :data:`LLM_MAX_MODEL_LEN`,
#: the size of the KV cache.
LLM_MAX_SEQS = 16

#: Prompt and completion tokens of one sequence when none is given (``max_model_len``): the model's
#: ``max_position_embeddings``, at most this.
LLM_MAX_MODEL_LEN = 4096

#: Tokens per block of the paged KV cache.
LLM_PAGE_SIZE = 64

#: Tokens one step reads at most: a longer prompt is read in chunks of this many, between decode steps.
LLM_MAX_BATCH_TOKENS = 512

# --------------------------------------------------------------------------- a cache (WeightCache)

#: Seconds a writer waits for another process's build lock (option ``packed_cache_lock_timeout``).
LOCK_TIMEOUT = 30.0

#: The four cache options' defaults, keyed as :class:`packcache.WeightCache` names its arguments and
#: attributes; read-only (``packcache._registry.DEFAULTS`` is the process's mutable copy, which
#: :func:`packcache.set_option` changes).
OPTIONS: MappingProxyType[str, Any] = MappingProxyType({
    "enabled": True,  # caching on (option ``packed_cache_enabled``)
    "lock_timeout": LOCK_TIMEOUT,  # option ``packed_cache_lock_timeout``
    "read_only": False,  # may write (option ``packed_cache_read_only``)
    "verify": False,  # a hit's checksum is not read again: that reads every page (option ``packed_cache_verify``)
})  # fmt: skip

#: Byte alignment of every pack in a new cache file.
ALIGNMENT = 64

#: Permission bits of a new cache file, and of a directory created for one (never group/world-writable).
FILE_MODE = 0o600
DIR_MODE = 0o700

#: Seconds for everything one fetch from a store asks it (``remote=``, ``--remote-timeout``).
REMOTE_TIMEOUT = 10.0

#: Seconds ``packcache fetch`` gives the whole fetch, a long healthy download included (``--deadline``); a
#: store that stops answering ends it after :data:`REMOTE_TIMEOUT` (``--timeout``).
FETCH_DEADLINE = 600.0

#: Range reads a fetch runs at once, and the bytes of each (benchmarks/fetch_speed.py chose them: 8 streams of
#: 32 MiB reach the server's speed on loopback; memory in flight is 8 chunks of 256 KiB, not the parts).
FETCH_STREAMS = 8
FETCH_PART_BYTES = 32 << 20
