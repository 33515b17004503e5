"""The model a cache file holds: its record and its embedded files (docs/FORMAT.md "Embedded entries").

A version-2 cache file built by a model loader (:mod:`packcache.hf`, :mod:`packcache.models.minilm`,
``packcache build``) holds, besides the packs, everything needed to build and run the model with no
checkpoint on the machine:

- the **model record** (:class:`ModelRecord`, entry ``packcache.model``): which loader, scheme and
  auto class, the content identity of every source file (what the file *is*), and the shape, dtype and
  source of every checkpoint tensor (what every pack key is made of);
- the checkpoint's **files** (entries ``packcache.file/<path>``): config, generation config, tokenizer
  files, sentence-transformers module configs (:func:`collect_files` says which).

Writers: :func:`record_requests` gives the cache requests that store them; a loader passes them to a
session of the cache it packed into. Readers: :func:`open_bundle` reads a cache file's record (the index
only, then the record's bytes: no pack is read), :meth:`Bundle.read_file` one embedded file (checked:
crc, sha256, bounded JSON), :meth:`Bundle.extract` all of them into a private directory for libraries
that read files (tokenizers, sentence-transformers).

Nothing executable is ever stored or written out: only data files of known names are collected, and a
config naming remote code is refused (:func:`check_no_remote_code`) when the file is built and again
when it is read.

>>> import os, tempfile, numpy as np, packcache
>>> d = tempfile.mkdtemp()
>>> record = ModelRecord(loader="hf", scheme="fp32", group_size=32, model_type="bert", auto_class="AutoModel",
...                      sentence_transformers=None, sources=("sha256:" + "0" * 64 + ":8",),
...                      tensors={"w": ((2,), "F32", 0)}, files={})
>>> files = {"config.json": b'{"model_type": "bert"}'}
>>> with packcache.WeightCache(os.path.join(d, "m.pcache")) as cache, cache.session() as s:
...     _ = s.get_many(record_requests(record, files))
>>> with open_bundle(os.path.join(d, "m.pcache")) as bundle:
...     bundle.record.scheme, bundle.read_json("config.json")["model_type"], sorted(bundle.record.files)
('fp32', 'bert', ['config.json'])
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _boundedjson as boundedjson
from . import _defaults
from . import format as fmt
from ._generations import read_committed
from ._paths import open_checked, pread_exact, read_bounded
from .cache import PackKey, Request
from .errors import FormatError
from .identity import digest_path
from .maintenance import VerifyProblem, verify_open
from .safetensors import DTYPES, MAX_NDIM, TensorMeta

__all__ = [
    "RECORD_VERSION",
    "ST_MODULE_PREFIX",
    "ST_TRANSFORMER_REFS",
    "TOKENIZER_FILES",
    "Bundle",
    "ModelRecord",
    "RecordSource",
    "SourceFile",
    "check_no_remote_code",
    "collect_files",
    "is_cache_file",
    "open_bundle",
    "record_requests",
    "tensor_table",
    "transformer_folder",
]

RECORD_VERSION = 1
#: Files a tokenizer reads: its configs, chat templates, and every vocabulary file name transformers' tokenizers
#: declare (their ``VOCAB_FILES_NAMES``: sentencepiece models, BPE codes, vocabularies): data, never code.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model",
    "spm.model", "spm_char.model", "bpe.codes", "dict.txt", "vocab-src.json", "vocab-tgt.json", "entity_vocab.json",
    "emoji.json", "byte_maps.json", "normalizer.json", "word_pronunciation.json", "word_shape.json",
    "prophetnet.tokenizer", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
#: Files of a checkpoint (or of a sentence-transformers Transformer module's folder) a model needs as data.
MODEL_FILES = (
    "config.json", "generation_config.json", *TOKENIZER_FILES, "preprocessor_config.json",
    "sentence_bert_config.json",
)  # fmt: skip
#: Files of a sentence-transformers model's root folder.
ST_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json")
#: Files of a sentence-transformers module folder other than the Transformer's (Pooling, Normalize, Dense).
ST_MODULE_FILES = re.compile(r"[A-Za-z0-9_.-]+\.json|model\.safetensors")
#: Weights saved with ``torch.save`` (pickle): a module folder holding one cannot be embedded (no pickle, anywhere).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
#: The module types sentence-transformers itself defines: anything else in ``modules.json`` is code to import.
ST_MODULE_PREFIX = "sentence_transformers."
#: Config members that make transformers import a checkpoint's own Python code.
REMOTE_CODE_FIELDS = ("auto_map", "trust_remote_code")
#: ``modules.json`` type names of sentence-transformers' Transformer module (old and new spellings).
ST_TRANSFORMER_REFS = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.transformer.Transformer",
    "sentence_transformers.base.modules.Transformer",
    "sentence_transformers.base.modules.transformer.Transformer",
    "sentence_transformers.sentence_transformer.modules.Transformer",
)
_SOURCE = re.compile(r"sha256:[0-9a-f]{64}:[0-9]{1,20}")


def is_cache_file(path: str | os.PathLike[str]) -> bool:
    """Whether a ``--model``/``path`` argument names a cache file (it ends in ``.pcache``) rather than a checkpoint.

    >>> is_cache_file("/x/m.pcache"), is_cache_file("/x/ckpt")
    (True, False)
    """
    return os.fspath(path).endswith(".pcache")


@dataclass(frozen=True)
class ModelRecord:
    """What a cache file says about the model it packs (docs/FORMAT.md "Embedded entries").

    Attributes:
        loader: ``"hf"`` (:mod:`packcache.hf`) or ``"minilm"`` (:mod:`packcache.models.minilm`).
        scheme, group_size: the recipe the packs were made with (:func:`packcache.loader.resolve`).
        model_type: the config's ``model_type``.
        auto_class: the transformers auto class the model was built with (hf), else ``None``.
        sentence_transformers: for a sentence-transformers model, the folder of its Transformer module
            (``""`` for the root), else ``None``.
        sources: the content identity (``sha256:<hex>:<size>``) of every checkpoint file the packs came from.
        tensors: every checkpoint tensor: name -> ``(shape, safetensors dtype, index into sources)``.
        files: every embedded file: relative path -> sha256 hex.
    """

    loader: str
    scheme: str
    group_size: int
    model_type: str
    auto_class: str | None
    sentence_transformers: str | None
    sources: tuple[str, ...]
    tensors: Mapping[str, tuple[tuple[int, ...], str, int]]
    files: Mapping[str, str]

    def meta(self, name: str) -> TensorMeta:
        """The :class:`~packcache.safetensors.TensorMeta` of checkpoint tensor ``name`` (what its pack keys name).

        Raises:
            KeyError: no such tensor.
        """
        shape, dtype, source = self.tensors[name]
        return TensorMeta(name, shape, dtype, self.sources[source])

    def encode(self) -> bytes:
        """The record's bytes: canonical JSON (a rebuild of the same model gives the same bytes, the same key)."""
        value = {
            "format": fmt.MODEL_ENTRY, "version": RECORD_VERSION, "loader": self.loader, "scheme": self.scheme,
            "group_size": self.group_size, "model_type": self.model_type, "auto_class": self.auto_class,
            "sentence_transformers": self.sentence_transformers, "sources": list(self.sources),
            "tensors": [[name, list(shape), dtype, source] for name, (shape, dtype, source) in self.tensors.items()],
            "files": dict(self.files),
        }  # fmt: skip
        return fmt.canonical_value(value)

    @classmethod
    def decode(cls, data: bytes, *, path: str | None = None) -> ModelRecord:
        """Parse and check a record's bytes, member by member.

        Raises:
            FormatError: not bounded JSON, or a member missing or of the wrong kind (naming it).
        """
        value = boundedjson.loads(data, path=path, what="model record", unique_keys=True, finite=True)

        def bad(what: str) -> FormatError:
            return FormatError(f"the model record's {what}", path=path)

        if not isinstance(value, dict) or value.get("format") != fmt.MODEL_ENTRY:
            raise bad("format is not packcache.model")
        if value.get("version") != RECORD_VERSION:
            raise bad(f"version {str(value.get('version'))[:20]} is not {RECORD_VERSION} (a newer packcache wrote it?)")
        strings = {"loader": ("hf", "minilm"), "scheme": None, "model_type": None}
        for member, allowed in strings.items():
            text = value.get(member)
            if not isinstance(text, str) or not 0 < len(text) <= 100 or (allowed and text not in allowed):
                raise bad(f"{member} is not a known short string")
        group_size = value.get("group_size")
        if type(group_size) is not int or not 0 < group_size <= 1 << 20:
            raise bad("group_size is not a positive integer")
        for member in ("auto_class", "sentence_transformers"):
            text = value.get(member)
            if text is not None and (not isinstance(text, str) or len(text) > 255):
                raise bad(f"{member} is neither null nor a short string")
        sources = value.get("sources")
        if not isinstance(sources, list) or not all(isinstance(s, str) and _SOURCE.fullmatch(s) for s in sources):
            raise bad("sources are not a list of sha256:<hex>:<size>")
        tensors: dict[str, tuple[tuple[int, ...], str, int]] = {}
        rows = value.get("tensors")
        if not isinstance(rows, list):
            raise bad("tensors are not a list")
        for row in rows:
            ok = isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and 0 < len(row[0]) <= 1024
            ok = ok and isinstance(row[1], list) and len(row[1]) <= MAX_NDIM
            ok = ok and all(type(d) is int and 0 <= d <= fmt.MAX_DIM for d in row[1])
            ok = ok and row[2] in DTYPES and type(row[3]) is int and 0 <= row[3] < len(sources)
            if not ok or row[0] in tensors:
                raise bad(f"tensor row {str(row)[:80]} is not a unique [name, shape, dtype, source index]")
            tensors[row[0]] = (tuple(row[1]), row[2], row[3])
        files = value.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for v in files.values()
        ):
            raise bad("files are not an object of path -> sha256")
        for file in files:
            if not _plain(file):
                raise bad(f"file path {file[:80]!r} is not a relative path of plain components")
        for file in files:
            # a path that is a file and a folder at once cannot be written out (extract): refused here, by name
            # pinned by tests/test_bundle.py::test_a_record_listing_a_file_and_a_file_inside_it_is_refused_naming_both
            parts = file.split("/")
            for end in range(1, len(parts)):
                if (folder := "/".join(parts[:end])) in files:
                    raise bad(
                        f"files list both {folder[:80]!r} and {file[:80]!r}: one path cannot be a file and a folder"
                    )
        return cls(
            loader=value["loader"], scheme=value["scheme"], group_size=group_size, model_type=value["model_type"],
            auto_class=value.get("auto_class"), sentence_transformers=value.get("sentence_transformers"),
            sources=tuple(sources), tensors=tensors, files=dict(files),
        )  # fmt: skip


