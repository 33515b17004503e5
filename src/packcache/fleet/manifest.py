"""Manifests: which published blob is the current cache file of one (model, platform class), signed.

A store holds one manifest per (model, platform class) at :func:`manifest_key`. It names the
blob by its sha256 and size (an object store's ETag is no content hash), carries a generation
that only grows, when it was made, when it stops being valid, and who made it::

    {"manifest": {"blob_sha256": "<64 hex>", "builder": "packcache 0.1.0 ci-job-123",
                  "created": 1796000000, "expires": 1798592000, "format": "packcache-manifest/1",
                  "generation": 3, "model": "minilm-int8-0123abcd", "platform_class": "pc1-<32 hex>",
                  "size": 23068672},
     "signatures": [{"alg": "ed25519", "key": "<32 hex>", "sig": "<base64 of 64 bytes>"}]}

Each signature is ed25519 over :meth:`Manifest.canonical` (the manifest object as JSON with
sorted keys, no whitespace, ASCII only): ``openssl pkeyutl -verify -rawin`` checks it too. A
key's id is the first 16 bytes (32 hex digits) of the sha256 of its raw 32-byte public key.
A reader trusts a manifest when one signature verifies under one of the operator's public keys
(several keys: rotation), refuses it when a signature that names a trusted key does not verify
(tampering), and takes an unsigned one only when told to (``allow_unsigned``). An expired
manifest (freeze attack) and one older than the last this machine accepted (rollback,
:func:`check_generation`) are refused as ``remote_stale``.

The keys and their files are :mod:`packcache.fleet.keys`' (their functions stay importable from here too,
where they were first documented). Signing and verifying need the ``fleet`` extra (``cryptography``),
imported by the functions that use it; building, encoding and parsing manifests does not.

A cache file is published under its model, the file's name without ``.pcache`` (:func:`model_of`): publish
and fetch both name files by :func:`check_publish_target`, so neither needs the other.

>>> m = Manifest("minilm-int8-0123", "pc1-" + "0" * 32, "ab" * 32, 8192, 1, 1000, 2000, "ci")
>>> m.blob_key == "blobs/sha256/" + "ab" * 32 + ".pcache"
True
>>> manifest_key(m.model, "pc1-0123")
'manifests/minilm-int8-0123/pc1-0123.json'
>>> read_envelope(encode_unsigned(m), trusted_keys=[], allow_unsigned=True, now=1500) == (m, None)
True
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import _boundedjson as boundedjson
from .. import _defaults
from .. import format as fmt
from ..errors import FormatError, RemoteError
from . import keys
from .keys import generate_key, key_id, load_private_key, load_public_keys, public_path_for

__all__ = [
    "DEFAULT_TTL_SECONDS",
    "MANIFEST_FORMAT",
    "MAX_BUILDER_CHARS",
    "MAX_ENVELOPE_BYTES",
    "Manifest",
    "check_generation",
    "check_manifest",
    "check_model",
    "check_name",
    "check_publish_target",
    "check_published_name",
    "encode_unsigned",
    "generate_key",
    "key_id",
    "load_private_key",
    "load_public_keys",
    "make_manifest",
    "manifest_key",
    "model_of",
    "public_path_for",
    "read_envelope",
    "sign",
]

MANIFEST_FORMAT = "packcache-manifest/1"
#: An envelope larger than this is refused before it is parsed (a real one is well under 2 KiB).
MAX_ENVELOPE_BYTES = 64 << 10
#: How long a manifest stays valid by default: a fleet whose builder stopped publishing for this
#: long packs locally again rather than serve what an attacker may be freezing it on.
DEFAULT_TTL_SECONDS = _defaults.MANIFEST_EXPIRY
MAX_SIGNATURES = 16
MAX_BUILDER_CHARS = 256
MAX_NAME_CHARS = 200
_MAX_INT = (1 << 63) - 1
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{32}")
_FIELDS = ("blob_sha256", "builder", "created", "expires", "format", "generation", "model", "platform_class", "size")


def check_name(text: object, what: str) -> str:
    """``text`` if it may name a model or a platform class in a store key: 1 to 200 characters of
    ``[A-Za-z0-9._-]``, not starting with a dot (no ``..``, no hidden file, no separator).

    Raises:
        ValueError: naming ``what`` and the rule.

    >>> check_name("minilm-int8-0a1b", "model")
    'minilm-int8-0a1b'
    """
    if not isinstance(text, str) or not 1 <= len(text) <= MAX_NAME_CHARS or not _NAME.fullmatch(text):
        shown = repr(text)[:80]
        raise ValueError(f"{what} {shown} is not 1-{MAX_NAME_CHARS} characters of A-Z a-z 0-9 . _ -")
    if text.startswith("."):
        raise ValueError(f"{what} {text!r} starts with a dot")
    return text


def check_model(text: object, what: str = "model") -> str:
    """``text`` if it may name a model in a store key: one or more :func:`check_name` segments joined by single
    ``/`` (a published name such as ``org/model-int8``; a file's name is one segment), at most 200 characters in all.

    Raises:
        ValueError: naming ``what`` and the rule.

    >>> check_model("org/model-int8")
    'org/model-int8'
    """
    if not isinstance(text, str) or not 1 <= len(text) <= MAX_NAME_CHARS:
        raise ValueError(f"{what} {repr(text)[:80]} is not 1-{MAX_NAME_CHARS} characters")
    for segment in text.split("/"):
        if not segment:
            raise ValueError(f"{what} {text[:80]!r} has an empty segment ('//', or a leading or trailing '/')")
        check_name(segment, f"{what} {text[:80]!r}: segment")
    return text


#: The most ``/``-separated segments a published name has (its local file name, ``/`` as ``--``, stays under 255 bytes).
MAX_NAME_SEGMENTS = 16


def check_published_name(text: object) -> str:
    """``text`` if a cache file may be published under it by name (``packcache publish --name``): a
    :func:`check_model` (``[A-Za-z0-9._-]`` segments, single ``/`` between, at most 200 characters, no segment
    starting with a dot), at most 16 segments, and none of ``..`` and ``--`` anywhere (a name's local file is the
    name with ``/`` as ``--``: ``a/b`` and ``a--b`` would share one), no segment ending in ``.json`` (manifests
    lie beside the segments) and no name ending in ``.pcache`` (``--model`` takes it for a cache file).

    Raises:
        ValueError: naming the name and the rule it breaks.

    >>> check_published_name("org/model-int8")
    'org/model-int8'
    """
    shown = repr(text)[:80]
    if isinstance(text, str) and text.count("/") >= MAX_NAME_SEGMENTS:
        raise ValueError(f"name {shown} has more than {MAX_NAME_SEGMENTS} '/'-separated segments")
    check_model(text, "name")
    assert isinstance(text, str)
    for bad, why in (("..", "'..'"), ("--", "'--' (the local file name writes '/' as '--')")):
        if bad in text:
            raise ValueError(f"name {shown} holds {why}")
    if any(segment.endswith(".json") for segment in text.split("/")):
        raise ValueError(f"name {shown}: a segment ends in .json (manifest files lie beside the segments)")
    if text.endswith(".pcache"):
        raise ValueError(f"name {shown} ends in .pcache: that reads as a cache file's path, not a name")
    return text


def manifest_key(model: str, platform_class: str, generation: int | None = None) -> str:
    """The store key of the manifest of ``(model, platform_class)``: ``manifests/<model>/<class>.json``, or with
    ``generation`` the immutable copy a publish by name leaves of that generation:
    ``manifests/<model>/<class>@<G>.json``.

    Raises:
        ValueError: either name breaks :func:`check_model`'s or :func:`check_name`'s rule, or a generation under 1.
    """
    key = f"manifests/{check_model(model)}/{check_name(platform_class, 'platform class')}"
    if generation is None:
        return key + ".json"
    return f"{key}@{_int_field(generation, 'generation', 1)}.json"


def model_of(path: str) -> str:
    """The model a cache file is published under: its file name without ``.pcache``.

    Default names are made of content (``identity.model_cache_name``), so every machine that
    loads the same checkpoint with the same scheme asks for the same model.

    >>> model_of("/var/cache/minilm-int8-0123.pcache")
    'minilm-int8-0123'
    """
    name = os.path.basename(path)
    return name[: -len(".pcache")] if name.endswith(".pcache") else name


def check_publish_target(path: str | os.PathLike[str]) -> str:
    """The model a cache file at ``path`` is published as: its name without ``.pcache``, which must be a
    model's name (:func:`check_name`). Publish names the file it sends by it and fetch the file it fills.

    Raises:
        ValueError: the file's name names no model (a space in it, say).
    """
    name = os.fspath(path)
    model = model_of(name)
    check_name(model, f"model (the file's name {os.path.basename(name)!r} without .pcache)")
    return model


def _int_field(value: object, name: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= _MAX_INT:
        raise ValueError(f"manifest field {name!r} must be an integer in [{low}, 2**63-1], got {repr(value)[:40]}")
    return value


@dataclass(frozen=True)
class Manifest:
    """One published cache file: ``model`` (its file name without ``.pcache``, or a published name such as
    ``org/model-int8``: :func:`check_model`), ``platform_class``
    (:func:`packcache.fleet.platform.platform_class`), the blob's ``blob_sha256`` (64 lowercase hex)
    and ``size`` in bytes, a ``generation`` >= 1 that each publish of the (model, class) raises,
    ``created`` and ``expires`` in unix seconds (``expires`` None: never; only when asked for), and a
    free-text ``builder`` (at most 256 printable characters).

    Raises:
        ValueError: any field of the wrong type or out of range (naming the field).
    """

    model: str
    platform_class: str
    blob_sha256: str
    size: int
    generation: int
    created: int
    expires: int | None
    builder: str
    format: str = MANIFEST_FORMAT

    def __post_init__(self) -> None:
        if self.format != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {repr(self.format)[:60]} is not {MANIFEST_FORMAT!r}")
        check_model(self.model)
        check_name(self.platform_class, "platform class")
        if not isinstance(self.blob_sha256, str) or not _HEX64.fullmatch(self.blob_sha256):
            raise ValueError(
                f"manifest field 'blob_sha256' must be 64 lowercase hex digits, got {self.blob_sha256!r:.80}"
            )
        _int_field(self.size, "size", fmt.HEADER_READ_SIZE)  # no cache file is shorter than its header
        _int_field(self.generation, "generation", 1)
        _int_field(self.created, "created", 0)
        if self.expires is not None and _int_field(self.expires, "expires", 0) <= self.created:
            raise ValueError(f"manifest expires at {self.expires}, not after it was created ({self.created})")
        if not isinstance(self.builder, str) or len(self.builder) > MAX_BUILDER_CHARS or not self.builder.isprintable():
            raise ValueError(f"manifest field 'builder' must be at most {MAX_BUILDER_CHARS} printable characters")

    @property
    def blob_key(self) -> str:
        """The store key of the blob: ``blobs/sha256/<hex>.pcache``."""
        return f"blobs/sha256/{self.blob_sha256}.pcache"

    @property
    def manifest_key(self) -> str:
        """The store key of this manifest: :func:`manifest_key` of its model and class."""
        return manifest_key(self.model, self.platform_class)

    def to_dict(self) -> dict[str, Any]:
        """The manifest object, JSON-serialisable."""
        return dataclasses.asdict(self)

    def canonical(self) -> bytes:
        """The bytes every signature covers: the manifest object as JSON, sorted keys, no whitespace, ASCII."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_dict(cls, data: object) -> Manifest:
        """A manifest from its parsed JSON object: exactly the nine fields, each checked.

        Raises:
            ValueError: not an object, a field missing or unknown, or a field out of range.
        """
        if not isinstance(data, dict):
            raise ValueError(f"the manifest is a JSON {type(data).__name__}, not an object")
        if sorted(data) != sorted(_FIELDS):
            missing, unknown = sorted(set(_FIELDS) - set(data)), sorted(set(data) - set(_FIELDS))
            raise ValueError(
                f"manifest fields differ from {MANIFEST_FORMAT}: missing {missing}, unknown {unknown}"[:300]
            )
        return cls(**data)


def make_manifest(
    model: str,
    platform_class: str,
    blob_sha256: str,
    size: int,
    generation: int,
    *,
    builder: str,
    created: int | None = None,
    ttl_seconds: int | None = DEFAULT_TTL_SECONDS,
) -> Manifest:
    """A new manifest created now (or at ``created``), expiring ``ttl_seconds`` later
    (``ttl_seconds=None``: never, which gives up the freeze check; ask for it knowingly).

    Raises:
        ValueError: as :class:`Manifest`, or a ``ttl_seconds`` under 1.
    """
    at = int(time.time()) if created is None else created
    if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds < 1):
        raise ValueError(f"ttl_seconds must be a positive integer or None, got {ttl_seconds!r}")
    expires = None if ttl_seconds is None else at + ttl_seconds
    return Manifest(model, platform_class, blob_sha256, size, generation, at, expires, builder)


