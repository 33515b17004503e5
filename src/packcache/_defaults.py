"""Every default value of packcache, in one place (diskcache's ``DEFAULT_SETTINGS``, httpx's ``_config.py``).

Constants only: no function, no import from packcache, nothing mutable. Whoever takes a default takes it
from here, by name, so a default is written once: ``tests/test_defaults.py`` reports any value of this module
written again as a literal where a default is written (a parameter, a field, an option, a fallback, a mode).
Two constants may share a value and still be two defaults (``LOCK_TIMEOUT`` and ``GRACEFUL_TIMEOUT``); one
default that two places name is one constant here, aliased where its meaning is the same (``FILE_MODE``).

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
    "BATCH_WAIT",
    "BODY_TIMEOUT",
    "BUILD_LOADER",
    "DIR_MODE",
    "EMBED_BATCH_SIZE",
    "FETCH_DEADLINE",
    "FETCH_LOADER",
    "FETCH_PART_BYTES",
    "FETCH_STREAMS",
    "FILE_CHECK_BYTES_PER_SECOND",
    "FILE_MODE",
    "GRACEFUL_TIMEOUT",
    "GROUP_SIZE",
    "GROUP_SIZES",
    "HEADER_TIMEOUT",
    "KERNEL_PATH",
    "LLM_MAX_BATCH_TOKENS",
    "LLM_MAX_MODEL_LEN",
    "LLM_MAX_SEQS",
    "LLM_MAX_TOKENS",
    "LLM_PAGE_SIZE",
    "LOCK_TIMEOUT",
    "MANIFEST_EXPIRY",
    "MAX_BATCH_TOKENS",
    "MAX_BODY_BYTES",
    "MAX_TEXTS",
    "MAX_TEXT_CHARS",
    "OPTIONS",
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "PROBE_TIMEOUT",
    "PUBLISH_TIMEOUT",
    "REMOTE_TIMEOUT",
    "SCHEME",
    "SEND_TIMEOUT",
    "SERVE_ENGINE",
    "SERVE_HOST",
    "SERVE_LOADER",
    "SERVE_LOG_LEVEL",
    "SERVE_PORT",
    "SERVE_TIMEOUT",
    "SHARED_DIR_MODE",
    "SHARED_FILE_MODE",
]

# --------------------------------------------------------------------------- loading a model

#: The weight scheme of the linear layers: ``"auto"`` is the one fast on this CPU
#: (:func:`packcache.native.default_scheme`: int8 where packcache's compiled kernels run, else fp32).
SCHEME = "auto"

#: Input features per scale of the int4 scheme. Ignored by the other schemes.
GROUP_SIZE = 32

#: The int4 group sizes there are (``packcache.packers_torch.Int4WeightOnly.GROUP_SIZES``; a test checks they
#: agree): named here so the command line offers them without importing torch.
GROUP_SIZES = (32, 64, 128)

#: The kernel path: ``None`` lets ``$PACKCACHE_KERNEL_PATH``, then the machine's rule, choose
#: (:mod:`packcache.kernels`).
KERNEL_PATH: str | None = None

#: Texts one forward of a sentence-transformers model a worker runs takes together: sentence-transformers' own
#: ``encode`` default. (:meth:`packcache.models.minilm.MiniLM.embed` bounds a forward by its tokens alone: each text
#: attends over its own tokens, so a pass of many texts pads nothing.)
EMBED_BATCH_SIZE = 32

#: ``packcache build``'s ``--loader``: ``auto`` is ``cli._model.default_loader``'s rule (the MiniLM loader where
#: it reads the checkpoint and ``serve`` runs it on the MiniLM engine, else ``packcache.hf``), because a build is
#: for a checkpoint of any architecture and should make the file ``run``, ``serve`` or ``hf`` will map.
BUILD_LOADER = "auto"

#: ``packcache fetch``'s ``--loader``: build's rule, so a fetch with default flags names the file a build with
#: default flags published.
FETCH_LOADER = BUILD_LOADER

#: The loader ``serve`` (and ``run``) use when no ``--model`` picks one: the bundled all-MiniLM-L6-v2 is read by
#: the MiniLM loader, whose int4 is calibrated (``serve --model`` decides by
#: ``server.modelfiles.choose_loader``; there is no ``--loader`` to give).
SERVE_LOADER = "minilm"

# --------------------------------------------------------------------------- serving (packcache serve)

#: What each worker runs: packcache's engine (``sentence-transformers``: the float32 baseline, no cache).
SERVE_ENGINE = "packcache"

#: Where the server listens: loopback, so a server is reachable from elsewhere only when asked to be.
SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8000

#: Seconds a worker's application may spend on one request (or on loading) before the master replaces it:
#: above :data:`LOCK_TIMEOUT`, so a worker waiting for another's build is not killed for it.
SERVE_TIMEOUT = 60.0

#: Seconds the workers get after SIGTERM (or SIGHUP's rolling restart) to finish their requests.
GRACEFUL_TIMEOUT = 30.0

#: gunicorn's log level.
SERVE_LOG_LEVEL = "info"

#: Bytes per second the background check of a served cache file reads at most (``packcache serve``: each pack's
#: checksum once, after the load, at nice 19): MiniLM int8 in under a second, a 4 GB file in about a minute,
#: and never a disk's whole bandwidth.
FILE_CHECK_BYTES_PER_SECOND = 64 << 20

#: Texts per request: a batch that takes seconds, not minutes, on one core.
MAX_TEXTS = 256

#: Characters per text (the model reads its first ``max_tokens`` tokens of it).
MAX_TEXT_CHARS = 10_000

#: Bytes of one request's body.
MAX_BODY_BYTES = 4 << 20

#: Seconds a client gets for the request line and headers, for a whole body, and to take a whole response.
HEADER_TIMEOUT = 10.0
BODY_TIMEOUT = 10.0
SEND_TIMEOUT = 10.0

#: Tokens per forward when a worker merges concurrent embedding requests (TEI's ``--max-batch-tokens`` default).
MAX_BATCH_TOKENS = 16384

#: Seconds a forward with room left may wait for more requests (only while another connection is sending one).
BATCH_WAIT = 0.001

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

#: The most tokens one request may generate, and a chat request's default when it names none.
LLM_MAX_TOKENS = 2048

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

#: Permission bits of what packcache keeps for this user alone whatever the umask (records beside a cache file,
#: the digest cache, a metrics directory, a private signing key, a bundle's extracted files).
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700

#: Permission bits of what a directory store holds, there for other users to read (objects and their
#: directories), and of a public key.
SHARED_FILE_MODE = 0o644
SHARED_DIR_MODE = 0o755

#: Permission bits of a new cache file, and of a directory created for one (never group/world-writable): private
#: unless ``file_mode``/``dir_mode`` say otherwise.
FILE_MODE = PRIVATE_FILE_MODE
DIR_MODE = PRIVATE_DIR_MODE

#: Seconds one fetch from a store may spend waiting on it, every call together (``remote=``, ``--remote-timeout``;
#: the machine's own work, hashing and verifying, does not count: docs/FLEET.md, "Deadline").
REMOTE_TIMEOUT = 10.0

#: Seconds ``packcache fetch`` may spend waiting on the store, a long healthy download included (``--deadline``); a
#: store that stops answering ends it after :data:`REMOTE_TIMEOUT` (``--timeout``).
FETCH_DEADLINE = 600.0

#: Range reads a fetch runs at once, and the bytes of each (benchmarks/fetch_speed.py chose them: 8 streams of
#: 32 MiB reach the server's speed on loopback; memory in flight is 8 chunks of 256 KiB, not the parts).
FETCH_STREAMS = 8
FETCH_PART_BYTES = 32 << 20

# --------------------------------------------------------------------------- a fleet (publish, probe)

#: Seconds ``packcache publish`` may spend waiting on the store (``--timeout``): what a fetch gives the whole download.
PUBLISH_TIMEOUT = FETCH_DEADLINE

#: Seconds a published manifest stays valid (``publish --expires-days``): a month, so a fleet that stops
#: publishing stops trusting old manifests.
MANIFEST_EXPIRY = 30 * 86400

#: Seconds for a probe's reads of a URL (``packcache probe --timeout``).
PROBE_TIMEOUT = 30.0
