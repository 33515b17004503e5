"""Packers for torch's CPU kernels (imports torch; ``import packcache`` does not import this).

Each packer produces the exact operand layout of one kernel of the installed torch
(``torch==2.13.0`` is what packcache pins), as plain numpy arrays the cache can
store; :func:`tensor_to_numpy` refuses anything that is not self-contained bytes.

- ``torch.linear.f32``: weight f32 ``[out, in]``; kernel ``torch.nn.functional.linear``.
- ``torch.linear.bf16``: weight bf16 ``[out, in]`` (stored as uint16 bits); ``linear`` on bf16 activations.
- ``torch.int8wo``: weight int8 ``[out, in]``, scales f32 ``[out]``; ``torch._weight_int8pack_mm``.
- ``torch.int4wo``: weight uint8 in the kernel's layout, scales_and_zeros f32 ``[in/g, out, 2]``,
  input_scales f32 ``[in]``; ``torch._weight_int4pack_mm_for_cpu``.

Their :meth:`~packcache.packers.Packer.platform_tags` name the torch version and
``torch.backends.cpu.get_cpu_capability()``: the int4 layout is blocked differently
per CPU capability, and the behavioural fingerprint catches a layout change in a new torch.

>>> import numpy as np
>>> parts = Int8WeightOnly().pack(np.ones((2, 4), np.float32), "F32")
>>> parts["weight"].dtype, parts["scales"].tolist()
(dtype('int8'), [0.007874015718698502, 0.007874015718698502])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import PackResultError
from .packers import (
    Packer,
    Parts,
    dequantize_int4,
    fingerprint_input,
    fingerprint_stats,
    quantize_int4_activation_aware,
    quantize_int4_groups,
    quantize_int8_rows,
    to_float32,
)

__all__ = [
    "Int4WeightOnly",
    "Int8WeightOnly",
    "LinearBFloat16",
    "LinearFloat32",
    "TorchPacker",
    "tensor_to_numpy",
]

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


class TorchPacker(Packer):
    """A packer whose bytes depend on torch's kernels: tagged with torch's version and CPU capability."""

    def platform_tags(self) -> dict[str, Any]:
        return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}

    def fingerprint(self) -> str:
        digest = super().fingerprint()
        if digest not in _CHECKED:
            _self_check(self)
            _CHECKED.add(digest)
        return digest

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        """The float32 ``[out, in]`` weight a pack of ``source`` stands for, computed without the kernel."""
        raise NotImplementedError

    def tolerance(self) -> float:
        """Largest max-abs kernel error :func:`_self_check` accepts on the fingerprint input."""
        return 1e-3


#: Fingerprints whose kernel self-check passed in this process.
_CHECKED: set[str] = set()


def _self_check(packer: TorchPacker) -> None:
    """Run the kernel once on the fingerprint pack and compare with the intended weight:
    a torch whose kernel reads the layout differently (same bytes, new meaning) must
    fail loudly here, never give wrong answers."""
    from .torch import PackedLinear

    source = fingerprint_input()
    stats = fingerprint_stats() if packer.uses_stats else None
    layer = PackedLinear.from_parts(packer, packer.checked_pack(source, "F32", stats), bias=None)
    x = torch.from_numpy(fingerprint_input((3, source.shape[1])))
    expected = x @ torch.from_numpy(packer.intended(source, "F32", stats)).T
    with torch.inference_mode():
        error = float((layer(x) - expected).abs().max())
    if not error <= packer.tolerance():
        raise PackResultError(
            f"packer {packer.id} failed its kernel self-check on torch {torch.__version__}: max error {error:.3g} "
            f"> {packer.tolerance():.3g}; the kernel no longer reads this layout, bump the packer's version"
        )


def _two_d(shape: tuple[int, ...]) -> str | None:
    return None if len(shape) == 2 else f"needs a 2-d weight, got shape {list(shape)}"


class LinearFloat32(TorchPacker):
    """float32 weight ``[out, in]`` for ``torch.nn.functional.linear``."""

    id = "torch.linear.f32"
    version = 1

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return _two_d(shape)

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        weight = torch.from_numpy(to_float32(source, dtype))
        return {"weight": tensor_to_numpy(weight.contiguous(), f"{self.id}:weight")}

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        return to_float32(source, dtype)

    def tolerance(self) -> float:
        return 1e-4


class LinearBFloat16(TorchPacker):
    """bfloat16 weight ``[out, in]`` (round to nearest even) for ``linear`` on bfloat16 activations."""

    id = "torch.linear.bf16"
    version = 1

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return _two_d(shape)

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        if dtype == "BF16":
            weight = torch.from_numpy(np.ascontiguousarray(source).view(np.int16).copy()).view(torch.bfloat16)
        else:
            weight = torch.from_numpy(to_float32(source, dtype)).to(torch.bfloat16)
        return {"weight": tensor_to_numpy(weight.contiguous(), f"{self.id}:weight")}

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        result: np.ndarray[Any, Any] = to_float32(self.pack(source, dtype)["weight"], "BF16")
        return result

    def tolerance(self) -> float:
        return 0.5  # bf16 activations: ~3 significant digits over a 256-term dot product


class Int8WeightOnly(TorchPacker):
    """Per-channel symmetric int8 for ``torch._weight_int8pack_mm(x, weight, scales)`` (float32 activations)."""

    id = "torch.int8wo"
    version = 1
    parts = ("weight", "scales")

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return _two_d(shape)

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        weight, scales = quantize_int8_rows(to_float32(source, dtype))
        return {
            "weight": tensor_to_numpy(torch.from_numpy(weight), f"{self.id}:weight"),
            "scales": tensor_to_numpy(torch.from_numpy(scales), f"{self.id}:scales"),
        }

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        weight, scales = quantize_int8_rows(to_float32(source, dtype))
        result: np.ndarray[Any, Any] = weight.astype(np.float32) * scales[:, None]
        return result


class Int4WeightOnly(TorchPacker):
    """Grouped asymmetric int4 for ``torch._weight_int4pack_mm_for_cpu`` (float32 activations).

    Without statistics, codes, scales and zeros come from
    :func:`packcache.packers.quantize_int4_groups` (a per-group least-squares search
    over clipping ranges, weight-only). With ``stats`` (``E[x x^T]`` of the layer input on
    calibration texts) and ``activation_aware=True``, from
    :func:`packcache.packers.quantize_int4_activation_aware`, which also picks a
    per-input-feature scale the layer applies to its input. The codes are laid out by
    ``torch._convert_weight_to_int4pack_for_cpu``.

    Parts: ``weight`` (uint8, the kernel's blocked layout, ``[out, in/2]``),
    ``scales_and_zeros`` (float32 ``[in/g, out, 2]``; weight = (code - 8)*scale + zero)
    and ``input_scales`` (float32 ``[in]``, all ones without statistics).

    Args:
        group_size: 32, 64 or 128 input features per scale.
        activation_aware: use ``stats`` when given.
    """

    id = "torch.int4wo"
    version = 1
    parts = ("weight", "scales_and_zeros", "input_scales")
    uses_stats = True
    GROUP_SIZES = (32, 64, 128)

    def __init__(self, group_size: int = 32, activation_aware: bool = True) -> None:
        if group_size not in self.GROUP_SIZES:
            raise ValueError(f"group_size must be one of {self.GROUP_SIZES}, got {group_size!r}")
        self.group_size = group_size
        self.activation_aware = activation_aware

    @property
    def params(self) -> dict[str, Any]:
        method = "awq-lsq-clip/1" if self.activation_aware else "lsq-clip/1"
        return {"group_size": self.group_size, "inner_k_tiles": 1, "method": method}

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        if len(shape) != 2:
            return f"needs a 2-d weight, got shape {list(shape)}"
        out_features, in_features = shape
        if out_features % 16:
            return f"out_features {out_features} is not a multiple of 16 (torch's int4 CPU layout)"
        if in_features % self.group_size:
            return f"in_features {in_features} is not a multiple of the group size {self.group_size}"
        return None

    def _quantize(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        reason = self.eligible(tuple(source.shape))
        if reason is not None:
            raise ValueError(f"{self.id}: {reason}")
        weight = to_float32(source, dtype)
        if stats is not None and self.activation_aware:
            return quantize_int4_activation_aware(weight, self.group_size, stats, zero_code=8)
        codes, scales, zeros = quantize_int4_groups(weight, self.group_size, zero_code=8)
        return codes, scales, zeros, np.ones(weight.shape[1], np.float32)

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        codes, scales, zeros, input_scales = self._quantize(source, dtype, stats)
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 1)
        scales_and_zeros = np.ascontiguousarray(np.stack([scales, zeros], axis=-1))
        return {
            "weight": tensor_to_numpy(packed, f"{self.id}:weight"),
            "scales_and_zeros": tensor_to_numpy(torch.from_numpy(scales_and_zeros), f"{self.id}:scales_and_zeros"),
            "input_scales": tensor_to_numpy(torch.from_numpy(input_scales), f"{self.id}:input_scales"),
        }

    def intended(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        codes, scales, zeros, input_scales = self._quantize(source, dtype, stats)
        weight = dequantize_int4(codes, scales, zeros, zero_code=8) * input_scales.astype(np.float64)[None, :]
        return weight.astype(np.float32)

    def tolerance(self) -> float:
        return 1e-3
