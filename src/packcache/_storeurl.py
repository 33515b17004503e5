"""A fleet store's URL, parsed once (docs/FLEET.md, "Stores"): its scheme, its canonical identity (what the
rollback record is keyed by) and its display form (what every message, report and log line shows).

A store URL may carry secrets: ``user:password@``, a token or a signature in its query (``?X-Amz-Signature=``,
``?sig=``, ``?token=``), a fragment. They reach the store client and nothing else: :attr:`StoreURL.display`
and :func:`redact_url` drop them, and :func:`redact_text` drops them from every URL inside a message
(:class:`packcache.errors.RemoteError` applies it to everything it is given). Stdlib only: the exception
tree at layer 0 needs it.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import urllib.parse

__all__ = ["StoreURL", "parse_store_url", "redact_text", "split_object_url"]

#: The schemes of object stores (through obstore); ``file`` and a plain path are directory stores.
OBJECT_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https"})
#: Spellings of one scheme: ``s3a://bucket`` is the bucket ``s3://bucket`` names.
_SAME_SCHEME = {"s3a": "s3"}
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: Schemes whose user part without a password names a container (``abfs://container@account…``), not a secret.
_CONTAINER_USER = frozenset({"abfs", "abfss"})
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_SECRET_MIN = 3  # shorter user-info or query values are not scrubbed from free text (they would hit words)


@dataclasses.dataclass(frozen=True, repr=False)
class StoreURL:
    """One store URL, parsed by :func:`parse_store_url`.

    Attributes:
        raw: what was given, secrets included: only the store client gets it; never shown.
        scheme: the lower-case scheme (``file`` for a directory store, a plain path included).
        identity: the canonical identity: no user info, query or fragment; scheme and host lower-case,
            ``s3a`` as ``s3``, the default port dropped, the path normalised (``.``, ``..``, ``//``, a
            trailing ``/``, percent-encoding). A directory store: ``file://`` and its absolute path (the
            store adds symlink resolution, :meth:`packcache.fleet.stores.Store.identity`).
        display: the redacted form every message shows (``str()`` of this value).
        root: a directory store's absolute path, else ``None``.
        secrets: the user-info and query values of ``raw``, scrubbed by :meth:`scrub` from text a store
            client returns (its errors may spell the URL in their own way).
    """

    raw: str
    scheme: str
    identity: str
    display: str
    root: str | None
    secrets: tuple[str, ...]

    def __str__(self) -> str:
        return self.display

    def __repr__(self) -> str:
        return f"StoreURL({self.display!r})"

    def scrub(self, text: str) -> str:
        """``text`` with every URL redacted and every secret of this URL replaced by ``***``."""
        text = redact_text(text)
        for secret in sorted(self.secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text


def redact_url(url: str) -> str:
    """``url`` without user info (a password, a token), query or fragment; a plain path as it is.

    >>> redact_url("https://user:pw@Example.com:8443/a/b?sig=abc#x")
    'https://example.com:8443/a/b'
    """
    scheme, sep, _ = url.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) or len(scheme) == 1:
        if url[:5].lower() == "file:":  # file:relative, file:/abs: no secret place but a query
            return url.split("?", 1)[0].split("#", 1)[0]
        return url
    rest = _.split("#", 1)[0].split("?", 1)[0]
    user, at, after = rest.rpartition("@")
    # A password may hold an unencoded '/' (AWS secret keys do): user info runs to the last '@' when
    # what precedes it starts as ``user:`` with no '/' before the ':' and is no ``host:port/``.
    head, colon, tail = user.partition(":")
    if at and colon and "/" not in head and not tail.split("/", 1)[0].isdigit():
        rest = after
    netloc, slash, path = rest.partition("/")
    user, at, host = netloc.rpartition("@")
    if at and scheme.lower() in _CONTAINER_USER and ":" not in user:
        host = f"{user}@{host}"
    return f"{scheme.lower()}://{host.lower()}{slash}{path}"


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (:func:`redact_url`)."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def parse_store_url(url: str | os.PathLike[str] | StoreURL) -> StoreURL:
    """``url`` (``s3://bucket/prefix``, ``file:///abs/dir``, a plain directory path, ...) as one value
    (a :class:`StoreURL` already parsed is returned as it is).

    Raises:
        ValueError: not a usable store URL: empty, a NUL or control character, an unknown scheme, a
            ``file:`` URL with a host or a relative path, a bad port, an object URL without a bucket or
            host. The message shows the redacted URL only.
    """
    if isinstance(url, StoreURL):
        return url
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise ValueError(f"store URL: a string or a path, not {type(url).__name__}")
    shown = redact_url(url)
    if not url.strip():
        raise ValueError("store URL: empty (give s3://bucket/prefix, gs://..., az://..., file:///dir or a directory)")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise ValueError(f"store URL {shown!r}: a NUL or control character")
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", url)
    scheme = match.group(1).lower() if match and ("://" in url or match.group(1).lower() == "file") else ""
    if scheme and len(scheme) == 1:  # a drive letter: a path
        scheme = ""
    if not scheme:
        root = os.path.abspath(url)
        return StoreURL(url, "file", f"file://{root}", url, root, ())
    parts = urllib.parse.urlsplit(url)
    secrets = _secrets(parts, scheme)
    if scheme == "file":
        if parts.netloc.lower() not in ("", "localhost"):
            raise ValueError(f"store URL {shown!r}: a file URL names no host (file:///abs/dir)")
        if not parts.path.startswith("/"):
            raise ValueError(f"store URL {shown!r}: a file URL needs an absolute path (file:///abs/dir)")
        root = posixpath.normpath(urllib.parse.unquote(parts.path))
        if root.startswith("//"):
            root = "/" + root.lstrip("/")
        if "\0" in root:
            raise ValueError(f"store URL {shown!r}: a NUL in the path")
        return StoreURL(url, "file", f"file://{root}", shown, root, secrets)
    if scheme not in OBJECT_SCHEMES:
        raise ValueError(
            f"store URL {shown!r}: unknown scheme {scheme!r} (s3, gs, az, abfs, http, https, file, or a directory)"
        )
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"store URL {shown!r}: a bad port") from None
    host = (parts.hostname or "").lower()
    if not host:
        raise ValueError(f"store URL {shown!r}: no {'host' if scheme in _DEFAULT_PORTS else 'bucket or container'}")
    if ":" in host:
        host = f"[{host}]"
    user = parts.username or ""
    if scheme in _CONTAINER_USER and user and parts.password is None:
        host = f"{urllib.parse.unquote(user)}@{host}"
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        host = f"{host}:{port}"
    path = posixpath.normpath("/" + urllib.parse.unquote(parts.path)).lstrip("/") if parts.path else ""
    path = "" if path == "." else urllib.parse.quote(path, safe="/-._~!$&'()*+,;=:@")
    canonical = f"{_SAME_SCHEME.get(scheme, scheme)}://{host}" + (f"/{path}" if path else "")
    return StoreURL(url, scheme, canonical, shown, None, secrets)


def split_object_url(url: StoreURL, markers: tuple[str, ...]) -> tuple[StoreURL, str]:
    """An object's URL (``s3://bucket/prefix/manifests/m/c.json?token=...``) as its store's URL and the object's
    key: cut at the last of ``markers`` in the path (``"/manifests/"``: the key keeps that word), else at the
    last ``/``. The store keeps the query (a token may sit there); the fragment is dropped. Only this module
    reads ``raw``'s text: the store's URL is parsed here, once, like every other.

    >>> store, key = split_object_url(parse_store_url("s3://u:pw@b/p/manifests/m/c.json?t=abc"), ("/manifests/",))
    >>> store, store.raw, key
    (StoreURL('s3://b/p'), 's3://u:pw@b/p?t=abc', 'manifests/m/c.json')

    Raises:
        ValueError: the URL names no object (no ``/`` in its path), or what is left is no store URL.
    """
    path, mark, query = url.raw.split("#", 1)[0].partition("?")
    path = path.rstrip("/")
    if "/" not in path:
        raise ValueError(f"store URL {url.display!r}: no object key in it")
    root, key = path.rsplit("/", 1)
    for marker in markers:
        if marker in path:
            root, rest = path.rsplit(marker, 1)
            key = marker.strip("/") + "/" + rest
            break
    return parse_store_url(root + mark + query), key


def _secrets(parts: urllib.parse.SplitResult, scheme: str) -> tuple[str, ...]:
    found: list[str] = []
    container = scheme in _CONTAINER_USER and parts.password is None
    for value in (None if container else parts.username, parts.password):
        if value:
            found += [value, urllib.parse.unquote(value)]
    for _, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        found += [value, urllib.parse.quote(value, safe="")]
    if parts.fragment:
        found.append(parts.fragment)
    return tuple(sorted({s for s in found if len(s) >= _SECRET_MIN}))
