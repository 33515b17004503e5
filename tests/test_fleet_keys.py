"""ed25519 key files: ``packcache.fleet.keys`` and ``packcache keygen``.

Real keys (``cryptography``), real files, a real FIFO: every refusal is one clear error naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from packcache.cli import main
from packcache.errors import FormatError, UntrustedFileError
from packcache.fleet import keys as fk


def test_keygen_writes_a_0600_private_and_a_0644_public_key_and_prints_the_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old_umask = os.umask(0o077)  # a strict umask must not leave the public key unreadable to others
    try:
        assert main(["keygen", str(tmp_path / "ci.pem"), "--json"]) == 0
    finally:
        os.umask(old_umask)
    printed = json.loads(capsys.readouterr().out)
    private, public = tmp_path / "ci.pem", tmp_path / "ci.pub.pem"
    assert printed == {"key_id": printed["key_id"], "private_key": str(private), "public_key": str(public)}
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and stat.S_IMODE(public.stat().st_mode) == 0o644
    key = serialization.load_pem_private_key(private.read_bytes(), password=None)
    assert isinstance(key, ed25519.Ed25519PrivateKey)
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")  # SubjectPublicKeyInfo
    assert fk.key_id(public.read_bytes()) == printed["key_id"]
    assert main(["keygen", str(tmp_path / "plain")]) == 0
    text = capsys.readouterr().out
    assert (tmp_path / "plain.pub.pem").exists() and text.startswith("key id        ")
    assert fk.key_id((tmp_path / "plain.pub.pem").read_bytes()) in text.splitlines()[0]


@pytest.mark.parametrize("existing", ["private", "public", "symlink"])
def test_keygen_never_overwrites_a_key_and_leaves_nothing_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], existing: str
) -> None:
    private, public = tmp_path / "k.pem", tmp_path / "k.pub.pem"
    if existing == "symlink":
        os.symlink(tmp_path / "elsewhere", private)  # a dangling link: O_EXCL must not create its target
    else:
        (private if existing == "private" else public).write_bytes(b"keep me")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["keygen", str(private)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("packcache keygen: EEXIST") and "never overwrites" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if existing != "symlink":
        assert (private if existing == "private" else public).read_bytes() == b"keep me"


def _pem_files(directory: Path) -> dict[str, Path]:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ed = ed25519.Ed25519PrivateKey.generate()
    pkcs8, spki, pem = (
        serialization.PrivateFormat.PKCS8,
        serialization.PublicFormat.SubjectPublicKeyInfo,
        serialization.Encoding.PEM,
    )
    files = {
        "rsa private": rsa_key.private_bytes(pem, pkcs8, serialization.NoEncryption()),
        "rsa public": rsa_key.public_key().public_bytes(pem, spki),
        "ec public": ec_key.public_key().public_bytes(pem, spki),
        "encrypted": ed.private_bytes(pem, pkcs8, serialization.BestAvailableEncryption(b"secret")),
        "ed private": ed.private_bytes(pem, pkcs8, serialization.NoEncryption()),
        "ed public": ed.public_key().public_bytes(pem, spki),
        "garbage": b"-----BEGIN PUBLIC KEY-----\nnot base64 at all\n-----END PUBLIC KEY-----\n",
        "not pem": b"\x00\x01binary",
        "two blocks": ed.public_key().public_bytes(pem, spki) * 2,
        "huge": b"-----BEGIN PUBLIC KEY-----\n" + b"A" * (1 << 20),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = directory / (name.replace(" ", "-") + ".pem")
        paths[name].write_bytes(data)
        os.chmod(paths[name], 0o600)  # as keygen makes a private key: a key others can read is refused first
    paths["fifo"] = directory / "fifo.pem"
    os.mkfifo(paths["fifo"])
    paths["directory"] = directory / "dir.pem"
    paths["directory"].mkdir()
    return paths


@pytest.mark.parametrize(
    "given, loader, error, words",
    [
        ("rsa private", "private", FormatError, "an RSA key, not ed25519"),
        ("ed public", "private", FormatError, "is a public key"),
        ("encrypted", "private", FormatError, "is encrypted"),
        ("garbage", "private", FormatError, "is a public key"),
        ("not pem", "private", FormatError, "not one PEM block"),
        ("rsa public", "public", FormatError, "an RSA key, not ed25519"),
        ("ec public", "public", FormatError, "an elliptic-curve (ECDSA) key, not ed25519"),
        ("ed private", "public", FormatError, "is a private key: give its public half"),
        ("garbage", "public", FormatError, "is not a PEM public key"),
        ("two blocks", "public", FormatError, "not one PEM block (found 2)"),
        ("huge", "public", FormatError, "past the 16384-byte cap"),
        ("fifo", "public", UntrustedFileError, "not a regular file (a FIFO)"),
        ("fifo", "private", UntrustedFileError, "not a regular file (a FIFO)"),
        ("directory", "public", UntrustedFileError, "not a regular file (a directory)"),
    ],
)
def test_a_wrong_key_file_is_one_clear_error_naming_it(
    tmp_path: Path, given: str, loader: str, error: type[Exception], words: str
) -> None:
    """A FIFO is refused without blocking (a blocking open would hang this test: there is no writer)."""
    path = _pem_files(tmp_path)[given]
    with pytest.raises(error) as caught:
        if loader == "private":
            fk.load_private_key(path)
        else:
            fk.load_public_keys([path])
    assert words in str(caught.value) and str(path.name) in str(caught.value)


def test_a_key_given_twice_is_trusted_once(tmp_path: Path) -> None:
    fk.generate_key(tmp_path / "new.pem")
    public = tmp_path / "new.pub.pem"
    copy = tmp_path / "copy.pub.pem"
    shutil.copy(public, copy)
    assert fk.load_public_keys([copy, public]) == [public.read_bytes()]
