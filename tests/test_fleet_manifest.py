"""Signed manifests: ``packcache.fleet.manifest``; the key files are ``test_fleet_keys.py``'s.

Real keys (``cryptography``), real files and, where a missing package or a FIFO is the point, real
child processes. Every refusal is a :class:`~packcache.errors.RemoteError` with its reason.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packcache.errors import FormatError, RemoteError
from packcache.fleet import manifest as mf
from packcache.fleet.manifest import Manifest
from test_fleet_keys import _pem_files

NOW = 1_800_000_000
BLOB = "0123456789abcdef" * 4


def a_manifest(**changes: Any) -> Manifest:
    fields: dict[str, Any] = {
        "model": "bert-int8-0123456789abcdef", "platform_class": "pc1-" + "ab" * 16, "blob_sha256": BLOB,
        "size": 123_456, "generation": 3, "created": NOW - 100, "expires": NOW + 86_400,
        "builder": "packcache 0.1.0 ci-7",
    }  # fmt: skip
    fields.update(changes)
    return Manifest(**fields)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three key pairs made by ``packcache keygen`` (old, new, other): their paths, PEMs and ids."""
    directory = tmp_path_factory.mktemp("keys")
    made: dict[str, Any] = {}
    for name in ("old", "new", "other"):
        private = directory / f"{name}.pem"
        made[name] = {
            "id": mf.generate_key(private),
            "private": mf.load_private_key(private),
            "public": mf.load_public_keys([directory / f"{name}.pub.pem"])[0],
            "path": private,
        }
    return made


def read(
    data: bytes, trusted: list[bytes], *, allow_unsigned: bool = False, now: float = NOW
) -> tuple[Manifest, str | None]:
    return mf.read_envelope(data, trusted_keys=trusted, allow_unsigned=allow_unsigned, now=now)


def refused(reason: str, data: bytes, trusted: list[bytes], **kwargs: Any) -> str:
    with pytest.raises(RemoteError) as caught:
        read(data, trusted, **kwargs)
    assert caught.value.reason == reason, str(caught.value)
    return str(caught.value)


# --------------------------------------------------------------------------- the manifest


def test_a_signed_manifest_round_trips_with_the_signing_key_named(keys: dict[str, Any]) -> None:
    m = a_manifest()
    envelope = mf.sign(m, keys["new"]["private"])
    assert read(envelope, [keys["new"]["public"]]) == (m, keys["new"]["id"])
    assert m.blob_key == f"blobs/sha256/{BLOB}.pcache"
    assert (
        m.manifest_key == mf.manifest_key(m.model, m.platform_class) == f"manifests/{m.model}/{m.platform_class}.json"
    )
    data = json.loads(envelope)
    assert sorted(data) == ["manifest", "signatures"] and data["manifest"] == m.to_dict()
    [signature] = data["signatures"]
    assert (signature["alg"], signature["key"], len(base64.b64decode(signature["sig"]))) == (
        "ed25519",
        keys["new"]["id"],
        64,
    )


def test_canonical_bytes_are_sorted_compact_ascii_and_pinned() -> None:
    m = a_manifest(builder="ci \u00e9t\u00e9")
    expected = (
        b'{"blob_sha256":"' + BLOB.encode() + b'","builder":"ci \\u00e9t\\u00e9","created":1799999900,'
        b'"expires":1800086400,"format":"packcache-manifest/1","generation":3,'
        b'"model":"bert-int8-0123456789abcdef","platform_class":"pc1-abababababababababababababababab","size":123456}'
    )
    assert m.canonical() == expected
    assert Manifest.from_dict(json.loads(expected)).canonical() == expected  # parse and re-encode: the same bytes


def test_a_signature_verifies_with_the_public_key_alone_over_the_canonical_bytes(keys: dict[str, Any]) -> None:
    """What an outside verifier does: take the canonical bytes and the public key, nothing of packcache."""
    m = a_manifest()
    signature = base64.b64decode(json.loads(mf.sign(m, keys["old"]["private"]))["signatures"][0]["sig"])
    public = serialization.load_pem_public_key(keys["old"]["public"])
    assert isinstance(public, ed25519.Ed25519PublicKey)
    public.verify(signature, m.canonical())  # raises InvalidSignature if not


