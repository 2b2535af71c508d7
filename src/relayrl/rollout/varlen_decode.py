"""Decode attention on the CPU that reads each row's own cache length, no padding, no copy.

A decode row ``i`` (one query token at position ``p_i`` of slot ``s_i``) attends to columns
``j = 0 .. p_i`` of its slot's keys/values in the arenas ``[S, Hkv, C, D]``::

    score_hj = (q_h . K[s_i, g(h), j]) * scale          g(h) = h // (H / Hkv)
    w_hj     = exp(score_hj - max_j score_hj) / sum_j exp(score_hj - max_j score_hj)
    out_h    = sum_j w_hj V[s_i, g(h), j]

SDPA on the CPU needs one rectangular ``[rows, Hkv, L, D]`` read per call: rows of a
heavy-tailed batch either attend over the longest row's columns (most of them masked) or are
split in length buckets, each a gathered copy of the cache, a mask and a call. This kernel
walks each row's ``p_i + 1`` columns straight out of the arena, with nothing built per step:
its work is the step's real context, ``sum_i (p_i + 1)``. A prompt's tokens are rows of the
same call (token ``t`` reads columns ``0 .. t``, its own keys written before attention): the
causal mask of a prefill is each row's length, so a step with admissions needs no prefill
mask and no per-prompt call.

It is C compiled once per machine with the system C compiler (``cc``, into
``$RELAYRL_CACHE_DIR`` or ``~/.cache/relayrl``, keyed by the source's and flags' hash) and
called through ``ctypes``; float32 on the CPU only. When no compiler is there, or for another
dtype or device, ``available()`` is False and the runner keeps SDPA. Per row and kv head,
its query heads two at a time (grouped-query attention: each key and value block is read
once for both, and twice the independent sums are in flight): the scores four columns at a
time (SSE2: four dot products, then a 4x4 transpose), the softmax with its own exp (Cephes'
``expf`` polynomial, vectorised; the max four lanes wide, exact in any order), the weighted
sum of values in 16-float blocks; the next rows' keys and values are prefetched (between
layers the arenas are mostly out of cache). Every float operation runs in the order the
source writes it (no fast-math, ``-ffp-contract=off``), so the SSE2 path and the plain C path
(``-DRELAYRL_SCALAR``) give the same bits, on any x86-64 (SSE2 is its baseline) whatever
its wider vector units; results agree with SDPA to float32 rounding (~1e-6 on scores of a
few units).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

SOURCE = r"""
#include <stdint.h>
#if defined(__SSE2__) && !defined(RELAYRL_SCALAR)
#include <emmintrin.h>
#define RELAYRL_SSE2 1
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
                      float *s) {
    int64_t j = 0;
#ifdef RELAYRL_SSE2
    if ((dim & 3) == 0) {
        const __m128 sc = _mm_set1_ps(scale);
        for (; j + 4 <= len; j += 4) {
            const float *k0 = kb + j * dim;
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
    for (; j < len; ++j) s[j] = dot4(q, kb + j * dim, dim) * scale;
}

/* scores_of for two query heads on the same keys (two heads of one kv group): each key
   block is loaded once for both, each head's operations are scores_of's in its order */
static void scores_of2(const float *q, const float *r, const float *kb, int64_t len,
                       int64_t dim, float scale, float *s, float *u) {
    int64_t j = 0;
#ifdef RELAYRL_SSE2
    if ((dim & 3) == 0) {
        const __m128 sc = _mm_set1_ps(scale);
        for (; j + 4 <= len; j += 4) {
            const float *k0 = kb + j * dim;
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
    for (; j < len; ++j) {
        s[j] = dot4(q, kb + j * dim, dim) * scale;
        u[j] = dot4(r, kb + j * dim, dim) * scale;
    }
}

/* s[j] = exp(s[j] - max s) / sum_j exp(s[j] - max s); the sum: lane l adds j = l (mod 4) in
   order (the last len mod 4 terms too), then (l0 + l1) + (l2 + l3) */
static void softmax(float *s, int64_t len) {
    float m = s[0];
    int64_t j = 1;
#ifdef RELAYRL_SSE2
    if (len >= 8) { /* the maximum is exact in any order: four lanes, then across them */
        __m128 mv = _mm_loadu_ps(s);
        for (j = 4; j + 4 <= len; j += 4) mv = _mm_max_ps(mv, _mm_loadu_ps(s + j));
        float lanes[4];
        _mm_storeu_ps(lanes, mv);
        for (int t = 0; t < 4; ++t) m = lanes[t] > m ? lanes[t] : m;
    }
#endif
    for (; j < len; ++j) m = s[j] > m ? s[j] : m;
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    j = 0;
#ifdef RELAYRL_SSE2
    {
        const __m128 mv = _mm_set1_ps(m), lo = _mm_set1_ps(EXP_LO);
        const __m128 log2e = _mm_set1_ps(LOG2E), half = _mm_set1_ps(0.5f);
        const __m128 one = _mm_set1_ps(1.0f);
        __m128 acc = _mm_setzero_ps();
        for (; j + 4 <= len; j += 4) {
            const __m128 x = _mm_sub_ps(_mm_loadu_ps(s + j), mv);
            const __m128 y = _mm_add_ps(_mm_mul_ps(x, log2e), half);
            __m128 fn = _mm_cvtepi32_ps(_mm_cvttps_epi32(y));
            fn = _mm_sub_ps(fn, _mm_and_ps(_mm_cmpgt_ps(fn, y), one));
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
            q = _mm_add_ps(q, one);
            const __m128i n = _mm_add_epi32(_mm_cvttps_epi32(fn), _mm_set1_epi32(127));
            __m128 e = _mm_mul_ps(q, _mm_castsi128_ps(_mm_slli_epi32(n, 23)));
            e = _mm_andnot_ps(_mm_cmplt_ps(x, lo), e);
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
                          int64_t dim, float *o, float *p) {
    int64_t d = 0;
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

#define AHEAD 2  /* rows */

/* q, out: [n, H, D]; k, v: [S, Hkv, C, D]; rows, lens: [n], max_len >= every len;
   scores: 2 * max_len floats. Query head h reads kv head h / (H / Hkv). */
void decode_attention_f32(const float *q, const float *k, const float *v,
                          const int64_t *rows, const int64_t *lens, float *out,
                          int64_t n, int64_t heads, int64_t kv_heads, int64_t cols,
                          int64_t dim, float scale, float *scores, int64_t max_len) {
    const int64_t group = heads / kv_heads;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t len = lens[i];
        /* the next rows' keys and values on their way while this row runs (the arenas are
           mostly out of cache between layers; a row's own columns are one short stream) */
        for (int64_t a = i == 0 ? 0 : i + AHEAD; a <= i + AHEAD && a < n; ++a)
            for (int64_t g = 0; g < kv_heads; ++g) {
                const int64_t nb = (rows[a] * kv_heads + g) * cols * dim;
                for (int64_t c = 0; c < lens[a] * dim; c += 16) {
                    __builtin_prefetch(k + nb + c);
                    __builtin_prefetch(v + nb + c);
                }
            }
        for (int64_t g = 0; g < kv_heads; ++g) {
            const int64_t base = (rows[i] * kv_heads + g) * cols * dim;
            int64_t h = g * group;
            /* two query heads of the group per pass over its keys and values: each block
               read once for both, twice the independent sums in flight */
            for (; h + 2 <= (g + 1) * group; h += 2) {
                const float *qh = q + (i * heads + h) * dim;
                float *second = scores + max_len;
                scores_of2(qh, qh + dim, k + base, len, dim, scale, scores, second);
                softmax(scores, len);
                softmax(second, len);
                weighted_sum2(scores, second, v + base, len, dim, out + (i * heads + h) * dim,
                              out + (i * heads + h + 1) * dim);
            }
            if (h < (g + 1) * group) { /* an odd group's last head */
                const float *qh = q + (i * heads + h) * dim;
                scores_of(qh, k + base, len, dim, scale, scores);
                softmax(scores, len);
                weighted_sum(scores, v + base, len, dim, out + (i * heads + h) * dim);
            }
        }
    }
}
"""

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_ERROR: str | None = None


def _cache_dir() -> Path:
    root = os.environ.get("RELAYRL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "relayrl"
    )
    return Path(root) / "kernels"


FLAGS = ("-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
"""No reassociation, no fused multiply-adds: the source's order is the order that runs."""


def _build(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile ``SOURCE`` once per source and flags (atomic rename: concurrent builders never
    see a partial file). ``defines``, e.g. ``("-DRELAYRL_SCALAR",)``: the plain C path."""
    flags = FLAGS + tuple(defines)
    digest = hashlib.sha256((SOURCE + " ".join(flags)).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib = out_dir / f"varlen_decode_{digest}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = Path(tmp) / "varlen_decode.c"
            src.write_text(SOURCE)
            part = Path(tmp) / lib.name
            cmd = [cc, *flags, str(src), "-o", str(part)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:500]}")
            os.replace(part, lib)
    handle = ctypes.CDLL(str(lib))
    fn = handle.decode_attention_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr] * 6 + [i64] * 5 + [ctypes.c_float, ptr, i64]
    fn.restype = None
    return handle


def _library() -> ctypes.CDLL | None:
    global _LIB, _TRIED, _ERROR
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                if os.environ.get("RELAYRL_VARLEN_DECODE", "1") == "0":
                    _ERROR = "turned off (RELAYRL_VARLEN_DECODE=0)"
                else:
                    try:
                        _LIB = _build()
                    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                        _ERROR = f"{type(e).__name__}: {e}"
                        logging.getLogger(__name__).warning(
                            "varlen decode attention unavailable, decode rows use SDPA "
                            "(slower on the CPU): %s",
                            _ERROR,
                        )
                _TRIED = True
    return _LIB


def available() -> bool:
    """Whether the compiled kernel is there (built on first call)."""
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True or not asked yet)."""
    _library()
    return _ERROR


def decode_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    rows: Tensor,
    lens: Tensor,
    max_len: int,
    scale: float,
    library: ctypes.CDLL | None = None,
) -> Tensor:
    """Each decode row on its own slot's first ``lens[i]`` cache columns.

    ``query`` ``[n, H, 1, D]`` float32; ``keys``/``values`` the layer's arenas ``[S, Hkv, C,
    D]`` (contiguous); ``rows``/``lens`` int64 ``[n]`` (arena row, columns to read, each
    ``<= C``); ``max_len = max(lens)``. The values of ``rows`` and ``lens`` are trusted (in
    ``[0, S)`` and ``[1, max_len]``: the runner builds them from its slot table; checking them
    here would read the tensors back to the host every layer). Returns ``[n, 1, H, D]`` like
    ``sdpa_attention_forward``. ``library``: another build of ``SOURCE`` (``_build``; tests
    run the plain C path through it).
    """
    lib = library or _library()
    assert lib is not None, unavailable_reason()
    n, heads, _, dim = query.shape
    slots, kv_heads, cols, kdim = keys.shape
    if kdim != dim or values.shape != keys.shape or heads % kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit the arena {tuple(keys.shape)}")
    if max_len > cols:
        raise ValueError(f"rows read {max_len} columns, the arena holds {cols}")
    # The C code trusts its pointers: everything on the CPU, of its dtype, laid out as said.
    for name, t, dtype in (
        ("query", query, torch.float32),
        ("keys", keys, torch.float32),
        ("values", values, torch.float32),
        ("rows", rows, torch.int64),
        ("lens", lens, torch.int64),
    ):
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} on the CPU, got {t.dtype} on {t.device}")
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("the arenas must be contiguous")
    if rows.shape != (n,) or lens.shape != (n,):
        raise ValueError(f"rows/lens must be [{n}], got {tuple(rows.shape)}/{tuple(lens.shape)}")
    q = query.contiguous()
    rows, lens = rows.contiguous(), lens.contiguous()
    # explicit device: a default device set by the caller (e.g. meta) must not apply here
    out = torch.empty(n, heads, dim, dtype=torch.float32, device="cpu")
    width = max(1, max_len)
    scores = torch.empty(2 * width, dtype=torch.float32, device="cpu")  # two heads' scores
    lib.decode_attention_f32(
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        rows.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        n,
        heads,
        kv_heads,
        cols,
        dim,
        float(scale),
        scores.data_ptr(),
        width,
    )
    return out.view(n, 1, heads, dim)
