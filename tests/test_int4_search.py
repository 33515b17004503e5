"""The int4 search of :func:`packcache.packers.quantize_int4_groups` against a frozen copy of its first version.

Every cached int4 pack's bytes and the int4 packers' behavioural fingerprints depend on what the search
returns, so the chunked, threaded search must give the same bytes as the whole-array formulas it replaced
(kept below, verbatim: ``frozen_quantize_int4_groups``) for every input, errors included. The bfloat16
scales of ``scale_dtype="bfloat16"`` are checked against torch's own rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import packcache.packers as packers
from packcache.errors import NonFiniteWeightError
from packcache.packers import (
    dequantize_int4,
    non_finite_source,
    quantize_int4_activation_aware,
    quantize_int4_groups,
    round_bfloat16,
)

#: ``INT4_RANGE_STEPS`` as the frozen copy knew it.
FROZEN_RANGE_STEPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)


def frozen_quantize_int4_groups(
    w: np.ndarray[Any, Any],
    group_size: int,
    *,
    zero_code: int = 0,
    importance: np.ndarray[Any, Any] | None = None,
    refine: int = 2,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``quantize_int4_groups`` as it was before the chunked search (main at 9c3cdc1), verbatim."""
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    shape = (out_features, in_features // group_size, group_size)
    # float32 search (half the memory traffic of float64); sums over one group of <= 128 stay exact enough.
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes Inf: refused below
        x = np.asarray(w, dtype=np.float32).reshape(shape)
    if importance is None:
        d = np.ones((1, shape[1], group_size), np.float32)
    else:
        raw = np.asarray(importance, dtype=np.float64)
        raw = np.where(raw > 0, raw, 0.0)
        peak = raw.max() if raw.size and raw.max() > 0 else 1.0
        # Normalised to a peak of 1; a feature never seen still counts a little.
        d = (raw / peak + 1e-6).astype(np.float32).reshape(1, shape[1], group_size)
    lo, hi = x.min(axis=2, keepdims=True), x.max(axis=2, keepdims=True)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):  # NaN and Inf reach min/max: no extra pass
        raise non_finite_source(x.reshape(out_features, in_features), original=np.asarray(w))
    # A range beyond float32 is refused below; a range of subnormals (a step of 0) ends as finite codes.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        codes, scales, zeros = _frozen_int4_search(x, lo, hi, d, zero_code, refine)
    if not (np.isfinite(scales).all() and np.isfinite(zeros).all()):
        row, group = (int(i) for i in np.argwhere(~(np.isfinite(scales) & np.isfinite(zeros))[:, :, 0])[0])
        first = group * group_size
        raise NonFiniteWeightError(
            f"holds values at row {row}, group {group} (columns {first}-{first + group_size - 1}) whose range "
            f"({float(lo[row, group, 0]):.6g} to {float(hi[row, group, 0]):.6g}) overflows float32: "
            "int4 cannot hold them",
            index=(row, group),
        )
    return (
        codes.reshape(out_features, in_features),
        np.ascontiguousarray(scales[:, :, 0].T),
        np.ascontiguousarray(zeros[:, :, 0].T),
    )


def _frozen_int4_search(
    x: np.ndarray[Any, Any],
    lo: np.ndarray[Any, Any],
    hi: np.ndarray[Any, Any],
    d: np.ndarray[Any, Any],
    zero_code: int,
    refine: int,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    span = hi - lo
    flat = span <= 0
    safe_span = np.where(flat, 1.0, span)
    centre = (hi + lo) / 2
    sum_d = np.broadcast_to(d.sum(axis=2, keepdims=True), lo.shape)
    dx = d * x
    sum_dx = dx.sum(axis=2, keepdims=True)
    best_err = np.full(lo.shape, np.inf, np.float32)
    best_s, best_m = safe_span / np.float32(15.0), lo.copy()

    def consider(codes: np.ndarray[Any, Any]) -> None:
        nonlocal best_err, best_s, best_m
        dq = d * codes
        sum_q, sum_qq, sum_qx = (
            dq.sum(axis=2, keepdims=True),
            (dq * codes).sum(axis=2, keepdims=True),
            (dq * x).sum(axis=2, keepdims=True),
        )
        det = sum_d * sum_qq - sum_q * sum_q
        ok = det > np.float32(1e-20)
        safe = np.where(ok, det, 1.0)
        s = np.where(ok, (sum_d * sum_qx - sum_q * sum_dx) / safe, best_s)
        m = np.where(ok, (sum_qq * sum_dx - sum_q * sum_qx) / safe, best_m)
        diff = codes * s + m - x
        err = (d * diff * diff).sum(axis=2, keepdims=True)
        better = (err < best_err) & (s > 0)
        best_err = np.where(better, err, best_err)
        best_s, best_m = np.where(better, s, best_s), np.where(better, m, best_m)

    for ratio in FROZEN_RANGE_STEPS:
        step = safe_span * np.float32(ratio / 15.0)
        consider(np.clip(np.rint((x - (centre - safe_span * np.float32(ratio / 2))) / step), 0, 15))
    for _ in range(refine):
        consider(np.clip(np.rint((x - best_m) / best_s), 0, 15))
    scales = np.where(flat, 0.0, best_s).astype(np.float32)
    zeros = np.where(flat, lo, best_m.astype(np.float64) + zero_code * best_s.astype(np.float64)).astype(np.float32)
    x = x.astype(np.float64)
    # Final codes against the float32 scale and zero the kernel will actually use.
    s64 = scales.astype(np.float64)
    m64 = zeros.astype(np.float64) - zero_code * s64
    codes = np.clip(np.rint((x - m64) / np.where(flat, 1.0, s64)), 0, 15)
    # A group whose scale overflowed has NaN codes here: it is refused by the caller, never cast.
    codes = np.where(flat | ~np.isfinite(codes), zero_code, codes).astype(np.uint8)
    return codes, scales, zeros