def test_any_one_of_several_trusted_keys_verifies_a_manifest_during_rotation(keys: dict[str, Any]) -> None:
    m = a_manifest()
    old, new = keys["old"], keys["new"]
    # Machines trust old and new while the builder still signs with old; then the builder signs with both;
    # then machines drop old and the builder signs with new only.
    assert read(mf.sign(m, old["private"]), [new["public"], old["public"]])[1] == old["id"]
    both = mf.sign(m, [old["private"], new["private"]])
    assert [s["key"] for s in json.loads(both)["signatures"]] == [old["id"], new["id"]]
    assert read(both, [new["public"]])[1] == new["id"]
    assert read(both, [old["public"]])[1] == old["id"]
    assert read(mf.sign(m, new["private"]), [new["public"]])[1] == new["id"]
    refused("remote_untrusted", mf.sign(m, old["private"]), [new["public"]])  # old dropped: its manifests too


@pytest.mark.parametrize(
    "field, value",
    [("model", "bert-int8-ffffffffffffffff"), ("platform_class", "pc1-" + "cd" * 16), ("blob_sha256", "f" * 64),
     ("size", 123_457), ("generation", 4), ("created", NOW - 99), ("expires", NOW + 10**7), ("builder", "evil")],
)  # fmt: skip
def test_a_field_changed_after_signing_is_untrusted(keys: dict[str, Any], field: str, value: Any) -> None:
    envelope = json.loads(mf.sign(a_manifest(), keys["new"]["private"]))
    envelope["manifest"][field] = value
    message = refused("remote_untrusted", json.dumps(envelope).encode(), [keys["new"]["public"]])
    assert "does not verify" in message
    # allow_unsigned does not excuse a signature by a trusted key that fails: that is tampering.
    refused("remote_untrusted", json.dumps(envelope).encode(), [keys["new"]["public"]], allow_unsigned=True)


def test_a_manifest_signed_by_a_key_not_trusted_here_is_refused_naming_both_keys(keys: dict[str, Any]) -> None:
    envelope = mf.sign(a_manifest(), keys["other"]["private"])
    message = refused("remote_untrusted", envelope, [keys["new"]["public"], keys["old"]["public"]])
    assert keys["other"]["id"] in message and keys["new"]["id"] in message and keys["old"]["id"] in message
    # A signature copied onto another key id does not verify under the trusted key it now names.
    forged = json.loads(envelope)
    forged["signatures"][0]["key"] = keys["new"]["id"]
    assert "does not verify" in refused("remote_untrusted", json.dumps(forged).encode(), [keys["new"]["public"]])
    # With allow_unsigned, a manifest no trusted key signed is taken, and no signer is claimed.
    assert read(envelope, [keys["new"]["public"]], allow_unsigned=True) == (a_manifest(), None)


def test_an_unsigned_manifest_is_taken_only_with_allow_unsigned(keys: dict[str, Any]) -> None:
    unsigned = mf.encode_unsigned(a_manifest())
    assert json.loads(unsigned)["signatures"] == []
    assert "unsigned" in refused("remote_untrusted", unsigned, [keys["new"]["public"]])
    assert "no trusted key" in refused("remote_untrusted", unsigned, [])
    assert read(unsigned, [keys["new"]["public"]], allow_unsigned=True) == (a_manifest(), None)
    assert read(unsigned, [], allow_unsigned=True) == (a_manifest(), None)


def test_an_expired_manifest_is_stale_and_one_never_expiring_only_when_asked(keys: dict[str, Any]) -> None:
    m = a_manifest(expires=NOW)
    envelope = mf.sign(m, keys["new"]["private"])
    assert read(envelope, [keys["new"]["public"]], now=NOW - 1)[0] == m
    assert "expired" in refused("remote_stale", envelope, [keys["new"]["public"]], now=NOW)
    refused("remote_stale", envelope, [keys["new"]["public"]], now=NOW + 10**6)
    made = mf.make_manifest("m", "pc1-x", BLOB, 8192, 1, builder="ci", created=NOW)
    assert made.expires == NOW + mf.DEFAULT_TTL_SECONDS
    forever = mf.make_manifest("m", "pc1-x", BLOB, 8192, 1, builder="ci", created=NOW, ttl_seconds=None)
    assert forever.expires is None
    assert read(mf.sign(forever, keys["new"]["private"]), [keys["new"]["public"]], now=4e9)[0] == forever
    with pytest.raises(ValueError, match="not after it was created"):
        a_manifest(expires=NOW - 100)


