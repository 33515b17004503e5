"""PyTorch integration: ``nn.Linear`` layers whose packed weights come from the cache, zero-copy.

:func:`convert` walks a module, replaces every eligible ``nn.Linear`` by a
:class:`PackedLinear` whose operands are tensors over the cache's read-only
mapping (``torch.frombuffer``, no copy), given an ``embedding`` packer every ``nn.Embedding``
by a :class:`PackedEmbedding` over its table in that packer's form (bf16, or int8 rows with
per-row scales), and gives every other parameter the same treatment (as float32). Ineligible
layers (shapes the kernel cannot take) stay ``nn.Linear`` and are listed in the :class:`ConversionReport`.

Sources are lazy. The pack keys come from names, shapes, dtypes, the packer's
identity and the source's identity (:class:`packcache.safetensors.SafetensorsFile`:
the sha256 of the file's bytes and its size, found without reading the file on a
warm launch, see :mod:`packcache.identity`; :class:`ModuleSource`: a caller-given
model id, or the sha256 of the parameters), and a source tensor is read only inside
the ``pack`` callable, which a hit never calls: a warm launch reads no source byte.
The module may be built on the ``meta`` device (``with torch.device("meta"): model
= MyModel()``) so its own weights are never materialised.

Packed tensors are views of a read-only file mapping: writing to them in place
crashes the process (SIGSEGV), which is why they are buffers and parameters
without gradients, and why ``load_state_dict`` into a converted module raises
``RuntimeError`` instead of copying into them. Saving works: ``state_dict()``
holds every weight the way the float module held it (a packed layer's weight is
the float32 weight it computes, see :meth:`PackedLinear.float_weight`), so
``torch.save(model.state_dict())`` and ``save_pretrained`` write a complete
float checkpoint. This module imports torch; ``import packcache`` does not.

:func:`open_cache` and :func:`scheme_packer`, which a model loader calls before :func:`convert`, live in
:mod:`packcache.loader` (with the scheme resolution every loader shares); they are importable from here too.

>>> import torch, packcache
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
>>> from packcache.packers_torch import Int8WeightOnly
>>> report = convert(model, packcache.WeightCache(None), Int8WeightOnly(), model_id="doctest-model")
>>> report.converted, report.ineligible, report.stats.state
(['0', '2'], {}, 'off')
>>> model(torch.zeros(1, 64)).shape
torch.Size([1, 3])
"""

from __future__ import annotations

import functools
import hashlib
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from .cache import PackKey, Request, Session, WeightCache
from .kernels import activation_dtype, int4_layout
from .loader import open_cache, scheme_packer
from .packers import Float32, Packer, Parts, SourceMeta, to_float32
from .packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32, TorchPacker, as_tensor
from .safetensors import TensorMeta
from .stats import CacheStats

