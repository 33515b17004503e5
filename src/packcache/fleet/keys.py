"""ed25519 key files: making a key pair, reading a private or public key file (bounded, trusted), and the
key objects and ids that manifest signatures are made and checked with.

Keys are ed25519, the private half PKCS#8 PEM (unencrypted, mode 0600), the public half
SubjectPublicKeyInfo PEM: :func:`generate_key` writes both, as ``packcache keygen`` does. A key's id
is the first 16 bytes (32 hex digits) of the sha256 of its raw 32-byte public key. Everything here but
:func:`public_path_for` needs the ``fleet`` extra (``cryptography``), imported by the functions that use
it, so reading a manifest without checking signatures does not.

>>> public_path_for("ci/signing.pem")
'ci/signing.pub.pem'
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from .. import _defaults
from .._paths import read_trusted
from ..errors import FormatError

__all__ = [
    "generate_key",
    "id_of",
    "key_id",
    "load_private_key",
    "load_public_keys",
    "private_key",
    "public_key",
    "public_path_for",
    "verifies",
]

_MAX_KEY_FILE_BYTES = 16 << 10  # a PEM ed25519 key is ~120 bytes; RSA-16384 would still fit


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


def id_of(public: Any) -> str:
    """The id (:func:`key_id`) of a loaded public key (:func:`public_key`, or a private key's ``public_key()``)."""
    return _id_of(_raw_public(public))


def verifies(public: Any, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s (a loaded key, :func:`public_key`) ed25519 signature of ``message``."""
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


def private_key(pem: bytes, *, where: str, path: str | None = None) -> Any:
    """The ed25519 private key (a ``cryptography`` object) in ``pem``; ``where`` names it in errors.

    Raises:
        ImportError: ``cryptography`` is missing. FormatError: not one PEM block, a public key, an encrypted
        key, or another key type. TypeError: ``pem`` is not bytes.
    """
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


def public_key(pem: bytes, *, where: str, path: str | None = None) -> Any:
    """The ed25519 public key (a ``cryptography`` object) in ``pem``; ``where`` names it in errors.

    Raises:
        ImportError: ``cryptography`` is missing. FormatError: not one PEM block, a private key, or another
        key type. TypeError: ``pem`` is not bytes.
    """
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
    return _id_of(_raw_public(public_key(public_key_pem, where="public key")))


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
    private_key(pem, where=f"private key {name}")
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
        public = public_key(pem, where=f"public key {name}")
        keys.setdefault(_id_of(_raw_public(public)), pem)
    return list(keys.values())