# --------------------------------------------------------------------------- envelopes


def _encode(manifest: Manifest, signatures: list[dict[str, str]]) -> bytes:
    envelope = {"manifest": manifest.to_dict(), "signatures": signatures}
    return json.dumps(envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def encode_unsigned(manifest: Manifest) -> bytes:
    """The envelope of ``manifest`` with no signature (readers take it only with ``allow_unsigned``)."""
    return _encode(manifest, [])


def sign(manifest: Manifest, private_key_pem: bytes | Sequence[bytes]) -> bytes:
    """The envelope of ``manifest`` signed by one private key (PKCS#8 PEM), or by each of several
    (while a fleet rotates keys, sign with the old and the new one).

    Raises:
        ImportError: ``cryptography`` is missing (the message names the ``fleet`` extra).
        FormatError: a key is not an ed25519 private key in PEM.
    """
    pems = [private_key_pem] if isinstance(private_key_pem, bytes) else list(private_key_pem)
    if not 1 <= len(pems) <= MAX_SIGNATURES:
        raise ValueError(f"sign with 1 to {MAX_SIGNATURES} keys, got {len(pems)}")
    message = manifest.canonical()
    signatures: dict[str, dict[str, str]] = {}  # a key given twice signs once
    for pem in pems:
        key = keys.private_key(pem, where="private key")
        key_id = keys.id_of(key.public_key())
        if key_id not in signatures:
            signatures[key_id] = {"alg": "ed25519", "key": key_id, "sig": base64.b64encode(key.sign(message)).decode()}
    return _encode(manifest, list(signatures.values()))


def read_envelope(
    data: bytes,
    *,
    trusted_keys: Sequence[bytes],
    allow_unsigned: bool,
    now: float | None = None,
    url: str | None = None,
) -> tuple[Manifest, str | None]:
    """Parse and check a manifest envelope: the manifest and the id of the trusted key that signed it
    (``None``: unsigned, or signed by no trusted key, and ``allow_unsigned``).

    Args:
        data: the envelope's bytes, as read from the store.
        trusted_keys: public keys (SubjectPublicKeyInfo PEM, :func:`load_public_keys`); any one suffices.
        allow_unsigned: take a manifest no trusted key signed. A signature that names a trusted key
            and does not verify is refused all the same: the manifest was changed after signing.
        now: the time to check ``expires`` against (default: now).
        url: where the envelope came from, for the error.

    Raises:
        RemoteError: ``remote_corrupt`` (too large, not bounded JSON, a field missing, unknown, of the
            wrong type or out of range), ``remote_untrusted`` (unsigned or signed by no trusted key
            without ``allow_unsigned``, a bad signature by a trusted key, or signatures to check and
            no ``cryptography``), ``remote_stale`` (``expires`` is not after ``now``).
        FormatError: a trusted key is not an ed25519 public key (the caller's configuration).
    """
    manifest, signatures = _parse(data, url)
    signer = _check_signatures(manifest, signatures, trusted_keys, allow_unsigned, url)
    moment = time.time() if now is None else now
    if manifest.expires is not None and manifest.expires <= moment:
        raise RemoteError(
            "remote_stale", f"the manifest of generation {manifest.generation} expired at {manifest.expires} "
            f"(now {int(moment)}): the builder has not published since; republish, or check the clock", url=url,
        )  # fmt: skip
    return manifest, signer


def _parse(data: bytes, url: str | None) -> tuple[Manifest, list[dict[str, str]]]:
    def corrupt(message: str) -> RemoteError:
        return RemoteError("remote_corrupt", f"malformed manifest: {message}", url=url)

    if not isinstance(data, bytes | bytearray | memoryview):
        raise corrupt(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_ENVELOPE_BYTES:
        raise corrupt(f"{len(data)} bytes, more than the {MAX_ENVELOPE_BYTES}-byte cap")
    try:
        value = boundedjson.loads(bytes(data), what="manifest", max_depth=8, unique_keys=True, finite=True)
    except FormatError as exc:
        raise corrupt(str(exc)) from None
    if not isinstance(value, dict) or sorted(value) != ["manifest", "signatures"]:
        raise corrupt('not an object of exactly "manifest" and "signatures"')
    try:
        manifest = Manifest.from_dict(value["manifest"])
    except (ValueError, TypeError) as exc:
        raise corrupt(str(exc)) from None
    signatures = value["signatures"]
    if not isinstance(signatures, list) or len(signatures) > MAX_SIGNATURES:
        raise corrupt(f'"signatures" must be a list of at most {MAX_SIGNATURES}')
    for entry in signatures:
        if (
            not isinstance(entry, dict)
            or sorted(entry) != ["alg", "key", "sig"]
            or not all(isinstance(v, str) and len(v) <= 512 for v in entry.values())
        ):
            raise corrupt('each signature must be {"alg", "key", "sig"}, strings of at most 512 characters')
        if entry["alg"] == "ed25519" and (not _KEY_ID.fullmatch(entry["key"]) or _signature_bytes(entry) is None):
            raise corrupt("an ed25519 signature needs a 32-hex key id and 64 bytes of standard base64")
    return manifest, signatures


def _signature_bytes(entry: dict[str, str]) -> bytes | None:
    try:
        raw = base64.b64decode(entry["sig"], validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 64 and base64.b64encode(raw).decode("ascii") == entry["sig"] else None


def _check_signatures(
    manifest: Manifest,
    signatures: list[dict[str, str]],
    trusted_keys: Sequence[bytes],
    allow_unsigned: bool,
    url: str | None,
) -> str | None:
    ours = [s for s in signatures if s["alg"] == "ed25519"]
    if not trusted_keys:
        if allow_unsigned:
            return None
        # pinned by tests/test_fleet_probe.py::
        #   test_a_probed_manifest_shows_its_own_generation_and_names_its_signers_when_no_key_is_trusted
        if ours:
            named = ", ".join(sorted({s["key"] for s in ours}))
            raise RemoteError(
                "remote_untrusted", f"the manifest is signed by key {named}, but no trusted key is configured: "
                "pass --trusted-key PUB.pem (trusted_keys=), the public half of a key that signed it", url=url,
            )  # fmt: skip
        raise RemoteError(
            "remote_untrusted", "the manifest is unsigned and no trusted key is configured (give --trusted-key "
            "PUB.pem and sign when publishing, or allow unsigned manifests knowingly)", url=url,
        )  # fmt: skip
    if not ours:  # nothing to verify: no cryptography needed
        if allow_unsigned:
            return None
        raise RemoteError("remote_untrusted", "the manifest is unsigned (unsigned manifests are not allowed)", url=url)
    try:
        trusted = {}
        for number, pem in enumerate(trusted_keys):
            public = keys.public_key(pem, where=f"trusted key {number + 1}")
            trusted[keys.id_of(public)] = public
    except ImportError as exc:
        raise RemoteError("remote_untrusted", f"cannot check signatures: {exc}", url=url) from None
    message = manifest.canonical()
    for entry in ours:
        public = trusted.get(entry["key"])
        if public is None:
            continue
        signature = _signature_bytes(entry)
        assert signature is not None  # _parse checked it
        # a trusted key's signature that fails is tampering, refused even with allow_unsigned; pinned by
        #   tests/test_fleet_manifest.py::test_a_field_changed_after_signing_is_untrusted
        if not keys.verifies(public, signature, message):
            raise RemoteError(
                "remote_untrusted",
                f"the signature by trusted key {entry['key']} does not verify: the manifest was changed after "
                "it was signed",
                url=url,
            )
        return entry["key"]
    if allow_unsigned:
        return None
    named = ", ".join(sorted({s["key"][:32] for s in signatures}))
    raise RemoteError(
        "remote_untrusted", f"the manifest is signed only by keys not trusted here ({named}); "
        f"trusted: {', '.join(sorted(trusted))}", url=url,
    )  # fmt: skip


def check_manifest(
    data: bytes,
    *,
    model: str,
    platform_class: str,
    trusted_keys: Sequence[bytes],
    allow_unsigned: bool,
    accepted: tuple[int, str] | None,
    now: float | None = None,
    url: str | None = None,
    pinned: int | None = None,
) -> tuple[Manifest, str | None]:
    """Every check a manifest read from ``manifests/<model>/<platform_class>.json`` must pass before its
    blob is read: :func:`read_envelope` (bounds, fields, signatures, expiry), its ``model`` and
    ``platform_class`` against the key's (a manifest copied under another key is refused), and
    :func:`check_generation` against ``accepted`` (the generation and blob sha256 this user last
    accepted from the store, or None). Fetch and probe both call it, so they cannot disagree.

    ``pinned``: the manifest was read from the immutable copy of that generation
    (``manifests/<model>/<class>@<G>.json``, a fetch of ``NAME@G``): its generation must be ``G``, and an older
    one than ``accepted`` is no rollback (the operator asked for it); the same generation naming another blob
    than ``accepted``'s still is.

    Raises:
        RemoteError: as :func:`read_envelope`; ``remote_incompatible`` (another model, class or pinned
            generation than the key's); ``remote_stale`` (a rollback).
    """
    manifest, signer = read_envelope(data, trusted_keys=trusted_keys, allow_unsigned=allow_unsigned, now=now, url=url)
    # pinned by tests/test_fleet_probe.py::
    #   test_probe_refuses_exactly_the_manifests_fetch_refuses_and_names_the_same_reason
    if (manifest.model, manifest.platform_class) != (model, platform_class):
        raise RemoteError(
            "remote_incompatible", f"the manifest at {manifest_key(model, platform_class)} is for {manifest.model} / "
            f"{manifest.platform_class}, not {model} / {platform_class}", url=url,
        )  # fmt: skip
    if pinned is not None:
        # pinned by tests/test_fleet_names.py::test_a_pinned_copy_naming_another_generation_is_refused
        if manifest.generation != pinned:
            raise RemoteError(
                "remote_incompatible", f"the manifest at {manifest_key(model, platform_class, pinned)} is of "
                f"generation {manifest.generation}, not {pinned}", url=url,
            )  # fmt: skip
        if accepted is None or accepted[0] != pinned:
            return manifest, signer
    check_generation(manifest, accepted[0] if accepted else None, last_blob_sha256=accepted[1] if accepted else None)
    return manifest, signer


def check_generation(manifest: Manifest, last_accepted: int | None, *, last_blob_sha256: str | None = None) -> None:
    """Refuse a rollback: a manifest older than the last one this machine accepted for its (model, class),
    or the same generation naming another blob (a replayed sibling, or a publisher that reused a number).

    Raises:
        RemoteError: ``remote_stale``, naming both generations.

    >>> m = Manifest("m", "pc1-x", "ab" * 32, 8192, 4, 1000, None, "ci")
    >>> check_generation(m, 3); check_generation(m, None); check_generation(m, 4)
    >>> check_generation(m, 5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packcache.errors.RemoteError: remote_stale: manifest generation 4 is older than generation 5, ...
    """
    if last_accepted is None:
        return
    if manifest.generation < last_accepted:
        raise RemoteError(
            "remote_stale", f"manifest generation {manifest.generation} is older than generation {last_accepted}, "
            "which this machine already accepted (a rollback)",
        )  # fmt: skip
    # pinned by tests/test_fleet_manifest.py::test_check_generation_refuses_rollbacks_and_a_reused_generation_number
    if manifest.generation == last_accepted and last_blob_sha256 not in (None, manifest.blob_sha256):
        raise RemoteError(
            "remote_stale", f"manifest generation {manifest.generation} names blob {manifest.blob_sha256[:16]}.., "
            f"but this machine accepted that generation with blob {str(last_blob_sha256)[:16]}..",
        )  # fmt: skip
