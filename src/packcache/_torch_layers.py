"""Packed torch layers: ``PackedLinear`` and ``PackedEmbedding`` over read-only packed operands.

A layer's operands are buffers without gradients, usually zero-copy views of the cache's read-only mapping;
its packer (:mod:`packcache.packers_torch`) owns the forward. Because writing into such a view kills the
process, a layer refuses ``load_state_dict`` (and :class:`_ReadOnlyTensors` does the same for a module whose
parameters the cache serves), while ``state_dict`` writes the float weights of the module it replaced.
Which modules become these layers is :mod:`packcache.torch`'s :func:`~packcache.torch.convert`; the public
names are importable from there, and their ``__module__`` says so (pickles name ``packcache.torch``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from . import native
from .kernels import activation_dtype
from .packers import Packer, Parts
from .packers_torch import (
    Int4WeightOnly,
    Int8WeightOnly,
    LinearBFloat16,
    LinearFloat32,
    TorchPacker,
    dequantize_int4_rows,
    dequantize_rows,
)

__all__ = [
    "_READ_ONLY_HOOK",
    "FloatLinear",
    "PackedEmbedding",
    "PackedLinear",
    "_ReadOnlyTensors",
    "_SharedFloat",
    "check_kernels",
]


def _keep_operands(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.dtype:
    """What ``nn.Module._apply`` (``.to``, ``.half()``, ``.float()``, ``.cpu()``) does to a packed layer: nothing.
    Its operands are the cache file's bytes in a kernel's layout, and a cast would make private heap copies that
    no kernel can read (bfloat16 scales turned float32 are refused at the first forward; a layer already run
    kept its old operands and ignored the copies). The forward casts its input to the path's dtype and its result
    back, so a model cast to bfloat16 runs as such. A move off the CPU raises, naming the layer. Returns the dtype
    ``fn`` gives a float32 tensor: what a float module's output would now be.

    Raises:
        RuntimeError: ``fn`` moves tensors to another device.
    """
    for buffer in module._buffers.values():
        if buffer is None:
            continue
        probe = fn(torch.empty(0, dtype=buffer.dtype, device=buffer.device))
        if probe.device != buffer.device:
            raise RuntimeError(
                f"packcache's {type(module).__name__} {getattr(module, '_name', '') or ''!r} computes on the CPU "
                f"over its cache file's mapping; it cannot move to {probe.device}. Load a float model "
                "(transformers' from_pretrained) for another device"
            )
        break  # every operand of a layer lives on the same device
    return fn(torch.empty(0, dtype=torch.float32)).dtype


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
            transposed=transposed, _dtype=activation_dtype(kernel_path), _prepared=None, _tie=None, _bound=None,
            _name="", training=False,  # inference only: its operands are read-only views of a file mapping
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
        #: The operands as :meth:`TorchPacker.bind <packcache.packers_torch.TorchPacker.bind>` checked them, at
        #: their first use (:meth:`_checked`); and the name the check's errors give the layer.
        self._bound: native.Bound | None
        self._name: str

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """The float32 tensor this layer's weight is tied to (:func:`~packcache.torch.convert` ties a tied output
        head): the embeddings' float32 parameter (fp32 embeddings), or the float32 weight of the
        :class:`PackedEmbedding` whose pack this layer reads (``.weight``, the same tensor while anyone holds it).
        What ``state_dict`` writes as its weight, so a saved model keeps the tie; ``None``: :meth:`float_weight`."""
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
        name: str = "",
        shape: tuple[int, int] | None = None,
    ) -> PackedLinear:
        """A layer over ``parts`` (a pack of ``packer``) and a float32 ``bias``; tensors are zero-copy views.

        ``kernel_path``: ``"bf16"``, ``"fp32"``, or ``None``/``"auto"`` for this machine's rule
        (see :mod:`packcache.kernels`; ``$PACKCACHE_KERNEL_PATH`` applies to ``None``).
        ``transposed``: the layer replaces one that stores its weight ``[in, out]``; only what
        ``state_dict`` writes depends on it. ``shape``: ``(out_features, in_features)`` of the module it
        replaces (``None``: read off the parts); ``name``: its name, for errors.

        The parts are checked at the layer's first use, not here (a warm load only maps): each must be what every
        kernel of the packer reads for this shape (:meth:`TorchPacker.bind
        <packcache.packers_torch.TorchPacker.bind>`), or that use raises ``PackResultError`` naming the layer and
        the part, before any kernel reads them. The packer's kernel self-check on that path runs then too.
        :func:`check_kernels` runs both now.

        Raises:
            TypeError: ``packer`` is not a torch packer (it has no forward).
            ValueError: a path the packer does not have.
            PackResultError: a part no tensor can view, or no shape to read (``shape`` not given).
        """
        if not isinstance(packer, TorchPacker):
            raise TypeError(f"PackedLinear has no kernel for packer {packer!r}: use a packcache.packers_torch packer")
        out_features, in_features = shape if shape is not None else packer.dims(parts)
        path = packer.kernel_path(kernel_path)
        layer = cls(packer, in_features, out_features, path, transposed)
        layer.__dict__["_name"] = name
        # Straight into the buffer table (what register_buffer does after its name checks, which
        # these fixed names pass): this runs for every layer of every warm load.
        buffers = layer._buffers
        buffers.update(packer.tensors({**parts, "bias": bias}, name))
        layer._non_persistent_buffers_set.update(buffers)
        return layer

    def _checked(self) -> native.Bound:
        """The operands, checked against the packer's layout at the first call (what every kernel reads, and
        :meth:`float_weight`).

        Raises:
            PackResultError: a part or the bias does not fit the layer (naming the layer and the part).
        """
        bound = self._bound
        if bound is None:
            # pinned by tests/test_native.py::test_retyped_parts_of_a_cache_file_are_refused_before_a_kernel_reads_them
            operands = {name: self._buffers.get(name) for name in (*self.packer.parts, "bias")}
            bound = self.packer.bind(operands, name=self._name, dims=(self.out_features, self.in_features))
            self.__dict__["_bound"] = bound
        return bound

    def _operands(self) -> dict[str, torch.Tensor | None]:
        prepared = self._prepared
        if prepared is None:
            # Derived once, at the first forward rather than at load: a warm load stays a mapping only. The kernel
            # self-check comes first (once per process and path, a set lookup afterwards): no output of a kernel
            # that misreads the layout is ever returned, and a load that never runs a layer pays nothing for it.
            bound = self._checked()
            self.packer.check_path(self.kernel_path)
            prepared = self._prepared = self.packer.prepare(bound, self.kernel_path)
        return prepared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` over the packed operands, in ``x``'s dtype.

        Raises:
            PackResultError: (at the first forward) a part does not fit the layer; (at the first forward on a
                path, once per process) the packer's kernel fails its self-check there: it misreads the layout
                the packer wrote.
        """
        flat = x.reshape(-1, self.in_features).to(self._dtype).contiguous()
        y = self.packer.linear(self._operands(), flat, self.kernel_path)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PackedLinear:
        _keep_operands(self, fn)  # a cast leaves the packed operands as the file holds them
        return self

    def kernel(self, rows: int) -> str:
        """The torch op this layer runs for an input of ``rows`` rows."""
        return self.packer.kernel(self.kernel_path, rows, out_features=self.out_features, in_features=self.in_features)

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
        >>> layer.float_weight().tolist()  # int8 codes times each block's bfloat16 scale: ~2/127 and ~0.5/127
        [[1.0078125, -1.9998779296875], [0.499969482421875, 0.251953125]]
        """
        with torch.no_grad():
            return _float_weight(self)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # What the replaced layer saved, so a checkpoint of a packed model is a float model's: the packed operands
        # are non-persistent buffers, and a state dict of only them would hold no linear weight at all.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        tied = self.tied_weight
        weight = tied if tied is not None else self.float_weight()
        destination[prefix + "weight"] = weight.t().contiguous() if self.transposed else weight
        bias = self._checked()["bias"]
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
    """Run now the checks every packed layer of ``module`` would run at its first use: its operands checked
    against its packer's layout (each layer once), and the kernel self-check of every :class:`PackedLinear`'s
    path (once per process per packer and path): a service that wants a file whose packs do not fit their
    layers, or a kernel misreading the layout, to fail its start, not its first request. Returns the number of
    packed linear layers (each check is a lookup after the first).

    Raises:
        PackResultError: a part does not fit its layer (naming both), or a packer's kernel fails its self-check
            on the path its layers run.

    >>> from packcache import WeightCache
    >>> from packcache.packers_torch import Int8WeightOnly
    >>> from packcache.torch import convert
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    >>> _ = convert(model, WeightCache(None), Int8WeightOnly(), model_id="doctest")
    >>> check_kernels(model)
    1
    """
    layers = [m for m in module.modules() if isinstance(m, PackedLinear)]
    for table in module.modules():
        if isinstance(table, PackedEmbedding):
            table._operands()
    for layer in layers:
        layer._checked()
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
    int8 rows with a scale per block of 32 (:data:`packcache.loader.EMBEDDING_PACKERS`), zero-copy over the cache
    mapping.

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
            _shared=_SharedFloat(self.float_weight), _bound=None, _name="",
        )  # fmt: skip
        self.packer: TorchPacker
        self.num_embeddings: int
        self.embedding_dim: int
        self.padding_idx: int | None
        self._shared: _SharedFloat
        self._bound: native.Bound | None  # its parts, checked at their first use (:meth:`_operands`)
        self._name: str

    @classmethod
    def from_parts(
        cls,
        packer: Packer,
        parts: Parts,
        *,
        padding_idx: int | None = None,
        name: str = "",
        shape: tuple[int, int] | None = None,
    ) -> PackedEmbedding:
        """A table over ``parts`` (a pack of ``packer``, whose packs are embedding tables); tensors are zero-copy views.
        ``shape``: ``(num_embeddings, embedding_dim)`` of the module it replaces (``None``: read off the parts);
        ``name``: its name, for errors. The parts are checked at the first use, as :meth:`PackedLinear.from_parts`
        says.

        Raises:
            TypeError: ``packer`` does not pack embedding tables (:attr:`TorchPacker.embeds
                <packcache.packers_torch.TorchPacker.embeds>`).
            PackResultError: a part no tensor can view, or no shape to read (``shape`` not given).
        """
        if not isinstance(packer, TorchPacker) or not packer.embeds:
            raise TypeError(f"PackedEmbedding cannot look up rows of packer {packer!r}")
        num_embeddings, embedding_dim = shape if shape is not None else packer.dims(parts)
        table = cls(packer, num_embeddings, embedding_dim, padding_idx)
        table.__dict__["_name"] = name
        buffers = table._buffers
        buffers.update(packer.tensors(parts, name))
        table._non_persistent_buffers_set.update(buffers)
        return table

    def _operands(self) -> native.Bound:
        """The parts, checked against the packer's layout at the first call.

        Raises:
            PackResultError: a part does not fit the table (naming the table and the part).
        """
        bound = self._bound
        if bound is None:
            operands = {name: self._buffers.get(name) for name in self.packer.parts}
            bound = self.packer.bind(operands, name=self._name, dims=(self.num_embeddings, self.embedding_dim))
            self.__dict__["_bound"] = bound
        return bound

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (``[*ids.shape, embedding_dim]``), dequantised one read row at a time: float32, or the
        float dtype the module was cast to (``model.to(torch.bfloat16)``)."""
        rows = self.packer.rows(self._operands(), ids)
        dtype = self.__dict__.get("_out_dtype")
        return rows if dtype is None or dtype == rows.dtype else rows.to(dtype)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PackedEmbedding:
        # the packed table stays as the file holds it; the rows come out in the dtype a float table would have now
        self.__dict__["_out_dtype"] = _keep_operands(self, fn)
        return self

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
        return dequantize_rows(operand("weight"), operand("scales"), torch.float32)
    if kind is Int4WeightOnly:  # Int4WeightOnly.linear's per-call dequantisation
        return dequantize_int4_rows(
            operand("weight"), operand("scales_and_zeros"), operand("input_scales"), torch.float32
        )
    return _probed_weight(layer)  # a packer packcache does not know


