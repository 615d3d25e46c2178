/* Attention of a flattened ragged batch's bf16 queries over the fixed-slot bf16 KV cache, on an
 * x86 CPU with AVX512-BF16 (python_backend/dspark/runtime/cpu_attention.py builds and calls it;
 * `dspark.runtime.attention._attend_torch`, torch SDPA, is its reference).
 *
 * Token i, query head h reads keys 0..positions[i] of slot tok_slot[i], kv head h / G:
 *     out = Σ_j softmax_j(scale · q·k_j) v_j
 * The scores q·k_j by VDPBF16PS (bf16 pairs, products summed in fp32: 2 instructions a key at
 * hd 64 where widening k to fp32 took 16), times scale; their softmax and the weighted sum of the
 * values in fp32 (a value row widened 32 elements at a time: even elements by a shift, odd ones
 * by a mask, no conversion), rounded once to bf16. Each (token, kv head) is computed alone, in key
 * order, whatever else is in the batch: a token's output is bit-identical in a one-token decode
 * and in an 8-token verify (batch invariance), and no padding, mask or length grouping is needed
 * for ragged batches.
 *
 * Layouts (element strides; every tensor bf16 except the int64 indices):
 *   q         [N, H, hd]          token stride q_stride (q may be a view into q|k|v), head stride hd
 *   k, v      [C, Hkv, S, hd]     contiguous (dspark.runtime.kv_cache)
 *   tok_slot  [N] int64, positions [N] int64
 *   out       [N, H, hd]          contiguous
 * hd is a multiple of 16 and at most 256; hd 64 (SmolLM2's) runs a copy of `attend` with its vector
 * counts fixed: with them unrolled and in registers a 5-token verify's attention takes half the time. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HD 256
#define MAX_G 16 /* query heads per kv head */

/* e^x for x <= 0: 2^n · e^r, n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its degree-6 Taylor
 * polynomial (relative error < 2e-7); below -87 the result is 0 */
static inline __m512 exp_neg(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504f), ln2 = _mm512_set1_ps(0.693147181f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2, x);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

/* v[0..15] -> one vector of their 16 lane sums, in order (sum t = Σ lanes of v[t]): a transpose
 * tree of 4 levels of adds, each sum over its own lanes in the same order wherever it sits, so a
 * key's score does not depend on its neighbours */
static inline __m512 sum16(__m512 *v) {
    __m512 r[8], t[4], u[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: key 2i, 8-15: key 2i+1 */
        r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit block c: key 4i + c */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* block c, lanes 0-1: key 8i + c, lanes 2-3: key 8i + 4 + c */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    /* block c, lane l: key 4l + c */
    __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, w);
}

/* the 32 bf16 at p (the first 16 only where m is 0xFFFF) as 16 bit-pairs: lane i holds elements 2i, 2i+1 */
static inline __m512i load_pairs(const uint16_t *p, __mmask32 m) { return _mm512_maskz_loadu_epi16(m, p); }

/* fp32 of a pair vector's even elements (exact: a bf16 is the top half of an fp32) */
static inline __m512 even_of(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }

/* fp32 of a pair vector's odd elements */
static inline __m512 odd_of(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* 16 fp32 -> their bf16 bits in the low half of each 32-bit lane, rounded to nearest even (finite) */
static inline __m512i round_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
}

/* one token's G query heads over one kv head's keys 0..keys-1; s: scratch of G * keys floats.
 * Vectors of 32 elements: c < chunks = hd / 32 rounded up, the last one half (mask 0xFFFF) when
 * hd is an odd multiple of 16. */