def _plain(path: str) -> bool:
    try:
        fmt.file_entry_name(path)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class SourceFile:
    """A checkpoint file to embed (:func:`collect_files`), known by its digest: a warm launch finds the digest
    without reading the file (:func:`packcache.identity.digest_path`), so only a file the cache lacks is read."""

    relative: str
    path: str
    sha256: str
    size: int

    def read(self) -> bytes:
        """The file's bytes, read as every checkpoint file is, checked: the digest it was named by, bounded JSON
        for a ``*.json`` file, and no remote code (:func:`check_no_remote_code`).

        Raises:
            FormatError: it changed since it was hashed, malformed JSON, remote code. UntrustedFileError, OSError.
        """
        data = read_bounded(self.path, what=self.relative, max_bytes=fmt.MAX_FILE_BYTES)
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise FormatError("changed while the model was being loaded: load it again", path=self.path)
        if self.relative.endswith(".json"):
            check_no_remote_code(self.relative, _json(data, self.path), path=self.path)
        return data


def record_requests(record: ModelRecord, files: Mapping[str, bytes | SourceFile]) -> list[Request]:
    """The cache requests that store ``record`` and ``files`` (relative path -> bytes, or a :class:`SourceFile` read
    only if the cache lacks it): one entry each, keyed by its sha256 (docs/FORMAT.md R49). ``record.files`` is made
    to list exactly ``files``.

    Raises:
        ValueError: a path that cannot be embedded, or a file over the 64 MiB cap.
    """
    listed: dict[str, str] = {}
    requests: list[Request] = []
    for path, file in sorted(files.items()):
        size = file.size if isinstance(file, SourceFile) else len(file)
        if size > fmt.MAX_FILE_BYTES:
            raise ValueError(f"cannot embed {path!r}: {size} bytes, over the {fmt.MAX_FILE_BYTES}-byte cap")
        name = fmt.file_entry_name(path)
        if isinstance(file, SourceFile):
            listed[path] = file.sha256
            key = fmt.embedded_key("file", sha256=file.sha256)
            requests.append((name, _reader(file.read), PackKey.from_canonical(key)))
        else:
            listed[path] = hashlib.sha256(file).hexdigest()
            requests.append(_request(name, "file", file))
    record = dataclasses.replace(record, files=listed)
    requests.append(_request(fmt.MODEL_ENTRY, "model", record.encode()))
    return requests


