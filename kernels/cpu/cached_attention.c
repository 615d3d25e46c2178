/* Attention of a flattened ragged batch's bf16 queries over the fixed-slot bf16 KV cache, on an
 * x86 CPU with AVX512-BF16 (python_backend/dspark/runtime/cpu_attention.py builds and calls it;
 * `dspark.runtime.attention._attend_torch`, torch SDPA, is its reference).
 *
 * Token i, query head h reads keys 0..positions[i] of slot tok_slot[i], kv head h / G:
 *     out = Σ_j softmax_j(scale · q·k_j) v_j
 * The scores q·k_j by VDPBF16PS (bf16 pairs, products summed in fp32: 2 instructions a key at
 * hd 64 where widening k to fp32 took 16), times scale; their softmax and the weighted sum of the
 * values in fp32 (a value row widened 32 elements at a time: even elements by a shift, odd ones
 * by a mask, no conversion), rounded once to bf16. Each (token, query head) is computed by the
 * same operations in the same order (keys in order) whatever else is in the batch: a token's
 * output is bit-identical in a one-token decode and in an 8-token verify (batch invariance), and
 * no padding, mask or length grouping is needed for ragged batches. What is shared is memory
 * traffic and conversions, never arithmetic: a request's consecutive tokens (a verify's) and the
 * G query heads of a kv head go through each block of keys together while it is in L1 (scanned
 * once per query, from L2, it bounded a verify's attention), and each value row is widened once
 * for up to V_GROUP queries; a 6-token verify's attention after 400 cached tokens takes ~0.7x the
 * time of each query alone (`dspark bench-glue`). In a forward the slot's keys and values arrive
 * from memory (the layers' weights streamed through the caches since the last step), in short
 * streams the hardware prefetcher ramps up on late: the scores pass prefetches the key rows
 * ATTN_PF_KEYS ahead into L1 and each block's value rows into L2 for the values pass
 * (-DATTN_NO_PREFETCH builds it without; the 30 layers' attention of a verify after 400 cached
 * tokens 1.08 -> 0.85 ms at 1 token, 2.36 -> 2.07 ms at 6 on an AMD EPYC, ad hoc, interleaved).
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

/* The queries of one work item: t <= MAX_RUN consecutive tokens of one request (one slot) times
 * the G query heads of one kv head, query a = token a / G, head a % G, keys[a / G] keys each.
 * Each query's arithmetic is the same sequence of operations in the same order as when it is
 * alone (keys in order, chunks in order), only interleaved with the others': the item's queries
 * share each block of keys while it is in L1 and each value row's widening to fp32. */
#define MAX_RUN 8 /* tokens of one request in a work item */
#ifndef ATTN_PF_KEYS
#define ATTN_PF_KEYS 64 /* keys ahead of the scores pass whose rows it prefetches */
#endif
#define MAX_Q (MAX_RUN * MAX_G)
#define V_GROUP 4 /* queries sharing one pass over the values (hd 64: 4 x 4 accumulators in registers) */

/* scores pass: s[a][j] = scale · q_a·k_j for j < keys of a, tops[a] their running max (per lane) */
static inline __attribute__((always_inline)) void scores(const uint16_t *q, int64_t q_stride, int64_t t, int64_t g,
                                                         int64_t hd, const uint16_t *k, const uint16_t *v,
                                                         const int64_t *keys,
                                                         float scale, float *s, int64_t s_stride, __m512 *tops) {
    int64_t chunks = (hd + 31) / 32, nq = t * g, most = 0;
    __mmask32 last = hd % 32 ? (__mmask32)0xFFFF : (__mmask32)0xFFFFFFFF;
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < t; i++) most = keys[i] > most ? keys[i] : most;
    for (int64_t a = 0; a < nq; a++) tops[a] = _mm512_set1_ps(-INFINITY);
#ifndef ATTN_NO_PREFETCH
    const char *kb = (const char *)k, *vb = (const char *)v;
    int64_t row = hd * (int64_t)sizeof(uint16_t), first = (most < ATTN_PF_KEYS ? most : ATTN_PF_KEYS) * row;
    for (int64_t b = 0; b < first; b += 64) _mm_prefetch(kb + b, _MM_HINT_T0);
