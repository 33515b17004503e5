"""packcache's compiled kernels: loading them, choosing their code for this CPU, and saying which runs.

``csrc/kernels.c`` is built at install into ``packcache._kernels`` (``setup.py``; optional: an install
without a C compiler succeeds without it). It holds streaming products over packed weights read in place
from the cache mapping, for a few rows of activations (a decode step, a short prefill):

``int8``
    ``torch.int8wo`` packs (int8 ``[out, in]``, a float32 scale per output row). The activations are
    quantised per row in blocks of 32 features to int8 with a float32 scale per block (llama.cpp's Q8_0
    activations); int8 dot products on VNNI (``vpdpbusd``) or AVX2 (``vpmaddubsw``).
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

>>> status().isa in (None, "avx2", "avx512")
True
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

__all__ = ["BFLOAT16", "FLOAT32", "ISAS", "NATIVE_ENV", "NativeError", "NativeStatus", "bf16_product", "int4_product",
           "int8_product", "k_multiple", "max_rows", "status", "stream"]  # fmt: skip

logger = logging.getLogger("packcache.native")

#: Environment variable choosing the compiled code: ``auto``, ``avx512``, ``avx2`` or ``off``.
NATIVE_ENV = "PACKCACHE_NATIVE"
#: The library's ISA levels, by the number ``pc_isa()`` returns.
ISAS = {2: "avx512", 1: "avx2"}
_LEVELS = {name: level for level, name in ISAS.items()}
#: The ``pc_abi_version()`` this module calls: a stale build of another version is not loaded.
ABI_VERSION = 1
#: Operand dtypes of the library's calls.
FLOAT32, BFLOAT16 = 0, 1
_OPS = {"int8": 0, "bf16": 1, "int4": 2}


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

    def flags(self) -> dict[str, object]:
        """As a JSON-able mapping (for reports)."""
        return {"native_isa": self.isa, "native_cpu": self.cpu, "native_reason": self.reason}


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
    lib.pc_int4.argtypes = [p, i, i, i, p, p, i, i, i, p, p, p, i, i]
    lib.pc_int8.restype = lib.pc_bf16.restype = lib.pc_int4.restype = i
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
    # system's libgomp would be the one both get.
    import torch  # noqa: F401

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
    """The most activation rows one compiled product takes (0 without the compiled part)."""
    return int(_library().pc_max_rows()) if status().isa is not None else 0


@functools.cache
def k_multiple(op: str) -> int:
    """What a product's ``in_features`` must be a multiple of, for ``op`` (``int8``, ``int4``, ``bf16``) in the code
    that runs."""
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


def int8_product(
    x: int, x_dtype: int, rows: int, k: int, weight: int, scales: int, n: int, bias: int | None, y: int,
    y_dtype: int, threads: int,
) -> None:  # fmt: skip
    """``y[rows, n] = x[rows, k] @ (weight[n, k] * scales[n])^T + bias``: pointers to contiguous row-major
    buffers (``x``/``y`` in :data:`FLOAT32` or :data:`BFLOAT16`; int8 ``weight``; float32 ``scales``/``bias``).

    Raises:
        NativeError: no compiled part, or the call's shape or dtypes are not ones it takes.
    """
    lib = _library()
    _set_threads(lib, threads)
    _check(lib.pc_int8(x, x_dtype, rows, k, weight, scales, n, bias, y, y_dtype, _level()), "int8")


def bf16_product(
    x: int, x_dtype: int, rows: int, k: int, weight: int, n: int, bias: int | None, y: int, y_dtype: int, threads: int
) -> None:
    """``y[rows, n] = bf16(x[rows, k]) @ weight[n, k]^T + bias`` (bfloat16 ``weight``, float32 accumulation, float32
    ``bias``); pointers and dtypes as :func:`int8_product`.

    Raises:
        NativeError: no compiled part, or the call's shape or dtypes are not ones it takes.
    """
    lib = _library()
    _set_threads(lib, threads)
    _check(lib.pc_bf16(x, x_dtype, rows, k, weight, n, bias, y, y_dtype, _level()), "bf16")


def int4_product(
    x: int, x_dtype: int, rows: int, k: int, weight: int, scales_and_zeros: int, n: int, group: int, block: int,
    input_scales: int | None, bias: int | None, y: int, y_dtype: int, threads: int,
) -> None:  # fmt: skip
    """``y[rows, n] = (x * input_scales) @ W^T + bias`` for a ``torch.int4wo`` pack: ``weight`` in torch's CPU layout
    with halves (``block`` 64 or 32, :class:`packcache.kernels.Int4Layout`), bf16 ``scales_and_zeros``
    ``[k/group, n, 2]``; float32 ``input_scales`` and ``bias`` may be ``None``. ``n % 64 == 0``, ``group`` a multiple
    of 32 dividing ``k``.

    Raises:
        NativeError: no compiled part, or the call's shape or dtypes are not ones it takes.
    """
    lib = _library()
    _set_threads(lib, threads)
    rc = lib.pc_int4(x, x_dtype, rows, k, weight, scales_and_zeros, n, group, block, input_scales, bias, y, y_dtype,
                     _level())  # fmt: skip
    _check(rc, "int4")


def stream(address: int, nbytes: int, threads: int) -> int:
    """Read ``nbytes`` at ``address`` once with ``threads`` threads, as the products read weights: the bandwidth
    probe of ``benchmarks/decode.py`` (it times this over a file-backed mapping). Returns the xor of the bytes'
    8-byte words, so no read can be left out.

    Raises:
        NativeError: no compiled part in this process.
    """
    lib = _library()
    _set_threads(lib, threads)
    return int(lib.pc_stream(address, nbytes))