__all__ = [
    "Calibration",
    "ConversionReport",
    "ModuleSource",
    "PackedEmbedding",
    "PackedLinear",
    "TensorSource",
    "as_tensor",
    "check_kernels",
    "convert",
    "count_packs",
    "load_parts",
    "materialize",
    "open_cache",
    "parameter_groups",
    "part_requests",
    "record_linear_inputs",
    "scheme_packer",
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


class PackedLinear(nn.Module):
    """A linear layer computing ``x @ W.T + b`` with its packer's forward over packed operands.

    Build it with :meth:`from_parts`. The operands are buffers (no gradients), usually
    zero-copy views of the cache mapping; ``bias`` is float32 or ``None``. The packer
    (a :class:`~packcache.packers_torch.TorchPacker`) owns the forward; ``kernel_path``
    (:mod:`packcache.kernels`) says which of its paths runs, and ``repr`` shows it with
    the torch ops it calls. Inputs of any float dtype are accepted; the output has the
    input's dtype (no conversion when it already is the path's dtype).

    Its ``state_dict`` is the layer it replaced: ``weight`` (:meth:`float_weight`, float32,
    ``[out, in]``, or ``[in, out]`` when ``transposed``) and ``bias``, never the packed operands,
    which are non-persistent buffers in a kernel's layout no float model reads; a layer tied to the
    input embeddings (:attr:`tied_weight`) writes the tie's one tensor, as the tied layer it replaced did.
    ``load_state_dict`` into it raises ``RuntimeError``: its operands are read-only.
    """

    def __init__(
        self, packer: TorchPacker, in_features: int, out_features: int, kernel_path: str, transposed: bool = False
    ) -> None:
        super().__init__()
        # Plain attributes, set without nn.Module.__setattr__'s checks: this runs per layer on every warm load.
        self.__dict__.update(
            packer=packer, in_features=in_features, out_features=out_features, kernel_path=kernel_path,
            transposed=transposed, _dtype=activation_dtype(kernel_path), _prepared=None, _tie=None,
            training=False,  # inference only: its operands are read-only views of a file mapping
        )  # fmt: skip
        self.packer: TorchPacker
        self.in_features: int
        self.out_features: int
        self.kernel_path: str
        #: The replaced module stored its weight ``[in, out]`` (GPT-2's ``Conv1D``): ``state_dict`` writes it so.
        self.transposed: bool
        self._dtype: torch.dtype
        self._prepared: dict[str, torch.Tensor | None] | None
        self._tie: torch.Tensor | _SharedFloat | None

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """The float32 tensor this layer's weight is tied to (:func:`convert` ties a tied output head): the
        embeddings' float32 parameter (fp32 embeddings), or the float32 weight of the :class:`PackedEmbedding`
        whose pack this layer reads (``.weight``, the same tensor while anyone holds it). What ``state_dict``
        writes as its weight, so a saved model keeps the tie; ``None``: :meth:`float_weight`."""
        tie = self._tie
        return tie() if isinstance(tie, _SharedFloat) else tie

    @classmethod
    def from_parts(
        cls,
        packer: Packer,
        parts: Parts,
        bias: np.ndarray[Any, Any] | None,
        *,
        kernel_path: str | None = None,
        transposed: bool = False,
    ) -> PackedLinear:
        """A layer over ``parts`` (a pack of ``packer``) and a float32 ``bias``; tensors are zero-copy views.

        ``kernel_path``: ``"bf16"``, ``"fp32"``, or ``None``/``"auto"`` for this machine's rule
        (see :mod:`packcache.kernels`; ``$PACKCACHE_KERNEL_PATH`` applies to ``None``).
        ``transposed``: the layer replaces one that stores its weight ``[in, out]``; only what
        ``state_dict`` writes depends on it.

        The packer's kernel self-check on that path runs at the layer's first forward (or
        :func:`check_kernels`), not here: a warm load only maps.

        Raises:
            TypeError: ``packer`` is not a torch packer (it has no forward).
            ValueError: a path the packer does not have.
        """
        if not isinstance(packer, TorchPacker):
            raise TypeError(f"PackedLinear has no kernel for packer {packer!r}: use a packcache.packers_torch packer")
        out_features, in_features = packer.dims(parts)
        path = packer.kernel_path(kernel_path)
        layer = cls(packer, in_features, out_features, path, transposed)
        dtypes = packer.part_dtypes()
        # Straight into the buffer table (what register_buffer does after its name checks, which
        # these fixed names pass): this runs for every layer of every warm load.
        buffers = layer._buffers
        for part, array in parts.items():
            buffers[part] = as_tensor(array, dtypes.get(part))
        buffers["bias"] = None if bias is None else as_tensor(bias)
        layer._non_persistent_buffers_set.update(buffers)
        return layer

    def _operands(self) -> dict[str, torch.Tensor | None]:
        prepared = self._prepared
        if prepared is None:
            # Derived once, at the first forward rather than at load: a warm load stays a mapping only. The kernel
            # self-check comes first (once per process and path, a set lookup afterwards): no output of a kernel
            # that misreads the layout is ever returned, and a load that never runs a layer pays nothing for it.
            self.packer.check_path(self.kernel_path)
            operands = {name: self._buffers[name] for name in (*self.packer.parts, "bias")}
            prepared = self._prepared = self.packer.prepare(operands, self.kernel_path)
        return prepared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` over the packed operands, in ``x``'s dtype.

        Raises:
            PackResultError: (at the first forward on a path, once per process) the packer's kernel fails
                its self-check there: it no longer reads the layout as the packer wrote it.
        """
        flat = x.reshape(-1, self.in_features).to(self._dtype).contiguous()
        y = self.packer.linear(self._operands(), flat, self.kernel_path)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def kernel(self, rows: int) -> str:
        """The torch op this layer runs for an input of ``rows`` rows."""
        return self.packer.kernel(self.kernel_path, rows)

    def float_weight(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight this layer multiplies by: its operands
        dequantised exactly as its dequantising path does (the fused weight-only kernels, which run
        for few rows, the ``bf16`` path and the bf16 scheme on every path also round the activations
        to bfloat16). With the fp32 scheme the weight tensor itself (a read-only view); otherwise a
        new tensor.

        A packer other than the four of :mod:`packcache.packers_torch` is probed: its forward,
        without bias, on the unit vectors.

        >>> from packcache.packers_torch import Int8WeightOnly
        >>> weight = np.array([[1.0, -2.0], [0.5, 0.25]], np.float32)
        >>> layer = PackedLinear.from_parts(Int8WeightOnly(), Int8WeightOnly().pack(weight, "F32"), None)
        >>> layer.float_weight().tolist()  # int8 codes times each row's scale: 2/127 and 0.5/127
        [[1.0078740119934082, -2.0], [0.5, 0.25196850299835205]]
        """
        with torch.no_grad():
            return _float_weight(self)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # What the replaced layer saved, so a checkpoint of a packed model is a float model's (issue 20, item 4):
        # the packed operands are non-persistent buffers, and saving only them dropped every linear weight.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        tied = self.tied_weight
        weight = tied if tied is not None else self.float_weight()
        destination[prefix + "weight"] = weight.t().contiguous() if self.transposed else weight
        bias = self._buffers["bias"]
        if bias is not None:
            destination[prefix + "bias"] = bias

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        names = ("weight",) if self._buffers["bias"] is None else ("weight", "bias")
        _refuse_read_only(state_dict, prefix, names)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )  # fmt: skip
        if strict:
            missing_keys.extend(prefix + name for name in names)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, packer={self.packer!r}, "
            f"kernel_path={self.kernel_path!r}, kernels={self.packer.kernels(self.kernel_path)!r}"
        )


def check_kernels(module: nn.Module) -> int:
    """Run now the kernel self-check every :class:`PackedLinear` of ``module`` would run at its first forward
    (once per process per packer and path): a service that wants a kernel misreading the layout to fail its
    start, not its first request. Returns the number of packed layers (each check is a set lookup after the first).

    Raises:
        PackResultError: a packer's kernel fails its self-check on the path its layers run.

    >>> from packcache.packers_torch import Int8WeightOnly
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    >>> _ = convert(model, WeightCache(None), Int8WeightOnly(), model_id="doctest")
    >>> check_kernels(model)
    1
    """
    layers = [m for m in module.modules() if isinstance(m, PackedLinear)]
    for layer in layers:
        layer.packer.check_path(layer.kernel_path)
    return len(layers)


class _SharedFloat:
    """The float32 weight of one packed embedding table, made when first asked and the same tensor while anyone
    holds it (a weak reference): what every module of a tie writes in ``state_dict``, so ``save_pretrained`` sees
    one tensor under each of the tie's names (as a float tied model has), and nothing is kept after saving."""

    def __init__(self, compute: Callable[[], torch.Tensor]) -> None:
        self._compute = compute
        self._ref: weakref.ref[torch.Tensor] | None = None

    def __call__(self) -> torch.Tensor:
        tensor = self._ref() if self._ref is not None else None
        if tensor is None:
            with torch.no_grad():
                tensor = self._compute()
            self._ref = weakref.ref(tensor)
        return tensor

    def __getstate__(self) -> dict[str, Any]:  # a weak reference cannot be pickled or deep-copied
        return {"_compute": self._compute, "_ref": None}


class PackedEmbedding(nn.Module):
    """An ``nn.Embedding`` whose table ``[num_embeddings, embedding_dim]`` is stored in the scheme's form: bf16, or
    int8 rows with per-row scales (:data:`packcache.loader.EMBEDDING_PACKERS`), zero-copy over the cache mapping.

    A lookup returns float32 rows, what the model's float32 forward expects: it gathers only the rows it reads
    from the packed parts and widens (and scales) only those (:meth:`TorchPacker.rows
    <packcache.packers_torch.TorchPacker.rows>`), bit for bit the rows of :meth:`float_weight`; no dequantised
    table is ever made, at load or per call. ``num_embeddings``, ``embedding_dim`` and ``padding_idx`` are the
    replaced module's (``padding_idx`` only matters to training, which a read-only table does not do).

    ``weight`` is the whole table in float32 (:meth:`float_weight`, made when read and kept while anyone holds it):
    for code that reads it, such as saving. Its ``state_dict`` is the module it replaced: ``weight``, float32,
    under the source's name (a tied output head writes the same tensor). ``load_state_dict`` into it raises
    ``RuntimeError``: its parts are read-only.
    """

    def __init__(self, packer: TorchPacker, num_embeddings: int, embedding_dim: int, padding_idx: int | None) -> None:
        super().__init__()
        self.__dict__.update(
            packer=packer, num_embeddings=num_embeddings, embedding_dim=embedding_dim, padding_idx=padding_idx,
            max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False, training=False,
            _shared=_SharedFloat(self.float_weight),
        )  # fmt: skip
        self.packer: TorchPacker
        self.num_embeddings: int
        self.embedding_dim: int
        self.padding_idx: int | None
        self._shared: _SharedFloat

    @classmethod
    def from_parts(cls, packer: Packer, parts: Parts, *, padding_idx: int | None = None) -> PackedEmbedding:
        """A table over ``parts`` (a pack of ``packer``, whose packs are embedding tables); tensors are zero-copy views.

        Raises:
            TypeError: ``packer`` does not pack embedding tables (:attr:`TorchPacker.embeds
                <packcache.packers_torch.TorchPacker.embeds>`).
        """
        if not isinstance(packer, TorchPacker) or not packer.embeds:
            raise TypeError(f"PackedEmbedding cannot look up rows of packer {packer!r}")
        num_embeddings, embedding_dim = packer.dims(parts)
        table = cls(packer, num_embeddings, embedding_dim, padding_idx)
        dtypes = packer.part_dtypes()
        buffers = table._buffers
        for part, array in parts.items():
            buffers[part] = as_tensor(array, dtypes.get(part))
        table._non_persistent_buffers_set.update(buffers)
        return table

    def _operands(self) -> dict[str, torch.Tensor | None]:
        return {name: self._buffers[name] for name in self.packer.parts}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``ids`` (``[*ids.shape, embedding_dim]``), dequantised one read row at a time."""
        return self.packer.rows(self._operands(), ids)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in float32 (:meth:`float_weight`), the same tensor while anyone holds it (or a tied
        head's ``tied_weight``). It costs a dequantised copy of the table: a lookup never reads it."""
        return self._shared()

    def float_weight(self) -> torch.Tensor:
        """The float32 ``[num_embeddings, embedding_dim]`` table this module looks rows up in: a new tensor (with
        a float32 pack, the read-only view itself)."""
        with torch.no_grad():
            return self.packer.dequantized(self._operands())

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        _refuse_read_only(state_dict, prefix, ("weight",))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )  # fmt: skip
        if strict:
            missing_keys.append(prefix + "weight")

    def extra_repr(self) -> str:
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{padding}, packer={self.packer!r}"


def _float_weight(layer: PackedLinear) -> torch.Tensor:
    """:meth:`PackedLinear.float_weight`: each known packer's dequantisation, as its ``linear`` computes it."""
    packer = layer.packer
    operand = functools.partial(_operand, layer)
    kind = type(packer)  # the exact class: a subclass may compute something else
    if kind is LinearFloat32:
        return operand("weight")
    if kind is LinearBFloat16:
        return operand("weight").float()
    if kind is Int8WeightOnly:
        return operand("weight").float().mul_(operand("scales")[:, None])
    if kind is Int4WeightOnly and isinstance(packer, Int4WeightOnly) and int4_layout() is not None:
        weight_t = packer.dequantized_t(
            operand("weight"), operand("scales_and_zeros"), operand("input_scales"), torch.float32
        )  # Int4WeightOnly.linear's per-call dequantisation
        return weight_t.t().contiguous()
    return _probed_weight(layer)  # a packer packcache does not know, or an int4 layout it cannot read


def _operand(layer: PackedLinear, name: str) -> torch.Tensor:
    tensor = layer._buffers[name]
    if tensor is None:
        raise ValueError(f"operand {name!r} is missing")
    return tensor


def _probed_weight(layer: PackedLinear) -> torch.Tensor:
    """The weight of any packer's layer: its forward, without bias, on the unit vectors (``I @ W.T = W.T``), in
    blocks of rows, past the packer's fused-kernel rows (its dequantising path, on ``fp32`` where it has it)."""
    packer = layer.packer
    path = "fp32" if "fp32" in packer.paths else layer.kernel_path
    operands: dict[str, torch.Tensor | None] = {name: _operand(layer, name) for name in packer.parts}
    operands["bias"] = None
    prepared = packer.prepare(operands, path)
    rows = max(256, packer.fused_max_rows.get(path, 0) + 1)
    blocks = []
    for start in range(0, layer.in_features, rows):
        count = min(rows, layer.in_features - start)
        probe = torch.zeros(rows, layer.in_features, dtype=activation_dtype(path))
        probe[:count, start : start + count] = torch.eye(count)
        blocks.append(packer.linear(prepared, probe, path)[:count].float())
    return torch.cat(blocks).t().contiguous()


def _refuse_read_only(state_dict: Mapping[str, Any], prefix: str, names: tuple[str, ...]) -> None:
    """Raise before ``load_state_dict`` copies into a tensor served from the cache (a read-only mapping:
    the copy would kill the process with SIGSEGV; a heap pack is the cache's own copy, which it serves again)."""
    for name in names:
        if prefix + name in state_dict:
            raise RuntimeError(
                f"cannot load {prefix + name!r}: packcache serves this model's weights from its cache, a read-only "
                "file mapping, and load_state_dict would write into them. Load the state dict into a float model "
                "of the same class (transformers' from_pretrained), or save it with save_pretrained and load that "
                "directory with packcache.hf.from_pretrained"
            )


class _ReadOnlyTensors:
    """A ``load_state_dict`` pre-hook of a module holding cache tensors (:func:`_refuse_read_only` for them).

    A plain class, not a closure: modules keep their hooks when pickled or deep-copied."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __call__(self, state_dict: Mapping[str, Any], prefix: str, *rest: Any) -> None:
        _refuse_read_only(state_dict, prefix, self.names)


#: The key of :class:`_ReadOnlyTensors` among a module's load pre-hooks (torch numbers its own from 0 up).
_READ_ONLY_HOOK = -1


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


@dataclass
class ConversionReport:
    """What :func:`convert` did.

    Attributes:
        converted: names of the ``nn.Linear`` modules now :class:`PackedLinear`.
        ineligible: name → reason for ``nn.Linear`` modules the packer cannot take;
            they stay ``nn.Linear`` (their weights come from the cache as float32).
        parameters: names of the other parameters now served from the cache as float32.
        embeddings: names of the ``nn.Embedding`` modules now :class:`PackedEmbedding` (their tables in the
            ``embedding`` packer's form); ``float_embeddings``: name -> why one stayed float32.
        tied: name served → the other names of the same (tied) parameter, which share its tensor.
        packed_ties: packed layer → the other names of the tensor its weight is tied to (an output head
            tied to the input embeddings): both come from the one source tensor. With an ``embedding`` packer
            the head and the embeddings read one pack; without one the layer is packed and the embeddings
            served as float32. Its ``state_dict`` writes the embeddings' float32 tensor, so the tie stays.
        packed_bytes: bytes of every array served from the cache for this module.
        stats: the cache's statistics when the conversion ended.
        kernel_path: the kernel path of the packed layers (:mod:`packcache.kernels`).
        kernels: per kind of linear layer (the last part of its name: ``q_proj``, ``lm_head``, ``dense``),
            the torch ops it runs on that path, with their row ranges (:meth:`TorchPacker.kernels`), or why it
            is a float32 layer; one entry per kind (layers of a kind are packed alike).
    """

    converted: list[str] = field(default_factory=list)
    ineligible: dict[str, str] = field(default_factory=dict)
    parameters: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)
    float_embeddings: dict[str, str] = field(default_factory=dict)
    tied: dict[str, list[str]] = field(default_factory=dict)
    packed_ties: dict[str, list[str]] = field(default_factory=dict)
    packed_bytes: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    kernel_path: str = "fp32"
    kernels: Mapping[str, str] = field(default_factory=dict)


class _KernelNames(Mapping[str, str]):
    """:attr:`ConversionReport.kernels`, worded when first read: naming an int4 layer's ops probes torch's int4
    layout (a kernel call, milliseconds), which a load that never reads the report must not pay."""

    def __init__(self) -> None:
        self._kinds: dict[str, tuple[TorchPacker, str] | str] = {}
        self._names: dict[str, str] | None = None

    def add(self, kind: str, what: tuple[TorchPacker, str] | str) -> None:
        self._kinds.setdefault(kind, what)
        self._names = None

    def _worded(self) -> dict[str, str]:
        if self._names is None:
            self._names = {
                kind: what if isinstance(what, str) else what[0].kernels(what[1]) for kind, what in self._kinds.items()
            }
        return self._names

    def __getitem__(self, kind: str) -> str:
        return self._worded()[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)

    def __repr__(self) -> str:
        return repr(self._worded())


def convert(
    module: nn.Module,
    cache: WeightCache,
    packer: Packer,
    *,
    session: Session | None = None,
    source: TensorSource | None = None,
    model_id: str | None = None,
    source_prefix: str = "",
    other: Packer | None = None,
    embedding: TorchPacker | None = None,
    calibration: Calibration | None = None,
    kernel_path: str | None = None,
    transposed: tuple[type[nn.Module], ...] = (),
) -> ConversionReport:
    """Convert ``module`` in place: packed linear layers and parameters served from ``cache``.

    Args:
        module: the model. Its parameters may live on the ``meta`` device when
            ``source`` is given: nothing of them is read.
        cache: the :class:`~packcache.WeightCache` the packs come from.
        session: an active session of ``cache`` to convert in (to load several modules
            in one session); by default a session is opened and closed here.
        packer: the packer of eligible ``nn.Linear`` weights, one of
            :mod:`packcache.packers_torch` (``LinearFloat32``, ``LinearBFloat16``,
            ``Int8WeightOnly``, ``Int4WeightOnly``).
        source: where the weights come from (e.g. a
            :class:`~packcache.safetensors.SafetensorsFile`); ``None`` reads the
            module's own parameters through :class:`ModuleSource`.
        model_id: with ``source=None``, the identity of the module's weights (see :class:`ModuleSource`).
        source_prefix: prepended to a parameter's name to find it in ``source``.
        other: packer of every other parameter (default float32, :class:`~packcache.packers.Float32`).
        embedding: packer of the ``nn.Embedding`` tables (one whose packs are tables,
            :attr:`~packcache.packers_torch.TorchPacker.embeds`: ``LinearBFloat16``, ``Int8WeightOnly``,
            what :data:`packcache.loader.EMBEDDING_PACKERS` names per scheme); each such module becomes a
            :class:`PackedEmbedding`. ``None`` (the default): tables are float32 parameters like the rest.
            A subclass of ``nn.Embedding`` (its own forward), one with ``max_norm``, or a table whose
            tensor another kind of module shares stays float32 (``report.float_embeddings`` says why).
        calibration: input statistics for a packer that uses them (activation-aware int4);
            recorded only if such a pack misses. Without it that packer packs weight-only.
        kernel_path: the kernel path of every :class:`PackedLinear` (``"bf16"``, ``"fp32"``,
            or ``None``/``"auto"``: this machine's rule, see :mod:`packcache.kernels`). It is a
            runtime choice: the packs, their keys and the platform are the same on every path.
        transposed: module classes that compute ``x @ weight + bias`` with ``weight`` stored
            ``[in, out]`` (GPT-2's ``Conv1D``); they are packed like ``nn.Linear`` from the
            transposed source (their pack keys say so) and replaced by :class:`PackedLinear`.

    A parameter shared by several modules (tied weights, e.g. a language-model head tied to
    the input embeddings) is fetched once, under the first of its names the source holds,
    and the one float32 tensor is given to every owner; the other names are listed in
    ``report.tied``. A linear layer among the owners (an output head tied to the input embeddings)
    is listed in ``report.packed_ties`` and its ``state_dict`` writes the embeddings' float32 tensor, so a
    saved model is still tied. With an ``embedding`` packer, the embeddings and the head read one pack of
    that packer (per-row int8 *is* per-output-channel int8): the head runs that packer's kernel, whatever
    ``packer`` is. Without one, the head is packed by ``packer`` from that same source tensor, while the
    embeddings keep it as float32; and with the float32 scheme the head stays a float32 layer over the one
    tensor (listed in ``report.ineligible``): packing it would store the same bytes twice.

    Returns:
        A :class:`ConversionReport`; ``report.stats`` is the cache's state afterwards and
        ``report.kernel_path`` the path the packed layers run.

    Raises:
        ValueError: a source tensor's shape differs from the module's parameter, or the
            packer has no such kernel path.
        TypeError: ``packer`` is not a torch packer.
        Whatever the source or a packer raises; cache problems are never raised.
    """
    if not isinstance(packer, TorchPacker):
        raise TypeError(f"convert() needs a packcache.packers_torch packer for the linear layers, got {packer!r}")
    if embedding is not None and (not isinstance(embedding, TorchPacker) or not embedding.embeds):
        raise TypeError(f"convert() needs a packer of embedding tables (TorchPacker.embeds), got {embedding!r}")
    path = packer.kernel_path(kernel_path)  # before any pack: a bad path fails fast
    other = other if other is not None else Float32()
    if source is None:
        source = ModuleSource(module, model_id)
    report = ConversionReport(kernel_path=path)
    try:
        if session is None:
            with cache.session() as own:
                _convert(module, own, packer, other, embedding, source, source_prefix, calibration, report, transposed)
        else:
            _convert(module, session, packer, other, embedding, source, source_prefix, calibration, report, transposed)
    finally:
        if calibration is not None:
            calibration.release()
    report.stats = cache.stats()
    return report


def _convert(
    module: nn.Module,
    session: Session,
    packer: TorchPacker,
    other: Packer,
    embedding: TorchPacker | None,
    source: TensorSource,
    prefix: str,
    calibration: Calibration | None,
    report: ConversionReport,
    transposed: tuple[type[nn.Module], ...],
) -> None:
    queue: list[Request] = []  # requests not served yet
    served: list[np.ndarray[Any, Any]] = []  # what every request before them was served

    def flush() -> None:
        served.extend(session.get_many(queue))
        queue.clear()

    def wanted(
        names: list[str], expected: tuple[int, ...], with_packer: Packer, layer: str | None = None, flip: bool = False
    ) -> slice:
        """Queue the requests of one source tensor's pack; where its parts will be in the batch's answer."""
        name, meta = _first_meta(source, [prefix + n for n in names])
        if flip:
            if len(meta.shape) != 2:
                raise ValueError(f"source tensor {name!r} has shape {list(meta.shape)}; a transposed layer needs 2-d")
            meta = TensorMeta(meta.name, meta.shape[::-1], meta.dtype, meta.identity + ";transposed")
        if tuple(meta.shape) != expected:
            raise ValueError(f"source tensor {name!r} has shape {list(meta.shape)}, the module {list(expected)}")
        stats = None
        if calibration is not None and layer is not None:
            stats = functools.partial(calibration.second_moment, layer)

        def read() -> np.ndarray[Any, Any]:
            array = source.read(name)
            return np.ascontiguousarray(array.T) if flip else array

        start = len(served) + len(queue)
        queue.extend(
            part_requests(
                name, with_packer, meta, read,
                stats=stats, calibration=calibration.identity if calibration is not None else None,
            )
        )  # fmt: skip
        if len(queue) >= _BATCH:
            flush()
        return slice(start, start + len(with_packer.parts))

    modules = dict(module.named_modules())
    plan = _plan(module, packer, transposed, embedding)
    report.ineligible.update(plan.ineligible)
    report.float_embeddings.update(plan.float_embeddings)
    tables = [(table, wanted(list(table.names), table.shape, table.packer)) for table in plan.tables]
    # Requests in batches of a few layers (shapes checked, nothing read): a warm load maps each batch in one pass,
    # and the requests' own objects (keys, callables) never all exist at once: they would leave heap behind.
    layers = []
    for layer in plan.linears:
        dotted = f"{layer.name}." if layer.name else ""
        names = [f"{dotted}weight", *layer.tied]  # a tied checkpoint saves the tensor under one of them
        layers.append((
            layer,
            # A head tied to a packed table reads the table's pack (below); it has no pack of its own.
            None if layer.table else wanted(names, layer.shape, packer, layer=layer.name, flip=layer.transposed),
            # pinned by tests/test_hf_ties.py::test_a_masked_lm_checkpoint_saved_tied_loads_in_every_scheme
            wanted([f"{dotted}bias", *layer.bias_tied], (layer.shape[0],), other) if layer.has_bias else None,
        ))  # fmt: skip
    parameters = [
        (names, wanted([*names, *plan.also.get(names[0], ())], tuple(module.get_parameter(names[0]).shape), other))
        for names in plan.parameters
    ]
    flush()
    report.packed_bytes += sum(int(a.nbytes) for a in served)

    tied_layers: dict[str, PackedLinear] = {}  # name of a served float parameter -> the packed layer tied to it
    kernels = _KernelNames()
    report.kernels = kernels
    table_parts: dict[str, tuple[Parts, _SharedFloat]] = {}  # a table's first name -> its parts and float weight
    for table, at in tables:
        parts = dict(zip(table.packer.parts, served[at], strict=True))
        shared: _SharedFloat | None = None
        for paths, padding_idx in table.modules:
            new_table = PackedEmbedding.from_parts(table.packer, parts, padding_idx=padding_idx)
            if shared is None:
                shared = new_table._shared
            new_table.__dict__["_shared"] = shared  # every module of a tie writes the one tensor
            for name in paths:
                _replace(modules, name, new_table, root=module)
            report.embeddings.append(paths[0])
        assert shared is not None
        table_parts[table.names[0]] = parts, shared
        head_names = {f"{name}.weight" for name, tie in plan.table_ties.items() if tie == table.names[0]}
        rest = [n for n in table.names[1:] if n not in head_names]
        if rest:  # embedding modules sharing the table (T5's shared and embed_tokens); a head is a packed tie
            report.tied[table.names[0]] = rest
    for layer, weight_at, bias_at in layers:
        bias = served[bias_at][0] if bias_at is not None else None
        layer_packer: TorchPacker = packer
        if weight_at is not None:
            parts = dict(zip(packer.parts, served[weight_at], strict=True))
        else:
            assert embedding is not None and layer.table is not None
            layer_packer, parts = embedding, table_parts[layer.table][0]
        new = PackedLinear.from_parts(
            layer_packer, parts, bias, kernel_path=report.kernel_path, transposed=layer.transposed
        )  # fmt: skip
        tie = plan.table_ties.get(layer.name)
        if tie is not None:  # it saves the table's float32 weight, as the tied float model did
            new.__dict__["_tie"] = table_parts[tie][1]
        _replace(modules, layer.name, new)
        report.converted.append(layer.name)
        kernels.add(layer.name.rpartition(".")[2], (layer_packer, report.kernel_path))
        if layer.tied:
            report.packed_ties[layer.name] = list(layer.tied)
            tied_layers[layer.tied[0]] = new
    for name in plan.ineligible:
        kernels.add(name.rpartition(".")[2], "linear(float32), not packed")
    owners: dict[str, list[str]] = {}
    for names, at in parameters:
        served_param = nn.Parameter(as_tensor(served[at][0]), requires_grad=False)
        for alias in names:
            owner, _, attr = alias.rpartition(".")
            modules[owner]._parameters[attr] = served_param
            owners.setdefault(owner, []).append(attr)
            if alias in tied_layers:  # what the packed twin saves: the tie's one tensor
                tied_layers[alias].__dict__["_tie"] = served_param
        report.parameters.append(names[0])
        if len(names) > 1:
            report.tied[names[0]] = names[1:]
    for owner, attrs in owners.items():
        # Straight into the hook table (register_load_state_dict_pre_hook adds a handle and a weakref, 3 us a
        # module): this runs for every module with a parameter on every warm load. One key: converting again
        # replaces it.
        modules[owner]._load_state_dict_pre_hooks[_READ_ONLY_HOOK] = _ReadOnlyTensors(tuple(attrs))


#: Requests :func:`convert` sends to :meth:`Session.get_many <packcache.Session.get_many>` at once: a few layers' parts.
_BATCH = 32


@dataclass(frozen=True)
class _Layer:
    name: str
    shape: tuple[int, int]  # (out, in), as packed
    transposed: bool  # the module stores its weight [in, out]
    has_bias: bool
    tied: tuple[str, ...] = ()  # the other names of its weight (parameters of other modules: the tie)
    bias_tied: tuple[str, ...] = ()  # the other names of its bias (BERT's MLM decoder's, tied to cls.predictions.bias)
    table: str | None = None  # the packed embedding table (its first name) whose pack this tied head reads


@dataclass(frozen=True)
class _Table:
    """An embedding table packed by an embedding packer, with every module over its tensor."""

    packer: TorchPacker
    names: tuple[str, ...]  # every name of its tensor (a checkpoint holds it under one of them)
    shape: tuple[int, int]
    modules: tuple[tuple[tuple[str, ...], int | None], ...]  # per nn.Embedding module: its paths, its padding_idx
    heads: tuple[_Layer, ...] = ()  # linear layers over the same tensor (a tied output head): they read its pack


@dataclass
class _Plan:
    linears: list[_Layer] = field(default_factory=list)
    ineligible: dict[str, str] = field(default_factory=dict)
    parameters: list[list[str]] = field(default_factory=list)  # every name of each other parameter
    tables: list[_Table] = field(default_factory=list)
    float_embeddings: dict[str, str] = field(default_factory=dict)
    # A linear layer whose weight is a packed table's tensor -> the table's first name: it saves the table's weight.
    table_ties: dict[str, str] = field(default_factory=dict)
    # A parameter's names that a packed layer owns (a packed head's weight, tied to the embeddings): a checkpoint
    # may hold the tie's tensor under one of them only (the head's), which then serves the embeddings too.
    also: dict[str, list[str]] = field(default_factory=dict)


def _plan(
    module: nn.Module, packer: Packer, transposed: tuple[type[nn.Module], ...], embedding: TorchPacker | None = None
) -> _Plan:
    """Which layers :func:`convert` packs with ``packer``, which embedding tables with ``embedding`` and which
    parameters it serves as float32; reads no weight."""
    plan = _Plan()
    aliases = _aliases(module)
    owned: set[str] = set()
    if embedding is not None:
        _plan_tables(module, embedding, aliases, plan)
        for table in plan.tables:
            owned.update(table.names)
            owned.update(f"{head.name}.bias" for head in table.heads if head.has_bias)
    heads = {head.name: head for table in plan.tables for head in table.heads}
    for name, sub in module.named_modules():
        if name in heads:  # a head over a packed table, in its place among the layers
            plan.linears.append(heads[name])
            continue
        flip = type(sub) in transposed
        if type(sub) is not nn.Linear and not flip:
            continue
        weight = sub.weight
        dotted = f"{name}." if name else ""
        rows, columns = int(weight.shape[0]), int(weight.shape[1])
        shape = (columns, rows) if flip else (rows, columns)
        tied = tuple(n for n in aliases.get(id(weight), []) if n != f"{dotted}weight")
        if tied and isinstance(packer, LinearFloat32):
            # Packed as float32 it would be a second copy of the very tensor its twin is served as: keep one.
            plan.ineligible[name] = f"weight tied to {', '.join(tied)}: one float32 tensor"
            continue
        reason = packer.eligible(shape)
        if reason is not None:
            plan.ineligible[name] = reason
            continue
        # A tied layer (an output head tied to the input embeddings) is packed like any other, from the one source
        # tensor of the tie; the other owners (the embedding lookup) keep that tensor as float32.
        bias_tied = (
            tuple(n for n in aliases.get(id(sub.bias), []) if n != f"{dotted}bias") if sub.bias is not None else ()
        )
        plan.linears.append(_Layer(name, shape, flip, sub.bias is not None, tied, bias_tied))
        owned.update({f"{dotted}weight", f"{dotted}bias"})
    # pinned by tests/test_hf_ties.py::test_every_config_and_checkpoint_combination_builds_transformers_model
    for names in aliases.values():
        left = [n for n in names if n not in owned]
        if left:
            plan.parameters.append(left)
            if len(left) < len(names):  # a packed head's weight: the checkpoint may hold the tie under its name only
                plan.also[left[0]] = [n for n in names if n in owned]
    return plan


def _plan_tables(module: nn.Module, packer: TorchPacker, aliases: dict[int, list[str]], plan: _Plan) -> None:
    """The embedding tables :func:`convert` packs with ``packer`` (into ``plan.tables``), and why the others stay
    float32 (``plan.float_embeddings``). A linear layer over a table's tensor (a tied output head) reads the
    table's pack, whatever packer the other layers use: one stored tensor (the int4 scheme's head is the
    int8 table's; issue 33 item 3: an int4 pack of its own beside the table made the file 1.35x llama.cpp's Q4_0)."""
    paths: dict[int, list[str]] = {}
    found: dict[int, nn.Embedding] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if isinstance(sub, nn.Embedding):
            paths.setdefault(id(sub), []).append(name)
            found[id(sub)] = sub
    by_weight: dict[int, list[int]] = {}  # a table's tensor -> the embedding modules over it
    for key, sub in found.items():
        reason = _table_reason(sub, packer)
        if reason is not None:
            plan.float_embeddings[paths[key][0]] = reason
            continue
        by_weight.setdefault(id(sub.weight), []).append(key)
    for weight, keys in by_weight.items():
        names = aliases.get(weight, [])
        if not names:
            continue
        tables = {f"{p}.weight" if p else "weight" for key in keys for p in paths[key]}
        layers: list[_Layer] = []
        others: list[str] = []
        for name in names:
            if name in tables:
                continue
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner)
            if type(sub) is not nn.Linear or attr != "weight":
                others.append(name)
            elif packer.eligible(tuple(sub.weight.shape)) is None:
                layers.append(_head(owner, sub, names, aliases))
            else:
                others.append(name)
        if others:  # a tensor another kind of module computes with: it needs the float32 tensor itself
            for key in keys:
                plan.float_embeddings[paths[key][0]] = f"its weight is also {', '.join(others)}: one float32 tensor"
            continue
        rows, columns = found[keys[0]].weight.shape
        modules = tuple((tuple(paths[key]), found[key].padding_idx) for key in keys)
        plan.tables.append(_Table(packer, tuple(names), (int(rows), int(columns)), modules, tuple(layers)))
        plan.table_ties.update(dict.fromkeys((layer.name for layer in layers), names[0]))


def _head(name: str, sub: nn.Linear, names: list[str], aliases: dict[int, list[str]]) -> _Layer:
    """The plan of linear layer ``name`` over a packed table's tensor (``names``): it reads the table's pack."""
    rows, columns = sub.weight.shape
    bias = sub.bias
    bias_tied = tuple(n for n in aliases.get(id(bias), []) if n != f"{name}.bias") if bias is not None else ()
    tied = tuple(n for n in names if n != f"{name}.weight")
    return _Layer(name, (int(rows), int(columns)), False, bias is not None, tied, bias_tied, names[0])


def _table_reason(sub: nn.Module, packer: TorchPacker) -> str | None:
    """Why ``convert`` keeps the embedding module ``sub`` float32 (``None``: it packs it with ``packer``)."""
    if type(sub) is not nn.Embedding:
        return f"{type(sub).__name__} is a subclass of nn.Embedding (its own forward): float32"
    assert isinstance(sub, nn.Embedding)
    if sub.max_norm is not None:
        return "max_norm renormalises looked-up rows in place: float32"
    return packer.eligible(tuple(sub.weight.shape))


def parameter_groups(module: nn.Module) -> list[list[str]]:
    """Every parameter of ``module`` as the list of its names, in ``named_parameters`` order:
    more than one name is a tied parameter (one tensor that several modules own).

    >>> lm = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    >>> lm[1].weight = lm[0].weight
    >>> parameter_groups(lm)
    [['0.weight', '1.weight']]
    """
    return list(_aliases(module).values())


def _aliases(module: nn.Module) -> dict[int, list[str]]:
    """``id(parameter)`` -> every name of that parameter in ``module``."""
    aliases: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    return aliases


def count_packs(
    module: nn.Module,
    packer: Packer,
    *,
    transposed: tuple[type[nn.Module], ...] = (),
    embedding: TorchPacker | None = None,
) -> int:
    """How many cache entries :func:`convert` requests for ``module`` (hits, stores and heap packs
    together): a progress total. Reads no weight; ``module`` may live on the ``meta`` device.

    >>> from packcache.packers_torch import Int8WeightOnly
    >>> count_packs(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32)), Int8WeightOnly())
    5
    """
    plan = _plan(module, packer, transposed, embedding)
    linears = sum(len(packer.parts) * (layer.table is None) + layer.has_bias for layer in plan.linears)
    return linears + sum(len(table.packer.parts) for table in plan.tables) + len(plan.parameters)


def _first_meta(source: TensorSource, names: list[str]) -> tuple[str, SourceMeta]:
    """The first of ``names`` that ``source`` holds, with its metadata (tied weights are saved under one name).

    Raises:
        KeyError: none of them (the message names them all).
    """
    if len(names) == 1:
        return names[0], source.meta(names[0])  # its own KeyError names the file
    for name in names:
        try:
            return name, source.meta(name)
        except KeyError:
            continue
    raise KeyError(f"the source has no tensor named {' or '.join(repr(n) for n in names)}")


def _replace(modules: Mapping[str, nn.Module], name: str, new: nn.Module, root: nn.Module | None = None) -> None:
    """Put ``new`` where module ``name`` is (``modules``: the root's ``named_modules()``; a container found
    only under another of its paths is looked up from ``root``)."""
    if not name:
        raise ValueError("convert() cannot replace the root module itself; wrap the nn.Linear in a container")
    owner, _, attr = name.rpartition(".")
    container = modules.get(owner)
    if container is None and root is not None:
        container = root.get_submodule(owner)
    assert container is not None, name
    setattr(container, attr, new)
