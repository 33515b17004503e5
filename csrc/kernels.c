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
 *   pc_int4  W int4 codes [N, K/2 bytes], row-major in units of 64 input features, with bfloat16 (scale, zero) pairs
 *            per row and group (packcache's torch.int4wo layout, version 3). x is quantised per row in blocks of 32
 *            (llama.cpp's Q8_0 activations); the
 *            codes times the activation codes on AVX2 (vpmaddubsw + vpmaddwd), the zeros against exact group sums
 *            of x, at every row count, on both ISA levels.
 *   pc_dense W float32, bfloat16 or int8 [N, K], x widened to float32, FMA: the fallback of every scheme.
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

PC_API int pc_abi_version(void) { return 5; }

/* ------------------------------------------------------------------ activation quantisation (scalar) */

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

/* ------------------------------------------------------------------ int4 (packcache's row-major layout) */

/* torch.int4wo version 3: the codes 0..15 of W [N, K], row-major, 4 bits each. Each row is cut into units of 64
 * input features (32 bytes) whose byte j holds feature j in its low nibble and feature j + 32 in its high nibble;
 * where K % 64 == 32 the row ends in a unit of 32 features (16 bytes) laid out alike (features j and j + 16).
 * Masking a unit's low nibbles gives its first block of 32 codes in feature order, shifting down 4 and masking its
 * second: two instructions per block and no shuffles, where torch's layout took 16 unpacks per 128 bytes. Weight =
 * code * scale + offset, offset = zero - 8 * scale, with a bfloat16 (scale, zero) pair per row and group of input
 * features (sz [N, K/group, 2]), so a decode step reads the codes and the pairs as two sequential streams.
 *
 * x is quantised per row in blocks of 32 (quantize_row32: llama.cpp's Q8_0 activations, which its Q4_0 product
 * multiplies; the int4 weights' own error is some 20 times the activations'), and each block's exact float32 sum is
 * kept (bsum, in feature order). Output (activation row i, weight row n) is then, per block b of 32 features:
 *   T_b = the exact int32 sum of code x activation code over the block (vpmaddubsw: unsigned codes times signed
 *         activations, every partial sum fits its integer lanes exactly),
 *   P_{b % 8} = fma(offset_{n,b}, bsum_{i,b}, fma(float(T_b), scale_{n,b} * ascale_{i,b}, P_{b % 8})),
 * eight float32 partials P_0 .. P_7 (from +0, blocks in increasing order), the output ((P0 + P4) + (P2 + P6)) +
 * ((P1 + P5) + (P3 + P7)) (hsum256's order), plus the bias. One row (int4_row) reaches the T_b by adding a block's
 * lanes and keeps P in the lanes of one vector; more rows (the tiles) reach them with eight outputs per vector and
 * keep P in memory: the same operations on the same values, so a row's bits do not depend on the rows beside it. */

/* One row of x [K] (K a multiple of 32) to int8 codes q [K], a scale per block of 32 (scale [K/32]) and the block's
 * exact sum (sum [K/32], features in order): scale = amax / 127, codes = round half to even (the default MXCSR mode)
 * of x * (1 / scale), clipped to +-127 (an all-zero block: scale 0, codes 0). */
__attribute__((target("avx2,fma,f16c")))
static void quantize_row32(const float *x, int K, int8_t *q, float *scale, float *sum) {
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
        const float s = _mm_cvtss_f32(h) / 127.0f;
        const __m256 inv = _mm256_set1_ps(s > 0 ? 1.0f / s : 0.0f);
        __m256i c[4];
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), top), bottom);
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + b), _mm256_permutevar8x32_epi32(packed, order));
        float total = 0.0f;
        for (int k = b; k < b + QBLOCK; k++) total += x[k];
        scale[b / QBLOCK] = s;
        sum[b / QBLOCK] = total;
    }
}

