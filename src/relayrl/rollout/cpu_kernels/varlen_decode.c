/* The decode attention kernel of relayrl.rollout.cpu_kernels.varlen_decode (built by cpu_kernels.build).

   Three paths, one set of bits: plain C (-DRELAYRL_SCALAR or a target without SSE2), SSE2
   (4 lanes: x86-64's baseline), and on an x86-64 CPU with AVX2 an 8-wide path chosen at run
   time (__builtin_cpu_supports; functions compiled with target("avx2"), no FMA). Every
   float operation runs in the order the source writes it (no fast-math, -ffp-contract=off)
   and every lane of a wider path repeats a narrower one's operations in its order, so the
   paths agree bit for bit (tests/unit/rollout/test_varlen_decode.py). */

#include <stdint.h>
#if defined(__SSE2__) && !defined(RELAYRL_SCALAR)
#include <emmintrin.h>
#define RELAYRL_SSE2 1
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RELAYRL_AVX2 1
#endif
#endif

/* Every float operation below is written out in the order it runs; the build forbids
   reassociation and contraction (no fast-math, -ffp-contract=off), so the SSE2 path and the
   plain C path (RELAYRL_SCALAR, or a target without SSE2) give the same bits. */

/* exp(x) for x <= 0 (Cephes expf): x = n ln2 + r, n = floor(x log2e + 1/2), |r| <= ln2 / 2,
   exp(r) by a degree-6 polynomial, times 2^n from the exponent bits; 0 below -87 (where
   exp(x) < 2^-125). Relative error ~1e-7 against the exact value. */
#define EXP_LO (-87.0f)
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

static inline float exp_neg(float x) {
    if (x < EXP_LO) return 0.0f;
    const float y = x * LOG2E + 0.5f;
    float fn = (float)(int32_t)y;
    if (fn > y) fn = fn - 1.0f;
    float r = x - fn * LN2_HI;
    r = r - fn * LN2_LO;
    const float z = r * r;
    float p = P0;
    p = p * r + P1;
    p = p * r + P2;
    p = p * r + P3;
    p = p * r + P4;
    p = p * r + P5;
    p = p * z + r;
    p = p + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)fn + 127) << 23;
    return p * two_n.f;
}

/* q . k over d: lane l sums the terms k = l (mod 4) in order, then (l0 + l1) + (l2 + l3) */
static inline float dot4(const float *a, const float *b, int64_t d) {
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t k = 0;
    for (; k + 4 <= d; k += 4)
        for (int t = 0; t < 4; ++t) p[t] = p[t] + a[k + t] * b[k + t];
    for (; k < d; ++k) p[k & 3] = p[k & 3] + a[k] * b[k];
    return (p[0] + p[1]) + (p[2] + p[3]);
}

/* The next row's keys and values of this kv head, asked for (into L2) while this row's
   scores run: between steps the arenas drop out of the caches, and a row's columns are a
   few short streams that the hardware prefetcher barely starts on. NULL: nothing. */
typedef struct {
    const float *k, *v;
    int64_t len;
} ahead_t;

#define LINE_FLOATS 16 /* floats per 64-byte cache line */

/* columns [from, min(to, len)) of the next row's keys and values (no effect on any result) */
static inline void prefetch_ahead(const ahead_t *a, int64_t from, int64_t to, int64_t dim) {
    if (a == 0) return;
    if (to > a->len) to = a->len;
    for (int64_t c = from * dim; c < to * dim; c += LINE_FLOATS) {
        __builtin_prefetch(a->k + c, 0, 2);
        __builtin_prefetch(a->v + c, 0, 2);
    }
}

#ifdef RELAYRL_SSE2
/* the four column sums of a 4-column block: lane l of column c into register l, lane c,
   then (l0 + l1) + (l2 + l3) per column */
static inline __m128 column_sums(__m128 a0, __m128 a1, __m128 a2, __m128 a3) {
    const __m128 t0 = _mm_unpacklo_ps(a0, a1), t1 = _mm_unpackhi_ps(a0, a1);
    const __m128 t2 = _mm_unpacklo_ps(a2, a3), t3 = _mm_unpackhi_ps(a2, a3);
    const __m128 l0 = _mm_movelh_ps(t0, t2), l1 = _mm_movehl_ps(t2, t0);
    const __m128 l2 = _mm_movelh_ps(t1, t3), l3 = _mm_movehl_ps(t3, t1);
    return _mm_add_ps(_mm_add_ps(l0, l1), _mm_add_ps(l2, l3));
}
#endif

