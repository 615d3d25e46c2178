/* The residual add and RMSNorm between a decoder layer's blocks, for bf16 rows on an x86 CPU with
 * AVX512 (python_backend/dspark/runtime/cpu_norm.py builds and calls it; `F.rms_norm` after a
 * torch add is its reference):
 *     s = bf16(x + delta)                        (written to sum; s = x when delta is NULL)
 *     out = bf16(s · 1/sqrt(Σ s² / D + eps) · w)
 * with the roundings torch's bf16 ops make: the add rounded to bf16; the norm and the weight in
 * fp32, rounded to bf16 once (`F.rms_norm` on bf16 rows, torch 2.13). One call
 * instead of the ~8 ATen ops torch runs per norm (~23 µs a call on an AMD EPYC between the
 * target's matmuls, 61 norms a SmolLM2 forward). The sum of squares runs over 16 fp32 lanes in
 * order, then across the lanes: per row, whatever else is in the batch (batch invariant), though
 * not in ATen's summation order, so a result can differ from torch's in its last bit.
 *
 * Layouts: x, delta [N, D] bf16 with row strides (elements) x_stride, d_stride and unit column
 * stride; sum, out [N, D] bf16 contiguous; w [D] bf16. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* 16 bf16 (masked) -> fp32 */
static inline __m512 load16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* 16 fp32 -> bf16, rounded to nearest even (finite values; a NaN stays a NaN) */
static inline __m256i round16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512 bf16_round_f32(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round16(x)), 16));
}

void add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *delta, int64_t d_stride,
                       const uint16_t *w, uint16_t *sum, uint16_t *out, int64_t n, int64_t d, float eps) {
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *xi = x + i * x_stride;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
            __mmask16 m = d - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - c)) - 1);
            __m512 v = load16(xi + c, m);
            if (delta) {
                v = bf16_round_f32(_mm512_add_ps(v, load16(delta + i * d_stride + c, m)));
                _mm256_mask_storeu_epi16(sum + i * d + c, m, round16(v));
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        if (delta) xi = sum + i * d;
        float r = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)d + eps);
        __m512 rv = _mm512_set1_ps(r);
        for (int64_t c = 0; c < d; c += 16) {
            __mmask16 m = d - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - c)) - 1);
            __m512 y = _mm512_mul_ps(load16(xi + c, m), rv);
            _mm256_mask_storeu_epi16(out + i * d + c, m, round16(_mm512_mul_ps(y, load16(w + c, m))));
        }
    }
}