def _reader(read: Callable[[], bytes]) -> Callable[[], np.ndarray[Any, Any]]:
    return lambda: np.frombuffer(read(), dtype=np.uint8).copy()


def _request(name: str, kind: str, data: bytes) -> Request:
    key = PackKey.from_canonical(fmt.embedded_key(kind, data))
    return name, _reader(lambda: data), key


def check_no_remote_code(name: str, settings: Any, *, path: str | None = None) -> None:
    """Refuse a config (``config.json``, ``tokenizer_config.json``) that names remote code, or a ``modules.json``
    naming a module class sentence-transformers does not define: packcache never stores or runs code.

    Raises:
        FormatError: it does (naming the file and the member).
    """
    where = path or name
    base = os.path.basename(name)
    if base == "modules.json":
        for module in settings if isinstance(settings, list) else []:
            kind = module.get("type") if isinstance(module, dict) else None
            if not isinstance(kind, str) or not kind.startswith(ST_MODULE_PREFIX):
                raise FormatError(
                    f"modules.json names the module class {str(kind)[:80]!r}, which is code of the model's own "
                    f"(not sentence-transformers'): packcache never stores or runs remote code",
                    path=where,
                )  # fmt: skip
        return
    if isinstance(settings, dict):
        for field in REMOTE_CODE_FIELDS:
            if field in settings and settings[field] not in (None, False, {}):
                raise FormatError(
                    f"{base} names remote code ({field}): packcache never stores or runs a model's own code; "
                    f"use a model transformers implements",
                    path=where,
                )  # fmt: skip


