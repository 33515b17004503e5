"""The int4 search of :func:`packcache.quantize.quantize_int4_groups` against a frozen copy of its first version.

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
import packcache.quantize as quantize
from packcache import _finite
from packcache.errors import NonFiniteWeightError
from packcache.packers import non_finite_source
from packcache.quantize import (
    dequantize_int4,
    quantize_int4_activation_aware,
    quantize_int4_groups,
    round_bfloat16,
)

#: ``INT4_RANGE_STEPS`` and ``AWQ_EXPONENTS`` as the frozen copies knew them.
FROZEN_RANGE_STEPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
AWQ_EXPONENTS = (0.0, 0.25, 0.5, 0.75, 1.0)


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


def frozen_quantize_int4_activation_aware(
    w: np.ndarray[Any, Any], group_size: int, second_moment: np.ndarray[Any, Any], *, zero_code: int = 0
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``quantize_int4_activation_aware`` as it was at main 9c3cdc1, over the frozen search, verbatim."""
    h = np.asarray(second_moment, dtype=np.float64)
    bad = _finite.non_finite_index(h)
    if bad is not None:
        raise NonFiniteWeightError(
            "has non-finite calibration statistics: E[x x^T] of the layer's input holds "
            f"{_finite.value_text(float(h[bad]))} at {_finite.position_text(bad)}, "
            "so the float model computes NaN or Inf on the calibration texts",
            index=bad,
        )
    energy = np.clip(np.diag(h), 0.0, None)
    rms = np.sqrt(energy)
    positive = rms > 0
    base = np.where(positive, rms, 1.0)
    base = base / np.exp(np.log(base[positive]).mean()) if positive.any() else base
    w64 = np.asarray(w, dtype=np.float64)
    best: tuple[float, tuple[Any, Any, Any], np.ndarray[Any, Any]] | None = None
    for alpha in AWQ_EXPONENTS:
        inv = (1.0 / base**alpha).astype(np.float32)
        column = 1.0 / inv.astype(np.float64)  # the scale the float32 input scale really undoes
        try:
            result = frozen_quantize_int4_groups(
                w64 * column, group_size, zero_code=zero_code, importance=energy / (column * column)
            )
        except NonFiniteWeightError:
            if alpha == 0.0:  # the weight itself: refused
                raise
            continue  # only this alpha's column scales push a group beyond float32
        delta = dequant = dequantize_int4(*result, zero_code=zero_code)
        delta = dequant / column - w64
        with np.errstate(over="ignore", invalid="ignore"):  # a huge error is Inf: it loses, never raises
            err = float(np.sum((delta @ h) * delta))
        if best is None or err < best[0]:
            best = (err, result, inv)
    assert best is not None
    codes, scales, zeros = best[1]
    return codes, scales, zeros, best[2]


# ---------------------------------------------------------------------------------------------- the comparison


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """What a quantizer did: its arrays as (dtype, shape, bytes), or the error's type, message and index."""
    try:
        result = fn(*args, **kwargs)
    except (NonFiniteWeightError, ValueError) as error:
        return "raised", (type(error), str(error), getattr(error, "index", None))
    return "returned", [(a.dtype.str, a.shape, a.tobytes()) for a in result]


def _assert_same_as_frozen(w: Any, group_size: int, **kwargs: Any) -> str:
    frozen = _outcome(frozen_quantize_int4_groups, w, group_size, **kwargs)
    chunked = _outcome(quantize_int4_groups, w, group_size, **kwargs)
    assert chunked[0] == frozen[0], (chunked[0], frozen[0])
    if frozen[0] == "raised":
        assert chunked[1] == frozen[1]
    else:
        for got, expected, name in zip(chunked[1], frozen[1], ("codes", "scales", "zeros"), strict=True):
            assert got[:2] == expected[:2], name
            if got[2] != expected[2]:
                a, b = np.frombuffer(got[2], np.uint8), np.frombuffer(expected[2], np.uint8)
                raise AssertionError(f"{name} differ at byte {int(np.argmax(a != b))} of {a.size}")
    return frozen[0]


