"""Packers for torch's CPU kernels (imports torch; ``import packcache`` does not import this).

Each packer produces the exact operand layout of one kernel of the installed torch
(``torch==2.13.0`` is what packcache pins), as plain numpy arrays the cache can
store; :func:`tensor_to_numpy` refuses anything that is not self-contained bytes.

- ``torch.linear.f32``: weight f32 ``[out, in]``; kernel ``torch.nn.functional.linear``.
- ``torch.linear.bf16``: weight bf16 ``[out, in]`` (stored as uint16 bits); ``linear`` on bf16 activations.
- ``torch.int8wo``: weight int8 ``[out, in]``, scales bf16 ``[out, in/32]`` (stored as uint16 bits): Q8_0's
  blocks; packcache's compiled int8 product (:func:`packcache.native.int8_product`).
- ``torch.int4wo``: weight uint8 ``[out, in/2]`` row-major (:func:`packcache.quantize.pack_int4_rows`),
  scales_and_zeros bf16 ``[out, in/g, 2]`` (stored as uint16 bits), input_scales f32 ``[in]``; packcache's
  compiled int4 product (:func:`packcache.native.int4_product`).

Their :meth:`~packcache.packers.Packer.platform_tags` name the torch version and
``torch.backends.cpu.get_cpu_capability()``, and the behavioural fingerprint catches a kernel that reads a layout
differently.

Every packer refuses a source holding NaN or ±Inf, or a finite value its scheme would turn
into one (:class:`~packcache.errors.NonFiniteWeightError`, see :mod:`packcache.packers`).

Each packer also owns its forward (:meth:`TorchPacker.linear`), on each kernel path of
:mod:`packcache.kernels` it supports (:attr:`TorchPacker.paths`). :class:`packcache.torch.PackedLinear`
only delegates to it. The path is a runtime choice: it changes neither the packed bytes
nor the platform fingerprint.

>>> import numpy as np
>>> parts = Int8WeightOnly().pack(np.ones((2, 4), np.float32), "F32")
>>> parts["weight"].dtype, parts["scales"].shape, parts["scales"].dtype  # bfloat16 bits, one per block of 32
(dtype('int8'), (2, 1), dtype('uint16'))
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from . import native
from ._defaults import GROUP_SIZE
from .errors import NonFiniteWeightError, PackResultError
from .kernels import KERNEL_PATHS, activation_dtype, cpu_kernels, requested_path
from .packers import (
    Packer,
    Parts,
    fingerprint_input,
    fingerprint_stats,
    finite_float32,
    non_finite_index,
    non_finite_source,
    to_float32,
)
from .quantize import (
    INT8_BLOCK,
    dequantize_int4,
    dequantize_int8_blocks,
    pack_int4_rows,
    quantize_int4_activation_aware,
    quantize_int4_groups,
    quantize_int8_blocks,
    unpack_int4_rows,
)

__all__ = [
    "Int4WeightOnly",
    "Int8WeightOnly",
    "LinearBFloat16",
    "LinearFloat32",
    "Operands",
    "Prepared",
    "STORAGE_DTYPES",
    "TorchPacker",
    "as_tensor",
    "dequantize_int4_rows",
    "dequantize_rows",
    "tensor_to_numpy",
]

#: A layer's tensors as a packer's forward reads them: the packed parts (zero-copy
#: views) plus ``"bias"`` (or ``None``) and whatever :meth:`TorchPacker.prepare` derives.
Operands = Mapping[str, "torch.Tensor | None"]

#: Per compiled operation (:mod:`packcache.native`), the most rows it is called for (``None``: every row count).
#: Each runs for every row count: one sum order whatever the batch, so a row's answer does not depend on the rows
#: beside it. ``dense`` (fp32, bf16) keeps up with torch's float32 GEMM at a MiniLM batch or a prefill; ``int8``
#: and ``int4`` multiply int8 activations by their codes at every row count (``docs/TORCH.md``, "Compiled kernels").
NATIVE_MAX_ROWS: dict[str, int | None] = {"dense": None, "int4": None, "int8": None}
#: Per compiled operation, the codes (``native.status().isa``) it is used on: all are AVX2 code, run on both levels
#: (the same numbers on every x86 CPU with AVX2 and FMA). On an AVX512 Xeon the AVX2 code decoded faster than
#: the AVX512 variants it replaced (``benchmarks/decode_kernels.py``, ``docs/BENCHMARKS.md``).
NATIVE_ISAS = {"dense": ("avx512", "avx2"), "int4": ("avx512", "avx2"), "int8": ("avx512", "avx2")}

#: torch dtypes a pack may hold, with the numpy dtype that stores their bytes.
#: bfloat16 has no numpy dtype: its bits are stored as uint16 and read back as bfloat16.
STORAGE_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    torch.float32: np.dtype("<f4"),
    torch.float64: np.dtype("<f8"),
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<u2"),
    torch.int8: np.dtype("i1"),
    torch.uint8: np.dtype("u1"),
    torch.int16: np.dtype("<i2"),
    torch.int32: np.dtype("<i4"),
    torch.int64: np.dtype("<i8"),
}


def tensor_to_numpy(tensor: object, what: str) -> np.ndarray[Any, Any]:
    """A numpy copy of a packed tensor's bytes, refusing anything that is not self-contained.

    Accepted: a plain dense CPU tensor (strided layout, not MKL-DNN/opaque, not
    quantized, sparse or nested, no autograd history) with standard C-contiguous
    strides and a dtype of :data:`STORAGE_DTYPES`. ``bfloat16`` comes back as ``uint16`` bits.

    Raises:
        PackResultError: naming ``what`` and the reason.

    >>> tensor_to_numpy(torch.tensor([1.0], dtype=torch.bfloat16), "w").tolist()
    [16256]
    """
    if not isinstance(tensor, torch.Tensor) or type(tensor) is not torch.Tensor:
        raise PackResultError(f"{what}: a torch pack must be a plain torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise PackResultError(f"{what}: the tensor lives on {tensor.device}, not the CPU")
    if tensor.layout != torch.strided or tensor.is_mkldnn or tensor.is_quantized or tensor.is_nested:
        raise PackResultError(
            f"{what}: layout {tensor.layout} (mkldnn={tensor.is_mkldnn}, quantized={tensor.is_quantized}) is an "
            "opaque or non-dense tensor whose bytes are not self-contained; it cannot be cached"
        )
    if tensor.requires_grad or tensor.grad_fn is not None:
        raise PackResultError(f"{what}: the tensor carries autograd state; pack under torch.no_grad()")
    if tensor.dtype not in STORAGE_DTYPES:
        raise PackResultError(f"{what}: dtype {tensor.dtype} has no numpy representation packcache stores")
    if not tensor.is_contiguous():
        raise PackResultError(f"{what}: strides {tensor.stride()} are not standard C-contiguous strides")
    bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    array = bits.numpy().copy()  # own the bytes: the tensor's storage may belong to the kernel's workspace
    return array.view(STORAGE_DTYPES[tensor.dtype])


_NUMPY_TO_TORCH = {np.dtype(v).str: k for k, v in STORAGE_DTYPES.items() if k is not torch.bfloat16}
_first_frombuffer = threading.Lock()
_frombuffer_warned = False


def as_tensor(array: np.ndarray[Any, Any], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor over ``array``'s buffer, zero-copy (``torch.frombuffer``), reshaped like it.

    ``dtype`` reinterprets the bytes (``torch.bfloat16`` over uint16 bits); by default
    the tensor has the array's own dtype. A read-only array gives a tensor over
    read-only memory: torch cannot mark it so, and writing to it crashes.

    >>> as_tensor(np.array([16256, 16320], np.uint16), torch.bfloat16).tolist()
    [1.0, 1.5]
    """
    global _frombuffer_warned
    dtype = dtype if dtype is not None else _NUMPY_TO_TORCH[array.dtype.str]
    if not array.flags.c_contiguous:
        raise ValueError("as_tensor needs a C-contiguous array")
    if array.nbytes == 0:
        return torch.empty(array.shape, dtype=dtype)
    if not _frombuffer_warned:
        # torch warns once per process that the buffer is not writable (read-only is the point: a
        # shared file mapping). Silencing only that first call keeps warnings.catch_warnings, which
        # copies the filter list and is not thread-safe, off the per-tensor path of a warm load.
        with _first_frombuffer, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            flat = torch.frombuffer(array, dtype=dtype)
            _frombuffer_warned = _frombuffer_warned or not array.flags.writeable
    else:
        flat = torch.frombuffer(array, dtype=dtype)
    return flat.view(array.shape)


