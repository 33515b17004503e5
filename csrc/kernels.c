/* packcache's streaming CPU kernels: few-row products over packed weights, read in place.
 *
 * Plain C, no Python API and no torch: packcache.native loads this shared object with ctypes
 * and passes it pointers into torch tensors (the packed operands are views of the cache
 * mapping, so the weights are read where the file's pages are: nothing is copied or repacked).
 *
 * Operations (y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and y float32, row-major):
 *   pc_int8  W int8 [N, K] with a bfloat16 scale per row and block of 32 input features (packcache's torch.int8wo
 *            layout: llama.cpp's Q8_0 weights). x is quantised per row in blocks of 4 input features to int8
 *            (symmetric, round to nearest, a float32 scale per block: one per int32 lane of the dot product), and
 *            the int8 dot products run on AVX2 (vpmaddubsw + vpmaddwd) at every row count, on both ISA levels.
 *   pc_bf16  W bfloat16 [N, K] (packcache's torch.linear.bf16 layout). x is rounded to bfloat16
 *            (round to nearest even, as torch does), products accumulate in float32: vdpbf16ps on
 *            AVX512-BF16, widening + FMA on AVX2.
 *
 * Dispatch: pc_isa() reports what this CPU runs (2: AVX512F/BW/VL + VNNI + BF16, 1: AVX2 + FMA + F16C,
 * 0: neither, then nothing here may be called). Each call names the ISA to use (at most pc_isa()):
 * the caller may force the AVX2 code on an AVX512 CPU. Code for each ISA is compiled with its own
 * target attribute, so the library builds with the compiler's default flags and runs anywhere.
 *
 * Threads: a call splits the output rows between pc_set_threads(n) OpenMP threads: torch's own
 * (see "threads" below).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PC_API __attribute__((visibility("default")))
#define QBLOCK 32
#define MAX_THREADS 64
#define MAX_ROWS 64
/* Bytes ahead of the weight stream a product prefetches: the hardware prefetchers stop at 4 KiB pages, and a
 * mapped file's pages are 4 KiB, so each page would otherwise start with demand misses. Prefetches never fault,
 * so running past the end of the weight is harmless. */
#define PREFETCH 2048

/* ------------------------------------------------------------------ ISA detection */

PC_API int pc_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512bf16"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return 1;
    return 0;
}

PC_API int pc_abi_version(void) { return 4; }

/* ------------------------------------------------------------------ activation quantisation (scalar) */

/* One row of x [K] to int8 codes q [K] and, per 4-feature lane, the block's scale (lane_scale [K/4]): the int4
 * product's activations.
 * Per block of 32: scale = amax / 127, codes = round half to even (the default MXCSR mode, as lrintf) of
 * x / scale, clipped to +-127. AVX2 (every CPU the kernels run on has it). */
__attribute__((target("avx2,fma,f16c")))
static void quantize_row(const float *x, int K, int8_t *q, float *lane_scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < K; b += QBLOCK) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + b + 8 * i);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float scale = _mm_cvtss_f32(h) / 127.0f;
        const __m256 inv = _mm256_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
        __m256i c[4];
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), top), bottom);
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + b), _mm256_permutevar8x32_epi32(packed, order));
        for (int l = b / 4; l < (b + QBLOCK) / 4; l++) lane_scale[l] = scale;
    }
}

/* One row of x [K] (K a multiple of 32) to int8 codes q [K] and lane_scale [K/4]: per block of 4 features (one
 * int32 lane of the int8 dot product), scale = amax / 127 and codes = round half to even (the default MXCSR mode)
 * of x * (1 / scale), clipped to +-127 (an all-zero block: scale 0, codes 0). */