def collect_files(
    directory: str | os.PathLike[str], *, sentence_transformers: str | None = None
) -> dict[str, SourceFile]:
    """The files of a checkpoint to embed: relative path -> :class:`SourceFile`. Those of :data:`MODEL_FILES` found in
    the model's folder (``directory``, or its ``sentence_transformers`` subfolder), and for a sentence-transformers
    model (``sentence_transformers`` not ``None``) :data:`ST_FILES` and the configs and small weights of its other
    modules (``modules.json`` paths). Each is known by its digest (found without reading it on a warm launch); its
    bytes are read, and its JSON checked, only when the cache lacks it (:meth:`SourceFile.read`).

    Raises:
        FormatError: a file over the cap, a malformed ``modules.json`` or one naming a module class of the model's
            own. UntrustedFileError, OSError: a file cannot be opened (a FIFO is refused, never waited on).
    """
    root = os.fspath(directory)
    found: dict[str, SourceFile] = {}

    def take(relative: str) -> None:
        full = os.path.join(root, relative)
        if relative in found or not os.path.lexists(full):
            return
        digest = digest_path(full)
        if digest.size > fmt.MAX_FILE_BYTES:
            raise FormatError(f"{digest.size} bytes, past the {fmt.MAX_FILE_BYTES}-byte cap of a file to embed",
                              path=full)  # fmt: skip
        found[relative] = SourceFile(relative, full, digest.sha256, digest.size)

    folder = sentence_transformers or ""
    for name in MODEL_FILES:
        take(f"{folder}/{name}" if folder else name)
    if sentence_transformers is not None:
        for name in ST_FILES:
            take(name)
        listing = found.get("modules.json")
        modules = _json(listing.read(), listing.path) if listing is not None else []
        for module in modules if isinstance(modules, list) else []:
            sub = module.get("path") if isinstance(module, dict) else None
            if not isinstance(sub, str) or sub.strip("/") in ("", folder):
                continue
            for relative in _module_files(root, sub, str(module.get("type"))):
                take(relative)
    return found


