"""The safetensors reader (``packcache.safetensors.SafetensorsFile``): the header first, tensor bytes on
demand, and hostile files.

Issue 10, item 16: ``SafetensorsFile`` raised ``TypeError`` (dtype given as a list), ``RecursionError``
(deep JSON) and a plain ``ValueError`` (an integer over 4,300 digits), and accepted a dimension over
int64 (failing later); a FIFO at the model path hung it. Every malformed header is now a FormatError
naming the file and the offset (``packcache run --model`` with such a file: test_cli_run.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from packcache.errors import FormatError, UntrustedFileError
from packcache.packers import to_float32
from packcache.safetensors import SafetensorsFile
from test_packers import _bf16_bits


def _write_safetensors(path: Path, header: dict[str, Any], data: bytes, header_len: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def test_safetensors_reads_header_then_tensor_bytes_on_demand(tmp_path: Path) -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = _bf16_bits(np.array([1.5, -2.0], np.float32))
    header = {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [2], "data_offsets": [24, 28]},
    }
    path = _write_safetensors(tmp_path / "m.safetensors", header, w.tobytes() + b.tobytes())
    st = SafetensorsFile(path)
    assert st.names() == ["w", "b"] and st.metadata == {"format": "pt"}
    assert st.meta("b").dtype == "BF16" and st.meta("w").shape == (2, 3)
    content = hashlib.sha256(path.read_bytes()).hexdigest()
    assert st.identity == f"sha256:{content}:{path.stat().st_size}"  # the bytes name it, not where they lie
    np.testing.assert_array_equal(st.read("w"), w)
    assert to_float32(st.read("b"), "BF16").tolist() == [1.5, -2.0]
    with pytest.raises(KeyError):
        st.meta("missing")


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, b"\0" * 12, "need 8"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "past the end"),
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unsupported dtype"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "invalid shape"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "invalid data_offsets"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlaps",
        ),
        ({"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, b"\0" * 8, "need"),
    ],
)
def test_safetensors_rejects_hostile_headers(tmp_path: Path, header: dict[str, Any], data: bytes, message: str) -> None:
    path = _write_safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(FormatError, match=message):
        SafetensorsFile(path)


def test_safetensors_rejects_a_header_length_past_the_file(tmp_path: Path) -> None:
    path = _write_safetensors(tmp_path / "bad.safetensors", {}, b"", header_len=10**9)
    with pytest.raises(FormatError, match="header length"):
        SafetensorsFile(path)
    (tmp_path / "short").write_bytes(b"\1\2")
    with pytest.raises(FormatError, match="shorter than the 8-byte"):
        SafetensorsFile(tmp_path / "short")
    _write_safetensors(tmp_path / "notjson", {}, b"")
    raw = b"{not json"
    (tmp_path / "notjson").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(FormatError, match="not UTF-8 JSON"):
        SafetensorsFile(tmp_path / "notjson")


# --------------------------------------------------------------------------- hostile files


HANG = 60.0  # seconds; reaching it means something blocked


def write(path: Path, header: bytes, data: bytes = b"", header_len: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if header_len is None else header_len) + header + data)
    return path


def entry(dtype: object = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict[str, object]:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}  # fmt: skip


def header(**tensors: object) -> bytes:
    return json.dumps(tensors).encode()


HOSTILE: dict[str, tuple[bytes, bytes, str]] = {  # name: (header bytes, data, message)
    "dtype-list": (header(w=entry(dtype=["F32"])), bytes(8), "unsupported dtype"),
    "dtype-dict": (header(w=entry(dtype={"F32": 1})), bytes(8), "unsupported dtype"),
    "dtype-number": (header(w=entry(dtype=4)), bytes(8), "unsupported dtype"),
    "deep-json": (b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", "nested deeper than 64"),
    "deep-inside-entry": (b'{"w": {"dtype": "F32", "shape": ' + b"[" * 5000 + b"]" * 5000 + b"}}", b"", "nested"),
    "huge-int-4301-digits": (
        b'{"w": {"dtype": "F32", "shape": [' + b"7" * 4301 + b'], "data_offsets": [0, 8]}}',
        bytes(8),
        "4301 digits",
    ),
    "huge-int-50-digits": (
        b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, ' + b"8" * 50 + b"]}}",
        bytes(8),
        "50 digits",
    ),
    "dim-over-int64": (header(w=entry(shape=(2**63, 0), offsets=(0, 0))), b"", "invalid shape"),
    "dim-2**64": (header(w=entry(shape=(2**64 + 1, 0), offsets=(0, 0))), b"", "invalid shape"),
    "dim-bool": (header(w=entry(shape=[True, 2])), bytes(8), "invalid shape"),
    "dims-over-numpy-limit": (header(w=entry(shape=[1] * 65, offsets=(0, 4))), bytes(4), "invalid shape"),
    "negative-offset": (header(w=entry(offsets=(-8, 0))), bytes(8), "invalid data_offsets"),
    "float-offset": (header(w=entry(offsets=(0.0, 8))), bytes(8), "invalid data_offsets"),
    "three-offsets": (header(w=entry(offsets=(0, 8, 16))), bytes(16), "invalid data_offsets"),
    "offsets-not-a-list": (header(w=entry(offsets="0-8")), bytes(8), "invalid data_offsets"),
    "overlapping": (header(a=entry(), b=entry(offsets=(4, 12))), bytes(12), "overlaps"),
    "past-the-end": (header(w=entry(shape=(4,), offsets=(0, 16))), bytes(8), "past the end"),
    "size-mismatch": (header(w=entry(shape=(3,), offsets=(0, 8))), bytes(8), "need 12"),
    "entry-is-a-list": (header(w=[1, 2]), b"", "not an object"),
    "entry-is-null": (header(w=None), b"", "not an object"),
    "header-is-a-list": (b"[1, 2]", b"", "not an object"),
    "duplicate-tensor": (
        b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
        b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        bytes(8),
        "duplicate key 'w'",
    ),
    "duplicate-field": (
        b'{"w": {"dtype": "F32", "dtype": "I8", "shape": [2], "data_offsets": [0, 8]}}',
        bytes(8),
        "duplicate key 'dtype'",
    ),
    "nan": (b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}', bytes(8), "NaN is not JSON"),
    "not-utf8": (b'{"w\xff": {}}', b"", "not UTF-8 JSON"),
    "not-json": (b"{not json", b"", "not UTF-8 JSON"),
    "metadata-not-strings": (b'{"__metadata__": {"a": 1}}', b"", "__metadata__"),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_header_is_a_format_error_naming_file_and_offset(tmp_path: Path, case: str) -> None:
    raw, data, message = HOSTILE[case]
    path = write(tmp_path / "bad.safetensors", raw, data)
    with pytest.raises(FormatError, match=message) as raised:
        SafetensorsFile(path)
    error = raised.value
    assert error.path == str(path) and error.offset is not None and 8 <= error.offset <= 8 + len(raw)
    assert f"{path}: offset {error.offset}: " in str(error) and len(str(error)) < 600


def test_the_offset_points_at_the_offending_tensor(tmp_path: Path) -> None:
    raw = header(good=entry(), bad=entry(dtype=["F32"], offsets=(8, 16)))
    path = write(tmp_path / "bad.safetensors", raw, bytes(16))
    with pytest.raises(FormatError) as raised:
        SafetensorsFile(path)
    assert raised.value.offset == 8 + raw.index(b'"bad"')


def test_header_length_past_the_file_or_the_cap_names_offset_zero(tmp_path: Path) -> None:
    for header_len in (10**9, 2**64 - 1, 50):
        path = write(tmp_path / "bad.safetensors", b"{}", header_len=header_len)
        with pytest.raises(FormatError, match="header length") as raised:
            SafetensorsFile(path)
        assert raised.value.offset == 0


def test_a_dimension_over_int64_is_refused_at_parse_not_later(tmp_path: Path) -> None:
    """Zero elements, so the byte count matches: the old reader accepted it and numpy failed later."""
    path = write(tmp_path / "bad.safetensors", header(w=entry(shape=(2**63, 0), offsets=(0, 0))))
    with pytest.raises(FormatError, match=r"\[0, 2\*\*63-1\]"):
        SafetensorsFile(path)
    ok = write(tmp_path / "ok.safetensors", header(w=entry(shape=(2**63 - 1, 0), offsets=(0, 0))))
    assert SafetensorsFile(ok).meta("w").shape == (2**63 - 1, 0)


def test_reading_a_tensor_truncated_after_open_is_a_format_error_naming_the_offset(tmp_path: Path) -> None:
    raw = header(a=entry(shape=(2,), offsets=(0, 8)), b=entry(shape=(4,), offsets=(8, 24)))
    data = np.arange(6, dtype=np.float32).tobytes()
    path = write(tmp_path / "m.safetensors", raw, data)
    source = SafetensorsFile(path)
    assert source.read("a").tolist() == [0.0, 1.0]
    os.truncate(path, 8 + len(raw) + 12)  # b's bytes vanish half-way
    # Another version of the file now: no tensor is read from it, not even one whose bytes are still there.
    for name, begin in (("a", 8 + len(raw)), ("b", 8 + len(raw) + 8)):
        with pytest.raises(FormatError, match="changed since its header was read") as raised:
            source.read(name)
        assert raised.value.offset == begin


def test_a_same_size_write_after_open_with_mtime_restored_is_refused(tmp_path: Path) -> None:
    """The digest names the version that was opened: a write in place moves ctime, which no tool restores."""
    raw = header(a=entry())
    path = write(tmp_path / "m.safetensors", raw, np.ones(2, np.float32).tobytes())
    source = SafetensorsFile(path)
    named = source.identity
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(8 + len(raw))
        f.write(np.zeros(2, np.float32).tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # touch -r / cp -p / rsync -t
    with pytest.raises(FormatError, match="changed since its header was read"):
        source.read("a")
    assert SafetensorsFile(path).identity != named


def test_reading_after_the_file_was_replaced_is_refused(tmp_path: Path) -> None:
    raw = header(a=entry())
    path = write(tmp_path / "m.safetensors", raw, np.ones(2, np.float32).tobytes())
    source = SafetensorsFile(path)
    write(tmp_path / "other", raw, np.zeros(2, np.float32).tobytes())
    os.rename(tmp_path / "other", path)  # same header, other bytes: the identity in pack keys would lie
    with pytest.raises(FormatError, match="replaced"):
        source.read("a")


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero-link"])
def test_a_non_file_at_the_model_path_is_refused_without_hanging(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    code = (
        "import sys\nfrom packcache.safetensors import SafetensorsFile\n"
        "try:\n    SafetensorsFile(sys.argv[1])\nexcept PermissionError as e:\n    print(type(e).__name__, e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.startswith("UntrustedFileError untrusted safetensors file") and "not a regular file" in done.stdout
    )
    with pytest.raises(UntrustedFileError, match="not a regular file"):
        SafetensorsFile(path)  # non-blocking: safe in-process once the subprocess proved it
