"""A source tensor's values as float32, and the refusal of NaN and ±Inf, naming where they are.

What every packer packs from (:func:`finite_float32`), and what the quantizers and
:meth:`packcache.packers.Packer.checked_pack` say when a value is not finite. Source dtypes are
safetensors codes (``"F32"``, ``"F16"``, ``"BF16"``, ``"F64"``); numpy has no bfloat16, so a ``BF16``
source arrives as ``uint16`` holding the raw bits. The public names are :mod:`packcache.packers`'.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import NonFiniteWeightError

__all__ = [
    "finite_float32",
    "non_finite_index",
    "non_finite_source",
    "position_text",
    "to_float32",
    "value_text",
]


def to_float32(source: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """A float32 copy of ``source`` read as safetensors dtype ``dtype`` (``F32``, ``F16``, ``BF16``, ``F64``).

    >>> to_float32(np.array([0x3FC0], np.uint16), "BF16").tolist()
    [1.5]
    """
    if dtype == "BF16":
        if source.dtype.itemsize != 2:
            raise TypeError(f"a BF16 source must hold 2-byte items (uint16 bits), got {source.dtype}")
        bits = np.ascontiguousarray(source).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)
    if dtype in ("F32", "F16", "F64"):
        return np.array(source, dtype=np.float32, order="C", copy=True)
    raise TypeError(f"unsupported source dtype {dtype!r}: expected F32, F16, BF16 or F64")


#: Elements per step when scanning for non-finite values: bounds the temporary mask (1 MiB).
_SCAN_CHUNK = 1 << 20


def non_finite_index(array: np.ndarray[Any, Any], dtype: str = "F32") -> tuple[int, ...] | None:
    """The position of the first NaN, +Inf or -Inf in ``array``, or ``None`` if it holds none.

    ``dtype`` ``"BF16"`` reads ``array`` as bfloat16 bits (uint16, all exponent bits set); any other
    value reads it as the float array it is. Integer arrays hold no non-finite value. Scans in chunks,
    so the temporary memory stays at 1 MiB whatever the size.

    >>> non_finite_index(np.array([[1.0, 2.0], [np.nan, 4.0]]))
    (1, 0)
    >>> non_finite_index(np.array([0x7F80], np.uint16), "BF16"), non_finite_index(np.ones(3, np.float16))
    ((0,), None)
    """
    bf16 = dtype == "BF16"
    if not bf16 and array.dtype.kind != "f":
        return None
    flat = np.ascontiguousarray(array).reshape(-1)
    if bf16:
        flat = flat.view(np.uint16)
    for start in range(0, flat.size, _SCAN_CHUNK):
        chunk = flat[start : start + _SCAN_CHUNK]
        # isfinite().all(): one temporary, ~0.4 ns per value (an inverted mask and any() take twice that).
        finite = (chunk & np.uint16(0x7F80)) != np.uint16(0x7F80) if bf16 else np.isfinite(chunk)
        if not finite.all():
            return tuple(int(i) for i in np.unravel_index(start + int(np.argmin(finite)), array.shape))
    return None


def _non_finite_mask(array: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    if dtype == "BF16":
        bits = np.ascontiguousarray(array).view(np.uint16)
        mask: np.ndarray[Any, Any] = (bits & np.uint16(0x7F80)) == np.uint16(0x7F80)
    else:
        mask = ~np.isfinite(array)
    return mask


def position_text(index: tuple[int, ...]) -> str:
    """A position as the message says it: a 2-d weight's row and column, else the index."""
    if len(index) == 2:
        return f"row {index[0]}, column {index[1]}"
    if len(index) == 1:
        return f"index {index[0]}"
    return f"index {index}"


def value_text(value: float) -> str:
    if np.isnan(value):
        return "NaN"
    if np.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.6g}"


def _element(array: np.ndarray[Any, Any], index: tuple[int, ...], dtype: str) -> float:
    if dtype == "BF16":
        return float(to_float32(np.asarray(array[index]).reshape(1), "BF16")[0])
    return float(array[index])


def non_finite_source(
    array: np.ndarray[Any, Any], dtype: str = "F32", *, original: np.ndarray[Any, Any] | None = None
) -> NonFiniteWeightError:
    """The error for a source ``array`` (read as ``dtype``) that holds a non-finite value.

    ``original``: the array ``array`` was converted from (a float64 source made float32): a value
    finite there went out of float32's range. The message names the first position and counts
    every non-finite value (and, for a 2-d weight, the rows they are in).
    """
    index = non_finite_index(array, dtype)
    assert index is not None, "non_finite_source() of a finite array"
    value = _element(array, index, dtype)
    if original is not None and np.isfinite(original[index]):
        return NonFiniteWeightError(
            f"holds {value_text(float(original[index]))} at {position_text(index)}, beyond float32's range "
            f"(it would become {value_text(value)})",
            index=index,
        )
    mask = _non_finite_mask(array, dtype)
    count = int(mask.sum())
    counted = f"{count} non-finite value{'s' if count != 1 else ''}"
    if mask.ndim == 2:
        rows = int(mask.any(axis=1).sum())
        counted += f" in {rows} row{'s' if rows != 1 else ''}"
    return NonFiniteWeightError(f"holds {value_text(value)} at {position_text(index)} ({counted})", index=index)


def finite_float32(source: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """:func:`to_float32`, refusing a source that holds NaN or ±Inf, or a float64 value beyond float32's
    range: what every packer here packs from. One scan of the float32 copy.

    Raises:
        NonFiniteWeightError: naming the first position (not the tensor:
            :meth:`packcache.packers.Packer.checked_pack` adds it).
        TypeError: an unsupported ``dtype``.

    >>> finite_float32(np.array([[1.0, np.inf]]), "F64")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packcache.errors.NonFiniteWeightError: the source tensor holds +Inf at row 0, column 1 (1 non-finite value ...
    """
    with np.errstate(over="ignore"):  # F64 beyond float32's range becomes Inf: refused just below
        weight = to_float32(source, dtype)
    if non_finite_index(weight) is not None:
        raise non_finite_source(weight, original=source if dtype == "F64" else None)
    return weight