#define INT4_LOW _mm256_set1_epi8(0x0f)
#define INT4_FIRST(v) _mm256_and_si256(v, INT4_LOW)
#define INT4_SECOND(v) _mm256_and_si256(_mm256_srli_epi16(v, 4), INT4_LOW)
/* The 32 codes of a row's last unit of 32 features (16 bytes at p). */
#define INT4_HALF_UNIT(p)                                                                                         \
    _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p))),       \
                                             _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(p)), 4), 1),        \
                     INT4_LOW)

/* Block b's 32 codes (feature order) of a weight row w of K features. */
__attribute__((target("avx2,fma,f16c")))
static inline __m256i int4_block_codes(const uint8_t *w, size_t K, size_t b) {
    const size_t unit = b >> 1;
    if ((unit + 1) * 64 > K) return INT4_HALF_UNIT(w + unit * 32); /* the row's last 32 features */
    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + unit * 32));
    return b & 1 ? INT4_SECOND(v) : INT4_FIRST(v);
}

/* The exact totals of eight blocks' int32 lane sums d[0..7] (eight lanes each): lane t of the result is block t's. */
__attribute__((target("avx2,fma,f16c")))
static inline __m256i int4_totals(const __m256i d[8]) {
    __m256i a[4], b[2];
    for (int t = 0; t < 4; t++)
        a[t] = _mm256_add_epi32(_mm256_unpacklo_epi32(d[2 * t], d[2 * t + 1]), _mm256_unpackhi_epi32(d[2 * t], d[2 * t + 1]));
    for (int t = 0; t < 2; t++)
        b[t] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[2 * t], a[2 * t + 1]), _mm256_unpackhi_epi64(a[2 * t], a[2 * t + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20), _mm256_permute2x128_si256(b[0], b[1], 0x31));
}

/* Eight (scale, zero) pairs (lane: scale bits | zero bits << 16) as the scales and the offsets zero - 8 * scale (one
 * rounding). */
#define INT4_SCALES(p) _mm256_castsi256_ps(_mm256_slli_epi32(p, 16))
#define INT4_OFFSETS(p)                                                                                           \
    _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), INT4_SCALES(p),                                                        \
                     _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32((int)0xffff0000u))))

/* One weight row (w, its pairs szn) times one activation row (q, block scales as, block sums bs): a decode step's
 * product, each weight row read as a sequential stream. Eight blocks (256 features) at a time: their exact int32
 * totals (int4_totals), converted and multiplied-added with their scale products onto eight lanes, then the offsets
 * times the block sums (lane t takes the blocks b % 8 == t), the lanes added as hsum256 does. comb and ofs: scratch
 * for K/32 rounded up to 8 floats each, the scale products and offsets where the loop does not make them (groups
 * past 32, the last span; zero past the last block: those lanes then add fma(0, 0, P) = P). */