__attribute__((target("avx2,fma,f16c")))
static void quantize_row4(const float *x, int K, int8_t *q, float *lane_scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 top127 = _mm256_set1_ps(127.0f);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < K; b += QBLOCK) {
        __m256i c[4];
        for (int i = 0; i < 4; i++) {
            const __m256 v = _mm256_loadu_ps(x + b + 8 * i);
            __m256 m = _mm256_andnot_ps(sign, v);
            m = _mm256_max_ps(m, _mm256_permute_ps(m, 0xb1)); /* max of neighbours */
            m = _mm256_max_ps(m, _mm256_permute_ps(m, 0x4e)); /* then of pairs: each 4-block's amax, 4 times */
            const __m256 scale = _mm256_div_ps(m, top127);
            const __m256 positive = _mm256_cmp_ps(scale, zero, _CMP_GT_OQ);
            const __m256 inv = _mm256_and_ps(positive, _mm256_div_ps(one, _mm256_blendv_ps(one, scale, positive)));
            c[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, inv)), top), bottom);
            float lanes[8];
            _mm256_storeu_ps(lanes, scale);
            lane_scale[(b + 8 * i) / 4] = lanes[0];
            lane_scale[(b + 8 * i) / 4 + 1] = lanes[4];
        }
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + b), _mm256_permutevar8x32_epi32(packed, order));
    }
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                         /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* y[i] = v in the output's dtype (0: float32, 1: bfloat16). */
static inline void store(void *y, size_t i, float v, int ydtype) {
    if (ydtype)
        ((uint16_t *)y)[i] = to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* A bfloat16's bits as the float32 they are (exact). */
static inline float bf16_float(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_x(const void *x, size_t i, int xdtype) {
    return xdtype ? bf16_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* The first lines of the next weight row (bytes at next): the hardware prefetcher needs a few misses to find a
 * new stream. */
static inline void prefetch_next_row(const void *next) {
    _mm_prefetch((const char *)next, _MM_HINT_T0);
    _mm_prefetch((const char *)next + 64, _MM_HINT_T0);
}

/* Output row n's results for activation rows m0 .. m0 + mc - 1: sums[i] + bias[n] (bias may be NULL), in y's
 * dtype. */
static inline void emit(void *y, int ydtype, int N, int n, int m0, int mc, const float *sums, const float *bias) {
    for (int i = 0; i < mc; i++) store(y, (size_t)(m0 + i) * N + n, bias ? sums[i] + bias[n] : sums[i], ydtype);
}

/* ------------------------------------------------------------------ AVX512 kernels */

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,fma")))
static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

/* bf16: 32 weights per step, vdpbf16ps against x rounded to bf16. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,fma")))
static void bf16_rows_avx512(const uint16_t *W, const float *bias, int K, int M, const uint16_t *xb, void *y, int ydtype,
                             int N, int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        const uint16_t *w = W + (size_t)n * K;
        if (n + 1 < n1) prefetch_next_row(w + K);
        for (int m0 = 0; m0 < M; m0 += 4) {
            int mc = M - m0 < 4 ? M - m0 : 4;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int k = 0; k < K; k += 32) {
                _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);
                __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k));
                for (int i = 0; i < mc; i++) {
                    __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + (size_t)(m0 + i) * K + k));
                    acc[i] = _mm512_dpbf16_ps(acc[i], wv, xv);
                }
            }
            float sums[4];
            for (int i = 0; i < mc; i++) sums[i] = hsum512(acc[i]);
            emit(y, ydtype, N, n, m0, mc, sums, bias);
        }
    }
}

/* ------------------------------------------------------------------ AVX2 kernels */

__attribute__((target("avx2,fma,f16c")))
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* int8 on AVX2 (run on both ISA levels): W int8 codes [N, K] with a bfloat16 scale per row and block of 32 input
 * features (ws [N, K/32]: llama.cpp's Q8_0 weights), x quantised per row to int8 in blocks of 4 features
 * (quantize_row4: one scale per int32 lane of the dot product). A tile of NR weight rows x MR activation rows over
 * bytes [k0, k1) of one chunk, 32 weight bytes (one block) per step: vpmaddubsw takes unsigned x signed bytes, so |w|
 * and the activation codes carrying w's sign (vpsignb); pairs fit int16 (|w|, |q| <= 127) and vpmaddwd sums each
 * lane's four products exactly. Each output (activation row i, weight row j) then adds, per step, its eight lane sums
 * times (lane scales * the block's weight scale) in one fused multiply-add per lane: acc_io[i * NR + j]. The block
 * scales come as float32 (wsf: the chunk's, INT8_K_CHUNK / 32 per weight row), widened once per chunk rather than
 * at every step of every activation row. Every output's operations are the same in every tile and chunk, so a row's
 * bits do not depend on the rows beside it. Only a one-row tile (a decode step, which streams the weight from
 * memory) prefetches: the others reread a chunk already in L1. */
/* Input bytes a weight tile passes its activation rows in before the next chunk: 2 weight rows and 4 activation
 * rows (codes and lane scales) of 1 KiB stay in L1 whatever K is. */
#define INT8_K_CHUNK 1024
#define INT8_TILE(NR, MR)                                                                                         \
    __attribute__((target("avx2,fma,f16c"))) static void int8_tile_##NR##x##MR(                                  \
        const int8_t *w, const float *wsf, size_t K, size_t k0, size_t k1, const int8_t *q, const float *ls,     \
        __m256 *acc_io) {                                                                                        \
        const __m256i ones = _mm256_set1_epi16(1);                                                               \
        __m256 acc[MR][NR];                                                                                      \
        for (int i = 0; i < MR; i++)                                                                             \
            for (int j = 0; j < NR; j++) acc[i][j] = acc_io[i * NR + j];                                         \
        const size_t qs = K, ss = K / 4;                                                                         \
        for (size_t k = k0; k < k1; k += QBLOCK) {                                                               \
            __m256i wv[NR], wabs[NR];                                                                            \
            for (int j = 0; j < NR; j++) {                                                                       \
                if (MR == 1 && !(k & 63)) {                                                                      \
                    const size_t ahead = k + PREFETCH < K ? k + PREFETCH : k + PREFETCH + (NR - 1) * K;          \
                    _mm_prefetch((const char *)(w + j * K + ahead), _MM_HINT_T0);                                \
                }                                                                                                \
                wv[j] = _mm256_loadu_si256((const __m256i *)(w + j * K + k));                                    \
                wabs[j] = _mm256_sign_epi8(wv[j], wv[j]);                                                        \
            }                                                                                                    \
            const float *wsk = wsf + (k - k0) / QBLOCK;                                                          \
            for (int i = 0; i < MR; i++) {                                                                       \
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + i * qs + k));                        \
                const __m256 s = _mm256_loadu_ps(ls + i * ss + k / 4);                                           \
                for (int j = 0; j < NR; j++) {                                                                   \
                    __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[j], _mm256_sign_epi8(qv, wv[j])), ones); \
                    const __m256 scale = _mm256_mul_ps(s, _mm256_broadcast_ss(wsk + j * (INT8_K_CHUNK / QBLOCK))); \
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i][j]);                      \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int i = 0; i < MR; i++)                                                                             \
            for (int j = 0; j < NR; j++) acc_io[i * NR + j] = acc[i][j];                                         \
    }

INT8_TILE(2, 1)
INT8_TILE(2, 2)
INT8_TILE(2, 3)
INT8_TILE(2, 4)
INT8_TILE(1, 1)
INT8_TILE(1, 2)
INT8_TILE(1, 3)
INT8_TILE(1, 4)

/* Activation rows a weight tile passes before the next tile: 48 rows' codes and lane scales of a chunk (96 KiB)
 * stay in L2. */
#define INT8_M_BLOCK 48

/* Output columns [n0, n1) for the M rows of quantised x. One row (a decode step): one weight row after the other,
 * the weight read as one sequential stream (on an AVX2 Zen 3, 0-7 % faster than 2 rows at a time over a 1.24 B
 * Llama's layers, three alternating runs: each row is a stream the prefetchers must find). More rows: blocks of INT8_M_BLOCK rows, and in each,
 * tiles of 2 weight rows (the last n1 - n0 mod 2 one at a time) passing the block's rows 4 at a time, a chunk of
 * K at a time. */
__attribute__((target("avx2,fma,f16c")))
static void int8_columns(const int8_t *W, const uint16_t *ws, const float *bias, int K, int M, const int8_t *q,
                         const float *lane_scale, void *y, int ydtype, int N, int n0, int n1) {
    __m256 acc[INT8_M_BLOCK * 2];
    const size_t blocks = (size_t)K / QBLOCK;
    for (int mb = 0; mb < M; mb += INT8_M_BLOCK) {
        const int mrows = M - mb < INT8_M_BLOCK ? M - mb : INT8_M_BLOCK;
        for (int n = n0; n < n1;) {
            const int nr = mrows > 1 && n1 - n >= 2 ? 2 : 1;
            const int8_t *w = W + (size_t)n * K;
            const uint16_t *wsn = ws + (size_t)n * blocks;
            if (n + nr < n1) prefetch_next_row(w + (size_t)nr * K);
            for (int i = 0; i < mrows * nr; i++) acc[i] = _mm256_setzero_ps();
            for (size_t k0 = 0; k0 < (size_t)K; k0 += INT8_K_CHUNK) {
                const size_t k1 = k0 + INT8_K_CHUNK < (size_t)K ? k0 + INT8_K_CHUNK : (size_t)K;
                float wsf[2 * (INT8_K_CHUNK / QBLOCK)];
                for (int j = 0; j < nr; j++)
                    for (size_t b = k0 / QBLOCK; b < k1 / QBLOCK; b++)
                        wsf[j * (INT8_K_CHUNK / QBLOCK) + b - k0 / QBLOCK] = bf16_float(wsn[j * blocks + b]);
                for (int m0 = 0; m0 < mrows; m0 += 4) {
                    const int mc = mrows - m0 < 4 ? mrows - m0 : 4;
                    const int8_t *qm = q + (size_t)(mb + m0) * K;
                    const float *lm = lane_scale + (size_t)(mb + m0) * (K / 4);
                    __m256 *am = acc + (size_t)m0 * nr;
                    switch (nr * 8 + mc) {
                        case 17: int8_tile_2x1(w, wsf, K, k0, k1, qm, lm, am); break;
                        case 18: int8_tile_2x2(w, wsf, K, k0, k1, qm, lm, am); break;
                        case 19: int8_tile_2x3(w, wsf, K, k0, k1, qm, lm, am); break;
                        case 20: int8_tile_2x4(w, wsf, K, k0, k1, qm, lm, am); break;
                        case 9: int8_tile_1x1(w, wsf, K, k0, k1, qm, lm, am); break;
                        case 10: int8_tile_1x2(w, wsf, K, k0, k1, qm, lm, am); break;
                        case 11: int8_tile_1x3(w, wsf, K, k0, k1, qm, lm, am); break;
                        default: int8_tile_1x4(w, wsf, K, k0, k1, qm, lm, am); break;
                    }
                }
            }
            for (int i = 0; i < mrows; i++)
                for (int j = 0; j < nr; j++) {
                    float v = hsum256(acc[(size_t)i * nr + j]);
                    store(y, (size_t)(mb + i) * N + n + j, bias ? v + bias[n + j] : v, ydtype);
                }
            n += nr;
        }
    }
}

/* bf16 on AVX2: 16 weights per step widened to two float32 vectors (bf16 is float32's high half), FMA
 * against x rounded to bf16 and widened the same way once per call (xw, float32). */
__attribute__((target("avx2,fma,f16c")))
static void bf16_rows_avx2(const uint16_t *W, const float *bias, int K, int M, const float *xw, void *y, int ydtype, int N,
                           int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        const uint16_t *w = W + (size_t)n * K;
        if (n + 1 < n1) prefetch_next_row(w + K);
        for (int m0 = 0; m0 < M; m0 += 4) {
            int mc = M - m0 < 4 ? M - m0 : 4;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int k = 0; k < K; k += 16) {
                if (!(k & 31)) _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);
                __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
                /* unpack with zeros below: word j of each half becomes the float with those 16 high bits */
                __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), wv));
                __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), wv));
                for (int i = 0; i < mc; i++) {
                    /* xw holds x permuted the same way per 16 features (see widen_x_avx2) */
                    const float *xr = xw + (size_t)(m0 + i) * K + k;
                    acc[i] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xr), acc[i]);
                    acc[i] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xr + 8), acc[i]);
                }
            }
            float sums[4];
            for (int i = 0; i < mc; i++) sums[i] = hsum256(acc[i]);
            emit(y, ydtype, N, n, m0, mc, sums, bias);
        }
    }
}