/* s[j] = (q . k_j) * scale for j < len, k_j = kb + j * dim */
static void scores_of(const float *q, const float *kb, int64_t len, int64_t dim, float scale,
                      float *s, const ahead_t *next) {
    int64_t j = 0;
#ifdef RELAYRL_SSE2
    if ((dim & 3) == 0) {
        const __m128 sc = _mm_set1_ps(scale);
        for (; j + 4 <= len; j += 4) {
            const float *k0 = kb + j * dim;
            prefetch_ahead(next, j, j + 4, dim);
            __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t t = 0; t < dim; t += 4) {
                const __m128 qv = _mm_loadu_ps(q + t);
                a0 = _mm_add_ps(a0, _mm_mul_ps(qv, _mm_loadu_ps(k0 + t)));
                a1 = _mm_add_ps(a1, _mm_mul_ps(qv, _mm_loadu_ps(k0 + dim + t)));
                a2 = _mm_add_ps(a2, _mm_mul_ps(qv, _mm_loadu_ps(k0 + 2 * dim + t)));
                a3 = _mm_add_ps(a3, _mm_mul_ps(qv, _mm_loadu_ps(k0 + 3 * dim + t)));
            }
            _mm_storeu_ps(s + j, _mm_mul_ps(column_sums(a0, a1, a2, a3), sc));
        }
    }
#endif
    prefetch_ahead(next, j, INT64_MAX, dim); /* the rest of its columns */
    for (; j < len; ++j) s[j] = dot4(q, kb + j * dim, dim) * scale;
}

/* scores_of for two query heads on the same keys (two heads of one kv group): each key
   block is loaded once for both, each head's operations are scores_of's in its order */
static void scores_of2(const float *q, const float *r, const float *kb, int64_t len,
                       int64_t dim, float scale, float *s, float *u, const ahead_t *next) {
    int64_t j = 0;
#ifdef RELAYRL_SSE2
    if ((dim & 3) == 0) {
        const __m128 sc = _mm_set1_ps(scale);
        for (; j + 4 <= len; j += 4) {
            const float *k0 = kb + j * dim;
            prefetch_ahead(next, j, j + 4, dim);
            __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m128 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t t = 0; t < dim; t += 4) {
                const __m128 qv = _mm_loadu_ps(q + t), rv = _mm_loadu_ps(r + t);
                const __m128 x0 = _mm_loadu_ps(k0 + t), x1 = _mm_loadu_ps(k0 + dim + t);
                const __m128 x2 = _mm_loadu_ps(k0 + 2 * dim + t);
                const __m128 x3 = _mm_loadu_ps(k0 + 3 * dim + t);
                a0 = _mm_add_ps(a0, _mm_mul_ps(qv, x0));
                b0 = _mm_add_ps(b0, _mm_mul_ps(rv, x0));
                a1 = _mm_add_ps(a1, _mm_mul_ps(qv, x1));
                b1 = _mm_add_ps(b1, _mm_mul_ps(rv, x1));
                a2 = _mm_add_ps(a2, _mm_mul_ps(qv, x2));
                b2 = _mm_add_ps(b2, _mm_mul_ps(rv, x2));
                a3 = _mm_add_ps(a3, _mm_mul_ps(qv, x3));
                b3 = _mm_add_ps(b3, _mm_mul_ps(rv, x3));
            }
            _mm_storeu_ps(s + j, _mm_mul_ps(column_sums(a0, a1, a2, a3), sc));
            _mm_storeu_ps(u + j, _mm_mul_ps(column_sums(b0, b1, b2, b3), sc));
        }
    }
#endif
    prefetch_ahead(next, j, INT64_MAX, dim); /* the rest of its columns */
    for (; j < len; ++j) {
        s[j] = dot4(q, kb + j * dim, dim) * scale;
        u[j] = dot4(r, kb + j * dim, dim) * scale;
    }
}

