/* y = x Wᵀ (+ b) in fp32 on an x86 CPU with AVX2 + FMA, for the few rows a decode or a
 * speculative verify sends (python_backend/dspark/runtime/cpu_gemm.py builds and calls it;
 * `F.linear` is its reference).
 *
 * The weight is read once per call, as [N/16, K, 16] column blocks (`rows_gemm_pack`), and
 * each block is applied to the rows 4 to 6 at a time from L1/L2 (1 to 3 rows run 4 or 2 blocks
 * at once: enough FMA chains to hide the FMA latency) while the next blocks are prefetched.
 * Every output is ONE fp32 FMA chain over k = 0..K-1 in order, whatever the row count or the
 * row's place in the batch: a row's result is bit-identical in a 1-row decode and in an 8-row
 * verify (batch invariance). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NB 16 /* output columns per block: two 8-float vectors */
#define MR 6  /* rows per register tile: 12 accumulators + 2 weight vectors + 1 broadcast */

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

/* rows 0..mr-1 of x and y, column blocks b..b+nb-1: 2·mr·nb accumulators, one per 8 outputs.
 * mr and nb are constants at each call site (the loops unroll; the accumulators stay in
 * registers). A decode's single row takes 4 blocks at once: one block gives only 2 FMA chains,
 * too few to hide the FMA latency. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *wp, const float *bias,
                                                       float *y, int64_t n, int64_t k, int64_t b, int mr,
                                                       int nb) {
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
    const float *next = wp + (b + nb) * k * NB;
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 w[8];
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++)
            if (j < ahead) _mm_prefetch((const char *)(next + (j * k + kk) * NB), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int j = 0; j < 2 * nb; j++) w[j] = _mm256_loadu_ps(wp + ((b + j / 2) * k + kk) * NB + (j % 2) * 8);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            __m256 xr = _mm256_broadcast_ss(x + r * k + kk);
#pragma GCC unroll 8
            for (int j = 0; j < 2 * nb; j++) acc[r * 2 * nb + j] = _mm256_fmadd_ps(xr, w[j], acc[r * 2 * nb + j]);
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

#define ROWS(R) tile(x + r * k, wp, bias, y + r * n, n, k, b, R, 1)

/* every row of one column block b, in tiles as even as they come (m = 9: 5 + 4, not 6 + 3): a
 * tile of fewer than 4 rows has too few FMA chains to hide the FMA latency */
static void column_block(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t n,
                         int64_t k, int64_t b) {
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
 * column blocks (OpenMP). One, two or three rows run 4, 2 or 2 column blocks at a time. */
void rows_gemm(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t n,
               int64_t k, int threads) {
    int64_t blocks = (n + NB - 1) / NB, group = m == 1 ? 4 : m <= 3 ? 2 : 1;
    int64_t groups = blocks / group;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t b = g * group;
        if (m == 1)
            tile(x, wp, bias, y, n, k, b, 1, 4);
        else if (m == 2)
            tile(x, wp, bias, y, n, k, b, 2, 2);
        else if (m == 3)
            tile(x, wp, bias, y, n, k, b, 3, 2);
        else
            column_block(x, wp, bias, y, m, n, k, b);
    }
    for (int64_t b = groups * group; b < blocks; b++) column_block(x, wp, bias, y, m, n, k, b);
}