/* x rounded to bf16, as float32, in the order unpacklo/unpackhi_epi16 yields 16 weights: 0-3, 8-11 | 4-7, 12-15. */
static void widen_x_avx2(const uint16_t *xb, int K, float *xw) {
    static const int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    for (int k = 0; k < K; k += 16)
        for (int j = 0; j < 16; j++) {
            uint32_t u = (uint32_t)xb[k + order[j]] << 16;
            memcpy(&xw[k + j], &u, 4);
        }
}

/* ------------------------------------------------------------------ int4 (torch's CPU layout) */

/* torch._convert_weight_to_int4pack_for_cpu cuts the rows into blocks of B (64 on AVX512 builds, 32 on AVX2) and
 * stores, per block and input feature k, B/2 bytes: byte j's low nibble is row j, its high nibble row j + B/2.
 * Codes 0..15; weight = (code - 8) * scale + zero with bf16 (scale, zero) pairs per group of input features and
 * row ([K/group, N, 2]). The kernel takes 64 rows at a time as four sets of 16: (low or high nibble) x (first or
 * second 16-byte lane). With B = 64 the lanes are the two halves of a block's 32 bytes per k; with B = 32 they are
 * the 16 bytes per k of two neighbouring blocks. Four k at a time, byte and word unpacks turn the four 16-byte rows
 * of codes into 32-bit lanes of (k, k+1, k+2, k+3) codes of one row: what vpdpbusd (or vpmaddubsw + vpmaddwd)
 * multiplies by four int8 activation codes broadcast to every lane. Per block of 32 input features the int32 sums
 * are scaled back: y += sum * activation scale * scale + (zero - 8 * scale) * (sum of the block's activations). */

typedef struct {
    const uint8_t *lane[2]; /* the two 16-byte lanes' bytes for k = 0 */
    int kstride;            /* bytes from one k to the next within a lane */
    int rows[4];            /* first row of each set, from base: (low, lane 0), (low, lane 1), (high, lane 0), (high, lane 1) */
    int base;               /* the unit's first row */
} int4_unit;

