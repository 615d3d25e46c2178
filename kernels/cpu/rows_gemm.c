/* y = x Wᵀ (+ b) in fp32 on an x86 CPU with AVX2 + FMA, for the few rows a decode or a
 * speculative verify sends (python_backend/dspark/runtime/cpu_gemm.py builds and calls it;
 * `F.linear` is its reference).
 *
 * The weight is read once per call, as [N/16, K, 16] column blocks (`rows_gemm_pack`), and
 * each block is applied to the rows 4 to 6 at a time from L1/L2 (1 to 3 rows run 4 or 2 blocks
 * at once: enough FMA chains to hide the FMA latency) while the next blocks are prefetched.
 * Every output is ONE fp32 FMA chain over k = 0..K-1 in order, whatever the row count or the
 * row's place in the batch: a row's result is bit-identical in a 1-row decode and in an 8-row
 * verify (batch invariance).
 *
 * A bf16 weight (`rows_gemm_bf16`) is streamed as bf16, half the bytes, and widened to fp32 in
 * registers (exact: a bf16 is the top half of an fp32); the arithmetic is the fp32 kernel's, so
 * its results are bit-identical to `rows_gemm` over the same weight widened to fp32. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 16 /* output columns per block: two 8-float vectors */
#define MR 6  /* rows per register tile: 12 accumulators + 2 weight vectors + 1 broadcast */
/* bf16 weights from this many rows are widened once per block (`widen`): on SmolLM2's shapes
 * (AVX2 AMD EPYC, 1 thread) that costs more than widening in every tile up to 2-3 tiles (8 rows
 * +10 %, 16 rows +3 %) and less from 4 (32 rows -5 %) */
#define WIDEN_MIN_ROWS 24

/* wp [ceil(N/16), K, 16] <- w [N, K] (rows past N zero) */
void rows_gemm_pack(const float *w, float *wp, int64_t n, int64_t k) {
    int64_t blocks = (n + NB - 1) / NB;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NB; j++) {
                int64_t col = b * NB + j;
                wp[(b * k + kk) * NB + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

/* wp [ceil(N/16), K, 16] bf16 <- w [N, K] fp32, rounded to nearest even (finite weights). In a
 * block's 16 the columns sit in the order `load_w`'s two unpacks take them: 0-3, 8-11, 4-7, 12-15. */
void rows_gemm_pack_bf16(const float *w, uint16_t *wp, int64_t n, int64_t k) {
    static const int slot[NB] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    int64_t blocks = (n + NB - 1) / NB;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NB; j++) {
                int64_t col = b * NB + j;
                uint32_t u = 0;
                if (col < n) memcpy(&u, &w[col * k + kk], sizeof u);
                wp[(b * k + kk) * NB + slot[j]] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
            }
}

/* the 16 weights of block row `at` (fp32 or bf16 `wp`) as two 8-float vectors: columns 0-7, 8-15.
 * A bf16 b sits in the top half of its fp32 lane: interleaving zeros below widens it exactly. */
static inline __attribute__((always_inline)) void load_w(const void *wp, int bf16, int64_t at, __m256 *lo,
                                                         __m256 *hi) {
    if (bf16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)wp + at));
        *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
        *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
    } else {
        *lo = _mm256_loadu_ps((const float *)wp + at);
        *hi = _mm256_loadu_ps((const float *)wp + at + 8);
    }
}

/* rows 0..mr-1 of x and y, column blocks b..b+nb-1: 2·mr·nb accumulators, one per 8 outputs.
 * w: block b's weights (fp32, or bf16 where `bf16`; block b+j at j·k·16); pf: the packed
 * stream's block b+nb, `pf_row` bytes per k (64 fp32, 32 bf16), prefetched while this tile
 * computes. mr and nb are constants at each call site (the loops unroll; the accumulators stay
 * in registers). A decode's single row takes 4 blocks at once: one block gives only 2 FMA
 * chains, too few to hide the FMA latency. */
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, int bf16, const char *pf,
                                                       int pf_row, const float *bias, float *y, int64_t n,
                                                       int64_t k, int64_t b, int mr, int nb) {
    __m256 acc[MR * 8];
#pragma GCC unroll 48
    for (int i = 0; i < 2 * mr * nb; i++) acc[i] = _mm256_setzero_ps();
    /* With 2+ rows a block's FMAs take longer than streaming it from DRAM, so while they run the
     * next blocks are fetched into L2 (prefetch; arithmetic unchanged): memory and compute
     * overlap instead of taking turns (4 to 7 rows: 1.24-1.31x faster, `dspark bench-cpu-gemm
     * --without-prefetch`). A decode's one row is memory-bound and streams 4 blocks at once
     * already; it runs without. */
#ifdef ROWS_GEMM_NO_PREFETCH /* a build for `dspark bench-cpu-gemm --without-prefetch` only */
    int64_t ahead = 0;
#else
    int64_t ahead = mr > 1 ? (n + NB - 1) / NB - (b + nb) : 0; /* blocks left after this tile's */
#endif
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 wv[8];
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++)
            if (j < ahead && (pf_row == 64 || kk % 2 == 0)) /* a bf16 line holds two k */
                _mm_prefetch(pf + (j * k + kk) * pf_row, _MM_HINT_T1);
#pragma GCC unroll 8
        for (int j = 0; j < nb; j++) load_w(w, bf16, (j * k + kk) * NB, &wv[2 * j], &wv[2 * j + 1]);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            __m256 xr = _mm256_broadcast_ss(x + r * k + kk);