#ifdef RELAYRL_SSE2
/* exp_neg on four lanes, its operations lane by lane */
static inline __m128 exp4(__m128 x) {
    const __m128 y = _mm_add_ps(_mm_mul_ps(x, _mm_set1_ps(LOG2E)), _mm_set1_ps(0.5f));
    __m128 fn = _mm_cvtepi32_ps(_mm_cvttps_epi32(y));
    fn = _mm_sub_ps(fn, _mm_and_ps(_mm_cmpgt_ps(fn, y), _mm_set1_ps(1.0f)));
    __m128 r = _mm_sub_ps(x, _mm_mul_ps(fn, _mm_set1_ps(LN2_HI)));
    r = _mm_sub_ps(r, _mm_mul_ps(fn, _mm_set1_ps(LN2_LO)));
    const __m128 z = _mm_mul_ps(r, r);
    __m128 q = _mm_set1_ps(P0);
    q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(P1));
    q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(P2));
    q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(P3));
    q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(P4));
    q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(P5));
    q = _mm_add_ps(_mm_mul_ps(q, z), r);
    q = _mm_add_ps(q, _mm_set1_ps(1.0f));
    const __m128i n = _mm_add_epi32(_mm_cvttps_epi32(fn), _mm_set1_epi32(127));
    const __m128 e = _mm_mul_ps(q, _mm_castsi128_ps(_mm_slli_epi32(n, 23)));
    return _mm_andnot_ps(_mm_cmplt_ps(x, _mm_set1_ps(EXP_LO)), e);
}
#endif

/* max_j s[j] (exact in any order: four lanes, then across them) */
static float max_of(const float *s, int64_t len) {
    float m = s[0];
    int64_t j = 1;
#ifdef RELAYRL_SSE2
    if (len >= 8) {
        __m128 mv = _mm_loadu_ps(s);
        for (j = 4; j + 4 <= len; j += 4) mv = _mm_max_ps(mv, _mm_loadu_ps(s + j));
        float lanes[4];
        _mm_storeu_ps(lanes, mv);
        for (int t = 0; t < 4; ++t) m = lanes[t] > m ? lanes[t] : m;
    }
#endif
    for (; j < len; ++j) m = s[j] > m ? s[j] : m;
    return m;
}

/* softmax from column j on (j a multiple of 4; the columns before it already exp'd and in
   the lane sums p): s[j] = exp(s[j] - m), lane l adds the columns = l (mod 4) in order, then
   every s[j] times 1 / ((l0 + l1) + (l2 + l3)) */
static void softmax_from(float *s, int64_t len, float m, int64_t j, float p[4]) {
#ifdef RELAYRL_SSE2
    {
        const __m128 mv = _mm_set1_ps(m);
        __m128 acc = _mm_loadu_ps(p);
        for (; j + 4 <= len; j += 4) {
            const __m128 e = exp4(_mm_sub_ps(_mm_loadu_ps(s + j), mv));
            _mm_storeu_ps(s + j, e);
            acc = _mm_add_ps(acc, e);
        }
        _mm_storeu_ps(p, acc);
    }
#endif
    for (; j < len; ++j) {
        s[j] = exp_neg(s[j] - m);
        p[j & 3] = p[j & 3] + s[j];
    }
    const float inv = 1.0f / ((p[0] + p[1]) + (p[2] + p[3]));
    for (j = 0; j < len; ++j) s[j] = s[j] * inv;
}

/* s[j] = exp(s[j] - max s) / sum_j exp(s[j] - max s) */
static void softmax(float *s, int64_t len) {
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    softmax_from(s, len, max_of(s, len), 0, p);
}

/* o[d] = sum_j w[j] v_j[d] for d < dim, the terms in order of j (from 0.0f) */
static void weighted_sum(const float *w, const float *vb, int64_t len, int64_t dim, float *o) {
    int64_t d = 0;
#ifdef RELAYRL_SSE2
    for (; d + 16 <= dim; d += 16) {
        __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < len; ++j) {
            const __m128 wj = _mm_set1_ps(w[j]);
            const float *vj = vb + j * dim + d;
            a0 = _mm_add_ps(a0, _mm_mul_ps(wj, _mm_loadu_ps(vj)));
            a1 = _mm_add_ps(a1, _mm_mul_ps(wj, _mm_loadu_ps(vj + 4)));
            a2 = _mm_add_ps(a2, _mm_mul_ps(wj, _mm_loadu_ps(vj + 8)));
            a3 = _mm_add_ps(a3, _mm_mul_ps(wj, _mm_loadu_ps(vj + 12)));
        }
        _mm_storeu_ps(o + d, a0);
        _mm_storeu_ps(o + d + 4, a1);
        _mm_storeu_ps(o + d + 8, a2);
        _mm_storeu_ps(o + d + 12, a3);
    }
    for (; d + 4 <= dim; d += 4) {
        __m128 a = _mm_setzero_ps();
        for (int64_t j = 0; j < len; ++j)
            a = _mm_add_ps(a, _mm_mul_ps(_mm_set1_ps(w[j]), _mm_loadu_ps(vb + j * dim + d)));
        _mm_storeu_ps(o + d, a);
    }
