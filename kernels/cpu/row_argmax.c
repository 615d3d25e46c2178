/* Row argmax of bf16 logits on an x86 CPU with AVX512 (python_backend/dspark/runtime/cpu_argmax.py
 * builds and calls it; torch's `x.max(-1).indices` is its reference). Greedy verification takes one
 * argmax per verified row of [N, V] logits: torch's bf16 `max` reads ~1 element a cycle (about 47 us
 * a SmolLM2 row on an AMD EPYC), this one 16 at a time.
 *
 * out[i] = the first index of the largest value of row i (the first NaN, if the row has one: as
 * torch's max). Layouts: x [N, V] bf16, row stride x_stride (elements); out [N] int64. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* the bf16 values x[m] (m: the lanes to load, others 0) -> fp32 (exact: a bf16 is the top half of an fp32) */
static inline __m512 widen(const uint16_t *x, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x)), 16));
}

/* round fp32 lanes to bf16, to nearest even, as torch stores a bf16 sum (finite values) */
static inline __m512 round_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* the first index of the largest x[j] (b NULL) or bf16(x[j] + b[j]), j < v; the first NaN's if any */
static int64_t argmax_row(const uint16_t *x, const uint16_t *b, int64_t v) {
    /* per lane: the largest value so far and its first index (only a strictly greater one replaces it) */
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j = 0; j < v; j += 16) {
        __mmask16 m = v - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (v - j)) - 1);
        __m512 val = widen(x + j, m);
        if (b) val = round_bf16(_mm512_add_ps(val, widen(b + j, m)));
        __mmask16 nan = _mm512_mask_cmp_ps_mask(m, val, val, _CMP_UNORD_Q);
        if (nan) return j + __builtin_ctz(nan); /* no NaN before this chunk */
        __mmask16 gt = _mm512_mask_cmp_ps_mask(m, val, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, val);
        at = _mm512_mask_mov_epi32(at, gt, idx);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    }
    float top = _mm512_reduce_max_ps(best);
    if (top == -INFINITY) return 0; /* every value -inf: the first, as torch */
    /* the smallest index among the lanes holding the maximum */
    __mmask16 hit = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return (int64_t)_mm512_reduce_min_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), hit, at));
}

void row_argmax_bf16(const uint16_t *x, int64_t x_stride, int64_t n, int64_t v, int64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = argmax_row(x + i * x_stride, NULL, v);
}

/* The greedy Markov chain of a drafted block over a K-token draft vocabulary (the DSpark drafter's
 * `_greedy_bigram`): idx[r, k] = argmax_j bf16(bigram[idx[r, k-1], j] + base[r, k, j]) for k = 1..w-1,
 * the same index as torch's `bigram.index_select(0, i).add_(base[:, k]).max(-1).indices`, one call
 * for the block instead of three ops a position.
 * Layouts: bigram [K, K] bf16 (row stride K); base [R, w, K] bf16 (strides base_r, base_k, unit
 * last); idx [R, w] int64 (row stride w), idx[:, 0] given by the caller, the rest written here. */
void bigram_chain_bf16(const uint16_t *bigram, const uint16_t *base, int64_t base_r, int64_t base_k,
                       int64_t r, int64_t w, int64_t k, int64_t *idx) {
    for (int64_t i = 0; i < r; i++)
        for (int64_t p = 1; p < w; p++)
            idx[i * w + p] = argmax_row(bigram + idx[i * w + p - 1] * k, base + i * base_r + p * base_k, k);
}
