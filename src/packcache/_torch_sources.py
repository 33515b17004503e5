"""Source tensors on their way into the cache: where a tensor's metadata and bytes come from (a
:class:`TensorSource`; a module's own parameters, :class:`ModuleSource`), the cache requests of its pack, which
read it only on a miss (:func:`part_requests`), and the calibration statistics a packer may ask for, recorded only
then (:class:`Calibration`). Importable from :mod:`packcache.torch`, the path to use.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from ._torch_layers import PackedLinear
from .cache import PackKey, Request, Session
from .packers import Packer, Parts, SourceMeta, to_float32
from .safetensors import TensorMeta

__all__ = [
    "Calibration",
    "ModuleSource",
    "TensorSource",
    "load_parts",
    "materialize",
    "part_requests",
    "record_linear_inputs",
]


class TensorSource(Protocol):
    """Where source weights come from: metadata now, bytes only when a pack needs them."""

    def meta(self, name: str) -> SourceMeta:
        """Shape, dtype and identity of tensor ``name``; must read no tensor byte."""
        ...

    def read(self, name: str) -> np.ndarray[Any, Any]:
        """The bytes of tensor ``name`` as a numpy array (``BF16`` as uint16 bits)."""
        ...


_TORCH_TO_CODE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


class ModuleSource:
    """The weights an in-memory module already holds, as a :class:`TensorSource`.

    Args:
        module: a module with real (not ``meta``) float parameters.
        model_id: what identifies these weights across launches (a name and version,
            a checkpoint hash). ``None``: the sha256 of every parameter's bytes, which
            reads them all; pass an id to keep a warm launch from reading anything.
    """

    def __init__(self, module: nn.Module, model_id: str | None = None) -> None:
        self._tensors = dict(module.named_parameters())
        if model_id is None:
            digest = hashlib.sha256()
            for name, tensor in sorted(self._tensors.items()):
                digest.update(name.encode() + b"\0" + str(tensor.dtype).encode() + str(list(tensor.shape)).encode())
                digest.update(self.read(name).tobytes())
            model_id = "sha256:" + digest.hexdigest()
        self.identity = model_id

    def meta(self, name: str) -> SourceMeta:
        tensor = self._tensors[name]
        if tensor.dtype not in _TORCH_TO_CODE:
            raise TypeError(f"parameter {name!r} has dtype {tensor.dtype}; only float parameters can be packed")
        return TensorMeta(name, tuple(tensor.shape), _TORCH_TO_CODE[tensor.dtype], self.identity)

    def read(self, name: str) -> np.ndarray[Any, Any]:
        param = self._tensors[name]
        if param.is_meta:
            raise ValueError(f"parameter {name!r} is on the meta device: give convert() a source")
        tensor = param.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(np.uint16)
        return tensor.numpy()


def part_requests(
    name: str,
    packer: Packer,
    meta: SourceMeta,
    read: Callable[[], np.ndarray[Any, Any]],
    *,
    stats: Callable[[], np.ndarray[Any, Any]] | None = None,
    calibration: str | None = None,
) -> list[Request]:
    """The requests (for :meth:`Session.get_many <packcache.Session.get_many>`) of every part of ``packer``'s
    pack of source ``name``, in :attr:`~packcache.packers.Packer.parts` order.

    The source is read (``read()``), its statistics computed (``stats()``, for packers that use them) and
    packed at most once, and only if some part misses; on a warm launch none of it happens. Entry names
    are ``"<name>:<packer id>:<part>"``; ``calibration`` identifies the data behind ``stats`` in the key,
    whose bytes are assembled once per tensor (:meth:`~packcache.packers.Packer.part_keys`).
    """
    packed: Parts | None = None
    use_stats = packer.uses_stats and stats is not None

    def pack_part(part: str) -> Callable[[], np.ndarray[Any, Any]]:
        def pack() -> np.ndarray[Any, Any]:
            nonlocal packed
            if packed is None:
                packer.check_deterministic()  # before its first pack that may be stored (once per process)
                layer_stats = stats() if use_stats and stats is not None else None
                packed = packer.checked_pack(read(), meta.dtype, layer_stats, name=name)
            return packed[part]

        return pack

    keys = packer.part_keys(meta, calibration if use_stats else None)
    return [
        (f"{name}:{packer.id}:{part}", pack_part(part), PackKey.from_canonical(keys[part])) for part in packer.parts
    ]


def load_parts(
    session: Session,
    name: str,
    packer: Packer,
    meta: SourceMeta,
    read: Callable[[], np.ndarray[Any, Any]],
    *,
    stats: Callable[[], np.ndarray[Any, Any]] | None = None,
    calibration: str | None = None,
) -> Parts:
    """Every part of ``packer``'s pack of source ``name``, through ``session`` in one batch (:func:`part_requests`)."""
    requests = part_requests(name, packer, meta, read, stats=stats, calibration=calibration)
    return dict(zip(packer.parts, session.get_many(requests), strict=True))