#endif
    for (; d < dim; ++d) {
        float a = 0.0f;
        for (int64_t j = 0; j < len; ++j) a = a + w[j] * vb[j * dim + d];
        o[d] = a;
    }
}

/* weighted_sum for two heads on the same values: each value block loaded once for both,
   each head's terms in weighted_sum's order */
static void weighted_sum2(const float *w, const float *x, const float *vb, int64_t len,
                          int64_t dim, float *o, float *p, int64_t d) { /* from element d */
#ifdef RELAYRL_SSE2
    for (; d + 16 <= dim; d += 16) {
        __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m128 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t j = 0; j < len; ++j) {
            const __m128 wj = _mm_set1_ps(w[j]), xj = _mm_set1_ps(x[j]);
            const float *vj = vb + j * dim + d;
            const __m128 v0 = _mm_loadu_ps(vj), v1 = _mm_loadu_ps(vj + 4);
            const __m128 v2 = _mm_loadu_ps(vj + 8), v3 = _mm_loadu_ps(vj + 12);
            a0 = _mm_add_ps(a0, _mm_mul_ps(wj, v0));
            b0 = _mm_add_ps(b0, _mm_mul_ps(xj, v0));
            a1 = _mm_add_ps(a1, _mm_mul_ps(wj, v1));
            b1 = _mm_add_ps(b1, _mm_mul_ps(xj, v1));
            a2 = _mm_add_ps(a2, _mm_mul_ps(wj, v2));
            b2 = _mm_add_ps(b2, _mm_mul_ps(xj, v2));
            a3 = _mm_add_ps(a3, _mm_mul_ps(wj, v3));
            b3 = _mm_add_ps(b3, _mm_mul_ps(xj, v3));
        }
        _mm_storeu_ps(o + d, a0);
        _mm_storeu_ps(o + d + 4, a1);
        _mm_storeu_ps(o + d + 8, a2);
        _mm_storeu_ps(o + d + 12, a3);
        _mm_storeu_ps(p + d, b0);
        _mm_storeu_ps(p + d + 4, b1);
        _mm_storeu_ps(p + d + 8, b2);
        _mm_storeu_ps(p + d + 12, b3);
    }
    for (; d + 4 <= dim; d += 4) {
        __m128 a = _mm_setzero_ps(), b = a;
        for (int64_t j = 0; j < len; ++j) {
            const __m128 vj = _mm_loadu_ps(vb + j * dim + d);
            a = _mm_add_ps(a, _mm_mul_ps(_mm_set1_ps(w[j]), vj));
            b = _mm_add_ps(b, _mm_mul_ps(_mm_set1_ps(x[j]), vj));
        }
        _mm_storeu_ps(o + d, a);
        _mm_storeu_ps(p + d, b);
    }
#endif
    for (; d < dim; ++d) {
        float a = 0.0f, b = 0.0f;
        for (int64_t j = 0; j < len; ++j) {
            a = a + w[j] * vb[j * dim + d];
            b = b + x[j] * vb[j * dim + d];
        }
        o[d] = a;
        p[d] = b;
    }
}

#ifdef RELAYRL_AVX2
/* The same sums eight lanes wide where a machine has AVX2 (chosen at run time): every lane
   does a 4-lane path's operations in its order, so the bits are the SSE2 path's. No FMA:
   the target is avx2 alone. */
#define WIDE __attribute__((target("avx2")))

WIDE static inline __m256 pair_of(const float *lo, const float *hi) { /* [lo[0:4] | hi[0:4]] */
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
}

/* column_sums on both 128-bit halves (movelh / movehl are unpack{lo,hi}_pd of the pairs) */
WIDE static inline __m256 column_sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(a0, a1));
    const __m256d t1 = _mm256_castps_pd(_mm256_unpackhi_ps(a0, a1));
    const __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(a2, a3));
    const __m256d t3 = _mm256_castps_pd(_mm256_unpackhi_ps(a2, a3));
    const __m256 l0 = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
    const __m256 l1 = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
    const __m256 l2 = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
    const __m256 l3 = _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3));
    return _mm256_add_ps(_mm256_add_ps(l0, l1), _mm256_add_ps(l2, l3));
}

