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

/* the first NaN of x[from..v-1] (exponent all ones, mantissa not zero) */
static int64_t first_nan(const uint16_t *x, int64_t from, int64_t v) {
    for (int64_t t = from; t < v; t++)
        if ((x[t] & 0x7f80) == 0x7f80 && (x[t] & 0x007f)) return t;
    return -1;
}

static int64_t argmax_row(const uint16_t *x, int64_t v) {
    /* per lane: the largest value so far and its first index (only a strictly greater one replaces it) */
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j = 0; j < v; j += 16) {
        __mmask16 m = v - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (v - j)) - 1);
        __m512 val = widen(x + j, m);
        if (_mm512_mask_cmp_ps_mask(m, val, val, _CMP_UNORD_Q)) return first_nan(x, j, v);
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
    for (int64_t i = 0; i < n; i++) out[i] = argmax_row(x + i * x_stride, v);
}