__attribute__((target("avx2,fma,f16c")))
static float int4_row(const uint8_t *w, const uint16_t *szn, size_t K, int per_group_log2, const int8_t *q,
                      const float *as, const float *bs, float *comb, float *ofs) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t blocks = K / QBLOCK, spans = (blocks + 7) / 8;
    /* group 32: whole spans make their scale products and offsets from the pairs in the loop below */
    for (size_t b = per_group_log2 == 0 ? blocks / 8 * 8 : 0; b < spans * 8; b++) {
        if (b >= blocks) {
            comb[b] = ofs[b] = 0.0f;
            continue;
        }
        const size_t g = b >> per_group_log2;
        const __m256i p = _mm256_set1_epi32((int)((uint32_t)szn[2 * g] | (uint32_t)szn[2 * g + 1] << 16));
        comb[b] = _mm256_cvtss_f32(_mm256_mul_ps(INT4_SCALES(p), _mm256_set1_ps(as[b])));
        ofs[b] = _mm256_cvtss_f32(INT4_OFFSETS(p));
    }
    __m256 acc = _mm256_setzero_ps();
    for (size_t s = 0; s < spans; s++) {
        __m256i d[8];
        const size_t k = s * 256;
        if (k + 256 <= K) { /* four whole units */
            _mm_prefetch((const char *)(w + k / 2) + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + k / 2) + PREFETCH + 64, _MM_HINT_T0);
            for (int u = 0; u < 4; u++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k / 2 + 32 * u));
                d[2 * u] = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(INT4_FIRST(v), _mm256_loadu_si256((const __m256i *)(q + k + 64 * u))), ones);
                d[2 * u + 1] = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(INT4_SECOND(v), _mm256_loadu_si256((const __m256i *)(q + k + 64 * u + 32))),
                    ones);
            }
        } else { /* the row's last blocks */
            for (int t = 0; t < 8; t++) {
                const size_t bt = s * 8 + t;
                d[t] = bt < blocks ? _mm256_madd_epi16(_mm256_maddubs_epi16(int4_block_codes(w, K, bt),
                                                                            _mm256_loadu_si256((const __m256i *)(q + bt * QBLOCK))),
                                                       ones)
                                   : _mm256_setzero_si256();
            }
        }
        __m256 scale, offset, sums;
        if (s * 8 + 8 <= blocks) {
            sums = _mm256_loadu_ps(bs + s * 8);
            if (per_group_log2 == 0) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)(szn + 16 * s));
                scale = _mm256_mul_ps(INT4_SCALES(p), _mm256_loadu_ps(as + s * 8));
                offset = INT4_OFFSETS(p);
            } else {
                scale = _mm256_loadu_ps(comb + s * 8);
                offset = _mm256_loadu_ps(ofs + s * 8);
            }
        } else { /* the last blocks, zeros past them */
            float tail[8] = {0};
            memcpy(tail, bs + s * 8, (blocks - s * 8) * sizeof(float));
            sums = _mm256_loadu_ps(tail);
            scale = _mm256_loadu_ps(comb + s * 8);
            offset = _mm256_loadu_ps(ofs + s * 8);
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int4_totals(d)), scale, acc);
        acc = _mm256_fmadd_ps(offset, sums, acc);
    }
    return hsum256(acc);
}

/* Several activation rows: a tile of up to INT4_TILE_VECTORS * 8 weight rows (64 outputs), eight per vector, the
 * lanes of each vector eight outputs. Per block the tile's codes are laid out once (int4_tile_codes: vector (kq, v) holds,
 * in lane r, the four codes of features 4 kq .. 4 kq + 3 of output 8 v + r), and its scales and offsets gathered;
 * then each activation row multiplies the codes by its four codes of each kq broadcast (vpmaddubsw, int16 sums,
 * then one vpmaddwd): the block's exact totals T_b for eight outputs per vector, and the partials P [rows][8][v]
 * take int4_row's two fused multiply-adds, lane for lane. */
#define INT4_TILE_VECTORS 8
#define INT4_TILE_ROWS (8 * INT4_TILE_VECTORS)

/* An 8 x 8 transpose of 32-bit lanes: lane i of t[kq] becomes r[i]'s lane kq. */
__attribute__((target("avx2,fma,f16c")))
static inline void int4_transpose(const __m256i r[8], __m256i out[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int kq = 0; kq < 4; kq++) {
        out[kq] = _mm256_permute2x128_si256(u[kq], u[4 + kq], 0x20);
        out[kq + 4] = _mm256_permute2x128_si256(u[kq], u[4 + kq], 0x31);
    }
}

/* Both blocks of a whole unit (features 64 unit .. 64 unit + 63) of weight rows [n, n + 8 * nv) (rows past N as
 * zeros) as 8 x nv vectors each, first[kq * nv + v] and second[kq * nv + v]: the unit's bytes are transposed once, and
 * the low nibbles of a transposed lane are its first block's four codes, the high nibbles its second block's. */