def _module_files(root: str, sub: str, kind: str) -> list[str]:
    """The files of a sentence-transformers module folder (``sub``, as ``modules.json`` gives it) to embed: every
    file in it, each of :data:`ST_MODULE_FILES`, so the file alone loads the module as its folder does.

    Raises:
        FormatError: a module the cache file could not hold: its folder outside the model or a symlink, or a file in
            it that cannot be embedded (pickle weights, ``pytorch_model.bin``, above all: packcache never reads nor
            stores pickle), naming the module and the file. A build refuses it rather than publish a file no node
            can load.
    """
    # pinned by tests/test_bundle.py::test_a_module_whose_weights_are_pickle_is_refused_at_build_naming_it
    folder = sub.rstrip("/")
    module = f"module {folder[:80]!r} ({kind[:80]})"
    if not _plain(folder):
        raise FormatError(
            f"{module}: its path is not a folder inside the model", path=os.path.join(root, "modules.json")
        )
    directory = os.path.join(root, folder)
    if os.path.islink(directory):
        raise FormatError(f"{module}: its folder is a symlink; packcache embeds the model's own folders only",
                          path=directory)  # fmt: skip
    if not os.path.isdir(directory):
        return []  # a module with no files of its own (Normalize): sentence-transformers reads nothing there
    wanted: list[str] = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("."):
            continue  # hidden files (.gitattributes, ...) are no module's data
        path = os.path.join(directory, name)
        if not ST_MODULE_FILES.fullmatch(name) or not os.path.isfile(path):
            why = (
                "pickle, which packcache never reads nor embeds: save the model with safetensors "
                "(SentenceTransformer.save writes model.safetensors)"
                if name.endswith(PICKLE_SUFFIXES)
                else "packcache embeds a module's *.json files and model.safetensors only"
            )
            raise FormatError(
                f"cannot make a self-contained cache file: {module} needs {folder}/{name}, {why} (a load with "
                "caching off, cache=False, writes no file)",
                path=path,
            )  # fmt: skip
        wanted.append(f"{folder}/{name}")
    return wanted


def _json(data: bytes, where: str) -> Any:
    return boundedjson.loads(data, path=where, what=os.path.basename(where), finite=True)