@pytest.fixture(params=["one chunk", "small chunks, two threads"])
def chunking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The default chunking, and chunks of a few rows (with a shorter last one) on a pool of two threads."""
    if request.param != "one chunk":
        monkeypatch.setattr(quantize, "_INT4_CHUNK", 700)
        monkeypatch.setattr(quantize, "usable_cpus", lambda: 2)
    return str(request.param)


def _weights(kind: str, shape: tuple[int, int], group_size: int, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    out_features, in_features = shape
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    w = rng.standard_t(3, size=shape).astype(np.float32)
    if kind == "heavy tails":
        return w
    groups = in_features // group_size
    view = w.reshape(out_features, groups, group_size)
    if kind == "flat groups":
        view[::3, ::2] = np.float32(0.125)  # all-equal groups
        view[1, :] = 0.0  # an all-zero row
        view[2, 0, ::2] = -0.0  # a zero group with both zeros
        view[-1, -1] = rng.standard_normal(1).astype(np.float32)  # one more flat group at the very end
        view[0, 0, 0] = -0.0  # a -0.0 minimum in a group of positives and negatives
    elif kind == "zero extremes":
        view[:, :] = np.abs(view)
        view[:, :, 0] = np.where(rng.random((out_features, groups)) < 0.5, np.float32(0.0), np.float32(-0.0))
        view[::2, :, -1] = -0.0  # a group whose minimum is -0.0 and +0.0 at once
    elif kind == "subnormals":
        view[::2] *= np.float32(1e-42)  # steps of 0: a group of subnormals packs as ~0
        view[1::4] *= np.float32(1e-38)
        view[3, 0] = np.float32(1e-45)
    elif kind == "huge":
        view[:] = np.clip(view, -4, 4)
        view[::2] *= np.float32(4e37)  # ranges up to ~3.2e38: finite, near float32's largest value
        view[1::4] = np.float32(3.3e38) + view[1::4] * np.float32(1e31)
    else:
        raise AssertionError(kind)
    return w


CASES = [
    # kind, shape, group size, seed
    ("normal", (64, 256), 32, 0),
    ("normal", (37, 512), 64, 1),
    ("normal", (16, 384), 128, 2),
    ("normal", (1, 128), 32, 3),
    ("normal", (3, 96), 8, 4),
    ("normal", (5, 40), 5, 5),
    ("normal", (4, 36), 3, 6),
    ("normal", (6, 64), 1, 7),
    ("normal", (9, 512), 256, 8),
    ("normal", (4, 600), 200, 9),
    ("normal", (130, 64), 16, 10),
    ("heavy tails", (48, 256), 32, 11),
    ("heavy tails", (21, 1024), 64, 12),
    ("flat groups", (30, 128), 32, 13),
    ("flat groups", (11, 256), 64, 14),
    ("zero extremes", (12, 128), 32, 15),
    ("subnormals", (16, 128), 32, 16),
    ("huge", (16, 128), 32, 17),
    ("huge", (7, 256), 128, 18),
    ("normal", (1, 75008), 75008, 19),  # a group too large for its sum of squared codes to be exact in float32
]


@pytest.mark.parametrize(("kind", "shape", "group_size", "seed"), CASES)
def test_the_chunked_search_gives_the_frozen_search_s_bytes(
    chunking: str, kind: str, shape: tuple[int, int], group_size: int, seed: int
) -> None:
    w = _weights(kind, shape, group_size, seed)
    importance = np.random.default_rng(seed + 100).random(shape[1]) ** 4 * 50
    importance[::7] = 0.0  # features never seen
    for zero_code in (0, 8):
        for weights in (None, importance):
            assert _assert_same_as_frozen(w, group_size, zero_code=zero_code, importance=weights) == "returned"
    for refine in (0, 1, 3):
        assert _assert_same_as_frozen(w, group_size, zero_code=8, refine=refine) == "returned"


@pytest.mark.parametrize("source_dtype", [np.float64, np.float16])
def test_the_chunked_search_converts_other_float_inputs_like_the_frozen_one(chunking: str, source_dtype: Any) -> None:
    w = np.random.default_rng(20).standard_t(4, size=(24, 256)).astype(source_dtype)
    assert _assert_same_as_frozen(w, 32, zero_code=8) == "returned"
    assert _assert_same_as_frozen(w, 64, importance=np.linspace(0, 3, 256)) == "returned"


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 1e300])
@pytest.mark.parametrize("at", [(0, 0), (17, 255), (40, 100), (63, 31)])
def test_a_non_finite_row_is_refused_with_the_frozen_search_s_error_and_index(
    chunking: str, value: float, at: tuple[int, int]
) -> None:
    w = np.random.default_rng(21).standard_normal((64, 256))
    w[at] = value
    w[50, 7] = -np.inf  # a second one, later: the first is named, both are counted
    source = w if value == 1e300 else w.astype(np.float32)  # 1e300 is finite in float64, beyond float32
    assert _assert_same_as_frozen(source, 32, zero_code=8) == "raised"
    with pytest.raises(NonFiniteWeightError) as caught:
        quantize_int4_groups(source, 32, zero_code=8)
    assert caught.value.index == min(at, (50, 7))  # the first in row-major order


def test_a_group_whose_range_overflows_is_refused_with_the_frozen_search_s_error(chunking: str) -> None:
    w = np.random.default_rng(22).standard_normal((40, 128), dtype=np.float32)
    w[29, 70], w[29, 80] = np.float32(3e38), np.float32(-3e38)  # group 2 of row 29
    w[35, 5], w[35, 6] = np.float32(3.3e38), np.float32(-3.3e38)  # a later row: the first row is named
    assert _assert_same_as_frozen(w, 32) == "raised"
    with pytest.raises(NonFiniteWeightError, match=r"row 29, group 2 \(columns 64-95\).*overflows float32") as caught:
        quantize_int4_groups(w, 32)
    assert caught.value.index == (29, 2)


def test_a_group_size_that_does_not_divide_the_row_is_refused_like_before() -> None:
    assert _assert_same_as_frozen(np.ones((4, 100), np.float32), 32) == "raised"


@pytest.mark.parametrize("seed", range(4))
def test_the_activation_aware_search_picks_the_frozen_alpha_and_bytes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = rng.standard_t(5, size=(48, 256)).astype(np.float32)
    x = rng.standard_normal((300, 256)) * np.geomspace(0.05, 20.0, 256)[rng.permutation(256)][None, :]
    h = x.T @ x / len(x)
    frozen = frozen_quantize_int4_activation_aware(w, 32, h, zero_code=8)
    chunked = quantize_int4_activation_aware(w, 32, h, zero_code=8)
    for got, expected in zip(chunked, frozen, strict=True):
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()
    assert not np.all(chunked[3] == 1.0)  # an alpha other than 0 won: the comparison covers the choice


# ---------------------------------------------------------------------------------------------- bfloat16


def test_round_bfloat16_rounds_like_torch() -> None:
    import torch

    rng = np.random.default_rng(30)
    bits = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [0.0, -0.0, 1.0, 1.00390625, 1.01171875, -1.00390625, 3.3895314e38, 3.39e38, 3.4e38, 3.4028235e38,
         -3.4028235e38, 1e-45, 1e-40, -1e-41, 1.1754944e-38, np.inf, -np.inf, np.nan],
        np.float32,
    )  # fmt: skip
    values = np.concatenate([bits.view(np.float32), special, -np.abs(special)])
    got = round_bfloat16(values)
    expected = torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()
    nan = np.isnan(values)
    assert got.dtype == np.float32 and got.shape == values.shape
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all() and np.array_equal(np.signbit(got[nan]), np.signbit(values[nan]))
    assert not (got.view(np.uint32) & np.uint32(0xFFFF)).any()  # every value, NaN included, is a bfloat16


def _nearest_code_error(x: Any, codes: Any, scales: Any, zeros: Any, zero_code: int) -> tuple[Any, Any]:
    """The error of the chosen code, and the least error of any of the 16 codes, per value (float64)."""
    group = codes.shape[1] // scales.shape[0]
    s = np.repeat(scales.T.astype(np.float64), group, axis=1)
    z = np.repeat(zeros.T.astype(np.float64), group, axis=1)
    chosen = np.abs((codes.astype(np.float64) - zero_code) * s + z - x)
    levels = (np.arange(16, dtype=np.float64)[:, None, None] - zero_code) * s[None] + z[None]
    return chosen, np.abs(levels - x[None]).min(axis=0)


@pytest.mark.parametrize("zero_code", [0, 8])
def test_bfloat16_scales_and_zeros_are_bfloat16_values_and_the_codes_are_the_nearest_for_them(
    chunking: str, zero_code: int
) -> None:
    w = _weights("heavy tails", (40, 256), 32, 31) * np.float32(0.05)
    codes, scales, zeros = quantize_int4_groups(w, 32, zero_code=zero_code, scale_dtype="bfloat16")
    assert scales.dtype == zeros.dtype == np.float32
    assert np.array_equal(round_bfloat16(scales), scales) and np.array_equal(round_bfloat16(zeros), zeros)
    assert not (scales.view(np.uint32) & np.uint32(0xFFFF)).any()
    plain = quantize_int4_groups(w, 32, zero_code=zero_code)
    assert not np.array_equal(plain[1], scales)  # the float32 scales were not bfloat16 values already
    assert np.array_equal(round_bfloat16(plain[1]), scales)  # the search's own values, rounded
    chosen, least = _nearest_code_error(w.astype(np.float64), codes, scales, zeros, zero_code)
    assert np.all(chosen <= least * (1 + 1e-9) + 1e-30)
    stale, _ = _nearest_code_error(w.astype(np.float64), plain[0], scales, zeros, zero_code)
    assert (stale > least * (1 + 1e-9) + 1e-30).any()  # the float32 search's codes are not the nearest ones


def test_bfloat16_scales_cost_little_weighted_error() -> None:
    rng = np.random.default_rng(32)
    w = rng.standard_normal((128, 512), dtype=np.float32) * np.float32(0.02)
    importance = rng.random(512) ** 3
    w64 = w.astype(np.float64)

    def weighted_error(scale_dtype: str) -> float:
        result = quantize_int4_groups(w, 32, zero_code=8, importance=importance, scale_dtype=scale_dtype)
        return float(np.sum(np.square(dequantize_int4(*result, zero_code=8) - w64) * importance))

    single, brain = weighted_error("float32"), weighted_error("bfloat16")
    assert single <= brain < 1.01 * single, (single, brain)  # +0.07 % here


def test_a_zero_that_rounds_to_inf_in_bfloat16_is_refused_like_an_overflow() -> None:
    w = np.random.default_rng(33).standard_normal((4, 64), dtype=np.float32)
    w[2, 32:] = np.linspace(3.397e38, 3.4e38, 32, dtype=np.float32)  # finite float32 zeros, beyond bfloat16's
    assert np.isfinite(quantize_int4_groups(w, 32)[2]).all()
    with pytest.raises(NonFiniteWeightError, match=r"row 2, group 1 \(columns 32-63\).*overflows bfloat16") as caught:
        quantize_int4_groups(w, 32, scale_dtype="bfloat16")
    assert caught.value.index == (2, 1)


def test_the_activation_aware_search_stores_bfloat16_scales_when_asked() -> None:
    x = np.random.default_rng(34).standard_normal((200, 128)) * np.geomspace(0.1, 10.0, 128)[None, :]
    w = np.random.default_rng(35).standard_normal((32, 128), dtype=np.float32)
    codes, scales, zeros, input_scales = quantize_int4_activation_aware(
        w, 32, x.T @ x / len(x), zero_code=8, scale_dtype="bfloat16"
    )
    assert np.array_equal(round_bfloat16(scales), scales) and np.array_equal(round_bfloat16(zeros), zeros)
    chosen, least = _nearest_code_error(w / input_scales.astype(np.float64), codes, scales, zeros, 8)
    assert np.all(chosen <= least * (1 + 1e-9) + 1e-30)


def test_an_unknown_scale_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="scale_dtype must be one of"):
        quantize_int4_groups(np.ones((2, 32), np.float32), 32, scale_dtype="float16")


def test_a_non_finite_chunk_stops_the_search_of_the_chunks_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    searched: list[int] = []
    run = quantize._Int4Search._run

    def counting(self: Any, start: int) -> bool:
        searched.append(start)
        return bool(run(self, start))

    monkeypatch.setattr(quantize._Int4Search, "_run", counting)
    monkeypatch.setattr(quantize, "_INT4_CHUNK", 256)  # one row of 256 per chunk
    monkeypatch.setattr(quantize, "usable_cpus", lambda: 1)
    w = np.random.default_rng(40).standard_normal((16, 256), dtype=np.float32)
    w[2, 5] = np.nan
    with pytest.raises(NonFiniteWeightError, match="row 2, column 5"):
        quantize_int4_groups(w, 32)
    assert searched == [0, 1, 2]


def _weighted_error(w: np.ndarray, d: np.ndarray, quantised: tuple[np.ndarray, ...], zero_code: int) -> float:
    weight = dequantize_int4(*quantised, zero_code=zero_code)
    return float(np.sum(d[None, :] * (weight - w.astype(np.float64)) ** 2))


@pytest.mark.parametrize("weighted", [False, True])
def test_the_closed_form_error_quantises_as_well_as_the_elementwise_one(weighted: bool) -> None:
    """``error="closed"`` (int4 version 2) judges candidates from the fit's sums in float64 instead of a float32
    pass over every value, on a coarser grid of ranges (half the passes): its weighted error is within 2 % of the
    fine search's (+1.1 % measured on 512x2048 normal and t(3) weights) and well below round-to-nearest's."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 256)).astype(np.float32) * np.float32(0.02)
    w[::7, ::13] *= 8  # outliers: the clipping search matters
    importance = rng.random(256) if weighted else None
    d = np.ones(256) if importance is None else importance / importance.max() + 1e-6
    errors = {}
    for error in ("elementwise", "closed"):
        result = quantize_int4_groups(w, 32, zero_code=8, importance=importance, error=error)
        errors[error] = _weighted_error(w, d, result, 8)
    plain = quantize_int4_groups(w, 32, zero_code=8, importance=importance, refine=0)  # includes r = 1.0
    groups = w.reshape(96, 8, 32)
    lo, hi = groups.min(axis=2, keepdims=True), groups.max(axis=2, keepdims=True)
    step = (hi - lo) / 15
    nearest = (np.clip(np.rint((groups - lo) / step), 0, 15) * step + lo).reshape(96, 256)
    round_to_nearest = float(np.sum(d[None, :] * (nearest - w.astype(np.float64)) ** 2))
    assert errors["closed"] <= errors["elementwise"] * 1.02, errors
    assert errors["closed"] < 0.9 * round_to_nearest, (errors, round_to_nearest)
    assert _weighted_error(w, d, plain, 8) < round_to_nearest
    with pytest.raises(ValueError, match="error must be"):
        quantize_int4_groups(w, 32, error="exact")