__attribute__((target("avx2,fma,f16c")))
static void int4_tile_unit_codes(const uint8_t *W, size_t K, int N, int n, int nv, size_t unit, __m256i *first,
                                 __m256i *second) {
    for (int v = 0; v < nv; v++) {
        __m256i r[8], t[8];
        for (int i = 0; i < 8; i++) {
            const int row = n + 8 * v + i;
            r[i] = row < N ? _mm256_loadu_si256((const __m256i *)(W + (size_t)row * (K / 2) + unit * 32))
                           : _mm256_setzero_si256();
        }
        int4_transpose(r, t);
        for (int kq = 0; kq < 8; kq++) {
            first[kq * nv + v] = INT4_FIRST(t[kq]);
            second[kq * nv + v] = INT4_SECOND(t[kq]);
        }
    }
}

/* Block b's codes of weight rows [n, n + 8 * nv) (rows past N as zeros) as 8 x nv vectors: codes[kq * nv + v]. For
 * a row's last 32 features, a half unit. */
__attribute__((target("avx2,fma,f16c")))
static void int4_tile_codes(const uint8_t *W, size_t K, int N, int n, int nv, size_t b, __m256i *codes) {
    for (int v = 0; v < nv; v++) {
        __m256i r[8], t[8];
        for (int i = 0; i < 8; i++) {
            const int row = n + 8 * v + i;
            r[i] = row < N ? int4_block_codes(W + (size_t)row * (K / 2), K, b) : _mm256_setzero_si256();
        }
        int4_transpose(r, t);
        for (int kq = 0; kq < 8; kq++) codes[kq * nv + v] = t[kq];
    }
}

/* One block of a tile of NV vectors of outputs for mrows activation rows (codes; the outputs' scales ws and offsets
 * os; the rows' codes q, block scales as and block sums bs, a row's K, K/32 and K/32 apart; the partials of block
 * b % 8, part, a row's 8 * NV vectors apart). A row at a time: each broadcast of its four codes serves NV vectors. */
#define INT4_TILE_BLOCK(NV)                                                                                       \
    __attribute__((target("avx2,fma,f16c"))) static void int4_tile_block_##NV(                                    \
        const __m256i *codes, const __m256 *ws, const __m256 *os, const int8_t *q, const float *as,               \
        const float *bs, size_t K, size_t blocks, int mrows, __m256 *part) {                                      \
        const __m256i ones = _mm256_set1_epi16(1);                                                               \
        for (int m = 0; m < mrows; m++) {                                                                        \
            /* the codes are read from L1 at each use: left free, the compiler hoists all 8 x NV out of the loop \
             * and, short of registers, spills them to the stack */                                              \
            const __m256i *cm = codes;                                                                           \
            __asm__("" : "+r"(cm));                                                                              \
            /* int16 sums over the block's eight kq: each vpmaddubsw lane is at most 2 * 15 * 127 = 3810, eight of \
             * them 30480, so they fit int16 exactly, and one vpmaddwd makes the int32 totals */                 \
            __m256i sum[NV];                                                                                     \
            for (int v = 0; v < NV; v++) sum[v] = _mm256_setzero_si256();                                        \
            for (int kq = 0; kq < 8; kq++) {                                                                     \
                int32_t four;                                                                                    \
                memcpy(&four, q + (size_t)m * K + 4 * kq, 4);                                                    \
                const __m256i act = _mm256_set1_epi32(four);                                                     \
                for (int v = 0; v < NV; v++) {                                                                   \
                    sum[v] = _mm256_add_epi16(sum[v], _mm256_maddubs_epi16(_mm256_load_si256(cm + kq * NV + v), act)); \
                    /* each step's sum kept in a register as it goes: left free, the compiler computes all the   \
                     * products first and spills them (integer adds may be reordered) */                         \
                    __asm__("" : "+x"(sum[v]));                                                                  \
                }                                                                                                \
            }                                                                                                    \
            const __m256 a = _mm256_set1_ps(as[(size_t)m * blocks]), s = _mm256_set1_ps(bs[(size_t)m * blocks]); \
            __m256 *p = part + (size_t)m * 8 * NV;                                                               \
            for (int v = 0; v < NV; v++) {                                                                       \
                const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[v], ones)),            \
                                                 _mm256_mul_ps(ws[v], a), p[v]);                                 \
                p[v] = _mm256_fmadd_ps(os[v], s, t);                                                             \
            }                                                                                                    \
        }                                                                                                        \
    }