#define INT4_UNIT(NAME, TARGET, DOT)                                                                              \
    TARGET static void NAME(const int4_unit *u, int K, int group, int N, const int8_t *q, const float *ascale,     \
                            const float *bsum, const uint16_t *sz, float *out) {                                  \
        const __m256i low = _mm256_set1_epi8(0x0f), high16 = _mm256_set1_epi32((int)0xffff0000u);                \
        const uint8_t *lane0 = u->lane[0], *lane1 = u->lane[1];                                                   \
        const size_t kstride = (size_t)u->kstride;                                                                \
        const int contiguous = lane1 == lane0 + 16 && kstride == 32; /* block 64: one 32-byte load per k */        \
        const int per_group = group / QBLOCK;                                                                     \
        __m256 y[8];                                                                                              \
        for (int i = 0; i < 8; i++) y[i] = _mm256_setzero_ps();                                                   \
        for (int b = 0; b < K; b += QBLOCK) {                                                                     \
            __m256i acc[8];                                                                                       \
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();                                          \
            for (int k = b; k < b + QBLOCK; k += 4) {                                                             \
                __m256i v[4];                                                                                     \
                for (int t = 0; t < 4; t++) {                                                                     \
                    size_t off = (size_t)(k + t) * kstride;                                                      \
                    v[t] = contiguous ? _mm256_loadu_si256((const __m256i *)(lane0 + off))                       \
                                      : _mm256_inserti128_si256(                                                  \
                                            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(lane0 + off))), \
                                            _mm_loadu_si128((const __m128i *)(lane1 + off)), 1);                  \
                }                                                                                                 \
                _mm_prefetch((const char *)(lane0 + k * kstride) + PREFETCH, _MM_HINT_T0);                       \
                if (!contiguous) _mm_prefetch((const char *)(lane1 + k * kstride) + PREFETCH, _MM_HINT_T0);      \
                int32_t four;                                                                                     \
                memcpy(&four, q + k, 4);                                                                          \
                const __m256i act = _mm256_set1_epi32(four);                                                      \
                for (int h = 0; h < 2; h++) {                                                                     \
                    __m256i c[4];                                                                                 \
                    for (int t = 0; t < 4; t++)                                                                   \
                        c[t] = h ? _mm256_and_si256(_mm256_srli_epi16(v[t], 4), low) : _mm256_and_si256(v[t], low); \
                    __m256i a01 = _mm256_unpacklo_epi8(c[0], c[1]), b01 = _mm256_unpackhi_epi8(c[0], c[1]);      \
                    __m256i a23 = _mm256_unpacklo_epi8(c[2], c[3]), b23 = _mm256_unpackhi_epi8(c[2], c[3]);      \
                    acc[4 * h + 0] = DOT(acc[4 * h + 0], _mm256_unpacklo_epi16(a01, a23), act);                   \
                    acc[4 * h + 1] = DOT(acc[4 * h + 1], _mm256_unpackhi_epi16(a01, a23), act);                   \
                    acc[4 * h + 2] = DOT(acc[4 * h + 2], _mm256_unpacklo_epi16(b01, b23), act);                   \
                    acc[4 * h + 3] = DOT(acc[4 * h + 3], _mm256_unpackhi_epi16(b01, b23), act);                   \
                }                                                                                                 \
            }                                                                                                     \
            const uint16_t *szg = sz + (size_t)(b / QBLOCK / per_group) * N * 2;                                  \
            const __m256 as = _mm256_set1_ps(ascale[b / QBLOCK]), bs = _mm256_set1_ps(bsum[b / QBLOCK]);        \
            for (int h = 0; h < 2; h++)                                                                           \
                for (int i = 0; i < 4; i++) {                                                                     \
                    /* acc[4h+i]: rows 4i..4i+3 of set (h, lane 0), then of set (h, lane 1) */                     \
                    __m256i pairs = _mm256_inserti128_si256(                                                      \
                        _mm256_castsi128_si256(                                                                   \
                            _mm_loadu_si128((const __m128i *)(szg + (size_t)(u->base + u->rows[2 * h] + 4 * i) * 2))),       \
                        _mm_loadu_si128((const __m128i *)(szg + (size_t)(u->base + u->rows[2 * h + 1] + 4 * i) * 2)), 1);    \
                    __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));                             \
                    __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(pairs, high16));                           \
                    __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);                         \
                    y[4 * h + i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[4 * h + i]), _mm256_mul_ps(scale, as),  \
                                                   y[4 * h + i]);                                                 \
                    y[4 * h + i] = _mm256_fmadd_ps(offset, bs, y[4 * h + i]);                                     \
                }                                                                                                 \
        }                                                                                                         \
        for (int h = 0; h < 2; h++)                                                                               \
            for (int i = 0; i < 4; i++) {                                                                         \
                _mm_storeu_ps(out + u->rows[2 * h] + 4 * i, _mm256_castps256_ps128(y[4 * h + i]));                \
                _mm_storeu_ps(out + u->rows[2 * h + 1] + 4 * i, _mm256_extractf128_ps(y[4 * h + i], 1));          \
            }                                                                                                     \
    }

/* The unit for M activation rows (out [M, 64]): per block of 32 input features the nibbles are unpacked once (into
 * codes, 2 KiB: L1) and the scales and offsets computed once, then each row runs only its vpdpbusd (or vpmaddubsw +
 * vpmaddwd) over them; the unit above redoes the 16 unpacks per 128 bytes for every row. Each row's numbers are the
 * unit's, bit for bit (the same int32 sums, the same float operations in the same order). */
#define INT4_ROWS(NAME, TARGET, DOT)                                                                              \
    TARGET static void NAME(const int4_unit *u, int K, int group, int N, int M, const int8_t *q,                  \
                            const float *ascale, const float *bsum, const uint16_t *sz, float *out) {             \
        const __m256i low = _mm256_set1_epi8(0x0f), high16 = _mm256_set1_epi32((int)0xffff0000u);                \
        const uint8_t *lane0 = u->lane[0], *lane1 = u->lane[1];                                                   \
        const size_t kstride = (size_t)u->kstride;                                                                \
        const int contiguous = lane1 == lane0 + 16 && kstride == 32;                                              \
        const int per_group = group / QBLOCK, blocks = K / QBLOCK;                                                \
        __m256 y[MAX_ROWS][8];                                                                                    \
        for (int m = 0; m < M; m++)                                                                               \
            for (int i = 0; i < 8; i++) y[m][i] = _mm256_setzero_ps();                                            \
        for (int b = 0; b < K; b += QBLOCK) {                                                                     \
            __m256i codes[QBLOCK / 4][8];                                                                         \
            for (int k = b; k < b + QBLOCK; k += 4) {                                                             \
                __m256i v[4];                                                                                     \
                for (int t = 0; t < 4; t++) {                                                                     \
                    size_t off = (size_t)(k + t) * kstride;                                                      \
                    v[t] = contiguous ? _mm256_loadu_si256((const __m256i *)(lane0 + off))                       \
                                      : _mm256_inserti128_si256(                                                  \
                                            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(lane0 + off))), \
                                            _mm_loadu_si128((const __m128i *)(lane1 + off)), 1);                  \
                }                                                                                                 \
                _mm_prefetch((const char *)(lane0 + k * kstride) + PREFETCH, _MM_HINT_T0);                       \
                if (!contiguous) _mm_prefetch((const char *)(lane1 + k * kstride) + PREFETCH, _MM_HINT_T0);      \
                __m256i *c4 = codes[(k - b) / 4];                                                                 \
                for (int h = 0; h < 2; h++) {                                                                     \
                    __m256i c[4];                                                                                 \
                    for (int t = 0; t < 4; t++)                                                                   \
                        c[t] = h ? _mm256_and_si256(_mm256_srli_epi16(v[t], 4), low) : _mm256_and_si256(v[t], low); \
                    __m256i a01 = _mm256_unpacklo_epi8(c[0], c[1]), b01 = _mm256_unpackhi_epi8(c[0], c[1]);      \
                    __m256i a23 = _mm256_unpacklo_epi8(c[2], c[3]), b23 = _mm256_unpackhi_epi8(c[2], c[3]);      \
                    c4[4 * h + 0] = _mm256_unpacklo_epi16(a01, a23);                                              \
                    c4[4 * h + 1] = _mm256_unpackhi_epi16(a01, a23);                                              \
                    c4[4 * h + 2] = _mm256_unpacklo_epi16(b01, b23);                                              \
                    c4[4 * h + 3] = _mm256_unpackhi_epi16(b01, b23);                                              \
                }                                                                                                 \
            }                                                                                                     \
            const uint16_t *szg = sz + (size_t)(b / QBLOCK / per_group) * N * 2;                                  \
            __m256 scale[8], offset[8];                                                                           \
            for (int h = 0; h < 2; h++)                                                                           \
                for (int i = 0; i < 4; i++) {                                                                     \
                    __m256i pairs = _mm256_inserti128_si256(                                                      \
                        _mm256_castsi128_si256(                                                                   \
                            _mm_loadu_si128((const __m128i *)(szg + (size_t)(u->base + u->rows[2 * h] + 4 * i) * 2))),       \
                        _mm_loadu_si128((const __m128i *)(szg + (size_t)(u->base + u->rows[2 * h + 1] + 4 * i) * 2)), 1);    \
                    scale[4 * h + i] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));                         \
                    offset[4 * h + i] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale[4 * h + i],                  \
                                                         _mm256_castsi256_ps(_mm256_and_si256(pairs, high16)));   \
                }                                                                                                 \
            for (int m = 0; m < M; m++) {                                                                         \
                const int8_t *qm = q + (size_t)m * K;                                                             \
                __m256i acc[8];                                                                                   \
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();                                      \
                for (int k = b; k < b + QBLOCK; k += 4) {                                                         \
                    int32_t four;                                                                                 \
                    memcpy(&four, qm + k, 4);                                                                     \
                    const __m256i act = _mm256_set1_epi32(four);                                                  \
                    const __m256i *c4 = codes[(k - b) / 4];                                                       \
                    for (int i = 0; i < 8; i++) acc[i] = DOT(acc[i], c4[i], act);                                 \
                }                                                                                                 \
                const __m256 as = _mm256_set1_ps(ascale[(size_t)m * blocks + b / QBLOCK]),                        \
                             bs = _mm256_set1_ps(bsum[(size_t)m * blocks + b / QBLOCK]);                          \
                for (int i = 0; i < 8; i++) {                                                                     \
                    __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(scale[i], as), y[m][i]); \
                    y[m][i] = _mm256_fmadd_ps(offset[i], bs, t);                                                  \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int m = 0; m < M; m++)                                                                               \
            for (int h = 0; h < 2; h++)                                                                           \
                for (int i = 0; i < 4; i++) {                                                                     \
                    _mm_storeu_ps(out + m * 64 + u->rows[2 * h] + 4 * i, _mm256_castps256_ps128(y[m][4 * h + i])); \
                    _mm_storeu_ps(out + m * 64 + u->rows[2 * h + 1] + 4 * i, _mm256_extractf128_ps(y[m][4 * h + i], 1)); \
                }                                                                                                 \
    }