static inline __attribute__((always_inline)) void attend(const uint16_t *q, int64_t g, int64_t hd, const uint16_t *k, const uint16_t *v, int64_t keys,
                   float scale, float *s, uint16_t *out) {
    int64_t chunks = (hd + 31) / 32;
    __mmask32 last = hd % 32 ? (__mmask32)0xFFFF : (__mmask32)0xFFFFFFFF;
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t a = 0; a < g; a++) {
        __m512bh qv[MAX_HD / 32];
        for (int64_t c = 0; c < chunks; c++)
            qv[c] = (__m512bh)load_pairs(q + a * hd + c * 32, c == chunks - 1 ? last : (__mmask32)0xFFFFFFFF);
        float *sa = s + a * keys;
        __m512 tops = _mm512_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < keys; j0 += 16) { /* 16 keys' scores at a time */
            int64_t nk = keys - j0 < 16 ? keys - j0 : 16;
            __m512 acc[16];
            for (int64_t t = 0; t < 16; t++) {
                acc[t] = _mm512_setzero_ps();
                if (t < nk) {
                    const uint16_t *kj = k + (j0 + t) * hd;
                    for (int64_t c = 0; c < chunks; c++)
                        acc[t] = _mm512_dpbf16_ps(acc[t], qv[c],
                                                  (__m512bh)load_pairs(kj + c * 32, c == chunks - 1 ? last : (__mmask32)0xFFFFFFFF));
                }
            }
            __mmask16 live = (__mmask16)((1u << nk) - 1);
            __m512 sc = _mm512_mul_ps(sum16(acc), sv);
            _mm512_mask_storeu_ps(sa + j0, live, sc);
            tops = _mm512_mask_max_ps(tops, live, tops, sc);
        }
        float top = _mm512_reduce_max_ps(tops);
        /* e_j = exp(s_j - max), summed 16 lanes at a time in key order */
        __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(top);
        int64_t j = 0;
        for (; j + 16 <= keys; j += 16) {
            __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sa + j), m));
            _mm512_storeu_ps(sa + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (j < keys) {
            __mmask16 rest = (__mmask16)((1u << (keys - j)) - 1);
            __m512 e = _mm512_maskz_mov_ps(rest, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, sa + j), m)));
            _mm512_mask_storeu_ps(sa + j, rest, e);
            sum = _mm512_add_ps(sum, e);
        }
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        /* o = Σ_j e_j v_j in key order, the even and the odd elements of each 32 apart */
        __m512 even[MAX_HD / 32], odd[MAX_HD / 32];
        for (int64_t c = 0; c < chunks; c++) even[c] = odd[c] = _mm512_setzero_ps();
        for (int64_t jj = 0; jj < keys; jj++) {
            __m512 p = _mm512_set1_ps(sa[jj]);
            const uint16_t *vj = v + jj * hd;
            for (int64_t c = 0; c < chunks; c++) {
                __m512i pairs = load_pairs(vj + c * 32, c == chunks - 1 ? last : (__mmask32)0xFFFFFFFF);
                even[c] = _mm512_fmadd_ps(p, even_of(pairs), even[c]);
                odd[c] = _mm512_fmadd_ps(p, odd_of(pairs), odd[c]);
            }
        }
        for (int64_t c = 0; c < chunks; c++) { /* back to element order: lane i = (2i, 2i+1) */
            __m512i lo = round_bf16(_mm512_mul_ps(even[c], inv)), hi = round_bf16(_mm512_mul_ps(odd[c], inv));
            _mm512_mask_storeu_epi16(out + a * hd + c * 32, c == chunks - 1 ? last : (__mmask32)0xFFFFFFFF,
                                     _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* returns 0; -1 when hd / G are outside what it handles (the caller checks them first); -2 when a
 * thread's score scratch could not be allocated (its outputs are then not written) */
int cached_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                          const int64_t *tok_slot, const int64_t *positions, uint16_t *out, int64_t n, int64_t h,
                          int64_t hkv, int64_t s_max, int64_t hd, float scale, int threads) {
    int64_t g = h / hkv;
    int failed = 0;
    if (hd % 16 || hd > MAX_HD || g > MAX_G || g * hkv != h) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *s = malloc(sizeof(float) * g * s_max);
        failed |= s == NULL;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * hkv; w++) {
            int64_t i = w / hkv, kvh = w % hkv;
            const uint16_t *kb = k + (tok_slot[i] * hkv + kvh) * s_max * hd;
            const uint16_t *vb = v + (tok_slot[i] * hkv + kvh) * s_max * hd;
            const uint16_t *qi = q + i * q_stride + kvh * g * hd;
            uint16_t *oi = out + (i * h + kvh * g) * hd;
            if (!s) continue;
            if (hd == 64) /* SmolLM2's head size: the vector loops unrolled, their registers fixed */
                attend(qi, g, 64, kb, vb, positions[i] + 1, scale, s, oi);
            else
                attend(qi, g, hd, kb, vb, positions[i] + 1, scale, s, oi);
        }
        free(s);
    }
    return failed ? -2 : 0;
}

/* fp32 of 16 bf16 */
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 fp32 -> bf16 rounded to nearest even (finite values), as 16 bits each */
static inline __m256i narrow16(__m512 x) {
    return _mm512_cvtepi32_epi16(round_bf16(x));
}

/* bf16 product of two bf16 vectors (exact in fp32, then rounded), widened back */
static inline __m512 mul_rounded(__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(_mm512_mul_ps(a, b)), 16));
}

/* RoPE on the new tokens' q and k, k and v written into the cache: what a decode or a verify does
 * before `cached_attention_bf16`, in one call (torch: roll, two products, a sum and two indexed
 * writes per layer). Rotate-half form with the sign folded into the table (`apply_rope_swapped`):
 *     y_j = bf16(bf16(x_j · cos_j) + bf16(x_{(j + hd/2) mod hd} · sin_signed_j))
 * with torch's bf16 roundings, so bit-identical to it.
 * Layouts (element strides; bf16 except the int64 indices):
 *   qkv       [N, H + 2·Hkv, hd]   row stride qkv_stride, heads contiguous (q heads, k heads, v heads)
 *   cos, sin  [N, hd]              contiguous (the tables' rows at each token's position)
 *   q_out     [N, H, hd]           contiguous
 *   k, v      [C, Hkv, S, hd]      contiguous: row positions[i] of slot tok_slot[i] written
 * hd a multiple of 32. */
void rope_write_kv_bf16(const uint16_t *qkv, int64_t qkv_stride, const uint16_t *cos, const uint16_t *sin,
                        uint16_t *q_out, uint16_t *k, uint16_t *v, const int64_t *tok_slot, const int64_t *positions,
                        int64_t n, int64_t h, int64_t hkv, int64_t s_max, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *row = qkv + i * qkv_stride, *ci = cos + i * hd, *si = sin + i * hd;
        int64_t cache_row = tok_slot[i] * hkv * s_max + positions[i];
        for (int64_t head = 0; head < h + hkv; head++) {
            const uint16_t *x = row + head * hd;
            uint16_t *dst = head < h ? q_out + (i * h + head) * hd : k + (cache_row + (head - h) * s_max) * hd;
            for (int64_t c = 0; c < hd; c += 16) {
                int64_t r = c + half < hd ? c + half : c + half - hd;
                __m512 y = _mm512_add_ps(mul_rounded(widen16(x + c), widen16(ci + c)),
                                         mul_rounded(widen16(x + r), widen16(si + c)));
                _mm256_storeu_si256((__m256i *)(dst + c), narrow16(y));
            }
        }
        for (int64_t kvh = 0; kvh < hkv; kvh++)
            memcpy(v + (cache_row + kvh * s_max) * hd, row + (h + hkv + kvh) * hd, sizeof(uint16_t) * hd);
    }
}
