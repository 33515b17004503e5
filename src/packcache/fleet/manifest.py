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

Keys are ed25519, the private half PKCS#8 PEM (unencrypted, mode 0600), the public half
SubjectPublicKeyInfo PEM: :func:`generate_key` writes both, as ``packcache keygen`` does.
Signing and verifying need the ``fleet`` extra (``cryptography``), imported by the functions
that use it; building, encoding and parsing manifests does not.

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
import contextlib
import dataclasses
import hashlib
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
from .._paths import read_trusted
from ..errors import FormatError, RemoteError

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
    "check_published_name",
    "encode_unsigned",
    "generate_key",
    "key_id",
    "load_private_key",
    "load_public_keys",
    "make_manifest",
    "manifest_key",
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
_MAX_KEY_FILE_BYTES = 16 << 10  # a PEM ed25519 key is ~120 bytes; RSA-16384 would still fit
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
    keys = [private_key_pem] if isinstance(private_key_pem, bytes) else list(private_key_pem)
    if not 1 <= len(keys) <= MAX_SIGNATURES:
        raise ValueError(f"sign with 1 to {MAX_SIGNATURES} keys, got {len(keys)}")
    message = manifest.canonical()
    signatures: dict[str, dict[str, str]] = {}  # a key given twice signs once
    for pem in keys:
        key = _private_key(pem, where="private key")
        key_id = _id_of(_raw_public(key.public_key()))
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
            public = _public_key(pem, where=f"trusted key {number + 1}")
            trusted[_id_of(_raw_public(public))] = public
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
        if not _verifies(public, signature, message):
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


# --------------------------------------------------------------------------- keys


def _crypto() -> Any:
    """The ed25519 and serialization modules of ``cryptography``, imported now.

    Raises:
        ImportError: naming the ``fleet`` extra.
    """
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise ImportError(
            f"manifest signatures need the 'cryptography' package ({exc}): pip install 'packcache[fleet]'"
        ) from None
    return ed25519, serialization


def _raw_public(public: Any) -> bytes:
    _, serialization = _crypto()
    raw: bytes = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw


def _id_of(raw_public: bytes) -> str:
    return hashlib.sha256(raw_public).digest()[:16].hex()


def _verifies(public: Any, signature: bytes, message: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        public.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def _one_pem_block(pem: bytes, where: str, path: str | None) -> bytes:
    if not isinstance(pem, bytes):
        raise TypeError(f"{where}: expected PEM bytes, got {type(pem).__name__}")
    if pem.count(b"-----BEGIN ") != 1:
        raise FormatError(f"{where} is not one PEM block (found {pem.count(b'-----BEGIN ')})", path=path)
    return pem


def _private_key(pem: bytes, *, where: str, path: str | None = None) -> Any:
    ed25519, serialization = _crypto()
    from cryptography.exceptions import UnsupportedAlgorithm

    _one_pem_block(pem, where, path)
    if b"PUBLIC KEY-----" in pem:
        raise FormatError(f"{where} is a public key: give the private one (KEY.pem, not KEY.pub.pem)", path=path)
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError:  # "Password was not given but private key is encrypted"
        raise FormatError(f"{where} is encrypted: packcache needs an unencrypted PKCS#8 PEM key", path=path) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise FormatError(f"{where} is not a PEM private key ({_short(exc)})", path=path) from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise FormatError(f"{where} is {_kind(key)}, not ed25519: make one with 'packcache keygen KEY.pem'", path=path)
    return key


def _public_key(pem: bytes, *, where: str, path: str | None = None) -> Any:
    ed25519, serialization = _crypto()
    from cryptography.exceptions import UnsupportedAlgorithm

    _one_pem_block(pem, where, path)
    if b"PRIVATE KEY-----" in pem:
        raise FormatError(
            f"{where} is a private key: give its public half (KEY.pub.pem); a private key stays with the builder",
            path=path,
        )
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise FormatError(f"{where} is not a PEM public key ({_short(exc)})", path=path) from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise FormatError(f"{where} is {_kind(key)}, not ed25519", path=path)
    return key


def _kind(key: object) -> str:
    """What kind of key ``key`` is, in words (for the message that refuses it)."""
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, rsa, x448, x25519

    kinds = [
        ((rsa.RSAPrivateKey, rsa.RSAPublicKey), "an RSA key"),
        ((ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey), "an elliptic-curve (ECDSA) key"),
        ((dsa.DSAPrivateKey, dsa.DSAPublicKey), "a DSA key"),
        ((ed448.Ed448PrivateKey, ed448.Ed448PublicKey), "an Ed448 key"),
        ((x25519.X25519PrivateKey, x25519.X25519PublicKey), "an X25519 key"),
        ((x448.X448PrivateKey, x448.X448PublicKey), "an X448 key"),
    ]
    return next((words for types, words in kinds if isinstance(key, types)), f"a {type(key).__name__}")


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:160]