/* vpmaddubsw cannot saturate here (two products of a code 0..15 and an int8 code: at most 3810), so its int32 sums
 * are exact, as vpdpbusd's would be: the AVX2 code runs on both ISA levels. On a Xeon with AVX512-VNNI it decoded
 * faster than torch's AVX512 int4 kernel, and the 256-bit vpdpbusd variant it replaces slower. */
#define DOT_AVX2(acc, codes, act) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, act), _mm256_set1_epi16(1)))
INT4_UNIT(int4_unit_avx2, __attribute__((target("avx2,fma,f16c"))), DOT_AVX2)
INT4_ROWS(int4_rows_avx2, __attribute__((target("avx2,fma,f16c"))), DOT_AVX2)

/* ------------------------------------------------------------------ threads */

/* OpenMP, from the libgomp torch loads (same soname, so the dynamic linker hands this library torch's instance):
 * a product runs on the very threads torch's own ops run on. A pool of its own would spin or sleep beside torch's
 * (whose idle threads spin for a while after each op), and on a 2-core machine the two pools took turns: decode
 * ran at a third of the kernels' speed. */
#include <omp.h>

typedef void (*pc_task)(void *ctx, int n0, int n1);

static int pool_threads = 1;

/* Threads for later calls (1: the caller only). Returns the number in effect. */
PC_API int pc_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pool_threads = n;
    return n;
}

static void split(int part, int parts, int N, int align, int *n0, int *n1) {
    int units = (N + align - 1) / align;
    int a = (int)((long)units * part / parts), b = (int)((long)units * (part + 1) / parts);
    *n0 = a * align < N ? a * align : N;
    *n1 = b * align < N ? b * align : N;
}

static void run(pc_task task, void *ctx, int N, int align) {
    int parts = pool_threads;
    if (parts > 1 && N >= 2 * align && !omp_in_parallel()) {
#pragma omp parallel num_threads(parts)
        {
            int n0, n1;
            split(omp_get_thread_num(), omp_get_num_threads(), N, align, &n0, &n1);
            if (n0 < n1) task(ctx, n0, n1);
        }
    } else {
        task(ctx, 0, N);
    }
}

/* ------------------------------------------------------------------ entry points */

typedef struct {
    const void *W;
    const float *bias;
    int K, M, N, isa, ydtype;
    const uint16_t *xb;
    const float *xw;
    void *y;
} job_t;

typedef struct {
    const int8_t *W;
    const uint16_t *ws;
    const float *bias;
    int K, M, N, ydtype;
    const int8_t *q;
    const float *lane_scale;
    void *y;
} int8_job;

static void int8_task(void *p, int n0, int n1) {
    int8_job *j = p;
    int8_columns(j->W, j->ws, j->bias, j->K, j->M, j->q, j->lane_scale, j->y, j->ydtype, j->N, n0, n1);
}

static void bf16_task(void *p, int n0, int n1) {
    job_t *j = p;
    if (j->isa == 2)
        bf16_rows_avx512(j->W, j->bias, j->K, j->M, j->xb, j->y, j->ydtype, j->N, n0, n1);
    else
        bf16_rows_avx2(j->W, j->bias, j->K, j->M, j->xw, j->y, j->ydtype, j->N, n0, n1);
}

/* The K multiple each operation's loop steps by on each ISA level. */
PC_API int pc_k_multiple(int op, int isa) {
    if (op == 0 || op == 2) return QBLOCK; /* int8 (a weight block), int4 (and a multiple of its group) */
    if (op == 3) return 8;                 /* dense: the AVX2 code on either level */
    return isa == 2 ? 32 : 16;             /* bf16 */
}

static int check_bf16(int M, int K, int N, int isa, int xdtype, int ydtype) {
    if (isa < 1 || isa > pc_isa()) return -ENOTSUP;
    if (M < 1 || M > MAX_ROWS || N < 1 || K < 1 || K % pc_k_multiple(1, isa)) return -EINVAL;
    if ((xdtype != 0 && xdtype != 1) || (ydtype != 0 && ydtype != 1)) return -EINVAL;
    return 0;
}

/* Rows of activations one pc_bf16 call takes (pc_int8, pc_int4 and pc_dense take any number). */
PC_API int pc_max_rows(void) { return MAX_ROWS; }

/* y [M, N] = x [M, K] @ W^T + bias [N], W int8 codes [N, K] times a bfloat16 scale per row and block of 32 input
 * features (ws [N, K/32]). x and y float32 (dtype 0) or bfloat16 (1), bias (may be NULL) float32. x is quantised
 * per row in blocks of 4 features (quantize_row4). K a multiple of 32, any M >= 1: a row's bits are the same alone
 * and among any rows (one answer per input). The AVX2 code runs on either ISA level. Returns 0, -EINVAL (shapes,
 * dtypes), -ENOTSUP (isa) or -ENOMEM. */
