"""packcache's compiled kernels: loading them, choosing their code for this CPU, and saying which runs.

``csrc/kernels.c`` is built at install into ``packcache._kernels`` (``setup.py``; optional: an install
without a C compiler succeeds without it). It holds products over packed weights read in place from the cache
mapping:

``dense``
    float32 and bfloat16 (``torch.linear.fp32``, ``torch.linear.bf16``) packs, and an int8 weight with a float32
    scale per row, for any number of rows. Float32 activations (bfloat16 ones widened); each weight widened to
    float32 exactly; every output summed in an order fixed by ``in_features`` alone, so a row gets the same bits
    alone and inside any batch (:func:`dense_product`). The AVX2 code, on either ISA level: what the packed layers
    of the fp32 and bf16 schemes run.
``int8``
    ``torch.int8wo`` packs (int8 codes ``[out, in]``, a bfloat16 scale per row and block of 32 input features:
    llama.cpp's Q8_0 weights). The activations are quantised per row in blocks of 4 features to int8 with a
    float32 scale per block (one per int32 lane of the dot product); int8 dot products on AVX2 (``vpmaddubsw``);
    any number of rows, a row's bits the same alone and inside any batch (:func:`int8_product`). The AVX2 code, on
    either ISA level: what the packed int8 layers run.
``int4``
    ``torch.int4wo`` packs (codes row-major, 4 bits each, in units of 64 input features; a bfloat16 scale and zero
    per row and group). The activations are quantised as for int8; any number of rows, a row's bits the same alone
    and inside any batch (:func:`int4_product`). The AVX2 code, on either ISA level: what the packed int4 layers
    run.

The product below takes at most :func:`max_rows` rows, and a row's bits depend only on the code level, not on
the rows beside it; no packed layer runs it any more, and ``benchmarks/decode_kernels.py`` compares it:

``bf16``
    ``torch.linear.bf16`` packs. Activations rounded to bfloat16 (as torch's bf16 ``linear`` does), products
    accumulated in float32: ``vdpbf16ps`` on AVX512-BF16, widening and FMA on AVX2.

**Dispatch.** The CPU decides the code (:func:`status`): ``avx512`` needs AVX512F/BW/VL, VNNI and BF16;
``avx2`` needs AVX2, FMA and F16C. ``$PACKCACHE_NATIVE`` overrides it: ``auto`` (the default: the best the
CPU runs), ``avx2`` (the AVX2 code even on an AVX512 CPU: what a CPU without AVX512 runs), ``avx512``
(an error if the CPU lacks it) or ``off`` (torch's kernels). Without the compiled part, on another CPU or
with ``off``, torch's kernels run, as before the compiled part existed; that is logged once per process
(WARNING when the part is missing or cannot load, INFO when switched off or forced to a code; the automatic
choice is not logged) and :func:`status` says why.

**Threads.** A product splits its output rows between ``threads`` OpenMP threads, torch's own: the library links
``libgomp.so.1`` by soname and is loaded after torch, so it shares the runtime torch loaded (callers in
:mod:`packcache.packers_torch` pass torch's intra-op thread count). A pool of its own took turns with torch's
on a 2-core machine and ran decode at a third of the kernels' speed.

**What the C code reads is checked first, once.** C trusts its pointers and counts, and a pack's parts come
from a cache file's index, which may say anything. So no entry point here takes a pointer: a product takes
the layer's operands as a :class:`Bound`, which only :func:`bind` makes, after checking every tensor against
the layout its packer declares (dtype, shape, C-contiguous strides, the bytes its storage holds, alignment,
a CPU tensor), and checks once per bound operands that the layout is what this product reads. Per call only
the activations are checked (a float32 or bfloat16 CPU tensor ``[rows, in]``, contiguous); the output is
allocated here. :func:`stream` takes a buffer, not an address.

>>> status().isa in (None, "avx2", "avx512")
True
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# torch before the library: see _load
import torch

from .errors import PackResultError

__all__ = ["BFLOAT16", "FLOAT32", "ISAS", "NATIVE_ENV", "Bound", "NativeError", "NativeStatus", "Spec",
           "bf16_product", "bind", "bind_dense", "default_scheme", "dense_product", "int4_product", "int8_product",
           "k_multiple", "max_rows", "misfit", "status", "stream"]  # fmt: skip

logger = logging.getLogger("packcache.native")

#: Environment variable choosing the compiled code: ``auto``, ``avx512``, ``avx2`` or ``off``.
NATIVE_ENV = "PACKCACHE_NATIVE"
#: The library's ISA levels, by the number ``pc_isa()`` returns.
ISAS = {2: "avx512", 1: "avx2"}
_LEVELS = {name: level for level, name in ISAS.items()}
#: The ``pc_abi_version()`` this module calls: a stale build of another version is not loaded.
ABI_VERSION = 5
#: Operand dtypes of the library's calls.
FLOAT32, BFLOAT16 = 0, 1
_OPS = {"int8": 0, "bf16": 1, "int4": 2, "dense": 3}
#: The weight dtypes :func:`dense_product` reads: the code the library's call takes, and the product's name in
#: :data:`_READS` and in errors.
_DENSE_WEIGHTS = {
    torch.float32: (0, "dense float32"), torch.bfloat16: (1, "dense bfloat16"), torch.int8: (2, "dense int8"),
}  # fmt: skip


class NativeError(RuntimeError):
    """A compiled kernel refused a call (a shape, dtype or ISA it does not take; out of memory)."""


@dataclass(frozen=True)
class NativeStatus:
    """Which compiled code runs in this process (:func:`status`).

    Attributes:
        isa: ``"avx512"`` or ``"avx2"``: the code that runs; ``None``: torch's kernels run (see ``reason``).
        cpu: the best code this CPU runs (``None``: neither, or the library is missing).
        reason: how ``isa`` was chosen, or why nothing compiled runs.
        library: the shared object's path, if one was found.
    """

    isa: str | None
    cpu: str | None
    reason: str
    library: str | None

    @property
    def batch_invariant(self) -> tuple[str, ...]:
        """The schemes whose packed linear layers give a row the same bits alone and inside any batch in this
        process: where the compiled kernels run, fp32 and bf16 (:func:`dense_product`), int8 (:func:`int8_product`,
        or the dense product over a weight it cannot take, dequantised) and int4
        (:func:`int4_product`), every row count; none without them (torch's kernels change with the row count)."""
        return ("fp32", "bf16", "int8", "int4") if self.isa is not None else ()

    def flags(self) -> dict[str, object]:
        """As a JSON-able mapping (for reports)."""
        return {
            "native_isa": self.isa, "native_cpu": self.cpu, "native_reason": self.reason,
            "native_batch_invariant": list(self.batch_invariant),
        }  # fmt: skip


def default_scheme() -> str:
    """The scheme that is fast on this machine: ``int8`` where the compiled int8 product runs (:func:`status`: an
    x86 CPU with AVX2 and the compiled part installed; int8 then runs as fast as the float schemes or faster, from
    the smallest fast cache, ``docs/BENCHMARKS.md``), else ``fp32`` (without it every int8 product dequantises its
    weight first: torch's int8 kernel reads one scale per row, not int8's blocks). What ``--scheme auto`` means on
    the command line.

    >>> default_scheme() in ("int8", "fp32")
    True
    """
    return "int8" if status().isa is not None else "fp32"


def _find() -> str | None:
    spec = importlib.util.find_spec("packcache._kernels")
    return spec.origin if spec is not None and spec.origin else None


def _bind(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    for name in ("pc_isa", "pc_abi_version", "pc_max_rows"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], i
    lib.pc_set_threads.argtypes, lib.pc_set_threads.restype = [i], i
    lib.pc_k_multiple.argtypes, lib.pc_k_multiple.restype = [i, i], i
    lib.pc_int8.argtypes = [p, i, i, i, p, p, i, p, p, i, i]
    lib.pc_bf16.argtypes = [p, i, i, i, p, i, p, p, i, i]
    lib.pc_int4.argtypes = [p, i, i, i, p, p, i, i, p, p, p, i, i]
    lib.pc_dense.argtypes = [p, i, i, i, p, i, p, i, p, p, i, i]
    lib.pc_int8.restype = lib.pc_bf16.restype = lib.pc_int4.restype = lib.pc_dense.restype = i
    lib.pc_stream.argtypes, lib.pc_stream.restype = [p, ctypes.c_size_t], ctypes.c_uint64


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, NativeStatus]:
    requested = os.environ.get(NATIVE_ENV, "") or "auto"
    if requested not in ("auto", "off", *_LEVELS):
        raise ValueError(
            f"the environment variable {NATIVE_ENV}={requested!r} is not a choice: expected auto, avx512, avx2 or "
            "off; unset it for auto"
        )
    path = _find()
    # torch first: the library links libgomp.so.1 by soname, and the dynamic linker then hands it the libgomp torch
    # loaded, so a product runs on torch's OpenMP threads (csrc/kernels.c, "threads"). Loaded before torch, the
    # system's libgomp would be the one both get. (This module imports torch at its top for that reason too.)
    if requested == "off":
        return None, _report(NativeStatus(None, None, f"switched off by {NATIVE_ENV}=off", path), logging.INFO)
    if path is None:
        reason = "packcache._kernels is not installed (built at install when a C compiler is present)"
        return None, _report(NativeStatus(None, None, reason, None), logging.WARNING)
    try:
        lib = ctypes.CDLL(path)
        version = int(lib.pc_abi_version())
        if version == ABI_VERSION:
            _bind(lib)
    except (OSError, AttributeError) as error:  # not a loadable object, or one without these functions
        return None, _report(NativeStatus(None, None, f"{path} does not load: {error}", path), logging.WARNING)
    if version != ABI_VERSION:
        reason = f"{path} is version {version}, this packcache calls version {ABI_VERSION}: reinstall packcache"
        return None, _report(NativeStatus(None, None, reason, path), logging.WARNING)
    level = int(lib.pc_isa())
    cpu = ISAS.get(level)
    if cpu is None:
        reason = "this CPU has neither AVX512 (F, BW, VL, VNNI, BF16) nor AVX2 (with FMA, F16C)"
        return None, _report(NativeStatus(None, None, reason, path), logging.WARNING)
    if requested == "auto":  # the usual case: not logged (a load's log stays what it was); status() tells
        return lib, NativeStatus(cpu, cpu, "the best code this CPU runs", path)
    if _LEVELS[requested] > level:
        raise ValueError(f"{NATIVE_ENV}={requested}: this CPU runs at most the {cpu} code")
    return lib, _report(NativeStatus(requested, cpu, f"chosen by {NATIVE_ENV}={requested}", path), logging.INFO)


def _report(state: NativeStatus, level: int) -> NativeStatus:
    if state.isa is None:
        logger.log(level, "packcache compiled kernels not used (%s): torch's kernels run", state.reason)
    else:
        logger.log(level, "packcache compiled kernels: %s code (%s)", state.isa, state.reason)
    return state


def status() -> NativeStatus:
    """Which compiled code runs in this process, decided (and logged) once.

    Raises:
        ValueError: ``$PACKCACHE_NATIVE`` is not a choice, or asks for code this CPU cannot run.
    """
    return _load()[1]


def _library() -> ctypes.CDLL:
    lib, state = _load()
    if lib is None:
        raise NativeError(f"no compiled kernels in this process: {state.reason}")
    return lib


def _level() -> int:
    isa = status().isa
    return _LEVELS[isa] if isa is not None else 0


@functools.cache
def max_rows() -> int:
    """The most activation rows one ``bf16`` product takes (0 without the compiled part); :func:`dense_product`,
    :func:`int8_product` and :func:`int4_product` take any number."""
    return int(_library().pc_max_rows()) if status().isa is not None else 0


@functools.cache
def k_multiple(op: str) -> int:
    """What a product's ``in_features`` must be a multiple of, for ``op`` (``dense``, ``int8``, ``int4``, ``bf16``) in
    the code that runs."""
    return int(_library().pc_k_multiple(_OPS[op], _level()))


#: The thread count last given to the library (0: none yet).
_threads = [0]


def _set_threads(lib: ctypes.CDLL, threads: int) -> None:
    if threads != _threads[0]:
        lib.pc_set_threads(threads)
        _threads[0] = threads


def _check(rc: int, op: str) -> None:
    if rc:
        raise NativeError(f"compiled {op} product refused the call: {os.strerror(-rc)} ({rc})")


# ---------------------------------------------------------------------------------------------- operands

#: One operand's layout: its dtype and its shape, C-contiguous.
Spec = tuple[torch.dtype, tuple[int, ...]]

#: The tensor types an operand may be: a subclass may redefine what its data pointer or its strides mean.
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
#: Activation dtypes, by the code the library's calls take.
_X_DTYPES = {torch.float32: FLOAT32, torch.bfloat16: BFLOAT16}


def _problem(tensor: object, dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    """Why ``tensor`` is not a dense C-contiguous CPU tensor of ``dtype`` and ``shape`` whose bytes all lie in its
    storage, at an address aligned to its elements (``None``: it is)."""
    if type(tensor) not in _TENSOR_TYPES:
        return f"is a {type(tensor).__module__}.{type(tensor).__qualname__}, not a torch.Tensor"
    assert isinstance(tensor, torch.Tensor)
    # The usual case first, in a few attribute reads: this runs for every part of every layer of a warm load. A nested
    # tensor has no shape to read; a quantized one no dtype of a layout.
    if tensor.is_nested:
        return f"is a nested tensor of {str(tensor.dtype).removeprefix('torch.')}"
    if tensor.dtype != dtype or tensor.shape != shape:
        return f"is {_spec_text((tensor.dtype, tuple(tensor.shape)))}"
    if tensor.layout != torch.strided or not tensor.is_cpu:
        return f"is {_spec_text((dtype, shape))} on {tensor.device}, layout {tensor.layout}: not a dense CPU tensor"
    if tensor.is_neg() or (dtype.is_complex and tensor.is_conj()):
        return f"is {_spec_text((dtype, shape))} as a lazily negated or conjugated view: its bytes are not its values"
    if not tensor.is_contiguous():
        return f"is {_spec_text((dtype, shape))} with strides {list(tensor.stride())}: not C-contiguous"
    itemsize = tensor.element_size()
    end = (tensor.storage_offset() + tensor.numel()) * itemsize
    held = tensor.untyped_storage().nbytes()
    if held < end and tensor.numel():
        return f"is {_spec_text((dtype, shape))} over a storage of {held} bytes, short of the {end} its view ends at"
    if tensor.data_ptr() % itemsize:
        return f"is {_spec_text((dtype, shape))} at address {tensor.data_ptr():#x}, not aligned to its elements"
    return None


def _spec_text(spec: Spec) -> str:
    return f"{str(spec[0]).removeprefix('torch.')} {list(spec[1])}"


def misfit(name: str, part: str, problem: str, spec: Spec | None = None) -> PackResultError:
    """The error of an operand that does not fit its layer: ``name`` the layer (may be empty), ``part`` the
    operand, ``problem`` what it is, ``spec`` what the layer needs.

    >>> str(misfit("fc", "scales", "is int8 [4]", (torch.float32, (4,))))  # doctest: +NORMALIZE_WHITESPACE
    "layer 'fc': packed operand 'scales' is int8 [4]; the layer needs float32 [4], C-contiguous: the cache holds a
    pack that does not fit this layer"
    """
    where = f"layer {name!r}: " if name else ""
    needs = "" if spec is None else f"; the layer needs {_spec_text(spec)}, C-contiguous"
    return PackResultError(
        f"{where}packed operand {part!r} {problem}{needs}: the cache holds a pack that does not fit this layer"
    )


#: Only :func:`bind` makes a :class:`Bound`.
_BIND = object()


class Bound(Mapping[str, "torch.Tensor | None"]):
    """A layer's operands as :func:`bind` checked them: a read-only mapping of part name to tensor (``None``: an
    optional part the layer does not have), its :attr:`layout` and the layer's :attr:`name`.

    What a compiled product reads, and the only thing it reads: the tensors' addresses are taken at the check and
    their storages kept alive, so nothing done to the tensor objects afterwards changes what the C code reads. A
    copy or a pickle binds (checks) its tensors again."""

    __slots__ = ("_addresses", "_fits", "_storages", "_tensors", "layout", "name", "optional")

    def __init__(
        self, token: object, layout: dict[str, Spec], tensors: dict[str, torch.Tensor | None], optional: frozenset[str],
        name: str,
    ) -> None:  # fmt: skip
        if token is not _BIND:
            raise TypeError("a Bound is made by packcache.native.bind(), which checks its operands")
        self.layout: Mapping[str, Spec] = layout
        self.optional = optional
        self.name = name
        self._tensors = tensors
        self._addresses = {part: None if t is None else int(t.data_ptr()) for part, t in tensors.items()}
        self._storages = tuple(t.untyped_storage() for t in tensors.values() if t is not None)
        #: (product, in_features, group) -> out_features, for each product whose reads were checked against layout.
        self._fits: dict[tuple[str, int, int], int] = {}

    def __getitem__(self, part: str) -> torch.Tensor | None:
        return self._tensors[part]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    # Mapping's __eq__ would compare the tensors element by element: a bound is equal only to itself.
    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebind, (dict(self.layout), dict(self._tensors), sorted(self.optional), self.name))

    def __repr__(self) -> str:
        parts = ", ".join(f"{part}: {_spec_text(spec)}" for part, spec in self.layout.items())
        return f"Bound({self.name!r}, {{{parts}}})"

    def _reads(self, op: str, k: int, group: int = 0) -> int:
        """``out_features``, once the layout is checked to be what product ``op`` reads for ``k`` inputs."""
        n = self._fits.get((op, k, group))
        if n is not None:
            return n
        weight = self.layout.get("weight")
        if weight is None or len(weight[1]) != 2:
            raise NativeError(f"the compiled {op} product reads a 2-d 'weight'; {self!r} has none")
        n = weight[1][0]
        for part, spec in _READS[op](n, k, group).items():
            if part in _NULLABLE and self._tensors.get(part) is None:
                continue  # given as NULL
            have = self.layout.get(part) if self._tensors.get(part) is not None else None
            if have != spec:
                raise NativeError(
                    f"the compiled {op} product reads {part!r} as {_spec_text(spec)} for {k} input features; "
                    f"{self!r} {'has no such part' if have is None else 'holds ' + _spec_text(have)}"
                )
        self._fits[(op, k, group)] = n
        return n


def _rebind(layout: dict[str, Spec], tensors: dict[str, torch.Tensor | None], optional: list[str], name: str) -> Bound:
    return bind(layout, tensors, optional=optional, name=name)


def bind(
    layout: Mapping[str, Spec], tensors: Mapping[str, object], *, optional: Collection[str] = (), name: str = ""
) -> Bound:
    """Check a layer's operands against ``layout`` before any compiled code reads them: each part a dense,
    C-contiguous CPU ``torch.Tensor`` (or ``nn.Parameter``) of exactly the layout's dtype and shape, not a lazily
    negated or conjugated view, whose storage holds every byte of it, at an address aligned to its elements. A part
    of ``optional`` may be missing or ``None``; parts outside ``layout`` are left out.

    The one check of what the products of this module read (the packers of :mod:`packcache.packers_torch` call it
    through :meth:`~packcache.packers_torch.TorchPacker.bind` when a layer's operands are bound, and every kernel,
    torch's too, then reads the bound tensors). ``name`` names the layer in the error.

    Raises:
        PackResultError: naming the layer and the part, what it is and what the layer needs.

    >>> ops = bind({"weight": (torch.int8, (2, 32))}, {"weight": torch.zeros(2, 32, dtype=torch.int8)})
    >>> list(ops), ops["weight"].dtype
    (['weight'], torch.int8)
    >>> bind({"scales": (torch.float32, (2,))}, {"scales": torch.zeros(2, dtype=torch.int8)}, name="fc")
    Traceback (most recent call last):
    packcache.errors.PackResultError: layer 'fc': packed operand 'scales' is int8 [2]; the layer needs float32 [2], \
C-contiguous: the cache holds a pack that does not fit this layer
    """
    checked: dict[str, torch.Tensor | None] = {}
    specs: dict[str, Spec] = {}
    for part, (dtype, shape) in layout.items():
        spec = specs[part] = (dtype, tuple(shape))
        tensor = tensors.get(part)
        if tensor is None:
            if part not in optional:
                raise misfit(name, part, "is missing", spec)
            checked[part] = None
            continue
        problem = _problem(tensor, *spec)
        if problem is not None:
            raise misfit(name, part, problem, spec)
        assert isinstance(tensor, torch.Tensor)
        checked[part] = tensor
    return Bound(_BIND, specs, checked, frozenset(optional), name)


def bind_dense(weight: torch.Tensor, bias: torch.Tensor | None = None, *, name: str = "") -> Bound:
    """:func:`bind` a float32 or bfloat16 ``weight [n, k]`` and an optional float32 ``bias [n]`` for
    :func:`dense_product`: a float weight no packer packed (an unpacked layer, an int4 weight dequantised per call).

    Raises:
        PackResultError: as :func:`bind` (an int8 weight: it needs its scales, which a pack's layout binds).
    """
    n, k = weight.shape
    return bind(_dense_reads(weight.dtype)(n, k, 0), {"weight": weight, "bias": bias}, optional=("bias",), name=name)


def _int8_reads(n: int, k: int, group: int) -> dict[str, Spec]:
    blocks = k // 32  # the product takes k % 32 == 0 (k_multiple); quantize.INT8_BLOCK sits a layer above
    return {"weight": (torch.int8, (n, k)), "scales": (torch.bfloat16, (n, blocks)), "bias": (torch.float32, (n,))}


def _bf16_reads(n: int, k: int, group: int) -> dict[str, Spec]:
    return {"weight": (torch.bfloat16, (n, k)), "bias": (torch.float32, (n,))}


def _dense_reads(dtype: torch.dtype) -> Any:
    def reads(n: int, k: int, group: int) -> dict[str, Spec]:
        scales = {"scales": (torch.float32, (n,))} if dtype == torch.int8 else {}
        return {"weight": (dtype, (n, k)), **scales, "bias": (torch.float32, (n,))}

    return reads


def _int4_reads(n: int, k: int, group: int) -> dict[str, Spec]:
    return {
        "weight": (torch.uint8, (n, k // 2)), "scales_and_zeros": (torch.bfloat16, (n, k // max(group, 1), 2)),
        "input_scales": (torch.float32, (k,)), "bias": (torch.float32, (n,)),
    }  # fmt: skip


#: What each product of csrc/kernels.c reads, by part, for ``n`` outputs, ``k`` inputs (and the int4 group).
_READS = {
    "int8": _int8_reads, "bf16": _bf16_reads, "int4": _int4_reads,
    **{name: _dense_reads(dtype) for dtype, (_, name) in _DENSE_WEIGHTS.items()},
}  # fmt: skip
#: Parts a product may be given as NULL.
_NULLABLE = frozenset({"bias", "input_scales"})


def _activations(x: torch.Tensor, op: str) -> tuple[int, int, int]:
    """``rows``, ``in_features`` and the dtype code of activations a product may read: a dense, contiguous 2-d
    float32 or bfloat16 CPU tensor whose storage holds it, element-aligned, its bytes its values (checked at every
    call: they are new each call)."""
    code = _X_DTYPES.get(x.dtype) if type(x) in _TENSOR_TYPES else None  # the type first: anything may come
    if (
        code is None or x.is_nested or x.layout != torch.strided or x.dim() != 2 or not x.is_cpu
        or not x.is_contiguous() or x.is_neg() or x.data_ptr() % x.element_size()
        or x.untyped_storage().nbytes() < (x.storage_offset() + x.numel()) * x.element_size()
    ):  # fmt: skip
        got = f"{x.dtype} {list(x.shape)}" if code is not None and not x.is_nested else type(x).__name__
        raise NativeError(
            f"the compiled {op} product takes activations as a contiguous 2-d float32 or bfloat16 CPU tensor, got {got}"
        )
    rows, k = x.shape
    return int(rows), int(k), code


def _call(op: str, x: torch.Tensor, operands: Bound, threads: int, group: int = 0) -> tuple[
    ctypes.CDLL, int, int, int, int, torch.Tensor
]:  # fmt: skip
    """What every product does first: the activations checked, the operands' layout checked against what ``op``
    reads (once per bound operands), the output allocated. Returns the library, ``rows``, ``k``, ``n``, the dtype
    code and the output."""
    if type(operands) is not Bound:
        raise TypeError(f"the compiled {op} product takes operands from packcache.native.bind(), got {type(operands)}")
    rows, k, code = _activations(x, op)
    n = operands._reads(op, k, group)
    lib = _library()
    _set_threads(lib, threads)
    return lib, rows, k, n, code, torch.empty(rows, n, dtype=x.dtype)


def int8_product(x: torch.Tensor, operands: Bound, threads: int) -> torch.Tensor:
    """``x[rows, k] @ W^T + bias`` over ``operands`` bound (:func:`bind`) to int8 codes ``weight [n, k]``, bfloat16
    ``scales [n, k / 32]`` (W = code * the scale of its row and block of 32) and optionally a float32 ``bias [n]``;
    ``x`` float32 or bfloat16, any number of rows, the result ``[rows, n]`` in its dtype; ``k`` a multiple of
    ``k_multiple("int8")`` (32).

    Each row's activations are rounded to int8 per block of 4 on their own and its sums taken in one order, so a
    row's bits are the same alone and among any rows.

    Raises:
        NativeError: no compiled part; ``x`` or the operands' layout is not what it reads; a call it does not take.
        TypeError: ``operands`` did not come from :func:`bind`.
    """
    lib, rows, k, n, code, y = _call("int8", x, operands, threads)
    if rows:
        a = operands._addresses
        rc = lib.pc_int8(x.data_ptr(), code, rows, k, a["weight"], a["scales"], n, a.get("bias"), y.data_ptr(), code,
                         _level())  # fmt: skip
        _check(rc, "int8")
    return y


def bf16_product(x: torch.Tensor, operands: Bound, threads: int) -> torch.Tensor:
    """``bf16(x[rows, k]) @ weight^T + bias`` (float32 accumulation) over ``operands`` bound to a bfloat16
    ``weight [n, k]`` and optionally a float32 ``bias [n]``; ``x`` and the result as :func:`int8_product`.

    Raises:
        NativeError: as :func:`int8_product`. TypeError: ``operands`` did not come from :func:`bind`.
    """
    lib, rows, k, n, code, y = _call("bf16", x, operands, threads)
    if rows:
        a = operands._addresses
        _check(
            lib.pc_bf16(x.data_ptr(), code, rows, k, a["weight"], n, a.get("bias"), y.data_ptr(), code, _level()),
            "bf16",
        )
    return y


def dense_product(x: torch.Tensor, operands: Bound, threads: int) -> torch.Tensor:
    """``x[rows, k] @ (weight * scales[:, None])^T + bias`` over ``operands`` bound (:func:`bind`) to a float32,
    bfloat16 or int8 ``weight [n, k]``, float32 ``scales [n]`` (int8 only) and optionally a float32 ``bias [n]``;
    ``x`` float32 or bfloat16 (widened to float32), the result ``[rows, n]`` in its dtype; any number of rows,
    ``k`` a multiple of ``k_multiple("dense")`` (8).

    Row ``i`` of the result has the same bits whatever the other rows are and however many: each output is a
    sum of ``x[i, k] * w[n, k]`` (fused multiply-adds, ``w`` exact in float32) over eight lanes of ``k`` modulo
    8 in increasing ``k``, the lanes then added in a fixed order, times the scale, plus the bias.

    Raises:
        NativeError: as :func:`int8_product`. TypeError: ``operands`` did not come from :func:`bind`.
    """
    weight = operands.layout.get("weight")
    dense = _DENSE_WEIGHTS.get(weight[0]) if weight is not None else None
    if dense is None:
        raise NativeError(f"the compiled dense product reads a float32, bfloat16 or int8 'weight'; {operands!r}")
    wcode, op = dense
    lib, rows, k, n, code, y = _call(op, x, operands, threads)
    if rows:
        a = operands._addresses
        # Only the int8 product reads (and so checked) scales: any other part named so stays out of the call.
        scales = a.get("scales") if wcode == _DENSE_WEIGHTS[torch.int8][0] else None
        rc = lib.pc_dense(x.data_ptr(), code, rows, k, a["weight"], wcode, scales, n, a.get("bias"), y.data_ptr(),
                          code, _level())  # fmt: skip
        _check(rc, "dense")
    return y


def int4_product(
    x: torch.Tensor, operands: Bound, group: int, threads: int, *, input_scales: bool = True
) -> torch.Tensor:
    """``(x * input_scales) @ W^T + bias`` for a ``torch.int4wo`` pack: ``operands`` bound to ``weight`` (uint8
    ``[n, k/2]``, packcache's row-major layout: :func:`packcache.quantize.pack_int4_rows`), bfloat16
    ``scales_and_zeros [n, k/group, 2]`` (W = (code - 8) * scale + zero), float32 ``input_scales [k]`` (not read when
    ``input_scales`` is false: all ones) and optionally a float32 ``bias [n]``. ``group`` a multiple of 32 dividing
    ``k``; ``x`` and the result as :func:`int8_product`, any number of rows.

    Each row's activations are rounded to int8 per block of 4 on their own and its sums taken in one order, so row
    ``i`` of the result has the same bits whatever the other rows are and however many (the AVX2 code, on either
    ISA level).

    Raises:
        NativeError: as :func:`int8_product`. TypeError: ``operands`` did not come from :func:`bind`.
    """
    lib, rows, k, n, code, y = _call("int4", x, operands, threads, group)
    if rows:
        a = operands._addresses
        scales = a.get("input_scales") if input_scales else None
        rc = lib.pc_int4(x.data_ptr(), code, rows, k, a["weight"], a["scales_and_zeros"], n, group, scales,
                         a.get("bias"), y.data_ptr(), code, _level())  # fmt: skip
        _check(rc, "int4")
    return y


def stream(data: Any, threads: int) -> int:
    """Read every byte of ``data`` (any object with a contiguous buffer: a ``mmap``, a numpy array, ``bytes``) once
    with ``threads`` threads, as the products read weights: the bandwidth probe of ``benchmarks/decode.py`` (it times
    this over a file-backed mapping). Returns the xor of the bytes' 8-byte words, so no read can be left out.

    Raises:
        NativeError: no compiled part in this process.
        ValueError: ``data`` has no contiguous buffer.
    """
    view = np.frombuffer(data, np.uint8)  # the buffer's own bounds: the probe reads nothing past them
    lib = _library()
    _set_threads(lib, threads)
    return int(lib.pc_stream(view.ctypes.data, view.nbytes))