def key_id(public_key_pem: bytes) -> str:
    """The id of an ed25519 public key (SubjectPublicKeyInfo PEM): 32 hex digits, the first 16 bytes of
    the sha256 of its raw 32 bytes. Signatures name their key by it.

    Raises:
        ImportError: ``cryptography`` is missing. FormatError: not an ed25519 public key in PEM.
    """
    return _id_of(_raw_public(_public_key(public_key_pem, where="public key")))


def public_path_for(private_path: str | os.PathLike[str]) -> str:
    """Where the public half of ``private_path`` goes: ``KEY.pem`` -> ``KEY.pub.pem`` (else ``KEY`` + ``.pub.pem``).

    >>> public_path_for("ci/signing.pem"), public_path_for("signing")
    ('ci/signing.pub.pem', 'signing.pub.pem')
    """
    name = os.fspath(private_path)
    return (name[: -len(".pem")] if name.endswith(".pem") else name) + ".pub.pem"


def generate_key(private_path: str | os.PathLike[str], public_path: str | os.PathLike[str] | None = None) -> str:
    """Make an ed25519 key pair: the private key as unencrypted PKCS#8 PEM at ``private_path`` (created,
    never overwritten, mode 0600), the public key as SubjectPublicKeyInfo PEM at ``public_path``
    (default :func:`public_path_for`; created, never overwritten, mode 0644). Both are fsynced.
    If the public file cannot be made, the private one just made is removed again.

    Returns:
        The key id (what signatures name).

    Raises:
        ImportError: ``cryptography`` is missing. FileExistsError: either file exists (nothing is
        changed). OSError: a file cannot be created or written.
    """
    ed25519, serialization = _crypto()
    private_name = os.fspath(private_path)
    public_name = os.fspath(public_path) if public_path is not None else public_path_for(private_name)
    if os.path.abspath(private_name) == os.path.abspath(public_name):
        raise ValueError(f"the private and public key would be the same file: {private_name}")
    if os.path.lexists(public_name):  # checked first so an existing public key leaves no stray private one
        raise FileExistsError(17, "the public key file exists (keygen never overwrites a key)", public_name)
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _create(private_name, private_pem, _defaults.PRIVATE_FILE_MODE, "private key")
    try:
        _create(public_name, public_pem, _defaults.SHARED_FILE_MODE, "public key")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(private_name)
        raise
    return _id_of(_raw_public(key.public_key()))


def _create(path: str, data: bytes, mode: int, what: str) -> None:
    """Write ``data`` to a new file at ``path`` (O_EXCL, no symlink followed) with exactly ``mode``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o600)
    except FileExistsError:
        raise FileExistsError(17, f"the {what} file exists (keygen never overwrites a key)", path) from None
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits the mode asks for (0644 for a public key)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def load_private_key(path: str | os.PathLike[str]) -> bytes:
    """The PEM bytes of an ed25519 private key file, checked (read bounded, without blocking on a FIFO) and
    trusted as ssh trusts one (:func:`packcache._paths.read_trusted`): this user's or root's, mode 0600 or
    narrower, reached through no symlink another user planted, in no directory another user can change.

    Raises:
        ImportError: ``cryptography`` is missing. FormatError: not one PEM block, a public key, an
        encrypted key, another key type, or larger than 16 KiB. UntrustedFileError: not a regular file,
        or it fails the trust rule above. OSError: it cannot be read.
    """
    name = os.fspath(path)
    pem = read_trusted(name, what="private key", max_bytes=_MAX_KEY_FILE_BYTES, secret=True)
    _private_key(pem, where=f"private key {name}")
    return pem


def load_public_keys(paths: Sequence[str | os.PathLike[str]]) -> list[bytes]:
    """The PEM bytes of each ed25519 public key file, checked (read bounded, without blocking on a FIFO),
    for ``trusted_keys``. A key given twice is kept once. A key file is trusted as the cache file is
    (:func:`packcache._paths.read_trusted`): this user's or root's, writable by no one else, reached through
    no symlink another user planted, in no directory another user can change.

    Raises:
        ImportError: ``cryptography`` is missing. FormatError: not one PEM block, a private key,
        another key type, or larger than 16 KiB (naming the file). UntrustedFileError: not a regular
        file, or it fails the trust rule above. OSError: it cannot be read.
    """
    keys: dict[str, bytes] = {}
    for path in paths:
        name = os.fspath(path)
        pem = read_trusted(name, what="public key", max_bytes=_MAX_KEY_FILE_BYTES)
        public = _public_key(pem, where=f"public key {name}")
        keys.setdefault(_id_of(_raw_public(public)), pem)
    return list(keys.values())