/* scores_of2, eight columns per block: register c holds column j + c in its low half and
   column j + 4 + c in its high half, each half summed as scores_of sums a column */
WIDE static void scores_of2_wide(const float *q, const float *r, const float *kb, int64_t len,
                                 int64_t dim, float scale, float *s, float *u,
                                 const ahead_t *next) {
    int64_t j = 0;
    if ((dim & 3) == 0) {
        const __m256 sc = _mm256_set1_ps(scale);
        for (; j + 8 <= len; j += 8) {
            const float *k0 = kb + j * dim, *k4 = k0 + 4 * dim;
            prefetch_ahead(next, j, j + 8, dim);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t t = 0; t < dim; t += 4) {
                const __m256 qv = _mm256_broadcast_ps((const __m128 *)(q + t));
                const __m256 rv = _mm256_broadcast_ps((const __m128 *)(r + t));
                const __m256 x0 = pair_of(k0 + t, k4 + t);
                const __m256 x1 = pair_of(k0 + dim + t, k4 + dim + t);
                const __m256 x2 = pair_of(k0 + 2 * dim + t, k4 + 2 * dim + t);
                const __m256 x3 = pair_of(k0 + 3 * dim + t, k4 + 3 * dim + t);
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(qv, x0));
                b0 = _mm256_add_ps(b0, _mm256_mul_ps(rv, x0));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(qv, x1));
                b1 = _mm256_add_ps(b1, _mm256_mul_ps(rv, x1));
                a2 = _mm256_add_ps(a2, _mm256_mul_ps(qv, x2));
                b2 = _mm256_add_ps(b2, _mm256_mul_ps(rv, x2));
                a3 = _mm256_add_ps(a3, _mm256_mul_ps(qv, x3));
                b3 = _mm256_add_ps(b3, _mm256_mul_ps(rv, x3));
            }
            _mm256_storeu_ps(s + j, _mm256_mul_ps(column_sums8(a0, a1, a2, a3), sc));
            _mm256_storeu_ps(u + j, _mm256_mul_ps(column_sums8(b0, b1, b2, b3), sc));
        }
    }
    prefetch_ahead(next, j, INT64_MAX, dim); /* the rest of its columns */
    scores_of2(q, r, kb + j * dim, len - j, dim, scale, s + j, u + j, 0);
}

WIDE static inline __m256 exp8(__m256 x) { /* exp4 on eight lanes */
    const __m256 y = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _mm256_set1_ps(0.5f));
    __m256 fn = _mm256_cvtepi32_ps(_mm256_cvttps_epi32(y));
    fn = _mm256_sub_ps(fn, _mm256_and_ps(_mm256_cmp_ps(fn, y, _CMP_GT_OS), _mm256_set1_ps(1.0f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fn, _mm256_set1_ps(LN2_HI)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(fn, _mm256_set1_ps(LN2_LO)));
    const __m256 z = _mm256_mul_ps(r, r);
    __m256 q = _mm256_set1_ps(P0);
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(P1));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(P2));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(P3));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(P4));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(P5));
    q = _mm256_add_ps(_mm256_mul_ps(q, z), r);
    q = _mm256_add_ps(q, _mm256_set1_ps(1.0f));
    const __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fn), _mm256_set1_epi32(127));
    const __m256 e = _mm256_mul_ps(q, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OS), e);
}

/* softmax: the max eight lanes wide, the exps eight at a time, each block's two halves
   added to the four lane sums low half first (the 4-wide order), the rest softmax_from's */
WIDE static void softmax_wide(float *s, int64_t len) {
    float m = s[0];
    int64_t j = 1;
    if (len >= 16) {
        __m256 mv = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= len; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int t = 0; t < 8; ++t) m = lanes[t] > m ? lanes[t] : m;
    }
    for (; j < len; ++j) m = s[j] > m ? s[j] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m128 acc = _mm_setzero_ps();
    for (j = 0; j + 8 <= len; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm_add_ps(acc, _mm256_castps256_ps128(e));
        acc = _mm_add_ps(acc, _mm256_extractf128_ps(e, 1));
    }
    float p[4];
    _mm_storeu_ps(p, acc);
    softmax_from(s, len, m, j, p);
}