class Calibration:
    """Inputs of a module's linear layers on calibration data, recorded lazily, for packers
    that use statistics (:attr:`packcache.packers.Packer.uses_stats`, e.g. activation-aware int4).

    Args:
        identity: names the calibration data and procedure; part of every pack key that used it.
        record: returns ``{linear module name: input rows [tokens, in_features]}``; called
            at most once, and only when such a pack misses (never on a warm launch).
    """

    def __init__(self, identity: str, record: Callable[[], Mapping[str, np.ndarray[Any, Any]]]) -> None:
        self.identity = identity
        self._record = record
        self._rows: Mapping[str, np.ndarray[Any, Any]] | None = None
        #: Whether ``record`` ran (a pack missed); a warm launch leaves it False.
        self.recorded = False

    def second_moment(self, name: str) -> np.ndarray[Any, Any]:
        """``sum x x^T`` (float64 ``[in, in]``) over linear layer ``name``'s recorded input rows: ``E[x x^T]`` up to a
        constant factor, which no packer's choice depends on (rows are pre-scaled, see :func:`record_linear_inputs`)."""
        if self._rows is None:
            self._rows = self._record()
            self.recorded = True
        rows = np.asarray(self._rows[name], dtype=np.float64)
        result: np.ndarray[Any, Any] = rows.T @ rows
        return result

    def release(self) -> None:
        """Drop the recorded rows."""
        self._rows = None


def record_linear_inputs(
    module: nn.Module, run: Callable[[], None], *, balance: bool = False
) -> dict[str, np.ndarray[Any, Any]]:
    """Run ``run()`` and return the input rows every ``nn.Linear``/:class:`PackedLinear` of ``module`` saw.

    With ``balance``, the rows of each forward call are scaled by ``1/sqrt(rows)``, so every
    call (every calibration text) weighs the same in ``E[x x^T]`` however long it is.
    Layers fed the same tensor (query, key and value) share one array.
    """
    rows: dict[str, list[torch.Tensor]] = {}
    handles = []

    def hook(name: str) -> Callable[..., None]:
        def record(mod: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            chunk = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float().clone()
            if balance and chunk.shape[0]:
                chunk *= 1.0 / math.sqrt(chunk.shape[0])
            rows.setdefault(name, []).append(chunk)

        return record

    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Linear, PackedLinear)):
            handles.append(sub.register_forward_hook(hook(name)))
    try:
        with torch.inference_mode():
            run()
    finally:
        for handle in handles:
            handle.remove()
    result: dict[str, np.ndarray[Any, Any]] = {}
    shared: dict[tuple[Any, ...], np.ndarray[Any, Any]] = {}
    for name, chunks in rows.items():
        tensor = torch.cat(chunks)
        array = tensor.numpy()
        digest = hashlib.sha256(array.tobytes()).digest()
        result[name] = shared.setdefault((*array.shape, digest), array)
    return result


def materialize(module: nn.Module, source: TensorSource, prefix: str = "") -> None:
    """Give every parameter of ``module`` (e.g. built on ``meta``) its float32 value from ``source``, on heap.

    For calibration runs: this reads every source tensor and bypasses the cache.
    """
    for name, param in list(module.named_parameters()):
        array = to_float32(source.read(prefix + name), source.meta(prefix + name).dtype)
        if tuple(array.shape) != tuple(param.shape):
            raise ValueError(
                f"source tensor {prefix + name!r} has shape {list(array.shape)}, the module {list(param.shape)}"
            )
        owner, _, attr = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        # clone(): torch's own 64-byte aligned memory, so kernels take the same path in every process.
        target._parameters[attr] = nn.Parameter(torch.from_numpy(array).clone(), requires_grad=False)


# The public face is packcache.torch: reprs, help() and pickles name it, so a module pickled or saved whole
# loads whichever private module defines its classes.
for _public in (TensorSource, ModuleSource, Calibration):
    _public.__module__ = "packcache.torch"
del _public
# doctest looks for a class's examples only in the module its __module__ names, and their methods' here:
# name them here so that their examples run.
__test__ = {_class.__name__: _class for _class in (TensorSource, ModuleSource, Calibration)}