def test_check_generation_refuses_rollbacks_and_a_reused_generation_number() -> None:
    m = a_manifest(generation=5)
    mf.check_generation(m, None)
    mf.check_generation(m, 4)
    mf.check_generation(m, 5, last_blob_sha256=BLOB)
    with pytest.raises(RemoteError, match="older than generation 6") as caught:
        mf.check_generation(m, 6)
    assert caught.value.reason == "remote_stale"
    with pytest.raises(RemoteError, match="accepted that generation with blob") as caught:
        mf.check_generation(m, 5, last_blob_sha256="e" * 64)
    assert caught.value.reason == "remote_stale"


# --------------------------------------------------------------------------- malformed envelopes


def _envelope(manifest: Any = None, signatures: Any = None, **top: Any) -> bytes:
    data = {"manifest": a_manifest().to_dict() if manifest is None else manifest, "signatures": signatures or []}
    data.update(top)
    return json.dumps(data).encode()


def _with(**changes: Any) -> dict[str, Any]:
    fields = a_manifest().to_dict()
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not _DROP}


_DROP = object()
MALFORMED = {
    "not json": b"{nope",
    "not utf-8": b'{"manifest": "\xff"}',
    "an array": b"[]",
    "an extra top-level key": _envelope(extra=1),
    "no signatures key": json.dumps({"manifest": a_manifest().to_dict()}).encode(),
    "a duplicate key": b'{"manifest": {}, "manifest": {}, "signatures": []}',
    "deep nesting": b"[" * 100 + b"]" * 100,
    "too large": b" " * (mf.MAX_ENVELOPE_BYTES + 1),
    "NaN": _envelope(_with(size=float("nan"))),
    "a huge integer": _envelope(_with(size=10**50)),
    "a missing field": _envelope(_with(builder=_DROP)),
    "an unknown field": _envelope(_with(note="x")),
    "another format": _envelope(_with(format="packcache-manifest/2")),
    "a boolean generation": _envelope(_with(generation=True)),
    "generation 0": _envelope(_with(generation=0)),
    "a float size": _envelope(_with(size=8192.0)),
    "a size under a header": _envelope(_with(size=4095)),
    "a negative created": _envelope(_with(created=-1)),
    "a string expires": _envelope(_with(expires="never")),
    "uppercase hex": _envelope(_with(blob_sha256=BLOB.upper())),
    "a short digest": _envelope(_with(blob_sha256=BLOB[:-1])),
    "a model with a slash": _envelope(_with(model="a/../../b")),
    "a model with a leading dot": _envelope(_with(model=".hidden")),
    "an empty model": _envelope(_with(model="")),
    "a long class": _envelope(_with(platform_class="p" * 201)),
    "a builder with an escape": _envelope(_with(builder="ci\x1b[2J")),
    "signatures not a list": _envelope(signatures={"alg": "ed25519"}),
    "too many signatures": _envelope(signatures=[{"alg": "x", "key": "k", "sig": "s"}] * 17),
    "a signature with an extra key": _envelope(signatures=[{"alg": "ed25519", "key": "0" * 32, "sig": "", "x": 1}]),
    "a short ed25519 signature": _envelope(
        signatures=[{"alg": "ed25519", "key": "0" * 32, "sig": base64.b64encode(bytes(63)).decode()}]
    ),
    "non-canonical base64": _envelope(signatures=[{"alg": "ed25519", "key": "0" * 32, "sig": "A" * 85 + "B=="}]),
    "a bad key id": _envelope(
        signatures=[{"alg": "ed25519", "key": "xyz", "sig": base64.b64encode(bytes(64)).decode()}]
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_envelope_is_remote_corrupt(case: str) -> None:
    message = refused("remote_corrupt", MALFORMED[case], [], allow_unsigned=True)
    assert message.startswith("remote_corrupt: malformed manifest") and "\n" not in message


def test_a_signature_of_an_unknown_algorithm_is_ignored_not_refused(keys: dict[str, Any]) -> None:
    envelope = json.loads(mf.sign(a_manifest(), keys["new"]["private"]))
    envelope["signatures"].insert(0, {"alg": "ml-dsa-65", "key": "future", "sig": "opaque"})
    assert read(json.dumps(envelope).encode(), [keys["new"]["public"]])[1] == keys["new"]["id"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)
FIELD_VALUES = st.one_of(JSON, st.sampled_from([0, 1, 4096, 2**63, -1, "", "pc1-x", BLOB, None, True]))


@st.composite
def envelopes(draw: st.DrawFn) -> bytes:
    """Any JSON at all, or an envelope whose manifest has real field names with any values."""
    if draw(st.booleans()):
        return json.dumps(draw(JSON)).encode()
    fields = a_manifest().to_dict()
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3)):
        fields[name] = draw(FIELD_VALUES)
    signatures = draw(st.lists(st.dictionaries(st.sampled_from(["alg", "key", "sig"]), FIELD_VALUES), max_size=2))
    return json.dumps({"manifest": fields, "signatures": signatures}).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=envelopes(), allow=st.booleans())
