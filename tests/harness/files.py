"""Cache files as the tests see and spoil them: a file's state, what it commits, garbage, flipped bits.

Also the safetensors files that the model tests load, written from a module's
parameters.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
from pathlib import Path
from typing import Any

from packcache import format as fmt
from packcache._generations import read_committed

FileState = tuple[int, int, int, bytes]  # inode, size, mtime_ns, bytes


def file_state(path: Path) -> FileState:
    """(inode, size, mtime_ns, bytes) of a file: what "nothing was written" compares."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, path.read_bytes()


def snapshot(path: Path) -> FileState | None:
    """``file_state(path)``, or None when there is no file (which "nothing was written" compares too)."""
    try:
        return file_state(path)
    except FileNotFoundError:
        return None


def committed(path: Path) -> tuple[fmt.Slot, dict[str, fmt.Entry]]:
    """The committed slot and entries of a valid cache file (which must have a commit)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _, slot, entries = read_committed(fd)
    finally:
        os.close(fd)
    assert slot is not None, f"{path} has no commit"
    return slot, entries


def plant_socket(path: Path) -> None:
    """A Unix socket file at ``path`` (the socket closed, the file left), bound through its directory's descriptor:
    an xdist worker's tmp path can pass AF_UNIX's 108-byte limit."""
    listener = socket.socket(socket.AF_UNIX)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        listener.bind(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)
        listener.close()


def garbage(path: Path, nbytes: int, mode: int = 0o600) -> None:
    """Write ``nbytes`` of deterministic noise at ``path``: a corrupt cache file the cache must rebuild."""
    path.write_bytes(random.Random(nbytes).randbytes(nbytes))
    os.chmod(path, mode)


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    """Flip one bit of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def save_safetensors(model: Any, path: Path) -> Path:
    """Write a torch module's parameters as a safetensors file (little-endian float32); return ``path``."""
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, param in model.named_parameters():
        data = param.detach().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(param.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path
