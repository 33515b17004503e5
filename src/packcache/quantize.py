"""Quantisation, torch-free: int8 per row or per block, and the int4 group search (plain and activation-aware).

What the quantising packers (:class:`packcache.packers.Int8PerChannel`, and
:mod:`packcache.packers_torch`'s int8 and int4) compute their bytes with, each function
deterministic: the same input gives the same bytes whatever the chunks or threads it runs on.

- :func:`quantize_int8_rows`: symmetric int8, one scale per output row.
- :func:`quantize_int8_blocks`: symmetric int8, one bfloat16 scale per row and block of 32 input features
  (llama.cpp's Q8_0 weights).
- :func:`quantize_int4_groups`: asymmetric 4-bit codes in groups along the input, each group's scale
  and offset found by a weighted least-squares search over clipping ranges.
- :func:`quantize_int4_activation_aware`: the same search under per-input-feature scales chosen from
  calibration statistics (AWQ-style).
- :func:`dequantize_int4` and :func:`round_bfloat16`: the values an int4 pack stands for, and the
  bfloat16 rounding a kernel reading bfloat16 scales applies.

Every function refuses a weight holding NaN or ±Inf (:class:`~packcache.errors.NonFiniteWeightError`)
rather than quantising it into finite numbers. docs/TORCH.md explains the int4 search and its figures.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ._cpus import usable_cpus
from ._finite import non_finite_index, non_finite_source, position_text, value_text
from .errors import NonFiniteWeightError

__all__ = [
    "AWQ_EXPONENTS",
    "INT8_BLOCK",
    "INT4_RANGE_STEPS",
    "INT4_RANGE_STEPS_CLOSED",
    "INT4_UNIT",
    "dequantize_int4",
    "pack_int4_rows",
    "unpack_int4_rows",
    "quantize_int4_activation_aware",
    "quantize_int4_groups",
    "dequantize_int8_blocks",
    "quantize_int8_blocks",
    "quantize_int8_rows",
    "round_bfloat16",
]


def quantize_int8_rows(w: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Round-to-nearest symmetric int8 per row of float32 ``w``: ``(int8 weight, float32 scales)``.

    Raises:
        NonFiniteWeightError: ``w`` holds NaN or ±Inf (a NaN row scale would pick the all-zero-row
            scale and turn the row into a finite channel of zeros).
    """
    amax = np.abs(w).max(axis=1) if w.shape[1] else np.zeros(w.shape[0], np.float32)
    # pinned by tests/test_packers.py::test_the_quantizers_refuse_non_finite_weights_instead_of_laundering_them
    if not np.isfinite(amax).all():  # NaN propagates through max and Inf is its own: no extra pass
        raise non_finite_source(w)
    step = amax / np.float32(127.0)
    # A row of subnormals (largest magnitude below ~1.8e-43) has a step of 0: it packs as zeros, like an
    # all-zero row, instead of dividing by zero.
    # pinned by tests/test_packers.py::test_rows_and_groups_of_subnormal_weights_pack_to_nearly_zero_without_warnings
    scales = np.where(step > 0, step, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


#: Input features per scale of :func:`quantize_int8_blocks`.
INT8_BLOCK = 32


def quantize_int8_blocks(w: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Round-to-nearest symmetric int8 of float32 ``w [out, in]`` in blocks of :data:`INT8_BLOCK` input features
    (the last block of a row may be shorter): ``(int8 codes [out, in], bfloat16 scales as uint16 bits
    [out, ceil(in / 32)])``.

    A block's scale is its largest magnitude over 127, rounded to bfloat16 (nearest, ties to even), and its codes
    are rounded against that stored scale and clipped to ±127: the weight the file stands for is exactly
    code * scale, what every kernel computes with, and the clip (the scale rounded down by at most 2^-9) moves the
    largest weight by at most a quarter step. An all-zero block (or one of subnormals whose step rounds to 0) gets
    scale 0 and codes 0.

    Raises:
        NonFiniteWeightError: ``w`` holds NaN or ±Inf.

    >>> codes, scales = quantize_int8_blocks(np.array([[1.0] * 32 + [0.5, -0.25]], np.float32))
    >>> codes[0, [0, 32, 33]].tolist(), scales.shape
    ([127, 127, -64], (1, 2))
    """
    rows, cols = w.shape
    blocks = -(-cols // INT8_BLOCK)
    padded = np.zeros((rows, blocks * INT8_BLOCK), np.float32)
    padded[:, :cols] = w
    amax = np.abs(padded.reshape(rows, blocks, INT8_BLOCK)).max(axis=2) if cols else np.zeros((rows, 0), np.float32)
    if not np.isfinite(amax).all():
        raise non_finite_source(w)
    # the step to the nearest bfloat16 (finite and below 2.7e36: never an Inf), its bits what the file stores
    stored = round_bfloat16(amax / np.float32(127.0))
    scales = (stored.view(np.uint32) >> 16).astype(np.uint16)
    inverse = np.divide(np.float32(1.0), stored, out=np.zeros_like(stored), where=stored > 0)
    codes = np.rint(padded.reshape(rows, blocks, INT8_BLOCK) * inverse[..., None])
    q = np.clip(codes, -127, 127).astype(np.int8).reshape(rows, blocks * INT8_BLOCK)[:, :cols]
    return np.ascontiguousarray(q), scales


def dequantize_int8_blocks(codes: np.ndarray[Any, Any], scales: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The float32 weight ``[out, in]`` of :func:`quantize_int8_blocks`' ``(codes, scales)``: code * scale.

    >>> dequantize_int8_blocks(*quantize_int8_blocks(np.array([[0.5, -1.0]], np.float32))).tolist()
    [[0.50390625, -0.99993896484375]]
    """
    cols = codes.shape[1]
    stored = (scales.astype(np.uint32) << 16).view(np.float32)
    per_feature = np.repeat(stored, INT8_BLOCK, axis=1)[:, :cols]
    result: np.ndarray[Any, Any] = codes.astype(np.float32) * per_feature
    return result


#: Candidate code ranges tried per group by :func:`quantize_int4_groups`, as a
#: fraction of the group's min-max span: 1.0 is plain min/max round-to-nearest.
INT4_RANGE_STEPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
#: The coarser candidates of ``error="closed"`` (what ``torch.int4wo`` packs with): half the passes; the
#: refinements that follow re-fit the scale and offset freely, so the final fit does not depend on a fine grid.
INT4_RANGE_STEPS_CLOSED = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)

#: Exponents tried by :func:`quantize_int4_activation_aware` for the per-input-channel scale.
AWQ_EXPONENTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def round_bfloat16(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``a`` (made float32 first) rounded to the nearest bfloat16 value, ties to even, as a float32 array.

    What ``torch.Tensor.to(torch.bfloat16)`` computes, without torch: the low 16 bits of each float32
    are rounded away. NaN stays NaN (quiet, same sign); ±Inf stays; a finite value beyond bfloat16's
    largest finite value (~3.39e38) becomes ±Inf, which a caller that needs finite values must refuse.

    >>> round_bfloat16(np.array([1.0, 1.00390625, 1.01171875, -3.4e38, np.nan], np.float32)).tolist()
    [1.0, 1.0, 1.015625, -inf, nan]
    """
    bits = np.array(a, dtype=np.float32, order="C", copy=True).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit, then truncating, rounds half to even; a carry into the
    # exponent is the right answer (up to the next binade, or Inf). NaN's payload could carry too: kept apart.
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    result: np.ndarray[Any, Any] = np.where(nan, (bits & np.uint32(0x80000000)) | np.uint32(0x7FC00000), rounded)
    return result.astype(np.uint32).view(np.float32)


#: Scale and zero dtypes :func:`quantize_int4_groups` rounds to: what the kernel that reads them holds.
_SCALE_DTYPES = ("float32", "bfloat16")

#: Elements of ``w`` one task of :func:`quantize_int4_groups` searches at a time: its three float32
#: working arrays (1.5 MiB) stay in one core's L2 cache (~2 MiB) through the 13 candidate passes,
#: instead of each pass streaming the whole weight through memory (measured: ``benchmarks/pack.py``).
_INT4_CHUNK = 1 << 17


def quantize_int4_groups(
    w: np.ndarray[Any, Any],
    group_size: int,
    *,
    zero_code: int = 0,
    importance: np.ndarray[Any, Any] | None = None,
    refine: int = 2,
    scale_dtype: str = "float32",
    error: str = "elementwise",
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Asymmetric 4-bit quantization of ``w [out, in]`` in groups of ``group_size`` along ``in``.

    Each group of ``g`` values ``x`` gets codes ``q`` in 0..15, a scale ``s`` and an
    offset ``m`` with ``x ~ q*s + m``, chosen to minimise the weighted squared error
    ``sum_j d_j (q_j s + m - x_j)^2`` (``d = importance`` per input feature, default 1):

    1. for each candidate range ``r`` in :data:`INT4_RANGE_STEPS` (1.0, 0.95, ..., 0.5
       of the group's min-max span, centred on it), round ``x`` to codes of step
       ``span * r / 15`` -- a narrower range clips outliers but refines the other levels;
    2. for those codes, solve the weighted 2x2 least-squares problem for the best ``(s, m)``;
    3. keep the candidate with the least error; then ``refine`` times re-round with the
       fitted ``(s, m)`` and re-fit, keeping the result only if the error drops.

    Deterministic, and never worse than plain round-to-nearest (the ``r = 1.0`` candidate).
    A non-finite ``w`` is refused, and so is a group whose range overflows float32 (its scale
    or offset would be Inf). The rows are searched in chunks that stay in a core's cache, on one
    thread per usable CPU; the result does not depend on the chunks or the threads.

    Returns ``(codes uint8 [out, in], scales float32 [in/g, out], zeros float32
    [in/g, out])`` with ``x ~ (q - zero_code) * scale + zero``: ``zero_code=8`` is
    the convention of ``torch.int4wo`` (torch's int4 CPU kernel's, which its versions 1 and 2 used). The final codes
    are rounded against
    the scale and zero actually stored: with ``scale_dtype="bfloat16"`` those are the search's
    float32 values rounded to bfloat16 (:func:`round_bfloat16`), still returned as float32 arrays,
    for a kernel that reads bfloat16 scales and zeros.

    ``error`` is how candidates are made and judged: ``"elementwise"`` sums ``d (q s + m - x)^2`` over
    the group in float32, for each range of :data:`INT4_RANGE_STEPS`; ``"closed"`` takes it in float64
    from the sums the fit already has (``s^2 S_qq + 2 s m S_q - 2 s S_qx + m^2 S_d - 2 m S_dx + S_dxx``),
    for the ranges of :data:`INT4_RANGE_STEPS_CLOSED`: about half the passes over the weight, for a
    weighted error within a fraction of a percent (``tests/test_packers_int4.py``). Their bytes differ.

    Raises:
        NonFiniteWeightError: ``w`` holds NaN or ±Inf (or float64 beyond float32's range), or a
            group's range overflows float32 (or, rounded, bfloat16) (``index`` is then ``(row, group)``).
        ValueError: ``in`` is not a multiple of ``group_size``, ``scale_dtype`` is neither ``"float32"``
            nor ``"bfloat16"``, or ``error`` neither ``"elementwise"`` nor ``"closed"``.

    >>> codes, scales, zeros = quantize_int4_groups(np.linspace(-1, 1, 32, dtype=np.float32)[None], 32)
    >>> codes.shape, scales.shape, int(codes.min()), int(codes.max())
    ((1, 32), (1, 1), 0, 15)
    """
    out_features, in_features = w.shape
    _check_int4_arguments(in_features, group_size, scale_dtype, error)
    groups = in_features // group_size
    rows = max(1, min(out_features, _INT4_CHUNK // max(in_features, 1)))
    search = _Int4Search(
        w, group_size, rows, zero_code, importance, refine, scale_dtype == "bfloat16", closed=error == "closed"
    )
    if not search.search_all():  # NaN and Inf reach a chunk's min/max: no extra pass
        with np.errstate(over="ignore"):  # float64 beyond float32's range becomes Inf: what is refused
            x = np.asarray(w, dtype=np.float32)
        raise non_finite_source(x.reshape(out_features, in_features), original=np.asarray(w))
    scales, zeros = search.scales, search.zeros
    if not (np.isfinite(scales).all() and np.isfinite(zeros).all()):
        row, group = (int(i) for i in np.argwhere(~(np.isfinite(scales) & np.isfinite(zeros)))[0])
        first = group * group_size
        with np.errstate(over="ignore"):
            values = np.asarray(w[row, first : first + group_size], dtype=np.float32)
        raise NonFiniteWeightError(
            f"holds values at row {row}, group {group} (columns {first}-{first + group_size - 1}) whose range "
            f"({float(values.min()):.6g} to {float(values.max()):.6g}) overflows {scale_dtype}: "
            "int4 cannot hold them",
            index=(row, group),
        )
    assert scales.shape == (out_features, groups)
    return search.codes, np.ascontiguousarray(scales.T), np.ascontiguousarray(zeros.T)


def _check_int4_arguments(in_features: int, group_size: int, scale_dtype: str, error: str) -> None:
    """Refuse what :func:`quantize_int4_groups` cannot search (one check, shared with the activation-aware search)."""
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {_SCALE_DTYPES}, got {scale_dtype!r}")
    if error not in ("elementwise", "closed"):
        raise ValueError(f"error must be 'elementwise' or 'closed', got {error!r}")


class _Int4Search:
    """The search of :func:`quantize_int4_groups`, one chunk of rows per :meth:`run`.

    A chunk is held transposed, ``X [g, chunk rows * groups]``: row ``j`` is the ``j``-th value of
    every group, so each per-group quantity is a contiguous vector and each operation one long
    vectorised loop. Every sum over a group that is not exact is taken in the order numpy's
    ``sum(axis=-1)`` takes it (:func:`_group_sum`), and every element's arithmetic is the same
    float32 operation, so the result is bit-identical to the plain whole-array formulas
    (``tests/test_packers_int4.py`` keeps them and compares).

    ``columns`` (float64 ``[variants, in]``) searches every row of ``w`` times each variant's column
    scales at once, each variant with its own ``importance`` row (``[variants, in]``): the candidate
    weights of :func:`quantize_int4_activation_aware`, one per ``alpha``. A chunk then holds its rows
    for every variant, ``X [g, chunk rows * variants * groups]``; nothing in the search mixes two
    groups, so each variant's bytes are what a search of ``w * columns[v]`` alone gives, in one pass
    of numpy calls instead of one per variant (the calls, not the arithmetic, are the cost of a small
    weight such as the fingerprint's). ``codes``, ``scales`` and ``zeros`` are then ``[out, variants,
    ...]``. A chunk whose variants all hold NaN or ±Inf refuses the search (a non-finite weight); one
    that only some variants overflow lands in :attr:`invalid` (those variants' results mean nothing)
    and the search goes on.
    """

    def __init__(
        self,
        w: np.ndarray[Any, Any],
        group_size: int,
        rows: int,
        zero_code: int,
        importance: np.ndarray[Any, Any] | None,
        refine: int,
        bfloat16: bool,
        *,
        closed: bool = False,
        columns: np.ndarray[Any, Any] | None = None,
    ) -> None:
        out_features, in_features = w.shape
        self.closed = closed
        self.w, self.g, self.rows, self.zero_code, self.refine, self.bfloat16 = (
            w,
            group_size,
            rows,
            zero_code,
            refine,
            bfloat16,
        )
        self.columns = columns
        self.variants = 1 if columns is None else int(columns.shape[0])
        self.groups = in_features // group_size
        per_row = () if columns is None else (self.variants,)
        self.codes = np.empty((out_features, *per_row, in_features), np.uint8)
        self.scales = np.empty((out_features, *per_row, self.groups), np.float32)
        self.zeros = np.empty((out_features, *per_row, self.groups), np.float32)
        self.refused = False
        #: Per chunk that held NaN or ±Inf in some variant, which variants did ([variants] bools); appended
        #: from the pool's threads (list.append is atomic).
        self.non_finite: list[np.ndarray[Any, Any]] = []
        self.d: np.ndarray[Any, Any] | None = None
        # With unit importance d * v is v exactly, so those products are skipped; sum(d) is g exactly.
        self.sum_d: Any = np.float32(group_size)
        if importance is not None:
            weights = [
                _group_weights(row, self.groups, group_size)
                for row in np.reshape(importance, (self.variants, in_features))
            ]
            d = np.concatenate(weights)  # [variants * groups, g]: one row's groups, variant by variant
            self.d = np.ascontiguousarray(np.tile(d.T, (1, rows)))  # [g, rows * variants * groups], like X
            self.sum_d = np.tile(np.concatenate([v.sum(axis=1) for v in weights]), rows)

    @property
    def invalid(self) -> np.ndarray[Any, Any]:
        """Per variant, whether a chunk held NaN or ±Inf in it (its codes, scales and zeros mean nothing)."""
        held: np.ndarray[Any, Any] = np.logical_or.reduce([np.zeros(self.variants, bool), *self.non_finite])
        return held

    def search_all(self) -> bool:
        """Search every chunk, on one thread per usable CPU; ``False`` if the search was refused (:meth:`run`)."""
        out_features = self.w.shape[0]
        starts = range(0, out_features, self.rows)
        workers = min(usable_cpus(), len(starts))
        if workers > 1:
            # numpy releases the GIL inside its loops: the chunks run in parallel on the threads.
            with ThreadPoolExecutor(workers, thread_name_prefix="packcache-int4") as pool:
                return all(pool.map(self.run, starts))
        return all([self.run(start) for start in starts])

    def run(self, start: int) -> bool:
        """Search rows ``start`` to ``start + rows``; ``False`` if they hold NaN or ±Inf in every variant
        (nothing written), or if an earlier chunk did (the weight is refused: the rest is not searched)."""
        if self.refused:
            return False
        # Thread-local: numpy's error state is not inherited by the pool's threads. A range beyond
        # float32 is refused by the caller; a range of subnormals (a step of 0) ends as finite codes.
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            searched = self._run(start)
        self.refused = self.refused or not searched
        return searched

    def _chunk(self, start: int) -> np.ndarray[Any, Any]:
        """Rows ``start`` to ``start + rows`` as float32 ``[rows, in]`` (with ``columns``: ``[rows, variants, in]``)."""
        rows = self.w[start : start + self.rows]
        if self.columns is None:
            return np.asarray(rows, dtype=np.float32)
        # The product in float64, then rounded to float32: what a search of ``w * columns[v]`` reads.
        scaled: np.ndarray[Any, Any] = (np.asarray(rows, dtype=np.float64)[:, None, :] * self.columns).astype(
            np.float32
        )
        return scaled

    def _run(self, start: int) -> bool:
        g, zero_code = self.g, self.zero_code
        chunk = self._chunk(start)
        rows = chunk.shape[0]
        size = rows * self.variants * self.groups
        by_group = chunk.reshape(size, g)
        x = np.ascontiguousarray(by_group.T)  # [g, size]
        lo, hi = x.min(axis=0), x.max(axis=0)
        finite = np.isfinite(lo) & np.isfinite(hi)
        if not finite.all():
            held = ~finite.reshape(rows, self.variants, self.groups).all(axis=(0, 2))
            self.non_finite.append(held)
            if held.all():
                return False
            # Some variants' groups only: no group's search reads another's, so the other variants' stay exact.
        # min/max of a group holding both -0.0 and +0.0 may give either; the stored zero of an all-zero
        # group is its min: take such groups' min/max exactly as numpy takes them over a row.
        zeroish = np.flatnonzero((lo == 0) | (hi == 0))
        if zeroish.size:
            lo[zeroish], hi[zeroish] = by_group[zeroish].min(axis=1), by_group[zeroish].max(axis=1)
        d = None if self.d is None else self.d[:, :size]
        sum_d = self.sum_d if d is None else self.sum_d[:size]
        span = hi - lo
        flat = span <= 0
        safe_span = np.where(flat, 1.0, span)
        centre = (hi + lo) / 2
        codes, product, weighted = np.empty_like(x), np.empty_like(x), None if d is None else np.empty_like(x)
        scratch = np.empty((14, size), np.float32)
        sum_dx = _group_sum(x if d is None else np.multiply(d, x, out=product), scratch)
        best_err = np.full(size, np.inf, np.float64 if self.closed else np.float32)
        best_s, best_m = safe_span / np.float32(15.0), lo.copy()
        sum_dxx: np.ndarray[Any, Any] | None = None
        if self.closed:  # the one sum the closed-form error needs besides the fit's: S_dxx, once per chunk
            squares = np.multiply(x, x, out=codes)
            sum_dxx = _group_sum(squares if d is None else np.multiply(d, squares, out=product), scratch)
            sum_dxx = sum_dxx.astype(np.float64)
        integral = 225 * g < 1 << 24  # a group's sum of codes squared is an exact float32 integer

        def consider() -> None:
            nonlocal best_err, best_s, best_m
            if d is None or weighted is None:
                if integral:  # sums of integers below 2**24: exact in any order, so numpy's fastest ones
                    sum_q, sum_qq = np.add.reduce(codes, axis=0), np.einsum("ij,ij->j", codes, codes)
                else:
                    sum_q = _group_sum(codes, scratch)
                    sum_qq = _group_sum(np.multiply(codes, codes, out=product), scratch)
                sum_qx = _group_sum(np.multiply(codes, x, out=product), scratch)
            else:
                dq = np.multiply(d, codes, out=weighted)
                sum_q = _group_sum(dq, scratch)
                sum_qq = _group_sum(np.multiply(dq, codes, out=product), scratch)
                sum_qx = _group_sum(np.multiply(dq, x, out=product), scratch)
            det = sum_d * sum_qq - sum_q * sum_q
            ok = det > np.float32(1e-20)
            safe = np.where(ok, det, 1.0)
            s = np.where(ok, (sum_d * sum_qx - sum_q * sum_dx) / safe, best_s)
            m = np.where(ok, (sum_qq * sum_dx - sum_q * sum_qx) / safe, best_m)
            if sum_dxx is not None:
                s64, m64 = s.astype(np.float64), m.astype(np.float64)
                err = s64 * (s64 * sum_qq + 2 * m64 * sum_q - 2 * sum_qx) + m64 * (m64 * sum_d - 2 * sum_dx) + sum_dxx
                better = (err < best_err) & (s > 0)
                best_err = np.where(better, err, best_err)
                best_s, best_m = np.where(better, s, best_s), np.where(better, m, best_m)
                return
            diff = np.multiply(codes, s, out=product)
            np.add(diff, m, out=diff)
            np.subtract(diff, x, out=diff)
            if d is None or weighted is None:
                err = _group_sum(np.multiply(diff, diff, out=diff), scratch)
            else:
                err = _group_sum(np.multiply(np.multiply(d, diff, out=weighted), diff, out=weighted), scratch)
            better = (err < best_err) & (s > 0)
            best_err = np.where(better, err, best_err)
            best_s, best_m = np.where(better, s, best_s), np.where(better, m, best_m)

        def round_codes(offset: np.ndarray[Any, Any], step: np.ndarray[Any, Any]) -> None:
            np.subtract(x, offset, out=codes)
            np.divide(codes, step, out=codes)
            np.rint(codes, out=codes)
            np.clip(codes, 0, 15, out=codes)

        for ratio in INT4_RANGE_STEPS_CLOSED if self.closed else INT4_RANGE_STEPS:
            round_codes(centre - safe_span * np.float32(ratio / 2), safe_span * np.float32(ratio / 15.0))
            consider()
        for _ in range(self.refine):
            round_codes(best_m, best_s)
            consider()
        scales = np.where(flat, 0.0, best_s).astype(np.float32)
        zeros = np.where(flat, lo, best_m.astype(np.float64) + zero_code * best_s.astype(np.float64)).astype(np.float32)
        if self.bfloat16:
            scales, zeros = round_bfloat16(scales), round_bfloat16(zeros)
        # Final codes against the scale and zero the kernel will actually use, in float64: they decide the bytes.
        s64 = scales.astype(np.float64)
        m64 = zeros.astype(np.float64) - zero_code * s64
        exact = x.astype(np.float64)
        np.subtract(exact, m64, out=exact)
        np.divide(exact, np.where(flat, 1.0, s64), out=exact)
        np.clip(np.rint(exact, out=exact), 0, 15, out=exact)
        # Only a flat group, or one whose scale is 0 (subnormal values) or not finite, can have a code that is
        # not finite here (a scale that overflowed gives NaN: the caller refuses it, it is never cast).
        special = np.flatnonzero(flat | (s64 == 0) | ~np.isfinite(s64) | ~np.isfinite(m64))
        if special.size:
            held = exact[:, special]
            exact[:, special] = np.where(flat[special] | ~np.isfinite(held), zero_code, held)
        final = exact.astype(np.uint8)
        self.codes[start : start + rows].reshape(size, g)[...] = final.T
        self.scales[start : start + rows] = scales.reshape(rows, *self.scales.shape[1:])
        self.zeros[start : start + rows] = zeros.reshape(rows, *self.zeros.shape[1:])
        return True


def _group_weights(importance: np.ndarray[Any, Any], groups: int, group_size: int) -> np.ndarray[Any, Any]:
    """The float32 weights ``d [groups, g]`` the search gives each value of a row from one ``importance [in]``."""
    raw = np.asarray(importance, dtype=np.float64)
    raw = np.where(raw > 0, raw, 0.0)
    peak = raw.max() if raw.size and raw.max() > 0 else 1.0
    # Normalised to a peak of 1; a feature never seen still counts a little.
    d: np.ndarray[Any, Any] = (raw / peak + 1e-6).astype(np.float32).reshape(groups, group_size)
    return d


def _group_sum(values: np.ndarray[Any, Any], scratch: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Sum ``values [n, size]`` over axis 0 in exactly the order numpy sums a contiguous row of ``n`` float32.

    numpy's float ``add.reduce`` (``pairwise_sum`` in ``loops_utils.h.src``): fewer than 8 values one by
    one; up to 128 in 8 interleaved partial sums combined as ((0+1)+(2+3))+((4+5)+(6+7)), then the rest
    one by one; more split in two halves (the first a multiple of 8). The reduction starts from +0.0.
    ``scratch`` holds at least ``[14, size]`` floats.
    """
    result: np.ndarray[Any, Any] = np.add(_pairwise(values, scratch), np.float32(0.0))
    return result


def _pairwise(values: np.ndarray[Any, Any], scratch: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    n = values.shape[0]
    total: np.ndarray[Any, Any]
    if n < 8:
        total = np.zeros(values.shape[1], values.dtype)
        for i in range(n):
            np.add(total, values[i], out=total)
        return total
    if n <= 128:
        partial = scratch[:8]
        if n >= 16:
            np.add(values[0:8], values[8:16], out=partial)
        else:
            np.copyto(partial, values[0:8])
        i = 16 if n >= 16 else 8
        while i < n - n % 8:
            np.add(partial, values[i : i + 8], out=partial)
            i += 8
        quads, pairs = scratch[8:12], scratch[12:14]
        np.add(partial[0::2], partial[1::2], out=quads)
        np.add(quads[0::2], quads[1::2], out=pairs)
        total = pairs[0] + pairs[1]
        for j in range(i, n):
            np.add(total, values[j], out=total)
        return total
    half = n // 2
    half -= half % 8
    first = _pairwise(values[:half], scratch)
    np.add(first, _pairwise(values[half:], scratch), out=first)
    return first


def dequantize_int4(
    codes: np.ndarray[Any, Any], scales: np.ndarray[Any, Any], zeros: np.ndarray[Any, Any], zero_code: int = 0
) -> np.ndarray[Any, Any]:
    """The float64 ``[out, in]`` weight that :func:`quantize_int4_groups`'s output stands for:
    ``(code - zero_code) * scale + zero``, each operation in float64.

    One float64 array, computed in place, with each group's scale and zero broadcast over its codes
    (two fewer passes and ``[out, in]`` float64 temporaries than repeating them; the same values).

    >>> dequantize_int4(np.array([[0, 15]], np.uint8), np.array([[0.5]], np.float32), np.array([[-1.0]], np.float32))
    array([[-1. ,  6.5]])
    """
    out_features, in_features = codes.shape
    groups = scales.shape[0]
    weight: np.ndarray[Any, Any] = codes.reshape(out_features, groups, in_features // groups).astype(np.float64)
    weight -= zero_code
    weight *= scales.T.astype(np.float64)[:, :, None]
    weight += zeros.T.astype(np.float64)[:, :, None]
    return weight.reshape(out_features, in_features)


#: Input features per unit of packcache's row-major int4 layout (:func:`pack_int4_rows`).
INT4_UNIT = 64


def pack_int4_rows(codes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """int4 ``codes [out, in]`` (0..15, ``in`` a multiple of 32) as packcache's row-major bytes ``[out, in / 2]``.

    Each row in units of :data:`INT4_UNIT` (64) input features, 32 bytes each: byte ``j`` of a unit holds feature
    ``j`` in its low nibble and feature ``j + 32`` in its high nibble. Where ``in % 64 == 32`` the row ends in a unit
    of 32 features (16 bytes) laid out alike: features ``j`` and ``j + 16``. A unit's low nibbles are its first 32
    codes in order and its high nibbles the next 32, so the compiled product unpacks a block of 32 codes with two
    instructions.

    Raises:
        ValueError: a code outside 0..15, or ``in`` not a multiple of 32.

    >>> pack_int4_rows(np.arange(32, dtype=np.uint8)[None, :] % 16)[0, :3].tolist()
    [0, 17, 34]
    """
    out_features, in_features = codes.shape
    if in_features % 32:
        raise ValueError(f"int4 rows pack 32 input features at a time; got {in_features}")
    if codes.size and int(codes.max()) > 15:
        raise ValueError(f"int4 codes are 0..15; got {int(codes.max())}")
    codes = codes.astype(np.uint8, copy=False)
    packed = np.empty((out_features, in_features // 2), np.uint8)
    body = in_features // INT4_UNIT * INT4_UNIT
    units = codes[:, :body].reshape(out_features, -1, 2, INT4_UNIT // 2)
    packed[:, : body // 2] = (units[:, :, 0] | (units[:, :, 1] << 4)).reshape(out_features, -1)
    if body < in_features:  # the last 32 features: a unit of half the size
        tail = codes[:, body:]
        packed[:, body // 2 :] = tail[:, :16] | (tail[:, 16:] << 4)
    return packed


def unpack_int4_rows(packed: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The codes ``[out, in]`` (uint8, 0..15) of :func:`pack_int4_rows`'s bytes ``[out, in / 2]``.

    >>> codes = np.arange(96 * 2, dtype=np.uint8).reshape(2, 96) % 16
    >>> bool((unpack_int4_rows(pack_int4_rows(codes)) == codes).all())
    True
    """
    out_features, half = packed.shape
    in_features = 2 * half
    if in_features % 32:
        raise ValueError(f"int4 rows pack 32 input features at a time; got {in_features}")
    codes = np.empty((out_features, in_features), np.uint8)
    body = in_features // INT4_UNIT * INT4_UNIT
    units = packed[:, : body // 2].reshape(out_features, -1, INT4_UNIT // 2)
    view = codes[:, :body].reshape(out_features, -1, 2, INT4_UNIT // 2)
    view[:, :, 0] = units & 15
    view[:, :, 1] = units >> 4
    if body < in_features:
        tail = packed[:, body // 2 :]
        codes[:, body : body + 16] = tail & 15
        codes[:, body + 16 :] = tail >> 4
    return codes


def quantize_int4_activation_aware(
    w: np.ndarray[Any, Any],
    group_size: int,
    second_moment: np.ndarray[Any, Any],
    *,
    zero_code: int = 0,
    scale_dtype: str = "float32",
    error: str = "elementwise",
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Int4 of ``w [out, in]`` with a per-input-feature scale chosen from input statistics (AWQ-style).

    ``second_moment`` is ``E[x x^T]`` of the layer's input ``[in, in]``, measured on a
    few calibration texts. With ``a_j = sqrt(E[x_j^2])`` normalised to geometric mean 1,
    for each exponent ``alpha`` in :data:`AWQ_EXPONENTS` the weight's columns are scaled by
    ``c = a^alpha``, quantized by :func:`quantize_int4_groups` with importance ``E[x_j^2] / c_j^2``
    and scaled back; the ``alpha`` whose weight error ``D`` gives the least expected output
    error ``sum_rows D E[x x^T] D^T`` wins (``alpha = 0`` is the plain search, so it is never worse
    on the calibration statistics). Features that matter get finer steps.

    The alphas are searched together, one pass of the search over the weight's rows scaled every
    way (chunk by chunk, so the float64 product ``w * c`` is never whole), with the bytes one
    :func:`quantize_int4_groups` per alpha gives (``tests/test_packers_int4.py`` keeps that loop and
    compares): a small weight costs a fifth of the numpy calls, which are most of its cost.

    Returns ``(codes, scales, zeros, input_scales)``: the layer computes
    ``(x * input_scales) @ dequant(codes, scales, zeros)^T``; ``input_scales = 1 / c`` (float32 ``[in]``).
    ``scale_dtype`` and ``error`` are passed to :func:`quantize_int4_groups`: each ``alpha`` is judged
    with the scales and zeros it would store.

    Raises:
        NonFiniteWeightError: ``w`` holds NaN or ±Inf, or a group's range overflows float32 (as
            :func:`quantize_int4_groups` with ``alpha = 0``; an ``alpha`` whose column scales push a
            group beyond float32 is only left out of the search), or ``second_moment`` holds NaN or
            ±Inf (the float model computes them on the calibration texts).
        ValueError: as :func:`quantize_int4_groups` (a group size or ``scale_dtype`` it refuses).
    """
    h = np.asarray(second_moment, dtype=np.float64)
    bad = non_finite_index(h)
    if bad is not None:
        raise NonFiniteWeightError(
            f"has non-finite calibration statistics: E[x x^T] of the layer's input holds {value_text(float(h[bad]))} "
            f"at {position_text(bad)}, so the float model computes NaN or Inf on the calibration texts",
            index=bad,
        )
    energy = np.clip(np.diag(h), 0.0, None)
    rms = np.sqrt(energy)
    positive = rms > 0
    base = np.where(positive, rms, 1.0)
    base = base / np.exp(np.log(base[positive]).mean()) if positive.any() else base
    w64 = np.asarray(w, dtype=np.float64)
    out_features, in_features = w64.shape
    _check_int4_arguments(in_features, group_size, scale_dtype, error)
    # One float32 input scale per alpha, and the column scale it really undoes, each as the per-alpha loop had them.
    inverses = [(1.0 / base**alpha).astype(np.float32) for alpha in AWQ_EXPONENTS]
    columns = np.stack([1.0 / inv.astype(np.float64) for inv in inverses])
    importance = energy / (columns * columns)
    # Every alpha in one search (its own columns and importance per variant), in chunks of rows sized
    # for all of them together: the same bytes per alpha as one search each, in a fifth of the calls.
    rows = max(1, min(out_features, _INT4_CHUNK // max(len(AWQ_EXPONENTS) * in_features, 1)))
    search = _Int4Search(
        w64,
        group_size,
        rows,
        zero_code,
        importance,
        2,
        scale_dtype == "bfloat16",
        closed=error == "closed",
        columns=columns,
    )
    search.search_all()  # refused (every alpha holds NaN or ±Inf) or not, alpha 0 decides below
    invalid = search.invalid
    best: tuple[float, int] | None = None
    for variant, alpha in enumerate(AWQ_EXPONENTS):
        codes, scales, zeros = search.codes[:, variant], search.scales[:, variant].T, search.zeros[:, variant].T
        if invalid[variant] or not (np.isfinite(scales).all() and np.isfinite(zeros).all()):
            if alpha == 0.0:  # the weight itself: refused, with the plain search's own message
                quantize_int4_groups(
                    w64 * columns[variant],
                    group_size,
                    zero_code=zero_code,
                    importance=importance[variant],
                    scale_dtype=scale_dtype,
                    error=error,
                )
                raise AssertionError("the search refused alpha 0, but the plain search of the weight did not")
            continue  # only this alpha's column scales push a group beyond float32 (or bfloat16)
        # The weight error D and sum(D H * D), the per-alpha loop's operations, in place: the same values.
        delta = dequantize_int4(codes, scales, zeros, zero_code=zero_code)
        delta /= columns[variant]
        delta -= w64
        with np.errstate(over="ignore", invalid="ignore"):  # a huge error is Inf: it loses, never raises
            product = delta @ h
            product *= delta
            err = float(np.sum(product))
        if best is None or err < best[0]:
            best = (err, variant)
    assert best is not None
    chosen = best[1]
    return (
        np.ascontiguousarray(search.codes[:, chosen]),
        np.ascontiguousarray(search.scales[:, chosen].T),
        np.ascontiguousarray(search.zeros[:, chosen].T),
        inverses[chosen],
    )