#pragma GCC unroll 8
            for (int j = 0; j < 2 * nb; j++) acc[r * 2 * nb + j] = _mm256_fmadd_ps(xr, wv[j], acc[r * 2 * nb + j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < nb; j++) {
        int64_t c0 = (b + j) * NB, cols = n - c0 < NB ? n - c0 : NB;
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        if (bias && cols == NB) {
            b0 = _mm256_loadu_ps(bias + c0);
            b1 = _mm256_loadu_ps(bias + c0 + 8);
        }
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            __m256 lo = acc[r * 2 * nb + 2 * j], hi = acc[r * 2 * nb + 2 * j + 1];
            if (cols == NB) {
                _mm256_storeu_ps(y + r * n + c0, _mm256_add_ps(lo, b0));
                _mm256_storeu_ps(y + r * n + c0 + 8, _mm256_add_ps(hi, b1));
            } else { /* the last, partial block */
                float out[NB];
                _mm256_storeu_ps(out, lo);
                _mm256_storeu_ps(out + 8, hi);
                for (int64_t c = 0; c < cols; c++) y[r * n + c0 + c] = out[c] + (bias ? bias[c0 + c] : 0.0f);
            }
        }
    }
}

#define ROWS(R)                                                                                   \
    (wide ? tile(x + r * k, wide, 0, pf, pf_row, bias, y + r * n, n, k, b, R, 1)                   \
          : tile(x + r * k, w, bf16, pf, pf_row, bias, y + r * n, n, k, b, R, 1))

/* block `blk` of bf16 weights widened to fp32 [K, 16] (columns in order) in this thread's buffer,
 * or NULL when it cannot be allocated (the caller then reads the bf16 block itself) */
static const float *widen(const uint16_t *blk, int64_t k) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (cap < k) {
        free(buf);
        buf = aligned_alloc(32, (size_t)k * NB * sizeof(float)); /* a multiple of 32: NB floats per k */
        cap = buf ? k : 0;
        if (!buf) return NULL;
    }
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 lo, hi;
        load_w(blk, 1, kk * NB, &lo, &hi);
        _mm256_store_ps(buf + kk * NB, lo);
        _mm256_store_ps(buf + kk * NB + 8, hi);
    }
    return buf;
}

/* every row of one column block b, in tiles as even as they come (m = 9: 5 + 4, not 6 + 3): a
 * tile of fewer than 4 rows has too few FMA chains to hide the FMA latency. With bf16 weights
 * and WIDEN_MIN_ROWS rows or more, the block is widened once and every tile reads fp32 (the
 * same values, so the same bits): one widening instead of one per tile. */
static inline __attribute__((always_inline)) void column_block(const float *x, const void *wp, int bf16,
                                                               const float *bias, float *y, int64_t m,
                                                               int64_t n, int64_t k, int64_t b) {
    int pf_row = NB * (bf16 ? 2 : 4);
    const char *pf = (const char *)wp + (b + 1) * k * pf_row; /* the next block of the packed stream */
    const void *w = (const char *)wp + b * k * pf_row;
    const float *wide = bf16 && m >= WIDEN_MIN_ROWS ? widen((const uint16_t *)w, k) : NULL;
    int64_t tiles = (m + MR - 1) / MR, r = 0;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t rows = (m - r) / (tiles - t) + ((m - r) % (tiles - t) ? 1 : 0);
        switch (rows) {
        case 1: ROWS(1); break;
        case 2: ROWS(2); break;
        case 3: ROWS(3); break;
        case 4: ROWS(4); break;
        case 5: ROWS(5); break;
        default: ROWS(6); break;
        }
        r += rows;
    }
}

/* y [M, N] = x [M, K] · wp (packed w [N, K])ᵀ + bias [N] (or NULL); threads > 1 splits the
 * column blocks (OpenMP). One, two or three rows run 4, 2 or 2 column blocks at a time. Two entry
 * points, each compiled for its weight type (bf16 is a constant in every inlined tile). */
#define ROWS_GEMM(NAME, WEIGHT, BF16)                                                                       \
    void NAME(const float *x, const WEIGHT *wp, const float *bias, float *y, int64_t m, int64_t n, int64_t k, \
              int threads) {                                                                              \
        int64_t blocks = (n + NB - 1) / NB, group = m == 1 ? 4 : m <= 3 ? 2 : 1;                          \
        int64_t groups = blocks / group;                                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                \
        for (int64_t g = 0; g < groups; g++) {                                                            \
            int64_t b = g * group;                                                                        \
            const WEIGHT *w = wp + b * k * NB, *pf = w + group * k * NB;                                   \
            if (m == 1)                                                                                   \
                tile(x, w, BF16, (const char *)pf, NB * sizeof *wp, bias, y, n, k, b, 1, 4);              \
            else if (m == 2)                                                                              \
                tile(x, w, BF16, (const char *)pf, NB * sizeof *wp, bias, y, n, k, b, 2, 2);              \
            else if (m == 3)                                                                              \
                tile(x, w, BF16, (const char *)pf, NB * sizeof *wp, bias, y, n, k, b, 3, 2);              \
            else                                                                                          \
                column_block(x, wp, BF16, bias, y, m, n, k, b);                                           \
        }                                                                                                 \
        for (int64_t b = groups * group; b < blocks; b++) column_block(x, wp, BF16, bias, y, m, n, k, b); \
    }

ROWS_GEMM(rows_gemm, float, 0)      /* wp from rows_gemm_pack */
ROWS_GEMM(rows_gemm_bf16, uint16_t, 1) /* wp from rows_gemm_pack_bf16 */