PC_API int pc_int8(const void *x, int xdtype, int M, int K, const int8_t *W, const uint16_t *ws, int N,
                   const float *bias, void *y, int ydtype, int isa) {
    if (isa < 1 || isa > pc_isa()) return -ENOTSUP;
    if (M < 1 || N < 1 || K < QBLOCK || K % QBLOCK || (xdtype != 0 && xdtype != 1) || (ydtype != 0 && ydtype != 1) ||
        (size_t)M * K > ((size_t)1 << 40))
        return -EINVAL;
    int8_t *q = malloc((size_t)M * K);
    float *lane = malloc((size_t)M * (K / 4) * sizeof(float));
    float *row = xdtype ? malloc((size_t)K * sizeof(float)) : NULL;
    if (!q || !lane || (xdtype && !row)) {
        free(q), free(lane), free(row);
        return -ENOMEM;
    }
    for (int m = 0; m < M; m++) {
        const float *xr = (const float *)x + (size_t)m * K;
        if (xdtype) {
            for (int k = 0; k < K; k++) row[k] = load_x(x, (size_t)m * K + k, 1);
            xr = row;
        }
        quantize_row4(xr, K, q + (size_t)m * K, lane + (size_t)m * (K / 4));
    }
    int8_job job = {.W = W, .ws = ws, .bias = bias, .K = K, .M = M, .N = N, .ydtype = ydtype, .q = q,
                    .lane_scale = lane, .y = y};
    run(int8_task, &job, N, 8);
    free(q), free(lane), free(row);
    return 0;
}

/* y [M, N] = bf16(x [M, K]) @ W bf16 [N, K]^T + bias [N], float32 accumulation. x and y float32 (0) or bfloat16
 * (1); bias (may be NULL) float32. K a multiple of pc_k_multiple(1, isa), 1 <= M <= 64. Returns as pc_int8. */
PC_API int pc_bf16(const void *x, int xdtype, int M, int K, const uint16_t *W, int N, const float *bias, void *y,
                   int ydtype, int isa) {
    int rc = check_bf16(M, K, N, isa, xdtype, ydtype);
    if (rc) return rc;
    size_t count = (size_t)M * K;
    uint16_t *xb = xdtype ? NULL : malloc(count * sizeof(uint16_t));
    float *xw = isa == 1 ? malloc(count * sizeof(float)) : NULL;
    if ((!xdtype && !xb) || (isa == 1 && !xw)) {
        free(xb);
        free(xw);
        return -ENOMEM;
    }
    const uint16_t *xs = xdtype ? (const uint16_t *)x : xb;
    if (!xdtype)
        for (size_t i = 0; i < count; i++) xb[i] = to_bf16(((const float *)x)[i]);
    if (isa == 1)
        for (int m = 0; m < M; m++) widen_x_avx2(xs + (size_t)m * K, K, xw + (size_t)m * K);
    job_t job = {.W = W, .bias = bias, .K = K, .M = M, .N = N, .isa = isa, .ydtype = ydtype, .xb = xs, .xw = xw,
                 .y = y};
    run(bf16_task, &job, N, 8);
    free(xb);
    free(xw);
    return 0;
}

typedef struct {
    const uint8_t *W;
    const uint16_t *sz;
    const float *bias;
    int K, N, M, block, group, ydtype;
    const int8_t *q;
    const float *bscale, *bsum;
    void *y;
} int4_job;

static void int4_task(void *p, int n0, int n1) {
    int4_job *j = p;
    size_t half_k = (size_t)j->K / 2;
    for (int base = n0; base < n1; base += 64) {
        int4_unit u = {.base = base};
        const uint8_t *first = j->W + (size_t)base * half_k;
        if (j->block == 64) {
            u = (int4_unit){{first, first + 16}, 32, {0, 16, 32, 48}, base};
        } else { /* blocks base / 32 and base / 32 + 1 */
            u = (int4_unit){{first, first + 32 * half_k}, 16, {0, 32, 16, 48}, base};
        }
        /* MAX_ROWS activation rows at a time, each row's numbers the same in any of them (INT4_ROWS) */
        for (int m0 = 0; m0 < j->M; m0 += MAX_ROWS) {
            const int rows = j->M - m0 < MAX_ROWS ? j->M - m0 : MAX_ROWS;
            const size_t blocks = (size_t)j->K / QBLOCK;
            const int8_t *q = j->q + (size_t)m0 * j->K;
            const float *bscale = j->bscale + m0 * blocks, *bsum = j->bsum + m0 * blocks;
            float out[MAX_ROWS * 64];
            if (rows > 1)
                int4_rows_avx2(&u, j->K, j->group, j->N, rows, q, bscale, bsum, j->sz, out);
            else
                int4_unit_avx2(&u, j->K, j->group, j->N, q, bscale, bsum, j->sz, out);
            for (int m = 0; m < rows; m++)
                for (int r = 0; r < 64; r++)
                    store(j->y, (size_t)(m0 + m) * j->N + base + r,
                          j->bias ? out[m * 64 + r] + j->bias[base + r] : out[m * 64 + r], j->ydtype);
        }
    }
}

/* y [M, N] = (x [M, K] * in_scales [K]) @ W^T + bias [N] for an int4 pack in torch's CPU layout with halves
 * (block 64 or 32: torch.int4wo on AVX512 or AVX2 builds), bf16 (scale, zero) pairs sz [K/group, N, 2]. x and y
 * float32 (0) or bfloat16 (1); in_scales and bias (each may be NULL) float32. The activations are quantised per row
 * in blocks of 32 (quantize_row), each row on its own. N % 64 == 0, K % group == 0, group % 32 == 0, any M >= 1: a row's
 * bits are the same alone and among any rows (one answer per input). The AVX2 code runs on either ISA level.
 * Returns as pc_int8. */
PC_API int pc_int4(const void *x, int xdtype, int M, int K, const uint8_t *W, const uint16_t *sz, int N, int group,
                   int block, const float *in_scales, const float *bias, void *y, int ydtype, int isa) {
    if (isa < 1 || isa > pc_isa()) return -ENOTSUP;
    if (M < 1 || N < 64 || N % 64 || group < QBLOCK || group % QBLOCK || K < group || K % group ||
        (block != 32 && block != 64) || (xdtype != 0 && xdtype != 1) || (ydtype != 0 && ydtype != 1) ||
        (size_t)M * K > ((size_t)1 << 40))
        return -EINVAL;
    int blocks = K / QBLOCK;
    int8_t *q = malloc((size_t)M * K);
    float *bscale = malloc((size_t)M * blocks * sizeof(float)), *bsum = malloc((size_t)M * blocks * sizeof(float));
    float *row = malloc((size_t)K * sizeof(float)), *lane = malloc((size_t)(K / 4) * sizeof(float));
    if (!q || !bscale || !bsum || !row || !lane) {
        free(q), free(bscale), free(bsum), free(row), free(lane);
        return -ENOMEM;
    }
    for (int m = 0; m < M; m++) {
        for (int k = 0; k < K; k++) {
            float v = load_x(x, (size_t)m * K + k, xdtype);
            row[k] = in_scales ? v * in_scales[k] : v;
        }
        quantize_row(row, K, q + (size_t)m * K, lane);
        for (int b = 0; b < blocks; b++) {
            float sum = 0.0f;
            for (int k = b * QBLOCK; k < (b + 1) * QBLOCK; k++) sum += row[k];
            bscale[(size_t)m * blocks + b] = lane[b * (QBLOCK / 4)];
            bsum[(size_t)m * blocks + b] = sum;
        }
    }
    int4_job job = {.W = W, .sz = sz, .bias = bias, .K = K, .N = N, .M = M, .block = block, .group = group,
                    .ydtype = ydtype, .q = q, .bscale = bscale, .bsum = bsum, .y = y};
    run(int4_task, &job, N, 64);
    free(q), free(bscale), free(bsum), free(row), free(lane);
    return 0;
}

