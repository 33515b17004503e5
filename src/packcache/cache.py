"""Weight caches: one cache file (or none), the sessions that load from it, and its statistics.

A :class:`WeightCache` owns one cache file (or none: caching off), its options, its ledger and, with
``remote=``, the store it reads through. A :meth:`WeightCache.session` is one model load
(:class:`~packcache._session.Session`, which routes each request by docs/ROUTING.md's table). A cache
problem is counted, logged once per reason and answered with a heap pack; it never raises.

Statistics are read without any lock: the bookkeeping (:class:`~packcache._ledger.Ledger`)
is changed under the session's mutex and read through a sequence counter, so
:meth:`WeightCache.stats` and :func:`aggregate_stats` never wait on a session
and never see a half-made change.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from . import _defaults, _registry
from . import format as fmt
from ._checks import PackKey, Request, check_mode, check_remote_timeout, check_timeout
from ._ledger import Ledger
from ._owner import CacheState, Owner
from ._registry import DEFAULTS, aggregate_stats, register, unregister
from ._remote import ReadThrough, take_fetched
from ._session import Session, SessionState
from ._store import FileStore
from ._storeurl import StoreURL
from .errors import SessionError
from .options import get_instance_option, set_instance_option
from .stats import CacheStats

__all__ = ["PackKey", "Request", "Session", "SessionState", "WeightCache", "aggregate_stats", "live_caches"]


def live_caches() -> list[WeightCache]:
    """Every :class:`WeightCache` of this process that is alive and not closed; takes no cache's lock."""
    return [cache for cache in _registry.live_caches() if isinstance(cache, WeightCache)]  # only caches register