#endif
    for (int64_t j0 = 0; j0 < most; j0 += 16) { /* 16 keys' scores at a time, for every query */
#ifndef ATTN_NO_PREFETCH
        { /* the key rows ATTN_PF_KEYS ahead into L1, this block's value rows into L2 for the values pass */
            int64_t ahead = j0 + ATTN_PF_KEYS, kend = (ahead + 16 < most ? ahead + 16 : most) * row;
            int64_t vend = (j0 + 16 < most ? j0 + 16 : most) * row;
            for (int64_t b = ahead * row; b < kend; b += 64) _mm_prefetch(kb + b, _MM_HINT_T0);
            for (int64_t b = j0 * row; b < vend; b += 64) _mm_prefetch(vb + b, _MM_HINT_T1);
        }
#endif
        for (int64_t a = 0; a < nq; a++) {
            int64_t ka = keys[a / g];
            if (j0 >= ka) continue;
            int64_t nk = ka - j0 < 16 ? ka - j0 : 16;
            const uint16_t *qa = q + (a / g) * q_stride + (a % g) * hd;
            __m512bh qv[MAX_HD / 32];
            for (int64_t c = 0; c < chunks; c++)
                qv[c] = (__m512bh)load_pairs(qa + c * 32, c == chunks - 1 ? last : (__mmask32)0xFFFFFFFF);
            __m512 acc[16];
            for (int64_t u = 0; u < 16; u++) {
                acc[u] = _mm512_setzero_ps();
                if (u < nk) {
                    const uint16_t *kj = k + (j0 + u) * hd;
                    for (int64_t c = 0; c < chunks; c++)
                        acc[u] = _mm512_dpbf16_ps(acc[u], qv[c],
                                                  (__m512bh)load_pairs(kj + c * 32, c == chunks - 1 ? last : (__mmask32)0xFFFFFFFF));
                }
            }
            __mmask16 live = (__mmask16)((1u << nk) - 1);
            __m512 sc = _mm512_mul_ps(sum16(acc), sv);
            _mm512_mask_storeu_ps(s + a * s_stride + j0, live, sc);
            tops[a] = _mm512_mask_max_ps(tops[a], live, tops[a], sc);
        }
    }
}

/* softmax numerators of one query's scores sa[0..keys-1] in place, e_j = exp(s_j - max), summed
 * 16 lanes at a time in key order -> 1 / their sum */