INT4_TILE_BLOCK(1)
INT4_TILE_BLOCK(2)
INT4_TILE_BLOCK(3)
INT4_TILE_BLOCK(4)
INT4_TILE_BLOCK(5)
INT4_TILE_BLOCK(6)
INT4_TILE_BLOCK(7)
INT4_TILE_BLOCK(8)

/* Activation rows a tile passes before the next tile: 48 rows' partials (48 x 8 x 8 vectors, 96 KiB) stay in L2. */
#define INT4_M_BLOCK 48
/* Weight rows ahead whose scale pairs a decode step prefetches: each row starts by reading its pairs (a second
 * stream, a quarter of the codes' bytes), and a demand miss there stalls the row. */
#define INT4_SZ_AHEAD 4

typedef struct {
    float *comb, *ofs; /* one row: K/32 rounded up to 8 each */
    __m256 *part;      /* more rows: INT4_M_BLOCK * 8 * INT4_TILE_VECTORS */
    __m256i *codes;    /* a unit's two blocks: 2 * 8 * INT4_TILE_VECTORS */
} int4_scratch;

/* Output columns [n0, n1) for the M rows of quantised x (block scales as and block sums bs, [M, K/32] each). One row
 * (a decode step): int4_row for one weight row after the other. More: blocks of INT4_M_BLOCK rows, and in each
 * tiles of INT4_TILE_ROWS weight rows, a block of 32 features at a time (two rows cost the same either way). */
