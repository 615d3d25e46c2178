/* y = x Wᵀ (+ b) with bf16 x, W and y on an x86 CPU with AVX512-BF16, for the rows a decode, a
 * speculative verify or a batched step sends (python_backend/dspark/runtime/cpu_gemm.py builds and
 * calls it as `DotBf16Linear`; `F.linear` is its reference).
 *
 * The weight is read once per call, as [N/64, K/2, 64, 2] column groups (`bf16_dot_pack`): for
 * each pair of k, the 64 columns' two weights sit side by side, so one 64-byte load holds what one
 * VDPBF16PS needs for 16 columns. A group's 4 × 16 columns are applied to up to 6 rows at a time
 * (24 accumulators). 1 to 3 rows are memory-bound and stream at the hardware prefetcher's pace (a
 * software prefetch measured slower at 1 row on an AMD EPYC). 4 to 6 rows in one tile do 16 to 24
 * VDPBF16PS per 256 bytes of weights, enough that the demand stream slows under the arithmetic:
 * they prefetch NTA_AHEAD k pairs ahead, non-temporal (the weights are read once; into L1 only,
 * the L2 and the L3 keep the KV caches and the drafter's weights), a 6-token verify of SmolLM2
 * 1.07-1.12x faster on an AMD EPYC (paired, ad hoc). From 7 rows a group takes two tiles or more,
 * the ones after the first reading it from L2 and bound by VDPBF16PS, and the hardware prefetcher,
 * which follows misses, idles under them: the first two tiles prefetch the next group into L2
 * (`rows_of_group`), so its stream overlaps their arithmetic (8 rows of SmolLM2's projections
 * 17.5 -> 13.7 ms on an AMD EPYC, 16 rows 25.8 -> 22.8; an L1 hint measured 1.2x slower).
 *
 * VDPBF16PS adds x[2p]·w[2p] + x[2p+1]·w[2p+1] to the fp32 accumulator of each output, for
 * p = 0..K/2-1 in order: ONE chain per output, whatever the row count or the row's place in the
 * batch, so a row's result is bit-identical in a 1-row decode and in an 8-row verify (batch
 * invariance). The fp32 sum (+ bias) is rounded to bf16 once, to nearest even, as F.linear's
 * bf16 output is. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define GC 64 /* output columns per group: 4 vectors of 16 fp32 accumulators */
#define MR 6  /* rows per register tile: 24 accumulators + 4 weight vectors + 1 broadcast */
#define NTA_AHEAD 32 /* k pairs (8 KB of a group) a one-tile pass of 4 to 6 rows prefetches ahead */

/* wp [ceil(N/64), K/2, 64, 2] <- w [N, K] bf16, K even (columns past N zero) */
void bf16_dot_pack(const uint16_t *w, uint16_t *wp, int64_t n, int64_t k) {
    int64_t groups = (n + GC - 1) / GC, pairs = k / 2;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t j = 0; j < GC; j++) {
                int64_t col = g * GC + j;
                uint16_t *out = wp + ((g * pairs + p) * GC + j) * 2;
                out[0] = col < n ? w[col * k + 2 * p] : 0;
                out[1] = col < n ? w[col * k + 2 * p + 1] : 0;
            }
}

/* rows 0..mr-1 of x [mr, K] and y [mr, N] over group g (its packed weights at w); mr is a constant
 * at each call site, so the loops unroll and the accumulators stay in registers. pf (or NULL): the
 * next group's packed weights, of which this tile prefetches cache lines pf_line and pf_line + 1
 * of each k pair's four (the tiles that read a group again from L2 are bound by VDPBF16PS, and the
 * memory would idle under them; into L2: 4 × 16 columns of K/2 pairs do not fit L1) */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *w, const float *bias,
                                                       uint16_t *y, int64_t n, int64_t k, int64_t g, int mr,
                                                       const uint16_t *pf, int pf_line) {
    __m512 acc[MR * 4];
#pragma GCC unroll 24
    for (int i = 0; i < 4 * mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        __m512i wv[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) wv[j] = _mm512_loadu_si512((const void *)(w + (p * GC + j * 16) * 2));
#ifndef BF16_DOT_NO_PREFETCH
        if (!pf && mr >= 4) /* past the group's end: the next group's first pairs (no fault) */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)(w + ((p + NTA_AHEAD) * GC + j * 16) * 2), _MM_HINT_NTA);
        if (pf) {
            _mm_prefetch((const char *)(pf + (p * GC + pf_line * 16) * 2), _MM_HINT_T1);
            _mm_prefetch((const char *)(pf + (p * GC + (pf_line + 1) * 16) * 2), _MM_HINT_T1);
        }
#endif
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * k + 2 * p, sizeof pair);
            __m512i xb = _mm512_set1_epi32((int)pair);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                acc[r * 4 + j] = _mm512_dpbf16_ps(acc[r * 4 + j], (__m512bh)wv[j], (__m512bh)xb);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        int64_t c0 = g * GC + j * 16, cols = n - c0 < 16 ? n - c0 : 16;
        if (cols <= 0) break;
        __mmask16 mask = (__mmask16)((1u << cols) - 1);
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r * 4 + j], b));
            _mm256_mask_storeu_epi16(y + r * n + c0, mask, (__m256i)out);
        }
    }
}

/* every row over group g, in tiles of at most 6 rows, as even as they come (m = 9: 5 + 4, not
 * 6 + 3); from 7 rows the group's weights are read again from L2 by each further tile. (Tiles of
 * up to 12 rows over half a group, which read the weights from memory once, measured 1.5x slower
 * at 7-12 rows on an AMD EPYC.) With two tiles or more, the first two prefetch the next group
 * (`next`, or NULL after the last), half its lines each, so the memory streams it while they
 * compute. */
static inline __attribute__((always_inline)) void rows_of_group(const uint16_t *x, const uint16_t *w,
                                                                const float *bias, uint16_t *y, int64_t m,
                                                                int64_t n, int64_t k, int64_t g,
                                                                const uint16_t *next) {
    int64_t tiles = (m + MR - 1) / MR, r = 0;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t rows = (m - r) / (tiles - t) + ((m - r) % (tiles - t) ? 1 : 0);
        const uint16_t *xr = x + r * k, *pf = tiles > 1 && t < 2 ? next : NULL;
        uint16_t *yr = y + r * n;
        int line = 2 * (int)t;
        switch (rows) {
        case 1: tile(xr, w, bias, yr, n, k, g, 1, pf, line); break;
        case 2: tile(xr, w, bias, yr, n, k, g, 2, pf, line); break;
        case 3: tile(xr, w, bias, yr, n, k, g, 3, pf, line); break;
        case 4: tile(xr, w, bias, yr, n, k, g, 4, pf, line); break;
        case 5: tile(xr, w, bias, yr, n, k, g, 5, pf, line); break;
        default: tile(xr, w, bias, yr, n, k, g, 6, pf, line); break;
        }
        r += rows;
    }
}

/* y [M, N] = x [M, K] · wp (packed w [N, K])ᵀ + bias [N] fp32 (or NULL), K even; threads > 1
 * splits the column groups (OpenMP). */
void bf16_dot_gemm(const uint16_t *x, const uint16_t *wp, const float *bias, uint16_t *y, int64_t m, int64_t n,
                   int64_t k, int threads) {
    int64_t groups = (n + GC - 1) / GC;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *w = wp + g * (k / 2) * GC * 2;
        rows_of_group(x, w, bias, y, m, n, k, g, g + 1 < groups ? w + (k / 2) * GC * 2 : NULL);
    }
}