# ------------------------------------------------------------------------------- every alpha in one search


def reference_dequantize_int4(
    codes: np.ndarray[Any, Any], scales: np.ndarray[Any, Any], zeros: np.ndarray[Any, Any], zero_code: int = 0
) -> np.ndarray[Any, Any]:
    """``dequantize_int4`` as it was at 8613857, verbatim."""
    group = codes.shape[1] // scales.shape[0]
    s = np.repeat(scales.T.astype(np.float64), group, axis=1)
    z = np.repeat(zeros.T.astype(np.float64), group, axis=1)
    result: np.ndarray[Any, Any] = (codes.astype(np.float64) - zero_code) * s + z
    return result


def reference_quantize_int4_activation_aware(
    w: np.ndarray[Any, Any],
    group_size: int,
    second_moment: np.ndarray[Any, Any],
    *,
    zero_code: int = 0,
    scale_dtype: str = "float32",
    error: str = "elementwise",
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``quantize_int4_activation_aware`` as it was at 8613857, verbatim: one ``quantize_int4_groups`` per alpha.
    Every int4 pack made with statistics and the int4 packer's fingerprint hold what it returns."""
    h = np.asarray(second_moment, dtype=np.float64)
    bad = _finite.non_finite_index(h)
    if bad is not None:
        raise NonFiniteWeightError(
            "has non-finite calibration statistics: E[x x^T] of the layer's input holds "
            f"{_finite.value_text(float(h[bad]))} at {_finite.position_text(bad)}, "
            "so the float model computes NaN or Inf on the calibration texts",
            index=bad,
        )
    energy = np.clip(np.diag(h), 0.0, None)
    rms = np.sqrt(energy)
    positive = rms > 0
    base = np.where(positive, rms, 1.0)
    base = base / np.exp(np.log(base[positive]).mean()) if positive.any() else base
    w64 = np.asarray(w, dtype=np.float64)
    best: tuple[float, tuple[Any, Any, Any], np.ndarray[Any, Any]] | None = None
    for alpha in AWQ_EXPONENTS:
        inv = (1.0 / base**alpha).astype(np.float32)
        column = 1.0 / inv.astype(np.float64)  # the scale the float32 input scale really undoes
        try:
            result = quantize_int4_groups(
                w64 * column,
                group_size,
                zero_code=zero_code,
                importance=energy / (column * column),
                scale_dtype=scale_dtype,
                error=error,
            )
        except NonFiniteWeightError:
            if alpha == 0.0:  # the weight itself: refused
                raise
            continue  # only this alpha's column scales push a group beyond float32
        delta = dequant = reference_dequantize_int4(*result, zero_code=zero_code)
        delta = dequant / column - w64
        with np.errstate(over="ignore", invalid="ignore"):  # a huge error is Inf: it loses, never raises
            err = float(np.sum((delta @ h) * delta))
        if best is None or err < best[0]:
            best = (err, result, inv)
    assert best is not None
    codes, scales, zeros = best[1]
    return codes, scales, zeros, best[2]


@pytest.mark.parametrize("group_size", [1, 32, 64, 128])
@pytest.mark.parametrize("zero_code", [0, 8])
def test_dequantize_int4_gives_the_repeating_version_s_values(group_size: int, zero_code: int) -> None:
    rng = np.random.default_rng(group_size)
    codes = rng.integers(0, 16, size=(48, 256), dtype=np.uint8)
    scales = (rng.standard_t(2, size=(256 // group_size, 48)) * 1e-3).astype(np.float32)
    zeros = (rng.standard_t(2, size=scales.shape)).astype(np.float32)
    scales[0, :4] = [0.0, -0.0, 1e-45, 3e38]  # flat, subnormal, huge
    zeros[0, :4] = [-0.0, 1e-40, -3e38, 3.4e38]
    got, expected = (
        dequantize_int4(codes, scales, zeros, zero_code),
        reference_dequantize_int4(codes, scales, zeros, zero_code),
    )
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.tobytes() == expected.tobytes()


def _assert_same_as_reference(w: Any, group_size: int, h: Any, **kwargs: Any) -> tuple[str, Any]:
    """The activation-aware search and its per-alpha reference did the same: the same four arrays, byte for
    byte (the same alpha), or the same error, message and index. Returns what the reference did."""
    reference = _outcome(reference_quantize_int4_activation_aware, w, group_size, h, **kwargs)
    stacked = _outcome(quantize_int4_activation_aware, w, group_size, h, **kwargs)
    assert stacked[0] == reference[0], (stacked, reference)
    if reference[0] == "raised":
        assert stacked[1] == reference[1]
        return reference
    names = ("codes", "scales", "zeros", "input_scales")
    for got, expected, name in zip(stacked[1], reference[1], names, strict=True):
        assert got[:2] == expected[:2], name
        if got[2] != expected[2]:
            a, b = np.frombuffer(got[2], np.uint8), np.frombuffer(expected[2], np.uint8)
            raise AssertionError(f"{name} differ at byte {int(np.argmax(a != b))} of {a.size}")
    return reference


def _columns(h: np.ndarray[Any, Any], alpha: float) -> np.ndarray[Any, Any]:
    """The column scale alpha applies, as the search computes it (to build weights that overflow at one alpha)."""
    rms = np.sqrt(np.clip(np.diag(h), 0.0, None))
    positive = rms > 0
    base = np.where(positive, rms, 1.0)
    base = base / np.exp(np.log(base[positive]).mean())
    return 1.0 / (1.0 / base**alpha).astype(np.float32).astype(np.float64)


def _statistics(kind: str, in_features: int, seed: int) -> np.ndarray[Any, Any]:
    """``E[x x^T]`` of one kind: features of spread scales, some never seen, all alike, none seen."""
    rng = np.random.default_rng(seed)
    if kind == "all alike":  # every alpha scales nothing: equal errors, alpha 0 wins the tie
        return np.eye(in_features) * 2.0
    if kind == "none seen":  # energy 0 everywhere: the importance is 1e-6 for every feature
        return np.zeros((in_features, in_features))
    x = rng.standard_normal((in_features + 64, in_features))
    x *= np.geomspace(0.05, 20.0, in_features)[rng.permutation(in_features)][None, :]
    if kind == "some never seen":
        x[:, ::5] = 0.0
    elif kind != "spread":
        raise AssertionError(kind)
    h: np.ndarray[Any, Any] = x.T @ x / len(x)
    return h


AWARE_CASES = [
    # weight kind, shape, group size, statistics kind, seed
    ("normal", (32, 256), 32, "spread", 0),
    ("heavy tails", (48, 256), 32, "spread", 1),
    ("normal", (20, 384), 64, "spread", 2),
    ("heavy tails", (16, 384), 128, "some never seen", 3),
    ("normal", (1, 128), 32, "spread", 4),
    ("normal", (130, 64), 32, "spread", 5),
    ("flat groups", (30, 128), 32, "spread", 6),
    ("flat groups", (11, 256), 64, "some never seen", 7),
    ("zero extremes", (12, 128), 32, "spread", 8),
    ("subnormals", (16, 128), 32, "spread", 9),
    ("huge", (16, 128), 32, "spread", 10),
    ("huge", (7, 256), 128, "some never seen", 11),
    ("heavy tails", (24, 128), 64, "all alike", 12),
    ("normal", (16, 128), 32, "none seen", 13),
]


@pytest.mark.parametrize(("kind", "shape", "group_size", "statistics", "seed"), AWARE_CASES)
@pytest.mark.parametrize("error", ["elementwise", "closed"])
def test_the_search_of_every_alpha_at_once_gives_the_per_alpha_loop_s_bytes(
    chunking: str, kind: str, shape: tuple[int, int], group_size: int, statistics: str, seed: int, error: str
) -> None:
    w = _weights(kind, shape, group_size, seed)
    h = _statistics(statistics, shape[1], seed + 100)
    for scale_dtype in ("float32", "bfloat16"):
        for zero_code in (0, 8):
            outcome = _assert_same_as_reference(
                w, group_size, h, zero_code=zero_code, scale_dtype=scale_dtype, error=error
            )
            assert outcome[0] == "returned" or (kind == "huge" and scale_dtype == "bfloat16"), outcome


def test_the_fingerprint_input_picks_the_per_alpha_loop_s_alpha() -> None:
    """The int4 packer's own call on the fingerprint's input and statistics: its fingerprint depends on it."""
    x, h = packers.fingerprint_input(), packers.fingerprint_stats()
    outcome = _assert_same_as_reference(x, 32, h, zero_code=8, scale_dtype="bfloat16", error="closed")
    assert outcome[0] == "returned" and not np.all(np.frombuffer(outcome[1][3][2], np.float32) == 1.0)


def _far_above(in_features: int, energy: float, features: int = 2) -> np.ndarray[Any, Any]:
    """Statistics where the first ``features`` features are seen far more than the others: large column scales."""
    h = np.diag(np.linspace(0.5, 2.0, in_features))
    h[np.arange(features), np.arange(features)] = energy
    return h


@pytest.mark.parametrize("error", ["elementwise", "closed"])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_an_alpha_whose_column_scales_overflow_float32_is_skipped_as_the_per_alpha_loop_skips_it(
    chunking: str, error: str, scale_dtype: str
) -> None:
    h = _far_above(128, 1e70)
    w = np.random.default_rng(50).standard_normal((24, 128)).astype(np.float32)
    top = _columns(h, 1.0)[0]
    w[5, 0] = np.float32(4e38 / top)  # beyond float32 at alpha 1 only: that chunk holds +Inf there
    assert float(w[5, 0]) * top > 3.5e38 and float(w[5, 0]) * _columns(h, 0.75)[0] < 1e35
    outcome = _assert_same_as_reference(w, 32, h, zero_code=8, scale_dtype=scale_dtype, error=error)
    assert outcome[0] == "returned"
    with pytest.raises(NonFiniteWeightError, match="row 5, column 0"):  # what the loop skipped alpha 1 for
        quantize_int4_groups(w.astype(np.float64) * _columns(h, 1.0), 32, scale_dtype=scale_dtype, error=error)


@pytest.mark.parametrize("error", ["elementwise", "closed"])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_an_alpha_whose_scaled_group_range_overflows_is_skipped_as_the_per_alpha_loop_skips_it(
    chunking: str, error: str, scale_dtype: str
) -> None:
    h = _far_above(128, 1e70)
    w = np.random.default_rng(51).standard_normal((24, 128)).astype(np.float32)
    top = _columns(h, 1.0)[0]
    w[17, 0], w[17, 1] = np.float32(2.5e38 / top), np.float32(-2.5e38 / top)  # finite, but a range of 5e38
    outcome = _assert_same_as_reference(w, 32, h, zero_code=8, scale_dtype=scale_dtype, error=error)
    assert outcome[0] == "returned"
    with pytest.raises(NonFiniteWeightError, match="row 17, group 0"):  # what the loop skipped alpha 1 for
        quantize_int4_groups(w.astype(np.float64) * _columns(h, 1.0), 32, scale_dtype=scale_dtype, error=error)


def test_an_alpha_whose_zero_overflows_bfloat16_only_is_skipped_as_the_per_alpha_loop_skips_it(chunking: str) -> None:
    h = _far_above(64, 1e60, features=32)
    w = np.random.default_rng(52).standard_normal((16, 64)).astype(np.float32)
    top = _columns(h, 1.0)[:32]
    w[9, :32] = (np.linspace(3.397e38, 3.4e38, 32) / top).astype(np.float32)  # group 0 of row 9 at alpha 1: its zero
    for scale_dtype in ("float32", "bfloat16"):  # is a float32 value, beyond bfloat16's largest
        assert _assert_same_as_reference(w, 32, h, scale_dtype=scale_dtype, error="closed")[0] == "returned"
    with pytest.raises(NonFiniteWeightError, match="overflows bfloat16"):
        quantize_int4_groups(w.astype(np.float64) * _columns(h, 1.0), 32, scale_dtype="bfloat16")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("at", [(0, 0), (40, 100), (63, 255)])
def test_a_non_finite_weight_is_refused_with_the_per_alpha_loop_s_error_and_index(
    chunking: str, value: float, at: tuple[int, int]
) -> None:
    w = np.random.default_rng(53).standard_normal((64, 256)).astype(np.float32)
    w[at] = value
    h = _statistics("spread", 256, 54)
    outcome = _assert_same_as_reference(w, 32, h, zero_code=8, scale_dtype="bfloat16", error="closed")
    assert outcome[0] == "raised" and outcome[1][2] == at


def test_a_non_finite_weight_stops_the_search_of_every_alpha_at_its_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    searched: list[int] = []
    run = quantize._Int4Search._run

    def counting(self: Any, start: int) -> bool:
        searched.append(start)
        return bool(run(self, start))

    monkeypatch.setattr(quantize._Int4Search, "_run", counting)
    monkeypatch.setattr(quantize, "_INT4_CHUNK", 5 * 256)  # one row of every alpha per chunk
    monkeypatch.setattr(quantize, "usable_cpus", lambda: 1)
    w = np.random.default_rng(58).standard_normal((16, 256)).astype(np.float32)
    w[2, 5] = np.nan
    with pytest.raises(NonFiniteWeightError, match="row 2, column 5"):
        quantize_int4_activation_aware(w, 32, _statistics("spread", 256, 59))
    # Rows 0-2 of every alpha, then alpha 0's own search (five rows a chunk) for the plain search's message.
    assert searched == [0, 1, 2, 0]


def test_a_weight_whose_own_group_range_overflows_is_refused_with_the_per_alpha_loop_s_error(chunking: str) -> None:
    w = np.random.default_rng(55).standard_normal((40, 128)).astype(np.float32)
    w[29, 70], w[29, 80] = np.float32(3e38), np.float32(-3e38)  # group 2 of row 29, at alpha 0
    for scale_dtype in ("float32", "bfloat16"):
        outcome = _assert_same_as_reference(w, 32, _statistics("spread", 128, 56), scale_dtype=scale_dtype)
        assert outcome[0] == "raised" and outcome[1][2] == (29, 2)


def test_refusals_of_arguments_and_statistics_are_the_per_alpha_loop_s() -> None:
    w = np.random.default_rng(57).standard_normal((16, 96)).astype(np.float32)
    h = _statistics("spread", 96, 58)
    assert _assert_same_as_reference(w, 64, h)[0] == "raised"  # 96 is not a multiple of 64
    assert _assert_same_as_reference(w, 32, h, scale_dtype="float16")[0] == "raised"
    assert _assert_same_as_reference(w, 32, h, error="exact")[0] == "raised"
    h[3, 5] = np.nan
    assert _assert_same_as_reference(w, 32, h)[1][2] == (3, 5)


@pytest.mark.parametrize("with_importance", [False, True])
@pytest.mark.parametrize("error", ["elementwise", "closed"])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_one_search_of_several_column_scalings_gives_each_its_own_search_s_bytes(
    chunking: str, with_importance: bool, error: str, scale_dtype: str, group_size: int
) -> None:
    """The search behind the activation-aware one, with and without importance: variant ``v`` of one search of
    ``w`` times ``columns`` is ``quantize_int4_groups(w * columns[v])``, byte for byte."""
    rng = np.random.default_rng(group_size)
    w = _weights("flat groups", (36, 256), group_size, group_size + 1).astype(np.float64)
    columns = np.stack([np.ones(256), rng.random(256) * 4 + 0.1, np.geomspace(1e-3, 1e3, 256)])
    importance = rng.random((3, 256)) ** 3 if with_importance else None
    rows = max(1, quantize._INT4_CHUNK // (3 * 256))
    search = quantize._Int4Search(
        w, group_size, rows, 8, importance, 2, scale_dtype == "bfloat16", closed=error == "closed", columns=columns
    )
    assert search.search_all() and not search.invalid.any()
    for variant in range(3):
        codes, scales, zeros = quantize_int4_groups(
            w * columns[variant],
            group_size,
            zero_code=8,
            importance=None if importance is None else importance[variant],
            scale_dtype=scale_dtype,
            error=error,
        )
        assert search.codes[:, variant].tobytes() == codes.tobytes()
        assert search.scales[:, variant].T.tobytes() == scales.tobytes()
        assert search.zeros[:, variant].T.tobytes() == zeros.tobytes()