__attribute__((target("avx2,fma,f16c")))
static void int4_columns(const uint8_t *W, const uint16_t *sz, const float *bias, int K, int group, int M,
                         const int8_t *q, const float *as, const float *bs, const int4_scratch *sc, void *y,
                         int ydtype, int N, int n0, int n1) {
    const size_t groups = (size_t)K / group, half_k = (size_t)K / 2, blocks = (size_t)K / QBLOCK;
    const int per_group_log2 = __builtin_ctz((unsigned)(group / QBLOCK)); /* blocks per group: 1, 2, 4 */
    if (M == 1) {
        for (int n = n0; n < n1; n++) {
            const uint16_t *szn = sz + (size_t)n * groups * 2;
            const uint8_t *w = W + (size_t)n * half_k;
            if (n + 1 < n1) prefetch_next_row(w + half_k);
            if (n + INT4_SZ_AHEAD < n1) {
                const char *ahead = (const char *)(szn + (size_t)INT4_SZ_AHEAD * groups * 2);
                for (size_t b = 0; b < groups * 4; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
            }
            const float v = int4_row(w, szn, (size_t)K, per_group_log2, q, as, bs, sc->comb, sc->ofs);
            store(y, (size_t)n, bias ? v + bias[n] : v, ydtype);
        }
        return;
    }
    for (int mb = 0; mb < M; mb += INT4_M_BLOCK) {
        const int mrows = M - mb < INT4_M_BLOCK ? M - mb : INT4_M_BLOCK;
        for (int n = n0; n < n1; n += INT4_TILE_ROWS) {
            const int nv = (n1 - n < INT4_TILE_ROWS ? n1 - n + 7 : INT4_TILE_ROWS) / 8;
            for (int i = 0; i < mrows * 8 * nv; i++) sc->part[i] = _mm256_setzero_ps();
            /* the tile's (scale, zero) pairs of eight groups from group base, transposed: pairs[j * nv + v] holds group
             * base + j of the eight rows of vector v (rows past n1 and groups past the last: zeros) */
            __m256i pairs[8 * INT4_TILE_VECTORS];
            size_t base = SIZE_MAX;
            for (size_t b = 0; b < blocks; b++) {
                const __m256i *codes = sc->codes;
                if ((b / 2 + 1) * 64 > (size_t)K) /* the row's last 32 features, a half unit */
                    int4_tile_codes(W, (size_t)K, n1, n, nv, b, sc->codes);
                else if (b & 1) /* the unit's second block, laid out with its first */
                    codes = sc->codes + 8 * INT4_TILE_VECTORS;
                else
                    int4_tile_unit_codes(W, (size_t)K, n1, n, nv, b / 2, sc->codes, sc->codes + 8 * INT4_TILE_VECTORS);
                const size_t g = b >> per_group_log2;
                if (g < base || g >= base + 8) {
                    base = g / 8 * 8;
                    for (int v = 0; v < nv; v++) {
                        __m256i r[8], t[8];
                        for (int i = 0; i < 8; i++) {
                            const int row = n + 8 * v + i;
                            if (row >= n1) {
                                r[i] = _mm256_setzero_si256();
                            } else if (base + 8 <= groups) {
                                r[i] = _mm256_loadu_si256((const __m256i *)(sz + ((size_t)row * groups + base) * 2));
                            } else { /* the row's last groups */
                                uint16_t last[16] = {0};
                                memcpy(last, sz + ((size_t)row * groups + base) * 2, (groups - base) * 4);
                                r[i] = _mm256_loadu_si256((const __m256i *)last);
                            }
                        }
                        int4_transpose(r, t);
                        for (int j = 0; j < 8; j++) pairs[j * nv + v] = t[j];
                    }
                }
                __m256 ws[INT4_TILE_VECTORS], os[INT4_TILE_VECTORS];
                for (int v = 0; v < nv; v++) {
                    const __m256i p = pairs[(g - base) * nv + v];
                    ws[v] = INT4_SCALES(p);
                    os[v] = INT4_OFFSETS(p);
                }
                const int8_t *qb = q + (size_t)mb * K + b * QBLOCK;
                const float *ab = as + (size_t)mb * blocks + b, *sb = bs + (size_t)mb * blocks + b;
                __m256 *pb = sc->part + (b & 7) * nv;
                switch (nv) {
                    case 8: int4_tile_block_8(codes, ws, os, qb, ab, sb, (size_t)K, blocks, mrows, pb); break;
                    case 7: int4_tile_block_7(codes, ws, os, qb, ab, sb, (size_t)K, blocks, mrows, pb); break;
                    case 6: int4_tile_block_6(codes, ws, os, qb, ab, sb, (size_t)K, blocks, mrows, pb); break;
                    case 5: int4_tile_block_5(codes, ws, os, qb, ab, sb, (size_t)K, blocks, mrows, pb); break;
                    case 4: int4_tile_block_4(codes, ws, os, qb, ab, sb, (size_t)K, blocks, mrows, pb); break;
                    case 3: int4_tile_block_3(codes, ws, os, qb, ab, sb, (size_t)K, blocks, mrows, pb); break;
                    case 2: int4_tile_block_2(codes, ws, os, qb, ab, sb, (size_t)K, blocks, mrows, pb); break;
                    default: int4_tile_block_1(codes, ws, os, qb, ab, sb, (size_t)K, blocks, mrows, pb); break;
                }
            }
            for (int m = 0; m < mrows; m++)
                for (int v = 0; v < nv; v++) {
                    const __m256 *p = sc->part + (size_t)m * 8 * nv + v;
                    /* hsum256's order over the partials */
                    const __m256 total = _mm256_add_ps(
                        _mm256_add_ps(_mm256_add_ps(p[0 * nv], p[4 * nv]), _mm256_add_ps(p[2 * nv], p[6 * nv])),
                        _mm256_add_ps(_mm256_add_ps(p[1 * nv], p[5 * nv]), _mm256_add_ps(p[3 * nv], p[7 * nv])));
                    float out[8];
                    _mm256_storeu_ps(out, total);
                    for (int i = 0; i < 8 && n + 8 * v + i < n1; i++) {
                        const int col = n + 8 * v + i;
                        store(y, (size_t)(mb + m) * N + col, bias ? out[i] + bias[col] : out[i], ydtype);
                    }
                }
        }
    }
}

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
    int K, group, M, N, ydtype;
    const int8_t *q;
    const float *as, *bs;
    void *y;
    int failed; /* a thread could not allocate its scratch */
} int4_job;