class WeightCache:
    """A cache of packed weights in one memory-mapped file.

    Args:
        path: the cache file, or ``None`` to turn caching off (every pack goes to
            heap with reason ``disabled``, and the state is ``off``).
        read_only: never write; missing entries go to heap with reason ``read_only``.
            ``None`` takes the process default (``packed_cache_read_only``, off unless changed).
        lock_timeout: seconds to wait for another process's build lock before
            packing to heap with reason ``locked``; ``None`` takes the process
            default (``packed_cache_lock_timeout``, 30 s unless changed).
        alignment: byte alignment of every pack in a new file (power of two, 64..1 MiB; default 64).
        platform: JSON-serialisable mapping identifying what makes packs valid on
            this machine (packer versions, framework version, CPU capability).
            A file made under another platform is rebuilt.
        enabled: ``False`` turns caching off; ``None`` takes the process default
            (``packed_cache_enabled``, on unless changed).
        file_mode: permission bits of new cache files (default ``0o600``); never group/world-writable.
        dir_mode: permission bits of directories created for them (default ``0o700``); same rule.
        verify: check each hit's checksum before serving it (reads every page of
            the pack, so off by default); a pack that fails is packed and stored again.
            ``None`` takes the process default (``packed_cache_verify``, off unless changed).
        remote: a store URL (``s3://bucket/prefix``, ``gs://...``, ``file:///dir`` or a plain
            directory; docs/FLEET.md). At a session's first miss, before packing, the cache fetches
            the file published there for its model (the file's name without ``.pcache``) and this
            platform, checked, into ``path``. A clean local hit never asks the store; a store
            problem is a counted remote miss (``CacheStats.remote_misses_by_reason``), never an
            error: the load packs locally.
        remote_timeout: seconds for everything one fetch asks the store (manifest, header, blob).
        trusted_keys: ed25519 public keys (SubjectPublicKeyInfo PEM: ``bytes`` of the PEM, or the
            path of a ``.pub.pem`` file); one of them must have signed the manifest.
        allow_unsigned: accept manifests nobody signed (a private store you trust as it is).

    Raises:
        ValueError/TypeError: for invalid arguments (an empty path, a writable mode, ...),
            never for a problem with the file.

    The four cache options (``read_only``, ``lock_timeout``, ``enabled``, ``verify``) follow one rule:
    ``None`` takes the process default (:func:`packcache.set_option`) as the cache is made, and an
    explicit value always wins over it, ``False`` included (an explicit ``verify=False`` never verifies, whatever
    the process default says). The defaults themselves are written once, in
    :mod:`packcache._defaults`.

    >>> import numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with WeightCache(os.path.join(d, "model.pcache")) as cache:
    ...     with cache.session() as s:
    ...         w = s.get_or_pack("layer0.weight", lambda: np.ones((2, 3), np.float32))
    ...     cache.stats().state, cache.stats().stored, w.flags.writeable
    ('stored', 1, False)
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        read_only: bool | None = None,
        lock_timeout: float | None = None,
        alignment: int = _defaults.ALIGNMENT,
        platform: Mapping[str, Any] | None = None,
        enabled: bool | None = None,
        file_mode: int = _defaults.FILE_MODE,
        dir_mode: int = _defaults.DIR_MODE,
        verify: bool | None = None,
        remote: str | os.PathLike[str] | StoreURL | None = None,
        remote_timeout: float = _defaults.REMOTE_TIMEOUT,
        trusted_keys: Sequence[bytes | str | os.PathLike[str]] = (),
        allow_unsigned: bool = False,
    ) -> None:
        platform_bytes = fmt.canonical_key(platform)
        fmt.check_new_file(alignment, platform_bytes)
        self.path: str | None = os.fspath(path) if path is not None else None
        # pinned by tests/test_cache.py::test_an_empty_or_nul_path_is_refused
        if self.path is not None and (not isinstance(self.path, str) or not self.path or "\0" in self.path):
            raise ValueError(f"path must be a non-empty file path (or None for caching off), got {path!r}")
        check_mode(file_mode, "file_mode")
        check_mode(dir_mode, "dir_mode")
        self.alignment = alignment
        self.platform = platform_bytes
        # None: the process default, read now (packcache._registry.DEFAULTS); an explicit value wins.
        self.lock_timeout = check_timeout(DEFAULTS["lock_timeout"] if lock_timeout is None else lock_timeout)
        self.enabled = bool(DEFAULTS["enabled"] if enabled is None else enabled) and self.path is not None
        self.verify = bool(DEFAULTS["verify"] if verify is None else verify)
        self._remote = ReadThrough(remote)
        self.remote = self._remote.display  # what every message shows: no secret of the URL
        self.remote_timeout = check_remote_timeout(remote_timeout)
        if isinstance(trusted_keys, (str, bytes, os.PathLike)):
            raise TypeError("trusted_keys is a list of keys (PEM bytes or paths), not one key")
        self.trusted_keys: tuple[bytes | str, ...] = tuple(
            k if isinstance(k, bytes) else os.fspath(k) for k in trusted_keys
        )  # fmt: skip
        self.allow_unsigned = bool(allow_unsigned)
        self._owner = Owner()
        self._store: FileStore | None = None
        self._read_only = bool(DEFAULTS["read_only"] if read_only is None else read_only)
        if self.path is not None:
            self._store = FileStore(
                self.path, alignment=alignment, platform=platform_bytes, read_only=self._read_only,
                file_mode=file_mode, dir_mode=dir_mode,
            )  # fmt: skip
            weakref.finalize(self, self._store.close)
        self._ledger = Ledger(self.path)
        if self.path is not None:
            # A fetch by name that landed this very file counts here, as a read-through's fetch counts in its cache.
            # pinned by tests/test_fleet_names.py::test_a_load_by_name_shows_its_fetch_in_stats_and_every_exporter
            take_fetched(self._ledger, self.path)
        register(self)

    # ------------------------------------------------------------------ public

    @property
    def read_only(self) -> bool:
        """Never write (``packed_cache_read_only``). Setting it takes effect at the next session."""
        return self._read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        self._read_only = bool(value)
        if self._store is not None:
            self._store.read_only = self._read_only

    def session(self) -> Session:
        """Start a load: a context manager holding this cache's lock until it exits.

        Raises:
            SessionError: (on entry) if this thread already has a session on this cache,
                or the cache is closed.
        """
        return Session(self)

    def stats(self) -> CacheStats:
        """A consistent snapshot of this cache's figures; never waits, takes no lock.

        >>> WeightCache(None).stats().state
        'off'
        """
        return self._ledger.snapshot(self.enabled, self.path or "")

    def get_option(self, key: str) -> Any:
        """Read an option key (see :mod:`packcache.options`) for this cache."""
        return get_instance_option(self, key)

    def set_option(self, key: str, value: Any) -> None:
        """Write a configuration key for this cache; takes effect at the next request."""
        set_instance_option(self, key, value)

    def finalize(self) -> None:
        """Stop inserting: later misses go to heap with reason ``finalized``. Hits still map."""
        with self._owner.lock:  # never moves a closed cache back
            if self._owner.state is CacheState.OPEN:
                self._owner.state = CacheState.FINALIZED

    @property
    def finalized(self) -> bool:
        """Whether misses go to heap (``finalized``): after :meth:`finalize`, and once closed."""
        return self._owner.state is not CacheState.OPEN

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._owner.state is CacheState.CLOSED

    def release(self, what: str | np.ndarray[Any, Any]) -> bool:
        """Stop holding a pack (by name, or the array that was handed out).

        The array stays valid for whoever still references it; it just stops
        counting. Returns whether something was released. Waits for a session
        running in another thread.
        """
        with self._exclusive("release()"):
            ledger = self._ledger
            if isinstance(what, str):
                if what in ledger.held:
                    ledger.drop(what)
                    return True
                return False
            for name, held in ledger.held.items():
                if held.array is what:
                    ledger.drop(name)
                    return True
            for serial, held in ledger.unnamed.items():
                if held.array is what:
                    ledger.drop(None, serial)
                    return True
            return False

    def close(self) -> None:
        """Release every pack, close the file and the lock; idempotent.

        Arrays already handed out stay valid: each keeps its mapping alive.
        """
        if self._owner.state is CacheState.CLOSED:
            return
        with self._exclusive("close()"):
            self._ledger.drop_all()
            if self._store is not None:
                self._store.close()
            self._owner.state = CacheState.CLOSED
            unregister(self)

    def __enter__(self) -> WeightCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return f"WeightCache({self.path!r}, state={s.state!r}, mapped={s.mapped_bytes}, heap={s.heap_bytes})"

    def __reduce_ex__(self, protocol: object) -> Any:
        # pickle.dumps, copy.deepcopy and torch.save of an object holding a cache (model.packcache) reach here.
        raise TypeError(
            f"a WeightCache ({self.path!r}) cannot be pickled or copied: it holds an open file, its locks and live "
            "mappings. Save what it serves instead: the model's state_dict() or save_pretrained() (docs/HF.md, "
            "'Saving a packed model'); open the cache again by its path in the other process"
        )

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Run the body with no session active on this cache (waiting for one in another thread)."""
        owner = self._owner
        while True:
            with owner.lock:
                current = owner.session
                if current is None:
                    yield
                    return
                abandoned = current._abandoned()
                if not abandoned and owner.thread == threading.get_ident():
                    raise SessionError(f"{what} called inside this thread's own session on {self.path!r}")
            if abandoned:
                current._end()
            else:
                time.sleep(0.002)  # polled, not a condition: an interrupt cannot leave a lock half-taken