def _operand(layer: PackedLinear, name: str) -> torch.Tensor:
    tensor = layer._checked()[name]
    if tensor is None:
        raise ValueError(f"operand {name!r} is missing")
    return tensor


def _probed_weight(layer: PackedLinear) -> torch.Tensor:
    """The weight of any packer's layer: its forward, without bias, on the unit vectors (``I @ W.T = W.T``), in
    blocks of rows (on ``fp32`` where the packer has it)."""
    packer = layer.packer
    path = "fp32" if "fp32" in packer.paths else layer.kernel_path
    operands: dict[str, torch.Tensor | None] = {name: _operand(layer, name) for name in packer.parts}
    operands["bias"] = None
    prepared = packer.prepare(operands, path)
    rows = 256
    blocks = []
    for start in range(0, layer.in_features, rows):
        count = min(rows, layer.in_features - start)
        probe = torch.zeros(rows, layer.in_features, dtype=activation_dtype(path))
        probe[:count, start : start + count] = torch.eye(count)
        blocks.append(packer.linear(prepared, probe, path)[:count].float())
    return torch.cat(blocks).t().contiguous()


#: Whether the compiled dense product runs for a number of rows here (its knobs: ``NATIVE_MAX_ROWS["dense"]``,
#: ``NATIVE_ISAS``), asked by :class:`FloatLinear` at every forward: one packer, not one per call.
_DENSE_GATE = LinearFloat32()


