/* The C source of the float32 CPU step's other pieces, built with varlen_decode.c
   into one library (relayrl.rollout.cpu_kernels.varlen_decode): a layer's rotary embedding, cache writes
   and attention in one call (attend_layer_f32, after decode_attention_f32 in the same
   unit), the residual add with LlamaRMSNorm (add_rms_f32) and the sampler's inverse-CDF
   draw after its log_softmax (sample_rows_f32: SplitMix64 uniforms, a float64 running CDF,
   torch.searchsorted's binary search; relayrl.rollout.sampler). Like the kernel they repeat
   torch's float operations in torch's order (the build forbids reassociation and contraction),
   so the direct path keeps the module path's bits (tests/unit/rollout/test_step_kernels.py). */

#include <math.h>
#include <stdint.h>

/* x * cos + roll(x, D/2) * sin of one head's D floats (sin pre-signed: its first half
   negated), each element as torch computes it: two products, then their sum. */
static void rope_row(const float *x, const float *c, const float *s, int64_t dim, float *o) {
    const int64_t half = dim / 2;
    for (int64_t j = 0; j < dim; ++j) {
        const float a = x[j] * c[j];
        const float b = x[j < half ? j + half : j - half] * s[j];
        o[j] = a + b;
    }
}

/* One layer's attention of a step, from its projections: row i is one token at column
   lens[i] - 1 of arena row rows[i]; qi/ki/vi: its query, key and value heads ([H], [Hkv],
   [Hkv] x D floats at row strides qs/ks/vs); cos, sin: [n, D]. First every row's rotated
   query heads into q ([n, H, D]) and its rotated key and value heads into the arenas k, v
   (all of them: a prompt's tokens read each other's keys), then decode_attention_f32. */
void attend_layer_f32(const float *qi, int64_t qs, const float *ki, int64_t ks,
                      const float *vi, int64_t vs, const float *cos, const float *sin,
                      float *q, float *k, float *v, const int64_t *rows, const int64_t *lens,
                      float *out, int64_t n, int64_t heads, int64_t kv_heads, int64_t cols,
                      int64_t dim, float scale, float *scores, int64_t max_len) {
    for (int64_t i = 0; i < n; ++i) {
        const float *c = cos + i * dim, *s = sin + i * dim;
        for (int64_t h = 0; h < heads; ++h)
            rope_row(qi + i * qs + h * dim, c, s, dim, q + (i * heads + h) * dim);
        for (int64_t g = 0; g < kv_heads; ++g) {
            const int64_t at = ((rows[i] * kv_heads + g) * cols + lens[i] - 1) * dim;
            rope_row(ki + i * ks + g * dim, c, s, dim, k + at);
            const float *src = vi + i * vs + g * dim;
            for (int64_t j = 0; j < dim; ++j) v[at + j] = src[j];
        }
    }
    decode_attention_f32(q, k, v, rows, lens, out, n, heads, kv_heads, cols, dim, scale,
                         scores, max_len);
}

/* ATen's float32 sum of x[0..size) as torch.sum over a contiguous last dimension computes
   it on the CPU (SumKernel.cpp: cascade_sum -> vectorized_inner_sum), for Vectorized<float>
   of `lanes` floats (8: see varlen_decode.ATEN_SUM_LANES; size >= lanes):
   whole vectors summed lane-wise in four interleaved rows (row_sum, ilp 4) with
   multi_row_sum's cascade, the rows then added in order, the scalar tail summed first and
   the lanes added to it one by one. Every addition below is one of ATen's, in its order. */
#define MAX_LANES 16
static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) ++bits;
    return bits;
}

static float aten_sum(const float *x, int64_t size, int64_t lanes) {
    const int64_t vecs = size / lanes, rows = vecs / 4;
    /* multi_row_sum over `rows` rows of 4 vectors */
    const int64_t lp = ceil_log2(rows) / 4 > 4 ? ceil_log2(rows) / 4 : 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    float acc[4][4][MAX_LANES];
    for (int a = 0; a < 4; ++a)
        for (int k = 0; k < 4; ++k)
            for (int64_t l = 0; l < lanes; ++l) acc[a][k][l] = 0.0f;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; ++k)
                for (int64_t l = 0; l < lanes; ++l)
                    acc[0][k][l] = acc[0][k][l] + x[(i * 4 + k) * lanes + l];
        for (int64_t j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; ++k)
                for (int64_t l = 0; l < lanes; ++l) {
                    acc[j][k][l] = acc[j][k][l] + acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * lp))) != 0) break;
        }
    }
    for (; i < rows; ++i)
        for (int k = 0; k < 4; ++k)
            for (int64_t l = 0; l < lanes; ++l)
                acc[0][k][l] = acc[0][k][l] + x[(i * 4 + k) * lanes + l];
    for (int j = 1; j < 4; ++j)
        for (int k = 0; k < 4; ++k)
            for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] = acc[0][k][l] + acc[j][k][l];
    /* row_sum: the vectors past the last whole row into the first, then the rows in order */
    for (int64_t v = rows * 4; v < vecs; ++v)
        for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] = acc[0][0][l] + x[v * lanes + l];
    for (int k = 1; k < 4; ++k)
        for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] = acc[0][0][l] + acc[0][k][l];
    float total = 0.0f;
    for (int64_t j = vecs * lanes; j < size; ++j) total = total + x[j];
    for (int64_t l = 0; l < lanes; ++l) total = total + acc[0][0][l];
    return 0.0f + total; /* the output starts at zero and the sum is added to it */
}