/* ------------------------------------------------------------------ one family for every row count */

/* y [M, N] = x [M, K] @ (W [N, K] * scales [N])^T + bias [N], for float32, bfloat16 and int8 weights alike, on
 * float32 activations. Each weight is widened to float32 exactly (an int8 code, a bfloat16's bits), so a product's
 * only roundings are the multiply-adds. Every output (row m, column n) has its own eight lanes: lane l adds
 * x[m, k] * w[n, k] for k = l, l + 8, l + 16, ... in increasing k, one fused multiply-add each; then the lanes are
 * added in hsum256's order, the sum times scales[n], plus bias[n]. No step of that depends on M, on which tile an
 * output falls in, on the chunking of K or on the thread that runs it: a row's bits are the same alone and inside
 * any batch (one answer per input). A tile of MR activation rows x NR weight rows keeps MR * NR such accumulators
 * in registers (3 x 4: 12 of the 16, beside the 4 widened weight vectors; the activations are memory operands). */

#define DENSE_K_CHUNK 512 /* float32 activations per row and pass: 3 rows x 2 KiB + 4 weight rows stay in L1 */
#define DENSE_M_BLOCK 48  /* activation rows a weight tile passes before the next: 48 x 2 KiB in L2 */

#define W_F32(w, k) _mm256_loadu_ps((const float *)(w) + (k))
#define W_BF16(w, k) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(w) + (k)))), 16))
#define W_INT8(w, k) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)(w) + (k)))))

#define DENSE_TILE(NAME, WT, LOADW, NR, MR)                                                                   \
    __attribute__((target("avx2,fma,f16c"))) static void NAME##_##NR##x##MR(                                     \
        const WT *w, size_t K, size_t k0, size_t k1, const float *x, size_t xstride, __m256 *acc_io) {            \
        __m256 acc[MR][NR];                                                                                      \
        for (int i = 0; i < MR; i++)                                                                             \
            for (int j = 0; j < NR; j++) acc[i][j] = acc_io[i * NR + j];                                         \
        for (size_t k = k0; k < k1; k += 8) {                                                                    \
            __m256 wv[NR];                                                                                       \
            for (int j = 0; j < NR; j++) wv[j] = LOADW(w + j * K, k);                                            \
            for (int i = 0; i < MR; i++) {                                                                       \
                const __m256 xv = _mm256_loadu_ps(x + i * xstride + k);                                          \
                for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);                  \
            }                                                                                                    \
        }                                                                                                        \
        for (int i = 0; i < MR; i++)                                                                             \
            for (int j = 0; j < NR; j++) acc_io[i * NR + j] = acc[i][j];                                         \
    }

/* The tiles of one weight type, and NAME_tile: the tile of nr (4 or 1) weight rows x mc (1-3) activation rows. */
#define DENSE_TILE_SET(NAME, WT, LOADW)                                                                           \
    DENSE_TILE(NAME, WT, LOADW, 4, 1)                                                                             \
    DENSE_TILE(NAME, WT, LOADW, 4, 2)                                                                             \
    DENSE_TILE(NAME, WT, LOADW, 4, 3)                                                                             \
    DENSE_TILE(NAME, WT, LOADW, 1, 1)                                                                             \
    DENSE_TILE(NAME, WT, LOADW, 1, 2)                                                                             \
    DENSE_TILE(NAME, WT, LOADW, 1, 3)                                                                             \
    __attribute__((target("avx2,fma,f16c"))) static void NAME##_tile(int nr, int mc, const WT *w, size_t K,       \
                                                                    size_t k0, size_t k1, const float *x,        \
                                                                    size_t xstride, __m256 *acc) {               \
        switch (nr * 8 + mc) {                                                                                   \
            case 33: NAME##_4x1(w, K, k0, k1, x, xstride, acc); break;                                           \
            case 34: NAME##_4x2(w, K, k0, k1, x, xstride, acc); break;                                           \
            case 35: NAME##_4x3(w, K, k0, k1, x, xstride, acc); break;                                           \
            case 9: NAME##_1x1(w, K, k0, k1, x, xstride, acc); break;                                            \
            case 10: NAME##_1x2(w, K, k0, k1, x, xstride, acc); break;                                           \
            default: NAME##_1x3(w, K, k0, k1, x, xstride, acc); break;                                           \
        }                                                                                                        \
    }

#define DENSE_TILES(NAME, WT, LOADW, WIDENS)                                                                      \
    DENSE_TILE_SET(NAME, WT, LOADW)                                                                               \
    /* Output columns [n0, n1) for every activation row: blocks of DENSE_M_BLOCK rows; in each, tiles of 4 weight \
     * rows (the last n1 - n0 mod 4 one at a time) pass the block's rows 3 at a time, a chunk of K at a time. */   \
    __attribute__((target("avx2,fma,f16c"))) static void NAME##_columns(                                         \
        const WT *W, const float *scales, const float *bias, int K, int M, const float *x, void *y, int ydtype,   \
        int N, int n0, int n1) {                                                                                 \
        __m256 acc[DENSE_M_BLOCK * 4];                                                                           \
        float wide[WIDENS ? 4 * DENSE_K_CHUNK : 1];                                                              \
        for (int mb = 0; mb < M; mb += DENSE_M_BLOCK) {                                                          \
            const int mrows = M - mb < DENSE_M_BLOCK ? M - mb : DENSE_M_BLOCK;                                   \
            for (int n = n0; n < n1;) {                                                                          \
                const int nr = n1 - n >= 4 ? 4 : 1;                                                              \
                const WT *w = W + (size_t)n * K;                                                                 \
                for (int i = 0; i < mrows * nr; i++) acc[i] = _mm256_setzero_ps();                               \
                for (size_t k0 = 0; k0 < (size_t)K; k0 += DENSE_K_CHUNK) {                                       \
                    const size_t k1 = k0 + DENSE_K_CHUNK < (size_t)K ? k0 + DENSE_K_CHUNK : (size_t)K;           \
                    /* Past a few rows the weight tile's chunk is widened once into L1 and read as float32: the   \
                     * same numbers, without widening them again for every 3 activation rows. */                  \
                    const int widen = WIDENS && mrows > 3;                                                       \
                    if (widen)                                                                                   \
                        for (int j = 0; j < nr; j++)                                                             \
                            for (size_t k = k0; k < k1; k += 8)                                                  \
                                _mm256_storeu_ps(wide + j * DENSE_K_CHUNK + (k - k0), LOADW(w + j * K, k));     \
                    for (int m0 = 0; m0 < mrows; m0 += 3) {                                                      \
                        const int mc = mrows - m0 < 3 ? mrows - m0 : 3;                                          \
                        const float *xm = x + (size_t)(mb + m0) * K;                                             \
                        __m256 *am = acc + (size_t)m0 * nr;                                                      \
                        if (widen) /* the chunk's rows DENSE_K_CHUNK apart, k from 0 */                          \
                            dense_wide_tile(nr, mc, wide, DENSE_K_CHUNK, 0, k1 - k0, xm + k0, K, am);            \
                        else                                                                                     \
                            NAME##_tile(nr, mc, w, K, k0, k1, xm, K, am);                                        \
                    }                                                                                            \
                }                                                                                                \
                for (int i = 0; i < mrows; i++)                                                                  \
                    for (int j = 0; j < nr; j++) {                                                               \
                        float v = hsum256(acc[(size_t)i * nr + j]);                                              \
                        if (scales) v *= scales[n + j];                                                          \
                        store(y, (size_t)(mb + i) * N + n + j, bias ? v + bias[n + j] : v, ydtype);              \
                    }                                                                                            \
                n += nr;                                                                                         \
            }                                                                                                    \
        }                                                                                                        \
    }