class Bundle:
    """A cache file opened for its model record and embedded files (:func:`open_bundle`). Holds the file open
    until :meth:`close` (a context manager): what it reads comes from the file it checked, however the path changes.

    Attributes:
        path: the cache file. record: its :class:`ModelRecord`. platform: its platform fingerprint (bytes).
        identity: ``(st_dev, st_ino)`` of the file read. entries: how many entries its index lists.
    """

    def __init__(self, path: str, fd: int, st: os.stat_result) -> None:
        self.path, self._fd = path, fd
        self.identity = (st.st_dev, st.st_ino)
        header, _, entries = read_committed(fd, path=path)
        self.platform = header.platform
        self._entries = entries
        self.entries = len(entries)
        entry = entries.get(fmt.MODEL_ENTRY)
        if entry is None:
            raise FormatError(
                "holds no model record: it is a cache of packs only (written by WeightCache directly, or by a "
                "build that was interrupted); build it with `packcache build` or a model loader",
                path=path,
            )  # fmt: skip
        self.record = ModelRecord.decode(self._read(entry), path=f"{path}::{fmt.MODEL_ENTRY}")
        for file in self.record.files:
            if fmt.file_entry_name(file) not in entries:
                raise FormatError(f"the model record lists {file!r}, which the file does not hold", path=path)

    def _read(self, entry: fmt.Entry) -> bytes:
        data = pread_exact(self._fd, entry.nbytes, entry.offset, path=self.path, what=entry.name)
        fmt.check_embedded(entry, data, path=self.path)
        return data

    def identity_of(self, relative: str) -> str:
        """``sha256:<hex>:<size>`` of an embedded file, from the record and the index (its bytes are not read): what
        :func:`packcache.identity.digest_path` names the same file by.

        Raises:
            KeyError: no such file.
        """
        return f"sha256:{self.record.files[relative]}:{self._entries[fmt.file_entry_name(relative)].nbytes}"

    def has_file(self, relative: str) -> bool:
        """Whether the file holds an embedded file at ``relative``."""
        return relative in self.record.files

    def read_file(self, relative: str) -> bytes:
        """An embedded file's bytes, checked (docs/FORMAT.md R50); a JSON file is also parsed bounded and checked
        for remote code.

        Raises:
            KeyError: no such file. FormatError: its bytes fail a check.
        """
        return self._checked(relative)[0]

    def read_json(self, relative: str) -> Any:
        """An embedded JSON file, parsed bounded (see :meth:`read_file`; a ``*.json`` file is parsed once)."""
        data, parsed = self._checked(relative)
        return parsed if relative.endswith(".json") else _json(data, f"{self.path}::{relative}")

    def _checked(self, relative: str) -> tuple[bytes, Any]:
        """An embedded file's bytes, checked, and for a ``*.json`` file its value, parsed once (else ``None``)."""
        if relative not in self.record.files:
            raise KeyError(f"{self.path} holds no embedded file {relative!r}")
        data = self._read(self._entries[fmt.file_entry_name(relative)])
        if not relative.endswith(".json"):
            return data, None
        where = f"{self.path}::{relative}"
        parsed = _json(data, where)
        check_no_remote_code(relative, parsed, path=where)
        return data, parsed

    def extract(self, directory: str | os.PathLike[str], only: Iterable[str] | None = None) -> None:
        """Write every embedded file (or those of ``only`` the file holds) under ``directory`` (which must exist,
        empty and private: a fresh ``tempfile.mkdtemp()``), each checked as :meth:`read_file` checks it, ``0600``,
        never following a symlink.

        Raises:
            FormatError: a file fails its checks.
        """
        root = os.fspath(directory)
        wanted = sorted(self.record.files) if only is None else sorted(set(only) & set(self.record.files))
        for relative in wanted:
            data = self.read_file(relative)
            parts = relative.split("/")
            dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                for part in parts[:-1]:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, _defaults.PRIVATE_DIR_MODE, dir_fd=dir_fd)
                    sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                    os.close(dir_fd)
                    dir_fd = sub
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(parts[-1], flags, _defaults.PRIVATE_FILE_MODE, dir_fd=dir_fd)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
            finally:
                os.close(dir_fd)

    def damaged(self, name: str) -> list[VerifyProblem]:
        """The packs made from tensor ``name`` whose bytes fail their checksum (else, if none is named after it, every
        damaged pack of the file); read with ``pread``. A load reads no pack data: only one that failed comes here."""
        if self._fd < 0:
            return []  # closed: the caller's own error stands
        prefix = f"{name}:"
        named = any(entry.startswith(prefix) for entry in self._entries)
        report = verify_open(self._fd, self.path, only=(lambda entry: entry.startswith(prefix)) if named else None)
        return [problem for problem in report.problems if problem.entry is not None]

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.record.files)