/* Per row of n x dim: h = a + b (b may be NULL: h = a, not stored), then LlamaRMSNorm in
   float32 as torch computes it: var = sum(h * h) / dim (mean: ATen's sum, then a true
   division), r = 1 / sqrt(var + eps) (rsqrt), x = w * (h * r). The squares are kept in
   x's row until it is written. */
void add_rms_f32(const float *a, const float *b, float *h, const float *w, float *x,
                 int64_t n, int64_t dim, float eps, int64_t lanes) {
    for (int64_t i = 0; i < n; ++i) {
        const float *hi = a + i * dim;
        if (b) {
            float *ho = h + i * dim;
            const float *bi = b + i * dim;
            for (int64_t j = 0; j < dim; ++j) ho[j] = hi[j] + bi[j];
            hi = ho;
        }
        float *xo = x + i * dim;
        for (int64_t j = 0; j < dim; ++j) xo[j] = hi[j] * hi[j];
        const float var = aten_sum(xo, dim, lanes) / (float)dim;
        const float r = 1.0f / sqrtf(var + eps);
        for (int64_t j = 0; j < dim; ++j) {
            const float t = hi[j] * r;
            xo[j] = w[j] * t;
        }
    }
}
/* SplitMix64 (relayrl.rollout.sampler._splitmix64): integer operations modulo 2^64. */
static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* The sampler's inverse-CDF draw of one token per row, as relayrl.rollout.sampler computes
   it in torch after the log_softmax: probs = exp(logp) (float32, from torch), per row
       cdf_j = sum_{k <= j} (double) probs_k        (torch.cumsum in float64: in order)
       u     = (x >> 11) * 2^-53,  x = SplitMix64(SplitMix64(seed) ^ index)
       token = #{j : !(cdf_j > u * cdf_last)}        (torch.searchsorted right=True: the same
                                                     binary search), at most vocab - 1
   and the token's logprob logp[token], widened to double (what tolist() of the float32
   gives). A greedy row (greedy[i] != 0) takes torch.argmax of its logits instead: the first
   NaN if there is one, else the first maximum (row i of the logits at logits + i * ls).
   cdf: a scratch row of vocab doubles. */
void sample_rows_f32(const float *logits, int64_t ls, const float *probs, const float *logp,
                     int64_t n, int64_t vocab, const uint64_t *seeds, const uint64_t *index,
                     const int8_t *greedy, int64_t *tokens, double *logprobs, double *cdf) {
    for (int64_t i = 0; i < n; ++i) {
        if (greedy[i]) {
            const float *x = logits + i * ls;
            int64_t best = 0;
            for (int64_t j = 1; j < vocab && x[best] == x[best]; ++j)
                if (x[j] != x[j] || x[j] > x[best]) best = j;
            tokens[i] = best;
            logprobs[i] = (double)logp[i * vocab + best];
            continue;
        }
        const float *p = probs + i * vocab;
        double acc = 0.0;
        for (int64_t j = 0; j < vocab; ++j) {
            acc = acc + (double)p[j];
            cdf[j] = acc;
        }
        const uint64_t x = splitmix64(splitmix64(seeds[i]) ^ index[i]);
        const double u = (double)(x >> 11) * (1.0 / 9007199254740992.0);
        const double v = u * cdf[vocab - 1];
        int64_t lo = 0, hi = vocab;
        while (lo < hi) {
            const int64_t mid = lo + ((hi - lo) >> 1);
            if (!(cdf[mid] > v)) lo = mid + 1;
            else hi = mid;
        }
        if (lo > vocab - 1) lo = vocab - 1;
        tokens[i] = lo;
        logprobs[i] = (double)logp[i * vocab + lo];
    }
}