/* float32 tiles over a weight chunk widened into L1 (the int8 and bfloat16 products' rows past 3) */
DENSE_TILE_SET(dense_wide, float, W_F32)

DENSE_TILES(dense_f32, float, W_F32, 0)

DENSE_TILES(dense_bf16, uint16_t, W_BF16, 1)
DENSE_TILES(dense_int8, int8_t, W_INT8, 1)

typedef struct {
    const void *W;
    const float *scales, *bias, *x;
    int K, M, N, wdtype, ydtype;
    void *y;
} dense_job;

static void dense_task(void *p, int n0, int n1) {
    dense_job *j = p;
    if (j->wdtype == 2)
        dense_int8_columns(j->W, j->scales, j->bias, j->K, j->M, j->x, j->y, j->ydtype, j->N, n0, n1);
    else if (j->wdtype == 1)
        dense_bf16_columns(j->W, j->scales, j->bias, j->K, j->M, j->x, j->y, j->ydtype, j->N, n0, n1);
    else
        dense_f32_columns(j->W, j->scales, j->bias, j->K, j->M, j->x, j->y, j->ydtype, j->N, n0, n1);
}

/* y [M, N] = x [M, K] @ (W [N, K] * scales [N])^T + bias [N] with W float32 (wdtype 0), bfloat16 (1) or int8 (2);
 * x and y float32 (0) or bfloat16 (1), x widened to float32 exactly; scales (may be NULL; int8 needs them) and bias
 * (may be NULL) float32. Any M >= 1; K a multiple of 8. Runs the AVX2 code on either ISA level (its numbers are the
 * same on every x86 CPU that has AVX2 and FMA). Returns 0, -EINVAL, -ENOTSUP or -ENOMEM. */
PC_API int pc_dense(const void *x, int xdtype, int M, int K, const void *W, int wdtype, const float *scales, int N,
                    const float *bias, void *y, int ydtype, int isa) {
    if (isa < 1 || isa > pc_isa()) return -ENOTSUP;
    if (M < 1 || N < 1 || K < 8 || K % 8 || wdtype < 0 || wdtype > 2 || (wdtype == 2 && !scales) ||
        (xdtype != 0 && xdtype != 1) || (ydtype != 0 && ydtype != 1) || (size_t)M * K > ((size_t)1 << 40))
        return -EINVAL;
    float *xw = NULL;
    if (xdtype) {
        size_t count = (size_t)M * K;
        xw = malloc(count * sizeof(float));
        if (!xw) return -ENOMEM;
        for (size_t i = 0; i < count; i++) xw[i] = load_x(x, i, 1);
    }
    dense_job job = {.W = W, .scales = scales, .bias = bias, .x = xw ? xw : x, .K = K, .M = M, .N = N,
                     .wdtype = wdtype, .ydtype = ydtype, .y = y};
    run(dense_task, &job, N, 8);
    free(xw);
    return 0;
}

/* ------------------------------------------------------------------ bandwidth probe */

typedef struct {
    const uint8_t *data;
    size_t bytes;
    _Atomic uint64_t sum;
} stream_t;

__attribute__((target("avx2")))
static void stream_task(void *p, int n0, int n1) {
    /* parts of 4 KiB pages: [n0, n1) pages, 4 independent accumulators so the loads, not the adds, set the pace */
    stream_t *st = p;
    size_t a = (size_t)n0 * 4096, b = (size_t)n1 * 4096;
    if (b > st->bytes) b = st->bytes;
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    size_t i = a;
    for (; i + 128 <= b; i += 128) {
        acc0 = _mm256_xor_si256(acc0, _mm256_loadu_si256((const __m256i *)(st->data + i)));
        acc1 = _mm256_xor_si256(acc1, _mm256_loadu_si256((const __m256i *)(st->data + i + 32)));
        acc2 = _mm256_xor_si256(acc2, _mm256_loadu_si256((const __m256i *)(st->data + i + 64)));
        acc3 = _mm256_xor_si256(acc3, _mm256_loadu_si256((const __m256i *)(st->data + i + 96)));
    }
    acc0 = _mm256_xor_si256(_mm256_xor_si256(acc0, acc1), _mm256_xor_si256(acc2, acc3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc0);
    uint64_t sum = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
    for (; i < b; i++) sum ^= st->data[i];
    atomic_fetch_xor(&st->sum, sum);
}

/* Reads bytes [0, bytes) of data once with the pool's threads (a bandwidth probe: the benchmark times it over a
 * file-backed mapping); returns the xor of its 8-byte words, so the reads cannot be left out. Needs AVX2. */
PC_API uint64_t pc_stream(const void *data, size_t bytes) {
    stream_t st = {.data = data, .bytes = bytes, .sum = 0};
    size_t pages = (bytes + 4095) / 4096;
    if (pages > INT32_MAX || pc_isa() < 1) return 0;
    run(stream_task, &st, (int)pages, 1);
    return atomic_load(&st.sum);
}

/* ------------------------------------------------------------------ import stub */

#ifdef PC_PYTHON_MODULE
/* Built by setup.py as the extension module packcache._kernels, so pip compiles and installs it like any other;
 * the module itself is empty: packcache.native loads this file with ctypes and calls the pc_* functions. */
#include <Python.h>
static struct PyModuleDef pc_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                       "packcache's compiled kernels (loaded by packcache.native through ctypes).",
                                       -1, NULL, NULL, NULL, NULL, NULL};
PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&pc_module); }
#endif
