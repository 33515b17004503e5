"""Where published caches live: one small store interface, a directory store and an object store.

A store holds objects under ``/``-separated relative keys (:func:`check_key`). Two kinds:

* :class:`DirectoryStore` (``file:///abs/path`` or a plain path): a local or NFS directory, stdlib
  only. A write lands by temp file + ``fsync`` + ``link`` (create-only) or ``rename`` under a lock
  (compare-and-swap), so a reader sees a whole object or none. No key escapes the root: every
  component is opened relative to its parent with ``O_NOFOLLOW``, so a symlink planted in a shared
  directory is refused, never followed; reads never block on a FIFO and read only regular files.
* :class:`ObjectStore` (``s3://``, ``gs://``, ``az://``, ``http(s)://``): through ``obstore`` (the
  ``fleet`` extra), with credentials and endpoints from each store's standard environment variables.

Every call takes an absolute ``deadline`` (a :func:`time.monotonic` time) and returns by
``deadline + 1 s`` at the latest, even against a server that accepts and never answers. An operation of
several calls (a fetch, a probe, a publish) bounds them with a :class:`StoreClock`: each call gets its own
bound, and the budget of the whole counts only the time a call is outstanding, never the local work between
(hashing, signature checks, writing the file). Every store problem raises
:class:`~packcache.errors.RemoteError` with a reason:

==================  ==============================================================================
``remote_absent``   no object at the key (a missing bucket or store directory: ``remote_error``)
``remote_timeout``  the deadline passed (a silent or stalled server, a lock held too long)
``remote_corrupt``  the object is larger than ``max_bytes``
``remote_conflict`` a create-only put found an object, or ``if_match`` no longer matches (publish only)
``remote_no_space`` ENOSPC, EDQUOT or EFBIG while writing
``remote_error``    anything else: refused, 403, 5xx, DNS, a malformed answer, EACCES, a FIFO at a key
==================  ==============================================================================

>>> import tempfile, time
>>> store = open_store(tempfile.mkdtemp())
>>> deadline = time.monotonic() + 10
>>> store.put_bytes("manifests/m.json", b"{}", deadline=deadline, if_match=None)
'44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a'
>>> store.get("manifests/m.json", deadline=deadline, max_bytes=1024)[0]
b'{}'
>>> store.head("manifests/none.json", deadline=deadline)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
packcache.errors.RemoteError: remote_absent: ...: no object at 'manifests/none.json'
"""

from __future__ import annotations

from .. import _defaults
from ._dirstore import DirectoryStore
from ._objectstore import ObjectStore
from ._storebase import (
    CHUNK_BYTES,
    MAX_KEY_BYTES,
    ObjectInfo,
    Store,
    StoreClock,
    StoreURL,
    check_key,
    parse_store_url,
)

__all__ = [
    "CHUNK_BYTES",
    "MAX_KEY_BYTES",
    "DirectoryStore",
    "ObjectInfo",
    "ObjectStore",
    "Store",
    "StoreClock",
    "StoreURL",
    "check_key",
    "open_store",
    "parse_store_url",
]


def open_store(url: str | StoreURL, *, timeout: float = _defaults.REMOTE_TIMEOUT) -> Store:
    """The store for ``url``.

    ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix`` (and the other forms
    ``obstore`` knows), ``http(s)://…``: an :class:`ObjectStore`, whose ``timeout`` bounds connecting
    and a stalled read. ``file:///abs/path`` or a plain path: a :class:`DirectoryStore`, whose
    ``timeout`` bounds each filesystem step of a download.

    Raises:
        ValueError: not a usable store URL (:func:`parse_store_url`: an unknown scheme, a ``file:`` URL
            with a host or a relative path, a bad port, ...); the message shows the redacted URL.
        ModuleNotFoundError: an object store URL without the ``fleet`` extra (the message says what to install).
        RemoteError: the object store cannot be configured from ``url`` (``remote_error``).
    """
    location = parse_store_url(url)
    if location.root is not None:
        return DirectoryStore(location, timeout=timeout)
    return ObjectStore(location, timeout=timeout)