def open_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Open a cache file for the model it holds: checked as the cache checks a file it maps (a regular file of this
    user or root that no one else can write, no symlink another user could have planted), its index read and
    validated, its model record read and checked. Reads no pack.

    Raises:
        FormatError: not a valid cache file, or it holds no model record, or the record is malformed.
        UntrustedFileError: the file is not one the cache would map. OSError: it cannot be opened or read
            (``FileNotFoundError`` for a missing file).
    """
    name = os.fspath(path)
    fd, st = open_checked(name)  # a regular file the cache would map, or it raises
    try:
        return Bundle(name, fd, st)
    except BaseException:
        os.close(fd)
        raise


def tensor_table(source: Any, names: list[str]) -> tuple[tuple[str, ...], dict[str, tuple[tuple[int, ...], str, int]]]:
    """``(sources, tensors)`` of a :class:`ModelRecord` from a tensor source's metas (``source.meta(name)``)."""
    sources: dict[str, int] = {}
    tensors: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for name in names:
        meta = source.meta(name)
        index = sources.setdefault(meta.identity, len(sources))
        tensors[name] = (tuple(int(d) for d in meta.shape), meta.dtype, index)
    return tuple(sources), tensors


class RecordSource:
    """A cache file's model record as a tensor source (:class:`packcache.torch.TensorSource`): names, shapes,
    dtypes and identities, so pack keys come out as they did when the file was built; no tensor bytes (with no
    checkpoint, a pack the file lacks cannot be made: :meth:`read` raises)."""

    def __init__(self, bundle: Bundle) -> None:
        self.bundle, self.record = bundle, bundle.record

    def names(self) -> list[str]:
        return list(self.record.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.record.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.record.tensors)

    def meta(self, name: str) -> TensorMeta:
        """Shape, dtype and identity of tensor ``name``, from the record.

        Raises:
            KeyError: no such tensor (naming the file).
        """
        try:
            return self.record.meta(name)
        except KeyError:
            raise KeyError(f"{self.bundle.path}: no tensor named {name[:80]!r} in the model record") from None

    def read(self, name: str) -> Any:
        """Raises :class:`~packcache.errors.FormatError`: a cache file holds packs, not the tensors they came from.

        The load asks only for a pack the cache did not serve: one the file lacks, or (a load that checks checksums,
        ``verify=True``) one whose bytes failed their checksum. The error names which: a damaged pack by its entry
        and offset, since with no checkpoint it cannot be packed again and the load must fail rather than serve it.
        """
        # pinned by tests/test_cli_run.py::test_run_verify_refuses_a_self_contained_file_with_a_damaged_pack
        damaged = self.bundle.damaged(name)
        if damaged:
            first = damaged[0]
            more = f" (and {len(damaged) - 1} more damaged packs)" if len(damaged) > 1 else ""
            raise FormatError(
                f"the pack {first.entry!r} failed its checksum ({first.message}){more}: "
                "the file is damaged, and with no checkpoint there is nothing to pack it again from; fetch or build "
                f"the file again (packcache verify {self.bundle.path} lists every damaged pack)",
                path=self.bundle.path, offset=first.offset,
            )  # fmt: skip
        raise FormatError(
            f"holds no pack made from {name[:80]!r} for this load (an incomplete file, or another auto_class or "
            f"scheme than it was built with: {self.record.auto_class}, {self.record.scheme}); with no checkpoint "
            "there is nothing to pack it from",
            path=self.bundle.path,
        )  # fmt: skip


def transformer_folder(path: str | os.PathLike[str]) -> str | None:
    """``""`` when checkpoint ``path`` is also a sentence-transformers model whose Transformer module is its root
    (MiniLM's package is both): every loader's file of it then holds the same record (and serves them all).
    Else ``None``.

    Raises:
        FormatError: a malformed ``modules.json``. UntrustedFileError, OSError: it cannot be read.
    """
    modules_path = os.path.join(os.fspath(path), "modules.json")
    if not os.path.lexists(modules_path):
        return None
    modules = boundedjson.load_file(modules_path, what="modules.json", max_bytes=fmt.MAX_FILE_BYTES)
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and module.get("type") in ST_TRANSFORMER_REFS and module.get("path") == "":
            return ""
    return None
