"""Kernel paths: how packed linear layers compute on this CPU (imports torch).

A *kernel path* is a runtime choice, made per process when a model is loaded. It
never changes a packed byte or the platform fingerprint, so a cache built on one
path is a hit on the other. There are two:

``bf16``
    Activations in bfloat16. Float weights go to oneDNN's bf16 GEMM (AMX or
    AVX512-BF16 instructions); an int8 or int4 layer dequantises its weight to bf16 once
    per call and uses the bf16 GEMM. (Where packcache's compiled kernels run,
    :mod:`packcache.native`, the packed layers run those instead, on either path.)
``fp32``
    Activations in float32 everywhere. Quantised weights are dequantised to float32
    once per call and multiplied by MKL's float32 GEMM.

**The rule** (:func:`cpu_kernels`): ``bf16`` when the CPU computes bfloat16 natively
(torch's cpuinfo reports AVX512-BF16 or AMX tiles) and torch's oneDNN runs bf16 on
it; ``fp32`` otherwise (without native bf16 a bf16 GEMM is emulated and slower than
float32). The float32 scheme (``torch.linear.f32``) always runs ``fp32``: it is the
exact reference.

**Forcing a path**, for tests and comparisons: the ``kernel_path=`` argument of
:func:`packcache.torch.convert`, :meth:`packcache.torch.PackedLinear.from_parts` and
:func:`packcache.models.minilm.load` (an error if the packer has no such path), or the
environment variable ``PACKCACHE_KERNEL_PATH`` (``bf16``, ``fp32`` or ``auto``), which
applies to every packer that has that path. An explicit choice wins: the variable is read
only where ``kernel_path`` is ``None`` (``"auto"`` is a choice, the rule), and an invalid
value there is a ``ValueError`` naming it.

>>> cpu_kernels().default_path in KERNEL_PATHS
True
>>> activation_dtype("fp32")
torch.float32
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

__all__ = [
    "KERNEL_PATHS",
    "KERNEL_PATH_ENV",
    "CpuKernels",
    "activation_dtype",
    "cpu_kernels",
    "requested_path",
]

#: The kernel paths, in order of preference on a machine with native bfloat16.
KERNEL_PATHS = ("bf16", "fp32")
#: Environment variable that forces a path for every packer that has it (``auto``: the rule).
KERNEL_PATH_ENV = "PACKCACHE_KERNEL_PATH"

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def activation_dtype(path: str) -> torch.dtype:
    """The dtype activations flow in on ``path``.

    Raises:
        ValueError: an unknown path.
    """
    try:
        return _DTYPES[path]
    except KeyError:
        raise ValueError(f"unknown kernel path {path!r}: expected one of {', '.join(KERNEL_PATHS)}") from None


@dataclass(frozen=True)
class CpuKernels:
    """What this CPU and this torch build offer the packed kernels (see :func:`cpu_kernels`).

    Attributes:
        capability: ``torch.backends.cpu.get_cpu_capability()`` (``AVX512``, ``AVX2``, ``DEFAULT``, ...):
            the ISA torch's own kernels were dispatched to (in the platform fingerprint of every torch
            packer's caches: the float GEMMs a pack is checked against run on it).
        avx512_bf16: the CPU has AVX512-BF16 (``torch.cpu._is_avx512_bf16_supported``).
        amx_tile: the CPU has AMX tiles (``torch.cpu._is_amx_tile_supported``; every such CPU has AMX-BF16).
        onednn_bf16: torch's oneDNN is built in and runs bf16 on this CPU.
    """

    capability: str
    avx512_bf16: bool
    amx_tile: bool
    onednn_bf16: bool

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 GEMMs run on native instructions (AVX512-BF16 or AMX) through oneDNN."""
        return (self.avx512_bf16 or self.amx_tile) and self.onednn_bf16

    @property
    def default_path(self) -> str:
        """The path the rule picks for a packer that has both: ``bf16`` with native bf16, else ``fp32``."""
        return "bf16" if self.native_bf16 else "fp32"

    def flags(self) -> dict[str, object]:
        """The facts that decided the path, as a JSON-able mapping (for reports)."""
        return {
            "cpu_capability": self.capability,
            "avx512_bf16": self.avx512_bf16,
            "amx_tile": self.amx_tile,
            "onednn_bf16": self.onednn_bf16,
            "native_bf16": self.native_bf16,
            "default_path": self.default_path,
        }


def _probe(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)  # private helpers of torch.cpu; absent means unknown, so no
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


@functools.cache
def cpu_kernels() -> CpuKernels:
    """This machine's :class:`CpuKernels`, read once per process."""
    onednn = bool(torch.backends.mkldnn.is_available()) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # type: ignore[no-untyped-call]
    return CpuKernels(
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=_probe("_is_avx512_bf16_supported"),
        amx_tile=_probe("_is_amx_tile_supported"),
        onednn_bf16=onednn,
    )


def requested_path(requested: str | None) -> str | None:
    """Normalise a path request: an explicit ``requested`` wins and the environment is not read;
    ``None`` (no choice) reads ``$PACKCACHE_KERNEL_PATH`` (unset or empty: no choice either).
    Returns the path, or ``None`` for "let the rule choose" (``"auto"``, or no choice anywhere).

    Raises:
        ValueError: a value that is not a path nor ``auto``, naming where it came from (the argument,
            or the environment variable and how to get past it).

    >>> requested_path("fp32"), requested_path("auto")
    ('fp32', None)
    """
    # the variable is read only without a choice, so an invalid value cannot fail an explicit kernel_path; pinned by
    #   tests/test_kernels.py::test_an_explicit_kernel_path_wins_over_an_invalid_environment_value
    if requested is None:
        value = os.environ.get(KERNEL_PATH_ENV) or None
        if value is None or value == "auto":
            return None
        if value not in KERNEL_PATHS:
            raise ValueError(
                f"the environment variable {KERNEL_PATH_ENV}={value!r} is not a kernel path: expected one of "
                f"{', '.join(KERNEL_PATHS)} or auto; unset it, or choose a path explicitly (kernel_path=)"
            )
        return value
    if requested == "auto":
        return None
    if requested not in KERNEL_PATHS:
        raise ValueError(f"kernel_path={requested!r}: expected one of {', '.join(KERNEL_PATHS)} or 'auto'")
    return requested