/* weighted_sum2 in 8-float blocks (each lane's terms in order of j, as 4-float blocks) */
WIDE static void weighted_sum2_wide(const float *w, const float *x, const float *vb,
                                    int64_t len, int64_t dim, float *o, float *p) {
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        for (int64_t j = 0; j < len; ++j) {
            const __m256 wj = _mm256_set1_ps(w[j]), xj = _mm256_set1_ps(x[j]);
            const float *vj = vb + j * dim + d;
            const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(wj, v0));
            b0 = _mm256_add_ps(b0, _mm256_mul_ps(xj, v0));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(wj, v1));
            b1 = _mm256_add_ps(b1, _mm256_mul_ps(xj, v1));
        }
        _mm256_storeu_ps(o + d, a0);
        _mm256_storeu_ps(o + d + 8, a1);
        _mm256_storeu_ps(p + d, b0);
        _mm256_storeu_ps(p + d + 8, b1);
    }
    weighted_sum2(w, x, vb, len, dim, o, p, d);
}

static int wide = -1; /* -1: not chosen yet */

/* 1 when the 8-wide path runs (AVX2 there and not turned off), else 0 */
int relayrl_wide(void) {
    if (wide < 0) {
        __builtin_cpu_init();
        wide = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return wide;
}

/* turn the 8-wide path off (0) or back on where the machine has it (1); returns relayrl_wide */
int relayrl_set_wide(int on) {
    wide = -1;
    wide = on ? relayrl_wide() : 0;
    return wide;
}
#else
int relayrl_wide(void) { return 0; }
int relayrl_set_wide(int on) { (void)on; return 0; }
#endif

/* q, out: [n, H, D]; k, v: [S, Hkv, C, D]; rows, lens: [n], max_len >= every len;
   scores: 2 * max_len floats. Query head h reads kv head h / (H / Hkv). */
void decode_attention_f32(const float *q, const float *k, const float *v,
                          const int64_t *rows, const int64_t *lens, float *out,
                          int64_t n, int64_t heads, int64_t kv_heads, int64_t cols,
                          int64_t dim, float scale, float *scores, int64_t max_len) {
    const int64_t group = heads / kv_heads;
    const int eight = relayrl_wide();
    (void)eight;
    /* the first row's columns: nothing runs before it to hide them behind */
    for (int64_t g = 0; n > 0 && g < kv_heads; ++g) {
        const int64_t nb = (rows[0] * kv_heads + g) * cols * dim;
        const ahead_t first = {k + nb, v + nb, lens[0]};
        prefetch_ahead(&first, 0, first.len, dim);
    }
    for (int64_t i = 0; i < n; ++i) {
        const int64_t len = lens[i];
        for (int64_t g = 0; g < kv_heads; ++g) {
            const int64_t base = (rows[i] * kv_heads + g) * cols * dim;
            /* row i + 1's columns of this kv head, asked for during the group's first pass
               over row i's keys (one row ahead: a few hundred ns, more than memory's latency) */
            const int64_t nb = i + 1 < n ? (rows[i + 1] * kv_heads + g) * cols * dim : 0;
            const ahead_t next = {k + nb, v + nb, i + 1 < n ? lens[i + 1] : 0};
            int64_t h = g * group;
            /* two query heads of the group per pass over its keys and values: each block
               read once for both, twice the independent sums in flight */
            for (; h + 2 <= (g + 1) * group; h += 2) {
                const float *qh = q + (i * heads + h) * dim;
                float *second = scores + max_len, *o = out + (i * heads + h) * dim;
                const ahead_t *pf = h == g * group ? &next : 0;
#ifdef RELAYRL_AVX2
                if (eight) {
                    scores_of2_wide(qh, qh + dim, k + base, len, dim, scale, scores, second, pf);
                    softmax_wide(scores, len);
                    softmax_wide(second, len);
                    weighted_sum2_wide(scores, second, v + base, len, dim, o, o + dim);
                    continue;
                }
#endif
                scores_of2(qh, qh + dim, k + base, len, dim, scale, scores, second, pf);
                softmax(scores, len);
                softmax(second, len);
                weighted_sum2(scores, second, v + base, len, dim, o, o + dim, 0);
            }
            if (h < (g + 1) * group) { /* an odd group's last head */
                const float *qh = q + (i * heads + h) * dim;
                scores_of(qh, k + base, len, dim, scale, scores, h == g * group ? &next : 0);
                softmax(scores, len);
                weighted_sum(scores, v + base, len, dim, out + (i * heads + h) * dim);
            }
        }
    }
}