def test_any_json_gives_a_manifest_or_a_remote_error(data: bytes, allow: bool) -> None:
    try:
        manifest, signer = mf.read_envelope(data, trusted_keys=[], allow_unsigned=allow, now=NOW)
    except RemoteError as exc:
        assert exc.reason in ("remote_corrupt", "remote_untrusted", "remote_stale")
        return
    assert isinstance(manifest, Manifest) and signer is None and allow
    assert Manifest.from_dict(json.loads(manifest.canonical())) == manifest


# --------------------------------------------------------------------------- keys in manifests


def test_a_trusted_key_that_is_no_ed25519_public_key_is_a_configuration_error(
    tmp_path: Path, keys: dict[str, Any]
) -> None:
    paths = _pem_files(tmp_path)
    envelope = mf.sign(a_manifest(), keys["new"]["private"])
    with pytest.raises(FormatError, match="trusted key 1 is an RSA key"):
        read(envelope, [paths["rsa public"].read_bytes()])


WITHOUT_CRYPTOGRAPHY = r"""
import json, sys
sys.modules["cryptography"] = None  # as if the fleet extra were not installed
import packcache, packcache.fleet.manifest as mf, packcache.fleet.platform, packcache.fleet.probe
from packcache.errors import RemoteError
from packcache.cli import main
loaded = "cryptography" in sys.modules and sys.modules["cryptography"] is not None
m = mf.make_manifest("m", "pc1-x", "ab" * 32, 8192, 1, builder="ci")
some_key = [b"-----BEGIN PUBLIC KEY-----"]
unsigned_ok = all(
    mf.read_envelope(mf.encode_unsigned(m), trusted_keys=keys, allow_unsigned=True)[0] == m for keys in ([], some_key)
)
signed = json.loads(mf.encode_unsigned(m))
signed["signatures"] = [{"alg": "ed25519", "key": "0" * 32, "sig": "A" * 86 + "=="}]
try:
    mf.read_envelope(json.dumps(signed).encode(), trusted_keys=some_key, allow_unsigned=False)
    refusal = None
except RemoteError as exc:
    refusal = [exc.reason, str(exc)]
code = main(["keygen", sys.argv[1]])
print(json.dumps({"loaded": loaded, "unsigned_ok": unsigned_ok, "refusal": refusal, "code": code}))
"""


def test_without_cryptography_the_core_imports_and_keygen_names_the_fleet_extra(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_CRYPTOGRAPHY, str(tmp_path / "k.pem")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["loaded"] is False and result["unsigned_ok"] is True and result["code"] == 1
    assert result["refusal"][0] == "remote_untrusted" and "packcache[fleet]" in result["refusal"][1]
    assert done.stderr.count("\n") == 1 and "pip install 'packcache[fleet]'" in done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


def test_openssl_verifies_a_packcache_signature_and_its_keys_sign_for_packcache(tmp_path: Path) -> None:
    """Interoperability, both ways, with real openssl processes: the format is the canonical bytes and ed25519,
    nothing of packcache's own."""

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)

    assert run("openssl", "genpkey", "-algorithm", "ed25519", "-out", "o.pem").returncode == 0
    assert run("openssl", "pkey", "-in", "o.pem", "-pubout", "-out", "o.pub.pem").returncode == 0
    private, [public] = mf.load_private_key(tmp_path / "o.pem"), mf.load_public_keys([tmp_path / "o.pub.pem"])
    m = a_manifest()
    envelope = mf.sign(m, private)
    assert read(envelope, [public])[1] == mf.key_id(public)
    (tmp_path / "canonical.json").write_bytes(m.canonical())
    (tmp_path / "sig.bin").write_bytes(base64.b64decode(json.loads(envelope)["signatures"][0]["sig"]))
    verify = ("openssl", "pkeyutl", "-verify", "-pubin", "-inkey", "o.pub.pem", "-rawin", "-sigfile", "sig.bin")
    done = run(*verify, "-in", "canonical.json")
    assert done.returncode == 0 and "Signature Verified Successfully" in done.stdout, done.stderr
    (tmp_path / "tampered.json").write_bytes(a_manifest(generation=4).canonical())
    assert run(*verify, "-in", "tampered.json").returncode != 0