/* 32-byte aligned scratch of at least bytes (rounded up to 32, as aligned_alloc needs). */
static void *aligned_scratch(size_t bytes) { return aligned_alloc(32, (bytes + 31) / 32 * 32); }

static void int4_task(void *p, int n0, int n1) {
    int4_job *j = p;
    const size_t padded = ((size_t)j->K / QBLOCK + 7) / 8 * 8;
    const int many = j->M > 1;
    int4_scratch sc = {
        .comb = many ? NULL : malloc(padded * sizeof(float)),
        .ofs = many ? NULL : malloc(padded * sizeof(float)),
        .part = many ? aligned_scratch(INT4_M_BLOCK * 8 * INT4_TILE_VECTORS * sizeof(__m256)) : NULL,
        .codes = many ? aligned_scratch(2 * 8 * INT4_TILE_VECTORS * sizeof(__m256i)) : NULL,
    };
    if (many ? !sc.part || !sc.codes : !sc.comb || !sc.ofs) {
#pragma omp atomic write
        j->failed = 1;
    } else {
        int4_columns(j->W, j->sz, j->bias, j->K, j->group, j->M, j->q, j->as, j->bs, &sc, j->y, j->ydtype, j->N, n0, n1);
    }
    free(sc.comb), free(sc.ofs), free(sc.part), free(sc.codes);
}

/* y [M, N] = (x [M, K] * in_scales [K]) @ W^T + bias [N] for an int4 pack in packcache's row-major layout (W uint8
 * [N, K/2], see "int4" above) with bf16 (scale, zero) pairs sz [N, K/group, 2]. x and y float32 (0) or bfloat16 (1);
 * in_scales and bias (each may be NULL) float32. The activations are quantised per row in blocks of 32
 * (quantize_row32), each row on its own. K % group == 0, group a power of 2 >= 32, any M, N >= 1: a row's bits are
 * the same alone and among any rows (one answer per input). The AVX2 code runs on either ISA level. Returns as
 * pc_int8. */
PC_API int pc_int4(const void *x, int xdtype, int M, int K, const uint8_t *W, const uint16_t *sz, int N, int group,
                   const float *in_scales, const float *bias, void *y, int ydtype, int isa) {
    if (isa < 1 || isa > pc_isa()) return -ENOTSUP;
    if (M < 1 || N < 1 || group < QBLOCK || (group & (group - 1)) || K < group || K % group || (xdtype != 0 && xdtype != 1) ||
        (ydtype != 0 && ydtype != 1) || (size_t)M * K > ((size_t)1 << 40) || (size_t)N * (K / group) > INT32_MAX)
        return -EINVAL;
    const size_t blocks = (size_t)K / QBLOCK;
    int8_t *q = malloc((size_t)M * K);
    float *as = malloc((size_t)M * blocks * sizeof(float)), *bs = malloc((size_t)M * blocks * sizeof(float));
    float *row = malloc((size_t)K * sizeof(float));
    if (!q || !as || !bs || !row) {
        free(q), free(as), free(bs), free(row);
        return -ENOMEM;
    }
    for (int m = 0; m < M; m++) {
        for (int k = 0; k < K; k++) {
            float v = load_x(x, (size_t)m * K + k, xdtype);
            row[k] = in_scales ? v * in_scales[k] : v;
        }
        quantize_row32(row, K, q + (size_t)m * K, as + (size_t)m * blocks, bs + (size_t)m * blocks);
    }
    int4_job job = {.W = W, .sz = sz, .bias = bias, .K = K, .group = group, .M = M, .N = N, .ydtype = ydtype, .q = q,
                    .as = as, .bs = bs, .y = y, .failed = 0};
    run(int4_task, &job, N, 8);
    free(q), free(as), free(bs), free(row);
    return job.failed ? -ENOMEM : 0;
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
