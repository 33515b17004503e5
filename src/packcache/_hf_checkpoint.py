"""Reading a Hugging Face checkpoint: a ``save_pretrained`` directory (or the cache file a model was built into)
as a :class:`~packcache.torch.TensorSource`, its config and generation settings read within bounds, its tensors
under the model's names. Headers are read at once, tensor bytes only when a pack misses; nothing here builds a
model (that is :mod:`packcache._hf_model`). :class:`Checkpoint` is importable from :mod:`packcache.hf`, the path
to use.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import transformers
from torch import nn

from . import _boundedjson as boundedjson
from .bundle import Bundle, RecordSource
from .errors import FormatError
from .safetensors import SafetensorsFile, TensorMeta

__all__ = [
    "Checkpoint",
    "_Bundled",
    "_Renamed",
    "_Source",
    "_clip",
    "_read_json",
    "_renaming",
    "_short",
]


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20  # a 1 T-parameter model's index is a few MiB; a config, a few KiB


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _short(value: object) -> str:
    """A bounded repr of a value from a checkpoint file (a 60 MB name must not become a 60 MB message)."""
    return _REPR.repr(value)


def _clip(exc: BaseException, limit: int = 300) -> str:
    """An error from a library, as one line of at most ``limit`` characters (its text may quote the hostile value)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Checkpoint:
    """A local checkpoint directory as ``save_pretrained`` writes it: headers read now, tensors on demand.

    It holds ``config.json`` and either ``model.safetensors`` or ``model.safetensors.index.json``
    with the shards it names (plain file names in the same directory). It is a
    :class:`~packcache.torch.TensorSource` over the checkpoint's own tensor names.

    Raises:
        FileNotFoundError: no such directory, no ``config.json``, or no safetensors weights
            (the message names what is missing; pickle checkpoints are never loaded).
        FormatError: a malformed index or safetensors header (naming the file and offset),
            a shard named with a path, or a tensor found in two shards.
        UntrustedFileError, OSError: a file cannot be opened as a regular file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {os.fspath(path)!r} does not exist or is not a directory")
        self.directory = directory
        self.config_path = directory / "config.json"
        if not os.path.lexists(self.config_path):
            raise FileNotFoundError(f"{self.config_path}: no config.json, so this is not a save_pretrained checkpoint")
        self.files = [SafetensorsFile(directory / name) for name in self._shard_names()]
        self._where: dict[str, SafetensorsFile] = {}
        for file in self.files:
            for name in file:
                if name in self._where:
                    raise FormatError(
                        f"tensor {_short(name)} is in two shards ({os.path.basename(self._where[name].path)} too)",
                        path=file.path, offset=8,
                    )  # fmt: skip
                self._where[name] = file

    def config(self) -> Any:
        """The model's ``transformers`` config, from ``config.json`` read as :func:`_read_json` reads
        (what ``AutoConfig.from_pretrained`` builds for a local directory; remote code is never run).

        Raises:
            FormatError: not a JSON object, or no known ``model_type``. UntrustedFileError, OSError: as the reader.
        """
        return _config_from(_read_json(self.config_path, "config"), str(self.config_path), os.fspath(self.directory))

    def generation_settings(self) -> Any:
        """``generation_config.json`` read as :func:`_read_json` reads, or ``None`` when there is none."""
        generation = self.directory / "generation_config.json"
        return _read_json(generation, "generation config") if os.path.lexists(generation) else None

    def source_bytes(self) -> int:
        """The size of every weights file: what the model's own buffers may take at most (:data:`MIN_BUFFER_CAP`)."""
        return sum(file.size for file in self.files)

    def _shard_names(self) -> list[str]:
        single, index = self.directory / SINGLE_FILE, self.directory / INDEX_FILE
        if index.exists():
            return _read_index(index)
        if single.exists():
            return [SINGLE_FILE]
        found = sorted(p.name for p in self.directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(found)}: pickle checkpoints are not loaded; save with safetensors)" if found else ""
        raise FileNotFoundError(f"{self.directory}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def meta(self, name: str) -> TensorMeta:
        """Shape, dtype and file identity of one tensor; reads nothing.

        Raises:
            KeyError: no tensor of that name (the message names the directory).
        """
        return self._file(name).meta(name)

    def read(self, name: str) -> np.ndarray[Any, Any]:
        """One tensor's bytes, read now (see :meth:`packcache.safetensors.SafetensorsFile.read`)."""
        return self._file(name).read(name)

    def _file(self, name: str) -> SafetensorsFile:
        file = self._where.get(name)
        if file is None:
            raise KeyError(f"{self.directory}: no tensor named {_short(name)} in the checkpoint")
        return file


def _read_json(path: Path, what: str) -> Any:
    """A small JSON file of the checkpoint, read as every checkpoint file is (:func:`packcache._boundedjson.load_file`:
    no blocking on a FIFO, no symlink swapped in after the check, a regular file of at most :data:`MAX_JSON_BYTES`,
    bounded JSON, no number past a float).

    Raises:
        FormatError: too large, or not bounded JSON (naming the file and offset).
        UntrustedFileError: not a regular file. OSError: it cannot be read.
    """
    return boundedjson.load_file(os.fspath(path), what=what, max_bytes=MAX_JSON_BYTES)


def _read_index(index: Path) -> list[str]:
    """The shard file names of a ``model.safetensors.index.json``, each checked to be a plain name."""
    data = _read_json(index, "index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError('the index has no "weight_map" object of tensor name -> shard file', path=str(index))
    shards: list[str] = []
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or shard in (".", "..") or "/" in shard or "\0" in shard:
            where = f"tensor {_short(tensor)} names the shard {_short(shard)}"
            raise FormatError(f"{where}: not a file name in this directory", path=str(index))
        if shard not in shards:
            shards.append(shard)
    return shards


def _config_from(settings: Any, where: str, name_or_path: str) -> Any:
    """A ``transformers`` config from the mapping ``config.json`` holds: the class its ``model_type`` names, never
    remote code.

    Raises:
        FormatError: not a JSON object, no known ``model_type``, or fields transformers refuses (naming ``where``).
    """
    model_type = settings.get("model_type") if isinstance(settings, dict) else None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise FormatError(
            f"model_type {_short(model_type)} is not one transformers {transformers.__version__} knows", path=where
        )  # fmt: skip
    try:
        config = CONFIG_MAPPING[model_type].from_dict(settings)
    except Exception as exc:  # transformers checks fields its own ways (TypeError, ValueError, ...)
        raise FormatError(
            f"transformers {transformers.__version__} cannot read it as a {model_type} config: {_clip(exc)}",
            path=where,
        ) from exc
    config._name_or_path = name_or_path
    return config


class _Bundled(RecordSource):
    """A cache file seen as the checkpoint it was built from (:class:`Checkpoint`'s interface): tensor names,
    shapes, dtypes and content identities from its model record, config and generation config from its embedded
    files. It holds no tensor bytes: every pack must be in the file already (:meth:`read` raises)."""

    def __init__(self, bundle: Bundle, folder: str = "") -> None:
        super().__init__(bundle)
        self.directory = Path(bundle.path)
        self.prefix = f"{folder}/" if folder else ""
        self.config_path = Path(f"{bundle.path}::{self.prefix}config.json")

    def config(self) -> Any:
        """The config embedded in the file (see :meth:`Checkpoint.config`)."""
        settings = self.bundle.read_json(f"{self.prefix}config.json")
        return _config_from(settings, str(self.config_path), self.bundle.path)

    def generation_settings(self) -> Any:
        """The embedded ``generation_config.json``, or ``None``."""
        name = f"{self.prefix}generation_config.json"
        return self.bundle.read_json(name) if self.bundle.has_file(name) else None

    def source_bytes(self) -> int:
        return sum(int(source.rpartition(":")[2]) for source in self.record.sources)


#: Where a load's tensors and config come from: a checkpoint directory, or a cache file that holds the model.
_Source = Checkpoint | _Bundled


class _Renamed:
    """A checkpoint seen under the model's parameter names (a base model's checkpoint in a head
    model, or the reverse: ``transformers`` adds or strips ``base_model_prefix`` the same way)."""

    def __init__(self, checkpoint: _Source, add: str, strip: str) -> None:
        self.checkpoint, self.add, self.strip = checkpoint, add, strip

    def name(self, model_name: str) -> str:
        if self.strip and model_name.startswith(self.strip):
            model_name = model_name[len(self.strip) :]
        return self.add + model_name

    def meta(self, name: str) -> TensorMeta:
        return self.checkpoint.meta(self.name(name))

    def read(self, name: str) -> np.ndarray[Any, Any]:
        return self.checkpoint.read(self.name(name))


def _renaming(model: nn.Module, groups: list[list[str]], checkpoint: _Source) -> _Renamed:
    """The prefix mapping under which the checkpoint holds the most of the model's parameters (``groups``)."""
    names = [name for group in groups for name in group]
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates = [_Renamed(checkpoint, "", "")]
    if prefix:
        candidates += [_Renamed(checkpoint, f"{prefix}.", ""), _Renamed(checkpoint, "", f"{prefix}.")]
    return max(candidates, key=lambda c: sum(c.name(n) in checkpoint for n in names))


# The public face is packcache.hf: reprs and help() name it, whichever private module defines the class.
Checkpoint.__module__ = "packcache.hf"
# doctest looks for a class's examples only in the module its __module__ names, and their methods' here.
__test__ = {"Checkpoint": Checkpoint}