class TorchPacker(Packer):
    """A packer whose bytes depend on torch's kernels (tagged with torch's version and CPU capability),
    and which owns the forward of a layer over its packs, on each kernel path it supports.

    A layer's forward is two calls: :meth:`prepare` once (what a path needs besides the mapped
    parts, e.g. bf16 copies of per-channel vectors), then :meth:`linear` per input.
    """

    #: Kernel paths (:mod:`packcache.kernels`) this packer runs.
    paths: ClassVar[tuple[str, ...]] = KERNEL_PATHS

    def platform_tags(self) -> dict[str, Any]:
        return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}

    def check_path(self, path: str) -> None:
        """Run :func:`_self_check` on kernel ``path`` once per process per packer identity.

        :meth:`PackedLinear.from_parts <packcache.torch.PackedLinear.from_parts>` checks the path
        each layer runs, before the layer exists. The fingerprint checks no path: it is the same on
        every path, and a path is the caller's choice (an explicit ``kernel_path``, else
        ``$PACKCACHE_KERNEL_PATH``, else the machine's rule), which the fingerprint does not know. A
        path no layer runs is not checked: its kernels' first calls cost tens of milliseconds.

        Raises:
            PackResultError: the kernel does not compute what the layout means on ``path``.
        """
        checked: set[str] | None = self.__dict__.get("_checked_paths")
        if checked is not None and path in checked:
            return
        # The packer's identity, not its fingerprint: two packers may pack the same bytes and read them differently.
        key = (*self._identity(), path)
        if key not in _CHECKED:
            _self_check(self, path)
            _CHECKED.add(key)
        self.__dict__.setdefault("_checked_paths", set()).add(path)

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        """The float32 ``[out, in]`` weight a pack of ``source`` stands for, computed without the kernel."""
        raise NotImplementedError

    def tolerance(self, path: str = "fp32", rows: int = 1) -> float:
        """Largest max-abs kernel error :func:`_self_check` accepts on the fingerprint input, on ``path``."""
        # bf16 activations keep ~3 significant digits; over a 256-term dot product that is ~0.1. int8 activations
        # (the compiled kernels': blocks of 32, amax/127 steps) err more; a misread layout errs by ~the output.
        dtype = self.kernel_input_dtype(path, rows)
        return 1.0 if dtype == torch.int8 else 0.5 if dtype == torch.bfloat16 else 1e-3

    # ------------------------------------------------------------------ forward

    def kernel_path(self, requested: str | None = None) -> str:
        """The path a layer of this packer runs.

        ``requested`` (``bf16``, ``fp32``, or ``"auto"`` for the rule of :mod:`packcache.kernels`)
        is an explicit choice and wins; ``None`` (no choice) reads ``$PACKCACHE_KERNEL_PATH``, which
        applies only if this packer has that path, else the rule. The environment is read only for ``None``.

        Raises:
            ValueError: an explicitly requested path this packer does not have, an unknown one, or
                (for ``None``) a ``$PACKCACHE_KERNEL_PATH`` that is not a path nor ``auto``.
        """
        path = requested_path(requested)
        if path is not None and path not in self.paths:
            if requested is not None:
                raise ValueError(f"packer {self.id} has no kernel path {path!r}; its paths are {', '.join(self.paths)}")
            path = None  # the environment's choice applies only where it exists
        if path is None:
            default = cpu_kernels().default_path
            path = default if default in self.paths else self.paths[0]
        return path

    def dims(self, parts: Mapping[str, Any]) -> tuple[int, int]:
        """``(out_features, in_features)`` of the layer a pack (numpy parts or tensors) computes.

        Raises:
            PackResultError: the part they are read from is missing or has another number of dimensions.
        """
        out_features, in_features = _shape(parts, "weight", 2)
        return out_features, in_features

    def part_dtypes(self) -> dict[str, torch.dtype]:
        """Parts whose stored bytes are read as another torch dtype (bf16 weights stored as uint16)."""
        return {}

    def layout(self, out_features: int, in_features: int) -> dict[str, native.Spec]:
        """Each part of a pack for a layer of ``out_features`` x ``in_features``, as every kernel of this packer
        reads it (torch's and the compiled ones alike): its torch dtype and shape, C-contiguous. A bfloat16 part is
        stored as uint16 bits. :meth:`bind` checks a layer's operands against it."""
        raise NotImplementedError

    def bind(self, operands: Mapping[str, Any], *, name: str = "", dims: tuple[int, int] | None = None) -> native.Bound:
        """Check a layer's operands once, before any kernel reads them: every part of :meth:`layout` and the
        optional float32 ``bias [out_features]``, as numpy arrays (a cache's views; a bfloat16 part as its uint16
        bits) or tensors, against the layout for ``dims`` (``None``: :meth:`dims` of the parts), by
        :func:`packcache.native.bind`. What it returns is what :meth:`prepare` and every kernel read;
        :class:`packcache.torch.PackedLinear` and :class:`~packcache.torch.PackedEmbedding` bind their parts at their
        first use (a forward, a lookup, their float weight, :func:`packcache.torch.check_kernels`), once: a warm load
        only maps. ``name`` names the layer in the error.

        Raises:
            PackResultError: a part (or the bias) is missing, or not a C-contiguous array or tensor of the
                layout's dtype and shape; the message names the layer and the part.

        >>> packer = Int8WeightOnly()
        >>> parts = packer.pack(np.ones((2, 32), np.float32), "F32")
        >>> sorted(packer.bind(parts))
        ['bias', 'scales', 'weight']
        >>> packer.bind({**parts, "scales": parts["scales"].view(np.float16)}, name="fc")
        Traceback (most recent call last):
        packcache.errors.PackResultError: layer 'fc': packed operand 'scales' is float16 [2, 1]; the layer needs \
bfloat16 [2, 1], C-contiguous: the cache holds a pack that does not fit this layer
        """
        if dims is None:
            try:
                dims = self.dims(operands)
            except PackResultError as error:
                raise PackResultError(f"layer {name!r}: {error}" if name else str(error)) from None
        out_features, in_features = dims
        layout = {**self.layout(out_features, in_features), "bias": (torch.float32, (out_features,))}
        return native.bind(
            layout, self.tensors({p: operands.get(p) for p in layout}, name), optional=("bias",), name=name
        )

    def tensors(self, parts: Mapping[str, Any], name: str = "") -> dict[str, Any]:
        """Zero-copy tensors over a pack's parts as a cache stores them: a numpy array becomes a tensor of its own
        dtype (a uint16 part of :meth:`part_dtypes` its bfloat16), anything else stays what it is. Nothing is
        checked here but what a tensor needs (:meth:`bind` checks the rest): a warm load makes these for every part.

        Raises:
            PackResultError: an array that no tensor can view (not C-contiguous, or of a dtype torch has not).
        """
        reinterpret = self.part_dtypes()
        return {part: _part_tensor(value, reinterpret.get(part), name, part) for part, value in parts.items()}

    def _bound(self, operands: Operands) -> native.Bound:
        """``operands`` bound: as they are if they already are (a :class:`packcache.native.Bound`, or the
        :attr:`Prepared.bound` of prepared ones), else by :meth:`bind`."""
        if isinstance(operands, native.Bound):
            return operands
        return operands.bound if isinstance(operands, Prepared) else self.bind(operands)

    def prepare(self, operands: Operands, path: str) -> dict[str, torch.Tensor | None]:
        """What :meth:`linear` reads on ``path``: the operands bound (:meth:`bind`, unless they already are: a
        :class:`packcache.native.Bound`, or prepared), with the small per-channel vectors (bias, scales) converted
        to the path's dtype once instead of at every call. A :class:`Prepared` mapping.

        Raises:
            PackResultError: the operands do not fit their layout (:meth:`bind`).
        """
        bound = self._bound(operands)
        prepared = Prepared(bound)
        bias = bound["bias"]
        # the compiled kernels add the float32 bias of the bound operands themselves, on either path
        prepared["bias"] = None if bias is None else bias.to(activation_dtype(path))
        return prepared

    def linear(self, operands: Operands, x: torch.Tensor, path: str) -> torch.Tensor:
        """``x @ W.T + bias`` for a 2-d contiguous ``x`` in the path's dtype, with operands from
        :meth:`prepare` (a :class:`Prepared`: anything else raises ``TypeError``, since only those were checked);
        returns ``[rows, out_features]`` in the same dtype."""
        raise NotImplementedError

    def kernel(self, path: str, rows: int, *, out_features: int = 64, in_features: int = 1 << 12) -> str:
        """The op :meth:`linear` runs for ``rows`` input rows on ``path`` (for reports and tests), for a layer of
        ``out_features`` and ``in_features`` (by default a shape every kernel takes)."""
        raise NotImplementedError

    def kernel_input_dtype(self, path: str, rows: int) -> torch.dtype:
        """The dtype of the activations when they reach that op (what a test observes at dispatch)."""
        return activation_dtype(path)

    # ------------------------------------------------------------------ embedding tables

    #: Whether a pack of this packer can also be an embedding table (:meth:`rows`, :meth:`dequantized`): a weight
    #: ``[num, dim]`` whose rows are looked up one token at a time (:class:`packcache.torch.PackedEmbedding`).
    embeds: ClassVar[bool] = False

    def rows(self, operands: Operands, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``ids`` (any shape of indices; result ``[*ids.shape, dim]``) of the weight a pack stands
        for, bit for bit the rows of :meth:`dequantized`: only those rows are read (``F.embedding`` over the packed
        parts) and widened, never the whole table. ``operands``: bound (:meth:`bind`), or bound here.

        Raises:
            NotImplementedError: this packer's packs are not embedding tables (:attr:`embeds` is False).
            PackResultError: the parts do not fit the packer's layout.
        """
        raise NotImplementedError(f"packer {self.id} does not pack embedding tables")

    def dequantized(self, operands: Operands) -> torch.Tensor:
        """The whole float32 ``[out, in]`` weight a pack stands for (for saving; a lookup reads :meth:`rows`).

        Raises:
            NotImplementedError: this packer's packs are not embedding tables (:attr:`embeds` is False).
        """
        raise NotImplementedError(f"packer {self.id} does not pack embedding tables")

    def kernels(self, path: str) -> str:
        """Every op this packer runs on ``path``, with the row ranges: e.g. for ``repr``."""
        most = NATIVE_MAX_ROWS[self.native_op] if self.native_op is not None else None
        limits = {most} if most is not None else set()
        ranges: list[tuple[str, int]] = []  # (op, the most rows it runs for)
        for limit in sorted(n for n in limits if n > 0):
            op = self.kernel(path, limit)
            if ranges and ranges[-1][0] == op:
                ranges[-1] = (op, limit)
            else:
                ranges.append((op, limit))
        large = self.kernel(path, 1 << 30)
        if ranges and ranges[-1][0] == large:
            ranges.pop()
        shown = [f"{op} up to {rows} row{'s' if rows > 1 else ''}" for op, rows in ranges]
        return ", ".join([*shown, f"else {large}"]) if ranges else large

    #: The compiled operation (:mod:`packcache.native`) of this packer's packs, if it has one.
    native_op: ClassVar[str | None] = None

    def _use_native(self, rows: int, in_features: int) -> bool:
        """Whether :meth:`linear` calls the compiled kernel for ``rows`` rows of ``in_features`` (on either path)."""
        op = self.native_op
        if op is None or native.status().isa not in NATIVE_ISAS[op]:
            return False
        most = NATIVE_MAX_ROWS[op]
        return (most is None or rows <= min(most, native.max_rows())) and in_features % native.k_multiple(op) == 0


def _dense_runs(in_features: int) -> bool:
    """Whether the compiled dense product runs here for a layer of ``in_features``: what a quantised layer its own
    product does not take falls back to, over its weight dequantised per call."""
    return native.status().isa in NATIVE_ISAS["dense"] and in_features % native.k_multiple("dense") == 0


def _dense_over(x: torch.Tensor, weight: torch.Tensor, operands: Prepared) -> torch.Tensor:
    """``x @ weight.T + bias`` by the compiled dense product over a float32 ``weight [out, in]`` dequantised per
    call, with the layer's bound (checked, float32) bias."""
    return native.dense_product(x, native.bind_dense(weight, operands.bound["bias"]), torch.get_num_threads())


def _native_kernel(op: str) -> str:
    """How :meth:`TorchPacker.kernel` names a compiled operation."""
    if op == "dense":
        return "packcache dense (avx2 code: weights widened to float32, FMA, one sum order at every row count)"
    if op == "int8":
        return "packcache int8 (avx2 code: activations int8 per 4, vpmaddubsw, one sum order at every row count)"
    # int4, the other operation a packer runs
    return "packcache int4 (avx2 code: activations int8 per 32, vpmaddubsw, one sum order at every row count)"


class Prepared(dict[str, "torch.Tensor | None"]):
    """What :meth:`TorchPacker.prepare` returns and :meth:`TorchPacker.linear` reads: the bound operands' tensors
    and what ``prepare`` derived from them, with :attr:`bound`, the checked operands the compiled kernels read."""

    __slots__ = ("bound",)

    def __init__(self, bound: native.Bound) -> None:
        super().__init__(bound)
        self.bound = bound


#: Every dtype a cache file's entry may have (docs/FORMAT.md), as torch names it: a part of another dtype than its
#: layout's becomes a tensor of its own dtype, for :func:`packcache.native.bind` to refuse by name.
_STORED_DTYPES: dict[str, torch.dtype] = {
    "|b1": torch.bool, "|i1": torch.int8, "<i2": torch.int16, "<i4": torch.int32, "<i8": torch.int64,
    "|u1": torch.uint8, "<u2": torch.uint16, "<u4": torch.uint32, "<u8": torch.uint64, "<f2": torch.float16,
    "<f4": torch.float32, "<f8": torch.float64, "<c8": torch.complex64, "<c16": torch.complex128,
}  # fmt: skip


def _part_tensor(value: object, reinterpret: torch.dtype | None, name: str, part: str) -> object:
    """:meth:`TorchPacker.tensors` of one part."""
    if not isinstance(value, np.ndarray):
        return value
    stored = value.dtype.str
    dtype = reinterpret if reinterpret is not None and stored == STORAGE_DTYPES[reinterpret].str else None
    dtype = dtype or _STORED_DTYPES.get(stored)
    if dtype is None:
        raise native.misfit(name, part, f"is a numpy array of dtype {value.dtype}, which no kernel reads")
    if not value.flags.c_contiguous:
        shape, strides = list(value.shape), list(value.strides)
        raise native.misfit(name, part, f"is {value.dtype} {shape} with strides {strides}: not C-contiguous")
    return as_tensor(value, dtype)


def _shape(parts: Mapping[str, Any], part: str, ndim: int) -> tuple[int, ...]:
    """The shape of ``parts[part]``, which a layer's dimensions are read off, if it has ``ndim`` dimensions."""
    value = parts.get(part)
    if not isinstance(value, (np.ndarray, torch.Tensor)):
        raise native.misfit("", part, "is missing" if value is None else f"is a {type(value).__name__}")
    if value.ndim != ndim:
        raise native.misfit("", part, f"has shape {list(value.shape)}, not {ndim} dimensions")
    return tuple(int(n) for n in value.shape)


#: (packer class, id, version, params, kernel path) whose kernel self-check passed in this process.
_CHECKED: set[tuple[str, str, int, str, str]] = set()


def _self_check(packer: TorchPacker, path: str) -> None:
    """Run kernel ``path`` on the fingerprint pack and compare with the intended weight: a kernel that reads the
    layout differently (same bytes, new meaning) must fail loudly here, never give wrong answers. Where a compiled
    kernel runs (:mod:`packcache.native`), also on a pack of :data:`NATIVE_PROBE_SHAPES` (more rows and input
    features than the fingerprint's: whole units of the int4 layout and more than one tile of output rows)."""
    source = fingerprint_input()
    stats = fingerprint_stats() if packer.uses_stats else None
    parts = packer.fingerprint_pack()  # the pack the fingerprint hashed: not packed again
    # 1 row: decode's case (where the compiled kernels run, a path of its own); 3: the tiles of several rows
    _check_rows(packer, path, parts, source, stats, [1, 3])
    if packer.native_op is not None and native.status().isa in NATIVE_ISAS[packer.native_op]:
        shape = next(shape for shape in NATIVE_PROBE_SHAPES if packer.eligible(shape) is None)
        probe = fingerprint_input(shape)
        probe_stats = fingerprint_stats(shape[1]) if packer.uses_stats else None
        _check_rows(packer, path, packer.pack(probe, "F32", probe_stats), probe, probe_stats, [1, 3])


#: The shapes of the extra pack :func:`_self_check` runs a compiled kernel on, the first the packer takes: 288 input
#: features end in the half unit of the int4 layout (a group size of 64 or 128 takes only the second).
NATIVE_PROBE_SHAPES = ((40, 288), (40, 256))


def _check_rows(
    packer: TorchPacker, path: str, parts: Parts, source: np.ndarray[Any, Any], stats: np.ndarray[Any, Any] | None,
    row_counts: list[int],
) -> None:  # fmt: skip
    dtypes = packer.part_dtypes()
    operands: dict[str, torch.Tensor | None] = {p: as_tensor(a, dtypes.get(p)) for p, a in parts.items()}
    operands["bias"] = None
    weight = torch.from_numpy(packer.intended(source, "F32", stats))
    prepared = packer.prepare(operands, path)
    for rows in row_counts:
        x = torch.from_numpy(fingerprint_input((rows, source.shape[1])))
        expected = x @ weight.T
        with torch.inference_mode():
            got = packer.linear(prepared, x.to(activation_dtype(path)).contiguous(), path).float()
        error = float((got - expected).abs().max())
        if not error <= packer.tolerance(path, rows):
            raise PackResultError(
                f"packer {packer.id} failed its kernel self-check on torch {torch.__version__} "
                f"({packer.kernel(path, rows)}, path {path}): max error {error:.3g} > "
                f"{packer.tolerance(path, rows):.3g}; "
                "the kernel no longer reads this layout, bump the packer's version"
            )


def _prepared(operands: Operands) -> Prepared:
    """The operands a forward reads: only what :meth:`TorchPacker.prepare` made, whose parts were checked (pinned by
    tests/test_native.py::test_bound_operands_are_made_only_by_the_check_and_a_copy_is_checked_again)."""
    if not isinstance(operands, Prepared):
        raise TypeError(f"a packed layer's forward reads operands from TorchPacker.prepare(), got {type(operands)}")
    return operands


def _tensor(operands: Operands, name: str) -> torch.Tensor:
    tensor = operands[name]
    if tensor is None:
        raise ValueError(f"operand {name!r} is missing")
    return tensor


def _two_d(shape: tuple[int, ...]) -> str | None:
    return None if len(shape) == 2 else f"needs a 2-d weight, got shape {list(shape)}"


class LinearFloat32(TorchPacker):
    """float32 weight ``[out, in]`` for ``torch.nn.functional.linear``; the exact reference, so ``fp32`` path only."""

    id = "torch.linear.f32"
    version = 1
    paths = ("fp32",)

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return _two_d(shape)

    def layout(self, out_features: int, in_features: int) -> dict[str, native.Spec]:
        return {"weight": (torch.float32, (out_features, in_features))}

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        weight = torch.from_numpy(finite_float32(source, dtype))
        return {"weight": tensor_to_numpy(weight.contiguous(), f"{self.id}:weight")}

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        return to_float32(source, dtype)

    def tolerance(self, path: str = "fp32", rows: int = 1) -> float:
        return 1e-4

    native_op = "dense"

    def linear(self, operands: Operands, x: torch.Tensor, path: str) -> torch.Tensor:
        operands = _prepared(operands)
        if self._use_native(x.shape[0], x.shape[1]):
            return native.dense_product(x, operands.bound, torch.get_num_threads())
        return F.linear(x, _tensor(operands, "weight"), operands.get("bias"))

    def kernel(self, path: str, rows: int, *, out_features: int = 64, in_features: int = 1 << 12) -> str:
        return _native_kernel("dense") if self._use_native(rows, in_features) else "linear(float32)"

    embeds = True

    def rows(self, operands: Operands, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, _tensor(self._bound(operands), "weight"))

    def dequantized(self, operands: Operands) -> torch.Tensor:
        return _tensor(self._bound(operands), "weight")


class LinearBFloat16(TorchPacker):
    """bfloat16 weight ``[out, in]`` (round to nearest even) for ``linear`` on bfloat16 activations, on
    both paths: on ``fp32`` the activations are rounded to bfloat16 for the product and the result
    widened back. The weight is never widened: widening it at each call reads 2 bytes and writes 4 per
    weight per token, which makes a decode 10x slower than transformers running the same bf16 weights;
    a CPU without native bf16 still runs torch's vectorised bf16 GEMV/GEMM (float32 FMAs
    on widened loads), as transformers does for a bf16 model."""

    id = "torch.linear.bf16"
    version = 1

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return _two_d(shape)

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        if dtype == "BF16":
            if non_finite_index(source, "BF16") is not None:
                raise non_finite_source(source, "BF16")
            weight = torch.from_numpy(np.ascontiguousarray(source).view(np.int16).copy()).view(torch.bfloat16)
        else:
            finite = finite_float32(source, dtype)
            weight = torch.from_numpy(finite).to(torch.bfloat16)
            index = non_finite_index(weight.view(torch.int16).numpy(), "BF16")
            if index is not None:  # above bfloat16's largest finite value (~3.39e38), rounding gives Inf
                raise NonFiniteWeightError(
                    f"holds {float(finite[index]):.6g} at row {index[0]}, column {index[1]}, which rounds to "
                    f"{'+' if finite[index] > 0 else '-'}Inf in bfloat16 (largest finite: "
                    f"{float(torch.finfo(torch.bfloat16).max):.6g})",
                    index=index,
                )
        return {"weight": tensor_to_numpy(weight.contiguous(), f"{self.id}:weight")}

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        result: np.ndarray[Any, Any] = to_float32(self.pack(source, dtype)["weight"], "BF16")
        return result

    def part_dtypes(self) -> dict[str, torch.dtype]:
        return {"weight": torch.bfloat16}

    def layout(self, out_features: int, in_features: int) -> dict[str, native.Spec]:
        return {"weight": (torch.bfloat16, (out_features, in_features))}

    native_op = "dense"

    def linear(self, operands: Operands, x: torch.Tensor, path: str) -> torch.Tensor:
        operands = _prepared(operands)
        weight = _tensor(operands, "weight")
        rows, in_features = x.shape
        if self._use_native(rows, in_features):
            return native.dense_product(x, operands.bound, torch.get_num_threads())
        if path == "bf16":
            return F.linear(x, weight, operands.get("bias"))
        y = F.linear(x.to(torch.bfloat16), weight).float()
        bias = operands.get("bias")
        return y if bias is None else y.add_(bias)

    def kernel(self, path: str, rows: int, *, out_features: int = 64, in_features: int = 1 << 12) -> str:
        if self._use_native(rows, in_features):
            return _native_kernel("dense")
        return "linear(bfloat16)" if path == "bf16" else "activations to bfloat16 + linear(bfloat16)"

    embeds = True

    def rows(self, operands: Operands, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, _tensor(self._bound(operands), "weight")).float()  # bf16 -> float32 is exact

    def dequantized(self, operands: Operands) -> torch.Tensor:
        return _tensor(self._bound(operands), "weight").float()

    def kernel_input_dtype(self, path: str, rows: int) -> torch.dtype:
        # the compiled kernel reads the path's activations (widened to float32); torch's linear bfloat16 ones
        return activation_dtype(path) if self._use_native(rows, 1 << 12) else torch.bfloat16


class Int8WeightOnly(TorchPacker):
    """Symmetric int8 in blocks of 32 input features, llama.cpp's Q8_0 weights: parts ``weight`` (int8 codes
    ``[out, in]``) and ``scales`` (bfloat16 ``[out, ceil(in / 32)]``, stored as uint16 bits), weight = code *
    scale (:func:`packcache.quantize.quantize_int8_blocks`).

    Version 3: one scale per block of 32, where versions 1 and 2 had one per output row. A row's largest weight set
    the step of all its others, and a 1 B Llama's logits came out at cosine 0.99694 against float32, below
    llama.cpp Q8_0's 0.99809 (docs/TORCH.md, "int8"). A cache of version 2 is rebuilt once.

    Where the compiled kernels run (:mod:`packcache.native`, ``in_features % 32 == 0``), every row count runs
    :func:`packcache.native.int8_product`: activations quantised to int8 per row in blocks of 4 features, integer
    dot products, one sum order whatever the batch. A layer whose ``in_features`` it does not take runs the
    compiled dense product over its weight dequantised per call (the same at every row count too). Without the
    compiled kernels the weight is dequantised per call, a block of output channels at a time, for the path's
    ``linear``: torch has no kernel of its own for per-block int8 scales.
    """

    id = "torch.int8wo"
    version = 3
    parts = ("weight", "scales")

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return _two_d(shape)

    def layout(self, out_features: int, in_features: int) -> dict[str, native.Spec]:
        blocks = -(-in_features // INT8_BLOCK)
        return {"weight": (torch.int8, (out_features, in_features)), "scales": (torch.bfloat16, (out_features, blocks))}

    def part_dtypes(self) -> dict[str, torch.dtype]:
        return {"scales": torch.bfloat16}

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        weight, scales = quantize_int8_blocks(finite_float32(source, dtype))
        return {
            "weight": tensor_to_numpy(torch.from_numpy(weight), f"{self.id}:weight"),
            "scales": tensor_to_numpy(
                torch.from_numpy(scales.view(np.int16)).view(torch.bfloat16), f"{self.id}:scales"
            ),
        }

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        return dequantize_int8_blocks(*quantize_int8_blocks(to_float32(source, dtype)))

    native_op = "int8"

    def _use_dense(self, in_features: int) -> bool:
        """Whether a layer the int8 product does not take (``in_features`` not a multiple of 32) runs the compiled
        dense product over its weight dequantised per call."""
        return _dense_runs(in_features) and in_features % native.k_multiple("int8") != 0

    def linear(self, operands: Operands, x: torch.Tensor, path: str) -> torch.Tensor:
        operands = _prepared(operands)
        weight, scales, bias = _tensor(operands, "weight"), _tensor(operands, "scales"), operands.get("bias")
        rows, in_features = x.shape
        if self._use_native(rows, in_features):
            return native.int8_product(x, operands.bound, torch.get_num_threads())
        if self._use_dense(in_features):
            return _dense_over(x, dequantize_rows(weight, scales, torch.float32), operands)
        return _dequantized_linear(
            x, bias, weight.shape[0], lambda part, dtype: dequantize_rows(weight[part], scales[part], dtype)
        )

    def kernel(self, path: str, rows: int, *, out_features: int = 64, in_features: int = 1 << 12) -> str:
        if self._use_native(rows, in_features):
            return _native_kernel("int8")
        if self._use_dense(in_features):
            return f"int8 weight to float32 per call + {_native_kernel('dense')}"
        dtype = "bfloat16" if path == "bf16" else "float32"
        return f"int8 weight to {dtype} per call + linear({dtype})"

    def kernel_input_dtype(self, path: str, rows: int) -> torch.dtype:
        # quantised per block of 4 inside the compiled kernel
        return torch.int8 if self._use_native(rows, 1 << 12) else activation_dtype(path)

    embeds = True

    def rows(self, operands: Operands, ids: torch.Tensor) -> torch.Tensor:
        # The rows of a [num, dim] table, each row's blocks with their scales.
        # F.embedding gathers them: an id out of range is an error, as for the float table, never a wrapped index.
        bound = self._bound(operands)
        flat = ids.reshape(-1)
        codes, scales = F.embedding(flat, _tensor(bound, "weight")), F.embedding(flat, _tensor(bound, "scales"))
        return dequantize_rows(codes, scales, torch.float32).view(*ids.shape, -1)

    def dequantized(self, operands: Operands) -> torch.Tensor:
        bound = self._bound(operands)
        return dequantize_rows(_tensor(bound, "weight"), _tensor(bound, "scales"), torch.float32)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight of int8 ``codes [rows, in]`` and bfloat16 block ``scales [rows, ceil(in / 32)]`` in ``dtype``:
    code * scale, computed in float32 (exact: an int8 times a bfloat16 has at most 15 significant bits), contiguous.

    >>> dequantize_rows(torch.tensor([[2, -3]], dtype=torch.int8), torch.tensor([[0.5]], dtype=torch.bfloat16),
    ...                 torch.float32).tolist()
    [[1.0, -1.5]]
    """
    rows, in_features = codes.shape
    blocks = scales.shape[1]
    padded = blocks * INT8_BLOCK
    wide = codes.float() if padded == in_features else F.pad(codes.float(), (0, padded - in_features))
    weight = wide.view(rows, blocks, INT8_BLOCK).mul_(scales.float()[:, :, None]).view(rows, padded)
    weight = weight if padded == in_features else weight[:, :in_features].contiguous()
    return weight if dtype == torch.float32 else weight.to(dtype)


#: The most bytes of a weight converted to the activations' dtype at once: a larger weight is converted and
#: multiplied block by block of output channels. A whole 8192x2048 weight converted per call (32 MiB of bf16) made a
#: 32-row prefill of a 1 B model's layers 1.7x slower than 8 MiB blocks (``docs/TORCH.md``, "Kernel paths").
DEQUANT_BLOCK_BYTES = 8 << 20


def _dequantized_linear(
    x: torch.Tensor, bias: torch.Tensor | None, out_features: int, rows: Callable[[slice, torch.dtype], torch.Tensor]
) -> torch.Tensor:
    """``x @ W.T + bias`` with the weight dequantised for this call only, ``rows(part, dtype)`` giving rows ``part``
    of it in ``x``'s dtype: a weight larger than :data:`DEQUANT_BLOCK_BYTES` a block of output channels at a time,
    so no call holds more than that of it."""
    in_features = x.shape[1]
    block = max(16, DEQUANT_BLOCK_BYTES // max(1, in_features * x.element_size()))
    if out_features <= block:
        return F.linear(x, rows(slice(None), x.dtype), bias)
    out_t = torch.empty(out_features, x.shape[0], dtype=x.dtype)
    for start in range(0, out_features, block):
        torch.mm(rows(slice(start, start + block), x.dtype), x.t(), out=out_t[start : start + block])
    y = out_t.t().contiguous()
    return y if bias is None else y.add_(bias)


class Int4WeightOnly(TorchPacker):
    """Grouped asymmetric int4, row-major: parts ``weight`` (uint8 ``[out, in / 2]``, two codes per byte in units of
    64 input features: :func:`packcache.quantize.pack_int4_rows`), ``scales_and_zeros`` (bfloat16 ``[out, in / g,
    2]``, stored as uint16 bits; weight = (code - 8) * scale + zero) and ``input_scales`` (float32 ``[in]``, all ones
    without statistics).

    Without statistics, codes, scales and zeros come from :func:`packcache.quantize.quantize_int4_groups` (a
    per-group least-squares search over clipping ranges, weight-only). With ``stats`` (``E[x x^T]`` of the layer
    input on calibration texts) and ``activation_aware=True``, from
    :func:`packcache.quantize.quantize_int4_activation_aware`, which also picks a per-input-feature scale the layer
    applies to its input. The scales and zeros are bfloat16, with the codes rounded against those values.

    Version 3 lays each row out on its own (a decode step reads the codes and the scale pairs as two sequential
    streams, a block of 32 codes unpacked by two instructions), where versions 1 and 2 stored
    ``torch._convert_weight_to_int4pack_for_cpu``'s layout: blocked by output channels, different on AVX512 and AVX2
    builds, and 16 unpacks per 128 bytes to read. A cache of version 2 is rebuilt once.

    Forward: with the compiled kernels, packcache's int4 product (:func:`packcache.native.int4_product`,
    activations int8 per block of 32) at every row count, one sum order per row. Without them the weight is
    dequantised per call, a block of output channels at a time, for the path's ``linear``: torch has no kernel
    for this layout.

    Args:
        group_size: 32, 64 or 128 input features per scale.
        activation_aware: use ``stats`` when given.
    """

    id = "torch.int4wo"
    version = 3
    parts = ("weight", "scales_and_zeros", "input_scales")
    uses_stats = True
    GROUP_SIZES = (32, 64, 128)

    def __init__(self, group_size: int = GROUP_SIZE, activation_aware: bool = True) -> None:
        if group_size not in self.GROUP_SIZES:
            raise ValueError(f"group_size must be one of {self.GROUP_SIZES}, got {group_size!r}")
        self.group_size = group_size
        self.activation_aware = activation_aware

    @property
    def params(self) -> dict[str, Any]:
        # /2: candidates judged by the closed-form error, against the bf16 scales (version 1 was neither).
        method = "awq-lsq-clip/2" if self.activation_aware else "lsq-clip/2"
        return {"group_size": self.group_size, "method": method}

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        if len(shape) != 2:
            return f"needs a 2-d weight, got shape {list(shape)}"
        in_features = shape[1]
        if in_features % self.group_size:
            return f"in_features {in_features} is not a multiple of the group size {self.group_size}"
        return None

    def _quantize(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        reason = self.eligible(tuple(source.shape))
        if reason is not None:
            raise ValueError(f"{self.id}: {reason}")
        weight = finite_float32(source, dtype)
        if stats is not None and self.activation_aware:
            return quantize_int4_activation_aware(
                weight, self.group_size, stats, zero_code=8, scale_dtype="bfloat16", error="closed"
            )
        codes, scales, zeros = quantize_int4_groups(
            weight, self.group_size, zero_code=8, scale_dtype="bfloat16", error="closed"
        )
        return codes, scales, zeros, np.ones(weight.shape[1], np.float32)

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        codes, scales, zeros, input_scales = self._quantize(source, dtype, stats)
        # bf16-representable float32 values (the quantiser rounded them): the conversion is exact.
        pairs = torch.from_numpy(np.stack([scales.T, zeros.T], axis=-1)).to(torch.bfloat16)
        return {
            "weight": tensor_to_numpy(torch.from_numpy(pack_int4_rows(codes)), f"{self.id}:weight"),
            "scales_and_zeros": tensor_to_numpy(pairs.contiguous(), f"{self.id}:scales_and_zeros"),
            "input_scales": tensor_to_numpy(torch.from_numpy(input_scales), f"{self.id}:input_scales"),
        }

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        codes, scales, zeros, input_scales = self._quantize(source, dtype, stats)
        weight = dequantize_int4(codes, scales, zeros, zero_code=8) * input_scales.astype(np.float64)[None, :]
        return weight.astype(np.float32)

    def dims(self, parts: Mapping[str, Any]) -> tuple[int, int]:
        out_features, groups, _ = _shape(parts, "scales_and_zeros", 3)
        return out_features, groups * self.group_size

    def layout(self, out_features: int, in_features: int) -> dict[str, native.Spec]:
        return {
            "weight": (torch.uint8, (out_features, in_features // 2)),
            "scales_and_zeros": (torch.bfloat16, (out_features, in_features // self.group_size, 2)),
            "input_scales": (torch.float32, (in_features,)),
        }

    def part_dtypes(self) -> dict[str, torch.dtype]:
        return {"scales_and_zeros": torch.bfloat16}

    def prepare(self, operands: Operands, path: str) -> dict[str, torch.Tensor | None]:
        prepared = super().prepare(operands, path)
        input_scales = _tensor(prepared, "input_scales")
        # All ones without calibration statistics (every hf model): then no per-call multiply of the activations.
        prepared["input_scales"] = None if bool(torch.all(input_scales == 1)) else input_scales
        return prepared

    native_op = "int4"

    def linear(self, operands: Operands, x: torch.Tensor, path: str) -> torch.Tensor:
        operands = _prepared(operands)
        if self._use_native(x.shape[0], x.shape[1]):
            scaled = operands.get("input_scales") is not None
            return native.int4_product(x, operands.bound, self.group_size, torch.get_num_threads(), input_scales=scaled)
        weight, pairs = _tensor(operands, "weight"), _tensor(operands, "scales_and_zeros")
        input_scales = operands.get("input_scales")
        return _dequantized_linear(
            x, operands.get("bias"), weight.shape[0],
            lambda part, dtype: dequantize_int4_rows(weight[part], pairs[part], input_scales, dtype),
        )  # fmt: skip

    def kernel(self, path: str, rows: int, *, out_features: int = 64, in_features: int = 1 << 12) -> str:
        if self._use_native(rows, in_features):
            return _native_kernel("int4")
        dtype = "bfloat16" if path == "bf16" else "float32"
        return f"int4 weight to {dtype} per call + linear({dtype})"

    def kernel_input_dtype(self, path: str, rows: int) -> torch.dtype:
        # quantised per block of 4 inside the compiled kernel
        return torch.int8 if self._use_native(rows, 1 << 12) else activation_dtype(path)


def dequantize_int4_rows(
    weight: torch.Tensor, scales_and_zeros: torch.Tensor, input_scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``[rows, in]`` of a ``torch.int4wo`` pack's rows in ``dtype``: ``code * scale + (zero - 8 *
    scale)`` per group (as the compiled product computes it: the offset in one rounding, then one multiply-add per
    code, in float32), the codes read out of :func:`packcache.quantize.pack_int4_rows`'s layout, then times the
    input scales (``None``: all ones) on its columns. The per-call dequantisation of :meth:`Int4WeightOnly.linear`
    and what :meth:`packcache.torch.PackedLinear.float_weight` saves.

    >>> from packcache.quantize import pack_int4_rows
    >>> codes = torch.from_numpy(pack_int4_rows(np.full((1, 32), 9, np.uint8)))
    >>> pairs = torch.tensor([[[0.5, 1.0]]], dtype=torch.bfloat16)
    >>> dequantize_int4_rows(codes, pairs, None, torch.float32)[0, :2].tolist()
    [1.5, 1.5]
    """
    rows, half = weight.shape
    in_features = 2 * half
    groups = scales_and_zeros.shape[1]
    codes = torch.from_numpy(unpack_int4_rows(weight.numpy()))  # the layout's one reader, over the bytes in place
    scale = scales_and_zeros[..., 0].float()
    offset = scales_and_zeros[..., 1].float() - 8 * scale  # 8 * scale is exact: one rounding, as fnmadd's
    out = torch.addcmul(offset[:, :, None], codes.view(rows, groups, -1), scale[:, :, None]).view(rows, in_features)
    if input_scales is not None:
        out.mul_(input_scales.float())
    return out if dtype == torch.float32 else out.to(dtype)