class FloatLinear(nn.Linear):
    """An ``nn.Linear`` a packer left unpacked (``ConversionReport.ineligible``: an int4 head of 30522 outputs, a
    float32 head tied to the embeddings), whose forward gives every row the same bits alone and in any batch.

    :func:`~packcache.torch.convert` turns such a layer into this class in place: the same parameters, state dict
    and ``isinstance``. Its forward runs the compiled dense product (:func:`packcache.native.dense_product`: one sum
    order whatever the rows beside a row) where that product runs and takes the layer: compiled kernels present, a
    float32 or bfloat16 weight and input of one dtype, contiguous on the CPU, ``in_features`` a multiple of 8, no
    gradient wanted. Anywhere else it is ``nn.Linear``'s ``F.linear``, whose sums on torch's CPU path depend on the
    row count (``native.status().batch_invariant`` says when the compiled kernels are absent).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fits(x):
            return super().forward(x)
        flat = x.reshape(-1, self.in_features).contiguous()
        y = native.dense_product(flat, self._bound(), torch.get_num_threads())
        return y.reshape(*x.shape[:-1], self.out_features)

    def _fits(self, x: torch.Tensor) -> bool:
        weight = self.weight
        return (
            x.dtype == weight.dtype and weight.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
            and x.shape[-1] == self.in_features and x.numel() > 0 and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and _DENSE_GATE._use_native(x.numel() // self.in_features, self.in_features)
        )  # fmt: skip

    def _bound(self) -> native.Bound:
        """The weight and a float32 bias bound for the compiled product, again only when a parameter changed."""
        weight, bias = self.weight, self.bias
        cached = self.__dict__.get("_binding")
        if cached is not None and cached[0] is weight and cached[1] is bias:
            return cached[2]  # type: ignore[no-any-return]
        wide = None if bias is None else bias.detach().float().contiguous()
        bound = native.bind_dense(weight.detach(), wide, name="FloatLinear")
        self.__dict__["_binding"] = (weight, bias, bound)
        return bound

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        state.pop("_binding", None)  # holds tensors bound to this process's checks, not part of the module
        return state


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


# The public face is packcache.torch: reprs, help() and pickles name it, so a module pickled or saved whole
# loads whichever private module defines its classes.
for _public in (FloatLinear, PackedLinear, PackedEmbedding, _SharedFloat, _ReadOnlyTensors):
    _public.__module__ = "packcache.torch"
del _public
# doctest looks for a class's examples only in the module its __module__ names, and their methods' here:
# name them here so that their examples run.
__test__ = {
    _class.__name__: _class for _class in (FloatLinear, PackedLinear, PackedEmbedding, _SharedFloat, _ReadOnlyTensors)
}