static inline float exponentiate(float *sa, int64_t keys, __m512 tops) {
    __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(_mm512_reduce_max_ps(tops));
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
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* values pass of n <= V_GROUP queries (rows sa[a] of numerators, ka[a] keys, inv[a] = 1 / their
 * sum): o_a = inv_a · Σ_j e_aj v_j in key order, the even and the odd elements of each 32 apart,
 * each value row widened once for all n; rounded once to bf16 into out[a] */
static inline __attribute__((always_inline)) void values(int64_t n, int64_t hd, const uint16_t *v, float *const *sa,
                                                         const int64_t *ka, const float *inv, uint16_t *const *out) {
    int64_t chunks = (hd + 31) / 32, fewest = ka[0], most = ka[0];
    __mmask32 last = hd % 32 ? (__mmask32)0xFFFF : (__mmask32)0xFFFFFFFF;
    __m512 even[V_GROUP][MAX_HD / 32], odd[V_GROUP][MAX_HD / 32];
    for (int64_t a = 0; a < n; a++) {
        fewest = ka[a] < fewest ? ka[a] : fewest;
        most = ka[a] > most ? ka[a] : most;
        for (int64_t c = 0; c < chunks; c++) even[a][c] = odd[a][c] = _mm512_setzero_ps();
    }
    for (int64_t jj = 0; jj < most; jj++) {
        const uint16_t *vj = v + jj * hd;
        int all = jj < fewest;
        for (int64_t c = 0; c < chunks; c++) {
            __m512i pairs = load_pairs(vj + c * 32, c == chunks - 1 ? last : (__mmask32)0xFFFFFFFF);
            __m512 ev = even_of(pairs), od = odd_of(pairs);
            for (int64_t a = 0; a < n; a++) {
                if (!all && jj >= ka[a]) continue;
                __m512 p = _mm512_set1_ps(sa[a][jj]);
                even[a][c] = _mm512_fmadd_ps(p, ev, even[a][c]);
                odd[a][c] = _mm512_fmadd_ps(p, od, odd[a][c]);
            }
        }
    }
    for (int64_t a = 0; a < n; a++) {
        __m512 ia = _mm512_set1_ps(inv[a]);
        for (int64_t c = 0; c < chunks; c++) { /* back to element order: lane i = (2i, 2i+1) */
            __m512i lo = round_bf16(_mm512_mul_ps(even[a][c], ia)), hi = round_bf16(_mm512_mul_ps(odd[a][c], ia));
            _mm512_mask_storeu_epi16(out[a] + c * 32, c == chunks - 1 ? last : (__mmask32)0xFFFFFFFF,
                                     _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* values() with n and hd 64 constants (SmolLM2's head size: the accumulators stay in registers) */
static void values64(int64_t n, const uint16_t *v, float *const *sa, const int64_t *ka, const float *inv,
                     uint16_t *const *out) {
    switch (n) {
    case 1: values(1, 64, v, sa, ka, inv, out); break;
    case 2: values(2, 64, v, sa, ka, inv, out); break;
    case 3: values(3, 64, v, sa, ka, inv, out); break;
    default: values(4, 64, v, sa, ka, inv, out); break;
    }
}

/* one work item (see MAX_RUN): its t tokens' G heads over kv head `k`, `v`; s: scratch of
 * t · G · s_stride floats */
static inline __attribute__((always_inline)) void attend(const uint16_t *q, int64_t q_stride, int64_t t, int64_t g,
                                                         int64_t hd, const uint16_t *k, const uint16_t *v,
                                                         const int64_t *keys, float scale, float *s,
                                                         int64_t s_stride, uint16_t *out, int64_t out_stride) {
    __m512 tops[MAX_Q];
    float inv[MAX_Q];
    int64_t nq = t * g;
    scores(q, q_stride, t, g, hd, k, v, keys, scale, s, s_stride, tops);
    for (int64_t a = 0; a < nq; a++) inv[a] = exponentiate(s + a * s_stride, keys[a / g], tops[a]);
    int64_t step = hd == 64 ? V_GROUP : 1; /* wider heads: one query a pass (its accumulators fill the registers) */
    for (int64_t a0 = 0; a0 < nq; a0 += step) {
        int64_t n = nq - a0 < step ? nq - a0 : step, ka[V_GROUP];
        float *sa[V_GROUP];
        uint16_t *oa[V_GROUP];
        for (int64_t a = 0; a < n; a++) {
            ka[a] = keys[(a0 + a) / g];
            sa[a] = s + (a0 + a) * s_stride;
            oa[a] = out + ((a0 + a) / g) * out_stride + ((a0 + a) % g) * hd;
        }
        if (hd == 64)
            values64(n, v, sa, ka, inv + a0, oa);
        else
            values(1, hd, v, sa, ka, inv + a0, oa);
    }
}

/* the work items' first tokens when runs of one slot are cut at `cap` tokens -> their count;
 * first[count] = n */
static int64_t cut_runs(const int64_t *tok_slot, int64_t n, int64_t cap, int64_t *first) {
    int64_t items = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || tok_slot[i] != tok_slot[i - 1] || i - first[items - 1] >= cap) first[items++] = i;
    first[items] = n;
    return items;
}

/* returns 0; -1 when hd / G are outside what it handles (the caller checks them first); -2 when
 * scratch could not be allocated (the outputs are then not written). Work items: runs of up to
 * MAX_RUN consecutive tokens of one slot (a verify's tokens) times kv heads, cut shorter where
 * that leaves too few items for the threads. grouped 0: each (token, query head) alone, as
 * before the grouping (the same bits, for benchmarks: `dspark bench-glue`). */
int cached_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                          const int64_t *tok_slot, const int64_t *positions, uint16_t *out, int64_t n, int64_t h,
                          int64_t hkv, int64_t s_max, int64_t hd, float scale, int threads, int grouped) {
    int64_t g = h / hkv, most = 0, cap = grouped ? MAX_RUN : 1, runs;
    int failed = 0;
    if (hd % 16 || hd > MAX_HD || g > MAX_G || g * hkv != h) return -1;
    int64_t *first = malloc(sizeof(int64_t) * (n + 1)), *keys = malloc(sizeof(int64_t) * (n > 0 ? n : 1));
    if (!first || !keys) {
        free(first);
        free(keys);
        return -2;
    }
    for (int64_t i = 0; i < n; i++) {
        keys[i] = positions[i] + 1;
        most = keys[i] > most ? keys[i] : most;
    }
    runs = cut_runs(tok_slot, n, cap, first);
    while (threads > 1 && cap > 1 && runs * hkv < 4 * threads) runs = cut_runs(tok_slot, n, cap /= 2, first);
    int64_t s_stride = (most + 15) / 16 * 16;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *s = malloc(sizeof(float) * cap * g * s_stride);
        failed |= s == NULL;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < runs * hkv; w++) {
            int64_t r = w / hkv, kvh = w % hkv, i = first[r], t = first[r + 1] - i;
            const uint16_t *kb = k + (tok_slot[i] * hkv + kvh) * s_max * hd;
            const uint16_t *vb = v + (tok_slot[i] * hkv + kvh) * s_max * hd;
            const uint16_t *qi = q + i * q_stride + kvh * g * hd;
            uint16_t *oi = out + (i * h + kvh * g) * hd;
            if (!s) continue;
            if (!grouped) /* t is 1 */
                for (int64_t a = 0; a < g; a++)
                    attend(qi + a * hd, q_stride, 1, 1, hd, kb, vb, keys + i, scale, s, s_stride, oi + a * hd, h * hd);
            else if (hd == 64) /* SmolLM2's head size: the vector loops unrolled, their registers fixed */
                attend(qi, q_stride, t, g, 64, kb, vb, keys + i, scale, s, s_stride, oi, h * hd);
            else
                attend(qi, q_stride, t, g, hd, kb, vb, keys + i, scale, s, s_stride, oi, h * hd);
        }
        free(s);
    }
    free(first);
    free(keys);
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
